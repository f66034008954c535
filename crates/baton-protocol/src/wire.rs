//! What travels between the conductor and its workers, in one place: in process over channels,
//! between processes as JSON over the control API ([`crate::control`]), the state stream's
//! [`StateUpdate`]s in a binary encoding of their own ([`crate::state_codec`]) when asked. Every type here is
//! serialisable and is the same value on both sides, so a request is never flattened on one side
//! and rebuilt on the other.
//!
//! - [`WorkRequest`]: one request as a worker receives it (prompt, tokens generated upstream,
//!   [`SamplingParams`], [`StopParams`], the hand-off's KV).
//! - [`RequestEvent`]: what a request produces, in order: tokens, then exactly one `Finished`,
//!   `Failed` or `Lost`.
//! - [`WorkerError`]: why a worker could not run a request, in the worker's terms. The conductor
//!   maps it to an HTTP status and an OpenAI error body at its edge
//!   (`impl From<WorkerError> for ApiError` in [`crate::error`]), never the worker.
//! - [`WorkerStats`], [`KvSource`], [`KvTransfer`], [`ReleaseBody`], [`ExportBody`].

use std::net::SocketAddr;

use baton_engine::{FinishReason, StopParams};
use baton_model::{SamplingParams, TokenLogprobs};
use serde::{Deserialize, Serialize};

/// A worker's role: the cluster's, so registry, routing and workers share one type.
pub use baton_cluster::Role;

/// KV a prefill worker holds for a request under a lease, and where its KV server is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvSource {
    /// The holder's KV server.
    pub addr: SocketAddr,
    /// The holder's blocks, in token order.
    pub blocks: Vec<u32>,
    /// Tokens they hold.
    pub tokens: usize,
    /// The transfer id the holder offers them under, when it is not the request's own (a
    /// cached prefix exported for a fetch: [`Worker::export_prefix`](crate::Worker::export_prefix)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<u64>,
}

/// The transfer id of a prefix exported for request `id` (a fetch): request ids stay below
/// 2^63, so a fetch's lease never shares a holder's id space with a request it runs.
pub fn fetch_lease(id: u64) -> u64 {
    id | 1 << 63
}

/// The transfer id under which a decode worker offers request `id`'s KV back to a prefill
/// worker (PD-Caching-3), and the id of the import there: distinct from the request's own and
/// from its fetch's.
pub fn return_lease(id: u64) -> u64 {
    id | 3 << 62
}

/// How KV moves from the prefill worker to the decode worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvTransfer {
    /// The decode worker reads the prefill worker's leased blocks into blocks it reserved.
    #[default]
    Pull,
    /// The decode worker reserves blocks and registers them; the prefill worker writes into
    /// them once the prefill is done.
    Push,
    /// Push, overlapped with the prefill: the conductor hands the decode worker the request
    /// when it hands the prefill worker the prompt; the decode worker reserves and registers
    /// its blocks at once, and the prefill worker writes each layer of each chunk's KV into
    /// them as its forward pass computes it, the last write carrying the first token
    /// (Mooncake §4, KVDirect §4).
    Layerwise,
}

impl KvTransfer {
    /// The mode of a hand-off that begins once the prefill is done: a layer-wise push cannot
    /// overlap a prefill that is over, so it is pulled from the prefill worker's lease.
    pub fn after_prefill(self) -> Self {
        match self {
            KvTransfer::Layerwise => KvTransfer::Pull,
            mode => mode,
        }
    }

    /// The name on the command line and in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            KvTransfer::Pull => "pull",
            KvTransfer::Push => "push",
            KvTransfer::Layerwise => "layerwise",
        }
    }
}

impl std::str::FromStr for KvTransfer {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "pull" => Ok(Self::Pull),
            "push" => Ok(Self::Push),
            "layerwise" => Ok(Self::Layerwise),
            other => Err(format!("unknown KV transfer mode `{other}` (expected pull, push or layerwise)")),
        }
    }
}

