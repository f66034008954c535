//! One state machine per request choice on the conductor, without I/O: the conductor's
//! counterpart of the worker's `baton_worker::session`.
//!
//! A [`Life`] is one choice of one request from its first route to its end. Its driver (the
//! conductor's task for the choice, [`crate::conductor`]) asks it what it waits for
//! ([`Life::waiting`]: a worker's next event, a holder's offer of a cached prefix, or nothing:
//! it is over), waits for that, and feeds it back — [`Life::event`], [`Life::offered`],
//! [`Life::client_gone`] — with the time as an argument. Everything else the life needs happens
//! synchronously through a [`Host`] (routing, the ledger of loads, the client's stream, the
//! breakers, the metrics) and the [`Peer`]s it is routed to (submitting work, releasing KV).
//! Tests drive it with a fake host and fake workers, no sockets, tasks or clocks.
//!
//! ```text
//!  route ──(a fetch planned)──▶ Offering ──offer or none──┐
//!    │                                                     ▼
//!    ├──colocated──────────────────────────────────────▶ Whole ─────────────finished──▶ Done
//!    └──disaggregated──▶ Prefill ──first token, KV leased──▶ Decode ───────finished──▶ Done
//!                          │ (max_tokens 1, a stop)            │ handoff failed: Decode again
//!                          └──────────────────────────────────▶│ decode worker lost: another one
//!   a worker lost before anything streamed: route again (Offering / Whole / Prefill)
//!   a colocated worker lost mid-stream: migrate (Whole on another worker, from the tokens so far)
//!   client gone, an error, retries spent: Done
//! ```
//!
//! Resources are released by `Drop`, never by hand: a planned fetch's lease on its holder is a
//! [`FetchLease`] (dropping it ends the offer), a worker's event stream is the peer's
//! [`Peer::Events`] (dropping it aborts the request there: the layer-wise decode half of a
//! failed prefill goes with the state that held it), and the ledger's entries are the host's
//! [`Host::Track`]s. Only the prefill worker's lease on the prompt's KV is released by a call
//! ([`Peer::release`]), at the points the protocol names: after the decode side is done with
//! it, or when the request ends before a hand-off.

use std::net::SocketAddr;
use std::time::Instant;

use baton_engine::{RequestId, StopParams};
use baton_model::{SamplingParams, TokenLogprobs};

use crate::metrics::{FetchOutcome, Metrics, Outcome};
use crate::openai::{LogprobEntry, ValidRequest};
use crate::response::Piece;
use baton_protocol::error::ApiError;
use baton_protocol::wire::Work;
use baton_protocol::wire::{KvSource, PdCaching, Received, WorkerError, fetch_lease};
use baton_protocol::{Finish, KvTransfer, RequestEvent, WorkRequest};

/// How many times a request whose worker was lost is routed again (or its decode half handed
/// to another decode worker).
pub(crate) const MAX_RETRIES: usize = 2;

/// A worker as a request's life sees it. Every call is synchronous and cheap (a message sent,
/// never a wait on the worker).
pub(crate) trait Peer: Clone {
    /// The stream of a submitted request's events; dropping it aborts the request there.
    type Events;
    /// The worker's name (unique in the cluster).
    fn name(&self) -> &str;
    /// Its KV server's address, when it has one (layer-wise hand-offs need it).
    fn kv_addr(&self) -> Option<SocketAddr>;
    /// Starts a request on the worker.
    fn submit(&self, req: WorkRequest) -> Self::Events;
    /// Tells the worker to release what it holds under `id` (a lease, a retained KV).
    fn release(&self, id: u64);
}

/// Where a request runs.
#[derive(Debug, Clone)]
pub(crate) enum Route<W> {
    /// One worker computes the prompt and generates every token.
    Colocated(W),
    /// The prefill worker computes the prompt and the first token; the decode worker the rest.
    Disaggregated {
        /// Computes the prompt.
        prefill: W,
        /// Generates from the prefill's KV.
        decode: W,
    },
}

/// A fetch the policy planned: the prompt's first `tokens` tokens, cached on `from`.
#[derive(Debug)]
pub(crate) struct PlannedFetch<W> {
    /// The holder.
    pub from: W,
    /// Prompt tokens it holds.
    pub tokens: usize,
}

/// A cached prefix a worker offers for one request's fetch. Dropping it ends the offer's lease
/// on the holder (a no-op once the fetching worker COMPLETEd its pull): whatever becomes of the
/// request, the holder's blocks are not kept for it.
#[derive(Debug)]
pub(crate) struct FetchLease<W: Peer> {
    /// The holder.
    pub from: W,
    /// The lease's transfer id.
    pub lease: u64,
}

impl<W: Peer> Drop for FetchLease<W> {
    fn drop(&mut self) {
        self.from.release(self.lease);
    }
}

/// A fetch under way for a request's prompt worker: what was offered, and the lease on it.
struct Fetching<W: Peer> {
    source: KvSource,
    _lease: FetchLease<W>,
}

/// What a request's life asks of the conductor. Nothing here waits.
pub(crate) trait Host {
    /// A worker.
    type Peer: Peer;
    /// An entry in the conductor's ledger of loads, removed when dropped.
    type Track;
    /// Routes the request among the workers not `excluded`; `admit` for one that has not
    /// started (it may be refused for load).
    fn route(&self, valid: &ValidRequest, excluded: &[String], admit: bool) -> Result<Route<Self::Peer>, ApiError>;
    /// Records that request `id` computes `prompt` on `worker`, `fetched` tokens of it fetched.
    fn track_prefill(&self, worker: &Self::Peer, id: RequestId, prompt: &[u32], fetched: usize) -> Self::Track;
    /// Records that request `id` decodes with `context` tokens on `worker`.
    fn track_decode(&self, worker: &Self::Peer, id: RequestId, context: usize) -> Self::Track;
    /// Whether the conductor has requests waiting for `worker`'s prefill.
    fn prefill_busy(&self, worker: &Self::Peer) -> bool;
    /// A request id no other request has.
    fn fresh_id(&self) -> u64;
    /// Takes the worker named `worker` out of routing after a failure.
    fn trip(&self, worker: &str, reason: &str);
    /// Sends a piece of the response to the client; `false` when it went away.
    fn send(&mut self, piece: Piece) -> bool;
    /// A token's log-probabilities as the response shows them.
    fn logprob_entry(&self, token: u32, lp: &TokenLogprobs) -> LogprobEntry;
    /// The first choice's prompt KV is in its worker's prefix cache: the other choices may start.
    fn prefilled(&mut self);
    /// PD-Caching-3: sends the blocks of `tokens` that `to` lacks back from `from`'s cache.
    fn return_kv(&self, from: Self::Peer, to: Self::Peer, id: RequestId, tokens: Vec<u32>);
    /// The conductor's metrics.
    fn metrics(&self) -> &Metrics;
}

/// The conductor's settings a request's life follows.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    /// How KV moves from prefill to decode workers.
    pub kv_transfer: KvTransfer,
    /// Where past requests' KV is kept.
    pub pd_caching: PdCaching,
    /// KV bytes a token for the transfer counter (emulated workers); `None` counts the bytes the
    /// workers moved.
    pub kv_bytes_per_token: Option<usize>,
}

/// Which choice of which request a life runs.
#[derive(Debug, Clone)]
pub(crate) struct Choice {
    /// The request.
    pub valid: ValidRequest,
    /// This choice's id (the request's first id plus its index).
    pub id: RequestId,
    /// Which of the request's `n` choices this is.
    pub index: usize,
    /// The client's (or a generated) `x-request-id`, passed to the workers for their logs.
    pub request_id: String,
}

/// Why an attempt ended without its request finishing.
#[derive(Debug)]
enum RunError {
    /// The client went away.
    Cancelled,
    /// The request failed.
    Api(ApiError),
    /// A worker went away.
    Lost { worker: String, reason: String },
    /// A layer-wise hand-off did not arrive; the decode worker gave the request back.
    Handoff(String),
}

/// How a prefill worker's part ended: why, the prompt's tokens, and the KV it leases.
type Prefilled = (Finish, usize, Option<KvSource>);

/// What the driver waits for next.
pub(crate) enum Waiting<'a, W: Peer> {
    /// The next event of the request on `worker` (or its silence, its loss, the client's going).
    Worker {
        /// The worker.
        worker: &'a W,
        /// Its stream of the request's events.
        events: &'a mut W::Events,
    },
    /// The holder's offer of a cached prefix (its export, within a deadline).
    Offer {
        /// The holder.
        from: &'a W,
        /// The lease to offer it under.
        lease: u64,
        /// The prefix.
        tokens: &'a [u32],
    },
    /// Nothing: the life is over.
    Done,
}

/// A worker's stream relayed to the client: a colocated worker's, or a decode worker's.
struct Relay<W: Peer, T> {
    worker: W,
    events: W::Events,
    /// When the hand-off of the KV began: the worker's first event means it arrived.
    handoff: Option<Instant>,
    /// Colocated: the prompt's ledger entry and its fetch, until the first token.
    prefill: Option<(T, Option<Fetching<W>>)>,
    colocated: bool,
    fetching: Option<Fetching<W>>,
    /// Colocated: the decode's ledger entry, from the first token.
    _decode: Option<T>,
    last: Option<Instant>,
    /// Tokens this worker streamed.
    relayed: Vec<u32>,
}

