//! A worker's control API, served: the routes [`baton_protocol::control`] lists, over a
//! [`WorkerHandle`], each request proven with the cluster secret (but the liveness and readiness
//! probes, which a kubelet asks without one).

use std::convert::Infallible;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use baton_cluster::{AUTH_HEADER, ClusterSecret, SeenProofs, unix_millis};
use tokio_stream::StreamExt;

use baton_protocol::control::*;
use baton_protocol::error::ApiError;
use baton_protocol::state_codec::StateFormat;
use baton_protocol::worker::Worker;

use crate::worker::WorkerHandle;

#[derive(Clone)]
struct ControlState {
    worker: WorkerHandle,
    secret: ClusterSecret,
    /// Proofs accepted lately: a captured call cannot be played again.
    seen: Arc<SeenProofs>,
}

/// The control routes over a local worker.
pub fn router(worker: WorkerHandle, secret: ClusterSecret) -> Router {
    Router::new()
        .route(GENERATE_PATH, post(generate))
        .route(RELEASE_PATH, post(release))
        .route(EXPORT_PATH, post(export))
        .route(IMPORT_PATH, post(import))
        .route(ROLE_PATH, post(role))
        .route(STATS_PATH, get(stats))
        .route(STATE_PATH, get(state_stream))
        .route(LIVE_PATH, get(|| async { "ok" }))
        .route(READY_PATH, get(ready))
        .with_state(ControlState { worker, secret, seen: Arc::default() })
}

fn authorize(state: &ControlState, headers: &HeaderMap, method: &str, path: &str, body: &[u8]) -> Result<(), ApiError> {
    let proof = headers.get(AUTH_HEADER).and_then(|v| v.to_str().ok());
    let now = unix_millis();
    state
        .secret
        .verify_request(proof, method, path, now, body)
        .and_then(|id| state.seen.check(id, now))
        .map_err(|f| ApiError::Unauthorized(format!("worker control API: {}", f.message())))
}

/// Checks a signed `POST` to `path` and reads its JSON body; the error otherwise (401 without
/// the cluster's proof, 400 naming `what` for a body that does not parse).
fn signed_body<T: serde::de::DeserializeOwned>(
    state: &ControlState,
    headers: &HeaderMap,
    path: &str,
    body: &[u8],
    what: &str,
) -> Result<T, ApiError> {
    authorize(state, headers, "POST", path, body)?;
    serde_json::from_slice(body).map_err(|e| ApiError::invalid(format!("invalid {what} request: {e}")))
}

