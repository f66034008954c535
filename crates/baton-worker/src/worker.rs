//! A worker: one engine on its own thread, driven through a handle.
//!
//! The engine is synchronous and CPU-bound, so it runs on a dedicated thread that owns it (one
//! owner: no lock around the engine). Everything else talks to it through [`WorkerHandle`]:
//! commands go in over a channel, and each request's events come back over its own channel.
//! The thread is a thin driver of [`Sessions`], the per-request state machine
//! ([`crate::session`]): it turns commands, step outputs and transfer results into the
//! machine's events, performs the engine calls it asks for through [`Host`], and hands the
//! other actions to the transfer thread and the KV server. When a request's receiver is dropped
//! (the client went away), the machine aborts the request and frees its KV.
//!
//! KV moves between workers with `baton-transfer`'s protocol, pulled or pushed as each request
//! says ([`KvTransfer`]; the modes are described in [`crate::handoff`]):
//!
//! 1. A prefill worker finishes a prompt with its KV retained and offers the blocks on its
//!    [`KvServer`] under a lease; the request's `Finished` event names them ([`KvSource`]). In
//!    push mode it also starts pushing them, which waits for the decode worker's reservation.
//! 2. The decode worker reserves blocks of its own, and its transfer thread pulls into them, or
//!    registers them for the push and waits for it, with a [`baton_transfer::KvClient`] — over
//!    shared memory when the peer is on this host, else TCP — without stalling the engine's
//!    steps; then it COMPLETEs.
//! 3. COMPLETE (or the lease running out, or the conductor's [`Worker::release`]) hands the
//!    blocks back to the prefill engine through its [`BlockOwner`].
//!
//! The same three steps move a cached prefix between any two workers (MemServe's and
//! Mooncake's global KV pool): [`Worker::export_prefix`] takes the longest cached prefix of a
//! prompt from the holder's index (from any tier) and offers it under a lease of its own
//! ([`baton_protocol::wire::fetch_lease`]), and the request sent to the worker that computes the prompt
//! names it in its [`baton_protocol::wire::Work`]'s `fetch`: that worker pulls it, computes the rest, and
//! keeps the whole prefix in its own index afterwards. Every role receives, on a transfer thread
//! per peer ([`crate::handoff`]'s `Transfers`), so a slow peer holds up only its own jobs.
//!
//! Lifecycle: [`WorkerHandle::drain`] stops a worker taking work (new requests are answered
//! `Lost`, so the conductor runs them elsewhere) while it finishes what it holds;
//! [`WorkerHandle::idle`] resolves when nothing is left. An engine thread that dies (a panic)
//! marks the worker stopped: every request it held hears `Lost`, new ones too, its stats stop
//! answering, and [`WorkerHandle::stopped`] resolves so a `baton worker` process leaves
//! membership and exits non-zero.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use baton_engine::{Engine, GenerationRequest, KvPrefix, RequestId, StepOutput};
use baton_kv::BlockId;
use baton_transfer::{
    Access, BlockOwner, ClientConfig, Compat, KvServer, PeerId, Region, Release, ServerConfig, TransferId,
};
use tokio::sync::{mpsc, oneshot, watch};
use tracing::Instrument;

use crate::handoff::{EmulatedLink, LayerPusher, ThreadSetup, Transfers, spawn_push};
pub use crate::handoff::{KvTransfer, TransportChoice};
use crate::session::{Action, Host, SessionConfig, Sessions, Submission, TransferDone};
use baton_protocol::wire::{BlockEvent, CachedBlock, LoadReport, Received};
pub use baton_protocol::wire::{
    Finish, KvSource, RequestEvent, Role, StateUpdate, WorkRequest, WorkerError, WorkerStats,
};
pub use baton_protocol::worker::{SharedRole, Worker};