/// What a worker is asked to do with a request: one value per part, so a request cannot ask for
/// an impossible mix (a decode that also retains its KV for a hand-off, a fetch into received
/// KV).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "part", rename_all = "snake_case", deny_unknown_fields)]
pub enum Work {
    /// Compute the prompt and generate to the end (colocated, a migrated request, the lone-role
    /// fallback), first pulling the prompt's cached prefix from the peer `fetch` names, if any
    /// (a fetch that fails recomputes the prefix: it never fails the request).
    Whole {
        /// A cached prefix of the prompt that a peer holds.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fetch: Option<KvSource>,
    },
    /// Compute the prompt and the first token (the conductor sends `max_tokens` 1) and keep the
    /// request's KV for its decode worker, handed over as `handoff` says: offered under a lease
    /// for a pull, pushed once the decode worker registers its blocks, or pushed layer by layer
    /// as the prompt computes.
    Prefill {
        /// A cached prefix of the prompt that a peer holds, pulled first.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fetch: Option<KvSource>,
        /// How the KV leaves.
        handoff: KvTransfer,
    },
    /// Receive the request's KV from `source` — pulled, or pushed into blocks this worker
    /// reserves and registers (`mode`) — then generate from the tokens the request carries.
    Decode {
        /// The holder's KV (a layer-wise push names no blocks: the prefill has not started).
        source: KvSource,
        /// How it arrives.
        mode: KvTransfer,
    },
}

impl Work {
    /// The part's name, for logs.
    pub fn part(&self) -> &'static str {
        match self {
            Work::Whole { .. } => "whole",
            Work::Prefill { .. } => "prefill",
            Work::Decode { .. } => "decode",
        }
    }

    /// The cached prefix to fetch before computing the prompt, if any.
    pub fn fetch(&self) -> Option<&KvSource> {
        match self {
            Work::Whole { fetch } | Work::Prefill { fetch, .. } => fetch.as_ref(),
            Work::Decode { .. } => None,
        }
    }
}

impl Default for Work {
    /// The whole request, nothing fetched.
    fn default() -> Self {
        Work::Whole { fetch: None }
    }
}

/// One request as a worker receives it, locally or over the control API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkRequest {
    /// Unique among the conductor's requests; also the KV transfer's id.
    pub id: u64,
    /// The client's `x-request-id` (or the conductor's own), for the worker's logs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens already generated elsewhere (the prefill worker's first token, or what a lost
    /// worker streamed before a migration).
    #[serde(default)]
    pub generated: Vec<u32>,
    /// How to sample (the sampler sees `prompt` and `generated` too, so a decode worker
    /// continues with the prefill worker's penalties).
    #[serde(default)]
    pub sampling: SamplingParams,
    /// When to stop; `max_tokens` counts `generated`.
    #[serde(default)]
    pub stop: StopParams,
    /// Report each token's log-probability and the `n` most likely tokens' (`Some(n)`).
    #[serde(default)]
    pub logprobs: Option<usize>,
    /// Tokens that end the request (their text left out).
    #[serde(default)]
    pub stop_token_ids: Vec<u32>,
    /// The worker's part of the request: the whole of it, its prefill, or its decode (and with
    /// it, where the KV comes from and how it leaves).
    #[serde(default)]
    pub work: Work,
    /// Whether the worker takes the prompt's cached prefix and caches the request's KV when it
    /// ends (`false`: MemServe's PD-Basic, [`PdCaching::Basic`]).
    #[serde(default = "yes", skip_serializing_if = "is_yes")]
    pub prefix_cache: bool,
}

