//! The conductor: the OpenAI-compatible HTTP API in front of the workers, and each request's
//! life across them.
//!
//! A request is validated into a [`ValidRequest`], routed by the [`RoutePolicy`], then run:
//! colocated, it goes to one worker; disaggregated, the prefill worker computes the prompt and
//! the first token and keeps the KV under a lease, the conductor streams that token, the decode
//! worker pulls the KV into blocks of its own, the prefill worker is told to release it, and the
//! decode worker streams the rest. A client that disconnects drops the response stream, which
//! drops the worker's event receiver, which aborts the request and frees its KV.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use baton_engine::{FinishReason, GenerationRequest, KvRetention, RequestId, StopParams};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::error::ApiError;
use crate::metrics::{Metrics, Outcome, WorkerGauges};
use crate::openai::{Endpoint, ValidRequest, Validator};
use crate::routing::{Decision, RoutePolicy, RouteRequest, Snapshot, WorkerView};
use crate::worker::{RequestEvent, Role, WorkerHandle};

/// How long the conductor waits for a worker's next event before failing the request.
const WORKER_EVENT_TIMEOUT: Duration = Duration::from_secs(120);

/// Shared state of the conductor's handlers.
pub struct Conductor {
    validator: Validator,
    workers: Vec<WorkerHandle>,
    policy: Box<dyn RoutePolicy>,
    metrics: Metrics,
    api_key: Option<String>,
    next_id: AtomicU64,
    /// KV bytes per token, for the transfer counter.
    kv_bytes_per_token: usize,
}

impl std::fmt::Debug for Conductor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conductor").field("workers", &self.workers).finish_non_exhaustive()
    }
}

impl Conductor {
    /// A conductor over `workers`.
    pub fn new(
        validator: Validator,
        workers: Vec<WorkerHandle>,
        policy: Box<dyn RoutePolicy>,
        api_key: Option<String>,
        kv_bytes_per_token: usize,
    ) -> Self {
        Self {
            validator,
            workers,
            policy,
            metrics: Metrics::default(),
            api_key,
            next_id: AtomicU64::new(1),
            kv_bytes_per_token,
        }
    }

    /// The workers.
    pub fn workers(&self) -> &[WorkerHandle] {
        &self.workers
    }

    /// The HTTP API.
    pub fn router(self: Arc<Self>) -> axum::Router {
        axum::Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/models", get(models))
            .route("/health", get(health))
            .route("/metrics", get(metrics))
            .fallback(|| async { ApiError::NotFound("no such endpoint".into()) })
            .with_state(self)
    }

    fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(key) = &self.api_key else { return Ok(()) };
        let given =
            headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        match given {
            Some(g) if constant_time_eq(g.as_bytes(), key.as_bytes()) => Ok(()),
            Some(_) => Err(ApiError::Unauthorized("incorrect API key".into())),
            None => Err(ApiError::Unauthorized("missing API key: send `Authorization: Bearer <key>`".into())),
        }
    }

    fn snapshot(&self) -> Snapshot {
        Snapshot {
            workers: self
                .workers
                .iter()
                .enumerate()
                .map(|(index, w)| WorkerView { index, role: w.role(), in_flight: w.in_flight() })
                .collect(),
        }
    }

    async fn handle(self: Arc<Self>, endpoint: Endpoint, headers: HeaderMap, body: Bytes) -> Response {
        let result = self.authorize(&headers).and_then(|()| match endpoint {
            Endpoint::Completions => self.validator.completion(&body),
            Endpoint::Chat => self.validator.chat(&body),
        });
        let valid = match result {
            Ok(v) => v,
            Err(e) => {
                self.metrics.outcome(Outcome::Invalid);
                return e.into_response();
            }
        };
        let route = self.policy.route(
            &self.snapshot(),
            &RouteRequest { prompt_tokens: valid.prompt_ids.len(), max_tokens: valid.stop.max_tokens },
        );
        let route = match route {
            Decision::Reject { reason } => {
                self.metrics.outcome(Outcome::Rejected);
                return ApiError::Overloaded { message: reason, retry_after_s: 1 }.into_response();
            }
            Decision::NoWorkers => {
                self.metrics.outcome(Outcome::Failed);
                return ApiError::Unavailable("no worker is available".into()).into_response();
            }
            other => other,
        };
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let (tx, rx) = mpsc::unbounded_channel();
        let stream = valid.stream;
        let run = Run { conductor: self.clone(), valid: valid.clone(), id, out: tx };
        tokio::spawn(run.run(route));
        if stream { sse_response(valid, id, rx) } else { full_response(valid, id, rx).await }
    }
}

