//! A worker's control API: what a conductor in another process calls.
//!
//! | route                        | body            | answer                                      |
//! |------------------------------|-----------------|---------------------------------------------|
//! | `POST /worker/v1/generate`   | [`WorkRequest`] | 200, then one [`RequestEvent`] per line (NDJSON) |
//! | `POST /worker/v1/release`    | [`ReleaseBody`] | 204                                         |
//! | `POST /worker/v1/export`     | [`ExportBody`]  | 200 [`KvSource`] (a cached prefix offered under a lease), 404 when none is cached |
//! | `POST /worker/v1/import`     | [`ImportBody`]  | 200 [`Received`] once a peer's KV is in the prefix cache, 404 when none arrived |
//! | `POST /worker/v1/role`       | [`RoleBody`]    | 204 once the worker is routed as the new role (elastic prefill/decode) |
//! | `GET /worker/v1/stats`       | none            | 200 [`WorkerStats`]                         |
//! | `GET /worker/v1/state`       | none            | 200, then a stream of [`StateUpdate`]s, a snapshot first: binary frames ([`state_codec`]) when `Accept` lists `application/x-baton-state-v1`, one JSON update a line (NDJSON) otherwise |
//!
//! The conductor reads the state stream in the binary encoding (a tenth of the bytes, several
//! times faster to decode); NDJSON stays for a person with `curl` (and for a conductor that
//! predates the encoding).
//!
//! Every request proves the cluster secret with the `x-baton-cluster-auth` header (an HMAC over
//! method, path, timestamp and body, see [`baton_cluster::auth`]); without it the answer is 401.
//! Closing the generate response's connection aborts the request and frees its KV.
//!
//! [`WorkRequest`]: crate::wire::WorkRequest
//! [`RequestEvent`]: crate::wire::RequestEvent
//! [`WorkerStats`]: crate::wire::WorkerStats
//! [`StateUpdate`]: crate::wire::StateUpdate
//! [`ReleaseBody`]: crate::wire::ReleaseBody
//! [`RoleBody`]: crate::wire::RoleBody
//! [`ExportBody`]: crate::wire::ExportBody
//! [`ImportBody`]: crate::wire::ImportBody
//! [`Received`]: crate::wire::Received
//! [`KvSource`]: crate::wire::KvSource
//! [`state_codec`]: crate::state_codec

/// Path of the generate route.
pub const GENERATE_PATH: &str = "/worker/v1/generate";
/// The longest a generate stream stays silent: a blank line comes after this long without an
/// event (the conductor's idle deadline on a worker's stream is several of these).
pub const KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(2);
/// Path of the release route.
pub const RELEASE_PATH: &str = "/worker/v1/release";
/// Path of the export route (a cached prefix offered to a peer that fetches it).
pub const EXPORT_PATH: &str = "/worker/v1/export";
/// How long the worker's engine thread may take to answer an export (it answers between steps).
pub const EXPORT_DEADLINE: std::time::Duration = std::time::Duration::from_secs(2);
/// Path of the import route (a peer's KV pulled into the prefix cache).
pub const IMPORT_PATH: &str = "/worker/v1/import";
/// How long an import may take, waiting for room and pulling.
pub const IMPORT_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);
/// Path of the role route (the conductor switches the worker's role).
pub const ROLE_PATH: &str = "/worker/v1/role";
/// Path of the stats route.
pub const STATS_PATH: &str = "/worker/v1/stats";
/// Path of the state stream's route.
pub const STATE_PATH: &str = "/worker/v1/state";
/// Path of the liveness probe (unauthenticated, no body of interest: the process serves HTTP).
pub const LIVE_PATH: &str = "/worker/v1/live";
/// Path of the readiness probe (unauthenticated): 200 while the worker takes work, 503 while it
/// drains or its engine does not answer; what Kubernetes' readiness probe asks.
pub const READY_PATH: &str = "/worker/v1/ready";

pub use crate::wire::{ExportBody, ImportBody, ReleaseBody, RoleBody};