fn yes() -> bool {
    true
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's `skip_serializing_if` passes a reference.
fn is_yes(b: &bool) -> bool {
    *b
}

/// Where a disaggregated cluster keeps past requests' KV (MemServe's §5 modes; `--pd-caching`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum PdCaching {
    /// PD-Basic: nowhere; every prompt is computed whole.
    Basic,
    /// PD-Caching-1: prefill workers cache prompts; a later prompt computes only what its
    /// prefill worker lacks.
    Prefill,
    /// PD-Caching-2: decode workers also keep finished requests' KV (a session's history, the
    /// answers included); a session's next turn is routed to the decode worker holding it when
    /// that worker is about as fast as the fastest, and the hand-off moves only the blocks the
    /// decode side lacks.
    Decode,
    /// PD-Caching-3: PD-Caching-2, and after each request its decode worker sends the blocks
    /// the prefill worker lacks (the answer) back into that worker's cache, so the session's
    /// next prompt is computed after its whole history. The default: on the CPU it gave the
    /// lowest JCT and TTFT of the four (`scripts/pd-caching.sh`).
    #[default]
    Return,
}

impl PdCaching {
    /// The mode's number, as on the command line and in MemServe.
    pub fn number(self) -> u8 {
        self as u8
    }
}

impl WorkRequest {
    /// A greedy request for `prompt` with default stop parameters (tests and tools build on it).
    pub fn new(id: u64, prompt: Vec<u32>) -> Self {
        Self {
            id,
            request_id: None,
            prompt,
            generated: Vec::new(),
            sampling: SamplingParams::default(),
            stop: StopParams::default(),
            logprobs: None,
            stop_token_ids: Vec::new(),
            work: Work::default(),
            prefix_cache: true,
        }
    }

    /// The span of this request's work on a worker and in its KV transfer.
    pub fn span(&self, worker: &str, role: Role) -> tracing::Span {
        let request_id = self.request_id.as_deref().unwrap_or_default();
        tracing::info_span!("work", request_id, request = self.id, worker, role = role.as_str())
    }
}

/// KV a worker received for a request from a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Received {
    /// Tokens of KV.
    pub tokens: usize,
    /// Bytes moved.
    pub bytes: u64,
    /// How long the transfer took, µs.
    pub micros: u64,
    /// The transport that moved it (`None` from a worker that does not say).
    #[serde(default)]
    pub transport: Option<baton_transfer::TransportKind>,
}

/// Why a request ended, as it travels between processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    /// End-of-sequence token.
    Eos,
    /// `max_tokens` or the context length.
    Length,
    /// A stop string.
    Stop,
    /// Aborted.
    Aborted,
    /// The output's grammar failed mid-generation: the conductor ends the request with an
    /// error, never as a complete output.
    GrammarFailed,
}

impl From<FinishReason> for Finish {
    fn from(r: FinishReason) -> Self {
        match r {
            FinishReason::Eos => Finish::Eos,
            FinishReason::Length => Finish::Length,
            FinishReason::Stop => Finish::Stop,
            FinishReason::Aborted => Finish::Aborted,
            FinishReason::GrammarFailed => Finish::GrammarFailed,
        }
    }
}

impl Finish {
    /// The OpenAI API's name for it.
    pub fn as_openai(self) -> &'static str {
        match self {
            Finish::Eos | Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::Aborted => "abort",
            Finish::GrammarFailed => "error",
        }
    }
}

/// Why a worker could not run a request, in the worker's terms (no HTTP here).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[serde(tag = "kind", content = "message", rename_all = "snake_case")]
pub enum WorkerError {
    /// The engine refused the request as invalid: the client's to fix.
    #[error("{0}")]
    InvalidRequest(String),
    /// The request asks this worker for what its role cannot do (a prefill worker handed KV,
    /// a worker without a transfer thread): the conductor's mistake.
    #[error("{0}")]
    WrongRole(String),
    /// The engine failed while running the request (a bug or a model failure).
    #[error("the engine failed: {0}")]
    Engine(String),
    /// The request could not be handed to the worker or its answer could not be read (an
    /// encoding error, an unexpected answer from a remote worker).
    #[error("{0}")]
    Protocol(String),
    /// A layer-wise hand-off did not arrive (the prefill worker failed, or the decode worker
    /// had no room for it in time). The decode worker has not the first token to recompute
    /// from, so it gives the request back: the conductor sends it again, with the first token.
    #[error("the layer-wise KV hand-off failed: {0}")]
    Handoff(String),
}