/// How a worker serves and fetches KV.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// How long handed-off KV is held when no one pulls or releases it.
    pub lease: Duration,
    /// The cluster secret KV peers must prove.
    pub secret: baton_cluster::ClusterSecret,
    /// Where the KV server listens (every role: hand-offs, and its cache to peers that fetch).
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
    /// Fault injection for tests: how long the transfer thread waits in the middle of pulling a
    /// fetched prefix, its transfer open on the holder (zero outside tests), so that a test can
    /// kill the holder mid-fetch.
    pub fetch_delay: Duration,
    /// Fault injection for tests: the engine thread panics before step number `n` (`None`
    /// outside tests), so that a test can watch a worker die.
    pub panic_at_step: Option<u64>,
    /// Fault injection for tests: the state stream leaves out the KV event with this sequence
    /// number (`None` outside tests), so that a test can watch the reader resynchronise.
    pub drop_event_seq: Option<u64>,
    /// TLS on the KV plane: the KV server speaks only TLS, and every pull, push and fetch from a
    /// peer checks the peer's certificate (`None`: plain TCP, authenticated by the secret).
    pub kv_tls: Option<baton_transfer::KvTls>,
    /// An emulated worker's network link (`--emulate-link-gbps`): what it receives is reported
    /// done no sooner than the emulated model's KV would have crossed it (`None`: as fast as the
    /// copy).
    pub link: Option<Arc<crate::handoff::EmulatedLink>>,
    /// Fault injection for tests: the worker refuses its first `n` role switches (0 outside
    /// tests; `BATON_FAULT_REFUSE_ROLE_SWITCHES` for `baton worker` processes), so that a test
    /// can watch a switch fail.
    pub refuse_role_switches: u32,
}

/// A role switch the worker refused (fault injection).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("fault injection: this worker refuses a role switch")]
pub struct RoleSwitchRefused;

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
        incoming: crate::session::Incoming,
        events: mpsc::UnboundedSender<RequestEvent>,
        /// The request's span (its ids), entered wherever the worker logs about it.
        span: tracing::Span,
    },
    Abort(RequestId),
    /// The conductor gives up a hand-off: end its lease now.
    Release(RequestId),
    /// The KV server ended a lease (COMPLETE, expiry or cancel): the blocks are ours again.
    Released(Release),
    /// The transfer thread finished a job.
    Transferred(Box<TransferDone>),
    /// Offer the longest cached prefix of `tokens` (whole blocks) to a peer under lease `lease`.
    Export {
        lease: RequestId,
        tokens: Vec<u32>,
        reply: oneshot::Sender<Option<KvSource>>,
    },
    /// Pull a peer's KV of `tokens` into the prefix cache (session `id`); its end on `events`.
    Import {
        id: RequestId,
        tokens: Vec<u32>,
        source: KvSource,
        events: mpsc::UnboundedSender<RequestEvent>,
    },
    Stats(oneshot::Sender<WorkerStats>),
    /// A new subscriber to the state stream; it gets a snapshot first.
    Subscribe(mpsc::Sender<StateUpdate>),
    /// Nothing to do but publish the state (the role changed).
    Nudge,
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
    /// What the conductor routes to this worker; its engine runs any kind of work, so a switch
    /// ([`WorkerHandle::set_role`]) changes only what is sent from then on.
    role: Arc<SharedRole>,
    commands: std::sync::mpsc::Sender<Command>,
    kv_addr: Option<SocketAddr>,
    capacity_blocks: usize,
    block_tokens: usize,
    /// Requests submitted and not finished: the load figure routing reads without a round trip.
    in_flight: AtomicUsize,
    /// Taking no new work.
    draining: AtomicBool,
    /// Fault injection for tests: role switches still to refuse.
    refuse_role_switches: AtomicU32,
    /// Why the engine thread stopped, once it has (`None` while it runs).
    stopped: watch::Receiver<Option<String>>,
    /// The engine thread, joined when the last handle goes.
    thread: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl std::fmt::Debug for WorkerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerHandle").field("name", &self.inner.name).field("role", &self.inner.role.get()).finish()
    }
}

/// A meter's counters as the wire carries them.
fn kv_copy_bytes(meter: &baton_kv::CopyMeter) -> baton_protocol::KvCopyBytes {
    let c = meter.snapshot();
    baton_protocol::KvCopyBytes {
        device_to_host: c.device_to_host,
        host_to_device: c.host_to_device,
        device_to_device: c.device_to_device,
    }
}

fn io_error(context: &str, e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(format!("{context}: {e}"))
}

/// Reports the engine thread's end, however it ends (its `Drop` runs while a panic unwinds).
struct Lifeline(watch::Sender<Option<String>>);

impl Drop for Lifeline {
    fn drop(&mut self) {
        let why = if std::thread::panicking() { "its engine thread panicked" } else { "it stopped" };
        self.0.send_replace(Some(why.to_owned()));
    }
}

