//! The KV hand-off from a prefill worker to a decode worker, in `baton-transfer`'s two modes.
//!
//! The conductor picks the mode (`--kv-transfer pull|push|layerwise` on `baton serve` and `baton
//! conductor`) and names it in both halves of every disaggregated request ([`KvTransfer`] in
//! [`WorkRequest`](crate::worker::WorkRequest)); every worker supports all three, so the choice
//! lives in one place and a cluster needs no per-worker configuration. Each mode has one path:
//!
//! - **Pull** (KVDirect's default). The prefill worker finishes the prompt and its first token
//!   and offers the blocks on its [`KvServer`] under a lease. The decode worker's engine thread
//!   reserves blocks; its transfer thread reads the prefill blocks into them (TRANSFER,
//!   coalesced reads) and COMPLETEs.
//! - **Push** (DESIGN.md: "decode reserves blocks first, prefill writes into them"). The
//!   prefill worker offers the blocks the same way and starts a push (`spawn_push`): it waits
//!   for the decode worker's reservation. The decode worker's engine thread reserves blocks;
//!   its transfer thread registers them with the prefill worker's KV server (TRANSFER in push
//!   mode, [`KvClient::begin_push`]). The push then writes every layer into them — a one-sided
//!   copy into the decode worker's mapped arena over shared memory, WRITE frames over TCP —
//!   and reports the last layer; the decode worker COMPLETEs.
//! - **Layer-wise push** (Mooncake §4, KVDirect §4: the transfer overlapped with the prefill).
//!   The conductor hands the decode worker its half when it hands the prefill worker the prompt,
//!   naming the prefill worker's KV server and the prompt's length but no blocks (there are none
//!   yet). The decode worker reserves and registers its blocks as in push mode. The prefill
//!   worker's engine streams the KV ([`baton_engine::KvStream`], `LayerPusher`): as each layer
//!   of each prompt chunk is written, that layer of the blocks the chunk completed goes out
//!   ([`KvServer::push_blocks`]), while the later layers compute. When the prefill is done its
//!   KV is offered under a lease as in the other modes, and the last write (a PUSHED with a
//!   trailer, [`KvServer::finish_layers`]) carries the first token, which the decode worker
//!   continues from. The decode worker holds its blocks while the prompt computes: that memory
//!   is the price of hiding the transfer (KVDirect's argument for pulling by default). So the
//!   conductor reserves early only when the prefill worker prefills nothing else for it; a
//!   request that would queue there is handed over by pull after its prefill.
//!
//! Either way COMPLETE ends the prefill side's lease (its blocks go back to its engine), and the
//! decode worker's engine admits the request with the received KV as its prefix, continuing from
//! the first token the prefill worker sampled (the conductor streamed it already).
//!
//! Failures, in every mode: a dead or slow peer ends the transfer (the decode side's wait is
//! bounded by its I/O timeout; the prefill side's push gives up when its lease ends, which the
//! conductor's release or the lease's expiry does), and the decode worker then recomputes the
//! prompt itself. A layer-wise hand-off's decode worker has no first token to recompute from:
//! it gives the request back ([`WorkerError::Handoff`](baton_protocol::wire::WorkerError::Handoff)),
//! and the conductor hands it over again with the first token, pulled from the lease or
//! recomputed. Its wait is the lease's for the first write (the prefill may queue), then the I/O
//! timeout from each write. Nothing stays held: the decode side's reserved blocks travel in the
//! [`KvJob`] and are freed when the job is dropped (or come back with its [`TransferDone`]),
//! and the prefill side's blocks come back when the lease ends. A pushed-into block is freed only
//! once the prefill side provably writes no more into it: after the answer to COMPLETE
//! ([`KvClient::cancel_push`]), or after the connection closed on both ends
//! ([`KvClient::close`]); and every write names the reservation's generation, so a late one
//! for an earlier reservation is refused rather than written.
//!
//! An emulated worker with `--emulate-link-gbps` receives over an [`EmulatedLink`]: a transfer
//! it receives is reported done no sooner than the emulated model's KV would have crossed the
//! link, queued behind the transfers before it (or at once when its request is cancelled). Without it, an emulated hand-off moves only the
//! emulated arena's few bytes and costs microseconds.
//!
//! This module knows nothing of the worker: it takes jobs from [`crate::session`] and reports
//! their ends through a callback; [`crate::worker`] wires it to the engine thread.
//!
//! Fault injection for tests: [`WorkerOptions::push_delay`](crate::WorkerOptions::push_delay)
//! (for `baton worker` processes, the `BATON_FAULT_PUSH_DELAY_MS` environment variable) makes a
//! prefill worker wait before each push, so a test can kill a worker mid-push;
//! [`WorkerOptions::fetch_delay`](crate::WorkerOptions::fetch_delay) (`BATON_FAULT_FETCH_DELAY_MS`)
//! makes a worker wait in the middle of pulling a fetched prefix, so a test can kill the holder
//! mid-fetch.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::time::{Duration, Instant};