impl From<baton_engine::EngineError> for WorkerError {
    fn from(e: baton_engine::EngineError) -> Self {
        match e {
            baton_engine::EngineError::InvalidRequest(m) => Self::InvalidRequest(m),
            other => Self::Engine(other.to_string()),
        }
    }
}

/// What a request produces, in order: tokens, then one `Finished`, `Failed` or `Lost`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum RequestEvent {
    /// A generated token and the text it makes visible.
    Token {
        /// The token.
        token: u32,
        /// Text delta.
        text: String,
        /// Its log-probabilities, when the request asked for them.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        logprobs: Option<TokenLogprobs>,
    },
    /// The request ended.
    Finished {
        /// Why.
        reason: Finish,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Prompt tokens served from cached or transferred KV.
        cached_tokens: usize,
        /// Generated tokens (upstream ones included).
        completion_tokens: usize,
        /// KV kept for a hand-off (prefill role), leased until pulled or released.
        kv: Option<KvSource>,
        /// The KV this worker received for the request before computing (a hand-off or a
        /// fetched prefix); `None` when it received none, or recomputed what did not arrive.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        received: Option<Received>,
    },
    /// The request could not run.
    Failed(WorkerError),
    /// The worker went away (crashed, draining, left the cluster, unreachable): the request may
    /// be run elsewhere.
    Lost {
        /// Why, for the logs.
        reason: String,
    },
}

impl RequestEvent {
    /// Whether this event ends the request.
    pub fn is_last(&self) -> bool {
        !matches!(self, RequestEvent::Token { .. })
    }
}

/// Load and memory figures of a worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerStats {
    /// Requests running.
    pub running: usize,
    /// Requests waiting.
    pub waiting: usize,
    /// Requests whose KV is being pulled in or pushed here.
    pub pulling: usize,
    /// Blocks allocatable now (free or merely cached).
    pub available_blocks: usize,
    /// Blocks in the arena.
    pub total_blocks: usize,
    /// KV handed off and not yet released.
    pub leased: usize,
    /// KV waiting for room to be received: hand-offs, fetched prefixes and imports.
    #[serde(default)]
    pub incoming: usize,
    /// The worker is draining: it finishes what it holds and takes nothing new.
    #[serde(default)]
    pub draining: bool,
    /// KV blocks that failed their checksum since the worker started: read back from its host
    /// or disk tier, or received over TCP. Each was dropped and its tokens computed again.
    #[serde(default)]
    pub corrupt_blocks: u64,
    /// Bytes copied into and out of the worker's device arena since it started, by direction.
    #[serde(default)]
    pub kv_copy_bytes: KvCopyBytes,
}

/// Bytes copied into and out of a worker's device arena, by direction (`baton_kv::CopyMeter`'s
/// counters): what `/metrics` exports as `baton_kv_copy_bytes_total{worker, direction}`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCopyBytes {
    /// Out of the device arena into host memory: tier demotions, sends, a device's write-back.
    pub device_to_host: u64,
    /// From host memory into the device arena: swap-ins, receives, a device's uploads.
    pub host_to_device: u64,
    /// Between device arenas (same-host hand-offs over a device link).
    pub device_to_device: u64,
}

impl WorkerStats {
    /// Nothing in flight and every block allocatable: what a quiet worker must report.
    pub fn is_quiet(&self) -> bool {
        self.is_idle() && self.available_blocks == self.total_blocks
    }

    /// Nothing in flight: no request running, waiting, receiving or holding a lease.
    pub fn is_idle(&self) -> bool {
        self.running == 0 && self.waiting == 0 && self.pulling == 0 && self.incoming == 0 && self.leased == 0
    }
}

