//! An engine's KV state on its model's device, beside the pool's arena.

use std::sync::Arc;

use baton_kv::{BlockId, KvArena};

use crate::backend::{HostKv, KvState};
use crate::error::Result;

/// An engine's KV state on its model's device: its backend's [`KvState`] (nothing on the CPU;
/// on the stand-in device, the arena offered to peers as a device arena; on a GPU, the arena's
/// copy in device memory and the engine's stream and workspace), with counts of what the
/// engine marked. Made by [`crate::Model::device_kv`], one per engine (per arena).
///
/// On a GPU today a block's two copies can each be the newer one: the host's, when someone
/// other than the forward pass wrote it (KV received into the host arena, a swap-in:
/// [`invalidate`]); the device's, when KV arrived device to device from a peer's GPU
/// ([`arrived_on_device`]). A step uploads what it reads that the host has newer; [`settle`]
/// makes the two agree before anyone else reads the host's (the prefix cache, a tier, a peer
/// pulling over shared memory or TCP) or a peer's device copies out of the device's. Where the
/// arena is the device's only copy (the CPU, the stand-in) each of these is a no-op that is
/// only counted.
///
/// [`invalidate`]: DeviceKv::invalidate
/// [`arrived_on_device`]: DeviceKv::arrived_on_device
/// [`settle`]: DeviceKv::settle
#[derive(Debug)]
pub struct DeviceKv {
    state: Box<dyn KvState>,
    /// Blocks marked stale so far, on any backend (what a test of the caller can count).
    invalidated: u64,
    /// Blocks marked as arrived on the device so far, on any backend.
    arrived: u64,
    /// Blocks handed to [`settle`](DeviceKv::settle) so far, on any backend.
    settled: u64,
}

impl Default for DeviceKv {
    /// The state of an engine with no device beside the host (an emulated engine's).
    fn default() -> Self {
        Self::new(Box::new(HostKv))
    }
}

impl DeviceKv {
    pub(crate) fn new(state: Box<dyn KvState>) -> Self {
        Self { state, invalidated: 0, arrived: 0, settled: 0 }
    }

    /// The backend's own state, for its forward pass.
    pub(crate) fn state_mut(&mut self) -> &mut dyn KvState {
        self.state.as_mut()
    }

    /// Tells the device that the host bytes of `blocks` were written by someone else than the
    /// forward pass (KV received from a peer, copied back from a slower tier): their device
    /// copy is refreshed before a step reads them.
    pub fn invalidate(&mut self, blocks: &[BlockId]) {
        self.invalidated += blocks.len() as u64;
        self.state.invalidate(blocks);
    }

    /// Tells the device that `blocks` arrived in its arena device to device (a peer's GPU wrote
    /// them): the device copy is the newer one, and the host's is refreshed by
    /// [`settle`](Self::settle).
    pub fn arrived_on_device(&mut self, blocks: &[BlockId]) {
        self.arrived += blocks.len() as u64;
        self.state.arrived_on_device(blocks);
    }

    /// Makes both copies of `blocks` agree, copying each block whichever way it is newer, before
    /// others read them: the host's for the prefix cache, a tier or a peer over shared memory or
    /// TCP, the device's for a peer copying device to device. Returns the blocks copied (none
    /// where the arena is the only copy).
    pub fn settle(&mut self, blocks: &[BlockId], arena: &mut KvArena) -> Result<usize> {
        self.settled += blocks.len() as u64;
        self.state.settle(blocks, arena)
    }

    /// This engine's device arena as the transfer plane opens it (a handle a peer on this host
    /// maps, copies device to device): `None` on the CPU, or where the device arena is not laid
    /// out as the host's (a host arena that is not block-major).
    pub fn device_arena(&self, arena: &KvArena) -> Option<Result<Arc<dyn baton_transfer::DeviceArena>>> {
        self.state.device_arena(arena)
    }

    /// Blocks marked stale since this state was made (counted on every backend: the engine's
    /// marking is tested without a GPU).
    pub fn invalidated_blocks(&self) -> u64 {
        self.invalidated
    }

    /// Blocks marked as arrived on the device since this state was made.
    pub fn arrived_blocks(&self) -> u64 {
        self.arrived
    }

    /// Blocks handed to [`settle`](Self::settle) since this state was made.
    pub fn settled_blocks(&self) -> u64 {
        self.settled
    }

    /// Device memory this engine's state takes: (KV arena, workspace) bytes; zeros where the
    /// device is the host's memory.
    pub fn device_bytes(&self) -> (usize, usize) {
        self.state.device_bytes()
    }
}
