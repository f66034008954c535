//! What a policy sees ([`ClusterSnapshot`], [`Request`]) and what it answers ([`Decision`]).
//!
//! The conductor fills a snapshot from its registry and the workers' load reports; the simulator
//! fills the same struct from its virtual instances. Neither the snapshot nor the decision holds
//! anything live: both are plain data.

use baton_kv::{BlockHash, InstanceId, Tier};
use serde::{Deserialize, Serialize};

use crate::Micros;
use crate::cost::{CostProfile, Link};
use crate::trees::GlobalPromptTrees;

/// A request's id, unique within a conductor (or a simulation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId(pub u64);

/// A client session (an HTTP session, a conversation) for session affinity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SessionId(pub u64);

/// What an instance does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Role {
    /// Prefill only; hands KV to a decode instance.
    Prefill,
    /// Decode only; pulls KV from a prefill instance.
    Decode,
    /// Both, in one engine (vLLM-style).
    Colocated,
}

impl Role {
    /// Whether it takes prefills.
    pub fn prefills(self) -> bool {
        matches!(self, Role::Prefill | Role::Colocated)
    }

    /// Whether it takes decodes.
    pub fn decodes(self) -> bool {
        matches!(self, Role::Decode | Role::Colocated)
    }
}

/// Blocks used and available on one tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierUsage {
    /// Blocks in use (running requests and cache).
    pub used: u64,
    /// Blocks the tier holds.
    pub total: u64,
}

/// A sequence in an instance's running decode batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecodeSeq {
    /// When it joined the batch.
    pub started_at: Micros,
    /// Its tokens of context now.
    pub context: u64,
}

/// A request routed to a decode instance whose prefill (or transfer) has not finished yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IncomingSeq {
    /// When its KV is expected to be ready on the decode instance.
    pub ready_at: Micros,
    /// Its prompt length.
    pub context: u64,
}

/// One instance as the scheduler sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct InstanceSnapshot {
    /// Its id.
    pub id: InstanceId,
    /// Its role now.
    pub role: Role,
    /// Whether it takes new work (false while draining for a role change or leaving).
    pub accepting: bool,
    /// Requests waiting for prefill (including the one running).
    pub prefill_queue_len: u32,
    /// Estimated time until its prefill queue is empty (Mooncake's `EstimatePrefillQueueTime`:
    /// the sum of the queued prefills' predicted times plus what is left of the running one).
    pub queued_prefill_us: Micros,
    /// Its running decode batch.
    pub decode_running: Vec<DecodeSeq>,
    /// Requests waiting to join the decode batch (KV arrived, no room yet).
    pub decode_waiting: u32,
    /// Requests routed here for decode whose prefill is still running.
    pub decode_incoming: Vec<IncomingSeq>,
    /// KV blocks per tier, indexed by `Tier as usize` (device, host, disk).
    pub kv: [TierUsage; 3],
    /// NIC bandwidth, bytes per second (0: the cost profile's default).
    pub nic_bytes_per_s: u64,
}

impl InstanceSnapshot {
    /// A fresh idle instance (for tests and simple callers).
    pub fn idle(id: InstanceId, role: Role) -> Self {
        Self {
            id,
            role,
            accepting: true,
            prefill_queue_len: 0,
            queued_prefill_us: 0,
            decode_running: Vec::new(),
            decode_waiting: 0,
            decode_incoming: Vec::new(),
            kv: [TierUsage::default(); 3],
            nic_bytes_per_s: 0,
        }
    }

    /// Sequences in the running decode batch.
    pub fn decode_batch(&self) -> u64 {
        self.decode_running.len() as u64
    }

    /// Tokens of context in the running decode batch.
    pub fn decode_context(&self) -> u64 {
        self.decode_running.iter().map(|s| s.context).sum()
    }

    /// Usage of one tier.
    pub fn tier(&self, tier: Tier) -> TierUsage {
        self.kv[tier as usize]
    }
}

/// The cluster at one instant, as one scheduling decision needs it.
#[derive(Debug, Clone)]
pub struct ClusterSnapshot<'a> {
    /// Virtual or wall time of the snapshot.
    pub now: Micros,
    /// Every instance, in id order.
    pub instances: Vec<InstanceSnapshot>,
    /// Where KV blocks are cached (fed by KV events).
    pub trees: &'a GlobalPromptTrees,
    /// The cost model.
    pub cost: &'a CostProfile,
    /// Links that differ from the default (`min` of the two NICs): `(from, to, link)`.
    pub links: Vec<(InstanceId, InstanceId, Link)>,
}