use baton_engine::{KvPiece, KvStream, RequestId};
use baton_kv::{BlockId, Dim};
use baton_transfer::{ClientConfig, KvClient, KvServer, Region, TransferError, TransferId, TransferStats};

use crate::session::{KvJob, TransferDone, TransferFailure};
pub use baton_protocol::wire::KvTransfer;

/// How a decode worker reaches prefill workers' KV: the transfer plane's choice (the fastest
/// path the two workers share, found at CONNECT, unless one is insisted on).
pub use baton_transfer::TransportChoice;

/// An emulated worker's network link (`--emulate-link-gbps`): the KV an emulated worker
/// receives is the emulated arena's few bytes a token, which shared memory copies in
/// microseconds; a GPU instance receives the real model's KV (the cost profile's
/// `kv_bytes_per_token`) over its NIC. So a transfer this worker receives (a hand-off pulled or
/// pushed, a fetched prefix, an import) is reported done no sooner than the real bytes would
/// have crossed the link since it began, behind whatever crossed before it: one link per
/// receiving worker, its transfers queued on it. Its transfer threads share it.
#[derive(Debug)]
pub struct EmulatedLink {
    link: baton_sched::Link,
    /// The emulated model's KV bytes per token.
    kv_bytes_per_token: u64,
    /// When the link is free again.
    free_at: std::sync::Mutex<Option<Instant>>,
}

impl EmulatedLink {
    /// A link of `link`'s bandwidth and latency, carrying `kv_bytes_per_token` bytes a token.
    pub fn new(link: baton_sched::Link, kv_bytes_per_token: u64) -> Self {
        Self { link, kv_bytes_per_token, free_at: std::sync::Mutex::new(None) }
    }

    /// The same link, idle: a worker sends over one and receives over another (a NIC is full
    /// duplex).
    pub fn idle_twin(&self) -> Self {
        Self::new(self.link, self.kv_bytes_per_token)
    }

    /// When the KV of `tokens` tokens, received in a transfer that began at `started`, has
    /// crossed the link: after the transfers before it; the link is busy until then.
    pub fn reserve(&self, started: Instant, tokens: usize) -> Instant {
        self.reserve_share(started, tokens, 1)
    }

    /// [`reserve`](Self::reserve) for one of `parts` equal parts of the KV of `tokens` tokens
    /// (one layer of a model of `parts` layers).
    pub fn reserve_share(&self, started: Instant, tokens: usize, parts: usize) -> Instant {
        let bytes = (tokens as u64).saturating_mul(self.kv_bytes_per_token) / parts.max(1) as u64;
        let took = Duration::from_micros(baton_sched::transfer_time(bytes, self.link));
        let mut free_at = self.free_at.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let begin = free_at.map_or(started, |f| f.max(started));
        let end = begin + took;
        *free_at = Some(end);
        end
    }
}

/// A received transfer still crossing an emulated link: reported at `end`, or at once when its
/// request is cancelled (a client gone), so a slow link never holds the reserved blocks of a
/// request no one waits for.
struct Crossing {
    end: Instant,
    job: KvJob,
    stats: TransferStats,
}

/// How often the transfer thread looks at its pushes in flight (and at new jobs meanwhile).
const POLL: Duration = Duration::from_millis(5);

/// How often an idle transfer thread looks for peers that are gone
/// ([`TransferThread::reap_exited`]).
const REAP_EVERY: Duration = Duration::from_secs(1);

/// The id the KV's holder offers it under: the request's own for a hand-off, the export's lease
/// for a fetched prefix.
fn transfer_id(job: &KvJob) -> TransferId {
    TransferId(job.source.lease.unwrap_or(job.id.0))
}

/// Where the transfer threads send each job's end; `false` when no one listens any more.
pub(crate) type Report = Arc<dyn Fn(TransferDone) -> bool + Send + Sync>;

/// How long a peer's transfer thread is kept without a job for it: after that its sender is
/// dropped and the thread ends once its queue is empty (the next job from that peer starts
/// another), so threads of peers that left do not pile up.
const PEER_IDLE: Duration = Duration::from_secs(60);

/// A worker's transfer threads: one per peer KV server, started on its first job, so a slow or
/// silent peer delays only the jobs that read from it. (With one thread for every peer, a
/// frozen prefill worker held every hand-off to this worker until the I/O timeout.)
pub(crate) struct Transfers {
    name: String,
    setup: ThreadSetup,
    /// Per peer: its thread's queue and when it was last given a job.
    threads: HashMap<SocketAddr, (Sender<KvJob>, Instant)>,
}

