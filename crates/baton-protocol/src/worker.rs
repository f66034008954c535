//! What the conductor needs of a worker, wherever the worker runs: the [`Worker`] trait. The
//! worker crate's `WorkerHandle` implements it in this process, the conductor crate's
//! `RemoteWorker` behind a worker's control API.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::sync::mpsc;

use crate::wire::{KvSource, Received, RequestEvent, Role, StateUpdate, WorkRequest, WorkerStats};

/// What the conductor needs of a worker, wherever it runs: `baton_worker::WorkerHandle` in this
/// process, `baton_conductor::remote::RemoteWorker` behind a worker's control API.
#[async_trait::async_trait]
pub trait Worker: Send + Sync + std::fmt::Debug {
    /// The worker's name (its cluster id).
    fn name(&self) -> &str;
    /// Its role: what the conductor routes to it.
    fn role(&self) -> Role;
    /// Switches its role (elastic prefill/decode): from now on it is sent the new kind of work;
    /// what it holds runs to its end. An error when it cannot switch or does not answer within
    /// `deadline`.
    async fn set_role(&self, _role: Role, _deadline: Duration) -> Result<(), String> {
        Err("this worker cannot switch roles".into())
    }
    /// The worker reported `role` in its state stream (a switch this or another conductor
    /// made): the handle routes it as that from now on.
    fn note_role(&self, _role: Role) {}
    /// Requests submitted through this handle and not finished.
    fn in_flight(&self) -> usize;
    /// Submits a request. Events arrive on the returned receiver; dropping it aborts the
    /// request (and frees its KV).
    fn submit(&self, req: WorkRequest) -> mpsc::UnboundedReceiver<RequestEvent>;
    /// Releases KV this worker handed off for request `id` and still holds (no-op if the decode
    /// side already completed the pull).
    fn release(&self, id: u64);
    /// Current load and memory; `None` when the worker does not answer in time.
    async fn stats(&self) -> Option<WorkerStats>;
    /// KV blocks of its pool (0: unknown).
    fn capacity_blocks(&self) -> usize {
        0
    }
    /// Tokens per KV block (0: unknown).
    fn block_tokens(&self) -> usize {
        0
    }
    /// Its KV cache as far as exchanging KV goes (layers, heads, block size, element type), when
    /// known: two workers that know theirs and differ cannot hand KV to each other (their KV
    /// servers refuse at CONNECT), so the conductor runs a request it would split between them
    /// whole on the decode worker instead. `None` (the default: the workers of one process share
    /// one engine configuration) matches any.
    fn kv_kind(&self) -> Option<&str> {
        None
    }
    /// Where its KV server listens, when known: a layer-wise hand-off's decode worker registers
    /// there before the prefill starts.
    fn kv_addr(&self) -> Option<SocketAddr> {
        None
    }
    /// Offers the longest prefix of `tokens` this worker caches (whole blocks, from any tier) to
    /// a peer, under lease `lease` on its KV server: the peer pulls the blocks named in the answer
    /// and COMPLETEs, or the lease ends when [`Worker::release`]d or when it expires. `None` when
    /// it caches none of it, has no KV server, or does not answer within `deadline`.
    async fn export_prefix(&self, _lease: u64, _tokens: &[u32], _deadline: Duration) -> Option<KvSource> {
        None
    }
    /// Pulls KV of `tokens` that a peer offers (`source`) into this worker's prefix cache,
    /// running nothing (what it caches already does not travel), as import `id`. What arrived,
    /// or `None` when nothing did within `deadline` (the peer's lease then ends on its own).
    async fn import_prefix(
        &self,
        _id: u64,
        _tokens: Vec<u32>,
        _source: KvSource,
        _deadline: Duration,
    ) -> Option<Received> {
        None
    }
    /// Subscribes to the worker's state stream: its KV events and load reports, in order,
    /// starting with a snapshot of its whole index. Each subscription is independent (two
    /// conductors may follow one worker); dropping the receiver ends it, and subscribing again
    /// is how a reader that saw a gap resynchronises. `None` when the worker has no stream.
    fn subscribe_state(&self) -> Option<mpsc::Receiver<StateUpdate>> {
        None
    }
}

/// Whether KV can move between `a` and `b`: their [`Worker::kv_kind`]s agree, or one is unknown.
pub fn kv_exchangeable(a: &dyn Worker, b: &dyn Worker) -> bool {
    match (a.kv_kind(), b.kv_kind()) {
        (Some(a), Some(b)) => a == b,
        _ => true,
    }
}

/// A worker's role, read and switched from any thread (a `Worker` implementation's).
#[derive(Debug)]
pub struct SharedRole(std::sync::atomic::AtomicU8);

impl SharedRole {
    const ROLES: [Role; 3] = [Role::Prefill, Role::Decode, Role::Colocated];

    /// Starts as `role`.
    pub fn new(role: Role) -> Self {
        Self(std::sync::atomic::AtomicU8::new(Self::code(role)))
    }

    fn code(role: Role) -> u8 {
        Self::ROLES.iter().position(|&r| r == role).unwrap_or(0) as u8
    }

    /// The role now.
    pub fn get(&self) -> Role {
        Self::ROLES[usize::from(self.0.load(std::sync::atomic::Ordering::SeqCst)) % Self::ROLES.len()]
    }

    /// Switches to `role`; the role before.
    pub fn swap(&self, role: Role) -> Role {
        Self::ROLES[usize::from(self.0.swap(Self::code(role), std::sync::atomic::Ordering::SeqCst)) % Self::ROLES.len()]
    }
}
