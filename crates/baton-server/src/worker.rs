//! A worker: one engine on its own thread, driven through a handle.
//!
//! The engine is synchronous and CPU-bound, so it runs on a dedicated thread that owns it (one
//! owner: no lock around the engine). Everything else talks to it through [`WorkerHandle`]:
//! commands go in over a channel, and each request's events come back over its own channel.
//! When a request's receiver is dropped (the client went away), the next event fails to send
//! and the engine aborts the request, freeing its KV.
//!
//! KV moves between workers with `baton-transfer`'s protocol, pulled or pushed as each request
//! says ([`KvTransfer`]; the modes are described in [`crate::handoff`]):
//!
//! 1. A prefill worker finishes a prompt with its KV retained and offers the blocks on its
//!    [`KvServer`] under a lease; the request's `Finished` event names them ([`KvSource`]). In
//!    push mode it also starts pushing them, which waits for the decode worker's reservation.
//! 2. The decode worker's engine thread reserves blocks of its own, and its transfer thread
//!    pulls into them, or registers them for the push and waits for it, with a
//!    [`baton_transfer::KvClient`] — over shared memory when the peer is on this host, else
//!    TCP — without stalling the engine's steps; then it COMPLETEs.
//! 3. COMPLETE (or the lease running out, or the conductor's [`Worker::release`]) hands the
//!    blocks back to the prefill engine through its [`BlockOwner`].
//!
//! A failed transfer frees the reserved blocks; a prefill worker's blocks come back when their
//! lease ends whatever the decode side does, so a dead peer leaves nothing held.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use baton_engine::{Engine, FinishReason, GenerationRequest, KvPrefix, KvRetention, RequestId, StopParams};
use baton_model::{LogitAdjust, SamplingParams, TokenLogprobs};
use baton_transfer::{
    Access, BlockOwner, ClientConfig, Compat, KvServer, PeerId, Region, Release, ServerConfig, TransferId,
    TransferStats,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;

use crate::error::ApiError;
pub use crate::handoff::KvTransfer;
use crate::handoff::{KvJob, TransferThread, spawn_push};

/// A worker's role: the cluster's, so registry, routing and workers share one type.
pub use baton_cluster::Role;

/// KV a prefill worker holds for a request under a lease, and where its KV server is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvSource {
    /// The holder's KV server.
    pub addr: SocketAddr,
    /// The holder's blocks, in token order.
    pub blocks: Vec<u32>,
    /// Tokens they hold.
    pub tokens: usize,
}

/// One request as a worker receives it, locally or over the control API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkRequest {
    /// Unique among the conductor's requests; also the KV transfer's id.
    pub id: u64,
    /// The client's `x-request-id` (or the conductor's own), for the worker's logs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens already generated elsewhere (the prefill worker's first token).
    #[serde(default)]
    pub generated: Vec<u32>,
    /// Softmax temperature (0: greedy).
    pub temperature: f32,
    /// Top-k (0: all).
    #[serde(default)]
    pub top_k: usize,
    /// Top-p (1: all).
    pub top_p: f32,
    /// Seed of the random stream.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Penalties, logit bias and min-p (the sampler sees `prompt` and `generated` too, so a
    /// decode worker continues with the prefill worker's state).
    #[serde(default)]
    pub adjust: LogitAdjust,
    /// Report each token's log-probability and the `n` most likely tokens' (`Some(n)`).
    #[serde(default)]
    pub logprobs: Option<usize>,
    /// Tokens that end the request (their text left out).
    #[serde(default)]
    pub stop_token_ids: Vec<u32>,
    /// Most tokens to generate, counting `generated`.
    pub max_tokens: usize,
    /// Keep going past end-of-sequence.
    #[serde(default)]
    pub ignore_eos: bool,
    /// Stop strings.
    #[serde(default)]
    pub stop: Vec<String>,
    /// Keep the KV for a hand-off when the request ends (prefill role).
    #[serde(default)]
    pub retain_kv: bool,
    /// How the hand-off moves the KV: whether a prefill worker pushes what it retains, and how
    /// a decode worker receives `kv`.
    #[serde(default)]
    pub kv_transfer: KvTransfer,
    /// KV to receive before starting (decode role).
    #[serde(default)]
    pub kv: Option<KvSource>,
}