impl WorkerHandle {
    /// Starts a worker thread that owns `engine`, with a KV server over the engine's arena (its
    /// hand-offs and exports) and transfer threads, one per peer (what it receives), whatever its
    /// role.
    pub fn spawn(name: impl Into<String>, role: Role, engine: Engine, options: WorkerOptions) -> std::io::Result<Self> {
        let mut engine = engine;
        let name = name.into();
        let (tx, rx) = std::sync::mpsc::channel();
        let arena = engine.kv().handle();
        let peer = PeerId(u64::from(engine.config().instance.0));
        // Every role serves KV: prefill workers their hand-offs, any worker its cache to a peer
        // that fetches from it.
        // The engine's device arena, which peers on this host may open and copy device to
        // device (a GPU engine's, or the stand-in device's: `--device stand-in`).
        let device: Option<Arc<dyn baton_transfer::DeviceArena>> = match engine.device_arena() {
            Some(Ok(device)) => Some(device),
            Some(Err(e)) => {
                tracing::warn!(error = %e, "the device KV arena cannot be shared: KV moves through host memory");
                None
            }
            None => None,
        };
        let server = {
            let arena = arena.as_ref().ok_or_else(|| io_error("KV server", "the engine's arena cannot be shared"))?;
            let region = Region::from_arena(arena, Access::ReadOnly)?;
            let config = ServerConfig {
                bind: options.kv_bind,
                lease: options.lease,
                io_timeout: options.io_timeout,
                tls: options.kv_tls.as_ref().map(|t| Arc::clone(&t.server)),
                device: device.clone(),
                meter: Arc::clone(engine.copy_meter()),
                ..ServerConfig::new(peer, options.compat.clone(), options.secret.expose())
            };
            let owner = LoopOwner(std::sync::Mutex::new(tx.clone()));
            let server = KvServer::start(config, region, owner).map_err(|e| io_error("starting the KV server", e))?;
            Some(Arc::new(server))
        };
        // Every role receives KV: decode workers their hand-offs, any worker a fetched prefix.
        let received_corrupt = Arc::new(AtomicU64::new(0));
        let transfers = {
            let arena = arena.as_ref().ok_or_else(|| io_error("KV client", "the engine's arena cannot be shared"))?;
            let local = Arc::new(Region::from_arena(arena, Access::ReadWrite)?);
            let config = ClientConfig {
                io_timeout: options.io_timeout,
                tls: options.kv_tls.as_ref().map(|t| Arc::clone(&t.client)),
                device,
                meter: Arc::clone(engine.copy_meter()),
                ..ClientConfig::new(peer, options.compat.clone(), options.secret.expose())
            };
            let engine_thread = std::sync::Mutex::new(tx.clone());
            let back: crate::handoff::Report = Arc::new(move |done: TransferDone| {
                let back = engine_thread.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                back.send(Command::Transferred(Box::new(done))).is_ok()
            });
            let setup = ThreadSetup {
                local,
                config,
                transport: options.transport,
                fetch_delay: options.fetch_delay,
                layerwise_wait: options.lease,
                link: options.link.clone(),
                back,
                corrupt: Arc::clone(&received_corrupt),
            };
            Some(Transfers::new(&name, setup))
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
        // Layer-wise pushes go out as the engine writes each layer (`--kv-transfer layerwise`).
        let pusher = match &server {
            Some(server) => {
                let link = options.link.as_deref().map(EmulatedLink::idle_twin);
                let pusher = LayerPusher::spawn(&name, server, push.wait, push.delay, link)?;
                engine.set_kv_stream(Box::new(pusher.clone()));
                Some(pusher)
            }
            None => None,
        };
        let sessions =
            Sessions::new(SessionConfig { incoming_wait: options.lease / 2, can_receive: transfers.is_some() });
        let (life_tx, life_rx) = watch::channel(None);
        let (panic_at_step, drop_event_seq) = (options.panic_at_step, options.drop_event_seq);
        let role = Arc::new(SharedRole::new(role));
        let published_role = Arc::clone(&role);
        let thread = std::thread::Builder::new().name(format!("baton-{name}")).spawn(move || {
            let _lifeline = Lifeline(life_tx);
            EngineLoop {
                host: EngineHost { engine, server, kv_addr, received_corrupt },
                sessions,
                push,
                pusher,
                transfers,
                steps: 0,
                panic_at_step,
                state: StatePublisher::new(drop_event_seq, published_role),
            }
            .run(rx);
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
                draining: AtomicBool::new(false),
                refuse_role_switches: AtomicU32::new(options.refuse_role_switches),
                stopped: life_rx,
                thread: std::sync::Mutex::new(Some(thread)),
            }),
        })
    }

    /// Where this worker's KV server listens (every role has one).
    pub fn kv_addr(&self) -> Option<SocketAddr> {
        self.inner.kv_addr
    }

    /// Aborts a request.
    pub fn abort(&self, id: u64) {
        let _ = self.inner.commands.send(Command::Abort(RequestId(id)));
    }

    /// Switches the worker's role: what the conductor routes to it from now on. Work it holds
    /// runs to its end whatever the switch (its engine prefills and decodes alike), hand-offs
    /// routed to it before the switch included; the state stream reports the new role at once.
    /// Refused only by fault injection ([`WorkerOptions::refuse_role_switches`]).
    pub fn set_role(&self, role: Role) -> Result<(), RoleSwitchRefused> {
        let refuse = |n: u32| n.checked_sub(1);
        if self.inner.refuse_role_switches.fetch_update(Ordering::SeqCst, Ordering::SeqCst, refuse).is_ok() {
            tracing::warn!(worker = self.inner.name, role = role.as_str(), "fault injection: a role switch is refused");
            return Err(RoleSwitchRefused);
        }
        let old = self.inner.role.swap(role);
        if old != role {
            tracing::info!(worker = self.inner.name, from = old.as_str(), to = role.as_str(), "role switched");
            // Wakes the engine thread, which reports the new role in its next load.
            let _ = self.inner.commands.send(Command::Nudge);
        }
        Ok(())
    }

    /// Stops taking work: new requests are answered `Lost` (the conductor runs them elsewhere)
    /// while the ones held run to their end. Cannot be undone.
    pub fn drain(&self) {
        if !self.inner.draining.swap(true, Ordering::SeqCst) {
            tracing::info!(worker = self.inner.name, "draining: finishing what this worker holds, taking nothing new");
        }
    }

    /// Whether the worker is draining.
    pub fn is_draining(&self) -> bool {
        self.inner.draining.load(Ordering::SeqCst)
    }

    /// Resolves when the worker holds nothing (no request running, waiting, receiving KV or
    /// leasing it), or at once when its engine thread stopped.
    pub async fn idle(&self) {
        let mut stopped = self.inner.stopped.clone();
        loop {
            if stopped.borrow().is_some() {
                return;
            }
            if self.stats().await.is_some_and(|s| s.is_idle()) && self.in_flight() == 0 {
                return;
            }
            tokio::select! {
                _ = stopped.changed() => {}
                () = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
        }
    }

    /// Why the engine thread stopped, if it has.
    pub fn stop_reason(&self) -> Option<String> {
        self.inner.stopped.borrow().clone()
    }

    /// Resolves with the reason when the engine thread stops (a panic, or the last handle gone).
    pub async fn stopped(&self) -> String {
        let mut rx = self.inner.stopped.clone();
        loop {
            if let Some(why) = rx.borrow_and_update().clone() {
                return why;
            }
            if rx.changed().await.is_err() {
                return "it stopped".to_owned();
            }
        }
    }
}

