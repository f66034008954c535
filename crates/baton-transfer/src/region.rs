//! A KV region: bytes laid out as a [`TensorDescriptor`] says, in a memfd another process on the
//! host can map. It is either created here (raw bytes of any dtype: the benchmark's f16 KV) or
//! a second mapping of an existing one — the engine's [`baton_kv::KvArena`] through its
//! [`ArenaHandle`], or a peer's region through a [`ShmHandle`].
//!
//! Several threads and processes touch a region at once (the engine writes blocks, a KV server
//! thread reads others, a peer copies out of its mapping), so it hands out no references that
//! outlive a call: bytes move in and out through [`Region::read`], [`Region::write`] and
//! closures. The transfer protocol keeps writers off the bytes being transferred (leases).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;

use baton_kv::{ArenaHandle, ByteRange, TensorDescriptor};
use memmap2::{MmapOptions, MmapRaw};

use crate::location::ShmHandle;
use crate::{Result, TransferError};

/// How a mapping of someone else's region may be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Copy out only (pull from a peer).
    ReadOnly,
    /// Copy in too (push into a peer, or a decode side receiving into its own arena).
    ReadWrite,
}

/// A mapped KV region (see the module docs).
#[derive(Debug)]
pub struct Region {
    map: MmapRaw,
    /// The memfd, when this process can hand out a handle to it.
    file: Option<File>,
    writable: bool,
    descriptor: TensorDescriptor,
}