impl WorkRequest {
    /// The span of this request's work on a worker and in its KV transfer.
    fn span(&self, worker: &str, role: Role) -> tracing::Span {
        let request_id = self.request_id.as_deref().unwrap_or_default();
        tracing::info_span!("work", request_id, request = self.id, worker, role = role.as_str())
    }

    fn into_parts(self) -> (GenerationRequest, Option<KvSource>, KvTransfer) {
        let req = GenerationRequest {
            generated: self.generated,
            sampling: SamplingParams {
                temperature: self.temperature,
                top_k: self.top_k,
                top_p: self.top_p,
                seed: self.seed,
                adjust: self.adjust,
            },
            stop: StopParams { max_tokens: self.max_tokens, ignore_eos: self.ignore_eos, stop_strings: self.stop },
            retain_kv: if self.retain_kv { KvRetention::All } else { KvRetention::None },
            logprobs: self.logprobs,
            stop_token_ids: self.stop_token_ids,
            ..GenerationRequest::new(RequestId(self.id), self.prompt)
        };
        (req, self.kv, self.kv_transfer)
    }
}

/// Why a request ended, as it travels between processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    /// End-of-sequence token.
    Eos,
    /// `max_tokens` or the context length.
    Length,
    /// A stop string.
    Stop,
    /// Aborted.
    Aborted,
}

impl From<FinishReason> for Finish {
    fn from(r: FinishReason) -> Self {
        match r {
            FinishReason::Eos => Finish::Eos,
            FinishReason::Length => Finish::Length,
            FinishReason::Stop => Finish::Stop,
            FinishReason::Aborted => Finish::Aborted,
        }
    }
}

impl Finish {
    /// The OpenAI API's name for it.
    pub fn as_openai(self) -> &'static str {
        match self {
            Finish::Eos | Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::Aborted => "abort",
        }
    }
}

/// What a request produces, in order: tokens, then one `Finished`, `Failed` or `Lost`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum RequestEvent {
    /// A generated token and the text it makes visible.
    Token {
        /// The token.
        token: u32,
        /// Text delta.
        text: String,
        /// Its log-probabilities, when the request asked for them.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        logprobs: Option<TokenLogprobs>,
    },
    /// The request ended.
    Finished {
        /// Why.
        reason: Finish,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Prompt tokens served from cached or transferred KV.
        cached_tokens: usize,
        /// Generated tokens (upstream ones included).
        completion_tokens: usize,
        /// KV kept for a hand-off (prefill role), leased until pulled or released.
        kv: Option<KvSource>,
    },
    /// The request could not run (a 400 when the engine refused it as invalid).
    Failed(ApiError),
    /// The worker went away (crashed, left the cluster, unreachable): the request may be
    /// retried elsewhere if nothing was streamed yet.
    Lost(String),
}

impl RequestEvent {
    /// Whether this event ends the request.
    pub fn is_last(&self) -> bool {
        !matches!(self, RequestEvent::Token { .. })
    }
}

/// Load and memory figures of a worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerStats {
    /// Requests running.
    pub running: usize,
    /// Requests waiting.
    pub waiting: usize,
    /// Requests whose KV is being pulled in or pushed here.
    pub pulling: usize,
    /// Blocks allocatable now (free or merely cached).
    pub available_blocks: usize,
    /// Blocks in the arena.
    pub total_blocks: usize,
    /// KV handed off and not yet released.
    pub leased: usize,
    /// Hand-offs waiting for room to receive their KV (decode role).
    #[serde(default)]
    pub incoming: usize,
}