#[async_trait::async_trait]
impl Worker for WorkerHandle {
    fn name(&self) -> &str {
        &self.inner.name
    }

    fn role(&self) -> Role {
        self.inner.role.get()
    }

    async fn set_role(&self, role: Role, _deadline: Duration) -> Result<(), String> {
        WorkerHandle::set_role(self, role).map_err(|e| e.to_string())
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight.load(Ordering::Relaxed)
    }

    fn kv_addr(&self) -> Option<SocketAddr> {
        self.inner.kv_addr
    }

    fn submit(&self, req: WorkRequest) -> mpsc::UnboundedReceiver<RequestEvent> {
        let (tx, rx) = mpsc::unbounded_channel();
        let span = req.span(&self.inner.name, self.inner.role.get());
        let _entered = span.enter();
        tracing::info!(
            prompt_tokens = req.prompt.len(),
            part = req.work.part(),
            fetches_tokens = req.work.fetch().map(|f| f.tokens),
            "work submitted"
        );
        let (req, incoming) = crate::session::Incoming::of(req);
        if let Some(why) = self.stop_reason() {
            let _ = tx.send(RequestEvent::Lost { reason: format!("worker {} has stopped: {why}", self.inner.name) });
            return rx;
        }
        if self.is_draining() {
            let _ = tx.send(RequestEvent::Lost { reason: format!("worker {} is draining", self.inner.name) });
            return rx;
        }
        self.inner.in_flight.fetch_add(1, Ordering::Relaxed);
        let guard = InFlight(self.inner.clone());
        let (ftx, frx) = mpsc::unbounded_channel();
        if self
            .inner
            .commands
            .send(Command::Submit { req: Box::new(req), incoming, events: ftx, span: span.clone() })
            .is_err()
        {
            let _ = tx.send(RequestEvent::Lost { reason: format!("worker {} has stopped", self.inner.name) });
            return rx;
        }
        // Forward events, counting the request out when it ends however it ends.
        tokio::spawn(forward(frx, tx, guard).instrument(span.clone()));
        rx
    }

