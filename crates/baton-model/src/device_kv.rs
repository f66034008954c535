//! An engine's KV state on its model's device, beside the host arena.

use std::sync::Arc;

use baton_kv::{BlockId, KvArena};

use crate::error::Result;

/// An engine's KV state on its model's device, beside the host arena: nothing for the CPU (the
/// host arena is what it computes on); for a GPU, the arena's copy in device memory and the
/// engine's stream and workspace. Made by [`crate::Model::device_kv`], one per engine (per
/// arena).
///
/// A block's two copies can each be the newer one: the host's, when someone other than the
/// forward pass wrote it (KV received into the host arena, a swap-in: [`invalidate`]); the
/// device's, when KV arrived device to device from a peer's GPU ([`arrived_on_device`]). A
/// step uploads what it reads that the host has newer; [`settle`] makes the two agree before
/// anyone else reads the host's (the prefix cache, a tier, a peer pulling over shared memory or
/// TCP) or a peer's device copies out of the device's.
///
/// [`invalidate`]: DeviceKv::invalidate
/// [`arrived_on_device`]: DeviceKv::arrived_on_device
/// [`settle`]: DeviceKv::settle
#[derive(Debug, Default)]
pub struct DeviceKv {
    #[cfg(feature = "cuda")]
    cuda: Option<crate::cuda::CudaKv>,
    /// Blocks marked stale so far, on any backend (what a test of the caller can count).
    invalidated: u64,
    /// Blocks marked as arrived on the device so far, on any backend.
    arrived: u64,
    /// Blocks handed to [`settle`](DeviceKv::settle) so far, on any backend.
    settled: u64,
}

impl DeviceKv {
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda(kv: crate::cuda::CudaKv) -> Self {
        Self { cuda: Some(kv), ..Self::default() }
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_mut(&mut self) -> Option<&mut crate::cuda::CudaKv> {
        self.cuda.as_mut()
    }

    /// Tells the device that the host bytes of `blocks` were written by someone else than the
    /// forward pass (KV received from a peer, copied back from a slower tier): their device
    /// copy is refreshed before a step reads them.
    pub fn invalidate(&mut self, blocks: &[BlockId]) {
        self.invalidated += blocks.len() as u64;
        #[cfg(feature = "cuda")]
        if let Some(c) = &mut self.cuda {
            c.invalidate(blocks);
        }
    }

    /// Tells the device that `blocks` arrived in its arena device to device (a peer's GPU wrote
    /// them): the device copy is the newer one, and the host's is refreshed by
    /// [`settle`](Self::settle).
    pub fn arrived_on_device(&mut self, blocks: &[BlockId]) {
        self.arrived += blocks.len() as u64;
        #[cfg(feature = "cuda")]
        if let Some(c) = &mut self.cuda {
            c.arrived_on_device(blocks);
        }
    }

    /// Makes both copies of `blocks` agree, copying each block whichever way it is newer, before
    /// others read them: the host's for the prefix cache, a tier or a peer over shared memory or
    /// TCP, the device's for a peer copying device to device. Returns the blocks copied (none on
    /// the CPU, whose host arena is the only copy).
    pub fn settle(&mut self, blocks: &[BlockId], arena: &mut KvArena) -> Result<usize> {
        self.settled += blocks.len() as u64;
        let _ = &arena;
        #[cfg(feature = "cuda")]
        if let Some(c) = &mut self.cuda {
            return c.settle(blocks, arena);
        }
        Ok(0)
    }

    /// This engine's device arena as the transfer plane opens it (a handle a peer on this host
    /// maps, copies device to device): `None` on the CPU, or where the device arena is not laid
    /// out as the host's (a host arena that is not block-major).
    pub fn device_arena(&self, arena: &KvArena) -> Option<Result<Arc<dyn baton_transfer::DeviceArena>>> {
        let _ = arena;
        #[cfg(feature = "cuda")]
        if let Some(c) = &self.cuda {
            return c.device_arena(arena);
        }
        None
    }

    /// Blocks marked stale since this state was made (counted on the CPU too, where marking
    /// costs nothing: the engine's marking is tested without a GPU).
    pub fn invalidated_blocks(&self) -> u64 {
        self.invalidated
    }

    /// Blocks marked as arrived on the device since this state was made (counted on the CPU
    /// too).
    pub fn arrived_blocks(&self) -> u64 {
        self.arrived
    }

    /// Blocks handed to [`settle`](Self::settle) since this state was made (counted on the CPU
    /// too).
    pub fn settled_blocks(&self) -> u64 {
        self.settled
    }

    /// Device memory this engine's state takes: (KV arena, workspace) bytes; zeros on the CPU.
    pub fn device_bytes(&self) -> (usize, usize) {
        #[cfg(feature = "cuda")]
        if let Some(c) = &self.cuda {
            return c.device_bytes();
        }
        (0, 0)
    }
}
