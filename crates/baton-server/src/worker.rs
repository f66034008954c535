//! A worker: one engine on its own thread, driven through a handle.
//!
//! The engine is synchronous and CPU-bound, so it runs on a dedicated thread that owns it (one
//! owner: no lock around the engine). Everything else talks to it through [`WorkerHandle`]:
//! commands go in over a channel, and each request's events come back over its own channel.
//! When a request's receiver is dropped (the client went away), the next event fails to send
//! and the engine aborts the request, freeing its KV.
//!
//! KV hand-off between workers on one host uses shared memory: every worker's arena is a memfd
//! mapping, a prefill worker keeps a finished prompt's blocks under a lease, and the decode
//! worker maps the prefill arena read-only and copies the blocks into blocks it reserved (pull
//! mode), then tells the prefill worker to release them (COMPLETE).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use baton_engine::{Engine, FinishReason, GenerationRequest, KvPrefix, RequestId};
use baton_kv::{ArenaHandle, BlockId, MappedArena};
use tokio::sync::{mpsc, oneshot};

use crate::error::ApiError;

/// A worker's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Computes prompts and first tokens, then hands the KV over.
    Prefill,
    /// Continues requests from KV computed elsewhere.
    Decode,
    /// Both, in one engine (vLLM's way).
    Colocated,
}

/// KV another worker holds for a request, and where to read it.
#[derive(Debug, Clone)]
pub struct RemoteKv {
    /// The holder's arena.
    pub arena: ArenaHandle,
    /// The blocks, in token order.
    pub blocks: Vec<BlockId>,
    /// Tokens they hold.
    pub tokens: usize,
}

/// What a request produces, in order: tokens, then one `Finished` (or `Failed`).
#[derive(Debug)]
pub enum RequestEvent {
    /// A generated token and the text it makes visible.
    Token {
        /// The token.
        token: u32,
        /// Text delta.
        text: String,
    },
    /// The request ended.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Prompt tokens served from cached or transferred KV.
        cached_tokens: usize,
        /// Generated tokens (upstream ones included).
        completion_tokens: usize,
        /// KV kept for a hand-off (prefill role): held under a lease until released.
        kv: Option<RemoteKv>,
    },
    /// The request could not run (a 400 when the engine refused it as invalid).
    Failed(ApiError),
}

enum Command {
    Submit { req: Box<GenerationRequest>, pull: Option<RemoteKv>, events: mpsc::UnboundedSender<RequestEvent> },
    Abort(RequestId),
    Release(RequestId),
    Stats(oneshot::Sender<WorkerStats>),
}

/// Load and memory figures of a worker.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct WorkerStats {
    /// Requests running.
    pub running: usize,
    /// Requests waiting.
    pub waiting: usize,
    /// Blocks allocatable now (free or merely cached).
    pub available_blocks: usize,
    /// Blocks in the arena.
    pub total_blocks: usize,
    /// KV handed off and not yet released.
    pub leased: usize,
}

/// A handle on a worker's engine thread. Cloning it shares the worker.
#[derive(Clone)]
pub struct WorkerHandle {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    role: Role,
    commands: std::sync::mpsc::Sender<Command>,
    arena: Option<ArenaHandle>,
    /// Requests submitted and not finished: the load figure routing reads without a round trip.
    in_flight: AtomicUsize,
}

impl std::fmt::Debug for WorkerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerHandle").field("name", &self.inner.name).field("role", &self.inner.role).finish()
    }
}

/// How long a prefill worker keeps handed-off KV when no one releases it.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

impl WorkerHandle {
    /// Starts a worker thread that owns `engine`.
    pub fn spawn(name: impl Into<String>, role: Role, engine: Engine, lease: Duration) -> std::io::Result<Self> {
        let name = name.into();
        let (tx, rx) = std::sync::mpsc::channel();
        let arena = engine.kv().handle();
        std::thread::Builder::new()
            .name(format!("baton-{name}"))
            .spawn(move || EngineLoop::new(engine, lease).run(rx))?;
        Ok(Self { inner: Arc::new(Inner { name, role, commands: tx, arena, in_flight: AtomicUsize::new(0) }) })
    }

