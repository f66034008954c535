//! One state machine per request on a worker, without I/O (as raft-rs's `RawNode`: events in,
//! actions out, a driver performs them).
//!
//! [`Sessions`] owns every request the worker holds, one [`Session`] each, in one map, on the
//! engine thread. Its drivers feed it events — [`submit`](Sessions::submit), a step's output
//! ([`step_output`](Sessions::step_output), [`step_failed`](Sessions::step_failed)), a
//! transfer's end ([`transfer_done`](Sessions::transfer_done)), a lease's end
//! ([`lease_ended`](Sessions::lease_ended)), [`abort`](Sessions::abort), the conductor's
//! [`release`](Sessions::release) and a [`tick`](Sessions::tick) — and perform what it asks:
//! the synchronous, same-thread work through a [`Host`] (the engine, and offering blocks on the
//! KV server), the rest as [`Action`]s taken from [`ready`](Sessions::ready) (start a transfer on
//! the transfer thread, start a push, end a lease). Tests drive it with a fake host and no
//! threads, sockets or clocks (time is an argument).
//!
//! ```text
//!   submit ──(KV to receive)──▶ Queued ──room──▶ Receiving ──done──▶ Running ──finish──▶ Done
//!     │                            │  deadline / no room  │ failed        │  │ (KV retained)
//!     │                            └──────────(recompute)─┴──────────────▶│  └──▶ Leased ──lease ends──▶ Done
//!     └──(no KV to receive)─────────────────────────────────────────────▶─┘       (push: Pushing)
//!   abort, client gone: any state ──▶ Done (a lease is cancelled; a transfer's KV comes back with it)
//! ```
//!
//! KV is released by `Drop`, never by hand: every block a session holds outside the engine is in
//! a [`HeldKv`], whose `drop` sends the blocks back over the owner's channel, and
//! [`Sessions`] gives them back to the engine on its next event. A transfer's reserved blocks
//! travel with its [`KvJob`] to the transfer thread and come back in its [`TransferDone`]; a job
//! dropped anywhere (an aborted request, a stopped thread) frees them, and only once the transfer
//! thread let go of it, which is when no write can land in them any more. Each reservation carries
//! a [`Generation`], so the result of an earlier transfer for the same request id never takes
//! over a later one's blocks, and the KV server's writes name it too.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::time::{Duration, Instant};

use baton_engine::{GenerationRequest, KvPrefix, KvRetention, RequestId, StepOutput};
use baton_kv::BlockId;
use baton_transfer::{TransferStats, TransportKind};
use tokio::sync::mpsc::UnboundedSender;

use baton_protocol::wire::{KvSource, KvTransfer, Received, RequestEvent, Work, WorkRequest, WorkerError};

/// Where a request's events go (its client's channel). Sending never blocks.
pub trait Sink {
    /// Sends an event; `false` when no one listens any more.
    fn send(&self, event: RequestEvent) -> bool;
    /// Whether no one listens any more (the client went away).
    fn is_closed(&self) -> bool;
}

impl Sink for UnboundedSender<RequestEvent> {
    fn send(&self, event: RequestEvent) -> bool {
        UnboundedSender::send(self, event).is_ok()
    }

    fn is_closed(&self) -> bool {
        UnboundedSender::is_closed(self)
    }
}

/// What the state machine asks of the thread it runs on: the engine, and the KV server's offer.
/// Each call is synchronous and cheap; nothing here waits on a peer.
pub trait Host {
    /// Queues a request in the engine.
    fn add_request(&mut self, req: GenerationRequest) -> Result<(), WorkerError>;
    /// Aborts a request in the engine; the KV it retained, if any.
    fn abort(&mut self, id: RequestId) -> Option<KvPrefix>;
    /// Reserves blocks for `tokens` tokens of KV to receive, the KV of `known` (its tokens; empty
    /// when nothing may come from the cache); with the number of leading blocks that hold it
    /// already (taken from this worker's prefix cache: they need not travel). `None` when there
    /// is no room.
    fn reserve_kv(&mut self, known: &[u32], tokens: usize) -> Option<(KvPrefix, usize)>;
    /// Gives blocks back to the engine.
    fn release_kv(&mut self, kv: KvPrefix);
    /// Caches received KV of `tokens` in the prefix index, running nothing; gives the blocks
    /// back.
    fn import_kv(&mut self, tokens: &[u32], kv: KvPrefix);
    /// Blocks allocatable now.
    fn available_blocks(&self) -> usize;
    /// Sequences running in the engine.
    fn running(&self) -> usize;
    /// Tokens per block.
    fn block_size(&self) -> usize;
    /// Offers a finished request's retained blocks on the KV server under a lease; the server's
    /// address, or `None` (no server, or it refused) and the blocks are released.
    fn offer(&mut self, id: RequestId, blocks: &[BlockId]) -> Option<SocketAddr>;
    /// Tells the engine that KV for `blocks` arrived in its device arena, device to device,
    /// not in its host arena.
    fn arrived_on_device(&mut self, blocks: &[BlockId]);
}

/// Work for the drivers other than the engine.
#[derive(Debug)]
pub enum Action {
    /// Receive a request's KV into the blocks of the job (the transfer thread); its end comes
    /// back as [`Sessions::transfer_done`].
    Transfer(KvJob),
    /// Push a leased request's KV into the blocks its decode worker reserves (prefill side).
    Push {
        /// The request.
        id: RequestId,
        /// Its span, entered by the push.
        span: tracing::Span,
    },
    /// End a layer-wise push: every layer of the request's KV went out as it was computed;
    /// tell the decode worker, handing it the tokens the prefill generated (prefill side).
    EndPush {
        /// The request.
        id: RequestId,
        /// Its generated tokens (the first token).
        tokens: Vec<u32>,
        /// Its span.
        span: tracing::Span,
    },
    /// End a request's lease on the KV server; the server reports the end as
    /// [`Sessions::lease_ended`].
    CancelLease(RequestId),
}

/// The KV a request brings to a worker, as the worker's session machine takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Incoming {
    /// KV to receive before computing (a hand-off, or a fetched prefix).
    pub source: Option<KvSource>,
    /// How it arrives.
    pub mode: KvTransfer,
    /// How the prefill side pushes the KV the request retains.
    pub push: Push,
}

impl Incoming {
    /// The engine's request, and the hand-off's KV and mode.
    pub(crate) fn of(work: WorkRequest) -> (GenerationRequest, Incoming) {
        let (incoming, retain) = match work.work {
            Work::Whole { fetch } => (Incoming { source: fetch, mode: KvTransfer::Pull, push: Push::No }, false),
            Work::Prefill { fetch, handoff } => {
                let push = match handoff {
                    KvTransfer::Pull => Push::No,
                    KvTransfer::Push => Push::Whole,
                    KvTransfer::Layerwise => Push::Layers,
                };
                (Incoming { source: fetch, mode: KvTransfer::Pull, push }, true)
            }
            // A decode-side hand-off: received as the request says, never pushed on.
            Work::Decode { source, mode } => (Incoming { source: Some(source), mode, push: Push::No }, false),
        };
        let req = GenerationRequest {
            generated: work.generated,
            sampling: work.sampling,
            stop: work.stop,
            retain_kv: if retain { KvRetention::All } else { KvRetention::None },
            logprobs: work.logprobs,
            stop_token_ids: work.stop_token_ids,
            prefix_cache: work.prefix_cache,
            stream_kv: incoming.push == Push::Layers,
            ..GenerationRequest::new(RequestId(work.id), work.prompt)
        };
        (req, incoming)
    }
}

/// How a prefill worker hands over the KV a request retains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Push {
    /// It does not: the KV is offered under a lease and the decode worker pulls it.
    #[default]
    No,
    /// Every layer, once the request finishes ([`Action::Push`]).
    Whole,
    /// Each layer of each prompt chunk as the engine writes it (the engine's `KvStream`); when
    /// the request finishes, the last write carries its first token ([`Action::EndPush`]).
    Layers,
}

/// Which reservation a transfer writes into: a reservation's number, unique on this worker.
/// A transfer's result, and every write the KV server pushes, name it; one for another
/// generation is stale and refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Generation(pub u64);

/// Blocks a session holds outside the engine. Dropping it gives them back to the engine (over
/// the owner's channel, so it may be dropped on any thread).
#[must_use = "dropping held KV frees it"]
pub struct HeldKv {
    kv: Option<KvPrefix>,
    back: Sender<KvPrefix>,
}

impl HeldKv {
    /// The blocks, in token order.
    pub fn blocks(&self) -> &[BlockId] {
        self.kv.as_ref().map_or(&[], |kv| &kv.blocks)
    }

    /// Tokens they hold.
    pub fn tokens(&self) -> usize {
        self.kv.as_ref().map_or(0, |kv| kv.tokens)
    }

    /// Hands the blocks to the engine (a request's prefix): no longer freed on drop.
    fn into_prefix(mut self) -> Option<KvPrefix> {
        self.kv.take()
    }
}