    fn release(&self, id: u64) {
        let _ = self.inner.commands.send(Command::Release(RequestId(id)));
    }

    async fn import_prefix(&self, id: u64, tokens: Vec<u32>, source: KvSource, deadline: Duration) -> Option<Received> {
        if self.stop_reason().is_some() || self.is_draining() {
            return None;
        }
        let (events, mut rx) = mpsc::unbounded_channel();
        self.inner.commands.send(Command::Import { id: RequestId(id), tokens, source, events }).ok()?;
        match tokio::time::timeout(deadline, rx.recv()).await.ok()?? {
            RequestEvent::Finished { received, .. } => received,
            _ => None,
        }
    }

    async fn export_prefix(&self, lease: u64, tokens: &[u32], deadline: Duration) -> Option<KvSource> {
        if self.stop_reason().is_some() || self.is_draining() {
            return None;
        }
        let (reply, rx) = oneshot::channel();
        let export = Command::Export { lease: RequestId(lease), tokens: tokens.to_vec(), reply };
        self.inner.commands.send(export).ok()?;
        tokio::time::timeout(deadline, rx).await.ok()?.ok()?
    }

    fn capacity_blocks(&self) -> usize {
        self.inner.capacity_blocks
    }

    fn block_tokens(&self) -> usize {
        self.inner.block_tokens
    }

    fn subscribe_state(&self) -> Option<mpsc::Receiver<StateUpdate>> {
        let (tx, rx) = mpsc::channel(STATE_BACKLOG);
        self.inner.commands.send(Command::Subscribe(tx)).ok()?;
        Some(rx)
    }

    async fn stats(&self) -> Option<WorkerStats> {
        let (tx, rx) = oneshot::channel();
        self.inner.commands.send(Command::Stats(tx)).ok()?;
        let stats = tokio::time::timeout(Duration::from_secs(5), rx).await.ok()?.ok()?;
        Some(WorkerStats { draining: self.is_draining(), ..stats })
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The KV server's owner and the transfer thread hold senders too, so the channel
        // would never close on its own.
        let _ = self.commands.send(Command::Shutdown);
        let thread = self.thread.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        // Joined off the caller's thread: the engine may be mid-step, and the last handle may
        // be dropped on an async runtime.
        if let Some(thread) = thread {
            let _ = std::thread::Builder::new().name("baton-join".into()).spawn(move || {
                if thread.join().is_err() {
                    tracing::error!("an engine thread had panicked");
                }
            });
        }
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
        // Dropping `from` tells the engine thread that the client went away, which aborts the
        // request (and tells a transfer in flight that its request is cancelled).
        let e = tokio::select! {
            e = from.recv() => e,
            () = to.closed() => return,
        };
        let Some(e) = e else {
            // The engine thread dropped the sender without a last event: it died.
            let _ = to.send(RequestEvent::Lost { reason: "the worker's engine thread stopped".into() });
            return;
        };
        let last = e.is_last();
        if to.send(e).is_err() || last {
            return;
        }
    }
}

/// What the session machine asks of the engine thread: the engine and the KV server's offer.
struct EngineHost {
    engine: Engine,
    server: Option<Arc<KvServer>>,
    /// The KV server's advertised address.
    kv_addr: Option<SocketAddr>,
    /// KV blocks the transfer threads received damaged (their checksums failed).
    received_corrupt: Arc<AtomicU64>,
}

impl Host for EngineHost {
    fn add_request(&mut self, req: GenerationRequest) -> Result<(), WorkerError> {
        self.engine.add_request(req).map_err(WorkerError::from)
    }

    fn abort(&mut self, id: RequestId) -> Option<KvPrefix> {
        self.engine.abort(id).ok().flatten().and_then(|f| f.kv)
    }

    fn reserve_kv(&mut self, known: &[u32], tokens: usize) -> Option<(KvPrefix, usize)> {
        self.engine.reserve_kv_reusing(known, tokens).ok()
    }

    fn release_kv(&mut self, kv: KvPrefix) {
        if let Err(e) = self.engine.release_kv(kv) {
            tracing::error!(error = %e, "releasing KV failed");
        }
    }

    fn arrived_on_device(&mut self, blocks: &[BlockId]) {
        self.engine.kv_arrived_on_device(blocks);
    }

