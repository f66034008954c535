//! KV arenas in device memory, as the transfer plane sees them: something a peer on the same
//! host opens once from a handle, then copies runs into or out of, device to device (KVDirect's
//! and Mooncake's GPU-to-GPU path; CUDA VMM or IPC on one host).
//!
//! The transfer plane knows only these two traits. A GPU backend implements them (the arena is
//! the engine's device KV); [`StandInArena`] implements them over host memory — a region's
//! memfd, handed to the peer as a CUDA VMM arena's descriptor is, poses as the device arena —
//! so the device path's protocol (the choice at CONNECT, the descriptor handed over, the
//! planned copies, push and pull, leases, an exporter dying mid-copy) runs and is tested where
//! there is no GPU. Offsets are the side's [`TensorDescriptor`]'s, `base` included: a device
//! arena is laid out exactly as its side's host region.

use std::sync::Arc;

use crate::location::{DeviceHandle, DeviceHandleKind, Location};
use crate::plan::RangeCopy;
use crate::region::{Access, Region};
use crate::share::FdShare;
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
    /// Whether the peer's memory stays this link's to touch after the peer's process dies (an
    /// imported CUDA VMM allocation, a mapped memfd: the link holds the memory itself). When
    /// not (legacy CUDA IPC), a copy after the exporter died is undefined, and the link must be
    /// guarded by a watch of the exporter ([`crate::transport::DeviceTransport`]). No by
    /// default.
    fn outlives_exporter(&self) -> bool {
        false
    }
}

/// Host memory standing in for a device arena: the side's region itself, its memfd handed to
/// a peer as a descriptor ([`FdShare`], under [`DeviceHandleKind::StandIn`]) the way a CUDA
/// VMM arena is. Copies are `memcpy`s between the two mappings, so a KV hand-off over it gives
/// exactly the bytes the device path would.
#[derive(Debug)]
pub struct StandInArena {
    region: Arc<Region>,
    location: Location,
    share: FdShare,
}

impl StandInArena {
    /// `region` (this side's arena, mapped writable) posing as device `ordinal`.
    pub fn new(region: Arc<Region>, ordinal: u32) -> Result<Self> {
        let fd = region
            .share_fd()
            .ok_or(TransferError::Unavailable("a stand-in device arena needs a region with a memfd"))?
            .map_err(TransferError::io("duplicating the stand-in arena's memfd"))?;
        let share = FdShare::serve(fd).map_err(TransferError::io("sharing the stand-in arena"))?;
        let mut uuid = [0u8; 16];
        uuid[..4].copy_from_slice(b"STND");
        uuid[4..8].copy_from_slice(&ordinal.to_le_bytes());
        Ok(Self { region, location: Location::Device { ordinal, uuid }, share })
    }
}

impl DeviceArena for StandInArena {
    fn location(&self) -> Location {
        self.location
    }

    fn handle(&self) -> DeviceHandle {
        DeviceHandle {
            kind: DeviceHandleKind::StandIn,
            bytes: self.share.name().to_vec(),
            len: self.region.len() as u64,
            pid: std::process::id(),
        }
    }

    fn open(&self, handle: &DeviceHandle, descriptor: &TensorDescriptor) -> Result<Box<dyn DeviceLink>> {
        if handle.kind != DeviceHandleKind::StandIn {
            return Err(TransferError::Protocol(format!("a {:?} device handle for a stand-in arena", handle.kind)));
        }
        let fd =
            crate::share::fetch(&handle.bytes).map_err(TransferError::io("receiving the peer's stand-in arena"))?;
        let peer = Region::from_fd(fd, handle.len, descriptor.clone(), Access::ReadWrite)
            .map_err(TransferError::io("mapping the peer's stand-in device arena"))?;
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

    /// The mapping holds the memfd's pages whatever becomes of its exporter.
    fn outlives_exporter(&self) -> bool {
        true
    }
}