impl WorkerStats {
    /// Nothing in flight and every block allocatable: what a quiet worker must report.
    pub fn is_quiet(&self) -> bool {
        self.running == 0
            && self.waiting == 0
            && self.pulling == 0
            && self.incoming == 0
            && self.leased == 0
            && self.available_blocks == self.total_blocks
    }
}

/// What the conductor needs of a worker, wherever it runs: [`WorkerHandle`] in this process,
/// [`crate::remote::RemoteWorker`] behind a control API.
#[async_trait::async_trait]
pub trait Worker: Send + Sync + std::fmt::Debug {
    /// The worker's name (its cluster id).
    fn name(&self) -> &str;
    /// Its role.
    fn role(&self) -> Role;
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
}

/// How a decode worker reaches prefill workers' KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportChoice {
    /// Shared memory when the peer's KV server is on a loopback address, else TCP.
    #[default]
    Auto,
    /// Always shared memory (fails for peers on other hosts).
    Shm,
    /// Always TCP.
    Tcp,
}

impl std::str::FromStr for TransportChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "shm" => Ok(Self::Shm),
            "tcp" => Ok(Self::Tcp),
            other => Err(format!("unknown transport `{other}` (expected auto, shm or tcp)")),
        }
    }
}

/// How a worker serves and fetches KV.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// How long handed-off KV is held when no one pulls or releases it.
    pub lease: Duration,
    /// The cluster secret KV peers must prove.
    pub secret: baton_cluster::ClusterSecret,
    /// Where the KV server listens (prefill and colocated roles).
    pub kv_bind: SocketAddr,
    /// The address decode workers dial for this worker's KV, when it differs from `kv_bind`'s
    /// (which, if unspecified like `0.0.0.0`, is advertised as loopback).
    pub kv_advertise: Option<std::net::IpAddr>,
    /// How KV travels to this worker, pulled or pushed (decode role).
    pub transport: TransportChoice,
    /// Model and KV geometry, checked with every peer.
    pub compat: Compat,
    /// Bound on every KV socket read and write, and on a decode worker's wait for pushed KV.
    pub io_timeout: Duration,
    /// Fault injection for tests: how long a prefill worker waits before each push (zero
    /// outside tests), so that a test can break a hand-off in the middle.
    pub push_delay: Duration,
}

/// How long a prefill worker keeps handed-off KV when no one releases it.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// How long an idle engine thread waits for a command before looking around again.
const IDLE_WAIT: Duration = Duration::from_millis(500);
/// How long a stalled engine thread (its work waits for blocks that a lease, a transfer or a
/// departing client will free) waits for a command before trying again: no spinning.
const STALL_WAIT: Duration = Duration::from_millis(5);

pub(crate) enum Command {
    Submit {
        req: Box<GenerationRequest>,
        kv: Option<KvSource>,
        mode: KvTransfer,
        events: mpsc::UnboundedSender<RequestEvent>,
        /// The request's span (its ids), entered wherever the worker logs about it.
        span: tracing::Span,
    },
    Abort(RequestId),
    /// The conductor gives up a hand-off: end its lease now.
    Release(RequestId),
    /// The KV server ended a lease (COMPLETE, expiry or cancel): the blocks are ours again.
    Released(Release),
    /// The transfer thread finished fetching a request's KV.
    Transferred {
        job: Box<KvJob>,
        result: Result<TransferStats, String>,
    },
    Stats(oneshot::Sender<WorkerStats>),
    /// The last handle is gone: stop the KV server and the thread.
    Shutdown,
}

/// The KV server hands leased blocks back through the engine thread's command channel.
struct LoopOwner(std::sync::Mutex<std::sync::mpsc::Sender<Command>>);

