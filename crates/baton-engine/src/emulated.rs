//! The emulated backend (like Dynamo's mocker): the engine loop, the planner and the KV pool run
//! for real, but a step's forward pass is replaced by waiting for the time a cost model predicts
//! and producing deterministic tokens.
//!
//! What stays real: admission, continuous batching and chunked prefill ([`planner`](crate::planner)),
//! block allocation, preemption, prefix caching and KV events ([`MemPool`](baton_kv::MemPool)),
//! stop conditions, detokenisation, KV retention and hand-over. What is emulated:
//!
//! - **time**: each step costs [`CostProfile::batch_time`] of its work (prefill chunks, decode
//!   batch and context). With [`EmulatedClock::Sleep`] a prefix brought back from the host
//!   and disk tiers is copied beside the step loop, and the copier waits for the profile's
//!   `host_to_device` / `disk_to_device` links; with [`EmulatedClock::Virtual`] the copy runs
//!   within the step, which costs it too. With [`EmulatedClock::Sleep`]
//!   the step returns that long after it started (wall time, for a live cluster of emulated
//!   workers); with [`EmulatedClock::Virtual`] it returns at once and only
//!   [`Engine::emulated_clock`](crate::Engine::emulated_clock) advances.
//! - **tokens**: the next token is a hash of the sequence's last token and its position, within the
//!   vocabulary and never an end-of-sequence token (unless [`EmulatedModel::eos_after`] asks), so
//!   a request runs to exactly `max_tokens` and its output does not depend on batching.
//! - **KV bytes**: the arena has the geometry of [`EmulatedKv`] (one tiny head by default), so a
//!   worker that accounts for a 70B model's thousands of blocks needs megabytes, not gigabytes.
//!   Transfers still copy those bytes.
//!
//! `baton-engine` depends on `baton-sched` for [`CostProfile`] (the profile file `baton profile`
//! writes and `baton sim --profile` reads); `baton-sched` depends only on `baton-kv`, so there is
//! no cycle.

use std::time::{Duration, Instant};

use baton_kv::KvGeometry;
use baton_model::ModelConfig;
use baton_sched::{CostProfile, Micros};

/// How an emulated step spends its predicted time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EmulatedClock {
    /// Sleep until the predicted time has passed since the step began (a live emulated worker).
    #[default]
    Sleep,
    /// Return at once; only the engine's emulated clock advances (tests, offline replays).
    Virtual,
}

/// Geometry of the emulated arena (what the KV bytes look like; the block accounting is real).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmulatedKv {
    /// Layers.
    pub layers: usize,
    /// KV heads per layer.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

impl Default for EmulatedKv {
    /// One layer of one head of 4 elements: 32 bytes of KV per token.
    fn default() -> Self {
        Self { layers: 1, kv_heads: 1, head_dim: 4 }
    }
}

/// A model the engine emulates instead of computing: its configuration (vocabulary, end tokens,
/// context length — usually that of the real model whose tokenizer is used) and the cost profile
/// whose step times it reproduces (e.g. LLaMA-2-70B on 8×H100, or a fitted CPU profile).
#[derive(Debug, Clone)]
pub struct EmulatedModel {
    /// Vocabulary size, end-of-sequence tokens and context length come from here.
    pub config: ModelConfig,
    /// Step times.
    pub profile: CostProfile,
    /// Geometry of the (small) arena.
    pub kv: EmulatedKv,
    /// Sleep or virtual time.
    pub clock: EmulatedClock,
    /// Emit an end-of-sequence token as the `n`-th generated token (requests that honour EOS
    /// stop there); `None`: never.
    pub eos_after: Option<usize>,
    /// Seed of the token hash (different seeds, different texts).
    pub seed: u64,
}

impl EmulatedModel {
    /// An emulated model with the default small arena, sleeping, never emitting EOS.
    pub fn new(config: ModelConfig, profile: CostProfile) -> Self {
        Self { config, profile, kv: EmulatedKv::default(), clock: EmulatedClock::Sleep, eos_after: None, seed: 0 }
    }

    pub(crate) fn kv_geometry(&self, block_size: usize) -> KvGeometry {
        KvGeometry::new(self.kv.layers, self.kv.kv_heads, self.kv.head_dim, block_size)
    }
}

/// Emulated time so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EmulatedStats {
    /// Steps that computed something.
    pub steps: u64,
    /// Predicted time of all of them.
    pub total_us: Micros,
    /// Predicted time of the last one.
    pub last_step_us: Micros,
}