/// The decode half of a disaggregated request, across decode workers.
struct Handover<W: Peer> {
    prefill: W,
    decode: W,
    /// The prefill worker's leased KV (`None`: lost, so it is recomputed).
    kv: Option<KvSource>,
    /// The decode half sent before the prefill, that receives the KV layer by layer.
    early: Option<W::Events>,
    /// Tokens the prefill generated.
    first: usize,
    /// Every token the client has.
    generated: Vec<u32>,
    prompt_tokens: usize,
    /// Decode workers lost.
    tried: Vec<String>,
    /// When the next decode worker's hand-off begins (`None`: nothing to hand over).
    handoff: Option<Instant>,
}

enum State<W: Peer, T> {
    /// Waiting for a holder's offer of the prompt's cached prefix, before the prompt runs on
    /// `then`.
    Offering { lease: FetchLease<W>, tokens: usize, then: Route<W> },
    /// A worker runs the request whole (colocated, or continuing after a migration).
    Whole(Relay<W, T>),
    /// The prefill worker computes the prompt and the first token.
    Prefill {
        prefill: W,
        decode: W,
        events: W::Events,
        early: Option<W::Events>,
        _track: T,
        fetching: Option<Fetching<W>>,
        first: Vec<u32>,
    },
    /// A decode worker streams the rest.
    Decode { relay: Relay<W, T>, _track: T, layerwise: bool, handover: Handover<W> },
    /// Over.
    Done(Outcome),
    /// Between two states (never seen outside a transition).
    Moving,
}

/// One choice of one request, from its route to its end. See the module's documentation.
pub(crate) struct Life<H: Host> {
    host: H,
    settings: Settings,
    choice: Choice,
    start: Instant,
    state: State<H::Peer, H::Track>,
    /// Whether any text reached the client (after which a lost worker cannot be hidden).
    streamed: bool,
    /// Prompt tokens the prefill (or colocated) worker served from its prefix cache: the first
    /// worker to finish sets it, so a decode worker's received KV does not count.
    cached_tokens: Option<usize>,
    /// The fetch of a cached prefix the policy planned; the first attempt takes it (a request
    /// routed again computes its prompt where it lands).
    fetch: Option<PlannedFetch<H::Peer>>,
    /// Workers lost on the request, whole or on its prefill side.
    lost: Vec<String>,
    /// Tokens colocated workers streamed: a worker lost mid-stream hands them on.
    so_far: Vec<u32>,
}

impl<H: Host> Life<H> {
    /// A choice's life on `route` (with the fetch the policy planned, if any), begun at `now`.
    pub(crate) fn new(
        host: H,
        settings: Settings,
        choice: Choice,
        route: Route<H::Peer>,
        fetch: Option<PlannedFetch<H::Peer>>,
        now: Instant,
    ) -> Self {
        let mut life = Life {
            host,
            settings,
            choice,
            start: now,
            state: State::Moving,
            streamed: false,
            cached_tokens: None,
            fetch,
            lost: Vec::new(),
            so_far: Vec::new(),
        };
        life.attempt(route, now);
        life
    }

