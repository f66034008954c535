//! The interface every compute backend implements.
//!
//! A backend computes a model's steps ([`Backend::forward`]) and owns what its device keeps of
//! an engine's KV ([`KvState`], one per engine, made by [`Backend::kv_state`]). Three implement
//! it:
//!
//! - the **CPU** (`model.rs`'s `CpuModel`): the pool's arena is the only copy of the KV, read
//!   and written in place; its state holds nothing;
//! - the **stand-in device** (`--device stand-in`, for tests): the CPU's kernels over an arena
//!   in a memfd of its own, `baton-device-arena`, which it offers to peers on this host as a
//!   device arena ([`baton_transfer::StandInArena`]), so that the device path of every
//!   hand-off, the copy counters and the memory figures run where there is no GPU;
//! - **CUDA** (`cuda/`, with the `cuda` feature; a stub that says how to get it without).
//!
//! Which backend a device means is `model.rs`'s to say, once a model loads
//! ([`crate::Model::load_on`]). The engine, the worker and the transfer plane see
//! [`crate::Model`] and [`crate::DeviceKv`], never a backend; only `lib.rs` names the `cuda`
//! feature (it picks `cuda/` or its stub).

use std::any::Any;
use std::sync::Arc;

use baton_kv::{BlockId, CopyMeter, KvArena};

use crate::config::ModelConfig;
use crate::device::ComputeDevice;
use crate::error::{ModelError, Result};
use crate::step::{SeqStep, StepLogits};

/// What computes a model's steps on one device (see the module docs).
pub trait Backend: Send + Sync {
    /// The device it computes on.
    fn device(&self) -> ComputeDevice;

    /// Bytes of weights one forward pass reads.
    fn weight_bytes_per_step(&self) -> usize;

    /// Device memory the weights take (0 where the device is the host's memory).
    fn device_weight_bytes(&self) -> usize {
        0
    }

    /// The name of the memfd an engine's KV arena is made in on this device.
    fn arena_name(&self) -> &'static str {
        baton_kv::DEFAULT_ARENA_NAME
    }

    /// The device's state for an engine's KV `arena`. With `fresh`, nothing is in the arena
    /// yet (an engine's); without, it may hold anything (a one-off forward's). Copies the
    /// device makes between its memory and the host's are counted on `meter`.
    fn kv_state(&self, arena: &KvArena, fresh: bool, meter: Arc<CopyMeter>) -> Result<Box<dyn KvState>>;

    /// One batch step (see [`crate::Model::forward_kv`]) with the engine's `state`, one this
    /// backend made.
    fn forward(
        &self,
        config: &ModelConfig,
        batch: &[SeqStep<'_>],
        kv: &mut KvArena,
        state: &mut dyn KvState,
        layer_written: &mut (dyn FnMut(usize) + Send),
    ) -> Result<StepLogits>;
}

/// What a device keeps of an engine's KV arena, beside the pool's bookkeeping (see
/// [`crate::DeviceKv`], which wraps it). Every method has the CPU's answer as its default:
/// nothing to mark, nothing to copy, no device arena to offer.
pub trait KvState: Send + std::fmt::Debug {
    /// The host bytes of `blocks` were written by someone else than the forward pass.
    fn invalidate(&mut self, blocks: &[BlockId]) {
        let _ = blocks;
    }

    /// `blocks` arrived in the device arena device to device.
    fn arrived_on_device(&mut self, blocks: &[BlockId]) {
        let _ = blocks;
    }

    /// Makes whatever copies of `blocks` the device keeps agree with the arena's; returns the
    /// blocks copied.
    fn settle(&mut self, blocks: &[BlockId], arena: &mut KvArena) -> Result<usize> {
        let _ = (blocks, arena);
        Ok(0)
    }

    /// The device arena as the transfer plane opens it (see [`crate::DeviceKv::device_arena`]).
    fn device_arena(&self, arena: &KvArena) -> Option<Result<Arc<dyn baton_transfer::DeviceArena>>> {
        let _ = arena;
        None
    }

    /// Device memory the state takes: (KV arena, workspace) bytes.
    fn device_bytes(&self) -> (usize, usize) {
        (0, 0)
    }

    /// The state as its backend's own type, for that backend's [`Backend::forward`].
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// The state of a backend whose device is the host's memory: nothing beside the arena.
#[derive(Debug, Default)]
pub(crate) struct HostKv;

impl KvState for HostKv {
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// The memfd name of a stand-in device's arenas: `/proc/PID/smaps` tells them from the rest
/// of the process's memory (the host tier is `baton-host-tier`).
pub const STAND_IN_ARENA_NAME: &str = "baton-device-arena";

/// The stand-in device's state: the engine's arena, posing as device memory, offered to peers
/// on this host as a device arena.
#[derive(Debug, Default)]
pub(crate) struct StandInKv;

impl KvState for StandInKv {
    fn device_arena(&self, arena: &KvArena) -> Option<Result<Arc<dyn baton_transfer::DeviceArena>>> {
        let handle = arena.handle()?;
        let open = || -> std::result::Result<Arc<dyn baton_transfer::DeviceArena>, String> {
            let region = baton_transfer::Region::from_arena(&handle, baton_transfer::Access::ReadWrite)
                .map_err(|e| format!("mapping the stand-in device arena: {e}"))?;
            let arena = baton_transfer::StandInArena::new(Arc::new(region), 0).map_err(|e| e.to_string())?;
            Ok(Arc::new(arena))
        };
        Some(open().map_err(ModelError::Device))
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
