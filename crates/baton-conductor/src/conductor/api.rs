//! The conductor's HTTP surface: its routes, the API key, `x-request-id`, and the handlers of
//! `/v1/models`, `/health`, `/metrics` and `/debug/kv-index` (the completions routes hand their
//! bodies to [`Conductor::handle`]).

use super::*;

impl Conductor {
    /// The HTTP API.
    pub fn router(self: Arc<Self>) -> axum::Router {
        self.follow_workers();
        self.run_elastic();
        axum::Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/models", get(models))
            .route("/health", get(health))
            .route("/metrics", get(metrics))
            .route("/debug/kv-index", get(kv_index))
            .route("/dashboard", get(crate::dashboard::page))
            .route(
                "/dashboard/state",
                get(|State(c): State<Arc<Self>>, h: HeaderMap| async move {
                    match c.authorize(&h) {
                        Ok(()) => crate::dashboard::state(&c, &c.metrics).await,
                        Err(e) => e.into_response(),
                    }
                }),
            )
            .fallback(|| async { ApiError::NotFound("no such endpoint".into()) })
            .layer(axum::middleware::from_fn(request_id))
            .with_state(self)
    }

    pub(super) fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(key) = &self.api_key else { return Ok(()) };
        let given =
            headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        match given {
            Some(g) if constant_time_eq(g.as_bytes(), key.as_bytes()) => Ok(()),
            Some(_) => Err(ApiError::Unauthorized("incorrect API key".into())),
            None => Err(ApiError::Unauthorized("missing API key: send `Authorization: Bearer <key>`".into())),
        }
    }
}

/// The header naming a request across the client's, the conductor's and the workers' logs.
pub const REQUEST_ID_HEADER: &str = "x-request-id";
/// Longest `x-request-id` taken from a client (a longer or non-printable one is replaced).
pub(super) const MAX_REQUEST_ID: usize = 128;

/// Gives every API request an `x-request-id`: the client's when it sent a usable one (1 to 128
/// printable ASCII characters), else a new one; handlers read it from the request's headers,
/// and every response carries it back.
pub(super) async fn request_id(mut req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let given = req
        .headers()
        .get(REQUEST_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= MAX_REQUEST_ID && v.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_owned);
    let id = given.unwrap_or_else(new_request_id);
    let value = header::HeaderValue::from_str(&id).unwrap_or_else(|_| header::HeaderValue::from_static("invalid"));
    req.headers_mut().insert(REQUEST_ID_HEADER, value.clone());
    let mut response = next.run(req).await;
    response.headers_mut().insert(REQUEST_ID_HEADER, value);
    response
}

/// A new request id: 32 hex digits, unique in practice (time, process and a counter hashed).
pub(super) fn new_request_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(nanos);
    h.write_u64(n);
    h.write_u32(std::process::id());
    format!("{:016x}{:016x}", h.finish(), (nanos as u64) ^ n.rotate_left(32))
}

/// The request's `x-request-id` (set by [`request_id`] on every API request).
pub(super) fn request_id_of(headers: &HeaderMap) -> String {
    headers.get(REQUEST_ID_HEADER).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned()
}

/// Compares secrets without an early exit that would leak their common prefix's length.
pub(super) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    subtle::ConstantTimeEq::ct_eq(a, b).into()
}

pub(super) async fn completions(State(c): State<Arc<Conductor>>, headers: HeaderMap, body: Bytes) -> Response {
    c.handle(Endpoint::Completions, headers, body).await
}

pub(super) async fn chat_completions(State(c): State<Arc<Conductor>>, headers: HeaderMap, body: Bytes) -> Response {
    c.handle(Endpoint::Chat, headers, body).await
}

pub(super) async fn models(State(c): State<Arc<Conductor>>, headers: HeaderMap) -> Response {
    if let Err(e) = c.authorize(&headers) {
        return e.into_response();
    }
    Json(json!({"object": "list", "data": [{"id": c.validator.model_id, "object": "model", "created": 0, "owned_by": "baton"}]}))
        .into_response()
}

/// Where a conductor's request ids start: a random point of [1, 2^62], so that conductor replicas
/// routing to the same workers hand them distinct ids (a worker refuses a second request under
/// an id it runs). Two replicas that each number n requests overlap with probability about
/// 2n / 2^62; counting from 1, as every conductor once did, they collide at once.
pub(super) fn first_request_id() -> u64 {
    (rand::random::<u64>() >> 2) | 1
}

pub(super) async fn health(State(c): State<Arc<Conductor>>, headers: HeaderMap) -> Response {
    if c.protect_metrics
        && let Err(e) = c.authorize(&headers)
    {
        return e.into_response();
    }
    let workers = c.workers();
    if workers.is_empty() {
        return (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "no workers"}))).into_response();
    }
    // Each worker's KV kind where it said one (remote workers): KV moves only between equal ones.
    let names: Vec<_> = workers
        .iter()
        .map(|w| {
            let mut entry = json!({"name": w.name(), "role": w.role().as_str()});
            if let Some(kv) = w.kv_kind() {
                entry["kv"] = json!(kv);
            }
            entry
        })
        .collect();
    Json(json!({"status": "ok", "workers": names})).into_response()
}

pub(super) async fn metrics(State(c): State<Arc<Conductor>>, headers: HeaderMap) -> Response {
    if c.protect_metrics
        && let Err(e) = c.authorize(&headers)
    {
        return e.into_response();
    }
    let mut gauges = Vec::new();
    for w in c.workers() {
        if let Some(s) = w.stats().await {
            gauges.push(WorkerGauges {
                name: w.name().to_owned(),
                role: w.role().as_str(),
                running: s.running,
                waiting: s.waiting,
                blocks_used: s.total_blocks - s.available_blocks,
                blocks_total: s.total_blocks,
                corrupt_blocks: s.corrupt_blocks,
                kv_copy_bytes: s.kv_copy_bytes,
            });
        }
    }
    let index = c.view.gauges();
    let pool_loads = c.elastic.as_ref().map(|e| e.lock().unwrap_or_else(std::sync::PoisonError::into_inner).loads());
    let scrape = crate::metrics::Scrape {
        workers: &gauges,
        index: &index,
        decode_time_us: c.loads().decode_time.get(),
        pool_loads,
        admission_queued: c.queued(),
    };
    let text = c.metrics.render(&scrape);
    ([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], text).into_response()
}

/// `GET /debug/kv-index`: what the conductor's index holds of each worker (confirmed blocks by
/// chained hash, with tiers) and each worker's last load report. Behind the API key.
pub(super) async fn kv_index(State(c): State<Arc<Conductor>>, headers: HeaderMap) -> Response {
    if let Err(e) = c.authorize(&headers) {
        return e.into_response();
    }
    let mut workers = serde_json::Map::new();
    for w in c.workers() {
        let blocks: Vec<serde_json::Value> = c
            .view
            .blocks(w.name())
            .unwrap_or_default()
            .into_iter()
            .map(|(h, t)| json!([h.0, baton_protocol::wire::KvTier::from(t).as_str()]))
            .collect();
        workers.insert(w.name().to_owned(), json!({"blocks": blocks, "report": c.view.report(w.name())}));
    }
    Json(json!({"mode": format!("{:?}", c.view.mode()).to_lowercase(), "workers": workers})).into_response()
}