    /// What the driver waits for next.
    pub(crate) fn waiting(&mut self) -> Waiting<'_, H::Peer> {
        let prompt = &self.choice.valid.prompt_ids;
        match &mut self.state {
            State::Offering { lease, tokens, .. } => {
                Waiting::Offer { from: &lease.from, lease: lease.lease, tokens: &prompt[..*tokens] }
            }
            State::Whole(relay) | State::Decode { relay, .. } => {
                Waiting::Worker { worker: &relay.worker, events: &mut relay.events }
            }
            State::Prefill { prefill, events, .. } => Waiting::Worker { worker: prefill, events },
            State::Done(_) | State::Moving => Waiting::Done,
        }
    }

    /// How the life ended; `None` while it goes on.
    pub(crate) fn outcome(&self) -> Option<Outcome> {
        match self.state {
            State::Done(o) => Some(o),
            _ => None,
        }
    }

    /// The holder's answer to the planned fetch: the prefix it offers, or `None` (it offered
    /// nothing in time), and the prompt is computed whole.
    pub(crate) fn offered(&mut self, source: Option<KvSource>) {
        let State::Offering { lease, then, .. } = std::mem::replace(&mut self.state, State::Moving) else {
            unreachable!("an offer answers only a life waiting for one");
        };
        let fetching = match source {
            Some(source) => {
                tracing::info!(from = lease.from.name(), tokens = source.tokens, "fetching a cached prefix");
                Some(Fetching { source, _lease: lease })
            }
            None => {
                tracing::info!(
                    from = lease.from.name(),
                    "the planned prefix is not offered; computing the prompt whole"
                );
                self.host.metrics().fetch(FetchOutcome::Unavailable, None);
                None
            }
        };
        match then {
            Route::Colocated(worker) => self.start_whole(worker, fetching),
            Route::Disaggregated { prefill, decode } => self.start_prefill(prefill, decode, fetching),
        }
    }

    /// The next event of the request on the worker it waits on ([`Waiting::Worker`]). The
    /// driver reports a worker that is silent past its deadline and does not answer a probe,
    /// or whose stream ended early, as [`RequestEvent::Lost`].
    pub(crate) fn event(&mut self, event: RequestEvent, now: Instant) {
        match std::mem::replace(&mut self.state, State::Moving) {
            State::Whole(mut relay) => match self.relay(&mut relay, event, now) {
                None => self.state = State::Whole(relay),
                Some(result) => self.whole_ended(relay, result, now),
            },
            State::Prefill { prefill, decode, events, early, _track, fetching, mut first } => {
                let ended = self.prefill_event(&prefill, &mut first, fetching.as_ref(), event, now);
                match ended {
                    None => {
                        self.state = State::Prefill { prefill, decode, events, early, _track, fetching, first };
                    }
                    Some(result) => {
                        drop((events, _track, fetching));
                        self.prefill_ended(prefill, decode, early, first, result, now);
                    }
                }
            }
            State::Decode { mut relay, _track, layerwise, handover } => match self.relay(&mut relay, event, now) {
                None => self.state = State::Decode { relay, _track, layerwise, handover },
                Some(result) => self.decode_ended(relay, _track, layerwise, handover, result, now),
            },
            state @ (State::Offering { .. } | State::Done(_) | State::Moving) => {
                debug_assert!(false, "an event for a life not waiting on a worker");
                self.state = state;
            }
        }
    }

    /// The client went away: the request ends wherever it is (dropping its worker's stream
    /// aborts it there).
    pub(crate) fn client_gone(&mut self, now: Instant) {
        match std::mem::replace(&mut self.state, State::Moving) {
            State::Offering { .. } => self.end(Err(RunError::Cancelled), now),
            State::Whole(relay) => self.whole_ended(relay, Err(RunError::Cancelled), now),
            State::Prefill { prefill, decode, events, early, _track, fetching, first } => {
                drop((events, _track, fetching));
                self.prefill_ended(prefill, decode, early, first, Err(RunError::Cancelled), now);
            }
            State::Decode { relay, _track, layerwise, handover } => {
                self.decode_ended(relay, _track, layerwise, handover, Err(RunError::Cancelled), now);
            }
            state @ (State::Done(_) | State::Moving) => self.state = state,
        }
    }

    /// One attempt at the request on `route`: the first, or one after a lost worker.
    fn attempt(&mut self, route: Route<H::Peer>, now: Instant) {
        let metrics = self.host.metrics();
        match route {
            Route::Colocated(_) if self.so_far.len() >= self.choice.valid.stop.max_tokens => {
                // Lost after its last token, before saying so: nothing is left to generate.
                let result = self.finish(Finish::Length, self.choice.valid.prompt_ids.len(), self.so_far.len());
                self.attempt_ended(result, now);
            }
            Route::Colocated(worker) => {
                metrics.routed_colocated.inc();
                match self.plan_fetch(&worker) {
                    Some((lease, tokens)) => {
                        self.state = State::Offering { lease, tokens, then: Route::Colocated(worker) };
                    }
                    None => self.start_whole(worker, None),
                }
            }
            Route::Disaggregated { prefill, decode } => {
                metrics.routed_disaggregated.inc();
                match self.plan_fetch(&prefill) {
                    Some((lease, tokens)) => {
                        self.state = State::Offering { lease, tokens, then: Route::Disaggregated { prefill, decode } };
                    }
                    None => self.start_prefill(prefill, decode, None),
                }
            }
        }
    }

    /// The planned fetch for the worker about to compute the prompt, `to`, as a lease to ask
    /// its holder for: `None` when none was planned or `to` holds it itself (the prompt is
    /// then computed whole, as without a fetch). Only the first attempt fetches.
    fn plan_fetch(&mut self, to: &H::Peer) -> Option<(FetchLease<H::Peer>, usize)> {
        let planned = self.fetch.take()?;
        if planned.from.name() == to.name() || planned.tokens == 0 {
            return None;
        }
        Some((FetchLease { from: planned.from, lease: fetch_lease(self.choice.id.0) }, planned.tokens))
    }

    fn start_whole(&mut self, worker: H::Peer, fetching: Option<Fetching<H::Peer>>) {
        let fetch = fetching.as_ref().map(|f| f.source.clone());
        let fetched = fetch.as_ref().map_or(0, |f| f.tokens);
        let work = Work::Whole { fetch };
        let events = worker.submit(WorkRequest { generated: self.so_far.clone(), work, ..self.request() });
        let track = self.host.track_prefill(&worker, self.choice.id, &self.choice.valid.prompt_ids, fetched);
        self.state = State::Whole(Relay {
            worker,
            events,
            handoff: None,
            prefill: Some((track, fetching)),
            colocated: true,
            fetching: None,
            _decode: None,
            last: None,
            relayed: Vec::new(),
        });
    }

    /// Prefill: the prompt and the first token; the KV stays on `prefill` under a lease (in
    /// push mode, `prefill` also waits to write it into `decode`'s blocks). With max_tokens 1
    /// the request ends there: nothing to hand over.
    fn start_prefill(&mut self, prefill: H::Peer, decode: H::Peer, fetching: Option<Fetching<H::Peer>>) {
        let retain_kv = self.choice.valid.stop.max_tokens > 1;
        let base = self.request();
        let stop = StopParams { max_tokens: 1, ..base.stop.clone() };
        let fetch = fetching.as_ref().map(|f| f.source.clone());
        let fetched = fetch.as_ref().map_or(0, |f| f.tokens);
        // Layer-wise: the decode worker has the request now, reserves blocks for the prompt's
        // KV and registers them with the prefill worker's KV server, which writes each layer
        // into them as the prefill computes it; the last write brings the first token. Only
        // when the prefill worker prefills nothing else for this conductor: behind a queue, the
        // reservation would hold decode memory idle for the queue's time, so the KV is pulled
        // once the prefill is done (as it is without a KV server address).
        let early = match (self.settings.kv_transfer, prefill.kv_addr()) {
            (KvTransfer::Layerwise, Some(addr)) if retain_kv && !self.host.prefill_busy(&prefill) => {
                let tokens = self.choice.valid.prompt_ids.len();
                let source = KvSource { addr, blocks: Vec::new(), tokens, lease: None };
                let work = Work::Decode { source, mode: KvTransfer::Layerwise };
                let prefix_cache = self.settings.pd_caching >= PdCaching::Decode;
                Some(decode.submit(WorkRequest { work, prefix_cache, ..self.request() }))
            }
            _ => None,
        };
        let work = match retain_kv {
            true if early.is_some() => Work::Prefill { fetch, handoff: KvTransfer::Layerwise },
            true => Work::Prefill { fetch, handoff: self.settings.kv_transfer.after_prefill() },
            false => Work::Whole { fetch },
        };
        let events = prefill.submit(WorkRequest { stop, work, ..base });
        let _track = self.host.track_prefill(&prefill, self.choice.id, &self.choice.valid.prompt_ids, fetched);
        self.state = State::Prefill { prefill, decode, events, early, _track, fetching, first: Vec::new() };
    }

    /// A prefill worker's event: `Some` once its part ended, with the prompt's tokens and the
    /// leased KV.
    fn prefill_event(
        &mut self,
        prefill: &H::Peer,
        first: &mut Vec<u32>,
        fetching: Option<&Fetching<H::Peer>>,
        event: RequestEvent,
        now: Instant,
    ) -> Option<Result<Prefilled, RunError>> {
        match event {
            RequestEvent::Token { token, text, logprobs } => {
                self.host.metrics().ttft.observe((now - self.start).as_secs_f64());
                first.push(token);
                let sent = self.send_logprobs(token, logprobs).and_then(|()| self.send(Piece::Text(text)));
                sent.err().map(Err)
            }
            RequestEvent::Finished { reason, prompt_tokens, kv, cached_tokens, received, .. } => {
                self.cached_tokens.get_or_insert(cached_tokens);
                self.fetch_ended(fetching, received);
                self.prefill_done(prefill.name(), prompt_tokens, cached_tokens);
                Some(Ok((reason, prompt_tokens, kv)))
            }
            RequestEvent::Failed(e) => Some(Err(RunError::Api(e.into()))),
            RequestEvent::Lost { reason } => Some(Err(RunError::Lost { worker: prefill.name().to_owned(), reason })),
        }
    }

    /// The prefill's part ended (the prompt's ledger entry and fetch are dropped already).
    fn prefill_ended(
        &mut self,
        prefill: H::Peer,
        decode: H::Peer,
        early: Option<<H::Peer as Peer>::Events>,
        first: Vec<u32>,
        result: Result<Prefilled, RunError>,
        now: Instant,
    ) {
        let (reason, prompt_tokens, kv) = match result {
            Ok(done) => done,
            // Lost after its first token (the client has it) but before it said it finished:
            // the decode side goes on from the prompt and that token, recomputing their KV as a
            // migrated request does.
            Err(RunError::Lost { worker, reason }) if !first.is_empty() => {
                self.handed_on(&worker, &reason, first.len());
                (Finish::Length, self.choice.valid.prompt_ids.len(), None)
            }
            Err(e) => {
                // The client may have gone just as the prefill finished, or the worker's stream
                // was lost (a half-open connection, a partition) after it offered the KV: the
                // conductor never heard of the hand-off, but releases it by the request's id, so
                // a worker still alive does not hold it until its lease ends. (Dropping `early`
                // aborts the decode worker's half, and frees the blocks it reserved.)
                drop(early);
                prefill.release(self.choice.id.0);
                return self.attempt_ended(Err(e), now);
            }
        };
        let max_tokens = self.choice.valid.stop.max_tokens;
        let done_at_prefill = reason != Finish::Length || max_tokens == 1;
        let prefill_lost = kv.is_none() && !done_at_prefill;
        let kv = kv.filter(|_| !done_at_prefill);
        if kv.is_none() && !prefill_lost {
            drop(early);
            prefill.release(self.choice.id.0);
            let result = self.finish(reason, prompt_tokens, first.len());
            return self.attempt_ended(result, now);
        }
        // Decode: reserve blocks and pull the KV into them, or have the prefill worker push it
        // (COMPLETE releases it on the prefill side), then stream the rest.
        let handover = Handover {
            prefill,
            decode,
            handoff: kv.is_some().then_some(now),
            kv,
            early,
            first: first.len(),
            generated: first,
            prompt_tokens,
            tried: Vec::new(),
        };
        self.start_decode(handover, now);
    }

    /// Hands the decode half to `handover.decode`.
    fn start_decode(&mut self, mut h: Handover<H::Peer>, now: Instant) {
        let valid = &self.choice.valid;
        if h.generated.len() >= valid.stop.max_tokens {
            // Lost after its last token, before saying so.
            let result = self.finish(Finish::Length, h.prompt_tokens, h.generated.len());
            return self.handover_ended(h, result, now);
        }
        let context = valid.prompt_ids.len() + h.generated.len();
        let _track = self.host.track_decode(&h.decode, self.choice.id, context);
        // The prefill worker's lease holds the prompt's KV until a decode worker completes its
        // transfer; a migrated request recomputes its KV instead.
        let kv = h.kv.clone().filter(|_| h.generated.len() == h.first);
        // Decode workers keep (and reuse) requests' KV only in PD-Caching-2.
        let prefix_cache = self.settings.pd_caching >= PdCaching::Decode;
        // The prefill is over: a hand-off from here on pulls what the prefill worker leases (a
        // layer-wise one already is on its way, in `early`).
        let kv_transfer = self.settings.kv_transfer.after_prefill();
        let layerwise = h.early.is_some();
        // With no decode worker left, the prefill worker itself runs the rest whole
        // (`lone_role_fallback`): it gives up what it held for the lost hand-off, and the rest
        // runs under a fresh id, since the old one may still be settling there.
        let on_prefill_worker = h.decode.name() == h.prefill.name();
        let id = if on_prefill_worker {
            h.prefill.release(self.choice.id.0);
            self.host.fresh_id()
        } else {
            self.choice.id.0
        };
        let events = match h.early.take() {
            Some(events) => events,
            None => h.decode.submit(WorkRequest {
                id,
                generated: h.generated.clone(),
                work: match kv.filter(|_| !on_prefill_worker) {
                    Some(source) => Work::Decode { source, mode: kv_transfer },
                    None => Work::default(),
                },
                prefix_cache,
                ..self.request()
            }),
        };
        let relay = Relay {
            worker: h.decode.clone(),
            events,
            handoff: h.handoff.take(),
            prefill: None,
            colocated: false,
            fetching: None,
            _decode: None,
            last: None,
            relayed: Vec::new(),
        };
        self.state = State::Decode { relay, _track, layerwise, handover: h };
    }

    /// A decode worker's part ended.
    fn decode_ended(
        &mut self,
        relay: Relay<H::Peer, H::Track>,
        track: H::Track,
        layerwise: bool,
        mut h: Handover<H::Peer>,
        result: Result<(), RunError>,
        now: Instant,
    ) {
        let streamed_here = relay.relayed.len();
        drop(relay.events);
        if layerwise && streamed_here > 0 {
            self.host.metrics().layerwise_handoffs.inc();
        }
        h.generated.extend(relay.relayed);
        // A decode worker lost: hand the decode to another, before its first token (it pulls
        // the KV if the lease still holds it, else recomputes) or mid-stream (migration: it
        // recomputes the KV of the prompt and the tokens so far, and continues).
        let next = match result {
            // The layer-wise hand-off failed (the prefill worker died mid-stream, or the decode
            // worker had no room in time): the decode worker gave the request back before
            // streaming anything; it gets it again with the first token, and pulls the KV if
            // the prefill worker still leases it, else recomputes it.
            Err(RunError::Handoff(reason)) => {
                tracing::warn!(request = self.choice.id.0, reason, "layer-wise hand-off failed; handing over again");
                self.host.metrics().retries.inc();
                h.handoff = Some(now);
                Ok(())
            }
            Err(RunError::Lost { worker, reason }) if h.tried.len() < MAX_RETRIES => {
                self.handed_on(&worker, &reason, streamed_here);
                h.tried.push(worker.clone());
                match self.reroute_decode(&h.tried) {
                    Some(next) => {
                        h.decode = next;
                        Ok(())
                    }
                    None => Err(Err(RunError::Lost { worker, reason })),
                }
            }
            other => Err(other),
        };
        drop(track);
        match next {
            Ok(()) => self.start_decode(h, now),
            Err(result) => self.handover_ended(h, result, now),
        }
    }

    /// The decode half is over: whatever happened on the decode side, the prefill side's blocks
    /// are not needed any more (a no-op when the pull completed).
    fn handover_ended(&mut self, h: Handover<H::Peer>, result: Result<(), RunError>, now: Instant) {
        h.prefill.release(self.choice.id.0);
        if result.is_ok() && self.settings.pd_caching == PdCaching::Return {
            let tokens: Vec<u32> = self.choice.valid.prompt_ids.iter().chain(&h.generated).copied().collect();
            self.host.return_kv(h.decode, h.prefill, self.choice.id, tokens);
        }
        self.attempt_ended(result, now);
    }

    /// A colocated worker's part ended.
    fn whole_ended(&mut self, relay: Relay<H::Peer, H::Track>, result: Result<(), RunError>, now: Instant) {
        let Relay { events, prefill, fetching, _decode, relayed, .. } = relay;
        drop((events, prefill, fetching, _decode));
        self.so_far.extend(relayed);
        self.attempt_ended(result, now);
    }

    /// An attempt ended: the request ends, or goes on elsewhere.
    fn attempt_ended(&mut self, result: Result<(), RunError>, now: Instant) {
        match result {
            // Lost before anything was streamed: route the request again. Lost after a colocated
            // worker streamed tokens: migrate — another worker continues from the prompt and
            // those tokens (it recomputes their KV), so the client's stream goes on with no
            // duplicate and, for greedy requests, the same tokens.
            Err(RunError::Lost { worker, reason })
                if (!self.so_far.is_empty() || !self.streamed) && self.lost.len() < MAX_RETRIES =>
            {
                self.handed_on(&worker, &reason, self.so_far.len());
                self.lost.push(worker);
                // (A request that streamed nothing is refused again if it must be.)
                match self.host.route(&self.choice.valid, &self.lost, self.so_far.is_empty()) {
                    // A migrated request has its first tokens: it continues on one worker.
                    Ok(Route::Disaggregated { decode, .. }) if !self.so_far.is_empty() => {
                        self.attempt(Route::Colocated(decode), now);
                    }
                    Ok(route) => self.attempt(route, now),
                    Err(e) => self.end(Err(RunError::Api(e)), now),
                }
            }
            other => self.end(other, now),
        }
    }

    /// The request ended: the client hears of a failure, and the metrics count it.
    fn end(&mut self, result: Result<(), RunError>, now: Instant) {
        let id = self.choice.id.0;
        let outcome = match result {
            Ok(()) => Outcome::Ok,
            Err(RunError::Cancelled) => Outcome::Cancelled,
            Err(RunError::Lost { worker, reason }) => {
                self.host.trip(&worker, &reason);
                tracing::warn!(request = id, worker, reason, "worker lost mid-request");
                let e = ApiError::Internal("a worker was lost while running the request; retry it".into());
                self.host.send(Piece::Failed(e));
                Outcome::Failed
            }
            Err(RunError::Api(ApiError::Internal(detail)) | RunError::Handoff(detail)) => {
                // The detail names workers' addresses and internals: the log's, not the client's.
                tracing::error!(request = id, error = detail, "request failed");
                let message = format!(
                    "the request failed inside the cluster; the conductor's log has the details under x-request-id `{}`",
                    self.choice.request_id
                );
                self.host.send(Piece::Failed(ApiError::Internal(message)));
                Outcome::Failed
            }
            Err(RunError::Api(e)) => {
                let o = Outcome::of_error(&e);
                self.host.send(Piece::Failed(e));
                o
            }
        };
        tracing::info!(outcome = ?outcome, choice = self.choice.index, "request finished");
        let metrics = self.host.metrics();
        metrics.outcome(outcome);
        metrics.e2e.observe((now - self.start).as_secs_f64());
        self.state = State::Done(outcome);
    }

    /// Relays a worker's event to the client: `Some` when the worker's part ended. With a
    /// hand-off under way, the first event means the KV arrived: it records the hand-off (and,
    /// when the request ends, the KV the worker says it received: tokens it cached already did
    /// not travel).
    fn relay(
        &mut self,
        r: &mut Relay<H::Peer, H::Track>,
        event: RequestEvent,
        now: Instant,
    ) -> Option<Result<(), RunError>> {
        let metrics = self.host.metrics();
        if let Some(t) = r.handoff.take()
            && !matches!(event, RequestEvent::Failed(_) | RequestEvent::Lost { .. })
        {
            metrics.transfer.observe((now - t).as_secs_f64());
            r.last = Some(now);
        }
        match event {
            RequestEvent::Token { token, text, logprobs } => {
                // A colocated worker's first token ends its prefill.
                if let Some((track, fetching)) = r.prefill.take() {
                    r.fetching = fetching;
                    let context = self.choice.valid.prompt_ids.len() + 1;
                    r._decode = Some(self.host.track_decode(&r.worker, self.choice.id, context));
                    drop(track);
                }
                let metrics = self.host.metrics();
                match r.last {
                    // (A migrated request's first token here is not its first.)
                    None if r.relayed.is_empty() && !self.streamed => {
                        metrics.ttft.observe((now - self.start).as_secs_f64());
                    }
                    None => {}
                    Some(t) => metrics.tbt.observe((now - t).as_secs_f64()),
                }
                r.last = Some(now);
                r.relayed.push(token);
                let sent = self.send_logprobs(token, logprobs).and_then(|()| self.send(Piece::Text(text)));
                sent.err().map(Err)
            }
            RequestEvent::Finished { reason, prompt_tokens, completion_tokens, cached_tokens, received, .. } => {
                self.cached_tokens.get_or_insert(cached_tokens);
                if let Some(rx) = received.filter(|_| !r.colocated) {
                    metrics.transfer_tokens.inc_by(rx.tokens as u64);
                    let bytes = self.settings.kv_bytes_per_token.map_or(rx.bytes, |b| (rx.tokens * b) as u64);
                    metrics.transfer_bytes.inc_by(bytes);
                    metrics.transferred(&rx);
                }
                if r.colocated {
                    let fetching = r.fetching.take().or_else(|| r.prefill.take().and_then(|(_, f)| f));
                    self.fetch_ended(fetching.as_ref(), received);
                    self.prefill_done(r.worker.name(), prompt_tokens, cached_tokens);
                }
                Some(self.finish(reason, prompt_tokens, completion_tokens))
            }
            RequestEvent::Failed(WorkerError::Handoff(reason)) => Some(Err(RunError::Handoff(reason))),
            RequestEvent::Failed(e) => Some(Err(RunError::Api(e.into()))),
            RequestEvent::Lost { reason } => Some(Err(RunError::Lost { worker: r.worker.name().to_owned(), reason })),
        }
    }

    /// Counts how a fetch sent with the prompt's work ended: `received` is what the worker
    /// says it received before computing.
    fn fetch_ended(&self, fetching: Option<&Fetching<H::Peer>>, received: Option<Received>) {
        if fetching.is_some() {
            let outcome = if received.is_some() { FetchOutcome::Fetched } else { FetchOutcome::Recomputed };
            self.host.metrics().fetch(outcome, received);
        }
    }

    /// The prompt's KV is cached now: the other choices may start. Also counts the prompt
    /// tokens the prefill computed.
    fn prefill_done(&mut self, worker: &str, prompt_tokens: usize, cached_tokens: usize) {
        let m = self.host.metrics();
        m.prefill_tokens.inc_by(prompt_tokens.saturating_sub(cached_tokens) as u64);
        m.prefix_cache(worker, prompt_tokens, cached_tokens);
        self.host.prefilled();
    }

    /// Books a worker lost while running this request, which goes on elsewhere: trips its
    /// breaker and counts a retry, or a migration when the lost worker had streamed `tokens`.
    fn handed_on(&self, worker: &str, reason: &str, tokens: usize) {
        let m = self.host.metrics();
        self.host.trip(worker, reason);
        m.retries.inc();
        if tokens > 0 {
            m.migrations.inc();
        }
        tracing::warn!(
            request = self.choice.id.0,
            worker,
            reason,
            tokens,
            "worker lost; the request goes on on another"
        );
    }

    /// Another worker to decode on, after `tried` failed: the decode worker (or else the
    /// colocated worker) the policy picks among the rest.
    fn reroute_decode(&self, tried: &[String]) -> Option<H::Peer> {
        match self.host.route(&self.choice.valid, tried, false).ok()? {
            Route::Disaggregated { decode, .. } => Some(decode),
            Route::Colocated(w) => Some(w),
        }
    }

    /// The request as a worker is asked to run it from the start.
    fn request(&self) -> WorkRequest {
        let v = &self.choice.valid;
        WorkRequest {
            id: self.choice.id.0,
            request_id: Some(self.choice.request_id.clone()),
            prompt: v.prompt_ids.clone(),
            generated: Vec::new(),
            sampling: SamplingParams {
                seed: v.sampling.seed.map(|s| s.wrapping_add(self.choice.index as u64)),
                ..v.sampling.clone()
            },
            stop: v.stop.clone(),
            logprobs: v.logprobs,
            stop_token_ids: v.stop_token_ids.clone(),
            work: Work::default(),
            prefix_cache: self.settings.pd_caching != PdCaching::Basic,
        }
    }

    fn finish(&mut self, reason: Finish, prompt_tokens: usize, completion_tokens: usize) -> Result<(), RunError> {
        if reason == Finish::GrammarFailed {
            // The text so far is not a sentence of the grammar: the client must not take it
            // for a complete output (a 400 before the body, or an error event in a stream).
            return Err(RunError::Api(ApiError::param(
                "response_format",
                format!(
                    "the output's grammar (`response_format` or a forced tool call) failed after {completion_tokens} \
                     tokens: the grammar engine cannot serve this schema (too deep a recursion, or a pattern past its \
                     limits); simplify it"
                ),
            )));
        }
        let m = self.host.metrics();
        if self.choice.index == 0 {
            m.prompt_tokens.inc_by(prompt_tokens as u64);
        }
        m.generation_tokens.inc_by(completion_tokens as u64);
        let cached_tokens = self.cached_tokens.unwrap_or(0);
        self.send(Piece::Done { reason, prompt_tokens, completion_tokens, cached_tokens })
    }

    fn send_logprobs(&mut self, token: u32, logprobs: Option<TokenLogprobs>) -> Result<(), RunError> {
        match logprobs {
            Some(lp) => {
                let entry = self.host.logprob_entry(token, &lp);
                self.send(Piece::Logprobs(entry))
            }
            None => Ok(()),
        }
    }

    fn send(&mut self, piece: Piece) -> Result<(), RunError> {
        if matches!(&piece, Piece::Text(t) if !t.is_empty()) {
            self.streamed = true;
        }
        if self.host.send(piece) { Ok(()) } else { Err(RunError::Cancelled) }
    }
}