    fn import_kv(&mut self, tokens: &[u32], kv: KvPrefix) {
        match self.engine.import_kv(tokens, kv) {
            Ok(blocks) => tracing::info!(blocks, "imported KV into the prefix cache"),
            Err(e) => tracing::error!(error = %e, "importing KV failed"),
        }
    }

    fn available_blocks(&self) -> usize {
        self.engine.available_blocks()
    }

    fn running(&self) -> usize {
        self.engine.queue_lengths().0
    }

    fn block_size(&self) -> usize {
        self.engine.config().block_size
    }

    fn offer(&mut self, id: RequestId, blocks: &[BlockId]) -> Option<SocketAddr> {
        let (server, addr) = (self.server.as_ref()?, self.kv_addr?);
        // A peer may read either copy of the blocks (the host's over shared memory or TCP, the
        // device's device to device): both must hold the KV.
        if let Err(e) = self.engine.settle_kv(blocks) {
            tracing::error!(request = id.0, error = %e, "cannot settle KV for transfer");
            return None;
        }
        match server.offer(TransferId(id.0), blocks.to_vec()) {
            Ok(()) => Some(addr),
            Err(e) => {
                tracing::error!(request = id.0, error = %e, "cannot offer KV for transfer");
                None
            }
        }
    }
}

/// The engine thread: a driver of the session machine.
struct EngineLoop {
    host: EngineHost,
    sessions: Sessions<mpsc::UnboundedSender<RequestEvent>>,
    push: PushOptions,
    /// Layer-wise pushes (a handle on the thread the engine streams KV to).
    pusher: Option<LayerPusher>,
    transfers: Option<Transfers>,
    steps: u64,
    panic_at_step: Option<u64>,
    state: StatePublisher,
}

/// Updates of the state stream a slow reader may have queued before the worker stops sending
/// deltas (and sends a snapshot once there is room again).
const STATE_BACKLOG: usize = 256;
/// Events kept for a reader that does not take them before they are dropped for a snapshot.
const STATE_MAX_PENDING: usize = 1 << 16;
/// Longest a changed load goes unreported while the engine is busy.
const LOAD_EVERY: Duration = Duration::from_millis(20);

/// The engine thread's side of the state streams: drains the pool's KV events into deltas for
/// each subscriber, with the load; a snapshot when a subscriber arrives or fell too far behind.
struct StatePublisher {
    subscribers: Vec<Subscriber>,
    /// The worker's role, reported with its load.
    role: Arc<SharedRole>,
    /// Exponential moving average of a step's time, µs.
    step_us: f64,
    /// The same over steps that ran no prefill chunk, with their batch and context.
    decode_steps: DecodeSteps,
    drop_event_seq: Option<u64>,
}

/// Moving means over decode-only steps (steps that ran no prefill chunk): time, batch and
/// context together, so the conductor can set the time beside the cost model's prediction for
/// the same work (the model is linear in batch and context, so the prediction for the mean
/// batch and context is the mean prediction).
#[derive(Debug, Clone, Copy, Default)]
struct DecodeSteps {
    us: f64,
    batch: f64,
    context: f64,
}

impl DecodeSteps {
    fn record(&mut self, us: f64, batch: usize, context: usize) {
        let (b, c) = (batch as f64, context as f64);
        if self.us == 0.0 {
            *self = Self { us, batch: b, context: c };
        } else {
            self.us = 0.9 * self.us + 0.1 * us;
            self.batch = 0.9 * self.batch + 0.1 * b;
            self.context = 0.9 * self.context + 0.1 * c;
        }
    }
}

/// One reader of the state stream (a conductor, or a conductor's resubscription).
struct Subscriber {
    tx: mpsc::Sender<StateUpdate>,
    snapshot_due: bool,
    pending: Vec<BlockEvent>,
    last_load: Option<LoadReport>,
    last_sent: Instant,
}

impl StatePublisher {
    fn new(drop_event_seq: Option<u64>, role: Arc<SharedRole>) -> Self {
        Self { subscribers: Vec::new(), role, step_us: 0.0, decode_steps: DecodeSteps::default(), drop_event_seq }
    }

    fn subscribe(&mut self, tx: mpsc::Sender<StateUpdate>) {
        self.subscribers.push(Subscriber {
            tx,
            snapshot_due: true,
            pending: Vec::new(),
            last_load: None,
            last_sent: Instant::now(),
        });
    }

