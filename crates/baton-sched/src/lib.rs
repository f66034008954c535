//! Baton's global scheduler: pure decisions over a snapshot of the cluster.
//!
//! Nothing in this crate does I/O, reads a clock or owns a random number generator: the
//! conductor (live) and `baton-sim` (virtual time) fill a [`ClusterSnapshot`], describe the
//! request as a [`Request`], pass their own RNG, and get a [`Decision`] back. The same inputs
//! give the same decision in both.
//!
//! The pieces:
//!
//! - [`CostProfile`]: MemServe's operator-level cost model — [`CostProfile::prefill_time`]
//!   `(x, y)`, [`CostProfile::decode_step`], [`transfer_time`] — fitted from samples
//!   ([`fit_prefill`], [`fit_decode`]) or from published hardware figures.
//! - [`GlobalPromptTrees`]: which instance caches which blocks, fed by `baton-kv`'s
//!   [`KvEvent`](baton_kv::KvEvent)s, with a TTL for the scheduler's own unconfirmed predictions.
//! - [`policy`]: round-robin, random, least-load, session affinity, MemServe's prompt tree,
//!   Mooncake's Algorithm 1 ([`KvCentric`]), FlowKV's [`LoadAware`] with role switching.
//! - [`admission`]: none, Mooncake's baseline, early rejection, prediction-based early rejection.
//! - [`Scheduler`]: a policy plus an admission control; [`Scheduler::decide`] is the one call
//!   per request, for the simulator and the conductor alike. It reads the trees and writes
//!   nothing shared: the prompt a route expects cached is a [`Predict`] ([`Predict::of`]), which
//!   the caller applies to the trees once it sends the request.
//! - [`WorkerLoad`] and [`ClusterSnapshot::from_workers`]: how both build the snapshot from
//!   per-worker figures (the conductor from load reports and its own routing records, the
//!   simulator from its virtual instances), with [`GlobalPromptTrees`] fed by KV events.
//!
//! ```
//! use baton_kv::{BlockHash, InstanceId};
//! use baton_sched::*;
//! use rand::SeedableRng;
//!
//! let cost = CostProfile::llama2_70b_8xa800();
//! let mut trees = GlobalPromptTrees::new(60_000_000);
//! let instances = vec![
//!     InstanceSnapshot::idle(InstanceId(0), Role::Prefill),
//!     InstanceSnapshot::idle(InstanceId(1), Role::Prefill),
//!     InstanceSnapshot::idle(InstanceId(2), Role::Decode),
//! ];
//! for i in &instances {
//!     trees.set_role(i.id, i.role);
//! }
//! // Instance 1 caches the first two blocks of the prompt (as its KV events said).
//! let hashes = vec![BlockHash(7), BlockHash(8), BlockHash(9)];
//! trees.predict(InstanceId(1), &hashes[..2], 0);
//!
//! let snap = ClusterSnapshot { now: 0, instances, trees: &trees, cost: &cost, links: vec![], kv_fetch: true, decode_affinity: false };
//! let req = Request {
//!     id: RequestId(1),
//!     prompt_tokens: 1400,
//!     block_hashes: hashes,
//!     block_tokens: 512,
//!     expected_output: 100,
//!     session: None,
//! };
//! let mut sched = Scheduler::new(PolicyKind::KvCentric.build(&PolicyConfig::default()), AdmissionConfig::default());
//! let mut rng = rand::rngs::StdRng::seed_from_u64(1);
//! let route = sched.decide(&snap, &req, &mut rng).route().cloned().expect("routed");
//! assert_eq!((route.prefill, route.decode), (InstanceId(1), InstanceId(2)));
//! assert_eq!(route.reused_blocks(), 2);
//! ```

pub mod admission;
mod cost;
mod fit;
pub mod policy;
mod role;
mod snapshot;
mod trees;

/// Time in integer microseconds (virtual or wall; the caller decides).
pub type Micros = u64;

pub use admission::{
    AdmissionConfig, AdmissionKind, DEFAULT_TBT_HEADROOM, DecodeCheck, Scheduler, Slo, admit, decode_check,
    predicted_peak_tbt, predicted_tbt_at,
};
pub use cost::{CostProfile, DecodeCoeffs, Link, PrefillCoeffs, transfer_time};
pub use fit::{DecodeSample, FitError, PrefillSample, fit_decode, fit_error, fit_prefill};
pub use policy::{
    KvCentric, LeastLoad, LoadAware, LoadAwareConfig, MAX_PACE, MIN_PACE, Policy, PolicyConfig, PolicyKind, PromptTree,
    RandomPolicy, RoundRobin, SessionAffinity,
};
pub use snapshot::{
    ClusterSnapshot, Decision, DecodeSeq, Estimate, HandOff, IncomingSeq, IncomingSeqs, InstanceSnapshot, Ledger,
    PendingPrefill, RejectReason, Request, RequestId, Reuse, Role, RoleChange, Route, SessionId, TierUsage, WorkerLoad,
};
pub use trees::{BlockUpdate, GlobalPromptTrees, InstancePrefix, Predict};
