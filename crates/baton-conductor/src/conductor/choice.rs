//! One request choice's task: the host of its [`Life`] and the loop that drives it, waiting on
//! a worker's events (with the silence probe), a holder's offer, or the client's going.

use super::*;

/// PD-Caching-3: after request `id` ended on `decode`, the prompt and answer's blocks that
/// `prefill` lacks go from `decode`'s cache into `prefill`'s (an export there, an import here),
/// so the session's next prompt is computed after its whole history. Off the request's path;
/// every wait has a deadline and a failure only leaves the cache as it was.
pub(super) async fn return_kv(
    c: Arc<Conductor>,
    decode: Arc<dyn Worker>,
    prefill: Arc<dyn Worker>,
    id: RequestId,
    tokens: Vec<u32>,
) {
    let lease = baton_protocol::wire::return_lease(id.0);
    let Some(source) = decode.export_prefix(lease, &tokens, baton_protocol::control::EXPORT_DEADLINE).await else {
        return;
    };
    let _lease = FetchLease { from: decode, lease };
    let received = prefill.import_prefix(lease, tokens, source, baton_protocol::control::IMPORT_DEADLINE).await;
    if let Some(r) = received {
        tracing::debug!(tokens = r.tokens, "the answer's KV went back to the prefill worker");
        c.metrics.return_tokens.inc_by(r.tokens as u64);
    }
}

/// What a request choice's [`Life`] asks of the conductor.
pub(super) struct ChoiceHost {
    pub(super) conductor: Arc<Conductor>,
    /// The response's stream, shared by the request's choices.
    pub(super) out: mpsc::UnboundedSender<(usize, Piece)>,
    pub(super) index: usize,
    /// Told when this choice's prompt KV is in the prefix cache (the first of `n` choices).
    pub(super) prefilled: Option<tokio::sync::oneshot::Sender<()>>,
}

impl life::Peer for Arc<dyn Worker> {
    type Events = mpsc::UnboundedReceiver<RequestEvent>;

    fn name(&self) -> &str {
        Worker::name(self.as_ref())
    }

    fn kv_addr(&self) -> Option<std::net::SocketAddr> {
        Worker::kv_addr(self.as_ref())
    }

    fn submit(&self, req: WorkRequest) -> Self::Events {
        Worker::submit(self.as_ref(), req)
    }

    fn release(&self, id: u64) {
        Worker::release(self.as_ref(), id);
    }
}

impl life::Host for ChoiceHost {
    type Peer = Arc<dyn Worker>;
    type Track = Tracked;

    fn route(&self, valid: &ValidRequest, excluded: &[String], admit: bool) -> Result<Route, ApiError> {
        self.conductor.route(valid, excluded, admit)
    }

    fn track_prefill(&self, worker: &Arc<dyn Worker>, id: RequestId, prompt: &[u32], fetched: usize) -> Tracked {
        self.conductor.track_prefill(worker.as_ref(), id, prompt, fetched)
    }

    fn track_decode(&self, worker: &Arc<dyn Worker>, id: RequestId, context: usize) -> Tracked {
        self.conductor.track(worker.as_ref(), id, true, context)
    }

    fn prefill_busy(&self, worker: &Arc<dyn Worker>) -> bool {
        self.conductor.loads().prefill.get(Worker::name(worker.as_ref())).is_some_and(|queued| !queued.is_empty())
    }