    fn record_step(&mut self, took: Duration, out: Option<&StepOutput>) {
        let us = took.as_secs_f64() * 1e6;
        self.step_us = if self.step_us == 0.0 { us } else { 0.9 * self.step_us + 0.1 * us };
        if let Some(o) = out
            && o.decode_batch > 0
            && o.computed_tokens == o.decode_batch
        {
            self.decode_steps.record(us, o.decode_batch, o.decode_context);
        }
    }

    /// Sends each subscriber what changed; `busy` (the engine has work) lets a changed load wait
    /// a little. Without subscribers the events are dropped (the pool's buffer stays empty).
    fn publish(&mut self, engine: &mut Engine, counts: crate::session::Counts, busy: bool) {
        let mut events: Vec<BlockEvent> = engine.drain_kv_events().iter().map(BlockEvent::from).collect();
        if let Some(drop) = self.drop_event_seq
            && let Some(at) = events.iter().position(|e| e.seq == drop)
        {
            tracing::warn!(seq = drop, "fault injection: a KV event is left out of the state stream");
            events.remove(at);
        }
        self.subscribers.retain(|s| !s.tx.is_closed());
        if self.subscribers.is_empty() {
            return;
        }
        let load = self.load(engine, counts);
        let mut snapshot = None;
        for sub in &mut self.subscribers {
            if !sub.snapshot_due {
                sub.pending.extend_from_slice(&events);
                if sub.pending.len() > STATE_MAX_PENDING {
                    sub.pending.clear();
                    sub.snapshot_due = true;
                }
            }
            let load_changed = sub.last_load.as_ref() != Some(&load);
            let due = sub.snapshot_due
                || !sub.pending.is_empty()
                || (load_changed && (!busy || sub.last_sent.elapsed() >= LOAD_EVERY));
            if !due {
                continue;
            }
            let at_ms = baton_cluster::unix_millis();
            let update = if sub.snapshot_due {
                let (next_seq, blocks) = snapshot.get_or_insert_with(|| {
                    let (next_seq, entries) = engine.kv_index_snapshot();
                    let blocks: Vec<CachedBlock> = entries
                        .into_iter()
                        .map(|(h, e)| CachedBlock { hash: h.0, parent: e.parent.map(|p| p.0), tier: e.tier.into() })
                        .collect();
                    (next_seq, blocks)
                });
                StateUpdate::Snapshot { next_seq: *next_seq, blocks: blocks.clone(), load: load.clone(), at_ms }
            } else {
                StateUpdate::Delta { events: std::mem::take(&mut sub.pending), load: load.clone(), at_ms }
            };
            match sub.tx.try_send(update) {
                Ok(()) => {
                    sub.snapshot_due = false;
                    sub.last_load = Some(load.clone());
                    sub.last_sent = Instant::now();
                }
                // A slow reader: keep its events (bounded), or start it over with a snapshot.
                Err(mpsc::error::TrySendError::Full(StateUpdate::Delta { events, .. })) => sub.pending = events,
                Err(_) => {}
            }
        }
    }