/// Body of the control API's `POST /worker/v1/role`: switch the worker's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoleBody {
    /// The new role.
    pub role: Role,
}

/// Body of the control API's `POST /worker/v1/release`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseBody {
    /// The request whose handed-off KV to release.
    pub id: u64,
}

/// Body of the control API's `POST /worker/v1/export`: offer the longest cached prefix of
/// `tokens` to a peer under lease `lease` ([`fetch_lease`] of the request that fetches it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportBody {
    /// The lease's transfer id.
    pub lease: u64,
    /// The prompt's first tokens (whole blocks).
    pub tokens: Vec<u32>,
}

/// Body of the control API's `POST /worker/v1/import`: pull the KV of `tokens` a peer offers
/// (`source`) into the prefix cache, running nothing, as import `id`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImportBody {
    /// The import's id on the worker (and the lease's on the peer).
    pub id: u64,
    /// The tokens the KV holds.
    pub tokens: Vec<u32>,
    /// Where it is.
    pub source: KvSource,
}

/// A KV tier, as the state stream names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvTier {
    /// The engine's working arena.
    Device,
    /// Host memory.
    Host,
    /// Local disk.
    Disk,
}

impl From<baton_kv::Tier> for KvTier {
    fn from(t: baton_kv::Tier) -> Self {
        match t {
            baton_kv::Tier::Device => KvTier::Device,
            baton_kv::Tier::Host => KvTier::Host,
            baton_kv::Tier::Disk => KvTier::Disk,
        }
    }
}

impl From<KvTier> for baton_kv::Tier {
    fn from(t: KvTier) -> Self {
        match t {
            KvTier::Device => baton_kv::Tier::Device,
            KvTier::Host => baton_kv::Tier::Host,
            KvTier::Disk => baton_kv::Tier::Disk,
        }
    }
}

impl KvTier {
    /// The name in metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            KvTier::Device => "device",
            KvTier::Host => "host",
            KvTier::Disk => "disk",
        }
    }
}

/// A block a worker's prefix index holds: its chained hash (the prefix it names), its parent's
/// and its tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CachedBlock {
    /// Chained hash of the block (and so of its whole prefix).
    pub hash: u64,
    /// The previous block's hash (`None` for a prompt's first block).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<u64>,
    /// Where it lives.
    pub tier: KvTier,
}

/// One change to a worker's prefix index, numbered: a worker's events carry consecutive
/// numbers from 0, so a gap shows that some were lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockEvent {
    /// Sequence number.
    pub seq: u64,
    /// What changed.
    #[serde(flatten)]
    pub change: BlockChange,
}

/// What changed in a worker's prefix index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum BlockChange {
    /// A block was cached.
    Stored(CachedBlock),
    /// A cached block moved to another tier.
    Moved {
        /// The block.
        hash: u64,
        /// Its tier now.
        tier: KvTier,
    },
    /// A block left the cache.
    Removed {
        /// The block.
        hash: u64,
    },
}

impl From<&baton_kv::KvEvent> for BlockEvent {
    fn from(e: &baton_kv::KvEvent) -> Self {
        use baton_kv::KvEventKind;
        let change = match &e.kind {
            KvEventKind::Stored { hash, parent, tier, .. } => {
                BlockChange::Stored(CachedBlock { hash: hash.0, parent: parent.map(|p| p.0), tier: (*tier).into() })
            }
            KvEventKind::Moved { hash, tier } => BlockChange::Moved { hash: hash.0, tier: (*tier).into() },
            KvEventKind::Removed { hash } => BlockChange::Removed { hash: hash.0 },
        };
        Self { seq: e.seq, change }
    }
}

impl From<BlockChange> for baton_sched::BlockUpdate {
    fn from(change: BlockChange) -> Self {
        use baton_kv::BlockHash;
        match change {
            BlockChange::Stored(b) => Self::Stored { hash: BlockHash(b.hash), tier: b.tier.into() },
            BlockChange::Moved { hash, tier } => Self::Moved { hash: BlockHash(hash), tier: tier.into() },
            BlockChange::Removed { hash } => Self::Removed { hash: BlockHash(hash) },
        }
    }
}

