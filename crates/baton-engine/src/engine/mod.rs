//! Executing plans: the engine owns the KV memory pool and the sequences, asks the
//! [`planner`](crate::planner) what to do, and does it.
//!
//! KV memory is a [`MemPool`]: blocks come from its segment allocator, and with prefix caching
//! on, a finished sequence's full blocks go into its prefix index and a new request starts from
//! the longest cached prefix of its prompt. The engine's logical clock (its step count) is the
//! time the pool's eviction policy sees: no wall clock is read here, except by the emulated
//! backend's sleeping clock, to end a step at its predicted time.
//!
//! The seam between scheduling and computing is the private `Backend`: the model's forward pass
//! (logits, sampled by each sequence's sampler) or the [emulated](crate::emulated) backend (a
//! predicted step time and deterministic tokens). It is an enum rather than a trait: there are
//! two backends, and everything else in a step — planning, allocation, stop conditions,
//! detokenisation, caching, retention — is the same code for both.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use baton_kv::{
    BlockId, InstanceId, KvArena, KvDtype, KvEvent, KvGeometry, KvLayout, Loc, MemPool, PolicyKind, PoolConfig,
    PoolError, SwapIn, Tier,
};
use baton_model::{DeviceKv, LogitsWanted, Model, ModelConfig, SeqStep, StepLogits, Tokenizer};
use baton_sched::{CostProfile, Micros};

use crate::emulated::{EmulatedModel, EmulatedStats, Emulator, StepWork};

use crate::planner::{self, PlanInput, PlannerConfig, Scheduled, SeqView};
use crate::request::{
    FinishReason, Finished, GenerationRequest, KvPiece, KvPrefix, KvRetention, KvStream, StepOutput, TokenEvent,
};
use crate::sequence::Sequence;
use crate::swapper::Swapper;
use crate::{EngineError, RequestId};

mod kv_exchange;
mod validate;

/// Sizes and limits of one engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the KV arena.
    pub num_blocks: usize,
    /// Memory layout of the arena.
    pub layout: KvLayout,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Most tokens computed per step.
    pub max_batch_tokens: usize,
    /// Most prompt tokens of one sequence per step.
    pub prefill_chunk: usize,
    /// Keep finished sequences' KV in the prefix index and reuse it for later prompts.
    pub prefix_caching: bool,
    /// Blocks of host DRAM the cache spills to (0: none).
    pub host_blocks: usize,
    /// Blocks of disk the cache spills to (0: none); needs `disk_dir`.
    pub disk_blocks: usize,
    /// Directory of the disk tier's block file.
    pub disk_dir: Option<PathBuf>,
    /// This instance's id in the cluster (KV addresses and events carry it).
    pub instance: InstanceId,
    /// Element type of the KV cache: float32, or a 16-bit one (half the memory and transfer
    /// bytes; keys and values are rounded once, when stored, and attention reads them widened).
    pub kv_dtype: KvDtype,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_blocks: 1024,
            layout: KvLayout::BlockMajor,
            max_num_seqs: 64,
            max_batch_tokens: 512,
            prefill_chunk: 512,
            prefix_caching: true,
            host_blocks: 0,
            disk_blocks: 0,
            disk_dir: None,
            instance: InstanceId(0),
            kv_dtype: KvDtype::F32,
        }
    }
}

impl EngineConfig {
    /// Checks that the limits make sense together.
    pub fn validate(&self) -> Result<(), EngineError> {
        let bad = |m: &str| Err(EngineError::Config(m.to_owned()));
        if self.block_size == 0 || self.num_blocks == 0 {
            return bad("block_size and num_blocks must be positive");
        }
        if self.max_num_seqs == 0 || self.max_batch_tokens == 0 || self.prefill_chunk == 0 {
            return bad("max_num_seqs, max_batch_tokens and prefill_chunk must be positive");
        }
        if u32::try_from(self.num_blocks).is_err() {
            return bad("num_blocks must fit in 32 bits");
        }
        Ok(())
    }

    fn planner(&self) -> PlannerConfig {
        PlannerConfig {
            block_size: self.block_size,
            max_num_seqs: self.max_num_seqs,
            max_batch_tokens: self.max_batch_tokens,
            prefill_chunk: self.prefill_chunk,
        }
    }
}

/// What computes a step: the model's forward pass, or the emulated backend's wait.
#[derive(Debug)]
enum Backend {
    Model(Arc<Model>),
    Emulated(Box<Emulator>),
}

impl Backend {
    fn config(&self) -> &ModelConfig {
        match self {
            Backend::Model(m) => m.config(),
            Backend::Emulated(e) => &e.model.config,
        }
    }
}

