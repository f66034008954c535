//! KV arenas in device memory, as the transfer plane sees them: something a peer on the same
//! host opens once from a handle, then copies runs into or out of, device to device (KVDirect's
//! and Mooncake's GPU-to-GPU path; CUDA IPC on one host).
//!
//! The transfer plane knows only these two traits. A GPU backend implements them (the arena is
//! the engine's device KV); [`StandInArena`] implements them over host memory — a region's
//! shared-memory mapping poses as the device arena — so the device path's protocol (the choice
//! at CONNECT, the planned copies, push and pull, leases) runs and is tested where there is no
//! GPU. Offsets are the side's [`TensorDescriptor`]'s, `base` included: a device arena is laid
//! out exactly as its side's host region.

use std::sync::Arc;

use crate::location::{DeviceHandle, DeviceHandleKind, Location, ShmHandle};
use crate::plan::RangeCopy;
use crate::region::{Access, Region};
use crate::{Result, TransferError};
use baton_kv::TensorDescriptor;

/// This side's KV arena in device memory.
pub trait DeviceArena: Send + Sync + std::fmt::Debug {
    /// The device it is on.
    fn location(&self) -> Location;
    /// Its handle, for a peer on this host to open.
    fn handle(&self) -> DeviceHandle;
    /// Opens a peer's arena (laid out as `descriptor`) from the handle it sent, for copies
    /// between it and this one. Called once per peer; what it maps stays mapped until the
    /// returned link drops.
    fn open(&self, handle: &DeviceHandle, descriptor: &TensorDescriptor) -> Result<Box<dyn DeviceLink>>;
    /// Copies `buf.len()` bytes at `offset` of the arena to the host (checks and benchmarks).
    fn read_back(&self, offset: usize, buf: &mut [u8]) -> Result<()>;
}

/// An open link between this side's device arena and a peer's.
pub trait DeviceLink: Send + Sync + std::fmt::Debug {
    /// Copies each run from the peer's arena (`src`) into ours (`dst`), in order; returns once
    /// every byte is in place.
    fn pull(&self, copies: &[RangeCopy]) -> Result<()>;
    /// Copies each run from our arena (`src`) into the peer's (`dst`), in order; returns once
    /// every byte is in place.
    fn push(&self, copies: &[RangeCopy]) -> Result<()>;
}

/// Host memory standing in for a device arena: the side's region itself, offered by its
/// shared-memory handle under [`DeviceHandleKind::StandIn`]. Copies are `memcpy`s between the
/// two mappings, so a KV hand-off over it gives exactly the bytes the device path would.
#[derive(Debug)]
pub struct StandInArena {
    region: Arc<Region>,
    location: Location,
}

impl StandInArena {
    /// `region` (this side's arena, mapped writable) posing as device `ordinal`.
    pub fn new(region: Arc<Region>, ordinal: u32) -> Result<Self> {
        if region.shm_handle().is_none() {
            return Err(TransferError::Unavailable("a stand-in device arena needs a region with a handle"));
        }
        let mut uuid = [0u8; 16];
        uuid[..4].copy_from_slice(b"STND");
        uuid[4..8].copy_from_slice(&ordinal.to_le_bytes());
        Ok(Self { region, location: Location::Device { ordinal, uuid } })
    }
}

impl DeviceArena for StandInArena {
    fn location(&self) -> Location {
        self.location
    }

    fn handle(&self) -> DeviceHandle {
        let h = self.region.shm_handle().expect("checked at construction");
        let mut bytes = Vec::with_capacity(16);
        bytes.extend_from_slice(&h.pid.to_le_bytes());
        bytes.extend_from_slice(&h.fd.to_le_bytes());
        bytes.extend_from_slice(&h.len.to_le_bytes());
        DeviceHandle { kind: DeviceHandleKind::StandIn, bytes, len: h.len, pid: h.pid }
    }

    fn open(&self, handle: &DeviceHandle, descriptor: &TensorDescriptor) -> Result<Box<dyn DeviceLink>> {
        let bad = || TransferError::Protocol(format!("a stand-in device handle of {} bytes", handle.bytes.len()));
        if handle.kind != DeviceHandleKind::StandIn || handle.bytes.len() != 16 {
            return Err(bad());
        }
        let word = |at: usize| -> [u8; 4] { handle.bytes[at..at + 4].try_into().expect("length checked") };
        let shm = ShmHandle {
            pid: u32::from_le_bytes(word(0)),
            fd: i32::from_le_bytes(word(4)),
            len: u64::from_le_bytes(handle.bytes[8..16].try_into().map_err(|_| bad())?),
        };
        let peer = Region::open(&shm, descriptor.clone(), Access::ReadWrite)
            .map_err(TransferError::io("opening the peer's stand-in device arena"))?;
        Ok(Box::new(StandInLink { ours: Arc::clone(&self.region), theirs: peer }))
    }

    fn read_back(&self, offset: usize, buf: &mut [u8]) -> Result<()> {
        self.region.read(offset, buf)
    }
}

#[derive(Debug)]
struct StandInLink {
    ours: Arc<Region>,
    theirs: Region,
}

impl DeviceLink for StandInLink {
    fn pull(&self, copies: &[RangeCopy]) -> Result<()> {
        copies.iter().try_for_each(|c| self.ours.copy_from(&self.theirs, c.src, c.dst))
    }

    fn push(&self, copies: &[RangeCopy]) -> Result<()> {
        copies.iter().try_for_each(|c| self.theirs.copy_from(&self.ours, c.src, c.dst))
    }
}
