//! The embedded registry's HTTP surface, for workers in other processes: an axum `Router` the
//! conductor merges into its app, and the JSON bodies its routes exchange.
//!
//! | route                     | body                 | answer                                   |
//! |---------------------------|----------------------|------------------------------------------|
//! | `POST /cluster/register`  | [`RegisterRequest`]  | 200 [`RegisterResponse`], 409 duplicate  |
//! | `POST /cluster/heartbeat` | [`LeaseRequest`]     | 200, 404 unknown lease                   |
//! | `POST /cluster/deregister`| [`LeaseRequest`]     | 200, 404 unknown lease                   |
//! | `GET /cluster/members`    | none                 | 200 [`MembersSnapshot`]                  |
//!
//! Every request carries the [`AUTH_HEADER`] proof of the cluster secret: 401 when it is
//! missing, malformed, stale or replayed, 403 when it was made with another secret. Errors are
//! `{"error": "..."}`; 400 for a body that does not parse or an invalid TTL.

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};

use crate::auth::{AUTH_HEADER, AuthFailure};
use crate::embedded::{EmbeddedRegistry, MembersSnapshot};
use crate::table::{Command, LeaseId};
use crate::types::{ClusterError, WorkerId, WorkerInfo, unix_millis};

/// Path of the registration route (also the path the proof is made over).
pub const REGISTER_PATH: &str = "/cluster/register";
/// Path of the heartbeat route.
pub const HEARTBEAT_PATH: &str = "/cluster/heartbeat";
/// Path of the deregistration route.
pub const DEREGISTER_PATH: &str = "/cluster/deregister";
/// Path of the member list route.
pub const MEMBERS_PATH: &str = "/cluster/members";

/// Body of `POST /cluster/register`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegisterRequest {
    /// Who is joining.
    pub info: WorkerInfo,
    /// Lease TTL in milliseconds.
    pub ttl_ms: u64,
}

/// Answer to a registration.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RegisterResponse {
    /// The lease to heartbeat and deregister with.
    pub lease: LeaseId,
}

/// Body of `POST /cluster/heartbeat` and `POST /cluster/deregister`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseRequest {
    /// The member.
    pub worker: WorkerId,
    /// Its lease.
    pub lease: LeaseId,
}

/// An error answer.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What went wrong, for a person.
    pub error: String,
}

/// The `/cluster/*` routes over `registry`, to merge into the conductor's app.
pub fn router(registry: EmbeddedRegistry) -> Router {
    Router::new()
        .route(REGISTER_PATH, post(register))
        .route(HEARTBEAT_PATH, post(heartbeat))
        .route(DEREGISTER_PATH, post(deregister))
        .route(MEMBERS_PATH, get(members))
        .with_state(registry)
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, axum::Json(ErrorBody { error: message.into() })).into_response()
}

fn auth_error(failure: AuthFailure) -> Response {
    let status = match failure {
        AuthFailure::BadSignature => StatusCode::FORBIDDEN,
        _ => StatusCode::UNAUTHORIZED,
    };
    error(status, failure.message())
}

fn cluster_error(e: ClusterError) -> Response {
    let status = match &e {
        ClusterError::DuplicateWorker(_) => StatusCode::CONFLICT,
        ClusterError::UnknownLease(_) => StatusCode::NOT_FOUND,
        ClusterError::InvalidTtl(_) | ClusterError::InvalidWorkerId { .. } => StatusCode::BAD_REQUEST,
        ClusterError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
        ClusterError::Timeout(_) | ClusterError::Closed => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    error(status, e.to_string())
}

/// Checks the proof over `body`, parses it, and refuses a replay by `worker_of(body)`.
async fn authenticate<T: serde::de::DeserializeOwned>(
    registry: &EmbeddedRegistry,
    headers: &HeaderMap,
    method: &str,
    path: &str,
    body: &[u8],
    worker_of: impl FnOnce(&T) -> WorkerId,
) -> Result<T, Response> {
    let now = unix_millis();
    let header = headers.get(AUTH_HEADER).and_then(|v| v.to_str().ok());
    let ts = registry.secret().verify_request(header, method, path, now, body).map_err(auth_error)?.ts;
    let parsed: T = serde_json::from_slice(body)
        .map_err(|e| error(StatusCode::BAD_REQUEST, format!("invalid JSON body for {path}: {e}")))?;
    registry.check_replay(worker_of(&parsed), ts, now).await.map_err(cluster_error)?;
    Ok(parsed)
}

async fn register(State(registry): State<EmbeddedRegistry>, headers: HeaderMap, body: Bytes) -> Response {
    let request: RegisterRequest =
        match authenticate(&registry, &headers, "POST", REGISTER_PATH, &body, |r: &RegisterRequest| r.info.id.clone())
            .await
        {
            Ok(r) => r,
            Err(response) => return response,
        };
    let lease = EmbeddedRegistry::new_lease_id();
    let ttl = std::time::Duration::from_millis(request.ttl_ms);
    let worker = request.info.id.clone();
    match registry.apply(Command::Register { info: request.info, ttl, lease }).await {
        Ok(_) => {
            tracing::info!(worker = %worker, "worker registered");
            axum::Json(RegisterResponse { lease }).into_response()
        }
        Err(e) => cluster_error(e),
    }
}

async fn lease_route(
    registry: EmbeddedRegistry,
    headers: HeaderMap,
    body: Bytes,
    path: &str,
    command: fn(WorkerId, LeaseId) -> Command,
) -> Response {
    let request: LeaseRequest =
        match authenticate(&registry, &headers, "POST", path, &body, |r: &LeaseRequest| r.worker.clone()).await {
            Ok(r) => r,
            Err(response) => return response,
        };
    match registry.apply(command(request.worker, request.lease)).await {
        Ok(_) => StatusCode::OK.into_response(),
        Err(e) => cluster_error(e),
    }
}

async fn heartbeat(State(registry): State<EmbeddedRegistry>, headers: HeaderMap, body: Bytes) -> Response {
    lease_route(registry, headers, body, HEARTBEAT_PATH, |worker, lease| Command::Heartbeat { worker, lease }).await
}

async fn deregister(State(registry): State<EmbeddedRegistry>, headers: HeaderMap, body: Bytes) -> Response {
    lease_route(registry, headers, body, DEREGISTER_PATH, |worker, lease| Command::Deregister { worker, lease }).await
}

async fn members(State(registry): State<EmbeddedRegistry>, headers: HeaderMap) -> Response {
    let header = headers.get(AUTH_HEADER).and_then(|v| v.to_str().ok());
    if let Err(failure) = registry.secret().verify_request(header, "GET", MEMBERS_PATH, unix_millis(), b"") {
        return auth_error(failure);
    }
    match registry.snapshot().await {
        Ok(snapshot) => axum::Json::<MembersSnapshot>(snapshot).into_response(),
        Err(e) => cluster_error(e),
    }
}