#[cfg(test)]
mod tests {
    //! Every path of a request's life on the conductor, with a fake host and fake workers: what
    //! each worker is asked, what it is told to release, which streams are dropped (aborting
    //! the request there), what the client receives, and how the request ends.

    use std::cell::{Cell, RefCell};
    use std::collections::VecDeque;
    use std::rc::Rc;

    use super::*;
    use crate::openai::Endpoint;

    type Log = Rc<RefCell<Vec<String>>>;

    #[derive(Debug, Clone)]
    struct FakeWorker {
        name: &'static str,
        kv_addr: Option<SocketAddr>,
        log: Log,
        submitted: Rc<RefCell<Vec<(&'static str, WorkRequest)>>>,
    }

    /// A submitted request's stream; dropping it is the abort the worker sees.
    #[derive(Debug)]
    struct FakeEvents {
        worker: &'static str,
        id: u64,
        log: Log,
    }

    impl Drop for FakeEvents {
        fn drop(&mut self) {
            self.log.borrow_mut().push(format!("drop {} {}", self.worker, self.id));
        }
    }

    impl Peer for FakeWorker {
        type Events = FakeEvents;

        fn name(&self) -> &str {
            self.name
        }

        fn kv_addr(&self) -> Option<SocketAddr> {
            self.kv_addr
        }