/// Compares secrets without an early exit that would leak their common prefix's length.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn completions(State(c): State<Arc<Conductor>>, headers: HeaderMap, body: Bytes) -> Response {
    c.handle(Endpoint::Completions, headers, body).await
}

async fn chat_completions(State(c): State<Arc<Conductor>>, headers: HeaderMap, body: Bytes) -> Response {
    c.handle(Endpoint::Chat, headers, body).await
}

async fn models(State(c): State<Arc<Conductor>>, headers: HeaderMap) -> Response {
    if let Err(e) = c.authorize(&headers) {
        return e.into_response();
    }
    Json(json!({"object": "list", "data": [{"id": c.validator.model_id, "object": "model", "created": 0, "owned_by": "baton"}]}))
        .into_response()
}

async fn health(State(c): State<Arc<Conductor>>) -> Response {
    if c.workers.is_empty() {
        return (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "no workers"}))).into_response();
    }
    Json(json!({"status": "ok", "workers": c.workers.len()})).into_response()
}

async fn metrics(State(c): State<Arc<Conductor>>) -> Response {
    let mut gauges = Vec::new();
    for w in &c.workers {
        if let Some(s) = w.stats().await {
            gauges.push(WorkerGauges {
                name: w.name().to_owned(),
                role: match w.role() {
                    Role::Prefill => "prefill",
                    Role::Decode => "decode",
                    Role::Colocated => "colocated",
                },
                running: s.running,
                waiting: s.waiting,
                blocks_used: s.total_blocks - s.available_blocks,
                blocks_total: s.total_blocks,
            });
        }
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], c.metrics.render(&gauges)).into_response()
}

/// What a run sends the response: text as it comes, then the end.
enum Piece {
    Text(String),
    Done { reason: FinishReason, prompt_tokens: usize, completion_tokens: usize },
    Failed(ApiError),
}

/// One request's life across the workers.
struct Run {
    conductor: Arc<Conductor>,
    valid: ValidRequest,
    id: RequestId,
    out: mpsc::UnboundedSender<Piece>,
}

impl Run {
    async fn run(self, route: Decision) {
        let c = self.conductor.clone();
        let start = Instant::now();
        let result = match route {
            Decision::Colocated(w) => {
                c.metrics.routed_colocated.fetch_add(1, Ordering::Relaxed);
                let req = self.request(self.valid.stop.clone());
                let events = c.workers[w].submit(req, None);
                self.relay(events, start, None).await
            }
            Decision::Disaggregated { prefill, decode } => {
                c.metrics.routed_disaggregated.fetch_add(1, Ordering::Relaxed);
                self.disaggregated(&c.workers[prefill], &c.workers[decode], start).await
            }
            Decision::Reject { .. } | Decision::NoWorkers => unreachable!("handled before spawning"),
        };
        let outcome = match result {
            Ok(()) => Outcome::Ok,
            Err(RunError::Cancelled) => Outcome::Cancelled,
            Err(RunError::Api(e)) => {
                let o = if e.status().is_client_error() { Outcome::Invalid } else { Outcome::Failed };
                let _ = self.out.send(Piece::Failed(e));
                o
            }
        };
        c.metrics.outcome(outcome);
        c.metrics.e2e.observe(start.elapsed().as_secs_f64());
    }

    fn request(&self, stop: StopParams) -> GenerationRequest {
        GenerationRequest {
            sampling: self.valid.sampling.clone(),
            stop,
            ..GenerationRequest::new(self.id, self.valid.prompt_ids.clone())
        }
    }