impl BlockEvent {
    /// The pool's event, for `instance` (the conductor's id of the worker); tokens are not
    /// carried (the index keys on hashes).
    pub fn to_kv(self, instance: baton_kv::InstanceId) -> baton_kv::KvEvent {
        use baton_kv::{BlockHash, KvEventKind};
        let kind = match self.change {
            BlockChange::Stored(b) => KvEventKind::Stored {
                hash: BlockHash(b.hash),
                parent: b.parent.map(BlockHash),
                tokens: baton_kv::BlockTokens::default(),
                tier: b.tier.into(),
            },
            BlockChange::Moved { hash, tier } => KvEventKind::Moved { hash: BlockHash(hash), tier: tier.into() },
            BlockChange::Removed { hash } => KvEventKind::Removed { hash: BlockHash(hash) },
        };
        baton_kv::KvEvent { instance, seq: self.seq, kind }
    }
}

/// A worker's load, as measured by the worker (the same fields the simulator fills).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LoadReport {
    /// Sequences in the running batch.
    pub running: usize,
    /// Sequences waiting to be admitted.
    pub waiting: usize,
    /// Prompt tokens not computed yet.
    pub queued_prefill_tokens: usize,
    /// Context of each sequence in the decode batch.
    pub decode_contexts: Vec<usize>,
    /// KV waiting for room to be received: hand-offs, fetched prefixes and imports.
    pub incoming: usize,
    /// KV on its way in (hand-offs, fetched prefixes, imports).
    pub receiving: usize,
    /// KV handed off and still leased (prefill role).
    pub leased: usize,
    /// Device blocks free.
    pub free_blocks: usize,
    /// Device blocks in the prefix index.
    pub cached_blocks: usize,
    /// Cached device blocks no request holds (reclaimable, leaf after leaf).
    pub evictable_blocks: usize,
    /// Device blocks in all.
    pub total_blocks: usize,
    /// Measured time of one engine step (exponential moving average), µs; 0 before the first.
    pub step_time_us: u64,
    /// The same over decode-only steps (no prefill chunk), µs; 0 before the first (or from a
    /// worker that predates it).
    pub decode_step_us: u64,
    /// Moving mean of those steps' batch (sequences decoding)...
    pub decode_step_batch: f64,
    /// ...and of their context (tokens of KV in all).
    pub decode_step_context: f64,
    /// The worker's role now (it changes when the conductor switches it; `None` from a worker
    /// that predates role switching).
    pub role: Option<Role>,
}

/// One message of a worker's state stream (KV events and load reports, in order). A stream
/// starts with a `Snapshot`; after it, `Delta`s carry the events from `next_seq` on. A new
/// snapshot comes when the worker dropped events (a slow reader) or a subscriber asked again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "update", rename_all = "snake_case")]
pub enum StateUpdate {
    /// Everything the worker's index holds, and the number of the next event.
    Snapshot {
        /// The next event's sequence number.
        next_seq: u64,
        /// Every cached block.
        blocks: Vec<CachedBlock>,
        /// Load now.
        load: LoadReport,
        /// When it was taken (Unix ms, the worker's clock).
        at_ms: u64,
    },
    /// Events since the last update (possibly none) and the load now.
    Delta {
        /// Events, in order.
        events: Vec<BlockEvent>,
        /// Load now.
        load: LoadReport,
        /// When it was sent (Unix ms, the worker's clock).
        at_ms: u64,
    },
}