/// What each of a worker's transfer threads is started with.
#[derive(Clone)]
pub(crate) struct ThreadSetup {
    /// The worker's arena, written into.
    pub(crate) local: Arc<Region>,
    /// The KV client's settings.
    pub(crate) config: ClientConfig,
    /// Shared memory or TCP.
    pub(crate) transport: TransportChoice,
    /// Fault injection: the pause between opening a fetch's transfer and reading it.
    pub(crate) fetch_delay: Duration,
    /// How long a layer-wise push may take to begin (see [`TransferThread`]).
    pub(crate) layerwise_wait: Duration,
    /// An emulated worker's link, which what it receives crosses (`None`: as fast as the copy).
    pub(crate) link: Option<Arc<EmulatedLink>>,
    /// Where each job's end goes.
    pub(crate) back: Report,
    /// KV blocks received damaged (their checksums failed), counted for the worker's stats.
    pub(crate) corrupt: Arc<AtomicU64>,
}

impl Transfers {
    /// No threads yet.
    pub(crate) fn new(name: &str, setup: ThreadSetup) -> Self {
        Self { name: name.to_owned(), setup, threads: HashMap::new() }
    }

    /// Hands a job to its peer's thread, starting one when there is none (or the last one
    /// ended); the job comes back when no thread can be started.
    pub(crate) fn send(&mut self, job: KvJob) -> Result<(), Box<KvJob>> {
        let now = Instant::now();
        // Dropping an idle thread's sender ends it after the jobs queued before: none is lost.
        self.threads.retain(|_, (_, used)| now.duration_since(*used) < PEER_IDLE);
        let addr = job.source.addr;
        let job = match self.threads.get_mut(&addr) {
            Some((tx, used)) => match tx.send(job) {
                Ok(()) => {
                    *used = now;
                    return Ok(());
                }
                // The thread is gone (it panicked): start another.
                Err(std::sync::mpsc::SendError(job)) => job,
            },
            None => job,
        };
        let name = format!("{}-{}", self.name, addr.port());
        match TransferThread::spawn(&name, self.setup.clone()) {
            Ok(tx) => {
                let sent = tx.send(job).map_err(|std::sync::mpsc::SendError(job)| Box::new(job));
                self.threads.insert(addr, (tx, now));
                sent
            }
            Err(e) => {
                tracing::error!(peer = %addr, error = %e, "cannot start a transfer thread");
                Err(Box::new(job))
            }
        }
    }
}

/// A push this side registered and waits for.
struct Pending {
    job: KvJob,
    deadline: Instant,
    /// When it was registered (its transfer began).
    started: Instant,
    /// PUSHED frames seen so far: a layer-wise push that makes progress gets more time.
    progress: u64,
}

/// A transfer thread (one per peer, see [`Transfers`]): a [`KvClient`] per peer it serves,
/// connected on first use and dropped after an error (the next job reconnects). A pull runs to its end at once; a push
/// is registered, then watched among the others until its last layer is in, its request is
/// cancelled or its deadline passes. Results go back to the engine thread as
/// [`TransferDone`]s with the reserved blocks, which the engine thread frees for a failed job
/// (and which free themselves if the engine thread is gone).
pub(crate) struct TransferThread {
    local: Arc<Region>,
    config: ClientConfig,
    transport: TransportChoice,
    clients: HashMap<SocketAddr, KvClient>,
    pushes: Vec<Pending>,
    back: Report,
    /// Fault injection: the pause between opening a fetch's transfer and reading it.
    fetch_delay: Duration,
    /// How long a layer-wise push may take to begin: its prefill may wait in the prefill
    /// worker's queue first (once it writes, each write gives it the I/O timeout again).
    layerwise_wait: Duration,
    /// An emulated worker's link.
    link: Option<Arc<EmulatedLink>>,
    /// Received transfers the link has not carried yet: the thread waits for none of them,
    /// so the other transfers go on meanwhile (pushes are polled, their deadlines hold).
    crossing: Vec<Crossing>,
    /// When [`Self::reap_exited`] last looked.
    reaped: Instant,
    /// KV blocks received damaged (see [`ThreadSetup::corrupt`]).
    corrupt: Arc<AtomicU64>,
}

impl TransferThread {
    /// Starts the thread; jobs go in over the returned sender.
    pub(crate) fn spawn(name: &str, setup: ThreadSetup) -> std::io::Result<Sender<KvJob>> {
        let (jobs, job_rx) = std::sync::mpsc::channel();
        let ThreadSetup { local, config, transport, fetch_delay, layerwise_wait, link, back, corrupt } = setup;
        let clients = HashMap::new();
        let thread = TransferThread {
            local,
            config,
            transport,
            clients,
            pushes: Vec::new(),
            back,
            fetch_delay,
            layerwise_wait,
            link,
            crossing: Vec::new(),
            reaped: Instant::now(),
            corrupt,
        };
        std::thread::Builder::new().name(format!("baton-{name}-kv")).spawn(move || thread.run(job_rx))?;
        Ok(jobs)
    }