impl Drop for HeldKv {
    fn drop(&mut self) {
        if let Some(kv) = self.kv.take() {
            // A closed channel means the engine, and its pool, is gone: nothing to free.
            let _ = self.back.send(kv);
        }
    }
}

impl std::fmt::Debug for HeldKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldKv").field("blocks", &self.blocks()).field("tokens", &self.tokens()).finish()
    }
}

/// Tells a transfer in flight that its request no longer wants it.
#[derive(Debug, Clone, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    /// Whether the request was aborted.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A request whose KV the transfer thread receives into blocks reserved here.
#[derive(Debug)]
pub struct KvJob {
    /// The request (and transfer) id.
    pub id: RequestId,
    /// The reservation.
    pub generation: Generation,
    /// The reserved blocks: freed if the job is dropped.
    pub kv: HeldKv,
    /// Leading blocks this worker had cached already: not transferred (pull mode only).
    pub skip: usize,
    /// Where the KV is.
    pub source: KvSource,
    /// Pulled or pushed.
    pub mode: KvTransfer,
    /// Set when the request is aborted.
    pub cancel: CancelToken,
    /// The request's span, entered while the transfer thread works on it.
    pub span: tracing::Span,
}

impl KvJob {
    /// The job's result, handing the reserved blocks back with it.
    pub fn done(self, result: Result<TransferStats, TransferFailure>) -> TransferDone {
        self.done_with(result, Vec::new())
    }

    /// [`done`](Self::done), with what the sender handed over with the KV.
    pub fn done_with(self, result: Result<TransferStats, TransferFailure>, trailer: Vec<u32>) -> TransferDone {
        let (id, generation, kv, skip, span) = (self.id, self.generation, self.kv, self.skip, self.span);
        TransferDone { id, generation, kv, skip, result, trailer, span }
    }
}

/// Why a transfer did not deliver the KV.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferFailure {
    /// The request was aborted before its KV arrived.
    #[error("the request was cancelled")]
    Cancelled,
    /// The peer failed, refused or did not answer in time.
    #[error("{0}")]
    Peer(String),
}

/// A transfer's end, from the transfer thread.
#[derive(Debug)]
pub struct TransferDone {
    /// The request.
    pub id: RequestId,
    /// The reservation it wrote into.
    pub generation: Generation,
    /// The reserved blocks.
    pub kv: HeldKv,
    /// Leading blocks that were cached here and not transferred.
    pub skip: usize,
    /// What the transfer moved, or why it did not.
    pub result: Result<TransferStats, TransferFailure>,
    /// What the sender handed over with the KV: a layer-wise push's first token.
    pub trailer: Vec<u32>,
    /// The request's span.
    pub span: tracing::Span,
}

/// Where a request is.
#[derive(Debug)]
pub enum State {
    /// Waiting for room to receive its KV (a hand-off, a fetched prefix or an import), until
    /// `deadline`.
    Queued {
        /// The request.
        req: Box<GenerationRequest>,
        /// Where its KV is.
        source: KvSource,
        /// How it travels.
        mode: KvTransfer,
        /// How it pushes the KV it retains when it finishes (a prefill worker that fetched a
        /// prefix).
        push: Push,
        /// Only cache the KV when it arrives (`req.prompt` are its tokens): nothing runs.
        import: bool,
        /// When it stops waiting and recomputes the prompt here (an import gives up).
        deadline: Instant,
    },
    /// Its KV is on its way into reserved blocks (the transfer thread holds them).
    Receiving {
        /// The request, admitted when the KV is in.
        req: Box<GenerationRequest>,
        /// The reservation.
        generation: Generation,
        /// Set on abort.
        cancel: CancelToken,
        /// How the KV arrives.
        mode: KvTransfer,
        /// How it pushes the KV it retains when it finishes.
        push: Push,
        /// Only cache the KV when it arrives.
        import: bool,
    },
    /// In the engine (waiting for a batch slot, prefilling or decoding).
    Running {
        /// How it pushes the KV it retains when it finishes (prefill role, push modes).
        push: Push,
        /// The KV it received before running, reported when it finishes.
        received: Option<Received>,
    },
    /// Finished, its KV offered on the KV server until the lease ends (prefill role); being
    /// pushed when `pushing`.
    Leased {
        /// The blocks under the lease.
        kv: HeldKv,
        /// A push of them was started.
        pushing: bool,
    },
}

impl State {
    /// The state's name, for logs and tests.
    pub fn name(&self) -> &'static str {
        match self {
            State::Queued { .. } => "queued",
            State::Receiving { .. } => "receiving",
            State::Running { .. } => "running",
            State::Leased { pushing: false, .. } => "leased",
            State::Leased { pushing: true, .. } => "pushing",
        }
    }
}

/// One request on this worker.
#[derive(Debug)]
pub struct Session<S> {
    state: State,
    sink: S,
    span: tracing::Span,
}

/// A request handed to the worker.
#[derive(Debug)]
pub struct Submission<S> {
    /// The engine's request.
    pub req: GenerationRequest,
    /// KV to receive first: a hand-off (decode role), or a prefix fetched from a peer's cache.
    pub source: Option<KvSource>,
    /// How `source` arrives.
    pub mode: KvTransfer,
    /// How the request pushes the KV it retains (prefill side, push modes).
    pub push: Push,
    /// Where its events go.
    pub sink: S,
    /// Its span.
    pub span: tracing::Span,
}

/// Counts of sessions by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Waiting for room to receive KV.
    pub queued: usize,
    /// Receiving KV.
    pub receiving: usize,
    /// In the engine.
    pub running: usize,
    /// Holding a lease (pushing included).
    pub leased: usize,
}

/// How the sessions behave.
#[derive(Debug, Clone, Copy)]
pub struct SessionConfig {
    /// How long a hand-off waits for room before recomputing (half the prefill side's lease,
    /// so the KV is still there when room comes).
    pub incoming_wait: Duration,
    /// This worker can receive KV (it has a transfer thread).
    pub can_receive: bool,
}

/// Every request this worker holds: one owner, one map.
pub struct Sessions<S> {
    sessions: HashMap<RequestId, Session<S>>,
    /// Queued hand-offs, first come first served.
    queue: VecDeque<RequestId>,
    back: Sender<KvPrefix>,
    returned: Receiver<KvPrefix>,
    next_generation: u64,
    config: SessionConfig,
    actions: Vec<Action>,
}

impl<S: Sink> Sessions<S> {
    /// No sessions.
    pub fn new(config: SessionConfig) -> Self {
        let (back, returned) = std::sync::mpsc::channel();
        Self {
            sessions: HashMap::new(),
            queue: VecDeque::new(),
            back,
            returned,
            next_generation: 1,
            config,
            actions: Vec::new(),
        }
    }