impl StateUpdate {
    /// The load it reports.
    pub fn load(&self) -> &LoadReport {
        match self {
            StateUpdate::Snapshot { load, .. } | StateUpdate::Delta { load, .. } => load,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_work_request_crosses_processes_whole() {
        let mut req = WorkRequest::new(7, vec![1, 2, 3]);
        req.sampling.temperature = 0.7;
        req.sampling.seed = Some(9);
        req.sampling.adjust.presence_penalty = 0.5;
        req.stop.stop_strings = vec!["\n".into()];
        req.stop.max_tokens = 33;
        let source =
            KvSource { addr: SocketAddr::from(([127, 0, 0, 1], 9)), blocks: vec![4, 5], tokens: 20, lease: None };
        for work in [
            Work::Whole { fetch: None },
            Work::Whole { fetch: Some(source.clone()) },
            Work::Prefill { fetch: None, handoff: KvTransfer::Layerwise },
            Work::Decode { source: source.clone(), mode: KvTransfer::Push },
        ] {
            req.work = work;
            let json = serde_json::to_string(&req).expect("serialise");
            let back: WorkRequest = serde_json::from_str(&json).expect("parse");
            assert_eq!(back, req, "{json}");
        }
        // A part is one of three, each with its own fields: a decode with a fetch, or a
        // prefill without its hand-off mode, cannot be written.
        let work = |w: &str| serde_json::from_str::<WorkRequest>(&format!(r#"{{"id":1,"prompt":[5],"work":{w}}}"#));
        let kv = r#"{"addr":"127.0.0.1:9","blocks":[1],"tokens":16}"#;
        assert!(work(&format!(r#"{{"part":"decode","source":{kv},"mode":"pull"}}"#)).is_ok());
        assert!(work(&format!(r#"{{"part":"decode","source":{kv},"mode":"pull","fetch":{kv}}}"#)).is_err());
        assert!(work(r#"{"part":"prefill"}"#).is_err());
        assert!(work(r#"{"part":"restart"}"#).is_err());
        // Fields left out take their defaults; unknown ones are refused.
        let minimal: WorkRequest = serde_json::from_str(r#"{"id":1,"prompt":[5]}"#).expect("parse");
        assert_eq!(minimal, WorkRequest::new(1, vec![5]));
        assert!(serde_json::from_str::<WorkRequest>(r#"{"id":1,"prompt":[5],"temprature":1}"#).is_err());
    }

    #[test]
    fn worker_errors_and_events_round_trip() {
        for e in [
            RequestEvent::Failed(WorkerError::InvalidRequest("too long".into())),
            RequestEvent::Failed(WorkerError::Engine("boom".into())),
            RequestEvent::Lost { reason: "draining".into() },
            RequestEvent::Token { token: 3, text: "a".into(), logprobs: None },
        ] {
            let json = serde_json::to_string(&e).expect("serialise");
            assert_eq!(serde_json::from_str::<RequestEvent>(&json).expect("parse"), e, "{json}");
        }
    }

    #[test]
    fn state_updates_round_trip_and_events_convert_both_ways() {
        use baton_kv::{BlockHash, BlockTokens, InstanceId, KvEvent, KvEventKind, Tier};
        let kv = KvEvent {
            instance: InstanceId(3),
            seq: 5,
            kind: KvEventKind::Stored {
                hash: BlockHash(9),
                parent: Some(BlockHash(8)),
                tokens: BlockTokens::default(),
                tier: Tier::Host,
            },
        };
        let e = BlockEvent::from(&kv);
        assert_eq!(e.to_kv(InstanceId(3)), kv);
        for e in [
            StateUpdate::Delta { events: vec![e], load: LoadReport::default(), at_ms: 1 },
            StateUpdate::Snapshot {
                next_seq: 6,
                blocks: vec![CachedBlock { hash: 1, parent: None, tier: KvTier::Device }],
                load: LoadReport { decode_contexts: vec![3, 4], ..LoadReport::default() },
                at_ms: 2,
            },
        ] {
            let json = serde_json::to_string(&e).expect("serialise");
            assert_eq!(serde_json::from_str::<StateUpdate>(&json).expect("parse"), e, "{json}");
        }
    }
}