    fn run(mut self, jobs: Receiver<KvJob>) {
        loop {
            // Idle: block for a job; pushes in flight: take what is there, then watch them;
            // only transfers crossing the link: wait for a job until the next one is due.
            let mut next = if !self.pushes.is_empty() {
                match jobs.try_recv() {
                    Ok(job) => Some(job),
                    Err(TryRecvError::Empty) => None,
                    Err(TryRecvError::Disconnected) => return self.deliver_all(),
                }
            } else if let Some(due) = self.crossing.iter().map(|c| c.end).min() {
                let wait = due.saturating_duration_since(Instant::now()).min(POLL * 10);
                match jobs.recv_timeout(wait) {
                    Ok(job) => Some(job),
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => None,
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return self.deliver_all(),
                }
            } else if !self.clients.is_empty() {
                // Idle with peers: look in now and then for one whose process is gone.
                match jobs.recv_timeout(REAP_EVERY) {
                    Ok(job) => Some(job),
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => None,
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
                }
            } else {
                match jobs.recv() {
                    Ok(job) => Some(job),
                    Err(_) => return,
                }
            };
            // Now and then, not on every turn of a loop that polls pushes (a job's own peer is
            // looked at when the job connects).
            if self.reaped.elapsed() >= REAP_EVERY && !self.reap_exited() {
                return;
            }
            while let Some(job) = next {
                if !self.start(job) {
                    return;
                }
                next = jobs.try_recv().ok();
            }
            if !self.watch() || !self.deliver_crossed(false) {
                return;
            }
        }
    }

    /// Reports the transfers the link has carried, or whose request was cancelled (`all`:
    /// every one, the thread is ending); `false` when the engine thread is gone.
    fn deliver_crossed(&mut self, all: bool) -> bool {
        let now = Instant::now();
        let (due, later): (Vec<Crossing>, Vec<Crossing>) = std::mem::take(&mut self.crossing)
            .into_iter()
            .partition(|c| all || c.end <= now || c.job.cancel.is_cancelled());
        self.crossing = later;
        due.into_iter().all(|c| self.report(c.job, Ok(c.stats)))
    }

    /// The thread's last act when its worker is gone: nothing is left crossing.
    fn deliver_all(mut self) {
        self.deliver_crossed(true);
    }

    /// Hands the result of a job that began at `started` to the engine thread, once an emulated
    /// link would have carried it ([`Self::deliver_crossed`]); `false` when the engine thread is
    /// gone.
    fn report_received(&mut self, job: KvJob, started: Instant, result: Result<TransferStats, String>) -> bool {
        match (&self.link, result) {
            (Some(link), Ok(stats)) => {
                // The tokens that travelled: those of the source less the blocks cached here.
                let block_tokens = self.local.descriptor().extent(Dim::Token);
                let end = link.reserve(started, job.source.tokens.saturating_sub(job.skip * block_tokens));
                self.crossing.push(Crossing { end, job, stats });
                self.deliver_crossed(false)
            }
            (_, result) => self.report(job, result),
        }
    }

    /// Hands a job's result to the engine thread; `false` when it is gone.
    fn report(&self, job: KvJob, result: Result<TransferStats, String>) -> bool {
        self.report_with(job, result, Vec::new())
    }

    /// [`report`](Self::report), with what the sender handed over with the KV.
    fn report_with(&self, job: KvJob, result: Result<TransferStats, String>, trailer: Vec<u32>) -> bool {
        let result = result
            .map_err(|e| if job.cancel.is_cancelled() { TransferFailure::Cancelled } else { TransferFailure::Peer(e) });
        (self.back)(job.done_with(result, trailer))
    }