        fn submit(&self, req: WorkRequest) -> FakeEvents {
            self.log.borrow_mut().push(format!("submit {} {}", self.name, req.id));
            let id = req.id;
            self.submitted.borrow_mut().push((self.name, req));
            FakeEvents { worker: self.name, id, log: self.log.clone() }
        }

        fn release(&self, id: u64) {
            self.log.borrow_mut().push(format!("release {} {id}", self.name));
        }
    }

    /// A ledger entry; dropping it is its removal.
    struct FakeTrack {
        what: String,
        log: Log,
    }

    impl Drop for FakeTrack {
        fn drop(&mut self) {
            self.log.borrow_mut().push(format!("untrack {}", self.what));
        }
    }

    struct FakeHost {
        log: Log,
        /// What each `route` call answers, in turn.
        routes: RefCell<VecDeque<Result<Route<FakeWorker>, ApiError>>>,
        /// Every `route` call: the excluded workers and `admit`.
        asked: RefCell<Vec<(Vec<String>, bool)>>,
        client: Vec<String>,
        client_gone: bool,
        prefill_busy: bool,
        fresh: Cell<u64>,
        metrics: Metrics,
    }

    impl Host for FakeHost {
        type Peer = FakeWorker;
        type Track = FakeTrack;

        fn route(&self, _: &ValidRequest, excluded: &[String], admit: bool) -> Result<Route<FakeWorker>, ApiError> {
            self.asked.borrow_mut().push((excluded.to_vec(), admit));
            self.routes.borrow_mut().pop_front().unwrap_or_else(|| Err(ApiError::Unavailable("no worker".into())))
        }

        fn track_prefill(&self, worker: &FakeWorker, id: RequestId, _: &[u32], fetched: usize) -> FakeTrack {
            let what = format!("prefill {} {} fetched {fetched}", worker.name, id.0);
            self.log.borrow_mut().push(format!("track {what}"));
            FakeTrack { what, log: self.log.clone() }
        }

        fn track_decode(&self, worker: &FakeWorker, id: RequestId, context: usize) -> FakeTrack {
            let what = format!("decode {} {} context {context}", worker.name, id.0);
            self.log.borrow_mut().push(format!("track {what}"));
            FakeTrack { what, log: self.log.clone() }
        }

        fn prefill_busy(&self, _: &FakeWorker) -> bool {
            self.prefill_busy
        }

        fn fresh_id(&self) -> u64 {
            self.fresh.set(self.fresh.get() + 1);
            1000 + self.fresh.get()
        }

        fn trip(&self, worker: &str, _: &str) {
            self.log.borrow_mut().push(format!("trip {worker}"));
        }

        fn send(&mut self, piece: Piece) -> bool {
            if self.client_gone {
                return false;
            }
            self.client.push(match piece {
                Piece::Text(t) => t,
                Piece::Logprobs(e) => format!("logprobs {}", e.token),
                Piece::Done { reason, completion_tokens, .. } => format!("done {reason:?} {completion_tokens}"),
                Piece::Failed(e) => format!("failed {}", e.status().as_u16()),
            });
            true
        }

        fn logprob_entry(&self, token: u32, lp: &TokenLogprobs) -> LogprobEntry {
            LogprobEntry { token: format!("t{token}"), logprob: lp.logprob, top: Vec::new() }
        }

        fn prefilled(&mut self) {
            self.log.borrow_mut().push("prefilled".into());
        }

        fn return_kv(&self, from: FakeWorker, to: FakeWorker, _: RequestId, tokens: Vec<u32>) {
            self.log.borrow_mut().push(format!("return {} -> {} {} tokens", from.name, to.name, tokens.len()));
        }

        fn metrics(&self) -> &Metrics {
            &self.metrics
        }
    }

    const ID: u64 = 7;
    const PROMPT: usize = 40;

    struct Cluster {
        log: Log,
        submitted: Rc<RefCell<Vec<(&'static str, WorkRequest)>>>,
    }

    impl Cluster {
        fn new() -> Self {
            Cluster { log: Log::default(), submitted: Rc::default() }
        }

        fn worker(&self, name: &'static str) -> FakeWorker {
            FakeWorker { name, kv_addr: None, log: self.log.clone(), submitted: self.submitted.clone() }
        }

        /// A worker with a KV server (a layer-wise hand-off's prefill side).
        fn kv_worker(&self, name: &'static str) -> FakeWorker {
            FakeWorker { kv_addr: Some(addr(9)), ..self.worker(name) }
        }

        fn host(&self, routes: Vec<Result<Route<FakeWorker>, ApiError>>) -> FakeHost {
            FakeHost {
                log: self.log.clone(),
                routes: RefCell::new(routes.into()),
                asked: RefCell::default(),
                client: Vec::new(),
                client_gone: false,
                prefill_busy: false,
                fresh: Cell::new(0),
                metrics: Metrics::default(),
            }
        }

        /// Lines of the log that start with `prefix`.
        fn logged(&self, prefix: &str) -> Vec<String> {
            self.log.borrow().iter().filter(|l| l.starts_with(prefix)).cloned().collect()
        }

        /// Where `line` is in the log (panics if absent).
        fn at(&self, line: &str) -> usize {
            let log = self.log.borrow();
            log.iter().position(|l| l == line).unwrap_or_else(|| panic!("`{line}` not in the log: {log:#?}"))
        }

        /// The `i`th request a worker was asked to run, and which worker.
        fn submitted(&self, i: usize) -> (&'static str, WorkRequest) {
            self.submitted.borrow()[i].clone()
        }

        fn submissions(&self) -> usize {
            self.submitted.borrow().len()
        }
    }

    /// The KV a decode part receives.
    fn received(req: &WorkRequest) -> Option<&KvSource> {
        match &req.work {
            Work::Decode { source, .. } => Some(source),
            _ => None,
        }
    }

    /// How a decode part receives its KV.
    fn mode(req: &WorkRequest) -> Option<KvTransfer> {
        match req.work {
            Work::Decode { mode, .. } => Some(mode),
            _ => None,
        }
    }

    /// How a prefill part hands its KV over.
    fn handoff(req: &WorkRequest) -> Option<KvTransfer> {
        match req.work {
            Work::Prefill { handoff, .. } => Some(handoff),
            _ => None,
        }
    }

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn settings(kv_transfer: KvTransfer, pd_caching: PdCaching) -> Settings {
        Settings { kv_transfer, pd_caching, kv_bytes_per_token: None }
    }

    fn choice(max_tokens: usize) -> Choice {
        let valid = ValidRequest {
            endpoint: Endpoint::Completions,
            model: "m".into(),
            prompt_ids: (0..PROMPT as u32).collect(),
            sampling: SamplingParams::default(),
            stop: StopParams { max_tokens, ..StopParams::default() },
            stream: true,
            include_usage: false,
            logprobs: None,
            stop_token_ids: Vec::new(),
            echo: None,
            n: 1,
            session: None,
            tools: None,
        };
        Choice { valid, id: RequestId(ID), index: 0, request_id: "req-1".into() }
    }

    fn token(t: u32) -> RequestEvent {
        RequestEvent::Token { token: t, text: format!("t{t}"), logprobs: None }
    }

