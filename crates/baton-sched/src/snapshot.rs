//! What a policy sees ([`ClusterSnapshot`], [`Request`]) and what it answers ([`Decision`],
//! and the [`Predict`] its caller applies to the prompt trees).
//!
//! The conductor fills a snapshot from its registry and the workers' load reports; the simulator
//! fills the same struct from its virtual instances. Neither the snapshot nor the decision holds
//! anything live: both are plain data.

use std::collections::BTreeMap;
use std::sync::Arc;

use baton_kv::{BlockHash, InstanceId, Tier};
use serde::{Deserialize, Serialize};

use crate::Micros;
use crate::cost::{CostProfile, Link};
pub use crate::role::Role;
use crate::trees::{GlobalPromptTrees, Predict};

/// A request's id, unique within a conductor (or a simulation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId(pub u64);

/// A client session (an HTTP session, a conversation) for session affinity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SessionId(pub u64);

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
    /// Tokens it is expected still to generate, when known (its request's expected output less
    /// what it has generated). Predictive admission counts it gone after that many steps;
    /// without it, after a uniform `t_d` from `started_at`.
    #[serde(default)]
    pub remaining: Option<u64>,
}

impl DecodeSeq {
    /// A sequence whose remaining output is not known.
    pub fn new(started_at: Micros, context: u64) -> Self {
        Self { started_at, context, remaining: None }
    }
}

/// A request routed to a decode instance whose prefill (or transfer) has not finished yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IncomingSeq {
    /// When its KV is expected to be ready on the decode instance.
    pub ready_at: Micros,
    /// Its prompt length.
    pub context: u64,
    /// Tokens it is expected to generate on the decode instance, when known (predictive
    /// admission counts it gone that many steps after `ready_at`; unknown: it stays).
    #[serde(default)]
    pub output: Option<u64>,
}

impl IncomingSeq {
    /// A sequence whose output length is not known.
    pub fn new(ready_at: Micros, context: u64) -> Self {
        Self { ready_at, context, output: None }
    }
}

/// An [`IncomingSeq`] as [`IncomingSeqs`] keys it: ready time, context, output.
type IncomingKey = (Micros, u64, Option<u64>);

/// The requests routed to a decode instance whose KV has not arrived, as the policies weigh
/// them: how many, their context in all (both kept as running totals), and how many of them,
/// with what context, are expected by a given time ([`IncomingSeqs::ready_by`]).
///
/// A multiset of [`IncomingSeq`]s behind an [`Arc`], so a snapshot copies a pointer, not one
/// entry per request: under overload a decode instance can have as many requests coming as the
/// prefill queues hold, and the simulator takes a snapshot per arrival. Whoever keeps one
/// (the simulator, per decode instance) changes it in place with [`IncomingSeqs::push`] and
/// [`IncomingSeqs::remove`] once the snapshots sharing it are gone, in O(log n).
///
/// ```
/// use baton_sched::{IncomingSeq, IncomingSeqs};
///
/// let mut inc: IncomingSeqs = [(5, 100), (9, 300), (5, 100)]
///     .into_iter()
///     .map(|(ready_at, context)| IncomingSeq::new(ready_at, context))
///     .collect();
/// assert_eq!((inc.len(), inc.context()), (3, 500));
/// assert_eq!(inc.ready_by(5), (2, 200));
/// assert!(inc.remove(IncomingSeq::new(5, 100)));
/// assert_eq!(inc.ready_by(u64::MAX), (2, 400));
/// // One more, ready at 6 with 10 tokens to generate: at steps of 1, gone by 16.
/// inc.push(IncomingSeq { ready_at: 6, context: 50, output: Some(10) });
/// assert_eq!((inc.staying_at(15, 1), inc.staying_at(16, 1)), ((3, 450), (2, 400)));
/// // None coming is none coming, whether some came and left or none ever came.
/// let mut gone = IncomingSeqs::new();
/// gone.push(IncomingSeq::new(1, 10));
/// assert!(gone.remove(IncomingSeq::new(1, 10)) && !gone.remove(IncomingSeq::new(1, 10)));
/// assert_eq!(gone, IncomingSeqs::new());
/// assert!(!IncomingSeqs::new().remove(IncomingSeq::new(1, 10)));
/// ```
#[derive(Debug, Clone, Default)]
pub struct IncomingSeqs {
    len: u64,
    context: u64,
    /// How many sequences of each (ready time, context, output); `None` until one comes, so
    /// the snapshot of an instance with none coming (most, most of the time: a conductor builds
    /// one per worker per decision) allocates nothing for it.
    by_ready: Option<Arc<BTreeMap<IncomingKey, u64>>>,
}

