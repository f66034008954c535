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
///
/// The file's name is removed as soon as it is made: the open file keeps its space while the
/// store lives, and the file system takes it back when the last descriptor closes, however the
/// process ends (a worker killed with SIGKILL leaves nothing in the directory). The space is
/// reserved up front (`fallocate`), so a directory without room is an error at start, not a
/// failed write later.
#[derive(Debug)]
pub struct DiskStore {
    file: File,
    path: PathBuf,
    block_bytes: usize,
}

impl DiskStore {
    /// Makes a block file in `dir` (created if missing) for `blocks` slots of `block_bytes`
    /// each, under `name` until it is unlinked a moment later.
    pub fn create(dir: &Path, name: &str, blocks: usize, block_bytes: usize) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join(name);
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path)?;
        std::fs::remove_file(&path)?;
        let len = blocks.checked_mul(block_bytes).map(|n| n as u64);
        let reserved = match len {
            None => Err(io::Error::new(io::ErrorKind::InvalidInput, "the size overflows")),
            Some(len) => match rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, len) {
                Ok(()) => Ok(()),
                // A file system that cannot reserve (some network ones) gets a sparse file.
                Err(rustix::io::Errno::OPNOTSUPP) => file.set_len(len),
                Err(e) => Err(e.into()),
            },
        };
        reserved.map_err(|e| {
            let what = format!("{blocks} disk blocks of {block_bytes} bytes in {}", dir.display());
            io::Error::new(e.kind(), format!("reserving {what}: {e}"))
        })?;
        Ok(Self { file, path, block_bytes })
    }

    /// The same block file through a descriptor of its own (for another thread).
    pub fn try_clone(&self) -> io::Result<DiskStore> {
        Ok(Self { file: self.file.try_clone()?, path: self.path.clone(), block_bytes: self.block_bytes })
    }

    /// Where the block file was made (its name is gone: see the type's documentation).
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_disk_store_leaves_no_file_and_keeps_its_blocks() {
        let dir = std::env::temp_dir().join(format!("baton-disk-store-{}", std::process::id()));
        let store = DiskStore::create(&dir, "blocks", 4, 8).expect("store");
        assert_eq!(std::fs::read_dir(&dir).expect("dir").count(), 0, "the name is gone at once");
        let src: Vec<u8> = (0..16).collect();
        store.write_block(BlockId(3), &src, &[ByteRange { offset: 8, len: 8 }]).expect("write");
        let mut dst = vec![0u8; 8];
        store.read_block(BlockId(3), &mut dst, &[ByteRange { offset: 0, len: 8 }]).expect("read");
        assert_eq!(dst, src[8..]);
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_disk_tier_too_big_for_its_file_system_is_an_error_at_start() {
        let dir = std::env::temp_dir().join(format!("baton-disk-full-{}", std::process::id()));
        // 2^62 bytes: more than any file system here has.
        let e = DiskStore::create(&dir, "blocks", 1 << 32, 1 << 30).expect_err("no room");
        assert!(e.to_string().contains("reserving"), "{e}");
        assert_eq!(std::fs::read_dir(&dir).expect("dir").count(), 0);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn address_packs_instance_tier_and_block() {
        let a = KvAddr { instance: InstanceId(7), loc: Loc { tier: Tier::Host, block: BlockId(123_456) } };
        assert_eq!(KvAddr::from_u64(a.to_u64()), Some(a));
        assert_eq!(KvAddr::from_u64(3 << 32), None);
    }
}
