//! What Baton's conductor and workers share, and nothing else: what travels between them
//! ([`wire`]: a request's work, its events, KV sources, load reports, KV events), the
//! [`Worker`] trait through which the conductor drives a worker wherever it runs, the worker's
//! control API's routes and deadlines ([`control`]), the state stream's binary encoding and its
//! bounded readers ([`state_codec`]), the errors both sides answer with ([`error`]), and the
//! HTTP serving ([`http`]) and back-off ([`retry`]) both use.
//!
//! Dependencies go one way: `baton-worker` and `baton-conductor` depend on this crate, the
//! conductor on the worker (to run workers in its own process), never the reverse.

pub mod control;
pub mod error;
pub mod http;
pub mod retry;
pub mod state_codec;
pub mod wire;
pub mod worker;

pub use error::ApiError;
pub use wire::{
    Finish, KvCopyBytes, KvSource, KvTransfer, RequestEvent, Role, StateUpdate, WorkRequest, WorkerError, WorkerStats,
};
pub use worker::{Worker, kv_exchangeable};