    /// The worker's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The worker's role.
    pub fn role(&self) -> Role {
        self.inner.role
    }

    /// Requests submitted through this handle and not finished.
    pub fn in_flight(&self) -> usize {
        self.inner.in_flight.load(Ordering::Relaxed)
    }

    /// Submits a request; `pull` names KV to copy in first (decode role). Events arrive on the
    /// returned receiver; dropping it aborts the request.
    pub fn submit(&self, req: GenerationRequest, pull: Option<RemoteKv>) -> mpsc::UnboundedReceiver<RequestEvent> {
        let (tx, rx) = mpsc::unbounded_channel();
        if pull.is_some() && self.inner.arena.is_none() {
            let _ = tx.send(RequestEvent::Failed(ApiError::Internal("this worker's arena cannot be shared".into())));
            return rx;
        }
        self.inner.in_flight.fetch_add(1, Ordering::Relaxed);
        let guard = InFlight(self.inner.clone());
        let (ftx, frx) = mpsc::unbounded_channel();
        if self.inner.commands.send(Command::Submit { req: Box::new(req), pull, events: ftx }).is_err() {
            let _ =
                tx.send(RequestEvent::Failed(ApiError::Internal(format!("worker {} has stopped", self.inner.name))));
            return rx;
        }
        // Forward events, counting the request out when it ends however it ends.
        tokio::spawn(forward(frx, tx, guard));
        rx
    }

    /// Aborts a request.
    pub fn abort(&self, id: RequestId) {
        let _ = self.inner.commands.send(Command::Abort(id));
    }

    /// Releases KV this worker handed off for `id` (the decode side's COMPLETE).
    pub fn release(&self, id: RequestId) {
        let _ = self.inner.commands.send(Command::Release(id));
    }

    /// Current load and memory.
    pub async fn stats(&self) -> Option<WorkerStats> {
        let (tx, rx) = oneshot::channel();
        self.inner.commands.send(Command::Stats(tx)).ok()?;
        tokio::time::timeout(Duration::from_secs(5), rx).await.ok()?.ok()
    }
}