    fn load(&self, engine: &Engine, counts: crate::session::Counts) -> LoadReport {
        let l = engine.load();
        LoadReport {
            running: l.running,
            waiting: l.waiting,
            queued_prefill_tokens: l.queued_prefill_tokens,
            decode_contexts: l.decode_contexts,
            incoming: counts.queued,
            receiving: counts.receiving,
            leased: counts.leased,
            free_blocks: l.free_blocks,
            cached_blocks: l.cached_blocks,
            evictable_blocks: l.evictable_blocks,
            total_blocks: l.total_blocks,
            step_time_us: self.step_us as u64,
            decode_step_us: self.decode_steps.us as u64,
            decode_step_batch: self.decode_steps.batch,
            decode_step_context: self.decode_steps.context,
            role: Some(self.role.get()),
        }
    }
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
            let busy = self.host.engine.has_work();
            let first = if busy && !stalled {
                rx.try_recv().map_err(|e| matches!(e, std::sync::mpsc::TryRecvError::Disconnected))
            } else {
                let wait = if stalled || self.sessions.has_queued() { STALL_WAIT } else { IDLE_WAIT };
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
            self.sessions.tick(&mut self.host, Instant::now());
            if !self.perform() {
                break;
            }
            stalled = self.host.engine.has_work() && !self.step();
            if !self.perform() {
                break;
            }
            let busy = self.host.engine.has_work();
            self.state.publish(&mut self.host.engine, self.sessions.counts(), busy);
        }
        self.sessions.stop(&mut self.host, "the worker stopped");
        // A push still running holds the server; it stops when that push ends.
        if let Some(server) = self.host.server.take().and_then(|s| Arc::try_unwrap(s).ok()) {
            server.shutdown();
        }
    }

    /// Handles a command; `false` means stop.
    fn handle(&mut self, cmd: Command) -> bool {
        let host = &mut self.host;
        match cmd {
            Command::Shutdown => return false,
            Command::Submit { req, incoming, events, span } => {
                let crate::session::Incoming { source, mode, push } = incoming;
                let submission = Submission { req: *req, source, mode, push, sink: events, span };
                self.sessions.submit(host, Instant::now(), submission);
            }
            Command::Import { id, tokens, source, events } => {
                self.sessions.import(host, Instant::now(), id, tokens, source, events);
            }
            Command::Export { lease, tokens, reply } => {
                let source = host.engine.export_prefix(&tokens).and_then(|kv| {
                    // No one listens to an export: it has no events, only a lease.
                    let (sink, _) = mpsc::unbounded_channel();
                    self.sessions.export(host, lease, kv, sink)
                });
                if let Some(s) = &source {
                    tracing::info!(
                        lease = lease.0,
                        blocks = s.blocks.len(),
                        tokens = s.tokens,
                        "cached prefix offered to a peer"
                    );
                }
                let _ = reply.send(source);
            }
            Command::Transferred(done) => self.sessions.transfer_done(host, *done),
            Command::Abort(id) => self.sessions.abort(host, id),
            Command::Release(id) => self.sessions.release(host, id),
            Command::Released(release) => self.sessions.lease_ended(host, RequestId(release.id.0)),
            Command::Subscribe(tx) => self.state.subscribe(tx),
            Command::Nudge => {}
            Command::Stats(reply) => {
                let (running, waiting) = host.engine.queue_lengths();
                let counts = self.sessions.counts();
                let _ = reply.send(WorkerStats {
                    running,
                    waiting,
                    pulling: counts.receiving,
                    incoming: counts.queued,
                    available_blocks: host.engine.available_blocks(),
                    total_blocks: host.engine.config().num_blocks,
                    leased: counts.leased,
                    draining: false,
                    corrupt_blocks: host.engine.pool().corrupt_blocks() + host.received_corrupt.load(Ordering::Relaxed),
                    kv_copy_bytes: kv_copy_bytes(host.engine.copy_meter()),
                });
            }
        }
        self.perform()
    }

    /// Performs the machine's actions; `false` when a thread it needs is gone.
    fn perform(&mut self) -> bool {
        for action in self.sessions.ready() {
            match action {
                Action::Transfer(job) => {
                    // Without transfer threads the job drops here, and its blocks with it.
                    let Some(transfers) = &mut self.transfers else { continue };
                    if let Err(job) = transfers.send(job) {
                        // No thread for its peer: the request recomputes what it would receive.
                        let failure = crate::session::TransferFailure::Peer("no transfer thread".into());
                        self.sessions.transfer_done(&mut self.host, (*job).done(Err(failure)));
                    }
                }
                Action::Push { id, span } => {
                    if let Some(server) = &self.host.server {
                        spawn_push(server, id, self.push.wait, self.push.delay, span);
                    }
                }
                Action::EndPush { id, tokens, span } => {
                    if let Some(pusher) = &self.pusher {
                        pusher.end(id, tokens, span);
                    }
                }
                Action::CancelLease(id) => {
                    // The server hands the blocks back through `Released` when it held a lease.
                    if let Some(server) = &self.host.server {
                        server.cancel(TransferId(id.0));
                    }
                }
            }
        }
        true
    }

    /// Runs one engine step; `false` when it made no progress (everything waits for blocks).
    fn step(&mut self) -> bool {
        self.steps += 1;
        if self.panic_at_step.is_some_and(|n| self.steps >= n) {
            panic!("fault injection: the engine thread panics at step {}", self.steps);
        }
        let started = Instant::now();
        let stepped = self.host.engine.step();
        self.state.record_step(started.elapsed(), stepped.as_ref().ok());
        match stepped {
            Ok(out) => {
                let progressed = out.computed_tokens > 0 || out.preempted > 0 || !out.finished.is_empty();
                self.sessions.step_output(&mut self.host, out);
                progressed
            }
            Err(e) => {
                // A failed step is a bug or a model failure: fail everything in it.
                tracing::error!(error = %e, "engine step failed");
                self.sessions.step_failed(&mut self.host, &e.to_string());
                true
            }
        }
    }
}