/// The sequences coming to an instance whose `by_ready` is `None`: none.
static NONE_COMING: BTreeMap<IncomingKey, u64> = BTreeMap::new();

/// Equal when the same sequences are coming, however they came to be held.
impl PartialEq for IncomingSeqs {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.context == other.context && self.by_ready() == other.by_ready()
    }
}

impl Eq for IncomingSeqs {}

impl IncomingSeqs {
    /// How many sequences of each (ready time, context, output).
    fn by_ready(&self) -> &BTreeMap<IncomingKey, u64> {
        self.by_ready.as_deref().unwrap_or(&NONE_COMING)
    }

    /// None coming.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sequences coming.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether none is coming.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Their tokens of context in all.
    pub fn context(&self) -> u64 {
        self.context
    }

    /// One more coming.
    pub fn push(&mut self, s: IncomingSeq) {
        let map = Arc::make_mut(self.by_ready.get_or_insert_with(Default::default));
        *map.entry((s.ready_at, s.context, s.output)).or_insert(0) += 1;
        self.len += 1;
        self.context += s.context;
    }

    /// One fewer coming (arrived, or dropped); false if no such sequence was coming.
    pub fn remove(&mut self, s: IncomingSeq) -> bool {
        let Some(map) = self.by_ready.as_mut() else { return false };
        let map = Arc::make_mut(map);
        let key = (s.ready_at, s.context, s.output);
        match map.get_mut(&key) {
            None => return false,
            Some(1) => {
                map.remove(&key);
            }
            Some(n) => *n -= 1,
        }
        self.len -= 1;
        self.context -= s.context;
        true
    }

    /// The sequences expected by `at` (ready at or before it): how many, and their context in
    /// all. Walks those sequences' distinct (time, context) pairs: what predictive admission asks
    /// of one decode instance per request, whose TTFT check bounds the prefill queues ahead.
    pub fn ready_by(&self, at: Micros) -> (u64, u64) {
        self.by_ready()
            .range(..=(at, u64::MAX, Some(u64::MAX)))
            .fold((0, 0), |(n, ctx), (&(_, c, _), &k)| (n + k, ctx + c * k))
    }

    /// Of the sequences expected by `at`, those still decoding then, at decode steps of `step_us`
    /// (a sequence of known output leaves that many steps after it is ready; one of unknown
    /// output stays): how many, and their context in all.
    pub fn staying_at(&self, at: Micros, step_us: Micros) -> (u64, u64) {
        self.by_ready()
            .range(..=(at, u64::MAX, Some(u64::MAX)))
            .filter(|&(&(ready, _, out), _)| out.is_none_or(|o| ready.saturating_add(o.saturating_mul(step_us)) > at))
            .fold((0, 0), |(n, ctx), (&(_, c, _), &k)| (n + k, ctx + c * k))
    }

    /// Every sequence coming, by ready time (then context).
    pub fn iter(&self) -> impl Iterator<Item = IncomingSeq> + '_ {
        self.by_ready().iter().flat_map(|(&(ready_at, context, output), &k)| {
            std::iter::repeat_n(IncomingSeq { ready_at, context, output }, k as usize)
        })
    }
}

impl FromIterator<IncomingSeq> for IncomingSeqs {
    fn from_iter<I: IntoIterator<Item = IncomingSeq>>(iter: I) -> Self {
        let mut out = Self::new();
        for s in iter {
            out.push(s);
        }
        out
    }
}

impl From<Vec<IncomingSeq>> for IncomingSeqs {
    fn from(v: Vec<IncomingSeq>) -> Self {
        v.into_iter().collect()
    }
}