    fn finished(reason: Finish, completion_tokens: usize) -> RequestEvent {
        RequestEvent::Finished {
            reason,
            prompt_tokens: PROMPT,
            cached_tokens: 0,
            completion_tokens,
            kv: None,
            received: None,
        }
    }

    /// A prefill worker's end: the first token's KV leased for the hand-off.
    fn leased() -> RequestEvent {
        let kv = KvSource { addr: addr(1), blocks: vec![1, 2, 3], tokens: PROMPT, lease: None };
        RequestEvent::Finished {
            reason: Finish::Length,
            prompt_tokens: PROMPT,
            cached_tokens: 0,
            completion_tokens: 1,
            kv: Some(kv),
            received: None,
        }
    }

    fn lost() -> RequestEvent {
        RequestEvent::Lost { reason: "connection reset".into() }
    }

    /// The worker the life waits on, `offer <holder>`, or `None` once it is over.
    fn waiting(life: &mut Life<FakeHost>) -> Option<String> {
        match life.waiting() {
            Waiting::Worker { worker, .. } => Some(worker.name.to_owned()),
            Waiting::Offer { from, .. } => Some(format!("offer {}", from.name)),
            Waiting::Done => None,
        }
    }

    /// Feeds `events` to the worker the life waits on, checking it is `worker`.
    fn feed(life: &mut Life<FakeHost>, worker: &str, events: Vec<RequestEvent>) {
        for e in events {
            assert_eq!(waiting(life).as_deref(), Some(worker), "waiting on the wrong worker");
            life.event(e, Instant::now());
        }
    }

    fn metric(m: &prometheus::IntCounter) -> u64 {
        m.get()
    }

    fn colocated(w: &FakeWorker) -> Route<FakeWorker> {
        Route::Colocated(w.clone())
    }

    fn disaggregated(p: &FakeWorker, d: &FakeWorker) -> Route<FakeWorker> {
        Route::Disaggregated { prefill: p.clone(), decode: d.clone() }
    }

    fn start(host: FakeHost, settings: Settings, max_tokens: usize, route: Route<FakeWorker>) -> Life<FakeHost> {
        Life::new(host, settings, choice(max_tokens), route, None, Instant::now())
    }

    fn pull() -> Settings {
        settings(KvTransfer::Pull, PdCaching::Prefill)
    }

    #[test]
    fn a_colocated_request_streams_every_token_and_ends_ok() {
        let cluster = Cluster::new();
        let w = cluster.worker("w");
        let mut life = start(cluster.host(vec![]), pull(), 3, colocated(&w));
        feed(&mut life, "w", vec![token(1), token(2), token(3), finished(Finish::Length, 3)]);
        assert_eq!(life.outcome(), Some(Outcome::Ok));
        assert_eq!(life.host.client, ["t1", "t2", "t3", "done Length 3"]);
        assert_eq!(life.host.metrics.ttft.get_sample_count(), 1);
        assert_eq!(life.host.metrics.tbt.get_sample_count(), 2);
        // The prompt's ledger entry gives way to the decode's at the first token; both are gone.
        let untracked = cluster.logged("untrack");
        assert_eq!(untracked, ["untrack prefill w 7 fetched 0", "untrack decode w 7 context 41"]);
        assert!(cluster.at("track decode w 7 context 41") < cluster.at("untrack prefill w 7 fetched 0"));
        assert_eq!(cluster.logged("drop"), ["drop w 7"]);
        assert!(cluster.logged("release").is_empty(), "nothing was leased");
        assert_eq!(waiting(&mut life), None);
    }

    #[test]
    fn a_worker_lost_before_streaming_is_tripped_and_the_request_routed_again_without_it() {
        let cluster = Cluster::new();
        let (a, b) = (cluster.worker("a"), cluster.worker("b"));
        let mut life = start(cluster.host(vec![Ok(colocated(&b))]), pull(), 2, colocated(&a));
        feed(&mut life, "a", vec![lost()]);
        assert_eq!(*life.host.asked.borrow(), [(vec!["a".to_owned()], true)], "routed again, admitted again");
        feed(&mut life, "b", vec![token(1), token(2), finished(Finish::Length, 2)]);
        assert_eq!(life.outcome(), Some(Outcome::Ok));
        assert_eq!(life.host.client, ["t1", "t2", "done Length 2"]);
        assert_eq!(cluster.logged("trip"), ["trip a"]);
        assert_eq!(metric(&life.host.metrics.retries), 1);
        assert_eq!(metric(&life.host.metrics.migrations), 0);
        assert_eq!(life.host.metrics.ttft.get_sample_count(), 1);
    }

    #[test]
    fn a_colocated_worker_lost_mid_stream_migrates_with_the_tokens_so_far() {
        let cluster = Cluster::new();
        let (a, p, d) = (cluster.worker("a"), cluster.worker("p"), cluster.worker("d"));
        // The policy would disaggregate: a migrated request continues whole on the decode worker.
        let mut life = start(cluster.host(vec![Ok(disaggregated(&p, &d))]), pull(), 4, colocated(&a));
        feed(&mut life, "a", vec![token(1), token(2), lost()]);
        assert_eq!(*life.host.asked.borrow(), [(vec!["a".to_owned()], false)], "a started request is not refused");
        let (worker, req) = cluster.submitted(1);
        assert_eq!(worker, "d");
        assert_eq!(req.generated, [1, 2], "it continues from what the client has");
        feed(&mut life, "d", vec![token(3), token(4), finished(Finish::Length, 4)]);
        assert_eq!(life.host.client, ["t1", "t2", "t3", "t4", "done Length 4"], "no gap, no duplicate");
        assert_eq!(metric(&life.host.metrics.migrations), 1);
        assert_eq!(
            life.host.metrics.ttft.get_sample_count(),
            1,
            "the migrated worker's first token is not the request's"
        );
    }

    #[test]
    fn a_colocated_worker_lost_after_its_last_token_ends_the_request_without_another_worker() {
        let cluster = Cluster::new();
        let (a, b) = (cluster.worker("a"), cluster.worker("b"));
        let mut life = start(cluster.host(vec![Ok(colocated(&b))]), pull(), 2, colocated(&a));
        feed(&mut life, "a", vec![token(1), token(2), lost()]);
        assert_eq!(life.outcome(), Some(Outcome::Ok));
        assert_eq!(life.host.client, ["t1", "t2", "done Length 2"]);
        assert_eq!(cluster.submissions(), 1, "b is never asked");
    }

    #[test]
    fn a_request_whose_workers_keep_dying_fails_after_its_retries_and_trips_each() {
        let cluster = Cluster::new();
        let (a, b, c) = (cluster.worker("a"), cluster.worker("b"), cluster.worker("c"));
        let routes = vec![Ok(colocated(&b)), Ok(colocated(&c))];
        let mut life = start(cluster.host(routes), pull(), 2, colocated(&a));
        feed(&mut life, "a", vec![lost()]);
        feed(&mut life, "b", vec![lost()]);
        feed(&mut life, "c", vec![lost()]);
        assert_eq!(life.outcome(), Some(Outcome::Failed));
        assert_eq!(life.host.client, ["failed 500"]);
        assert_eq!(cluster.logged("trip"), ["trip a", "trip b", "trip c"]);
        assert_eq!(metric(&life.host.metrics.retries), MAX_RETRIES as u64);
    }

    #[test]
    fn a_worker_lost_after_the_client_saw_text_from_a_prefill_cannot_be_hidden() {
        // Disaggregated, the prefill worker streamed the first token and died with the KV: the
        // decode side recomputes from the prompt and that token (a migration), no re-route.
        let cluster = Cluster::new();
        let (p, d) = (cluster.worker("p"), cluster.worker("d"));
        let mut life = start(cluster.host(vec![]), pull(), 3, disaggregated(&p, &d));
        feed(&mut life, "p", vec![token(1), lost()]);
        let (worker, req) = cluster.submitted(1);
        assert_eq!((worker, req.generated.as_slice(), received(&req).is_none()), ("d", &[1][..], true));
        feed(&mut life, "d", vec![token(2), token(3), finished(Finish::Length, 3)]);
        assert_eq!(life.host.client, ["t1", "t2", "t3", "done Length 3"]);
        assert_eq!(metric(&life.host.metrics.migrations), 1);
        assert_eq!(cluster.logged("trip"), ["trip p"]);
        assert!(life.host.asked.borrow().is_empty(), "the decode worker was already chosen");
        assert_eq!(cluster.logged("release p"), ["release p 7"], "whatever p held is released at the end");
    }

    #[test]
    fn a_disaggregated_request_pulls_the_leased_kv_then_releases_the_prefill_side() {
        let cluster = Cluster::new();
        let (p, d) = (cluster.worker("p"), cluster.worker("d"));
        let mut life = start(cluster.host(vec![]), pull(), 3, disaggregated(&p, &d));
        let (_, prefill) = cluster.submitted(0);
        assert_eq!(
            (prefill.stop.max_tokens, handoff(&prefill)),
            (1, Some(KvTransfer::Pull)),
            "the prefill stops at the first token"
        );
        feed(&mut life, "p", vec![token(1), leased()]);
        assert_eq!(cluster.logged("prefilled"), ["prefilled"]);
        let (worker, decode) = cluster.submitted(1);
        assert_eq!(worker, "d");
        assert_eq!(decode.generated, [1]);
        assert_eq!(received(&decode).map(|kv| kv.blocks.clone()), Some(vec![1, 2, 3]), "it pulls the lease");
        assert_eq!(mode(&decode), Some(KvTransfer::Pull));
        let received = Some(Received { tokens: PROMPT, bytes: 4096, micros: 10, transport: None });
        let end = RequestEvent::Finished {
            reason: Finish::Length,
            prompt_tokens: PROMPT,
            cached_tokens: 0,
            completion_tokens: 3,
            kv: None,
            received,
        };
        feed(&mut life, "d", vec![token(2), token(3), end]);
        assert_eq!(life.outcome(), Some(Outcome::Ok));
        assert_eq!(life.host.client, ["t1", "t2", "t3", "done Length 3"]);
        assert_eq!(metric(&life.host.metrics.transfer_bytes), 4096);
        assert_eq!(life.host.metrics.transfer.get_sample_count(), 1);
        assert_eq!(life.host.metrics.ttft.get_sample_count(), 1);
        // The prefill side is released after the decode side is done with the lease.
        assert!(cluster.at("drop d 7") < cluster.at("release p 7"));
        assert_eq!(cluster.logged("release"), ["release p 7"]);
    }