    fn start(&mut self, job: KvJob) -> bool {
        let span = job.span.clone();
        let _entered = span.enter();
        tracing::info!(mode = job.mode.as_str(), peer = %job.source.addr, tokens = job.source.tokens, "KV transfer starting");
        if job.cancel.is_cancelled() {
            return self.report(job, Err("the request was cancelled".into()));
        }
        let addr = job.source.addr;
        let started = Instant::now();
        if let Err(e) = self.connect(addr) {
            return self.report(job, Err(e));
        }
        let Some(client) = self.clients.get_mut(&addr) else {
            return self.report(job, Err("no connection".into()));
        };
        match job.mode {
            KvTransfer::Pull => {
                // Blocks cached here already (`skip`) stay out of the transfer.
                let remote: Vec<BlockId> = job.source.blocks.iter().skip(job.skip).map(|&b| BlockId(b)).collect();
                let local = job.kv.blocks().get(job.skip..).unwrap_or_default();
                let id = transfer_id(&job);
                let pulled = if job.source.lease.is_some() && !self.fetch_delay.is_zero() {
                    // Fault injection: the holder may be killed while the transfer is open.
                    client.open(id, &remote, local).and_then(|()| {
                        std::thread::sleep(self.fetch_delay);
                        let stats = client.read(id, &remote, local)?;
                        client.complete(id).map(|()| stats)
                    })
                } else {
                    client.pull(id, &remote, local)
                };
                match pulled {
                    Ok(stats) => self.report_received(job, started, Ok(stats)),
                    // Pipelined reads may still be answered: the connection is out of step.
                    Err(e) => {
                        self.count_corrupt(addr, &e);
                        self.drop_client(addr, &e.to_string(), Some((job, format!("pulling KV from {addr}: {e}"))))
                    }
                }
            }
            KvTransfer::Push | KvTransfer::Layerwise => {
                match client.begin_push(transfer_id(&job), job.generation.0, job.kv.blocks()) {
                    Ok(()) => {
                        let wait = match job.mode {
                            KvTransfer::Layerwise => self.layerwise_wait.max(self.config.io_timeout),
                            _ => self.config.io_timeout,
                        };
                        self.pushes.push(Pending { job, deadline: Instant::now() + wait, started, progress: 0 });
                        true
                    }
                    // Refused: nothing was registered.
                    Err(e) if e.is_remote() => self.report(job, Err(format!("reserving KV on {addr} for a push: {e}"))),
                    // Perhaps registered: only a closed connection makes the blocks safe to free.
                    Err(e) => self.drop_client(
                        addr,
                        &e.to_string(),
                        Some((job, format!("registering for a push from {addr}: {e}"))),
                    ),
                }
            }
        }
    }

    /// Counts the blocks a failed transfer from `addr` received damaged ([`TransferError::Corrupt`]:
    /// their checksums failed), and says so. The transfer failed: its blocks are freed and their
    /// tokens computed again, never used.
    fn count_corrupt(&self, addr: SocketAddr, e: &TransferError) {
        let blocks = e.corrupt_blocks();
        if blocks > 0 {
            self.corrupt.fetch_add(blocks as u64, Ordering::Relaxed);
            tracing::warn!(peer = %addr, blocks, "KV received damaged (checksum mismatch); the request computes it again");
        }
    }

    /// Drops the clients whose KV server is gone ([`KvClient::peer_gone`]: its process exited,
    /// or it closed the connection), failing what was pending on them. A same-host client holds
    /// its peer's arena mapped (an imported device arena stays allocated on the GPU while any
    /// process holds it), and a dead worker's is no one's once the conductor routes around it;
    /// any other would fail the next transfer to a worker restarted at the same address, where
    /// a fresh connection succeeds. A client with pushes pending is left to [`Self::watch`],
    /// which reads what the peer sent before it went (a last PUSHED may be waiting) and then
    /// fails the rest. `false` when the engine thread is gone.
    fn reap_exited(&mut self) -> bool {
        self.reaped = Instant::now();
        let gone: Vec<SocketAddr> =
            self.clients.iter().filter(|(a, c)| !self.pushing(**a) && c.peer_gone()).map(|(a, _)| *a).collect();
        gone.into_iter().all(|addr| {
            tracing::info!(peer = %addr, "the KV server is gone; dropping its connection");
            self.drop_client(addr, "the KV server is gone (its process exited or it closed the connection)", None)
        })
    }

    /// Whether pushes from `addr` are pending.
    fn pushing(&self, addr: SocketAddr) -> bool {
        self.pushes.iter().any(|p| p.job.source.addr == addr)
    }

    /// Connects to the KV server at `addr` unless a client is there already whose server is
    /// not gone ([`KvClient::peer_gone`]; one with pushes pending is kept, as in
    /// [`Self::reap_exited`]): a job for a worker restarted at the same address then goes over
    /// a fresh connection rather than fail on the old one.
    fn connect(&mut self, addr: SocketAddr) -> Result<(), String> {
        if let Some(client) = self.clients.get(&addr) {
            if self.pushing(addr) || !client.peer_gone() {
                return Ok(());
            }
            tracing::info!(peer = %addr, "the KV server is gone; connecting afresh");
            self.clients.remove(&addr);
        }
        let config = ClientConfig { transport: self.transport, ..self.config.clone() };
        let client = KvClient::connect(addr, config, self.local.clone())
            .map_err(|e| format!("connecting to the KV server at {addr}: {e}"))?;
        tracing::info!(peer = %addr, transport = %client.transport(), "KV from a new peer: over {}", client.transport());
        self.clients.insert(addr, client);
        Ok(())
    }