/// What a router counts of an instance itself, beside the figures the policies estimate from:
/// requests it has in flight there and the KV its admissions claim. The conductor fills it from
/// its ledger (its least-in-flight routing and its check that a decode worker has room for a
/// prompt read it); the simulator, whose policies estimate from queues and batches, leaves it
/// at its default (nothing counted, capacity unknown).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ledger {
    /// Requests in flight on the instance.
    pub in_flight: u32,
    /// KV tokens of the requests decoding on it.
    pub decoding_tokens: u64,
    /// KV tokens claimed on it by requests admitted to decode there and not decoding yet (in
    /// prefill elsewhere, or handing over).
    pub bound_tokens: u64,
    /// Tokens of KV its pool holds (0: unknown).
    pub capacity_tokens: u64,
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
    pub decode_incoming: IncomingSeqs,
    /// KV blocks per tier, indexed by `Tier as usize` (device, host, disk).
    pub kv: [TierUsage; 3],
    /// NIC bandwidth, bytes per second (0: the cost profile's default).
    pub nic_bytes_per_s: u64,
    /// How much longer (above 1) or shorter its decode steps take than the cost profile
    /// predicts, as measured (1.0: as predicted; the simulator's instances are exact).
    pub decode_step_scale: f64,
    /// Its mean step as measured over every step, prefill chunks included (0: unknown). The
    /// decodes of a colocated instance wait for its prefill chunks too, so this, not the
    /// decode-only step, is the gap between their tokens.
    pub mean_step_us: Micros,
    /// What the router counts of it ([`Ledger`]).
    pub ledger: Ledger,
    /// Which instances it can exchange KV with: those of the same group, or any when either is
    /// `None` (unknown). Workers whose KV caches differ (a CPU worker's float32 arena, a GPU
    /// worker's bfloat16 one) cannot take each other's blocks: the policies pair a prefill
    /// instance only with decode instances of its group and fetch a prefix only within it.
    pub kv_group: Option<u32>,
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
            decode_incoming: IncomingSeqs::new(),
            kv: [TierUsage::default(); 3],
            nic_bytes_per_s: 0,
            decode_step_scale: 1.0,
            mean_step_us: 0,
            ledger: Ledger::default(),
            kv_group: None,
        }
    }

    /// Whether it and `other` can exchange KV ([`Self::kv_group`]).
    pub fn shares_kv(&self, other: &InstanceSnapshot) -> bool {
        match (self.kv_group, other.kv_group) {
            (Some(a), Some(b)) => a == b,
            _ => true,
        }
    }

    /// Its decode step with `batch` sequences of `context` tokens in all: the cost profile's
    /// prediction, scaled by what this instance measures.
    pub fn decode_step(&self, cost: &crate::CostProfile, batch: u64, context: u64) -> Micros {
        let predicted = cost.decode_step(batch, context);
        if self.decode_step_scale == 1.0 { predicted } else { (predicted as f64 * self.decode_step_scale) as Micros }
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

/// A prefill routed to an instance and not finished: what the conductor (or the simulator)
/// tracks to estimate the instance's prefill queue time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingPrefill {
    /// Its predicted compute time, fixed when it was routed:
    /// `cost.prefill_time_cached(req.prompt_tokens, req.cached_tokens(route.reused_blocks()))`.
    pub est_us: Micros,
    /// When it started computing (`None`: still queued).
    pub started_at: Option<Micros>,
}

/// The figures a conductor has of one live worker: its membership (id, role, accepting), its load
/// report (KV blocks used and total per tier, requests waiting to join the decode batch) and what
/// the conductor itself tracks (prefills routed and not finished, running decodes with their
/// contexts, decodes whose KV has not arrived). [`WorkerLoad::snapshot`] turns it into the
/// [`InstanceSnapshot`] a policy sees; the simulator builds its snapshots through the same call.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerLoad {
    /// Its id.
    pub id: InstanceId,
    /// Its role.
    pub role: Role,
    /// Whether it takes new work.
    pub accepting: bool,
    /// Prefills routed to it and not finished, oldest (the running one) first.
    pub prefills: Vec<PendingPrefill>,
    /// Its running decode batch.
    pub decode_running: Vec<DecodeSeq>,
    /// Requests waiting to join the decode batch.
    pub decode_waiting: u32,
    /// Requests routed here for decode whose KV has not arrived.
    pub decode_incoming: Vec<IncomingSeq>,
    /// KV blocks used and total on the device tier (the engine's `num_blocks` and
    /// `num_blocks - available_blocks`, or with the cache counted as used, as the worker reports).
    pub kv_device: TierUsage,
    /// KV blocks of the host tier.
    pub kv_host: TierUsage,
    /// Its measured decode step time over the cost profile's prediction (1.0: as predicted).
    pub decode_step_scale: f64,
    /// Its measured mean step, every step (0: unknown; see [`InstanceSnapshot::mean_step_us`]).
    pub mean_step_us: Micros,
    /// What the router counts of it ([`Ledger`]).
    pub ledger: Ledger,
    /// Which workers it can exchange KV with ([`InstanceSnapshot::kv_group`]).
    pub kv_group: Option<u32>,
}