    async fn disaggregated(&self, p: &WorkerHandle, d: &WorkerHandle, start: Instant) -> Result<(), RunError> {
        let c = &self.conductor;
        // Prefill: the prompt and the first token; the KV stays on `p` under a lease.
        let first_stop = StopParams { max_tokens: 1, ..self.valid.stop.clone() };
        // (With max_tokens 1 the request ends here: nothing to hand over.)
        let retain_kv = if self.valid.stop.max_tokens > 1 { KvRetention::All } else { KvRetention::None };
        let req = GenerationRequest { retain_kv, ..self.request(first_stop) };
        let mut events = p.submit(req, None);
        let mut first = Vec::new();
        let (reason, prompt_tokens, kv) = loop {
            match next(&mut events).await? {
                RequestEvent::Token { token, text } => {
                    c.metrics.ttft.observe(start.elapsed().as_secs_f64());
                    first.push(token);
                    self.send(Piece::Text(text))?;
                }
                RequestEvent::Finished { reason, prompt_tokens, kv, .. } => break (reason, prompt_tokens, kv),
                RequestEvent::Failed(e) => return Err(RunError::Api(e)),
            }
        };
        let done_at_prefill = reason != FinishReason::Length || self.valid.stop.max_tokens == 1;
        let Some(kv) = kv.filter(|_| !done_at_prefill) else {
            p.release(self.id);
            return self.finish(reason, prompt_tokens, first.len());
        };
        // Decode: pull the KV, release it on the prefill side, stream the rest.
        let handoff = Instant::now();
        let bytes = kv.tokens * c.kv_bytes_per_token;
        let req = GenerationRequest { generated: first, ..self.request(self.valid.stop.clone()) };
        let events = d.submit(req, Some(kv));
        let result = self.relay(events, start, Some((p, handoff, bytes))).await;
        // Released in any case (already released after a successful pull: a no-op then).
        p.release(self.id);
        result
    }

    /// Streams a worker's events to the response. With `handoff`, the first event means the
    /// KV was pulled: release it at the prefill worker and record the hand-off.
    async fn relay(
        &self,
        mut events: mpsc::UnboundedReceiver<RequestEvent>,
        start: Instant,
        mut handoff: Option<(&WorkerHandle, Instant, usize)>,
    ) -> Result<(), RunError> {
        let c = &self.conductor;
        let mut last = None;
        loop {
            let event = next(&mut events).await?;
            if let Some((p, t, bytes)) = handoff.take() {
                p.release(self.id);
                c.metrics.transfer.observe(t.elapsed().as_secs_f64());
                c.metrics.transfer_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
                last = Some(Instant::now());
            }
            match event {
                RequestEvent::Token { text, .. } => {
                    let now = Instant::now();
                    match last {
                        None => c.metrics.ttft.observe(start.elapsed().as_secs_f64()),
                        Some(t) => c.metrics.tbt.observe((now - t).as_secs_f64()),
                    }
                    last = Some(now);
                    self.send(Piece::Text(text))?;
                }
                RequestEvent::Finished { reason, prompt_tokens, completion_tokens, .. } => {
                    return self.finish(reason, prompt_tokens, completion_tokens);
                }
                RequestEvent::Failed(e) => return Err(RunError::Api(e)),
            }
        }
    }

    fn finish(&self, reason: FinishReason, prompt_tokens: usize, completion_tokens: usize) -> Result<(), RunError> {
        let m = &self.conductor.metrics;
        m.prompt_tokens.fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        m.generation_tokens.fetch_add(completion_tokens as u64, Ordering::Relaxed);
        self.send(Piece::Done { reason, prompt_tokens, completion_tokens })
    }

    fn send(&self, piece: Piece) -> Result<(), RunError> {
        self.out.send(piece).map_err(|_| RunError::Cancelled)
    }
}

enum RunError {
    /// The client went away.
    Cancelled,
    /// The request failed.
    Api(ApiError),
}

async fn next(events: &mut mpsc::UnboundedReceiver<RequestEvent>) -> Result<RequestEvent, RunError> {
    match tokio::time::timeout(WORKER_EVENT_TIMEOUT, events.recv()).await {
        Ok(Some(e)) => Ok(e),
        Ok(None) => Err(RunError::Api(ApiError::Internal("the worker stopped before finishing the request".into()))),
        Err(_) => Err(RunError::Api(ApiError::Internal("the worker did not answer in time".into()))),
    }
}