    /// Drops the connection to `addr` after `error`, failing its pushes (and `also`, a job that
    /// hit the error). When pushes may still be registered, the blocks are handed back only
    /// after the peer closed its end too (or, a hung peer, after the I/O timeout).
    fn drop_client(&mut self, addr: SocketAddr, error: &str, also: Option<(KvJob, String)>) -> bool {
        let (failed, kept): (Vec<Pending>, Vec<Pending>) =
            std::mem::take(&mut self.pushes).into_iter().partition(|p| p.job.source.addr == addr);
        self.pushes = kept;
        if let Some(client) = self.clients.remove(&addr) {
            let registered = !failed.is_empty() || also.as_ref().is_some_and(|(j, _)| j.mode != KvTransfer::Pull);
            if registered && !client.close(self.config.io_timeout) {
                tracing::warn!(peer = %addr, "the KV server did not close the failed connection; freeing its push targets anyway");
            }
        }
        let mut go = true;
        for p in failed {
            go &= self.report(p.job, Err(format!("receiving pushed KV from {addr}: {error}")));
        }
        if let Some((job, message)) = also {
            go &= self.report(job, Err(message));
        }
        go
    }

    /// Takes the pushes whose last layer arrived, and gives up those cancelled or overdue.
    fn watch(&mut self) -> bool {
        let mut addrs: Vec<SocketAddr> = self.pushes.iter().map(|p| p.job.source.addr).collect();
        addrs.sort_unstable();
        addrs.dedup();
        let slice = POLL / u32::try_from(addrs.len().max(1)).unwrap_or(u32::MAX);
        for addr in addrs {
            let Some(client) = self.clients.get_mut(&addr) else { continue };
            let done = match client.poll_pushes(slice) {
                Ok(done) => done,
                Err(e) => {
                    self.count_corrupt(addr, &e);
                    if !self.drop_client(addr, &e.to_string(), None) {
                        return false;
                    }
                    continue;
                }
            };
            for id in done {
                let at = self.pushes.iter().position(|p| p.job.source.addr == addr && transfer_id(&p.job) == id);
                let Some(client) = self.clients.get_mut(&addr) else { break };
                let Some(at) = at else {
                    // Not ours any more: end it on the prefill side too.
                    let _ = client.cancel_push(id);
                    continue;
                };
                let Pending { job, started, .. } = self.pushes.swap_remove(at);
                let trailer = client.push_trailer(id).to_vec();
                // Its last layer is in: nothing more is written into its blocks, whatever the
                // COMPLETE says.
                let go = match client.finish_push(id, Duration::ZERO) {
                    // A layer-wise push crossed the prefill worker's emulated link as it was
                    // written (`LayerPusher`), overlapped with the prefill: it is all in now.
                    Ok(stats) if job.mode == KvTransfer::Layerwise => self.report_with(job, Ok(stats), trailer),
                    Ok(stats) => self.report_received(job, started, Ok(stats)),
                    Err(e) if e.is_remote() => self.report(job, Err(format!("completing the push from {addr}: {e}"))),
                    Err(e) => {
                        self.count_corrupt(addr, &e);
                        let message = format!("completing the push from {addr}: {e}");
                        self.drop_client(addr, &e.to_string(), Some((job, message)))
                    }
                };
                if !go {
                    return false;
                }
            }
        }
        let now = Instant::now();
        for p in &mut self.pushes {
            let progress = self.clients.get(&p.job.source.addr).and_then(|c| c.push_progress(transfer_id(&p.job)));
            if let Some(progress) = progress.filter(|&n| n > p.progress) {
                p.progress = progress;
                p.deadline = p.deadline.max(now + self.config.io_timeout);
            }
        }
        let due: Vec<(SocketAddr, TransferId, String)> = self
            .pushes
            .iter()
            .filter_map(|p| {
                let addr = p.job.source.addr;
                let why = if p.job.cancel.is_cancelled() {
                    "the request was cancelled".to_owned()
                } else if now >= p.deadline {
                    format!("no KV was pushed from {addr} within {:?}", self.config.io_timeout)
                } else {
                    return None;
                };
                Some((addr, transfer_id(&p.job), why))
            })
            .collect();
        for (addr, id, why) in due {
            let Some(at) = self.pushes.iter().position(|p| p.job.source.addr == addr && transfer_id(&p.job) == id)
            else {
                continue;
            };
            let job = self.pushes.swap_remove(at).job;
            let cancelled = self.clients.get_mut(&addr).map_or(Ok(()), |c| c.cancel_push(id));
            let go = match cancelled {
                Ok(()) => self.report(job, Err(why)),
                Err(e) => self.drop_client(addr, &e.to_string(), Some((job, why))),
            };
            if !go {
                return false;
            }
        }
        true
    }
}