impl WorkerLoad {
    /// An idle, accepting worker with no KV in use.
    pub fn idle(id: InstanceId, role: Role) -> Self {
        Self {
            id,
            role,
            accepting: true,
            prefills: Vec::new(),
            decode_running: Vec::new(),
            decode_waiting: 0,
            decode_incoming: Vec::new(),
            kv_device: TierUsage::default(),
            kv_host: TierUsage::default(),
            decode_step_scale: 1.0,
            mean_step_us: 0,
            ledger: Ledger::default(),
            kv_group: None,
        }
    }

    /// Estimated time until its prefill queue is empty at `now` (Mooncake's
    /// `EstimatePrefillQueueTime`): queued prefills in full, the running ones' remainder.
    pub fn queued_prefill_us(&self, now: Micros) -> Micros {
        self.prefills
            .iter()
            .map(|p| match p.started_at {
                None => p.est_us,
                Some(s) => p.est_us.saturating_sub(now.saturating_sub(s)),
            })
            .sum()
    }

    /// The policy's view of this worker at `now`.
    pub fn snapshot(&self, now: Micros) -> InstanceSnapshot {
        InstanceSnapshot {
            id: self.id,
            role: self.role,
            accepting: self.accepting,
            prefill_queue_len: self.prefills.len() as u32,
            queued_prefill_us: self.queued_prefill_us(now),
            decode_running: self.decode_running.clone(),
            decode_waiting: self.decode_waiting,
            decode_incoming: self.decode_incoming.iter().copied().collect(),
            kv: [self.kv_device, self.kv_host, TierUsage::default()],
            nic_bytes_per_s: 0,
            decode_step_scale: self.decode_step_scale,
            mean_step_us: self.mean_step_us,
            ledger: self.ledger,
            kv_group: self.kv_group,
        }
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
    /// Whether an instance can fetch a prefix cached on another (over `links`). Off, a policy
    /// costs each instance with the blocks it holds and never routes a fetch.
    pub kv_fetch: bool,
    /// Whether decode instances keep finished requests' KV in their caches and receive only
    /// what they lack (MemServe's PD-Caching-2): the decode instance caching the longest prefix
    /// of the prompt (a session's history) is preferred among those about as fast.
    pub decode_affinity: bool,
}

/// Whether a prefilling instance has someone to decode what it prefills: itself when
/// colocated, else a decode instance of the snapshot that can take its KV
/// ([`InstanceSnapshot::shares_kv`]). Built once per decision by [`ClusterSnapshot::hand_off`]
/// (the decode pool's KV groups, a handful), then asked of each candidate in O(groups).
#[derive(Debug, Clone)]
pub struct HandOff {
    /// Some instance decodes.
    any: bool,
    /// A decoding instance of unknown group (`None`): it takes every group's KV.
    any_group: bool,
    /// The decoding instances' known groups.
    groups: Vec<u32>,
}

impl HandOff {
    /// Whether `p` prefills and what it prefills can be decoded.
    pub fn hands_off(&self, p: &InstanceSnapshot) -> bool {
        match p.role {
            crate::Role::Colocated => true,
            crate::Role::Decode => false,
            crate::Role::Prefill => match p.kv_group {
                None => self.any,
                Some(g) => self.any_group || self.groups.contains(&g),
            },
        }
    }
}

impl<'a> ClusterSnapshot<'a> {
    /// The snapshot a conductor (or the simulator) builds at `now` from its workers' figures and
    /// its global prompt trees (fed by the workers' KV events): instances in id order, no special
    /// links.
    ///
    /// ```
    /// use baton_kv::{BlockHash, InstanceId, KvEvent, KvEventKind, Tier};
    /// use baton_sched::*;
    /// use rand::SeedableRng;
    ///
    /// let cost = CostProfile::llama2_70b_8xh100();
    /// let mut trees = GlobalPromptTrees::new(60_000_000);
    /// let mut workers = vec![
    ///     WorkerLoad::idle(InstanceId(0), Role::Prefill),
    ///     WorkerLoad::idle(InstanceId(1), Role::Prefill),
    ///     WorkerLoad::idle(InstanceId(2), Role::Decode),
    /// ];
    /// for w in &workers {
    ///     trees.set_role(w.id, w.role);
    /// }
    /// // Worker 0's pool stored the prompt's first block (from `Engine::drain_kv_events`).
    /// let stored = KvEventKind::Stored { hash: BlockHash(7), parent: None, tokens: Default::default(), tier: Tier::Device };
    /// trees.apply(&KvEvent { instance: InstanceId(0), seq: 0, kind: stored })?;
    /// // Worker 1 is busy with a prefill of 2 s that started 0.5 s ago; worker 2 decodes one sequence.
    /// workers[1].prefills.push(PendingPrefill { est_us: 2_000_000, started_at: Some(500_000) });
    /// workers[2].decode_running.push(DecodeSeq::new(0, 3000));
    /// workers[2].kv_device = TierUsage { used: 200, total: 4000 };
    ///
    /// let now = 1_000_000;
    /// let snap = ClusterSnapshot::from_workers(now, &workers, &trees, &cost);
    /// assert_eq!(snap.instance(InstanceId(1)).map(|i| i.queued_prefill_us), Some(1_500_000));
    /// let req = Request {
    ///     id: RequestId(1),
    ///     prompt_tokens: 1000,
    ///     block_hashes: vec![BlockHash(7), BlockHash(8)],
    ///     block_tokens: 512,
    ///     expected_output: 100,
    ///     session: None,
    /// };
    /// let mut sched = Scheduler::new(PolicyKind::KvCentric.build(&PolicyConfig::default()), AdmissionConfig::default());
    /// let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    /// let route = sched.decide(&snap, &req, &mut rng).route().cloned().expect("routed");
    /// assert_eq!((route.prefill, route.decode, route.reused_blocks()), (InstanceId(0), InstanceId(2), 1));
    /// # Ok::<(), baton_kv::EventError>(())
    /// ```
    pub fn from_workers(
        now: Micros,
        workers: &[WorkerLoad],
        trees: &'a GlobalPromptTrees,
        cost: &'a CostProfile,
    ) -> Self {
        let mut instances: Vec<InstanceSnapshot> = workers.iter().map(|w| w.snapshot(now)).collect();
        instances.sort_by_key(|i| i.id);
        Self { now, instances, trees, cost, links: Vec::new(), kv_fetch: true, decode_affinity: false }
    }