    #[test]
    fn a_request_done_at_its_first_token_is_never_handed_over() {
        let cluster = Cluster::new();
        let (p, d) = (cluster.worker("p"), cluster.worker("d"));
        let mut life = start(cluster.host(vec![]), pull(), 1, disaggregated(&p, &d));
        assert_eq!(cluster.submitted(0).1.work, Work::default(), "nothing to retain");
        feed(&mut life, "p", vec![token(1), finished(Finish::Length, 1)]);
        assert_eq!(life.outcome(), Some(Outcome::Ok));
        assert_eq!(cluster.submissions(), 1);
        assert_eq!(cluster.logged("release"), ["release p 7"]);
        // A stop at the first token (leased KV or not) ends it too.
        let mut life = start(cluster.host(vec![]), pull(), 5, disaggregated(&p, &d));
        feed(&mut life, "p", vec![token(1), finished(Finish::Stop, 1)]);
        assert_eq!(life.host.client, ["t1", "done Stop 1"]);
        assert_eq!(cluster.submissions(), 2);
    }

    #[test]
    fn a_prefill_worker_lost_before_its_first_token_is_released_and_the_request_routed_again() {
        let cluster = Cluster::new();
        let (p, q, d) = (cluster.worker("p"), cluster.worker("q"), cluster.worker("d"));
        let mut life = start(cluster.host(vec![Ok(disaggregated(&q, &d))]), pull(), 2, disaggregated(&p, &d));
        feed(&mut life, "p", vec![lost()]);
        assert!(cluster.at("drop p 7") < cluster.at("release p 7"), "p's stream is dropped, then its hold released");
        assert_eq!(*life.host.asked.borrow(), [(vec!["p".to_owned()], true)]);
        feed(&mut life, "q", vec![token(1), leased()]);
        feed(&mut life, "d", vec![token(2), finished(Finish::Length, 2)]);
        assert_eq!(life.outcome(), Some(Outcome::Ok));
        assert_eq!(metric(&life.host.metrics.routed_disaggregated), 2);
        assert_eq!(cluster.logged("release"), ["release p 7", "release q 7"]);
    }

    #[test]
    fn a_decode_worker_lost_before_its_first_token_hands_the_lease_to_another() {
        let cluster = Cluster::new();
        let (p, d, e) = (cluster.worker("p"), cluster.worker("d"), cluster.worker("e"));
        let mut life = start(cluster.host(vec![Ok(disaggregated(&p, &e))]), pull(), 3, disaggregated(&p, &d));
        feed(&mut life, "p", vec![token(1), leased()]);
        feed(&mut life, "d", vec![lost()]);
        assert_eq!(*life.host.asked.borrow(), [(vec!["d".to_owned()], false)], "rerouted, never refused");
        let (worker, req) = cluster.submitted(2);
        assert_eq!(worker, "e");
        assert!(received(&req).is_some(), "the prefill worker's lease still holds the KV: e pulls it");
        assert!(cluster.logged("release").is_empty(), "the lease stays until the hand-off is over");
        feed(&mut life, "e", vec![token(2), token(3), finished(Finish::Length, 3)]);
        assert_eq!(life.host.client, ["t1", "t2", "t3", "done Length 3"]);
        assert_eq!(cluster.logged("trip"), ["trip d"]);
        assert_eq!(metric(&life.host.metrics.migrations), 0);
        assert_eq!(cluster.logged("release"), ["release p 7"]);
        // Each decode worker's ledger entry went when it did.
        assert_eq!(
            cluster.logged("untrack decode"),
            ["untrack decode d 7 context 41", "untrack decode e 7 context 41"]
        );
    }

    #[test]
    fn a_decode_worker_lost_mid_stream_migrates_and_recomputes() {
        let cluster = Cluster::new();
        let (p, d, e) = (cluster.worker("p"), cluster.worker("d"), cluster.worker("e"));
        let mut life = start(cluster.host(vec![Ok(colocated(&e))]), pull(), 4, disaggregated(&p, &d));
        feed(&mut life, "p", vec![token(1), leased()]);
        feed(&mut life, "d", vec![token(2), lost()]);
        let (worker, req) = cluster.submitted(2);
        assert_eq!(worker, "e", "a colocated pick decodes too");
        assert_eq!(req.generated, [1, 2]);
        assert_eq!(req.work, Work::default(), "the lease's KV is the prompt's only: the rest is recomputed");
        feed(&mut life, "e", vec![token(3), token(4), finished(Finish::Length, 4)]);
        assert_eq!(life.host.client, ["t1", "t2", "t3", "t4", "done Length 4"]);
        assert_eq!(metric(&life.host.metrics.migrations), 1);
    }

    #[test]
    fn decode_workers_lost_past_the_retries_fail_the_request_and_release_the_prefill_side() {
        let cluster = Cluster::new();
        let (p, d, e, f) = (cluster.worker("p"), cluster.worker("d"), cluster.worker("e"), cluster.worker("f"));
        let routes = vec![Ok(disaggregated(&p, &e)), Ok(disaggregated(&p, &f))];
        let mut life = start(cluster.host(routes), pull(), 3, disaggregated(&p, &d));
        feed(&mut life, "p", vec![token(1), leased()]);
        feed(&mut life, "d", vec![lost()]);
        feed(&mut life, "e", vec![lost()]);
        feed(&mut life, "f", vec![lost()]);
        assert_eq!(life.outcome(), Some(Outcome::Failed));
        assert_eq!(life.host.client, ["t1", "failed 500"]);
        assert_eq!(cluster.logged("trip"), ["trip d", "trip e", "trip f"]);
        assert_eq!(cluster.logged("release"), ["release p 7"]);
        // And no decode worker to reroute to at all: the same end, sooner.
        let mut life = start(cluster.host(vec![]), pull(), 3, disaggregated(&p, &d));
        feed(&mut life, "p", vec![token(1), leased()]);
        feed(&mut life, "d", vec![lost()]);
        assert_eq!(life.outcome(), Some(Outcome::Failed));
    }

    #[test]
    fn with_no_decode_worker_left_the_prefill_worker_decodes_under_a_fresh_id() {
        let cluster = Cluster::new();
        let (p, d) = (cluster.worker("p"), cluster.worker("d"));
        // The lone-role fallback routes the rest to the prefill worker itself.
        let mut life = start(cluster.host(vec![Ok(colocated(&p))]), pull(), 3, disaggregated(&p, &d));
        feed(&mut life, "p", vec![token(1), leased()]);
        feed(&mut life, "d", vec![lost()]);
        let (worker, req) = cluster.submitted(2);
        assert_eq!((worker, req.id), ("p", 1001));
        assert_eq!(req.work, Work::default(), "it recomputes what it leased, under the new id");
        assert!(cluster.at("release p 7") < cluster.at("submit p 1001"), "the old id is released first");
        feed(&mut life, "p", vec![token(2), token(3), finished(Finish::Length, 3)]);
        assert_eq!(life.outcome(), Some(Outcome::Ok));
    }

    #[test]
    fn a_layerwise_hand_off_sends_the_decode_half_first_and_retries_it_by_pull_when_it_fails() {
        let cluster = Cluster::new();
        let (p, d) = (cluster.kv_worker("p"), cluster.worker("d"));
        let layerwise = settings(KvTransfer::Layerwise, PdCaching::Prefill);
        let mut life = start(cluster.host(vec![]), layerwise, 3, disaggregated(&p, &d));
        let (first, early) = cluster.submitted(0);
        let (second, prefill) = cluster.submitted(1);
        assert_eq!((first, second), ("d", "p"), "the decode half goes first, to reserve and register its blocks");
        let kv = received(&early).cloned().expect("the decode half receives the prompt's KV");
        assert_eq!(mode(&early), Some(KvTransfer::Layerwise));
        assert_eq!((kv.addr, kv.blocks.len(), kv.tokens), (addr(9), 0, PROMPT));
        assert_eq!(handoff(&prefill), Some(KvTransfer::Layerwise));
        feed(&mut life, "p", vec![token(1), leased()]);
        // The pushed KV did not arrive: d gives the request back; it gets it again, and pulls.
        feed(&mut life, "d", vec![RequestEvent::Failed(WorkerError::Handoff("no room in time".into()))]);
        let (worker, again) = cluster.submitted(2);
        assert_eq!((worker, mode(&again), again.generated.as_slice()), ("d", Some(KvTransfer::Pull), &[1][..]));
        assert_eq!(received(&again).map(|kv| kv.blocks.clone()), Some(vec![1, 2, 3]));
        assert_eq!(metric(&life.host.metrics.retries), 1);
        feed(&mut life, "d", vec![token(2), token(3), finished(Finish::Length, 3)]);
        assert_eq!(life.outcome(), Some(Outcome::Ok));
        assert_eq!(metric(&life.host.metrics.layerwise_handoffs), 0, "the layer-wise one did not arrive");
        // One that arrives is counted.
        let mut life = start(cluster.host(vec![]), layerwise, 2, disaggregated(&p, &d));
        feed(&mut life, "p", vec![token(1), leased()]);
        feed(&mut life, "d", vec![token(2), finished(Finish::Length, 2)]);
        assert_eq!(metric(&life.host.metrics.layerwise_handoffs), 1);
    }