/// Pushes a finished request's offered KV (every layer) into the blocks the decode worker
/// reserves for it, on a thread of its own: a push waits for that reservation, which must not
/// hold up the other requests' pushes. It gives up when `wait` passes or the lease ends; a
/// failed push cancels the lease, so the blocks go back to the engine at once.
pub(crate) fn spawn_push(server: &Arc<KvServer>, id: RequestId, wait: Duration, delay: Duration, span: tracing::Span) {
    let xfer = TransferId(id.0);
    let layers = server.region().descriptor().extent(Dim::Layer);
    let s = Arc::clone(server);
    let spawned = std::thread::Builder::new().name(format!("baton-push-{}", id.0)).spawn(move || {
        let _entered = span.entered();
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        match s.push_offered(xfer, 0..layers, wait) {
            Ok(stats) => tracing::info!(bytes = stats.bytes, calls = stats.calls, "pushed KV"),
            Err(e) => {
                tracing::warn!(request = id.0, error = %e, "pushing KV failed");
                s.cancel(xfer);
            }
        }
    });
    if let Err(e) = spawned {
        tracing::error!(request = id.0, error = %e, "cannot start a push");
        server.cancel(xfer);
    }
}

/// A prefill worker's layer-wise pushes (`--kv-transfer layerwise`): the engine's
/// [`KvStream`] sends each layer of each request's KV here as its forward pass writes it, and
/// this worker's pusher thread writes it into the blocks the decode worker reserved
/// ([`KvServer::push_blocks`]), overlapped with the layers still computing; when the request
/// finishes, [`LayerPusher::end`] queues the last write, which carries the first token
/// ([`KvServer::finish_layers`]).
///
/// The thread never waits on one request: a request whose decode worker has not registered yet
/// keeps its layers queued (polled every few milliseconds) while the others' go out, each
/// request's in order. A request's queue is dropped when a write fails (the decode side
/// withdrew) or when it has waited `wait` without a write; the decode side then gives up
/// and the conductor sends the request again. The pusher writes blocks the engine holds, not
/// under a lease: a block freed meanwhile (the request aborted, or preempted and to be
/// computed again) may be written with what replaced it, but the last PUSHED goes out only after
/// every layer of the finished request was written again from the blocks it finished with,
/// and the decode worker uses nothing before it.
///
/// With an emulated link (`--emulate-link-gbps`), each layer leaves no sooner than its share of
/// the real model's KV would have crossed the prefill worker's link, queued behind the layers
/// before it; the decode worker then adds no link time of its own to a layer-wise push.
#[derive(Clone)]
pub(crate) struct LayerPusher {
    tx: Sender<PushWork>,
    /// The arena's layers (an emulated arena has fewer than the model it emulates).
    arena_layers: usize,
}

enum PushWork {
    /// Arena layers `layers` of blocks `first..` are final: modelled layer `layer` of `of`.
    Layers {
        id: TransferId,
        layers: std::ops::Range<usize>,
        first: usize,
        blocks: Vec<BlockId>,
        tokens: usize,
        of: usize,
    },
    /// The request finished with `tokens`: the last write.
    End { id: TransferId, tokens: Vec<u32>, span: tracing::Span },
}

impl PushWork {
    fn id(&self) -> TransferId {
        match self {
            PushWork::Layers { id, .. } | PushWork::End { id, .. } => *id,
        }
    }
}

/// One request's writes, in order.
struct LayerQueue {
    items: std::collections::VecDeque<(Instant, PushWork)>,
    /// When it is dropped unless a write goes out first.
    expires: Instant,
    /// When the last write queued was due (fault injection spaces writes from it).
    last: Option<Instant>,
}

/// How often the pusher looks again at requests whose decode worker has not registered yet.
const PUSH_POLL: Duration = Duration::from_millis(2);

impl LayerPusher {
    /// Starts the pusher thread of `server`'s worker; it ends when every handle is gone.
    /// `delay` (fault injection) spaces a request's writes, so a test can kill a worker
    /// mid-stream.
    pub(crate) fn spawn(
        name: &str,
        server: &Arc<KvServer>,
        wait: Duration,
        delay: Duration,
        link: Option<EmulatedLink>,
    ) -> std::io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel();
        let arena_layers = server.region().descriptor().extent(Dim::Layer);
        let server = Arc::downgrade(server);
        std::thread::Builder::new()
            .name(format!("baton-{name}-push"))
            .spawn(move || run_pusher(&server, &rx, wait, delay, link.as_ref()))?;
        Ok(Self { tx, arena_layers })
    }

    /// Queues the last write of request `id`'s push, carrying `tokens`.
    pub(crate) fn end(&self, id: RequestId, tokens: Vec<u32>, span: tracing::Span) {
        let _ = self.tx.send(PushWork::End { id: TransferId(id.0), tokens, span });
    }
}

