//! Cluster membership for Baton: workers join and leave at run time, and the conductor (and
//! any worker that cares) watches them come and go.
//!
//! One trait, [`Registry`], with two backends:
//!
//! - **Embedded** (the default, no external service): an [`EmbeddedRegistry`] task inside the
//!   conductor, whose pure core is a [`MembershipTable`] (commands and expiry at a time passed
//!   in). Workers in other processes reach it through the `/cluster/*` routes of [`router`]
//!   with a [`RemoteRegistryClient`] (`--registry http://conductor:port`).
//! - **etcd** (`--registry etcd://HOST:PORT`): an [`EtcdRegistry`], with etcd leases for
//!   liveness and a prefix watch for joins and departures. Behind the cargo feature `etcd`
//!   (etcd-client's build needs `protoc`); without it [`EtcdRegistry`] is a stub whose `connect`
//!   fails with [`ClusterError::EtcdNotBuilt`], so callers never see a `cfg`.
//!
//! A registration returns a [`Lease`] that heartbeats in the background; a worker that stops
//! heartbeating is reported `Left(LeaseExpired)` once its TTL passes. Every registration proves
//! the shared [`ClusterSecret`] (an HMAC, see [`auth`]); a worker without it is refused.
//!
//! ```no_run
//! use std::time::Duration;
//! use baton_cluster::{ClusterSecret, EmbeddedRegistry, KvSummary, MembershipEvent, Registry, Role, WorkerId, WorkerInfo};
//!
//! # async fn example() -> Result<(), baton_cluster::ClusterError> {
//! let secret = ClusterSecret::new("from --cluster-secret")?;
//! // Conductor: the registry, its HTTP routes (merged into the app) and a watch.
//! let registry = EmbeddedRegistry::start(secret.clone());
//! let _routes: axum::Router = baton_cluster::router(registry.clone());
//! let mut watch = registry.watch().await?;
//!
//! // Worker (here in-process; remotely, `baton_cluster::connect(&"http://conductor:8000".parse()?, secret)`).
//! let info = WorkerInfo {
//!     id: WorkerId::new("prefill-0")?,
//!     role: Role::Prefill,
//!     control_url: "http://127.0.0.1:9001".into(),
//!     kv_addr: "127.0.0.1:9101".into(),
//!     model: "gemma-3-270m".into(),
//!     kv: KvSummary { num_layers: 18, num_kv_heads: 1, head_dim: 256, block_tokens: 16, dtype: "f32".into() },
//!     capacity_blocks: 4096,
//!     started_at_ms: baton_cluster::unix_millis(),
//! };
//! let lease = registry.register(info, Duration::from_secs(3)).await?;
//! assert!(matches!(watch.recv().await, Some(MembershipEvent::Joined(_))));
//! registry.deregister(lease).await?;
//! # Ok(()) }
//! ```

pub mod auth;
mod config;
mod connect;
mod embedded;
#[cfg(feature = "etcd")]
mod etcd;
#[cfg(not(feature = "etcd"))]
#[path = "etcd_stub.rs"]
mod etcd;
mod http;
mod registry;
mod remote;
pub mod table;
mod types;

pub use auth::{AUTH_HEADER, AuthFailure, ClusterSecret, ProofId, SeenProofs};
pub use config::{DEFAULT_CLUSTER, EtcdConfig, RegistryConfig};
pub use connect::{connect, connect_with_ca};
pub use embedded::{EmbeddedRegistry, MembersSnapshot};
pub use etcd::{EtcdOptions, EtcdRegistry};
pub use http::{
    DEREGISTER_PATH, ErrorBody, HEARTBEAT_PATH, LeaseRequest, MEMBERS_PATH, REGISTER_PATH, RegisterRequest,
    RegisterResponse, router,
};
pub use registry::{Lease, LeaseStatus, MembershipWatch, Registry};
pub use remote::{RemoteOptions, RemoteRegistryClient};
pub use table::{LeaseId, MembershipTable};
pub use types::{
    ClusterError, KvSummary, LeftReason, MAX_WORKER_ID_LEN, MembershipEvent, Role, WorkerId, WorkerInfo, unix_millis,
};