impl BlockOwner for LoopOwner {
    fn release(&self, release: Release) {
        // A closed channel means the engine is gone, and its pool with it: nothing to free.
        let _ = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).send(Command::Released(release));
    }
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
    kv_addr: Option<SocketAddr>,
    capacity_blocks: usize,
    block_tokens: usize,
    /// Requests submitted and not finished: the load figure routing reads without a round trip.
    in_flight: AtomicUsize,
}

impl std::fmt::Debug for WorkerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerHandle").field("name", &self.inner.name).field("role", &self.inner.role).finish()
    }
}

fn io_error(context: &str, e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(format!("{context}: {e}"))
}

impl WorkerHandle {
    /// Starts a worker thread that owns `engine`; prefill and colocated workers also start a
    /// KV server over the engine's arena, decode workers a transfer thread.
    pub fn spawn(name: impl Into<String>, role: Role, engine: Engine, options: WorkerOptions) -> std::io::Result<Self> {
        let name = name.into();
        let (tx, rx) = std::sync::mpsc::channel();
        let arena = engine.kv().handle();
        let peer = PeerId(u64::from(engine.config().instance.0));
        let server = if role == Role::Decode {
            None
        } else {
            let arena = arena.as_ref().ok_or_else(|| io_error("KV server", "the engine's arena cannot be shared"))?;
            let region = Region::from_arena(arena, Access::ReadOnly)?;
            let config = ServerConfig {
                bind: options.kv_bind,
                lease: options.lease,
                io_timeout: options.io_timeout,
                ..ServerConfig::new(peer, options.compat.clone(), options.secret.expose())
            };
            let owner = LoopOwner(std::sync::Mutex::new(tx.clone()));
            let server = KvServer::start(config, region, owner).map_err(|e| io_error("starting the KV server", e))?;
            Some(Arc::new(server))
        };
        let transfers = if role == Role::Prefill {
            None
        } else {
            let arena = arena.as_ref().ok_or_else(|| io_error("KV client", "the engine's arena cannot be shared"))?;
            let local = Arc::new(Region::from_arena(arena, Access::ReadWrite)?);
            let config = ClientConfig {
                io_timeout: options.io_timeout,
                ..ClientConfig::new(peer, options.compat.clone(), options.secret.expose())
            };
            Some(TransferThread::spawn(&name, local, config, options.transport, tx.clone())?)
        };
        let capacity_blocks = engine.config().num_blocks;
        let block_tokens = engine.config().block_size;
        let kv_addr = server.as_ref().map(|s| {
            let mut addr = s.addr();
            match options.kv_advertise {
                Some(ip) => addr.set_ip(ip),
                None if addr.ip().is_unspecified() => addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into()),
                None => {}
            }
            addr
        });
        let push = PushOptions { wait: options.lease, delay: options.push_delay };
        std::thread::Builder::new().name(format!("baton-{name}")).spawn(move || {
            EngineLoop {
                kv_addr,
                engine,
                streams: HashMap::new(),
                spans: HashMap::new(),
                handed_off: HashMap::new(),
                server,
                push,
                push_on_finish: HashSet::new(),
                transfers,
                pulling: HashMap::new(),
                incoming: VecDeque::new(),
                incoming_wait: options.lease / 2,
            }
            .run(rx)
        })?;
        Ok(Self {
            inner: Arc::new(Inner {
                name,
                role,
                commands: tx,
                kv_addr,
                capacity_blocks,
                block_tokens,
                in_flight: AtomicUsize::new(0),
            }),
        })
    }

    /// Where this worker's KV server listens (prefill and colocated roles).
    pub fn kv_addr(&self) -> Option<SocketAddr> {
        self.inner.kv_addr
    }

    /// Aborts a request.
    pub fn abort(&self, id: u64) {
        let _ = self.inner.commands.send(Command::Abort(RequestId(id)));
    }
}

#[async_trait::async_trait]
impl Worker for WorkerHandle {
    fn name(&self) -> &str {
        &self.inner.name
    }