async fn generate(State(state): State<ControlState>, headers: HeaderMap, body: Bytes) -> Response {
    let req = match signed_body(&state, &headers, GENERATE_PATH, &body, "work") {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let mut events = state.worker.submit(req);
    // One line per event, and a blank line after each KEEPALIVE without one: a request may wait
    // or prefill for long without an event, and the conductor must tell that from a connection
    // that hangs (a frozen or half-open worker). The client leaving drops `lines`, which ends this
    // task at once (not at its next line) and drops `events`: the request is aborted.
    let (tx, lines) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(16);
    tokio::spawn(async move {
        loop {
            let next = tokio::select! {
                () = tx.closed() => return,
                next = tokio::time::timeout(KEEPALIVE, events.recv()) => next,
            };
            let line = match next {
                Ok(Some(event)) => {
                    let mut line = serde_json::to_vec(&event).unwrap_or_else(|_| b"{}".to_vec());
                    line.push(b'\n');
                    Bytes::from(line)
                }
                Ok(None) => return,
                Err(_) => Bytes::from_static(b"\n"),
            };
            if tx.send(Ok(line)).await.is_err() {
                return;
            }
        }
    });
    let lines = tokio_stream::wrappers::ReceiverStream::new(lines);
    ([(header::CONTENT_TYPE, "application/x-ndjson")], Body::from_stream(lines)).into_response()
}

async fn release(State(state): State<ControlState>, headers: HeaderMap, body: Bytes) -> Response {
    let b: ReleaseBody = match signed_body(&state, &headers, RELEASE_PATH, &body, "release") {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    state.worker.release(b.id);
    StatusCode::NO_CONTENT.into_response()
}

async fn export(State(state): State<ControlState>, headers: HeaderMap, body: Bytes) -> Response {
    let b: ExportBody = match signed_body(&state, &headers, EXPORT_PATH, &body, "export") {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    match state.worker.export_prefix(b.lease, &b.tokens, EXPORT_DEADLINE).await {
        Some(source) => axum::Json(source).into_response(),
        None => ApiError::NotFound("no prefix of these tokens is cached here".into()).into_response(),
    }
}

async fn import(State(state): State<ControlState>, headers: HeaderMap, body: Bytes) -> Response {
    let b: ImportBody = match signed_body(&state, &headers, IMPORT_PATH, &body, "import") {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    match state.worker.import_prefix(b.id, b.tokens, b.source, IMPORT_DEADLINE).await {
        Some(received) => axum::Json(received).into_response(),
        None => ApiError::NotFound("no KV arrived".into()).into_response(),
    }
}

async fn role(State(state): State<ControlState>, headers: HeaderMap, body: Bytes) -> Response {
    let b: RoleBody = match signed_body(&state, &headers, ROLE_PATH, &body, "role") {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    match state.worker.set_role(b.role) {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => ApiError::Unavailable(e.to_string()).into_response(),
    }
}

async fn stats(State(state): State<ControlState>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&state, &headers, "GET", STATS_PATH, b"") {
        return e.into_response();
    }
    match state.worker.stats().await {
        Some(s) => axum::Json(s).into_response(),
        None => ApiError::Unavailable("the engine did not answer in time".into()).into_response(),
    }
}

/// The readiness probe: 200 while the worker takes work; 503 while it drains (SIGTERM: it
/// finishes what it holds) or its engine does not answer. Unauthenticated, as a probe is; it
/// says no more than the role and whether the worker is ready.
async fn ready(State(state): State<ControlState>) -> Response {
    let role = state.worker.role().as_str();
    match state.worker.stats().await {
        Some(s) if !s.draining => axum::Json(serde_json::json!({"status": "ready", "role": role})).into_response(),
        Some(_) => {
            (StatusCode::SERVICE_UNAVAILABLE, axum::Json(serde_json::json!({"status": "draining", "role": role})))
                .into_response()
        }
        None => (StatusCode::SERVICE_UNAVAILABLE, axum::Json(serde_json::json!({"status": "engine not answering"})))
            .into_response(),
    }
}

/// The worker's state stream, a snapshot first, in the format the `Accept` header asks for;
/// closing the connection ends the subscription. An update that cannot be encoded (a snapshot
/// over the frame limit) ends the stream.
async fn state_stream(State(state): State<ControlState>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&state, &headers, "GET", STATE_PATH, b"") {
        return e.into_response();
    }
    let Some(updates) = state.worker.subscribe_state() else {
        return ApiError::Unavailable("the worker has stopped".into()).into_response();
    };
    let format = StateFormat::from_accept(headers.get_all(header::ACCEPT).iter().filter_map(|v| v.to_str().ok()));
    let chunks = tokio_stream::wrappers::ReceiverStream::new(updates)
        .map(move |update| {
            let mut chunk = Vec::new();
            format.encode(&update, &mut chunk).map(|()| Bytes::from(chunk)).map_err(|e| {
                tracing::error!(error = %e, "a state update could not be encoded; the state stream ends");
            })
        })
        .take_while(Result::is_ok)
        .map(|chunk| Ok::<_, Infallible>(chunk.unwrap_or_default()));
    ([(header::CONTENT_TYPE, format.media_type())], Body::from_stream(chunks)).into_response()
}