    /// The actions the events asked for since the last call, in order.
    pub fn ready(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.actions)
    }

    /// A request's state, if this worker holds it.
    pub fn state(&self, id: RequestId) -> Option<&State> {
        self.sessions.get(&id).map(|s| &s.state)
    }

    /// Counts by state.
    pub fn counts(&self) -> Counts {
        let mut c = Counts::default();
        for s in self.sessions.values() {
            match s.state {
                State::Queued { .. } => c.queued += 1,
                State::Receiving { .. } => c.receiving += 1,
                State::Running { .. } => c.running += 1,
                State::Leased { .. } => c.leased += 1,
            }
        }
        c
    }

    /// Whether no request is held at all.
    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }

    /// Whether a queued hand-off waits for room (the driver then polls briefly, not idly).
    pub fn has_queued(&self) -> bool {
        !self.queue.is_empty()
    }

    /// Wraps blocks so that dropping them frees them.
    pub fn hold(&self, kv: KvPrefix) -> HeldKv {
        HeldKv { kv: Some(kv), back: self.back.clone() }
    }

    /// A new request. With a `source`, its KV (or a prefix of it) is received from a peer
    /// first; then it runs from its prompt (and, with `push`, pushes the KV it retains when it
    /// finishes).
    pub fn submit(&mut self, host: &mut impl Host, now: Instant, submission: Submission<S>) {
        let Submission { req, source, mode, push, sink, span } = submission;
        // Only a prefill part pushes, and it retains its KV (`Incoming::of` makes both from one
        // `Work`).
        debug_assert!(push == Push::No || req.retain_kv == KvRetention::All, "a push without retained KV");
        let id = req.id;
        if self.sessions.get(&id).is_some_and(|s| s.sink.is_closed()) {
            // Its conductor gave the earlier one up (it routes the request again, and may pick
            // this worker again before the abort arrived): the id is free.
            self.abort(host, id);
        }
        if self.sessions.contains_key(&id) {
            sink.send(RequestEvent::Failed(WorkerError::InvalidRequest(format!(
                "request {} is already running on this worker",
                id.0
            ))));
            return;
        }
        match source {
            None => {
                self.start(host, req, push, sink, span);
            }
            Some(_) if !self.config.can_receive => {
                sink.send(RequestEvent::Failed(WorkerError::WrongRole("this worker cannot receive KV".into())));
            }
            // (A layer-wise hand-off names no blocks: the prefill has not started.)
            Some(source)
                if mode != KvTransfer::Layerwise
                    && source.blocks.len() != source.tokens.div_ceil(host.block_size()) =>
            {
                sink.send(RequestEvent::Failed(WorkerError::WrongRole(format!(
                    "{} blocks cannot hold {} tokens",
                    source.blocks.len(),
                    source.tokens
                ))));
            }
            Some(source) => {
                let deadline = now + self.config.incoming_wait;
                let state = State::Queued { req: Box::new(req), source, mode, push, import: false, deadline };
                self.sessions.insert(id, Session { state, sink, span });
                self.queue.push_back(id);
                self.start_queued(host, now);
            }
        }
        self.settle(host);
    }

    /// Receives a peer's KV of `tokens` into this worker's prefix cache, running nothing
    /// (MemServe's PD-Caching-3: a decode worker's answer sent back to a prefill worker). What
    /// is cached here already does not travel. The sink hears one `Finished` (with what was
    /// received, `None` when nothing arrived), or `Failed` when this worker cannot receive.
    pub fn import(
        &mut self,
        host: &mut impl Host,
        now: Instant,
        id: RequestId,
        tokens: Vec<u32>,
        source: KvSource,
        sink: S,
    ) {
        if self.sessions.contains_key(&id) || !self.config.can_receive {
            sink.send(RequestEvent::Failed(WorkerError::WrongRole(format!("cannot import KV as {}", id.0))));
            return;
        }
        // An import is a courtesy (PD-Caching-3's answer coming back): it starts now or not at
        // all. Queued, it would wait for room behind the hand-offs (or, at the head, in front
        // of them) while its exporter keeps the blocks pinned under a lease; when the exporter
        // is the decode worker those hand-offs wait for, that is a cycle only the deadline
        // breaks (#63: a burst stalled 10 s at a time on a 64-block arena).
        let blocks = source.tokens.div_ceil(host.block_size());
        if !self.queue.is_empty() || host.available_blocks() < blocks + host.running() {
            tracing::debug!(id = id.0, "no room for KV to import now; not importing it");
            Self::imported(&sink, tokens.len(), 0, None);
            return;
        }
        let req = GenerationRequest::new(id, tokens);
        let deadline = now + self.config.incoming_wait;
        let state = State::Queued {
            req: Box::new(req),
            source,
            mode: KvTransfer::Pull,
            push: Push::No,
            import: true,
            deadline,
        };
        let span = tracing::info_span!("import", id = id.0);
        self.sessions.insert(id, Session { state, sink, span });
        self.queue.push_back(id);
        self.start_queued(host, now);
        self.settle(host);
    }

    /// An import's end: `received` is what arrived and is cached now.
    fn imported(sink: &S, tokens: usize, cached: usize, received: Option<Received>) {
        sink.send(RequestEvent::Finished {
            reason: baton_protocol::wire::Finish::Length,
            prompt_tokens: tokens,
            cached_tokens: cached,
            completion_tokens: 0,
            kv: None,
            received,
        });
    }

    /// Time passes: requests whose client left are aborted, queued hand-offs that have room
    /// start receiving, those past their deadline recompute.
    pub fn tick(&mut self, host: &mut impl Host, now: Instant) {
        let gone: Vec<RequestId> = self
            .sessions
            .iter()
            .filter(|(_, s)| !matches!(s.state, State::Leased { .. }) && s.sink.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            let _entered = self.sessions[&id].span.clone().entered();
            tracing::debug!("client went away; aborting");
            self.abort(host, id);
        }
        self.start_queued(host, now);
        self.settle(host);
    }

    /// A step's tokens and finished requests.
    pub fn step_output(&mut self, host: &mut impl Host, out: StepOutput) {
        let mut gone = Vec::new();
        for t in out.tokens {
            if let Some(s) = self.sessions.get(&t.id)
                && !s.sink.send(RequestEvent::Token { token: t.token, text: t.text_delta, logprobs: t.logprobs })
            {
                gone.push(t.id);
            }
        }
        for f in out.finished {
            let Some(s) = self.sessions.remove(&f.id) else {
                // Not ours (aborted meanwhile): its KV goes back.
                if let Some(kv) = f.kv {
                    drop(self.hold(kv));
                }
                continue;
            };
            let _entered = s.span.clone().entered();
            tracing::info!(reason = ?f.reason, generated = f.token_ids.len(), cached = f.cached_tokens, "finished");
            let (push, received) = match s.state {
                State::Running { push, received } => (push, received),
                _ => (Push::No, None),
            };
            let mut leased = None;
            if let Some(kv) = f.kv {
                let held = self.hold(kv);
                // Without a KV server (or if it refuses), `held` drops here: the blocks are freed.
                if let Some(addr) = host.offer(f.id, held.blocks()) {
                    tracing::info!(blocks = held.blocks().len(), tokens = held.tokens(), "KV offered for the hand-off");
                    let blocks = held.blocks().iter().map(|b| b.0).collect();
                    leased = Some((KvSource { addr, blocks, tokens: held.tokens(), lease: None }, held));
                }
            }
            let delivered = s.sink.send(RequestEvent::Finished {
                reason: f.reason.into(),
                prompt_tokens: f.prompt_tokens,
                cached_tokens: f.cached_tokens,
                completion_tokens: f.token_ids.len(),
                kv: leased.as_ref().map(|(source, _)| source.clone()),
                received,
            });
            if let Some((_, kv)) = leased {
                let state = State::Leased { kv, pushing: push != Push::No && delivered };
                self.sessions.insert(f.id, Session { state, sink: s.sink, span: s.span.clone() });
                if !delivered {
                    // The conductor gave up on this request (its stream is closed): no one will
                    // take the hand-off, so nothing is pushed and the lease ends now.
                    tracing::info!("no one listens for the hand-off; ending its lease");
                    gone.retain(|&g| g != f.id);
                    self.actions.push(Action::CancelLease(f.id));
                } else {
                    match push {
                        Push::No => {}
                        Push::Whole => self.actions.push(Action::Push { id: f.id, span: s.span.clone() }),
                        Push::Layers => self.actions.push(Action::EndPush {
                            id: f.id,
                            tokens: f.token_ids.clone(),
                            span: s.span.clone(),
                        }),
                    }
                }
            }
        }
        for id in gone {
            self.abort(host, id);
        }
        self.settle(host);
    }

    /// The engine failed a step: every request in it fails (the others wait on).
    pub fn step_failed(&mut self, host: &mut impl Host, error: &str) {
        let running: Vec<RequestId> =
            self.sessions.iter().filter(|(_, s)| matches!(s.state, State::Running { .. })).map(|(&id, _)| id).collect();
        for id in running {
            if let Some(s) = self.sessions.remove(&id) {
                s.sink.send(RequestEvent::Failed(WorkerError::Engine(error.to_owned())));
            }
            if let Some(kv) = host.abort(id) {
                drop(self.hold(kv));
            }
        }
        self.settle(host);
    }

    /// The transfer thread ended a job: the request runs with the KV received, or recomputes it
    /// when the transfer failed. A result for a request gone, or for an earlier reservation,
    /// only frees its blocks.
    pub fn transfer_done(&mut self, host: &mut impl Host, done: TransferDone) {
        let TransferDone { id, generation, kv, skip, result, trailer, span } = done;
        let current = matches!(
            self.sessions.get(&id).map(|s| &s.state),
            Some(State::Receiving { generation: g, .. }) if *g == generation
        );
        if !current {
            drop(kv);
            self.settle(host);
            return;
        }
        let Some(s) = self.sessions.remove(&id) else { return };
        let State::Receiving { mut req, mode, push, import, .. } = s.state else { return };
        let _entered = span.entered();
        let mut received = None;
        // A layer-wise hand-off brings the prefill's first token with its last layer.
        let result = match result {
            Ok(_) if mode == KvTransfer::Layerwise && trailer.is_empty() => {
                Err(TransferFailure::Peer("the push ended without the first token".into()))
            }
            other => other,
        };
        match result {
            Err(e) if mode == KvTransfer::Layerwise => {
                // Nothing to recompute from without the first token: the conductor sends the
                // request again, with it.
                tracing::warn!(error = %e, "the layer-wise hand-off failed; giving the request back");
                drop(kv);
                s.sink.send(RequestEvent::Failed(WorkerError::Handoff(e.to_string())));
                self.settle(host);
                return;
            }
            Ok(stats) => {
                if mode == KvTransfer::Layerwise {
                    req.generated.extend_from_slice(&trailer);
                }
                tracing::info!(bytes = stats.bytes, calls = stats.calls, transport = %stats.transport, "received KV");
                if stats.transport == TransportKind::Device {
                    // The blocks this worker cached already did not travel.
                    host.arrived_on_device(kv.blocks().get(skip..).unwrap_or_default());
                }
                received = Some(Received {
                    tokens: kv.tokens().saturating_sub(skip * host.block_size()),
                    bytes: stats.bytes,
                    micros: u64::try_from(stats.elapsed.as_micros()).unwrap_or(u64::MAX),
                    transport: Some(stats.transport),
                });
                req.prefix = kv.into_prefix();
            }
            Err(e) => {
                // The KV did not arrive (the peer died, its lease ended, the link broke): this
                // worker has the prompt and the tokens so far, so it recomputes the KV itself.
                tracing::warn!(error = %e, "receiving KV failed; recomputing the prompt here");
                drop(kv);
            }
        }
        if import {
            let cached = skip * host.block_size();
            if let Some(kv) = req.prefix.take() {
                host.import_kv(&req.prompt, kv);
            }
            Self::imported(&s.sink, req.prompt.len(), cached, received);
        } else {
            self.start_received(host, *req, push, received, s.sink, s.span);
        }
        self.settle(host);
    }

    /// Offers blocks of this worker's prefix cache (`kv`, one reference each, taken by the
    /// caller) to a peer that fetches them, under lease `lease` on the KV server: the session is
    /// leased from the start, and ends as a hand-off's lease ends (COMPLETE, expiry, the
    /// conductor's release). `None` when the lease id is taken or the KV server refuses; the
    /// blocks are released then.
    pub fn export(&mut self, host: &mut impl Host, lease: RequestId, kv: KvPrefix, sink: S) -> Option<KvSource> {
        let held = self.hold(kv);
        let source = if self.sessions.contains_key(&lease) {
            None
        } else {
            host.offer(lease, held.blocks()).map(|addr| KvSource {
                addr,
                blocks: held.blocks().iter().map(|b| b.0).collect(),
                tokens: held.tokens(),
                lease: Some(lease.0),
            })
        };
        if source.is_some() {
            let span = tracing::info_span!("export", lease = lease.0);
            self.sessions.insert(lease, Session { state: State::Leased { kv: held, pushing: false }, sink, span });
        } else {
            drop(held);
        }
        self.settle(host);
        source
    }

    /// The KV server ended a request's lease (COMPLETE, expiry or cancel): its blocks are the
    /// engine's again.
    pub fn lease_ended(&mut self, host: &mut impl Host, id: RequestId) {
        if matches!(self.sessions.get(&id).map(|s| &s.state), Some(State::Leased { .. })) {
            self.sessions.remove(&id);
        }
        self.settle(host);
    }

    /// The conductor gives up a hand-off: its lease ends now.
    pub fn release(&mut self, host: &mut impl Host, id: RequestId) {
        if matches!(self.sessions.get(&id).map(|s| &s.state), Some(State::Leased { .. })) {
            self.actions.push(Action::CancelLease(id));
        }
        self.settle(host);
    }

    /// Ends a request wherever it is; whatever it holds is freed (a lease when the server ends
    /// it, a transfer's blocks when the transfer thread lets go of them).
    pub fn abort(&mut self, host: &mut impl Host, id: RequestId) {
        let Some(s) = self.sessions.get(&id) else { return };
        match &s.state {
            State::Leased { .. } => self.actions.push(Action::CancelLease(id)),
            State::Queued { .. } => {
                self.sessions.remove(&id);
                self.queue.retain(|&q| q != id);
            }
            State::Receiving { cancel, .. } => {
                cancel.cancel();
                self.sessions.remove(&id);
            }
            State::Running { .. } => {
                self.sessions.remove(&id);
                if let Some(kv) = host.abort(id) {
                    drop(self.hold(kv));
                }
            }
        }
        self.settle(host);
    }

    /// Every request is lost to its client (the worker stops): each client hears `Lost`, the
    /// engine's requests are aborted, and every block held here is freed.
    pub fn stop(&mut self, host: &mut impl Host, why: &str) {
        for (id, s) in self.sessions.drain() {
            if let State::Running { .. } = s.state
                && let Some(kv) = host.abort(id)
            {
                drop(HeldKv { kv: Some(kv), back: self.back.clone() });
            }
            if !matches!(s.state, State::Leased { .. }) {
                s.sink.send(RequestEvent::Lost { reason: why.to_owned() });
            }
        }
        self.queue.clear();
        self.settle(host);
    }

    /// Queues the engine's work: admits `req`, or fails it.
    fn start(&mut self, host: &mut impl Host, req: GenerationRequest, push: Push, sink: S, span: tracing::Span) {
        self.start_received(host, req, push, None, sink, span);
    }

    /// [`Self::start`] for a request that received KV first.
    fn start_received(
        &mut self,
        host: &mut impl Host,
        req: GenerationRequest,
        push: Push,
        received: Option<Received>,
        sink: S,
        span: tracing::Span,
    ) {
        let id = req.id;
        match host.add_request(req) {
            Ok(()) => {
                self.sessions.insert(id, Session { state: State::Running { push, received }, sink, span });
            }
            Err(e) => {
                sink.send(RequestEvent::Failed(e));
            }
        }
    }

    /// Starts the queued hand-offs that have room now, first come first served; one whose
    /// deadline passed runs by recomputing its prompt (its KV would be gone soon anyway).
    fn start_queued(&mut self, host: &mut impl Host, now: Instant) {
        while let Some(&id) = self.queue.front() {
            let Some(State::Queued { source, deadline, .. }) = self.sessions.get(&id).map(|s| &s.state) else {
                self.queue.pop_front();
                continue;
            };
            let blocks = source.tokens.div_ceil(host.block_size());
            // Leave a block per running sequence for its next decode step.
            let room = host.available_blocks() >= blocks + host.running();
            let overdue = now >= *deadline;
            if !room && !overdue {
                break;
            }
            self.queue.pop_front();
            let Some(s) = self.sessions.remove(&id) else { continue };
            let State::Queued { req, source, mode, push, import, .. } = s.state else { continue };
            let _entered = s.span.clone().entered();
            // What this worker caches of the KV already need not travel. (A push writes every
            // block the prefill side holds, so push mode reserves them all.)
            let known: Vec<u32> = match mode {
                KvTransfer::Pull if req.prefix_cache => {
                    req.prompt.iter().chain(&req.generated).copied().take(source.tokens).collect()
                }
                _ => Vec::new(),
            };
            let reserved = if room { host.reserve_kv(&known, source.tokens) } else { None };
            match reserved {
                Some((kv, skip)) => {
                    if skip > 0 {
                        tracing::info!(cached_blocks = skip, "part of the KV is cached here: receiving the rest");
                    }
                    let generation = Generation(self.next_generation);
                    self.next_generation += 1;
                    let cancel = CancelToken::default();
                    let job = KvJob {
                        id,
                        generation,
                        kv: self.hold(kv),
                        skip,
                        source,
                        mode,
                        cancel: cancel.clone(),
                        span: s.span.clone(),
                    };
                    self.actions.push(Action::Transfer(job));
                    let state = State::Receiving { req, generation, cancel, mode, push, import };
                    self.sessions.insert(id, Session { state, sink: s.sink, span: s.span });
                }
                None if import => {
                    tracing::info!("no room for KV to import in time; not importing it");
                    Self::imported(&s.sink, req.prompt.len(), 0, None);
                }
                None if mode == KvTransfer::Layerwise => {
                    // Without the first token there is nothing to recompute from.
                    tracing::warn!("no room for a layer-wise hand-off in time; giving the request back");
                    s.sink.send(RequestEvent::Failed(WorkerError::Handoff("no room for its KV in time".into())));
                }
                None => {
                    if room {
                        tracing::warn!("no room for the KV after all; recomputing the prompt here");
                    } else {
                        tracing::warn!("no room for the KV in time; recomputing the prompt here");
                    }
                    self.start(host, *req, push, s.sink, s.span);
                }
            }
        }
    }

    /// Gives the blocks dropped since the last event back to the engine.
    fn settle(&mut self, host: &mut impl Host) {
        while let Ok(kv) = self.returned.try_recv() {
            host.release_kv(kv);
        }
    }
}