impl ClusterSnapshot<'_> {
    /// The instance with this id.
    pub fn instance(&self, id: InstanceId) -> Option<&InstanceSnapshot> {
        self.instances.iter().find(|i| i.id == id)
    }

    /// Instances that take prefills now.
    pub fn prefill_pool(&self) -> impl Iterator<Item = &InstanceSnapshot> {
        self.instances.iter().filter(|i| i.accepting && i.role.prefills())
    }

    /// Instances that take decodes now.
    pub fn decode_pool(&self) -> impl Iterator<Item = &InstanceSnapshot> {
        self.instances.iter().filter(|i| i.accepting && i.role.decodes())
    }

    /// The link from one instance to another.
    pub fn link(&self, from: InstanceId, to: InstanceId) -> Link {
        if let Some(&(_, _, l)) = self.links.iter().find(|(f, t, _)| *f == from && *t == to) {
            return l;
        }
        let nic = |id| self.instance(id).map_or(0, |i| i.nic_bytes_per_s);
        let bw = match (nic(from), nic(to)) {
            (0, 0) => self.cost.network.bytes_per_s,
            (0, b) | (b, 0) => b,
            (a, b) => a.min(b),
        };
        Link { bytes_per_s: bw, latency_us: self.cost.network.latency_us }
    }
}

/// A request as the scheduler sees it: lengths and block keys, no text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Its id.
    pub id: RequestId,
    /// Prompt length, tokens.
    pub prompt_tokens: u64,
    /// Chained hashes of the prompt's blocks (`block_tokens` tokens each; the last may be partial).
    pub block_hashes: Vec<BlockHash>,
    /// Tokens per block.
    pub block_tokens: u64,
    /// Expected output length (max_tokens, or a prediction).
    pub expected_output: u64,
    /// Its session, if any.
    pub session: Option<SessionId>,
}

impl Request {
    /// Tokens covered by the first `blocks` blocks, leaving at least one token to compute (the
    /// last token's logits are needed to sample the first output token).
    pub fn cached_tokens(&self, blocks: usize) -> u64 {
        (blocks as u64 * self.block_tokens).min(self.prompt_tokens.saturating_sub(1))
    }
}

/// Blocks `start..end` of the request's prompt, to be reused from `from`'s cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reuse {
    /// The instance holding them (the prefill instance itself for a local hit).
    pub from: InstanceId,
    /// First block index.
    pub start: u32,
    /// One past the last block index.
    pub end: u32,
}

/// What the policy expects of a route.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Estimate {
    /// Predicted time to first token (queue + transfer + prefill).
    pub ttft_us: Micros,
    /// Predicted time between tokens on the decode instance, with this request in the batch.
    pub tbt_us: Micros,
}

/// Where a request runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// Prefill instance.
    pub prefill: InstanceId,
    /// Decode instance (equal to `prefill` on a colocated instance).
    pub decode: InstanceId,
    /// Cached blocks to reuse, in prompt order: a local span first, then remote spans.
    pub reuse: Vec<Reuse>,
    /// Keep the remote blocks fetched for this request in the prefill instance's cache (Mooncake's
    /// hot-spot migration: the hot prefix gets a replica).
    pub migrate: bool,
    /// What the policy predicted.
    pub estimate: Estimate,
}

impl Route {
    /// Blocks reused in all.
    pub fn reused_blocks(&self) -> u32 {
        self.reuse.iter().map(|r| r.end - r.start).sum()
    }
}

/// Why a request was turned away (HTTP 429).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum RejectReason {
    /// No instance can take it (none in a needed role, or none accepting).
    #[error("no instance can serve the request")]
    NoInstance,
    /// The predicted TTFT is over the SLO.
    #[error("predicted TTFT {predicted_us} µs exceeds the SLO of {slo_us} µs")]
    Ttft {
        /// Predicted TTFT.
        predicted_us: Micros,
        /// The SLO.
        slo_us: Micros,
    },
    /// The decode instance's (predicted) TBT is over the SLO.
    #[error("predicted TBT {predicted_us} µs exceeds the SLO of {slo_us} µs")]
    Tbt {
        /// Predicted TBT.
        predicted_us: Micros,
        /// The SLO.
        slo_us: Micros,
    },
}

/// A policy's answer for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Run it here.
    Route(Route),
    /// Turn it away.
    Reject {
        /// Why.
        reason: RejectReason,
    },
}

impl Decision {
    /// The route, if routed.
    pub fn route(&self) -> Option<&Route> {
        match self {
            Decision::Route(r) => Some(r),
            Decision::Reject { .. } => None,
        }
    }
}

/// Move an instance to another role (FlowKV's elastic P/D allocation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoleChange {
    /// The instance.
    pub instance: InstanceId,
    /// Its role now.
    pub from: Role,
    /// Its new role.
    pub to: Role,
}