struct InFlight(Arc<Inner>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn forward(
    mut from: mpsc::UnboundedReceiver<RequestEvent>,
    to: mpsc::UnboundedSender<RequestEvent>,
    _guard: InFlight,
) {
    while let Some(e) = from.recv().await {
        let last = matches!(e, RequestEvent::Finished { .. } | RequestEvent::Failed(_));
        if to.send(e).is_err() || last {
            // Dropping `from` makes the engine's next send fail, which aborts the request.
            return;
        }
    }
}

/// The engine thread's state.
struct EngineLoop {
    engine: Engine,
    streams: HashMap<RequestId, mpsc::UnboundedSender<RequestEvent>>,
    /// Handed-off KV by request, with its deadline.
    leases: HashMap<RequestId, (KvPrefix, Instant)>,
    lease: Duration,
    /// Peer arenas mapped for pulls, by memfd path.
    peers: HashMap<std::path::PathBuf, MappedArena>,
}

impl EngineLoop {
    fn new(engine: Engine, lease: Duration) -> Self {
        Self { engine, streams: HashMap::new(), leases: HashMap::new(), lease, peers: HashMap::new() }
    }

    fn run(mut self, rx: std::sync::mpsc::Receiver<Command>) {
        loop {
            // Idle: block for a command (waking for lease expiry); busy: take what is there.
            let first = if self.engine.has_work() {
                rx.try_recv().map_err(|e| matches!(e, std::sync::mpsc::TryRecvError::Disconnected))
            } else {
                rx.recv_timeout(Duration::from_millis(500))
                    .map_err(|e| matches!(e, std::sync::mpsc::RecvTimeoutError::Disconnected))
            };
            match first {
                Ok(cmd) => {
                    self.handle(cmd);
                    while let Ok(cmd) = rx.try_recv() {
                        self.handle(cmd);
                    }
                }
                Err(true) => return,
                Err(false) => {}
            }
            self.expire_leases();
            if self.engine.has_work() {
                self.step();
            }
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit { mut req, pull, events } => {
                let id = req.id;
                if let Some(remote) = pull {
                    match self.pull(&remote) {
                        Ok(prefix) => req.prefix = Some(prefix),
                        Err(e) => {
                            let _ = events.send(RequestEvent::Failed(ApiError::Internal(e)));
                            return;
                        }
                    }
                }
                match self.engine.add_request(*req) {
                    Ok(()) => {
                        self.streams.insert(id, events);
                    }
                    Err(e) => {
                        let _ = events.send(RequestEvent::Failed(e.into()));
                    }
                }
            }
            Command::Abort(id) => self.abort(id),
            Command::Release(id) => {
                if let Some((kv, _)) = self.leases.remove(&id) {
                    self.release(kv);
                }
            }
            Command::Stats(reply) => {
                let (running, waiting) = self.engine.queue_lengths();
                let _ = reply.send(WorkerStats {
                    running,
                    waiting,
                    available_blocks: self.engine.available_blocks(),
                    total_blocks: self.engine.config().num_blocks,
                    leased: self.leases.len(),
                });
            }
        }
    }

    /// Reserves local blocks and copies a peer's KV into them (shared-memory pull).
    fn pull(&mut self, remote: &RemoteKv) -> Result<KvPrefix, String> {
        let path = remote.arena.path();
        if !self.peers.contains_key(&path) {
            let mapped = MappedArena::open(&remote.arena).map_err(|e| format!("cannot map the prefill arena: {e}"))?;
            self.peers.insert(path.clone(), mapped);
        }
        let reserved = self.engine.reserve_kv(remote.tokens).map_err(|e| e.to_string())?;
        let src = self.peers[&path].as_slice();
        self.engine.kv_mut().copy_blocks_from_slice(&remote.arena.descriptor, src, &remote.blocks, &reserved.blocks);
        Ok(reserved)
    }

    fn step(&mut self) {
        let out = match self.engine.step() {
            Ok(out) => out,
            Err(e) => {
                // A failed step is a bug or a model failure: fail everything in flight.
                tracing::error!(error = %e, "engine step failed");
                for (id, tx) in self.streams.drain() {
                    let _ = tx.send(RequestEvent::Failed(ApiError::Internal(e.to_string())));
                    let _ = self.engine.abort(id);
                }
                return;
            }
        };
        let mut gone = Vec::new();
        for t in out.tokens {
            if let Some(tx) = self.streams.get(&t.id)
                && tx.send(RequestEvent::Token { token: t.token, text: t.text_delta }).is_err()
            {
                gone.push(t.id);
            }
        }
        for f in out.finished {
            let kv = f.kv.map(|kv| {
                let remote = self.engine.kv().handle().map(|arena| RemoteKv {
                    arena,
                    blocks: kv.blocks.clone(),
                    tokens: kv.tokens,
                });
                self.leases.insert(f.id, (kv, Instant::now() + self.lease));
                remote
            });
            if let Some(tx) = self.streams.remove(&f.id) {
                let _ = tx.send(RequestEvent::Finished {
                    reason: f.reason,
                    prompt_tokens: f.prompt_tokens,
                    cached_tokens: f.cached_tokens,
                    completion_tokens: f.token_ids.len(),
                    kv: kv.flatten(),
                });
            }
        }
        for id in gone {
            self.abort(id);
        }
    }

    fn abort(&mut self, id: RequestId) {
        self.streams.remove(&id);
        if let Ok(Some(f)) = self.engine.abort(id)
            && let Some(kv) = f.kv
        {
            self.release(kv);
        }
        if let Some((kv, _)) = self.leases.remove(&id) {
            self.release(kv);
        }
    }

    fn release(&mut self, kv: KvPrefix) {
        if let Err(e) = self.engine.release_kv(kv) {
            tracing::error!(error = %e, "releasing handed-off KV failed");
        }
    }

    fn expire_leases(&mut self) {
        let now = Instant::now();
        let expired: Vec<RequestId> = self.leases.iter().filter(|(_, (_, t))| *t <= now).map(|(id, _)| *id).collect();
        for id in expired {
            tracing::warn!(request = id.0, "no one released handed-off KV within the lease; releasing it");
            if let Some((kv, _)) = self.leases.remove(&id) {
                self.release(kv);
            }
        }
    }
}