#[cfg(test)]
mod tests {
    //! Every transition of the machine, driven by hand with a fake engine that counts blocks:
    //! after each scenario no block is held outside the engine's own requests, so the `Drop`
    //! accounting is proven, not assumed.

    use std::cell::{Cell, RefCell};
    use std::collections::{HashMap, HashSet};
    use std::rc::Rc;

    use baton_engine::{FinishReason, Finished, TokenEvent};

    use super::*;

    const BS: usize = 4;

    #[derive(Clone, Default)]
    struct TestSink {
        events: Rc<RefCell<Vec<RequestEvent>>>,
        closed: Rc<Cell<bool>>,
    }

    impl Sink for TestSink {
        fn send(&self, event: RequestEvent) -> bool {
            if self.closed.get() {
                return false;
            }
            self.events.borrow_mut().push(event);
            true
        }

        fn is_closed(&self) -> bool {
            self.closed.get()
        }
    }

    impl TestSink {
        fn names(&self) -> Vec<&'static str> {
            self.events
                .borrow()
                .iter()
                .map(|e| match e {
                    RequestEvent::Token { .. } => "token",
                    RequestEvent::Finished { kv: Some(_), .. } => "finished+kv",
                    RequestEvent::Finished { .. } => "finished",
                    RequestEvent::Failed(_) => "failed",
                    RequestEvent::Lost { .. } => "lost",
                })
                .collect()
        }