    #[test]
    fn a_busy_prefill_worker_gets_a_pull_not_a_layerwise_reservation() {
        let cluster = Cluster::new();
        let (p, d) = (cluster.kv_worker("p"), cluster.worker("d"));
        let mut host = cluster.host(vec![]);
        host.prefill_busy = true;
        let _life = start(host, settings(KvTransfer::Layerwise, PdCaching::Prefill), 3, disaggregated(&p, &d));
        let (worker, prefill) = cluster.submitted(0);
        assert_eq!((worker, handoff(&prefill)), ("p", Some(KvTransfer::Pull)));
        assert_eq!(cluster.submissions(), 1, "no decode half reserved behind a queue");
    }

    #[test]
    fn a_failed_prefill_drops_the_early_decode_half_and_releases_the_prefill_side() {
        let cluster = Cluster::new();
        let (p, d) = (cluster.kv_worker("p"), cluster.worker("d"));
        let layerwise = settings(KvTransfer::Layerwise, PdCaching::Prefill);
        let mut life = start(cluster.host(vec![]), layerwise, 3, disaggregated(&p, &d));
        let failed = RequestEvent::Failed(WorkerError::InvalidRequest("prompt too long".into()));
        feed(&mut life, "p", vec![failed]);
        assert_eq!(life.outcome(), Some(Outcome::Invalid));
        assert_eq!(life.host.client, ["failed 400"]);
        assert!(cluster.at("drop d 7") < cluster.at("release p 7"), "the decode half is aborted, then p released");
        assert!(cluster.logged("trip").is_empty(), "a refusal is not a failure of the worker");
    }

    #[test]
    fn a_client_gone_mid_decode_ends_the_request_cancelled_and_frees_both_sides() {
        let cluster = Cluster::new();
        let (p, d) = (cluster.worker("p"), cluster.worker("d"));
        let mut life = start(cluster.host(vec![]), pull(), 5, disaggregated(&p, &d));
        feed(&mut life, "p", vec![token(1), leased()]);
        feed(&mut life, "d", vec![token(2)]);
        life.client_gone(Instant::now());
        assert_eq!(life.outcome(), Some(Outcome::Cancelled));
        assert_eq!(life.host.client, ["t1", "t2"], "nothing is sent to a client that left");
        assert!(cluster.at("drop d 7") < cluster.at("release p 7"));
        assert_eq!(cluster.logged("untrack decode"), ["untrack decode d 7 context 41"]);
        assert!(cluster.logged("trip").is_empty());
        // A client that is gone when a token is sent ends it the same way.
        let mut life = start(cluster.host(vec![]), pull(), 5, colocated(&d));
        life.host.client_gone = true;
        feed(&mut life, "d", vec![token(1)]);
        assert_eq!(life.outcome(), Some(Outcome::Cancelled));
    }

    #[test]
    fn a_planned_fetch_is_asked_for_and_its_lease_ends_with_the_prompt() {
        let cluster = Cluster::new();
        let (h, w) = (cluster.worker("holder"), cluster.worker("w"));
        let fetch = PlannedFetch { from: h.clone(), tokens: 32 };
        let mut life = Life::new(cluster.host(vec![]), pull(), choice(2), colocated(&w), Some(fetch), Instant::now());
        match life.waiting() {
            Waiting::Offer { from, lease, tokens } => {
                assert_eq!((from.name, lease, tokens.len()), ("holder", fetch_lease(ID), 32));
            }
            _ => panic!("the prompt waits for the holder's offer"),
        }
        let source = KvSource { addr: addr(2), blocks: vec![9, 9], tokens: 32, lease: None };
        life.offered(Some(source));
        let (_, req) = cluster.submitted(0);
        assert_eq!(req.work.fetch().map(|f| f.tokens), Some(32));
        assert_eq!(cluster.logged("track prefill"), ["track prefill w 7 fetched 32"]);
        let received = Some(Received { tokens: 32, bytes: 100, micros: 5, transport: None });
        let end = RequestEvent::Finished {
            reason: Finish::Length,
            prompt_tokens: PROMPT,
            cached_tokens: 32,
            completion_tokens: 2,
            kv: None,
            received,
        };
        feed(&mut life, "w", vec![token(1)]);
        assert!(cluster.logged("release holder").is_empty(), "the lease holds until the prompt is done");
        feed(&mut life, "w", vec![token(2), end]);
        assert_eq!(cluster.logged("release holder"), [format!("release holder {}", fetch_lease(ID))]);
        assert_eq!(metric(&life.host.metrics.kv_fetch_tokens), 32);
        assert_eq!(life.host.client.last().map(String::as_str), Some("done Length 2"));
    }

    #[test]
    fn a_fetch_not_offered_is_counted_and_the_prompt_computed_whole() {
        let cluster = Cluster::new();
        let (h, p, d) = (cluster.worker("holder"), cluster.worker("p"), cluster.worker("d"));
        let fetch = PlannedFetch { from: h.clone(), tokens: 32 };
        let route = disaggregated(&p, &d);
        let mut life = Life::new(cluster.host(vec![]), pull(), choice(2), route, Some(fetch), Instant::now());
        life.offered(None);
        assert_eq!(cluster.logged("release holder").len(), 1, "the lease asked for ends at once");
        let (worker, req) = cluster.submitted(0);
        assert_eq!((worker, req.work.fetch().is_none()), ("p", true));
        // The holder itself computing the prompt needs no fetch; a re-route never fetches.
        let fetch = PlannedFetch { from: p.clone(), tokens: 32 };
        let mut life = Life::new(cluster.host(vec![]), pull(), choice(2), colocated(&p), Some(fetch), Instant::now());
        assert_eq!(waiting(&mut life).as_deref(), Some("p"));
    }

    #[test]
    fn a_client_gone_while_a_fetch_is_offered_ends_the_request_and_the_lease() {
        let cluster = Cluster::new();
        let (h, w) = (cluster.worker("holder"), cluster.worker("w"));
        let fetch = PlannedFetch { from: h.clone(), tokens: 32 };
        let mut life = Life::new(cluster.host(vec![]), pull(), choice(2), colocated(&w), Some(fetch), Instant::now());
        life.client_gone(Instant::now());
        assert_eq!(life.outcome(), Some(Outcome::Cancelled));
        assert_eq!(cluster.logged("release holder").len(), 1);
        assert_eq!(cluster.submissions(), 0);
    }

    #[test]
    fn pd_caching_3_returns_the_answer_to_the_prefill_worker_after_a_success_only() {
        let cluster = Cluster::new();
        let (p, d) = (cluster.worker("p"), cluster.worker("d"));
        let ret = settings(KvTransfer::Pull, PdCaching::Return);
        let mut life = start(cluster.host(vec![]), ret, 3, disaggregated(&p, &d));
        feed(&mut life, "p", vec![token(1), leased()]);
        assert!(cluster.submitted(1).1.prefix_cache, "decode workers keep the KV in PD-Caching-2 and 3");
        feed(&mut life, "d", vec![token(2), token(3), finished(Finish::Length, 3)]);
        assert_eq!(cluster.logged("return"), [format!("return d -> p {} tokens", PROMPT + 3)]);
        let mut life = start(cluster.host(vec![]), ret, 3, disaggregated(&p, &d));
        feed(&mut life, "p", vec![token(1), leased()]);
        life.client_gone(Instant::now());
        assert_eq!(cluster.logged("return").len(), 1, "nothing returned for a cancelled request");
    }

    #[test]
    fn a_grammar_that_failed_is_a_client_error_not_a_complete_answer() {
        let cluster = Cluster::new();
        let w = cluster.worker("w");
        let mut life = start(cluster.host(vec![]), pull(), 5, colocated(&w));
        feed(&mut life, "w", vec![token(1), finished(Finish::GrammarFailed, 1)]);
        assert_eq!(life.outcome(), Some(Outcome::Invalid));
        assert_eq!(life.host.client, ["t1", "failed 400"]);
    }

    #[test]
    fn a_reroute_refused_for_load_ends_the_request_with_a_429() {
        let cluster = Cluster::new();
        let w = cluster.worker("w");
        let busy = ApiError::Overloaded { message: "full".into(), retry_after_s: 1 };
        let mut life = start(cluster.host(vec![Err(busy)]), pull(), 2, colocated(&w));
        feed(&mut life, "w", vec![lost()]);
        assert_eq!(life.outcome(), Some(Outcome::Rejected));
        assert_eq!(life.host.client, ["failed 429"]);
        assert_eq!(cluster.logged("trip"), ["trip w"]);
    }

    #[test]
    fn an_internal_failure_tells_the_client_where_to_look_not_what_broke() {
        let cluster = Cluster::new();
        let w = cluster.worker("w");
        let mut life = start(cluster.host(vec![]), pull(), 2, colocated(&w));
        feed(&mut life, "w", vec![RequestEvent::Failed(WorkerError::Engine("cuda oom at 0xdeadbeef".into()))]);
        assert_eq!(life.outcome(), Some(Outcome::Failed));
        assert_eq!(life.host.client, ["failed 500"]);
        assert!(cluster.logged("trip").is_empty(), "an engine error is the request's, not a lost worker");
    }
}