    /// This snapshot with decode affinity on or off ([`ClusterSnapshot::decode_affinity`]).
    #[must_use]
    pub fn with_decode_affinity(mut self, on: bool) -> Self {
        self.decode_affinity = on;
        self
    }

    /// This snapshot with fetching between instances allowed or not ([`ClusterSnapshot::kv_fetch`]).
    #[must_use]
    pub fn with_kv_fetch(mut self, on: bool) -> Self {
        self.kv_fetch = on;
        self
    }

    /// The instance with this id.
    pub fn instance(&self, id: InstanceId) -> Option<&InstanceSnapshot> {
        self.instances.iter().find(|i| i.id == id)
    }

    /// Instances that take prefills now.
    ///
    /// A prefill-only instance counts only while some decode instance can take its KV
    /// ([`InstanceSnapshot::shares_kv`]): with none, every policy would pick a pair that cannot
    /// hand off.
    pub fn prefill_pool(&self) -> impl Iterator<Item = &InstanceSnapshot> {
        let hand_off = self.hand_off();
        self.instances.iter().filter(move |i| i.accepting && hand_off.hands_off(i))
    }

    /// Which prefilling instances some instance decodes for ([`HandOff`]), from one pass over
    /// the decode pool: ask it of every candidate in a routing decision.
    pub fn hand_off(&self) -> HandOff {
        let mut rule = HandOff { any: false, any_group: false, groups: Vec::new() };
        for d in self.decode_pool() {
            rule.any = true;
            match d.kv_group {
                None => rule.any_group = true,
                Some(g) if !rule.groups.contains(&g) => rule.groups.push(g),
                Some(_) => {}
            }
        }
        rule
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

/// The [`Predict`] of a decision (the type is the trees' own: they apply it).
impl Predict {
    /// What `decision` on `req` predicts: the prompt cached at the prefill instance of a route,
    /// nothing for a rejection. Takes the request, whose hashes move into the prediction.
    pub fn of(decision: &Decision, req: Request) -> Option<Self> {
        decision.route().map(|r| Self { instance: r.prefill, hashes: req.block_hashes })
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