        fn close(&self) {
            self.closed.set(true);
        }
    }

    /// An engine of `total` blocks: blocks are handed out and must come back exactly once.
    struct FakeHost {
        total: usize,
        next: u32,
        /// Blocks out of the free list (reserved, in a request, or retained).
        taken: HashSet<u32>,
        /// Requests in the engine, with the blocks they hold.
        engine: HashMap<RequestId, Vec<BlockId>>,
        refuse: bool,
        offer: bool,
        /// Leading blocks of any KV to receive that "are cached" here.
        cached_blocks: usize,
        /// Blocks imported into the "cache".
        imported: usize,
        /// Tokens generated elsewhere that requests came with.
        generated: HashMap<RequestId, Vec<u32>>,
        /// Blocks told they arrived device to device.
        on_device: Vec<BlockId>,
    }

    impl FakeHost {
        fn new(total: usize) -> Self {
            Self {
                total,
                next: 0,
                taken: HashSet::new(),
                engine: HashMap::new(),
                refuse: false,
                offer: true,
                cached_blocks: 0,
                imported: 0,
                generated: HashMap::new(),
                on_device: Vec::new(),
            }
        }

        fn alloc(&mut self, n: usize) -> Vec<BlockId> {
            (0..n)
                .map(|_| {
                    self.next += 1;
                    assert!(self.taken.insert(self.next));
                    BlockId(self.next)
                })
                .collect()
        }

        fn free(&mut self, blocks: &[BlockId]) {
            for b in blocks {
                assert!(self.taken.remove(&b.0), "block {} freed twice or never taken", b.0);
            }
        }

        /// The engine runs `id` to its end; `retain` keeps its KV (a prefill hand-off).
        fn finish(&mut self, id: RequestId, retain: bool) -> StepOutput {
            let mut blocks = self.engine.remove(&id).expect("request in the engine");
            // The engine computed the rest of the prompt into one more block.
            blocks.extend(self.alloc(1));
            let tokens = blocks.len() * BS;
            let kv = if retain {
                Some(KvPrefix { blocks, tokens })
            } else {
                self.free(&blocks);
                None
            };
            let finished = Finished {
                id,
                reason: FinishReason::Length,
                prompt_tokens: tokens,
                cached_tokens: 0,
                token_ids: vec![7],
                text: String::new(),
                prompt_logits: None,
                kv,
            };
            StepOutput { tokens: vec![token(id)], finished: vec![finished], computed_tokens: 1, ..Default::default() }
        }

        /// Blocks held by no request in the engine: must be none once the sessions let go.
        fn leaked(&self) -> usize {
            let in_engine: usize = self.engine.values().map(Vec::len).sum();
            self.taken.len() - in_engine
        }
    }

    impl Host for FakeHost {
        fn add_request(&mut self, mut req: GenerationRequest) -> Result<(), WorkerError> {
            let prefix = req.prefix.take().map(|p| p.blocks).unwrap_or_default();
            if self.refuse {
                // As the real engine: a refused request's received KV is released.
                self.free(&prefix);
                return Err(WorkerError::InvalidRequest("refused".into()));
            }
            self.engine.insert(req.id, prefix);
            self.generated.insert(req.id, req.generated);
            Ok(())
        }

        fn abort(&mut self, id: RequestId) -> Option<KvPrefix> {
            let blocks = self.engine.remove(&id)?;
            self.free(&blocks);
            None
        }

        fn reserve_kv(&mut self, known: &[u32], tokens: usize) -> Option<(KvPrefix, usize)> {
            let n = tokens.div_ceil(BS);
            let cached = self.cached_blocks.min(known.len() / BS).min(n.saturating_sub(1));
            (self.available_blocks() >= n).then(|| (KvPrefix { blocks: self.alloc(n), tokens }, cached))
        }

        fn release_kv(&mut self, kv: KvPrefix) {
            self.free(&kv.blocks);
        }

        fn import_kv(&mut self, tokens: &[u32], kv: KvPrefix) {
            assert!(kv.tokens <= tokens.len(), "KV of the tokens named");
            self.imported += kv.blocks.len();
            self.free(&kv.blocks);
        }

        fn available_blocks(&self) -> usize {
            self.total - self.taken.len()
        }

        fn running(&self) -> usize {
            self.engine.len()
        }

        fn block_size(&self) -> usize {
            BS
        }

        fn offer(&mut self, _id: RequestId, _blocks: &[BlockId]) -> Option<SocketAddr> {
            self.offer.then(addr)
        }

        fn arrived_on_device(&mut self, blocks: &[BlockId]) {
            self.on_device.extend_from_slice(blocks);
        }
    }

    fn span() -> tracing::Span {
        tracing::Span::none()
    }

    fn addr() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 7000))
    }

    fn token(id: RequestId) -> TokenEvent {
        TokenEvent { id, token: 7, text_delta: "x".into(), logprobs: None }
    }

    fn sessions() -> Sessions<TestSink> {
        Sessions::new(SessionConfig { incoming_wait: Duration::from_secs(10), can_receive: true })
    }

    fn request(id: u64, retain: bool) -> GenerationRequest {
        let mut req = GenerationRequest::new(RequestId(id), vec![1; 10]);
        req.retain_kv = if retain { KvRetention::All } else { KvRetention::None };
        req
    }

    fn source(tokens: usize) -> KvSource {
        KvSource { addr: addr(), blocks: (0..tokens.div_ceil(BS) as u32).collect(), tokens, lease: None }
    }

    fn state(s: &Sessions<TestSink>, id: u64) -> Option<&'static str> {
        s.state(RequestId(id)).map(State::name)
    }

    /// Submits a hand-off (decode side) and returns its sink.
    fn submit_kv(s: &mut Sessions<TestSink>, h: &mut FakeHost, now: Instant, id: u64, tokens: usize) -> TestSink {
        let sink = TestSink::default();
        let req = request(id, false);
        let source = Some(source(tokens));
        s.submit(
            h,
            now,
            Submission { req, source, mode: KvTransfer::Pull, push: Push::No, sink: sink.clone(), span: span() },
        );
        sink
    }

    fn submit(s: &mut Sessions<TestSink>, h: &mut FakeHost, id: u64, retain: bool, mode: KvTransfer) -> TestSink {
        let sink = TestSink::default();
        let req = request(id, retain);
        let push = if mode == KvTransfer::Push { Push::Whole } else { Push::No };
        s.submit(h, Instant::now(), Submission { req, source: None, mode, push, sink: sink.clone(), span: span() });
        sink
    }

    fn take_jobs(s: &mut Sessions<TestSink>) -> Vec<KvJob> {
        s.ready()
            .into_iter()
            .filter_map(|a| match a {
                Action::Transfer(job) => Some(job),
                _ => None,
            })
            .collect()
    }

    fn take_job(s: &mut Sessions<TestSink>) -> KvJob {
        let mut jobs = take_jobs(s);
        assert_eq!(jobs.len(), 1, "one transfer started");
        jobs.remove(0)
    }

    fn ok() -> Result<TransferStats, TransferFailure> {
        Ok(TransferStats::default())
    }

    #[test]
    fn a_colocated_request_runs_and_ends() {
        let (mut s, mut h) = (sessions(), FakeHost::new(16));
        let sink = submit(&mut s, &mut h, 1, false, KvTransfer::Pull);
        assert_eq!(state(&s, 1), Some("running"));
        let out = h.finish(RequestId(1), false);
        s.step_output(&mut h, out);
        assert_eq!(sink.names(), ["token", "finished"]);
        assert_eq!(state(&s, 1), None);
        assert!(s.is_empty());
        assert_eq!(h.leaked(), 0);
    }

    #[test]
    fn a_prefill_hand_off_is_leased_until_the_lease_ends() {
        let (mut s, mut h) = (sessions(), FakeHost::new(16));
        let sink = submit(&mut s, &mut h, 1, true, KvTransfer::Pull);
        let out = h.finish(RequestId(1), true);
        s.step_output(&mut h, out);
        assert_eq!(sink.names(), ["token", "finished+kv"]);
        assert_eq!(state(&s, 1), Some("leased"));
        assert!(s.ready().is_empty(), "pull mode starts no push");
        assert_eq!(h.leaked(), 1, "the lease holds the KV");
        assert_eq!(s.counts().leased, 1);
        // COMPLETE, expiry and cancel all arrive as the lease's end.
        s.lease_ended(&mut h, RequestId(1));
        assert_eq!(state(&s, 1), None);
        assert_eq!(h.leaked(), 0);
    }

    #[test]
    fn a_fetched_prefix_is_received_then_the_rest_computed_and_pushed() {
        let (mut s, mut h) = (sessions(), FakeHost::new(16));
        let sink = TestSink::default();
        // A prefill worker fetching 2 blocks of a peer's cache, in push mode for its hand-off.
        let submission = Submission {
            req: request(1, true),
            source: Some(KvSource { lease: Some(7), ..source(2 * BS) }),
            mode: KvTransfer::Pull,
            push: Push::Whole,
            sink: sink.clone(),
            span: span(),
        };
        s.submit(&mut h, Instant::now(), submission);
        let job = take_job(&mut s);
        assert_eq!((job.mode, job.source.lease), (KvTransfer::Pull, Some(7)), "a fetch is always pulled");
        let stats = TransferStats { bytes: 640, ..TransferStats::default() };
        s.transfer_done(&mut h, job.done(Ok(stats)));
        assert_eq!(state(&s, 1), Some("running"));
        let out = h.finish(RequestId(1), true);
        s.step_output(&mut h, out);
        assert!(matches!(
            &sink.events.borrow()[1],
            RequestEvent::Finished { received: Some(Received { tokens: 8, bytes: 640, .. }), .. }
        ));
        assert_eq!(state(&s, 1), Some("pushing"), "the fetched request still pushes its hand-off");
        s.lease_ended(&mut h, RequestId(1));
        assert_eq!(h.leaked(), 0);
    }

    #[test]
    fn kv_cached_here_already_is_left_out_of_a_pull_not_of_a_push() {
        let (mut s, mut h) = (sessions(), FakeHost::new(16));
        h.cached_blocks = 2;
        let sink = submit_kv(&mut s, &mut h, Instant::now(), 1, 3 * BS);
        let job = take_job(&mut s);
        assert_eq!(job.skip, 2, "two of three blocks are cached: one travels");
        s.transfer_done(&mut h, job.done(ok()));
        let out = h.finish(RequestId(1), false);
        s.step_output(&mut h, out);
        assert!(matches!(
            &sink.events.borrow()[1],
            RequestEvent::Finished { received: Some(Received { tokens: BS, .. }), .. }
        ));
        // A push writes every block the prefill side holds: nothing is skipped.
        let req = request(2, false);
        let submission = Submission {
            req,
            source: Some(source(3 * BS)),
            mode: KvTransfer::Push,
            push: Push::No,
            sink: TestSink::default(),
            span: span(),
        };
        s.submit(&mut h, Instant::now(), submission);
        assert_eq!(take_job(&mut s).skip, 0);
        assert!(h.on_device.is_empty(), "nothing arrived device to device");
    }

    #[test]
    fn kv_that_arrived_device_to_device_is_marked_so_in_the_engine_and_only_what_travelled() {
        let (mut s, mut h) = (sessions(), FakeHost::new(16));
        h.cached_blocks = 2;
        submit_kv(&mut s, &mut h, Instant::now(), 1, 3 * BS);
        let job = take_job(&mut s);
        let travelled = job.kv.blocks()[2..].to_vec();
        let stats = TransferStats { transport: TransportKind::Device, bytes: 64, ..TransferStats::default() };
        s.transfer_done(&mut h, job.done(Ok(stats)));
        assert_eq!(h.on_device, travelled, "the block that travelled, not those cached here");
        // Over shared memory or TCP the host arena got the bytes: nothing to mark.
        submit_kv(&mut s, &mut h, Instant::now(), 2, 3 * BS);
        let stats = TransferStats { transport: TransportKind::Shm, bytes: 64, ..TransferStats::default() };
        let job = take_job(&mut s);
        s.transfer_done(&mut h, job.done(Ok(stats)));
        assert_eq!(h.on_device, travelled);
    }

    #[test]
    fn an_import_caches_what_arrives_and_runs_nothing() {
        let (mut s, mut h) = (sessions(), FakeHost::new(16));
        h.cached_blocks = 1;
        let sink = TestSink::default();
        s.import(&mut h, Instant::now(), RequestId(3), vec![1; 12], source(12), sink.clone());
        let job = take_job(&mut s);
        assert_eq!((job.skip, job.mode), (1, KvTransfer::Pull), "what is cached here does not travel");
        s.transfer_done(&mut h, job.done(ok()));
        assert!(matches!(
            &sink.events.borrow()[..],
            [RequestEvent::Finished { cached_tokens: 4, received: Some(Received { tokens: 8, .. }), .. }]
        ));
        assert_eq!((h.imported, h.engine.len(), h.leaked()), (3, 0, 0), "cached, nothing run, nothing held");
        assert!(s.is_empty());
        // A failed pull imports nothing, and says so.
        let sink = TestSink::default();
        s.import(&mut h, Instant::now(), RequestId(4), vec![1; 12], source(12), sink.clone());
        let job = take_job(&mut s);
        s.transfer_done(&mut h, job.done(Err(TransferFailure::Peer("gone".into()))));
        assert!(matches!(&sink.events.borrow()[..], [RequestEvent::Finished { received: None, .. }]));
        assert_eq!((h.imported, h.leaked()), (3, 0));
    }

    /// An import never waits for room: behind a queued hand-off, or without room now, it is
    /// declined at once (its exporter then lets go of the blocks it leased for it), and the
    /// queue is left as it was.
    #[test]
    fn an_import_without_room_now_is_declined_at_once() {
        let (mut s, mut h) = (sessions(), FakeHost::new(4));
        let sink = TestSink::default();
        s.import(&mut h, Instant::now(), RequestId(3), vec![1; 8 * BS], source(8 * BS), sink.clone());
        assert!(matches!(&sink.events.borrow()[..], [RequestEvent::Finished { received: None, .. }]));
        assert!(s.is_empty() && !s.has_queued(), "nothing queued");
        // A hand-off waiting for room: an import that would fit still does not jump it.
        submit_kv(&mut s, &mut h, Instant::now(), 1, 8 * BS);
        assert_eq!(state(&s, 1), Some("queued"));
        let sink = TestSink::default();
        s.import(&mut h, Instant::now(), RequestId(4), vec![1; BS], source(BS), sink.clone());
        assert!(matches!(&sink.events.borrow()[..], [RequestEvent::Finished { received: None, .. }]));
        assert_eq!(s.counts().queued, 1, "only the hand-off waits");
        assert_eq!(h.leaked(), 0);
    }

    #[test]
    fn an_exported_prefix_is_leased_until_the_lease_ends() {
        let (mut s, mut h) = (sessions(), FakeHost::new(16));
        let kv = h.reserve_kv(&[], 2 * BS).expect("room").0;
        let source = s.export(&mut h, RequestId(9), kv, TestSink::default()).expect("offered");
        assert_eq!((source.blocks.len(), source.tokens, source.lease), (2, 2 * BS, Some(9)));
        assert_eq!(state(&s, 9), Some("leased"));
        // A second export under the same lease id is refused, and its blocks freed.
        let again = h.reserve_kv(&[], BS).expect("room").0;
        assert!(s.export(&mut h, RequestId(9), again, TestSink::default()).is_none());
        assert_eq!(h.leaked(), 2, "the first export's blocks stay held");
        s.release(&mut h, RequestId(9));
        assert!(matches!(s.ready()[..], [Action::CancelLease(RequestId(9))]));
        s.lease_ended(&mut h, RequestId(9));
        assert_eq!((state(&s, 9), h.leaked()), (None, 0));
        // Without a KV server nothing is offered, and nothing kept.
        h.offer = false;
        let kv = h.reserve_kv(&[], BS).expect("room").0;
        assert!(s.export(&mut h, RequestId(10), kv, TestSink::default()).is_none());
        assert_eq!(h.leaked(), 0);
    }

    #[test]
    fn a_hand_off_no_one_listens_for_is_released_at_once() {
        for mode in [KvTransfer::Pull, KvTransfer::Push] {
            let (mut s, mut h) = (sessions(), FakeHost::new(16));
            let sink = submit(&mut s, &mut h, 1, true, mode);
            // The conductor gives up (its stream closes) while the prefill is in the step.
            sink.closed.set(true);
            let out = h.finish(RequestId(1), true);
            s.step_output(&mut h, out);
            assert!(matches!(s.ready()[..], [Action::CancelLease(RequestId(1))]), "{mode:?}: no push, the lease ends");
            s.lease_ended(&mut h, RequestId(1));
            assert_eq!(state(&s, 1), None);
            assert_eq!(h.leaked(), 0, "{mode:?}");
        }
    }

    #[test]
    fn push_mode_starts_a_push_and_the_conductor_can_release_it() {
        let (mut s, mut h) = (sessions(), FakeHost::new(16));
        submit(&mut s, &mut h, 1, true, KvTransfer::Push);
        let out = h.finish(RequestId(1), true);
        s.step_output(&mut h, out);
        assert_eq!(state(&s, 1), Some("pushing"));
        assert!(matches!(s.ready()[..], [Action::Push { id: RequestId(1), .. }]));
        s.release(&mut h, RequestId(1));
        assert!(matches!(s.ready()[..], [Action::CancelLease(RequestId(1))]));
        assert_eq!(h.leaked(), 1, "held until the server says the lease ended");
        s.lease_ended(&mut h, RequestId(1));
        assert_eq!(h.leaked(), 0);
    }

    #[test]
    fn kv_that_cannot_be_offered_is_freed_and_the_request_still_ends() {
        let (mut s, mut h) = (sessions(), FakeHost::new(16));
        h.offer = false;
        let sink = submit(&mut s, &mut h, 1, true, KvTransfer::Push);
        let out = h.finish(RequestId(1), true);
        s.step_output(&mut h, out);
        assert_eq!(sink.names(), ["token", "finished"]);
        assert!(s.ready().is_empty(), "nothing to push");
        assert!(s.is_empty());
        assert_eq!(h.leaked(), 0);
    }

    #[test]
    fn a_hand_off_receives_its_kv_then_runs_on_it() {
        let (mut s, mut h) = (sessions(), FakeHost::new(16));
        let now = Instant::now();
        let sink = submit_kv(&mut s, &mut h, now, 1, 10);
        assert_eq!(state(&s, 1), Some("receiving"));
        let job = take_job(&mut s);
        assert_eq!(job.kv.blocks().len(), 3);
        assert_eq!(h.leaked(), 3, "reserved for the transfer");
        s.transfer_done(&mut h, job.done(ok()));
        assert_eq!(state(&s, 1), Some("running"));
        assert_eq!(h.engine[&RequestId(1)].len(), 3, "the engine took the received blocks as the prefix");
        assert_eq!(h.leaked(), 0);
        let out = h.finish(RequestId(1), false);
        s.step_output(&mut h, out);
        assert_eq!(sink.names(), ["token", "finished"]);
        assert_eq!(h.taken.len(), 0);
    }

    /// A request id whose earlier holder's client is gone is free: the conductor may route the
    /// request here again before the abort of the earlier one arrived (a layer-wise decode
    /// half it gave up). One whose client still listens is refused.
    #[test]
    fn an_id_whose_client_left_can_be_submitted_again() {
        let (mut s, mut h) = (sessions(), FakeHost::new(16));
        let now = Instant::now();
        let old = submit_kv(&mut s, &mut h, now, 1, 10);
        assert_eq!(state(&s, 1), Some("receiving"));
        let refused = submit_kv(&mut s, &mut h, now, 1, 10);
        assert_eq!(refused.names(), ["failed"], "the first still has its client");
        old.close();
        let again = submit_kv(&mut s, &mut h, now, 1, 10);
        assert!(again.names().is_empty(), "{:?}", again.names());
        assert_eq!(state(&s, 1), Some("receiving"));
        // Both reservations' jobs: the first's result is stale, the second's is taken.
        let jobs = take_jobs(&mut s);
        assert_eq!(jobs.len(), 2);
        for job in jobs {
            s.transfer_done(&mut h, job.done(ok()));
        }
        assert_eq!(state(&s, 1), Some("running"));
        assert_eq!(h.engine[&RequestId(1)].len(), 3);
        assert_eq!(h.leaked(), 0, "the first reservation was freed");
    }

    /// A layer-wise hand-off (decode side): blocks reserved for a source that names none (the
    /// prefill has not run), registered like a push; the last write brings the first token,
    /// which the request continues from. Without it, or without the KV, the request is given
    /// back to the conductor (there is no first token to recompute from), its blocks freed.
    #[test]
    fn a_layerwise_hand_off_continues_from_the_pushed_token_or_is_given_back() {
        let layerwise = |s: &mut Sessions<TestSink>, h: &mut FakeHost, id: u64| {
            let sink = TestSink::default();
            let source = Some(KvSource { addr: addr(), blocks: Vec::new(), tokens: 10, lease: None });
            let (req, mode, push) = (request(id, false), KvTransfer::Layerwise, Push::No);
            s.submit(h, Instant::now(), Submission { req, source, mode, push, sink: sink.clone(), span: span() });
            sink
        };
        let (mut s, mut h) = (sessions(), FakeHost::new(16));
        let sink = layerwise(&mut s, &mut h, 1);
        let job = take_job(&mut s);
        assert_eq!((job.mode, job.kv.blocks().len()), (KvTransfer::Layerwise, 3));
        s.transfer_done(&mut h, job.done_with(ok(), vec![42]));
        assert_eq!(state(&s, 1), Some("running"));
        assert_eq!(h.engine[&RequestId(1)].len(), 3, "the engine took the pushed blocks as the prefix");
        assert_eq!(h.generated[&RequestId(1)], [42], "it continues from the prefill's first token");
        assert!(sink.names().is_empty());

        for (id, result, trailer) in
            [(2, ok(), Vec::new()), (3, Err(TransferFailure::Peer("the prefill worker died".into())), Vec::new())]
        {
            let sink = layerwise(&mut s, &mut h, id);
            let job = take_job(&mut s);
            s.transfer_done(&mut h, job.done_with(result, trailer));
            assert_eq!(state(&s, id), None, "request {id} given back");
            assert!(
                matches!(&sink.events.borrow()[..], [RequestEvent::Failed(WorkerError::Handoff(_))]),
                "request {id}: {:?}",
                sink.names()
            );
        }
        // No room until the deadline: given back too, not recomputed.
        let (mut s, mut h) = (sessions(), FakeHost::new(2));
        let now = Instant::now();
        let sink = layerwise(&mut s, &mut h, 4);
        assert_eq!(state(&s, 4), Some("queued"));
        s.tick(&mut h, now + Duration::from_secs(11));
        assert_eq!((state(&s, 4), sink.names()), (None, vec!["failed"]));
        assert_eq!(h.leaked(), 0);
    }

    /// A layer-wise push (prefill side): the engine streams the layers; when the request
    /// finishes its KV is leased and the last write, with the first token, is queued.
    #[test]
    fn a_layerwise_push_ends_with_the_first_token() {
        let (mut s, mut h) = (sessions(), FakeHost::new(16));
        let (sink, req) = (TestSink::default(), request(1, true));
        let (mode, push) = (KvTransfer::Layerwise, Push::Layers);
        s.submit(
            &mut h,
            Instant::now(),
            Submission { req, source: None, mode, push, sink: sink.clone(), span: span() },
        );
        let out = h.finish(RequestId(1), true);
        s.step_output(&mut h, out);
        assert_eq!(state(&s, 1), Some("pushing"));
        assert!(matches!(&s.ready()[..], [Action::EndPush { id: RequestId(1), tokens, .. }] if tokens == &[7]));
        assert_eq!(sink.names(), ["token", "finished+kv"], "the lease stands for a pull should the push fail");
        s.release(&mut h, RequestId(1));
        s.lease_ended(&mut h, RequestId(1));
        assert_eq!(h.leaked(), 0);
    }

    #[test]
    fn a_failed_transfer_recomputes_the_prompt() {
        let (mut s, mut h) = (sessions(), FakeHost::new(16));
        let sink = submit_kv(&mut s, &mut h, Instant::now(), 1, 10);
        let job = take_job(&mut s);
        s.transfer_done(&mut h, job.done(Err(TransferFailure::Peer("the peer died".into()))));
        assert_eq!(state(&s, 1), Some("running"));
        assert!(h.engine[&RequestId(1)].is_empty(), "no prefix: the prompt is recomputed");
        assert_eq!(h.leaked(), 0, "the reserved blocks were freed");
        assert!(sink.names().is_empty(), "the client sees no error");
    }

    #[test]
    fn a_hand_off_without_room_waits_then_starts_or_recomputes_at_its_deadline() {
        let (mut s, mut h) = (sessions(), FakeHost::new(4));
        let now = Instant::now();
        let other = submit(&mut s, &mut h, 9, true, KvTransfer::Pull);
        let out = h.finish(RequestId(9), true);
        s.step_output(&mut h, out);
        assert_eq!(h.available_blocks(), 3);
        // 10 tokens need 3 blocks plus one per running sequence: there is room for one only.
        submit_kv(&mut s, &mut h, now, 1, 10);
        submit_kv(&mut s, &mut h, now, 2, 10);
        assert_eq!(state(&s, 1), Some("receiving"));
        assert_eq!(state(&s, 2), Some("queued"));
        assert_eq!(s.counts(), Counts { queued: 1, receiving: 1, running: 0, leased: 1 });
        let job = take_job(&mut s);
        // Room comes back when the first transfer is done, the lease ends and the request ends.
        s.transfer_done(&mut h, job.done(ok()));
        s.lease_ended(&mut h, RequestId(9));
        let out = h.finish(RequestId(1), false);
        s.step_output(&mut h, out);
        s.tick(&mut h, now);
        assert_eq!(state(&s, 2), Some("receiving"), "first come, first served once there is room");
        drop(take_job(&mut s));
        // A dropped job (a stopped transfer thread) frees its blocks by itself.
        s.tick(&mut h, now);
        assert_eq!(h.leaked(), 0);
        assert_eq!(other.names(), ["token", "finished+kv"]);

        // No room until the deadline: the prompt is recomputed here.
        let (mut s, mut h) = (sessions(), FakeHost::new(2));
        submit_kv(&mut s, &mut h, now, 3, 10);
        assert_eq!(state(&s, 3), Some("queued"));
        s.tick(&mut h, now + Duration::from_secs(9));
        assert_eq!(state(&s, 3), Some("queued"));
        s.tick(&mut h, now + Duration::from_secs(10));
        assert_eq!(state(&s, 3), Some("running"));
        assert_eq!(h.leaked(), 0);
    }

    #[test]
    fn abort_in_every_state_frees_everything() {
        let now = Instant::now();
        // Queued.
        let (mut s, mut h) = (sessions(), FakeHost::new(2));
        submit_kv(&mut s, &mut h, now, 1, 10);
        s.abort(&mut h, RequestId(1));
        assert!(s.is_empty() && !s.has_queued());
        s.tick(&mut h, now + Duration::from_secs(60));
        assert!(h.engine.is_empty(), "an aborted hand-off never starts");
        // Receiving: the blocks stay reserved until the transfer thread lets go of the job.
        let (mut s, mut h) = (sessions(), FakeHost::new(16));
        submit_kv(&mut s, &mut h, now, 1, 10);
        let job = take_job(&mut s);
        s.abort(&mut h, RequestId(1));
        assert!(job.cancel.is_cancelled(), "the transfer thread is told");
        assert_eq!(h.leaked(), 3, "a transfer may still write into them");
        s.transfer_done(&mut h, job.done(Err(TransferFailure::Cancelled)));
        assert_eq!(h.leaked(), 0);
        assert!(s.is_empty());
        // Running.
        let (mut s, mut h) = (sessions(), FakeHost::new(16));
        submit_kv(&mut s, &mut h, now, 1, 10);
        let job = take_job(&mut s);
        s.transfer_done(&mut h, job.done(ok()));
        s.abort(&mut h, RequestId(1));
        assert!(h.engine.is_empty() && h.taken.is_empty());
        // Leased: the lease is cancelled, and its end frees the blocks.
        let (mut s, mut h) = (sessions(), FakeHost::new(16));
        submit(&mut s, &mut h, 1, true, KvTransfer::Pull);
        let out = h.finish(RequestId(1), true);
        s.step_output(&mut h, out);
        s.abort(&mut h, RequestId(1));
        assert!(matches!(s.ready()[..], [Action::CancelLease(RequestId(1))]));
        s.lease_ended(&mut h, RequestId(1));
        assert_eq!(h.leaked(), 0);
        assert!(s.is_empty());
        // Unknown ids, twice: nothing happens.
        s.abort(&mut h, RequestId(1));
        s.lease_ended(&mut h, RequestId(1));
        s.release(&mut h, RequestId(1));
        assert!(s.ready().is_empty());
    }

    #[test]
    fn a_client_that_leaves_is_aborted_wherever_it_waits() {
        let now = Instant::now();
        let (mut s, mut h) = (sessions(), FakeHost::new(5));
        let running = submit(&mut s, &mut h, 1, false, KvTransfer::Pull);
        let receiving = submit_kv(&mut s, &mut h, now, 2, 10);
        let queued = submit_kv(&mut s, &mut h, now, 3, 10);
        assert_eq!(s.counts(), Counts { queued: 1, receiving: 1, running: 1, leased: 0 });
        let job = take_job(&mut s);
        for sink in [&running, &receiving, &queued] {
            sink.close();
        }
        s.tick(&mut h, now);
        assert!(s.is_empty());
        assert!(job.cancel.is_cancelled());
        drop(job);
        s.tick(&mut h, now);
        assert_eq!(h.taken.len(), 0);
        assert!(h.engine.is_empty());
        // A token that finds its client gone aborts the request too.
        let sink = submit(&mut s, &mut h, 4, false, KvTransfer::Pull);
        sink.close();
        s.step_output(&mut h, StepOutput { tokens: vec![token(RequestId(4))], ..Default::default() });
        assert!(s.is_empty() && h.engine.is_empty());
    }

    #[test]
    fn a_stale_transfer_result_never_takes_over_a_later_reservation() {
        let now = Instant::now();
        let (mut s, mut h) = (sessions(), FakeHost::new(16));
        submit_kv(&mut s, &mut h, now, 1, 10);
        let old = take_job(&mut s);
        s.abort(&mut h, RequestId(1));
        // The same request id comes again (a retried hand-off) and reserves anew.
        let sink = submit_kv(&mut s, &mut h, now, 1, 10);
        let new = take_job(&mut s);
        assert!(new.generation > old.generation);
        // The first transfer's late success must not start the request on its blocks.
        s.transfer_done(&mut h, old.done(ok()));
        assert_eq!(state(&s, 1), Some("receiving"));
        assert_eq!(h.leaked(), 3, "only the new reservation is held");
        s.transfer_done(&mut h, new.done(ok()));
        assert_eq!(state(&s, 1), Some("running"));
        assert_eq!(h.leaked(), 0);
        assert!(sink.names().is_empty());
    }

    #[test]
    fn a_failed_step_fails_the_running_requests_only() {
        let now = Instant::now();
        let (mut s, mut h) = (sessions(), FakeHost::new(4));
        let running = submit(&mut s, &mut h, 1, false, KvTransfer::Pull);
        submit_kv(&mut s, &mut h, now, 2, 10);
        s.step_failed(&mut h, "boom");
        assert_eq!(running.names(), ["failed"]);
        assert!(matches!(&running.events.borrow()[0], RequestEvent::Failed(WorkerError::Engine(m)) if m == "boom"));
        assert_eq!(state(&s, 2), Some("receiving"));
        assert!(h.engine.is_empty());
    }

    #[test]
    fn refusals_leave_nothing_held() {
        let now = Instant::now();
        // The engine refuses the request after its KV arrived: the KV is released.
        let (mut s, mut h) = (sessions(), FakeHost::new(16));
        let sink = submit_kv(&mut s, &mut h, now, 1, 10);
        let job = take_job(&mut s);
        h.refuse = true;
        s.transfer_done(&mut h, job.done(ok()));
        assert_eq!(sink.names(), ["failed"]);
        assert_eq!(h.taken.len(), 0);
        assert!(s.is_empty());
        // A worker without a transfer thread, blocks that cannot hold the tokens, a duplicate id.
        let mut s: Sessions<TestSink> =
            Sessions::new(SessionConfig { incoming_wait: Duration::from_secs(1), can_receive: false });
        let sink = submit_kv(&mut s, &mut h, now, 1, 10);
        assert!(matches!(&sink.events.borrow()[..], [RequestEvent::Failed(WorkerError::WrongRole(_))]));
        let mut s = sessions();
        let sink = TestSink::default();
        let bad = Some(KvSource { tokens: 100, ..source(10) });
        let submission = Submission {
            req: request(1, false),
            source: bad,
            mode: KvTransfer::Pull,
            push: Push::No,
            sink: sink.clone(),
            span: span(),
        };
        s.submit(&mut h, now, submission);
        assert_eq!(sink.names(), ["failed"]);
        h.refuse = false;
        submit(&mut s, &mut h, 5, false, KvTransfer::Pull);
        let twice = submit(&mut s, &mut h, 5, false, KvTransfer::Pull);
        assert!(matches!(&twice.events.borrow()[..], [RequestEvent::Failed(WorkerError::InvalidRequest(_))]));
        assert_eq!(s.counts().running, 1);
    }

    #[test]
    fn stopping_loses_every_request_and_frees_every_block() {
        let now = Instant::now();
        let (mut s, mut h) = (sessions(), FakeHost::new(6));
        let a = submit(&mut s, &mut h, 1, false, KvTransfer::Pull);
        let b = submit_kv(&mut s, &mut h, now, 2, 10);
        let c = submit_kv(&mut s, &mut h, now, 3, 10);
        let leased = submit(&mut s, &mut h, 4, true, KvTransfer::Pull);
        let out = h.finish(RequestId(4), true);
        s.step_output(&mut h, out);
        let job = take_job(&mut s);
        s.stop(&mut h, "the worker stopped");
        assert_eq!(a.names(), ["lost"]);
        assert_eq!(b.names(), ["lost"]);
        assert_eq!(c.names(), ["lost"]);
        assert_eq!(leased.names(), ["token", "finished+kv"], "a finished request hears nothing more");
        drop(job);
        s.tick(&mut h, now);
        assert!(s.is_empty());
        assert_eq!(h.taken.len(), 0);
    }
}