fn created() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn response_id(valid: &ValidRequest, id: RequestId) -> String {
    match valid.endpoint {
        Endpoint::Completions => format!("cmpl-{}", id.0),
        Endpoint::Chat => format!("chatcmpl-{}", id.0),
    }
}

fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens})
}

async fn full_response(valid: ValidRequest, id: RequestId, mut rx: mpsc::UnboundedReceiver<Piece>) -> Response {
    let mut text = String::new();
    while let Some(piece) = rx.recv().await {
        match piece {
            Piece::Text(t) => text.push_str(&t),
            Piece::Failed(e) => return e.into_response(),
            Piece::Done { reason, prompt_tokens, completion_tokens } => {
                let choice = match valid.endpoint {
                    Endpoint::Completions => {
                        json!({"index": 0, "text": text, "finish_reason": reason.as_openai(), "logprobs": null})
                    }
                    Endpoint::Chat => json!({"index": 0, "message": {"role": "assistant", "content": text},
                        "finish_reason": reason.as_openai(), "logprobs": null}),
                };
                let object = if valid.endpoint == Endpoint::Chat { "chat.completion" } else { "text_completion" };
                return Json(json!({
                    "id": response_id(&valid, id), "object": object, "created": created(), "model": valid.model,
                    "choices": [choice], "usage": usage(prompt_tokens, completion_tokens),
                }))
                .into_response();
            }
        }
    }
    ApiError::Internal("the request ended without a result".into()).into_response()
}

fn sse_response(valid: ValidRequest, id: RequestId, mut rx: mpsc::UnboundedReceiver<Piece>) -> Response {
    let (tx, out) = mpsc::unbounded_channel::<Result<Event, Infallible>>();
    tokio::spawn(async move {
        let rid = response_id(&valid, id);
        let created = created();
        let chat = valid.endpoint == Endpoint::Chat;
        let object = if chat { "chat.completion.chunk" } else { "text_completion" };
        let chunk = |choice: Value, usage: Value| {
            let data = json!({"id": rid, "object": object, "created": created, "model": valid.model,
                "choices": choice, "usage": usage});
            Ok(Event::default().data(data.to_string()))
        };
        if chat {
            let role = json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null, "logprobs": null}]);
            if tx.send(chunk(role, Value::Null)).is_err() {
                return;
            }
        }
        while let Some(piece) = rx.recv().await {
            let sent = match piece {
                Piece::Text(t) if t.is_empty() => Ok(()),
                Piece::Text(t) => {
                    let choice = if chat {
                        json!([{"index": 0, "delta": {"content": t}, "finish_reason": null, "logprobs": null}])
                    } else {
                        json!([{"index": 0, "text": t, "finish_reason": null, "logprobs": null}])
                    };
                    tx.send(chunk(choice, Value::Null))
                }
                Piece::Done { reason, prompt_tokens, completion_tokens } => {
                    let choice = if chat {
                        json!([{"index": 0, "delta": {}, "finish_reason": reason.as_openai(), "logprobs": null}])
                    } else {
                        json!([{"index": 0, "text": "", "finish_reason": reason.as_openai(), "logprobs": null}])
                    };
                    let _ = tx.send(chunk(choice, Value::Null));
                    if valid.include_usage {
                        let _ = tx.send(chunk(json!([]), usage(prompt_tokens, completion_tokens)));
                    }
                    let _ = tx.send(Ok(Event::default().data("[DONE]")));
                    return;
                }
                Piece::Failed(e) => {
                    // Headers are gone: the error travels as an event, then the stream ends.
                    let _ = tx.send(Ok(Event::default().data(e.body().to_string())));
                    return;
                }
            };
            if sent.is_err() {
                // The client went away: dropping `rx` cancels the run.
                return;
            }
        }
    });
    Sse::new(UnboundedReceiverStream::new(out)).keep_alive(KeepAlive::default()).into_response()
}
