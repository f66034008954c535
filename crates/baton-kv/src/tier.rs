//! Memory tiers, addresses and the disk tier's block file.
//!
//! Tiers are ordered from fastest to slowest: device (the engine's working arena), host DRAM,
//! disk. An address names an instance, a tier and a block slot of that tier, as MemServe's
//! addresses encode the instance id.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::{BlockId, ByteRange};

/// Identifies one instance (one engine process or one worker) in the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct InstanceId(pub u32);

impl std::fmt::Display for InstanceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "instance#{}", self.0)
    }
}

/// Where a block lives, fastest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// The engine's working arena (GPU HBM on a GPU host; RAM here).
    Device = 0,
    /// Host DRAM pool of historical KV.
    Host = 1,
    /// Block files on local disk (SSD).
    Disk = 2,
}

impl Tier {
    /// Every tier, fastest first.
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];

    /// Position in [`Tier::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
        })
    }
}

/// A block slot within one instance: its tier and its id in that tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Loc {
    /// The tier.
    pub tier: Tier,
    /// The slot within the tier.
    pub block: BlockId,
}

/// A block address in the cluster: instance, tier and block (MemServe: "each address encodes
/// instance ID").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KvAddr {
    /// The instance holding the block.
    pub instance: InstanceId,
    /// Tier and slot.
    pub loc: Loc,
}

impl KvAddr {
    /// Packs the address into 64 bits: instance (24 bits), tier (8 bits), block (32 bits).
    pub fn to_u64(self) -> u64 {
        (u64::from(self.instance.0 & 0xff_ffff) << 40) | ((self.loc.tier as u64) << 32) | u64::from(self.loc.block.0)
    }

    /// Unpacks [`to_u64`](Self::to_u64); `None` for an unknown tier.
    pub fn from_u64(v: u64) -> Option<Self> {
        let tier = *Tier::ALL.get(((v >> 32) & 0xff) as usize)?;
        Some(Self { instance: InstanceId((v >> 40) as u32), loc: Loc { tier, block: BlockId(v as u32) } })
    }
}

impl std::fmt::Display for KvAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}/{}", self.instance, self.loc.tier, self.loc.block)
    }
}

/// The disk tier: one file of fixed-size block slots, read and written with positioned I/O.
/// The file is removed when the store is dropped.
#[derive(Debug)]
pub struct DiskStore {
    file: File,
    path: PathBuf,
    block_bytes: usize,
}

impl DiskStore {
    /// Creates (truncating) `dir/name` sized for `blocks` slots of `block_bytes` each.
    pub fn create(dir: &Path, name: &str, blocks: usize, block_bytes: usize) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join(name);
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path)?;
        file.set_len((blocks * block_bytes) as u64)?;
        Ok(Self { file, path, block_bytes })
    }

    /// The block file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes per slot.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Writes a block gathered from `ranges` of `src` into slot `block`, in range order.
    pub fn write_block(&self, block: BlockId, src: &[u8], ranges: &[ByteRange]) -> io::Result<()> {
        let mut at = (block.index() * self.block_bytes) as u64;
        for r in ranges {
            self.file.write_all_at(&src[r.offset..r.end()], at)?;
            at += r.len as u64;
        }
        Ok(())
    }

    /// Reads slot `block` and scatters it over `ranges` of `dst`, in range order.
    pub fn read_block(&self, block: BlockId, dst: &mut [u8], ranges: &[ByteRange]) -> io::Result<()> {
        let mut at = (block.index() * self.block_bytes) as u64;
        for r in ranges {
            self.file.read_exact_at(&mut dst[r.offset..r.end()], at)?;
            at += r.len as u64;
        }
        Ok(())
    }
}

impl Drop for DiskStore {
    fn drop(&mut self) {
        // Best effort: a leftover file is harmless and is truncated on the next create.
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_packs_instance_tier_and_block() {
        let a = KvAddr { instance: InstanceId(7), loc: Loc { tier: Tier::Host, block: BlockId(123_456) } };
        assert_eq!(KvAddr::from_u64(a.to_u64()), Some(a));
        assert_eq!(KvAddr::from_u64(3 << 32), None);
    }
}
