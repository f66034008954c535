//! A Baton worker: one engine on a thread of its own, driven through a [`WorkerHandle`].
//!
//! [`session`] is the per-request state machine (events in, actions out; the engine thread is
//! its driver), [`worker`] owns the engine thread, the KV server and the transfer threads,
//! [`handoff`] moves a request's KV between workers (pulled, pushed, or pushed layer by layer),
//! and [`control`] serves the worker's control API to a conductor in another process. What a
//! worker shares with the conductor (the wire types, the `Worker` trait) is `baton-protocol`.

pub mod control;
pub mod handoff;
pub mod session;
pub mod worker;

pub use handoff::TransportChoice;
pub use worker::{RoleSwitchRefused, WorkerHandle, WorkerOptions};