/// What a step's execution produced for the scheduled sequences, in batch order.
enum Computed {
    /// The model's logits (sampled by each sequence's sampler).
    Logits(StepLogits),
    /// The emulated backend's next token of each sequence that completed its known tokens.
    Tokens(Vec<Option<u32>>),
}

/// What an engine is doing, as a load report carries it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineLoad {
    /// Sequences in the running batch.
    pub running: usize,
    /// Sequences waiting to be admitted.
    pub waiting: usize,
    /// Prompt tokens not computed yet, over all sequences.
    pub queued_prefill_tokens: usize,
    /// Context length of each running sequence past its prompt (the decode batch).
    pub decode_contexts: Vec<usize>,
    /// Device blocks on the free list.
    pub free_blocks: usize,
    /// Device blocks in the prefix index.
    pub cached_blocks: usize,
    /// Cached device blocks no request holds: reclaimable, by evicting leaf after leaf (not
    /// only the leaves evictable this moment).
    pub evictable_blocks: usize,
    /// Device blocks in all.
    pub total_blocks: usize,
}

/// One instance's inference loop over a paged KV cache.
pub struct Engine {
    backend: Backend,
    tokenizer: Option<Arc<Tokenizer>>,
    config: EngineConfig,
    /// The KV arena on the model's device (a GPU's copy of the pool's arena; nothing on the
    /// CPU). Blocks whose host bytes arrive from elsewhere (a transfer, a tier's copy) are
    /// marked stale in it, so the device reads them afresh. Declared before `pool`, so it drops
    /// first: a GPU's state may have page-locked the pool's arena, and unlocks it on drop.
    device_kv: DeviceKv,
    pool: MemPool,
    /// Steps run: the logical time of the pool's eviction policy.
    clock: u64,
    /// Blocks brought onto the device from (host, disk) within the step since the last one
    /// (no copier thread): the emulated backend charges their copy to the next step, as the
    /// copy stalls the loop. `None` when the pool has no slower tier (nothing to count, no
    /// prefix to look up twice).
    swapped_in: Option<[usize; 2]>,
    seqs: HashMap<RequestId, Sequence>,
    /// Oldest first.
    running: Vec<RequestId>,
    /// First come first served; preempted sequences go back to the front.
    waiting: VecDeque<RequestId>,
    next_seed: u64,
    /// Where requests with `stream_kv` send their KV layer by layer.
    kv_stream: Option<Box<dyn KvStream>>,
    /// Swap-ins beside the step loop (a pool with a host or disk tier in shared memory): a
    /// request whose cached prefix is on a slower tier waits for its copy while the others
    /// step. `None`: the copy runs inside the step that admits the request.
    swapper: Option<Swapper>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("config", &self.config)
            .field("running", &self.running.len())
            .field("waiting", &self.waiting.len())
            .field("free_blocks", &self.pool.num_free())
            .finish()
    }
}

impl Engine {
    /// An engine running `model`; with a tokenizer it produces text and honours stop strings.
    pub fn new(
        model: Arc<Model>,
        tokenizer: Option<Arc<Tokenizer>>,
        config: EngineConfig,
    ) -> Result<Self, EngineError> {
        let geometry = model.kv_geometry(config.block_size);
        Self::with_backend(Backend::Model(model), geometry, tokenizer, config)
    }

    /// An engine that emulates `model` (see [`crate::emulated`]): the same loop, planner and KV
    /// pool, with step times from the model's cost profile and deterministic tokens instead of a
    /// forward pass. No weights are needed; the tokenizer (of the real model the configuration
    /// describes) gives text and stop strings.
    pub fn emulated(
        model: EmulatedModel,
        tokenizer: Option<Arc<Tokenizer>>,
        config: EngineConfig,
    ) -> Result<Self, EngineError> {
        let geometry = model.kv_geometry(config.block_size);
        Self::with_backend(Backend::Emulated(Box::new(Emulator::new(model))), geometry, tokenizer, config)
    }