impl Region {
    /// A new zeroed region in a memfd, large enough for `descriptor` (base included).
    pub fn create(descriptor: TensorDescriptor) -> io::Result<Self> {
        let len = descriptor.base + descriptor.num_bytes();
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "an empty region cannot be mapped"));
        }
        let fd: OwnedFd = rustix::fs::memfd_create("baton-transfer-region", rustix::fs::MemfdFlags::CLOEXEC)?;
        let file = File::from(fd);
        file.set_len(len as u64)?;
        let map = MmapOptions::new().len(len).map_raw(&file)?;
        Ok(Self { map, file: Some(file), writable: true, descriptor })
    }

    /// A second mapping of a [`baton_kv::KvArena`] (this process's or a peer's on this host).
    pub fn from_arena(handle: &ArenaHandle, access: Access) -> io::Result<Self> {
        let shm = ShmHandle { pid: handle.pid, fd: handle.fd, len: handle.len as u64 };
        Self::open(&shm, handle.descriptor.clone(), access)
    }

    /// Maps the region `handle` names, laid out as `descriptor`.
    pub fn open(handle: &ShmHandle, descriptor: TensorDescriptor, access: Access) -> io::Result<Self> {
        let path = PathBuf::from(format!("/proc/{}/fd/{}", handle.pid, handle.fd));
        let file = OpenOptions::new().read(true).write(access == Access::ReadWrite).open(&path)?;
        Self::map(file, handle.len, descriptor, access)
    }

    /// Maps the region behind `fd` (a memfd another process handed over, see
    /// [`crate::share`]), `len` bytes laid out as `descriptor`.
    pub fn from_fd(fd: OwnedFd, len: u64, descriptor: TensorDescriptor, access: Access) -> io::Result<Self> {
        Self::map(File::from(fd), len, descriptor, access)
    }

    fn map(file: File, len: u64, descriptor: TensorDescriptor, access: Access) -> io::Result<Self> {
        let writable = access == Access::ReadWrite;
        let len = usize::try_from(len).map_err(|_| io::Error::other("region too large"))?;
        if (file.metadata()?.len() as usize) < len || descriptor.base + descriptor.num_bytes() > len {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "region is shorter than its descriptor"));
        }
        let options = {
            let mut o = MmapOptions::new();
            o.len(len);
            o
        };
        let map = if writable { options.map_raw(&file)? } else { options.map_raw_read_only(&file)? };
        // Keep the file so this process can re-share the region (a handle of our own fd).
        Ok(Self { map, file: Some(file), writable, descriptor })
    }

    /// A descriptor of the region's memfd of this process's own, to hand to a peer
    /// ([`crate::share::FdShare`]); `None` for a region without one.
    pub fn share_fd(&self) -> Option<io::Result<OwnedFd>> {
        self.file.as_ref().map(|f| f.try_clone().map(OwnedFd::from))
    }

    /// Bytes in the region.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the region has no bytes (never true: empty regions are refused).
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// The layout.
    pub fn descriptor(&self) -> &TensorDescriptor {
        &self.descriptor
    }

    /// Whether this mapping may be written.
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    /// The handle a peer on this host maps the region with.
    pub fn shm_handle(&self) -> Option<ShmHandle> {
        self.file.as_ref().map(|f| ShmHandle { pid: std::process::id(), fd: f.as_raw_fd(), len: self.len() as u64 })
    }

    /// Checks `range` lies within the region.
    pub fn check(&self, range: ByteRange) -> Result<()> {
        match range.offset.checked_add(range.len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(TransferError::OutOfBounds { offset: range.offset, len: range.len, region_len: self.len() }),
        }
    }

    /// Copies `range` of the region into `out` (`out.len() == range.len`).
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.with_bytes(ByteRange { offset, len: out.len() }, |b| out.copy_from_slice(b))
    }

    /// Copies `data` into the region at `offset`.
    #[allow(unsafe_code)]
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        let dst = self.writable_ptr(ByteRange { offset, len: data.len() })?;
        // SAFETY: `dst` is `data.len()` writable bytes of the mapping (checked above), which
        // lives as long as `self`; a raw copy creates no reference to the destination, so two
        // calls on the same bytes race on their values (any bit pattern is a valid `u8`) but
        // alias nothing. `data` is the caller's own slice: it cannot be the mapping mutably.
        unsafe { std::ptr::copy(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    /// Copies `src` of `from` onto `dst` of this region (the shared-memory transport's call).
    #[allow(unsafe_code)]
    pub fn copy_from(&self, from: &Region, src: ByteRange, dst: ByteRange) -> Result<()> {
        if src.len != dst.len {
            return Err(TransferError::Protocol(format!("copy of {} bytes into {}", src.len, dst.len)));
        }
        from.check(src)?;
        let to = self.writable_ptr(dst)?;
        // SAFETY: both ranges lie within their mappings (checked); `copy` (a memmove) is right
        // even when the two mappings are of the same memory and the ranges overlap; raw
        // pointers alias nothing.
        unsafe { std::ptr::copy(from.map.as_ptr().add(src.offset), to, src.len) };
        Ok(())
    }

    /// A pointer to the first byte of `range`, checked to lie within a writable mapping.
    #[allow(unsafe_code)]
    fn writable_ptr(&self, range: ByteRange) -> Result<*mut u8> {
        if !self.writable {
            return Err(TransferError::Unavailable("the region is mapped read-only"));
        }
        self.check(range)?;
        // SAFETY: `range.offset` is within the mapping (checked).
        Ok(unsafe { self.map.as_mut_ptr().add(range.offset) })
    }

    /// Runs `f` over the bytes of `range`.
    #[allow(unsafe_code)]
    pub fn with_bytes<R>(&self, range: ByteRange, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        self.check(range)?;
        // SAFETY: the range is within the mapping, which lives as long as `self`; the slice does
        // not escape `f`. Other threads or processes may write these bytes concurrently only if
        // the protocol is broken (a lease keeps the owner off blocks under transfer); even then
        // the reader sees arbitrary bytes, never invalid Rust values (`u8` has no invalid values),
        // and a COMPLETE refused after a lease ran out makes the caller discard them.
        let bytes = unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(range.offset), range.len) };
        Ok(f(bytes))
    }

    /// Runs `f` over the bytes of several ranges at once (a vectored socket write).
    #[allow(unsafe_code)]
    pub fn with_many<R>(&self, ranges: &[ByteRange], f: impl FnOnce(&[&[u8]]) -> R) -> Result<R> {
        for &r in ranges {
            self.check(r)?;
        }
        // SAFETY: as in `with_bytes`, for each range; the slices do not escape `f`.
        let slices: Vec<&[u8]> = ranges
            .iter()
            .map(|r| unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(r.offset), r.len) })
            .collect();
        Ok(f(&slices))
    }

    /// Runs `f` over the bytes of `range`, mutably (a writable mapping only): for a reader
    /// that fills them in place (a socket's `read_exact`).
    ///
    /// # Safety
    ///
    /// The region is shared (`&self`), so nothing stops two calls from handing out the same
    /// bytes twice. The caller must hold `range` exclusively while `f` runs: no other call of
    /// this function, and no slice from [`Self::with_bytes`] or [`Self::with_many`], on
    /// overlapping bytes in this process. The transfer code holds it by the protocol: the
    /// destination blocks of a transfer are reserved for that transfer alone, and one thread
    /// serves it. (Another process writing the same shared memory can only be a broken
    /// protocol; it yields wrong bytes, which `u8` accepts, never an invalid value.)
    #[allow(unsafe_code)]
    pub unsafe fn with_bytes_mut<R>(&self, range: ByteRange, f: impl FnOnce(&mut [u8]) -> R) -> Result<R> {
        let start = self.writable_ptr(range)?;
        // SAFETY: `range` is within the writable mapping (checked), which outlives `f`; the
        // caller holds it exclusively (this function's contract), so this is its one reference.
        let bytes = unsafe { std::slice::from_raw_parts_mut(start, range.len) };
        Ok(f(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_kv::{BlockId, KvArena, KvGeometry, KvLayout, KvPart};

    #[test]
    fn second_mapping_of_an_arena_sees_its_bytes() {
        let g = KvGeometry::new(2, 1, 4, 2);
        let mut arena = KvArena::new_shared(g, KvLayout::LayerMajor, 4).expect("memfd");
        arena.token_mut(1, KvPart::Value, BlockId(2), 1).fill(3.5);
        let handle = arena.handle().expect("shared");
        let region = Region::from_arena(&handle, Access::ReadWrite).expect("map");
        let at = arena.descriptor().offset(1, KvPart::Value, 2, 1, 0) * 4;
        let mut b = [0u8; 4];
        region.read(at, &mut b).expect("read");
        assert_eq!(f32::from_le_bytes(b), 3.5);
        region.write(at, &7.0f32.to_le_bytes()).expect("write");
        assert_eq!(arena.block(1, KvPart::Value, BlockId(2))[4], 7.0);
        assert!(region.read(region.len() - 2, &mut b).is_err(), "out of bounds");
        let ro = Region::from_arena(&handle, Access::ReadOnly).expect("map");
        assert!(ro.write(0, &[1]).is_err(), "read-only mapping refuses writes");
    }
}