    fn fresh_id(&self) -> u64 {
        self.conductor.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn trip(&self, worker: &str, reason: &str) {
        let c = &self.conductor;
        if let Some(w) = c.workers().into_iter().find(|w| Worker::name(w.as_ref()) == worker) {
            c.trip(&w, reason);
        }
    }

    fn send(&mut self, piece: Piece) -> bool {
        self.out.send((self.index, piece)).is_ok()
    }

    fn logprob_entry(&self, token: u32, lp: &baton_model::TokenLogprobs) -> crate::openai::LogprobEntry {
        self.conductor.validator.logprob_entry(token, lp)
    }

    fn prefilled(&mut self) {
        if let Some(tx) = self.prefilled.take() {
            let _ = tx.send(());
        }
    }

    fn return_kv(&self, from: Arc<dyn Worker>, to: Arc<dyn Worker>, id: RequestId, tokens: Vec<u32>) {
        tokio::spawn(return_kv(self.conductor.clone(), from, to, id, tokens).in_current_span());
    }

    fn metrics(&self) -> &Metrics {
        &self.conductor.metrics
    }
}

impl ChoiceHost {
    /// Runs a choice of a request on `route` to its end (the task that drives its [`Life`]),
    /// holding `binding` (its claim on its decode worker's room) until then.
    pub(super) async fn run(self, choice: Choice, route: Route, fetch: Option<PlannedFetch>, binding: Option<Binding>) {
        let _binding = binding;
        let c = self.conductor.clone();
        let settings =
            Settings { kv_transfer: c.kv_transfer, pd_caching: c.pd_caching, kv_bytes_per_token: c.kv_bytes_per_token };
        let out = self.out.clone();
        let mut life = Life::new(self, settings, choice, route, fetch, Instant::now());
        loop {
            enum Got {
                Event(RequestEvent),
                Offer(Option<KvSource>),
                Gone,
            }
            let got = match life.waiting() {
                Waiting::Done => break,
                Waiting::Worker { worker, events } => match next_event(worker, events, c.worker_silence, &out).await {
                    Some(event) => Got::Event(event),
                    None => Got::Gone,
                },
                Waiting::Offer { from, lease, tokens } => tokio::select! {
                    offer = from.export_prefix(lease, tokens, baton_protocol::control::EXPORT_DEADLINE) => Got::Offer(offer),
                    () = out.closed() => Got::Gone,
                },
            };
            let now = Instant::now();
            match got {
                Got::Event(event) => life.event(event, now),
                Got::Offer(offer) => life.offered(offer),
                Got::Gone => life.client_gone(now),
            }
        }
        debug_assert!(life.outcome().is_some(), "a life waits on nothing only once it is over");
    }
}

/// A worker's next event for a request, or `None` as soon as the client goes away. A worker
/// silent past `silence` is probed (its engine answers a stats call between steps): one that
/// answers is busy and the wait goes on, up to [`WORKER_SILENCE_MAX`]; one that does not, or
/// whose stream ends before the request does, is reported as [`RequestEvent::Lost`].
pub(super) async fn next_event(
    worker: &Arc<dyn Worker>,
    events: &mut mpsc::UnboundedReceiver<RequestEvent>,
    silence: Duration,
    out: &mpsc::UnboundedSender<(usize, Piece)>,
) -> Option<RequestEvent> {
    let lost = |reason: &str| Some(RequestEvent::Lost { reason: reason.to_owned() });
    let since = Instant::now();
    loop {
        let event = tokio::select! {
            e = tokio::time::timeout(silence, events.recv()) => e,
            () = out.closed() => return None,
        };
        match event {
            Ok(Some(e)) => return Some(e),
            Ok(None) => return lost("it stopped before finishing the request"),
            Err(_) if since.elapsed() >= WORKER_SILENCE_MAX => {
                return lost("it sent nothing for this request in ten minutes");
            }
            Err(_) => {
                // Silent: queued behind other requests, or dead? Its engine answers a stats
                // call between steps; a busy worker is not taken for a dead one.
                let alive = tokio::select! {
                    stats = worker.stats() => stats.is_some(),
                    () = out.closed() => return None,
                };
                if !alive {
                    return lost("it sent nothing and did not answer a probe in time");
                }
                tracing::debug!(worker = worker.name(), silent_s = since.elapsed().as_secs(), "worker busy; waiting");
            }
        }
    }
}