    fn with_backend(
        backend: Backend,
        geometry: KvGeometry,
        tokenizer: Option<Arc<Tokenizer>>,
        config: EngineConfig,
    ) -> Result<Self, EngineError> {
        config.validate()?;
        let geometry = KvGeometry { dtype: config.kv_dtype, ..geometry };
        let pool = MemPool::new(PoolConfig {
            host_blocks: config.host_blocks,
            disk_blocks: config.disk_blocks,
            disk_dir: config.disk_dir.clone(),
            policy: PolicyKind::Lru,
            device_arena_name: match &backend {
                Backend::Model(m) => m.arena_name(),
                Backend::Emulated(_) => baton_kv::DEFAULT_ARENA_NAME,
            },
            ..PoolConfig::device_only(config.instance, geometry, config.layout, config.num_blocks)
        })?;
        // A virtual clock charges the copy to the step: nothing runs beside it to overlap.
        let sleeps = match &backend {
            Backend::Emulated(e) => e.model.clock == crate::EmulatedClock::Sleep,
            Backend::Model(_) => true,
        };
        let swapper = if sleeps && (config.host_blocks > 0 || config.disk_blocks > 0) {
            match pool
                .swap_copier()
                .map_err(|e| e.to_string())
                .and_then(|c| Swapper::spawn(c).map_err(|e| e.to_string()))
            {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::warn!(error = %e, "no copier thread: prefixes on the host and disk tiers are copied within the step");
                    None
                }
            }
        } else {
            None
        };
        let device_kv = match &backend {
            Backend::Model(m) => m.device_kv(pool.arena(), pool.copy_meter())?,
            Backend::Emulated(_) => DeviceKv::default(),
        };
        Ok(Self {
            device_kv,
            swapper,
            pool,
            clock: 0,
            swapped_in: (config.host_blocks > 0 || config.disk_blocks > 0).then_some([0; 2]),
            backend,
            tokenizer,
            config,
            seqs: HashMap::new(),
            running: Vec::new(),
            waiting: VecDeque::new(),
            next_seed: 0x5eed,
            kv_stream: None,
        })
    }

    /// Sets where requests with [`GenerationRequest::stream_kv`] stream their prompt's KV,
    /// layer by layer as each step writes it (without one, such requests stream nothing).
    pub fn set_kv_stream(&mut self, stream: Box<dyn KvStream>) {
        self.kv_stream = Some(stream);
    }

    /// The engine's configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The model (`None` for an emulated engine).
    pub fn model(&self) -> Option<&Arc<Model>> {
        match &self.backend {
            Backend::Model(m) => Some(m),
            Backend::Emulated(_) => None,
        }
    }

    /// The model's configuration (vocabulary, end tokens, context length).
    pub fn model_config(&self) -> &ModelConfig {
        self.backend.config()
    }

    /// Emulated time so far (`None` unless the engine is [emulated](Self::emulated)).
    pub fn emulated_clock(&self) -> Option<EmulatedStats> {
        match &self.backend {
            Backend::Model(_) => None,
            Backend::Emulated(e) => Some(e.stats),
        }
    }

    /// KV geometry of the arena.
    pub fn kv_geometry(&self) -> KvGeometry {
        *self.pool.geometry()
    }

    /// Device memory this engine's KV arena and workspace take on its model's GPU (zeros on
    /// the CPU).
    pub fn device_memory(&self) -> (usize, usize) {
        self.device_kv.device_bytes()
    }

    /// The meter of bytes copied into and out of the engine's device arena (its tiers', its
    /// device's, and those of the transfer plane it is handed to).
    pub fn copy_meter(&self) -> &Arc<baton_kv::CopyMeter> {
        self.pool.copy_meter()
    }

    /// The KV arena (read-only; for inspection and transfer).
    pub fn kv(&self) -> &KvArena {
        self.pool.arena()
    }

    /// The KV memory pool (read-only).
    pub fn pool(&self) -> &MemPool {
        &self.pool
    }

    /// Blocks on the free list.
    pub fn free_blocks(&self) -> usize {
        self.pool.num_free()
    }

    /// Blocks an allocation could get now: free, plus cached blocks no one holds.
    pub fn available_blocks(&self) -> usize {
        self.pool.available()
    }

    /// What this engine is doing, for a load report.
    pub fn load(&self) -> EngineLoad {
        let mut load = EngineLoad { running: self.running.len(), waiting: self.waiting.len(), ..EngineLoad::default() };
        for seq in self.seqs.values() {
            load.queued_prefill_tokens += seq.prompt_len.saturating_sub(seq.computed);
        }
        for id in &self.running {
            if let Some(seq) = self.seqs.get(id)
                && seq.computed >= seq.prompt_len
            {
                load.decode_contexts.push(seq.tokens.len());
            }
        }
        let device = self.pool.usage(Tier::Device);
        load.free_blocks = device.free;
        load.cached_blocks = device.cached;
        load.evictable_blocks = device.unheld_cached;
        load.total_blocks = self.config.num_blocks;
        load
    }

    /// Whether any request is waiting or running.
    pub fn has_work(&self) -> bool {
        // A swap-in whose request was aborted still holds device slots until its copy ends.
        !self.seqs.is_empty() || self.swapper.as_ref().is_some_and(|s| s.pending() > 0)
    }

    /// Requests running and waiting.
    pub fn queue_lengths(&self) -> (usize, usize) {
        (self.running.len(), self.waiting.len())
    }

    /// Validates and queues a request. The engine takes over the references `req.prefix` holds:
    /// a refused request's prefix is released (unless its blocks were not held to begin with).
    pub fn add_request(&mut self, mut req: GenerationRequest) -> Result<(), EngineError> {
        let grammar = match self.validate(&req).and_then(|()| self.grammar(&req)) {
            Ok(g) => g,
            Err(e) => {
                if let Some(prefix) = req.prefix.take()
                    && prefix.blocks.iter().all(|&b| self.pool.ref_count(Loc { tier: Tier::Device, block: b }) > 0)
                {
                    self.pool.free_blocks(&prefix.blocks)?;
                }
                return Err(e);
            }
        };
        let bs = self.config.block_size;
        let known = req.prompt.len() + req.generated.len();
        // A request without a prefix takes its cached prefix when admitted (`admit`), not now:
        // a waiting request holds no blocks it cannot use yet.
        if let Some(prefix) = &mut req.prefix {
            // At least one token must be computed to sample from its logits.
            while prefix.tokens >= known {
                let b = prefix.blocks.pop().expect("tokens > 0 means blocks");
                self.pool.free_blocks(&[b])?;
                prefix.tokens = prefix.blocks.len() * bs;
            }
        }
        self.next_seed = self.next_seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let seq = Sequence::new(req, self.next_seed, self.tokenizer.as_deref(), grammar)?;
        self.waiting.push_back(seq.id);
        self.seqs.insert(seq.id, seq);
        Ok(())
    }

    /// Ends a request now, freeing its blocks. Unknown ids are ignored (it may have finished).
    pub fn abort(&mut self, id: RequestId) -> Result<Option<Finished>, EngineError> {
        if !self.seqs.contains_key(&id) {
            return Ok(None);
        }
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&r| r != id);
        if let Some(swapper) = &mut self.swapper {
            swapper.abort(id);
        }
        self.finish(id, FinishReason::Aborted).map(Some)
    }

    /// Whether a sequence may take (and give) KV through the prefix cache now: a request for
    /// prompt logits computes every prompt position, so it skips the cache until it has them.
    fn uses_cache(&self, seq: &Sequence) -> bool {
        self.config.prefix_caching
            && seq.prefix_cache
            && !seq.collecting_prompt_logits(self.backend.config().vocab_size)
    }

    /// What the planner sees of a sequence. A waiting sequence that holds nothing and may use
    /// the cache is seen with the cache hit it would take when admitted (`peek` is false for
    /// those the planner cannot reach this step: they are seen without it).
    fn view(&self, seq: &Sequence, peek: bool) -> SeqView {
        let freeable = seq
            .table
            .blocks()
            .iter()
            .filter(|&&b| self.pool.ref_count(Loc { tier: Tier::Device, block: b }) == 1)
            .count();
        let base = SeqView {
            id: seq.id,
            computed: seq.computed,
            total: seq.tokens.len(),
            blocks: seq.table.len(),
            freeable,
            to_pin: 0,
        };
        if !peek || !seq.table.is_empty() || !self.uses_cache(seq) {
            return base;
        }
        let hit = self.pool.peek_device_prefix(&seq.tokens[..seq.tokens.len() - 1]);
        SeqView {
            computed: hit.blocks * self.config.block_size,
            blocks: hit.blocks,
            to_pin: hit.blocks - hit.held,
            ..base
        }
    }

    /// Starts a waiting sequence: takes its cached prefix (if it holds no KV yet) and the blocks
    /// of its first chunk of at most `num` tokens. `None` when the blocks cannot be had after
    /// all (the cache changed since planning): it keeps waiting, holding what it held before.
    fn admit(&mut self, id: RequestId, num: usize) -> Result<Option<Scheduled>, EngineError> {
        let bs = self.config.block_size;
        let uses_cache = self.uses_cache(&self.seqs[&id]);
        let seq = self.seqs.get_mut(&id).expect("admitted sequences exist");
        let mut took = false;
        if seq.table.is_empty() && uses_cache {
            let known = seq.tokens.len() - 1;
            let profile = match &self.backend {
                Backend::Emulated(e) => Some(&e.model.profile),
                Backend::Model(_) => None,
            };
            let take = worth_taking(&self.pool, profile, bs, &seq.tokens[..known], seq.tokens.len());
            let tokens = &seq.tokens[..take];
            let blocks = match &mut self.swapper {
                Some(swapper) => {
                    // Blocks on a slower tier are copied beside the step loop and the request
                    // waits for them (`take_swapped`); a prefix all on the device is taken now.
                    let job = self.pool.begin_acquire_prefix(tokens, self.clock)?;
                    if job.lower() > 0 {
                        let wait = profile.map_or(Duration::ZERO, |p| copy_time(p, &job, bs));
                        if let Err(job) = swapper.start(id, job, wait) {
                            // The copier thread is gone: copies run within the step from now on.
                            tracing::error!("the swap-in copier stopped; copying within the step");
                            self.pool.abort_swap_in(job)?;
                            self.swapper = None;
                        }
                        return Ok(None);
                    }
                    self.pool.finish_swap_in(job)?
                }
                _ => take_prefix(&mut self.pool, &mut self.swapped_in, &mut self.device_kv, self.clock, tokens)?.0,
            };
            seq.computed = blocks.len() * bs;
            seq.table.extend(blocks);
            took = true;
        }
        seq.cached_tokens.get_or_insert(seq.computed);
        let num = num.min(seq.tokens.len() - seq.computed);
        let need = (seq.computed + num).div_ceil(bs).saturating_sub(seq.table.len());
        match self.pool.alloc_blocks(need) {
            Ok(blocks) => {
                seq.table.extend(blocks);
                Ok(Some(Scheduled { id, num_tokens: num, new_blocks: need }))
            }
            Err(PoolError::OutOfBlocks { .. }) => {
                if took {
                    self.pool.free_blocks(&seq.table.take())?;
                    seq.computed = 0;
                }
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Plans and runs one step. Never fails for want of KV blocks: the planner schedules only
    /// what the pool can hold, and should an allocation fail all the same, the sequence is
    /// preempted (running) or keeps waiting (admitted), and the rest of the batch runs.
    pub fn step(&mut self) -> Result<StepOutput, EngineError> {
        let started = std::time::Instant::now();
        self.clock += 1;
        self.take_swapped(Duration::ZERO)?;
        // Only the waiting requests the planner can admit this step are seen with their cache
        // hit (peeking hashes the prompt): at most as many as free sequence slots. Requests
        // waiting for their swap-in are not seen at all.
        let reach = self.config.max_num_seqs.saturating_sub(self.running.len());
        let running: Vec<SeqView> = self.running.iter().map(|id| self.view(&self.seqs[id], false)).collect();
        let swapping = |id: &RequestId| self.swapper.as_ref().is_some_and(|s| s.is_swapping(*id));
        let waiting: Vec<SeqView> = self
            .waiting
            .iter()
            .filter(|id| !swapping(id))
            .enumerate()
            .map(|(i, id)| self.view(&self.seqs[id], i < reach))
            .collect();
        let plan = planner::plan(&PlanInput {
            config: self.config.planner(),
            free_blocks: self.pool.available(),
            running: &running,
            waiting: &waiting,
        });
        let mut out = StepOutput { preempted: plan.preempted.len(), ..StepOutput::default() };

        for &id in plan.preempted.iter().rev() {
            self.preempt(id)?;
        }
        let mut batch: Vec<Scheduled> = Vec::with_capacity(plan.batch.len());
        for s in plan.batch.iter().filter(|s| !plan.admitted.contains(&s.id)) {
            match self.pool.alloc_blocks(s.new_blocks) {
                Ok(blocks) => {
                    self.seqs.get_mut(&s.id).expect("planned sequences exist").table.extend(blocks);
                    batch.push(*s);
                }
                Err(PoolError::OutOfBlocks { .. }) => {
                    tracing::debug!(request = s.id.0, "blocks ran out after planning; preempting");
                    self.preempt(s.id)?;
                    out.preempted += 1;
                }
                Err(e) => return Err(e.into()),
            }
        }
        for s in plan.batch.iter().filter(|s| plan.admitted.contains(&s.id)) {
            let Some(scheduled) = self.admit(s.id, s.num_tokens)? else { break };
            self.waiting.retain(|&w| w != s.id);
            self.running.push(s.id);
            batch.push(scheduled);
        }
        if batch.is_empty() {
            return Ok(out);
        }

        // The step's work in the cost model's terms: what the emulated backend waits for, and
        // the decode batch the output reports (load reports keep decode-only step times).
        let bs = self.config.block_size as u64;
        let swapped = self.swapped_in.as_mut().map_or([0; 2], std::mem::take).map(|b| b as u64 * bs);
        let mut work = StepWork { swapped_in_tokens: swapped, ..StepWork::default() };
        for s in &batch {
            work.add(self.seqs[&s.id].computed, s.num_tokens);
        }
        let pieces = self.stream_pieces(&batch);
        let computed = match &mut self.backend {
            Backend::Model(model) => {
                let vocab = model.config().vocab_size;
                let steps: Vec<SeqStep<'_>> = batch
                    .iter()
                    .map(|s| {
                        let seq = &self.seqs[&s.id];
                        let end = seq.computed + s.num_tokens;
                        let collecting = seq.collecting_prompt_logits(vocab);
                        let logits = if collecting {
                            LogitsWanted::All
                        } else if end == seq.tokens.len() && seq.logprobs.is_none() && seq.sampler.is_plain_greedy() {
                            LogitsWanted::Argmax
                        } else if end == seq.tokens.len() {
                            LogitsWanted::Last
                        } else {
                            LogitsWanted::None
                        };
                        SeqStep {
                            start_pos: seq.computed,
                            tokens: &seq.tokens[seq.computed..end],
                            blocks: seq.table.blocks(),
                            logits,
                        }
                    })
                    .collect();
                let arena = self.pool.arena_mut();
                let layers = arena.geometry().layers;
                let device = &mut self.device_kv;
                let logits = match &mut self.kv_stream {
                    Some(stream) if !pieces.is_empty() => model.forward_kv(&steps, arena, device, &mut |l| {
                        pieces.iter().for_each(|p| stream.layer_written(l, layers, p));
                    })?,
                    _ => model.forward_kv(&steps, arena, device, &mut |_| {})?,
                };
                Computed::Logits(logits)
            }
            Backend::Emulated(emu) => {
                let tokens = batch
                    .iter()
                    .map(|s| {
                        let seq = &self.seqs[&s.id];
                        (seq.computed + s.num_tokens == seq.tokens.len())
                            .then(|| emu.next_token(&seq.tokens, seq.prompt_len))
                    })
                    .collect();
                match &mut self.kv_stream {
                    Some(stream) if !pieces.is_empty() => emu.run_step_layers(&work, started, &mut |l, layers| {
                        pieces.iter().for_each(|p| stream.layer_written(l, layers, p));
                    }),
                    _ => emu.run_step(&work, started),
                }
                Computed::Tokens(tokens)
            }
        };
        out.computed_tokens = batch.iter().map(|s| s.num_tokens).sum();
        out.decode_batch = work.decode_batch as usize;
        out.decode_context = work.decode_context as usize;

        let eos = self.backend.config().eos_token_ids.clone();
        let max_context = self.backend.config().max_position_embeddings;
        let vocab = self.backend.config().vocab_size;
        for (i, s) in batch.iter().enumerate() {
            let seq = self.seqs.get_mut(&s.id).expect("planned sequences exist");
            if let Computed::Logits(logits) = &computed
                && seq.collecting_prompt_logits(vocab)
            {
                let rows = logits.of(i);
                let prompt_rows = (seq.prompt_len - seq.computed).min(s.num_tokens);
                if let Some(collected) = &mut seq.prompt_logits {
                    collected.extend_from_slice(&rows[..prompt_rows * vocab]);
                }
            }
            seq.computed += s.num_tokens;
            if seq.computed < seq.tokens.len() {
                continue;
            }
            let token = match &computed {
                Computed::Logits(logits) => match logits.argmax[i] {
                    Some(token) => token,
                    None => {
                        let rows = logits.of(i);
                        seq.sampler.sample(&rows[rows.len() - logits.vocab..])
                    }
                },
                Computed::Tokens(tokens) => tokens[i].ok_or_else(|| {
                    EngineError::Internal("the emulated backend produced no token for a finished run".into())
                })?,
            };
            let logprobs = match (&computed, seq.logprobs) {
                (Computed::Logits(logits), Some(n)) => {
                    let rows = logits.of(i);
                    Some(baton_model::token_logprobs(&rows[rows.len() - logits.vocab..], token, n))
                }
                _ => None,
            };
            let reason = seq.push_token(token, &eos, self.tokenizer.as_deref(), max_context)?;
            let text_delta = seq.take_delta(reason.is_some());
            out.tokens.push(TokenEvent { id: s.id, token, text_delta, logprobs });
            if let Some(reason) = reason {
                self.running.retain(|&r| r != s.id);
                out.finished.push(self.finish(s.id, reason)?);
            }
        }
        Ok(out)
    }

    /// Finishes the swap-ins the copier is done with (waiting up to `wait` for one): each
    /// request gets its prefix on the device and waits to be admitted like one holding received
    /// KV; an aborted request's swap-in, or one whose copy failed, is given back.
    fn take_swapped(&mut self, wait: Duration) -> Result<(), EngineError> {
        let Some(swapper) = &mut self.swapper else { return Ok(()) };
        if swapper.pending() == 0 {
            return Ok(());
        }
        for f in swapper.finished(wait) {
            match self.seqs.get_mut(&f.id).filter(|_| f.usable) {
                Some(seq) => {
                    let copied: Vec<BlockId> = f.job.copies().into_iter().map(|(_, to)| to).collect();
                    let blocks = self.pool.finish_swap_in(f.job)?;
                    self.device_kv.invalidate(&copied);
                    seq.computed = blocks.len() * self.config.block_size;
                    seq.table.extend(blocks);
                }
                None => self.pool.abort_swap_in(f.job)?,
            }
        }
        Ok(())
    }

    /// The pieces of KV the batch completes for requests that stream theirs: the prompt
    /// blocks not streamed yet that are whole after the step (all of them on the prompt's last
    /// chunk, whose last block may be partial). Marks them streamed.
    fn stream_pieces(&mut self, batch: &[Scheduled]) -> Vec<KvPiece> {
        if self.kv_stream.is_none() {
            return Vec::new();
        }
        let bs = self.config.block_size;
        let mut pieces = Vec::new();
        for s in batch {
            let Some(seq) = self.seqs.get_mut(&s.id) else { continue };
            if !seq.stream_kv || seq.computed >= seq.prompt_len {
                continue;
            }
            let end_token = (seq.computed + s.num_tokens).min(seq.prompt_len);
            let end = if end_token == seq.prompt_len { end_token.div_ceil(bs) } else { end_token / bs };
            let first = seq.streamed_blocks;
            if end <= first {
                continue;
            }
            seq.streamed_blocks = end;
            let blocks = seq.table.blocks()[first..end].to_vec();
            let tokens = end_token.min(end * bs) - first * bs;
            pieces.push(KvPiece { id: s.id, first, blocks, tokens });
        }
        pieces
    }

    /// Frees a sequence's blocks, to be recomputed later (from the longest prefix the cache
    /// holds when it is admitted again, with prefix caching on). A running sequence goes back
    /// to the front of the queue; a waiting one (that held KV received from a peer) keeps its
    /// place.
    fn preempt(&mut self, id: RequestId) -> Result<(), EngineError> {
        let seq = self.seqs.get_mut(&id).expect("preempted sequences exist");
        self.pool.free_blocks(&seq.table.take())?;
        seq.streamed_blocks = 0;
        let vocab = self.backend.config().vocab_size;
        if seq.collecting_prompt_logits(vocab)
            && let Some(l) = &mut seq.prompt_logits
        {
            // Half-collected prompt logits are collected again from the first position.
            l.clear();
        }
        seq.computed = 0;
        if self.running.contains(&id) {
            self.running.retain(|&r| r != id);
            self.waiting.push_front(id);
        }
        Ok(())
    }

    fn finish(&mut self, id: RequestId, reason: FinishReason) -> Result<Finished, EngineError> {
        let mut seq = self.seqs.remove(&id).expect("finished sequences exist");
        let mut blocks = seq.table.take();
        let caches = self.config.prefix_caching && seq.prefix_cache && reason != FinishReason::Aborted;
        if caches || (seq.retain_kv != KvRetention::None && reason != FinishReason::Aborted) {
            // What stays (in the prefix cache, or for a peer) is read from the host arena by
            // tiers and peers: a block whose KV arrived device to device is brought down first.
            self.device_kv.settle(&blocks, self.pool.arena_mut())?;
        }
        if caches {
            // Every whole block with computed KV goes into the index (which takes its own hold).
            self.pool.insert(&seq.tokens[..seq.computed], &blocks, self.clock)?;
        }
        let bs = self.config.block_size;
        let kv = match seq.retain_kv {
            _ if reason == FinishReason::Aborted => None,
            KvRetention::None => None,
            KvRetention::PromptBlocks => {
                // Keep the whole blocks of the prompt; the rest goes back.
                let keep = (seq.prompt_len.min(seq.computed) / bs).min(blocks.len());
                let kept: Vec<_> = blocks.drain(..keep).collect();
                Some(KvPrefix { tokens: kept.len() * bs, blocks: kept })
            }
            KvRetention::All => {
                let kept: Vec<_> = blocks.drain(..seq.computed.div_ceil(bs).min(blocks.len())).collect();
                Some(KvPrefix { blocks: kept, tokens: seq.computed })
            }
        };
        self.pool.free_blocks(&blocks)?;
        let text_tail = seq.take_delta(true);
        debug_assert!(text_tail.is_empty() || reason == FinishReason::Aborted || self.tokenizer.is_some());
        let prompt_logits = seq.prompt_logits.take().filter(|l| !l.is_empty());
        Ok(Finished {
            id,
            reason,
            prompt_tokens: seq.prompt_len,
            cached_tokens: seq.cached_tokens.unwrap_or(0),
            token_ids: seq.generated().to_vec(),
            text: seq.text,
            prompt_logits,
            kv,
        })
    }

    /// Runs until every queued request has finished and returns them in finishing order.
    pub fn run_to_completion(&mut self) -> Result<Vec<Finished>, EngineError> {
        let mut done = Vec::new();
        while self.has_work() {
            let out = self.step()?;
            if out.computed_tokens == 0 && out.preempted == 0 && out.finished.is_empty() {
                if self.swapper.as_ref().is_some_and(|s| s.pending() > 0) {
                    self.take_swapped(Duration::from_secs(10))?;
                    continue;
                }
                return Err(EngineError::Internal("no progress: nothing fits in the KV cache".into()));
            }
            done.extend(out.finished);
        }
        Ok(done)
    }
}

/// How long an emulated engine's copier takes for `job`: its blocks over the profile's host and
/// disk links.
fn copy_time(p: &CostProfile, job: &SwapIn, bs: usize) -> Duration {
    let (mut host, mut disk) = (0, 0);
    for (from, _) in job.copies() {
        match from.tier {
            Tier::Disk => disk += bs as u64,
            _ => host += bs as u64,
        }
    }
    let us = |tokens, link| if tokens == 0 { 0 } else { p.kv_transfer_time(tokens, link) };
    Duration::from_micros(us(host, p.host_to_device) + us(disk, p.disk_to_device))
}

/// [`MemPool::acquire_prefix`], adding to `swapped_in` the blocks it brings onto the device from
/// the (host, disk) tiers (along a cached prefix the tiers only get slower, so they come last).
/// The blocks it copies are marked stale on the model's device (`device_kv`), which reads them
/// afresh (the copier thread's swap-ins mark theirs when they finish, `take_swapped`).
fn take_prefix(
    pool: &mut MemPool,
    swapped_in: &mut Option<[usize; 2]>,
    device_kv: &mut DeviceKv,
    clock: u64,
    tokens: &[u32],
) -> Result<(Vec<BlockId>, usize), PoolError> {
    let Some(swapped) = swapped_in else { return pool.acquire_prefix(tokens, clock) };
    let [device, host, _] = pool.peek_prefix(tokens);
    let (blocks, covered) = pool.acquire_prefix(tokens, clock)?;
    let lower = blocks.len().saturating_sub(device);
    let from_host = lower.min(host);
    swapped[0] += from_host;
    swapped[1] += lower - from_host;
    device_kv.invalidate(&blocks[blocks.len() - lower..]);
    Ok((blocks, covered))
}

/// How many leading tokens of `known` (a prompt of `prompt_len` tokens, less its last) to take
/// from the prefix cache: all it holds, unless the cost profile says that copying the blocks
/// on a slower tier (the request waits for the copy) takes longer than computing them again;
/// then as far as the copy pays (device only, or device and host). A block left behind is
/// computed again, and the new one takes its place in the index.
///
/// Only an engine that knows its costs weighs this: an emulated one, whose profile may put a
/// 70B model's KV behind a disk slower than its GPUs (4,096 tokens from a 6 GB/s disk take
/// 224 ms, computing them 155 ms). The CPU backend always loads: recomputing is its slow side.
fn worth_taking(pool: &MemPool, profile: Option<&CostProfile>, bs: usize, known: &[u32], prompt_len: usize) -> usize {
    let Some(p) = profile else { return known.len() };
    let [device, host, disk] = pool.peek_prefix(known);
    if host + disk == 0 {
        return known.len();
    }
    let tokens = |blocks: usize| (blocks * bs) as u64;
    let copy = |blocks: usize, link| if blocks == 0 { 0 } else { p.kv_transfer_time(tokens(blocks), link) };
    let (to_host, to_disk) = (copy(host, p.host_to_device), copy(disk, p.disk_to_device));
    let options = [(device, 0), (device + host, to_host), (device + host + disk, to_host + to_disk)];
    let cost =
        |&(blocks, copy_us): &(usize, Micros)| copy_us + p.prefill_time_cached(prompt_len as u64, tokens(blocks));
    match options.iter().min_by_key(|o| cost(o)) {
        Some(&(blocks, _)) if blocks < device + host + disk => blocks * bs,
        _ => known.len(),
    }
}