    fn role(&self) -> Role {
        self.inner.role
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight.load(Ordering::Relaxed)
    }

    fn submit(&self, req: WorkRequest) -> mpsc::UnboundedReceiver<RequestEvent> {
        let (tx, rx) = mpsc::unbounded_channel();
        let span = req.span(&self.inner.name, self.inner.role);
        let _entered = span.enter();
        tracing::info!(prompt_tokens = req.prompt.len(), receives_kv = req.kv.is_some(), "work submitted");
        let (req, kv, mode) = req.into_parts();
        if kv.is_some() && self.inner.role == Role::Prefill {
            let _ = tx.send(RequestEvent::Failed(ApiError::Internal("a prefill worker does not receive KV".into())));
            return rx;
        }
        self.inner.in_flight.fetch_add(1, Ordering::Relaxed);
        let guard = InFlight(self.inner.clone());
        let (ftx, frx) = mpsc::unbounded_channel();
        if self
            .inner
            .commands
            .send(Command::Submit { req: Box::new(req), kv, mode, events: ftx, span: span.clone() })
            .is_err()
        {
            let _ = tx.send(RequestEvent::Lost(format!("worker {} has stopped", self.inner.name)));
            return rx;
        }
        // Forward events, counting the request out when it ends however it ends.
        tokio::spawn(forward(frx, tx, guard).instrument(span.clone()));
        rx
    }

    fn release(&self, id: u64) {
        let _ = self.inner.commands.send(Command::Release(RequestId(id)));
    }

    fn capacity_blocks(&self) -> usize {
        self.inner.capacity_blocks
    }

    fn block_tokens(&self) -> usize {
        self.inner.block_tokens
    }

    async fn stats(&self) -> Option<WorkerStats> {
        let (tx, rx) = oneshot::channel();
        self.inner.commands.send(Command::Stats(tx)).ok()?;
        tokio::time::timeout(Duration::from_secs(5), rx).await.ok()?.ok()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The KV server's owner and the transfer thread hold senders too, so the channel
        // would never close on its own.
        let _ = self.commands.send(Command::Shutdown);
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
    loop {
        // Dropping `from` makes the engine's next send fail, which aborts the request, and tells
        // a transfer in flight at once that its request is cancelled.
        let e = tokio::select! {
            e = from.recv() => e,
            () = to.closed() => return,
        };
        let Some(e) = e else { return };
        let last = e.is_last();
        if to.send(e).is_err() || last {
            return;
        }
    }
}

/// The engine thread's state.
struct EngineLoop {
    engine: Engine,
    streams: HashMap<RequestId, mpsc::UnboundedSender<RequestEvent>>,
    /// Each live request's span, entered where the engine thread logs about it.
    spans: HashMap<RequestId, tracing::Span>,
    /// KV offered on the KV server, by request, until its lease ends.
    handed_off: HashMap<RequestId, KvPrefix>,
    server: Option<Arc<KvServer>>,
    /// The KV server's advertised address.
    kv_addr: Option<SocketAddr>,
    push: PushOptions,
    /// Requests whose retained KV is pushed when they finish.
    push_on_finish: HashSet<RequestId>,
    transfers: Option<std::sync::mpsc::Sender<KvJob>>,
    /// Requests whose KV is being pulled or pushed in; `true` once aborted.
    pulling: HashMap<RequestId, bool>,
    /// Hand-offs that found no room for their KV, first come first served: each waits until
    /// blocks free up, or until its deadline, when it is run by recomputing its prompt here.
    incoming: VecDeque<Incoming>,
    /// How long a hand-off waits for room (half the prefill side's lease, so the KV is still
    /// there when room comes).
    incoming_wait: Duration,
}

/// A hand-off waiting for room to receive its KV.
struct Incoming {
    span: tracing::Span,
    req: GenerationRequest,
    source: KvSource,
    mode: KvTransfer,
    events: mpsc::UnboundedSender<RequestEvent>,
    deadline: Instant,
}

/// How a prefill worker pushes.
#[derive(Debug, Clone, Copy)]
struct PushOptions {
    /// Longest wait for the decode worker's reservation (the lease ends it anyway).
    wait: Duration,
    /// See [`WorkerOptions::push_delay`].
    delay: Duration,
}

impl EngineLoop {
    fn run(mut self, rx: std::sync::mpsc::Receiver<Command>) {
        let mut stalled = false;
        loop {
            // Idle: block for a command; busy: take what is there; stalled (work that waits for
            // blocks a lease or a transfer holds): wait a little for the command that frees them.
            let first = if self.engine.has_work() && !stalled {
                rx.try_recv().map_err(|e| matches!(e, std::sync::mpsc::TryRecvError::Disconnected))
            } else {
                let wait = if stalled || !self.incoming.is_empty() { STALL_WAIT } else { IDLE_WAIT };
                rx.recv_timeout(wait).map_err(|e| matches!(e, std::sync::mpsc::RecvTimeoutError::Disconnected))
            };
            match first {
                Ok(cmd) => {
                    let mut go = self.handle(cmd);
                    while go && let Ok(cmd) = rx.try_recv() {
                        go = self.handle(cmd);
                    }
                    if !go {
                        break;
                    }
                }
                Err(true) => break,
                Err(false) => {}
            }
            self.drop_departed();
            self.start_incoming();
            stalled = self.engine.has_work() && !self.step();
        }
        // Requests still running learn that the worker stopped when their senders drop.
        // (A push still running holds the server; it stops when that push ends.)
        if let Some(server) = self.server.take().and_then(|s| Arc::try_unwrap(s).ok()) {
            server.shutdown();
        }
    }

