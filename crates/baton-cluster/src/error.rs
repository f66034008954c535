//! The crate's error type.

use crate::types::WorkerId;

/// Everything that can go wrong in membership.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// A worker id that cannot be used.
    #[error("invalid worker id {id:?}: {reason}")]
    InvalidWorkerId {
        /// The rejected id.
        id: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A `--registry` value that does not parse.
    #[error("invalid --registry {value:?}: {reason} (expected `embedded`, `http://HOST:PORT` or `etcd://HOST:PORT`)")]
    InvalidRegistryUrl {
        /// The rejected value.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The cluster secret is unusable (empty).
    #[error("invalid cluster secret: {0}")]
    InvalidSecret(String),
    /// The registry refused the request: the worker does not hold the cluster secret, or its
    /// proof is stale or replayed.
    #[error("refused by the registry: {0} (does this worker have the cluster secret?)")]
    Unauthorized(String),
    /// A worker with this id is already a live member.
    #[error("worker {0} is already registered; pick another id or wait for its lease to expire")]
    DuplicateWorker(WorkerId),
    /// The lease is unknown to the registry: it expired, or was deregistered.
    #[error("lease of worker {0} is unknown to the registry (expired or deregistered)")]
    UnknownLease(WorkerId),
    /// A TTL the registry cannot use.
    #[error("invalid lease TTL: {0}")]
    InvalidTtl(String),
    /// The registry (its task, HTTP endpoint or etcd) did not answer in time.
    #[error("registry timed out: {0}")]
    Timeout(String),
    /// The embedded registry's task has stopped.
    #[error("the embedded registry has shut down")]
    Closed,
    /// A transport failure talking to a remote registry.
    #[error("registry transport error: {0}")]
    Transport(String),
    /// The remote registry answered something unexpected.
    #[error("registry protocol error: {0}")]
    Protocol(String),
    /// An error from etcd.
    #[error("etcd: {0}")]
    Etcd(String),
    /// `--registry etcd://...` on a binary built without the `etcd` feature.
    #[error(
        "this build of Baton has no etcd support: rebuild with `--features etcd` (e.g. `cargo build --release \
         --features etcd`; etcd-client's build needs `protoc`), or use the embedded registry \
         (`--registry http://CONDUCTOR:PORT`)"
    )]
    EtcdNotBuilt,
}

impl ClusterError {
    /// Whether the same call may succeed later without anything changing on this side: the
    /// registry could not be reached or did not answer in time, or a member under this id has
    /// not lapsed yet. A worker joining again retries these and gives up on the others.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            ClusterError::Timeout(_)
                | ClusterError::Transport(_)
                | ClusterError::Etcd(_)
                | ClusterError::DuplicateWorker(_)
        )
    }
}

impl From<reqwest::Error> for ClusterError {
    fn from(e: reqwest::Error) -> Self {
        if e.is_timeout() { ClusterError::Timeout(e.to_string()) } else { ClusterError::Transport(e.to_string()) }
    }
}