impl KvStream for LayerPusher {
    fn layer_written(&mut self, layer: usize, layers: usize, piece: &KvPiece) {
        let a = self.arena_layers;
        let work = PushWork::Layers {
            id: TransferId(piece.id.0),
            layers: layer * a / layers..(layer + 1) * a / layers,
            first: piece.first,
            blocks: piece.blocks.clone(),
            tokens: piece.tokens,
            of: layers,
        };
        // The thread is gone only when the worker is: nothing to push to.
        let _ = self.tx.send(work);
    }
}

fn run_pusher(
    server: &std::sync::Weak<KvServer>,
    rx: &Receiver<PushWork>,
    wait: Duration,
    delay: Duration,
    link: Option<&EmulatedLink>,
) {
    let mut queues: HashMap<TransferId, LayerQueue> = HashMap::new();
    loop {
        let now = Instant::now();
        let next_due = queues.values().filter_map(|q| q.items.front()).map(|(due, _)| *due).min();
        let first = match next_due {
            None => rx.recv().map_err(|_| true),
            Some(due) => {
                // A write due later: wake for it; one due already waits for its decode worker's
                // registration: look again shortly.
                let timeout = if due > now { due - now } else { PUSH_POLL };
                rx.recv_timeout(timeout).map_err(|e| matches!(e, std::sync::mpsc::RecvTimeoutError::Disconnected))
            }
        };
        let mut incoming = match first {
            Ok(work) => vec![work],
            Err(true) => return,
            Err(false) => Vec::new(),
        };
        incoming.extend(rx.try_iter());
        let now = Instant::now();
        for work in incoming {
            let queue = queues.entry(work.id()).or_insert_with(|| LayerQueue {
                items: std::collections::VecDeque::new(),
                expires: now + wait,
                last: None,
            });
            let due = match (&work, link) {
                (PushWork::Layers { tokens, of, .. }, Some(link)) => link.reserve_share(now, *tokens, *of),
                _ => now,
            };
            let due = queue.last.map_or(due, |last| due.max(last + delay));
            queue.last = Some(due);
            queue.items.push_back((due, work));
        }
        let Some(server) = server.upgrade() else { return };
        for (&id, queue) in &mut queues {
            while let Some((due, work)) = queue.items.front() {
                if *due > now {
                    break;
                }
                let pushed = match work {
                    PushWork::Layers { layers, .. } if layers.is_empty() => Ok(()),
                    PushWork::Layers { layers, first, blocks, .. } => {
                        server.push_blocks(id, blocks, *first, layers.clone(), Duration::ZERO).map(drop)
                    }
                    PushWork::End { tokens, span, .. } => {
                        let _entered = span.enter();
                        let ended = server.finish_layers(id, tokens, Duration::ZERO).map(drop);
                        if ended.is_ok() {
                            tracing::info!("pushed the KV layer by layer");
                        }
                        ended
                    }
                };
                match pushed {
                    Ok(()) => {
                        queue.items.pop_front();
                        queue.expires = now + wait;
                    }
                    // The decode worker has not registered yet.
                    Err(baton_transfer::TransferError::Timeout { .. }) => break,
                    Err(e) => {
                        tracing::warn!(request = id.0, error = %e, "pushing KV layer by layer failed");
                        queue.items.clear();
                    }
                }
            }
        }
        queues.retain(|id, q| {
            // (With a fault delay, a request's queue outlives its writes: the next one is spaced
            // from the last.)
            let keep = q.expires > now && (!q.items.is_empty() || !delay.is_zero());
            if !keep && !q.items.is_empty() {
                tracing::warn!(
                    request = id.0,
                    "no decode worker registered for the layer-wise push in time; dropping it"
                );
            }
            keep
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An emulated link carries one transfer at a time: transfers that arrive together queue,
    /// one that begins after the link went idle starts at once, and a transfer is never done
    /// before its own bytes crossed.
    #[test]
    fn an_emulated_link_queues_transfers_at_its_bandwidth() {
        // 1 GB/s, 1 MB a token: a token takes 1 ms.
        let link = EmulatedLink::new(baton_sched::Link { bytes_per_s: 1_000_000_000, latency_us: 0 }, 1_000_000);
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        assert_eq!(link.reserve(t0, 10), t0 + ms(10));
        assert_eq!(link.reserve(t0, 10), t0 + ms(20), "behind the first");
        assert_eq!(link.reserve(t0 + ms(5), 1), t0 + ms(21), "still behind");
        assert_eq!(link.reserve(t0 + ms(100), 4), t0 + ms(104), "an idle link starts at once");
        assert_eq!(link.reserve(t0 + ms(200), 0), t0 + ms(200), "nothing to carry");
    }
}