/// The work of one step, in the cost model's terms.
#[derive(Debug, Clone, Default)]
pub(crate) struct StepWork {
    /// Prefill chunks `(start, end)`.
    pub(crate) prefill: Vec<(u64, u64)>,
    /// Decoding sequences.
    pub(crate) decode_batch: u64,
    /// Their context, tokens in all.
    pub(crate) decode_context: u64,
    /// Tokens of KV brought onto the device from the (host, disk) tiers within this step (no
    /// copier thread: the virtual clock): their copy, over the profile's links, stalls it.
    pub(crate) swapped_in_tokens: [u64; 2],
}

impl StepWork {
    /// Adds one scheduled sequence: `num_tokens` tokens from position `computed`. One token after
    /// some KV is a decode (a one-token prompt remainder costs the same); anything else a chunk.
    pub(crate) fn add(&mut self, computed: usize, num_tokens: usize) {
        if num_tokens == 1 && computed > 0 {
            self.decode_batch += 1;
            self.decode_context += computed as u64 + 1;
        } else {
            self.prefill.push((computed as u64, (computed + num_tokens) as u64));
        }
    }
}

/// The emulated backend's state inside an engine.
#[derive(Debug)]
pub(crate) struct Emulator {
    pub(crate) model: EmulatedModel,
    pub(crate) stats: EmulatedStats,
}

impl Emulator {
    pub(crate) fn new(model: EmulatedModel) -> Self {
        Self { model, stats: EmulatedStats::default() }
    }

    /// Spends the step's predicted time (sleeping from `started`, or on the virtual clock).
    pub(crate) fn run_step(&mut self, work: &StepWork, started: Instant) {
        let us = self.step_time(work);
        self.sleep_until(started, us);
    }

    fn sleep_until(&self, started: Instant, us: Micros) {
        if self.model.clock == EmulatedClock::Sleep {
            let target = Duration::from_micros(us);
            let spent = started.elapsed();
            if target > spent {
                std::thread::sleep(target - spent);
            }
        }
    }

    /// [`run_step`](Self::run_step), calling `layer_written(l, layers)` for each of the emulated
    /// model's layers (the profile's, else the configuration's) as the step's time reaches
    /// `(l + 1) / layers` of it: when a GPU would have written that layer's KV.
    pub(crate) fn run_step_layers(
        &mut self,
        work: &StepWork,
        started: Instant,
        layer_written: &mut dyn FnMut(usize, usize),
    ) {
        let us = self.step_time(work);
        let layers = self.model.profile.layers.map_or(self.model.config.num_layers, |l| l as usize).max(1);
        for l in 0..layers {
            self.sleep_until(started, us * (l as u64 + 1) / layers as u64);
            layer_written(l, layers);
        }
    }

    /// The step's predicted time, counted in the stats.
    fn step_time(&mut self, work: &StepWork) -> Micros {
        let p = &self.model.profile;
        let [host, disk] = work.swapped_in_tokens;
        let swap_us = |tokens, link| if tokens == 0 { 0 } else { p.kv_transfer_time(tokens, link) };
        let us = p.batch_time(&work.prefill, work.decode_batch, work.decode_context)
            + swap_us(host, p.host_to_device)
            + swap_us(disk, p.disk_to_device);
        self.stats.steps += 1;
        self.stats.total_us += us;
        self.stats.last_step_us = us;
        us
    }

    /// The token after `tokens` (prompt then generated; `prompt_len` of them are the prompt).
    pub(crate) fn next_token(&self, tokens: &[u32], prompt_len: usize) -> u32 {
        let cfg = &self.model.config;
        let generated = tokens.len().saturating_sub(prompt_len);
        if let (Some(n), Some(&eos)) = (self.model.eos_after, cfg.eos_token_ids.first())
            && generated + 1 >= n
        {
            return eos;
        }
        let vocab = cfg.vocab_size.max(1) as u64;
        let last = u64::from(tokens.last().copied().unwrap_or(0));
        let mut h = splitmix64(self.model.seed ^ (tokens.len() as u64).rotate_left(32) ^ last);
        let avoid = |t: u32| cfg.eos_token_ids.contains(&t) || cfg.bos_token_id == Some(t);
        loop {
            let t = (h % vocab) as u32;
            if !avoid(t) || vocab <= (cfg.eos_token_ids.len() + 1) as u64 {
                return t;
            }
            h = splitmix64(h);
        }
    }
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}
