//! What the cluster knows about a worker: its id, role, addresses and KV capacity, and the
//! membership events a watcher receives.
//!
//! [`ClusterError`], everything membership can fail with, is here too: it names worker ids, and a
//! worker id's validation fails with it.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// Longest accepted worker id, in bytes.
pub const MAX_WORKER_ID_LEN: usize = 128;

/// A worker's name in the cluster, unique among live members.
///
/// Ids appear in etcd keys and HTTP bodies, so they are restricted to ASCII letters, digits,
/// `.`, `_`, `-` and `:` (1 to [`MAX_WORKER_ID_LEN`] bytes).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct WorkerId(String);

impl WorkerId {
    /// Validates `id` into a worker id.
    pub fn new(id: impl Into<String>) -> Result<Self, ClusterError> {
        let id = id.into();
        if id.is_empty() || id.len() > MAX_WORKER_ID_LEN {
            return Err(ClusterError::InvalidWorkerId {
                id,
                reason: format!("must be 1 to {MAX_WORKER_ID_LEN} bytes long"),
            });
        }
        if let Some(c) = id.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':'))) {
            return Err(ClusterError::InvalidWorkerId {
                id,
                reason: format!("character {c:?} is not allowed (use letters, digits, '.', '_', '-', ':')"),
            });
        }
        Ok(Self(id))
    }

    /// The id as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for WorkerId {
    type Error = ClusterError;

    fn try_from(id: String) -> Result<Self, Self::Error> {
        Self::new(id)
    }
}

impl From<WorkerId> for String {
    fn from(id: WorkerId) -> Self {
        id.0
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

pub use baton_sched::Role;

/// The shape of a worker's KV cache, enough for a peer to check that blocks are compatible
/// before pulling them (the full tensor descriptor is exchanged by the transfer protocol).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvSummary {
    /// Transformer layers.
    pub num_layers: u32,
    /// KV heads per layer.
    pub num_kv_heads: u32,
    /// Dimension of one head.
    pub head_dim: u32,
    /// Tokens per KV block.
    pub block_tokens: u32,
    /// Element type of the cache, e.g. `"f32"`, `"f16"`, `"bf16"`.
    pub dtype: String,
}

impl fmt::Display for KvSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} KV: {} layers, {} KV heads of {}, {}-token blocks",
            self.dtype, self.num_layers, self.num_kv_heads, self.head_dim, self.block_tokens
        )
    }
}

/// A worker's registration: who it is and where to reach it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// Unique id among live members.
    pub id: WorkerId,
    /// Prefill, decode or colocated.
    pub role: Role,
    /// Base URL of the worker's control API, e.g. `http://10.0.0.5:9001`.
    pub control_url: String,
    /// Address (`host:port`) of the worker's KV server, which peers pull blocks from.
    pub kv_addr: String,
    /// The model the worker serves (as `/v1/models` names it).
    pub model: String,
    /// Shape of the worker's KV cache.
    pub kv: KvSummary,
    /// KV blocks the worker's pool holds in its fastest tier.
    pub capacity_blocks: u64,
    /// When the worker started, in milliseconds since the Unix epoch.
    pub started_at_ms: u64,
}

/// Why a worker left the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LeftReason {
    /// The worker said goodbye.
    Deregistered,
    /// No heartbeat arrived within the lease's TTL: the worker is presumed dead.
    LeaseExpired,
}

/// A change in membership, as a watcher sees it.
///
/// A new watcher first receives one `Joined` per current member, then changes in the order
/// the registry applied them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MembershipEvent {
    /// A worker joined (or was already a member when the watch began).
    Joined(WorkerInfo),
    /// A worker left.
    Left(WorkerId, LeftReason),
}

/// Milliseconds since the Unix epoch, from the wall clock.
pub fn unix_millis() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_ids_are_validated() {
        assert!(WorkerId::new("prefill-0").is_ok());
        assert!(WorkerId::new("host.example:9001_a").is_ok());
        assert!(WorkerId::new("").is_err());
        assert!(WorkerId::new("a/b").is_err());
        assert!(WorkerId::new("x".repeat(MAX_WORKER_ID_LEN + 1)).is_err());
        let bad: Result<WorkerId, _> = serde_json::from_str("\"a b\"");
        assert!(bad.is_err());
        let good: WorkerId = serde_json::from_str("\"d1\"").expect("valid id");
        assert_eq!(good.as_str(), "d1");
    }
}