    /// Handles a command; `false` means stop.
    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Shutdown => return false,
            Command::Submit { req, kv: Some(source), mode, events, span } => {
                self.start_transfer(*req, source, mode, events, span);
            }
            Command::Submit { req, kv: None, mode, events, span } => {
                if mode == KvTransfer::Push && req.retain_kv == KvRetention::All {
                    self.push_on_finish.insert(req.id);
                }
                self.admit(*req, events, span);
            }
            Command::Transferred { job, result } => self.finish_transfer(*job, result),
            Command::Abort(id) => self.abort(id),
            Command::Release(id) => self.cancel_lease(id),
            Command::Released(release) => {
                if let Some(kv) = self.handed_off.remove(&RequestId(release.id.0)) {
                    self.release(kv);
                }
            }
            Command::Stats(reply) => {
                let (running, waiting) = self.engine.queue_lengths();
                let _ = reply.send(WorkerStats {
                    running,
                    waiting,
                    pulling: self.pulling.len(),
                    incoming: self.incoming.len(),
                    available_blocks: self.engine.available_blocks(),
                    total_blocks: self.engine.config().num_blocks,
                    leased: self.handed_off.len(),
                });
            }
        }
        true
    }

    fn admit(&mut self, req: GenerationRequest, events: mpsc::UnboundedSender<RequestEvent>, span: tracing::Span) {
        let id = req.id;
        match self.engine.add_request(req) {
            Ok(()) => {
                self.streams.insert(id, events);
                self.spans.insert(id, span);
            }
            Err(e) => {
                self.push_on_finish.remove(&id);
                let _ = events.send(RequestEvent::Failed(e.into()));
            }
        }
    }

    /// Reserves blocks for a peer's KV and hands the transfer to the transfer thread.
    fn start_transfer(
        &mut self,
        req: GenerationRequest,
        source: KvSource,
        mode: KvTransfer,
        events: mpsc::UnboundedSender<RequestEvent>,
        span: tracing::Span,
    ) {
        if self.transfers.is_none() {
            let _ = events.send(RequestEvent::Failed(ApiError::Internal("this worker cannot receive KV".into())));
            return;
        }
        if source.blocks.len() != source.tokens.div_ceil(self.engine.config().block_size) {
            let _ = events.send(RequestEvent::Failed(ApiError::Internal(format!(
                "{} blocks cannot hold {} tokens",
                source.blocks.len(),
                source.tokens
            ))));
            return;
        }
        let deadline = Instant::now() + self.incoming_wait;
        self.incoming.push_back(Incoming { span, req, source, mode, events, deadline });
        self.start_incoming();
    }

    /// Starts the waiting hand-offs that have room now, first come first served; one whose
    /// deadline passed runs by recomputing its prompt (its KV would be gone soon anyway).
    fn start_incoming(&mut self) {
        while let Some(head) = self.incoming.front() {
            if head.events.is_closed() {
                self.incoming.pop_front();
                continue;
            }
            let blocks = head.source.tokens.div_ceil(self.engine.config().block_size);
            // Leave a block per running sequence for its next decode step.
            let (running, _) = self.engine.queue_lengths();
            if self.engine.available_blocks() >= blocks + running {
                let Some(h) = self.incoming.pop_front() else { break };
                let _entered = h.span.clone().entered();
                match self.engine.reserve_kv(h.source.tokens) {
                    Ok(prefix) => self.send_job(h.req, prefix, h.source, h.mode, h.events, h.span),
                    Err(e) => {
                        tracing::warn!(request = h.req.id.0, error = %e, "no room for KV after all; recomputing");
                        self.admit(h.req, h.events, h.span.clone());
                    }
                }
            } else if Instant::now() >= head.deadline {
                let Some(h) = self.incoming.pop_front() else { break };
                let _entered = h.span.clone().entered();
                tracing::warn!(request = h.req.id.0, "no room for the KV in time; recomputing the prompt here");
                self.admit(h.req, h.events, h.span.clone());
            } else {
                break;
            }
        }
    }

    fn send_job(
        &mut self,
        req: GenerationRequest,
        prefix: KvPrefix,
        source: KvSource,
        mode: KvTransfer,
        events: mpsc::UnboundedSender<RequestEvent>,
        span: tracing::Span,
    ) {
        let Some(transfers) = &self.transfers else {
            self.release(prefix);
            return;
        };
        let id = req.id;
        if let Err(std::sync::mpsc::SendError(job)) = transfers.send(KvJob { req, prefix, source, mode, events, span })
        {
            let _ = job.events.send(RequestEvent::Failed(ApiError::Internal("the transfer thread stopped".into())));
            self.release(job.prefix);
            return;
        }
        self.pulling.insert(id, false);
    }

    fn finish_transfer(&mut self, job: KvJob, result: Result<TransferStats, String>) {
        let KvJob { mut req, prefix, events, mode, span, .. } = job;
        let _entered = span.clone().entered();
        let aborted = self.pulling.remove(&req.id).unwrap_or(true) || events.is_closed();
        match result {
            Ok(stats) if !aborted => {
                let mode = mode.as_str();
                tracing::info!(mode, bytes = stats.bytes, calls = stats.calls, "received KV");
                req.prefix = Some(prefix);
                self.admit(req, events, span.clone());
            }
            Ok(_) => self.release(prefix),
            Err(_) if aborted => self.release(prefix),
            Err(e) => {
                // The KV did not arrive (the peer died, its lease ended, the link broke): this
                // worker has the prompt and the tokens so far, so it recomputes the KV itself.
                tracing::warn!(request = req.id.0, error = %e, "receiving KV failed; recomputing the prompt here");
                self.release(prefix);
                self.admit(req, events, span.clone());
            }
        }
    }

    /// Aborts the requests whose client went away, wherever they are: waiting, running or
    /// waiting for room (a request that only waits sends nothing, so no failed send says so).
    fn drop_departed(&mut self) {
        let gone: Vec<RequestId> = self.streams.iter().filter(|(_, tx)| tx.is_closed()).map(|(&id, _)| id).collect();
        for id in gone {
            tracing::debug!(request = id.0, "client went away; aborting");
            self.abort(id);
        }
        self.incoming.retain(|h| !h.events.is_closed());
    }

    /// Runs one engine step; `false` when it made no progress (everything waits for blocks).
    fn step(&mut self) -> bool {
        let out = match self.engine.step() {
            Ok(out) => out,
            Err(e) => {
                // A failed step is a bug or a model failure: fail everything in flight.
                tracing::error!(error = %e, "engine step failed");
                self.spans.clear();
                for (id, tx) in self.streams.drain() {
                    let _ = tx.send(RequestEvent::Failed(ApiError::Internal(e.to_string())));
                    let _ = self.engine.abort(id);
                }
                return true;
            }
        };
        let progressed = out.computed_tokens > 0 || out.preempted > 0 || !out.finished.is_empty();
        let mut gone = Vec::new();
        for t in out.tokens {
            if let Some(tx) = self.streams.get(&t.id)
                && tx.send(RequestEvent::Token { token: t.token, text: t.text_delta, logprobs: t.logprobs }).is_err()
            {
                gone.push(t.id);
            }
        }
        for f in out.finished {
            let span = self.spans.remove(&f.id).unwrap_or_else(tracing::Span::none);
            let _entered = span.clone().entered();
            tracing::info!(reason = ?f.reason, generated = f.token_ids.len(), cached = f.cached_tokens, "finished");
            let push = self.push_on_finish.remove(&f.id);
            let kv = f.kv.and_then(|kv| self.offer(f.id, kv));
            if push
                && kv.is_some()
                && let Some(server) = &self.server
            {
                spawn_push(server, f.id, self.push.wait, self.push.delay, span.clone());
            }
            if let Some(tx) = self.streams.remove(&f.id) {
                let _ = tx.send(RequestEvent::Finished {
                    reason: f.reason.into(),
                    prompt_tokens: f.prompt_tokens,
                    cached_tokens: f.cached_tokens,
                    completion_tokens: f.token_ids.len(),
                    kv,
                });
            }
        }
        for id in gone {
            self.abort(id);
        }
        progressed
    }

    /// Offers a finished request's KV on the KV server; without one, frees it.
    fn offer(&mut self, id: RequestId, kv: KvPrefix) -> Option<KvSource> {
        let (Some(server), Some(addr)) = (&self.server, self.kv_addr) else {
            self.release(kv);
            return None;
        };
        let source = KvSource { addr, blocks: kv.blocks.iter().map(|b| b.0).collect(), tokens: kv.tokens };
        match server.offer(TransferId(id.0), kv.blocks.clone()) {
            Ok(()) => {
                tracing::info!(blocks = kv.blocks.len(), tokens = kv.tokens, "KV offered for the hand-off");
                self.handed_off.insert(id, kv);
                Some(source)
            }
            Err(e) => {
                tracing::error!(request = id.0, error = %e, "cannot offer KV for transfer");
                self.release(kv);
                None
            }
        }
    }

    fn cancel_lease(&mut self, id: RequestId) {
        // The server hands the blocks back through `Released` when it held a lease.
        if let Some(server) = &self.server {
            server.cancel(TransferId(id.0));
        }
    }

    fn abort(&mut self, id: RequestId) {
        self.streams.remove(&id);
        self.spans.remove(&id);
        self.push_on_finish.remove(&id);
        if let Some(aborted) = self.pulling.get_mut(&id) {
            *aborted = true;
        }
        if let Ok(Some(f)) = self.engine.abort(id)
            && let Some(kv) = f.kv
        {
            self.release(kv);
        }
        self.cancel_lease(id);
    }

    fn release(&mut self, kv: KvPrefix) {
        if let Err(e) = self.engine.release_kv(kv) {
            tracing::error!(error = %e, "releasing KV failed");
        }
    }
}
