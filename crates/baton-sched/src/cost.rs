//! The cost model: how long a prefill, a decode step and a KV transfer take.
//!
//! MemServe (§5.3) predicts the execution time `exec(x, y)` of prefilling a prompt of `x` tokens
//! whose leading fraction `y` is cached, from operator-level terms: GEMMs cost time linear in the
//! tokens computed, attention quadratic in the prompt, and "constant" operators a fixed amount.
//! Baton uses the same shape:
//!
//! ```text
//! prefill_time(x, y) = fixed + per_token · n + attention · (x² − c²)      c = ⌊x·y⌋, n = x − c
//! decode_step(b, C)  = fixed + per_seq · b + per_context_token · C        b sequences, C tokens of context
//! transfer_time(B)   = latency + B / bandwidth
//! ```
//!
//! (`x² − c²` is, up to a constant folded into the coefficient, the number of query–key pairs of
//! causal attention for the `n` new tokens over all `x`.) A [`CostProfile`] holds the
//! coefficients; it is either fitted by least squares from measured samples ([`fit_prefill`],
//! [`fit_decode`], so a profiling command can write it as JSON) or derived from published hardware
//! figures ([`CostProfile::llama2_70b_8xa800`], [`CostProfile::llama2_70b_8xh100`]).
//!
//! Time is integer microseconds ([`Micros`]) everywhere outside the coefficients.

use serde::{Deserialize, Serialize};

use crate::Micros;

/// Coefficients of `prefill_time`, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PrefillCoeffs {
    /// Per-prefill constant (launches, weight reads, constant operators).
    pub fixed_us: f64,
    /// Per computed token (the GEMMs: QKV, output projection, MLP).
    pub per_token_us: f64,
    /// Per unit of `x² − c²` (causal attention of the new tokens over the whole prompt).
    pub attention_us: f64,
}

/// Coefficients of `decode_step`, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DecodeCoeffs {
    /// Per step (reading the weights once: decode is memory-bound).
    pub fixed_us: f64,
    /// Per sequence in the batch (GEMM rows, sampling).
    pub per_seq_us: f64,
    /// Per token of context over the whole batch (reading the KV cache).
    pub per_context_token_us: f64,
}

/// A network path between two instances.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Link {
    /// Sustained bandwidth, bytes per second (non-zero).
    pub bytes_per_s: u64,
    /// One-way setup latency, microseconds.
    pub latency_us: Micros,
}

/// The time of `bytes` over `link`, rounded up to whole microseconds.
pub fn transfer_time(bytes: u64, link: Link) -> Micros {
    if bytes == 0 {
        return 0;
    }
    let bw = u128::from(link.bytes_per_s.max(1));
    let us = (u128::from(bytes) * 1_000_000).div_ceil(bw);
    link.latency_us.saturating_add(u64::try_from(us).unwrap_or(u64::MAX))
}

/// Everything the scheduler and the simulator need to put a time on work: model shape (KV bytes
/// per token), prefill and decode coefficients, and the hardware's links.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CostProfile {
    /// What this profile describes (model, hardware).
    pub name: String,
    /// Where the figures come from.
    pub source: String,
    /// Bytes of KV per token of context on one instance (`2·L·H_kv·D·sizeof(dtype)`).
    pub kv_bytes_per_token: u64,
    /// The model's transformer layers (`L`), when known: a step writes its KV in this many
    /// pieces, which layer-wise streaming sends as each is done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<u32>,
    /// Prefill coefficients.
    pub prefill: PrefillCoeffs,
    /// Decode coefficients.
    pub decode: DecodeCoeffs,
    /// Default instance-to-instance link (the NIC; bandwidth per instance).
    pub network: Link,
    /// Host DRAM → device link, for cached blocks that must be loaded before use.
    pub host_to_device: Link,
    /// Disk → device link.
    pub disk_to_device: Link,
}

fn to_micros(v: f64) -> Micros {
    if v.is_finite() && v > 0.0 { v.round() as Micros } else { 0 }
}

impl CostProfile {
    /// Prefill time of a prompt of `tokens` tokens whose leading fraction `cached_ratio` (0..=1)
    /// is already in KV. MemServe's `exec(x, y)`.
    pub fn prefill_time(&self, tokens: u64, cached_ratio: f64) -> Micros {
        let y = if cached_ratio.is_finite() { cached_ratio.clamp(0.0, 1.0) } else { 0.0 };
        let x = tokens as f64;
        self.prefill_time_cached(tokens, (x * y).floor() as u64)
    }

    /// Prefill time of `tokens` tokens of which the first `cached` are in KV.
    pub fn prefill_time_cached(&self, tokens: u64, cached: u64) -> Micros {
        let c = cached.min(tokens) as f64;
        let x = tokens as f64;
        let p = &self.prefill;
        to_micros(p.fixed_us + p.per_token_us * (x - c) + p.attention_us * (x * x - c * c))
    }

    /// One decode step of `batch` sequences holding `total_context` tokens of KV between them.
    pub fn decode_step(&self, batch: u64, total_context: u64) -> Micros {
        if batch == 0 {
            return 0;
        }
        let d = &self.decode;
        to_micros(d.fixed_us + d.per_seq_us * batch as f64 + d.per_context_token_us * total_context as f64)
    }

    /// One engine step of continuous batching: prefill chunks (`(start, end)`: tokens `start..end`
    /// of a prompt computed, the first `start` already in KV) and `decode_batch` decoding sequences
    /// with `decode_context` tokens of context between them, in one forward pass.
    ///
    /// The weights are read once per step, so a mixed step pays the larger fixed term once; each
    /// chunk adds its tokens' GEMMs and its attention (`end² − start²`), each decoding sequence its
    /// per-sequence and context terms. A step of one chunk `(c, x)` takes exactly
    /// [`prefill_time_cached(x, c)`](Self::prefill_time_cached), a pure decode step exactly
    /// [`decode_step`](Self::decode_step). This is what the emulated backend of `baton-engine`
    /// waits for per step.
    pub fn batch_time(&self, prefill_chunks: &[(u64, u64)], decode_batch: u64, decode_context: u64) -> Micros {
        if prefill_chunks.is_empty() {
            return self.decode_step(decode_batch, decode_context);
        }
        let p = &self.prefill;
        let d = &self.decode;
        let mut us = if decode_batch > 0 { p.fixed_us.max(d.fixed_us) } else { p.fixed_us };
        for &(start, end) in prefill_chunks {
            let (c, x) = (start.min(end) as f64, end as f64);
            us += p.per_token_us * (x - c) + p.attention_us * (x * x - c * c);
        }
        if decode_batch > 0 {
            us += d.per_seq_us * decode_batch as f64 + d.per_context_token_us * decode_context as f64;
        }
        to_micros(us)
    }

    /// Bytes of KV of `tokens` tokens.
    pub fn kv_bytes(&self, tokens: u64) -> u64 {
        tokens.saturating_mul(self.kv_bytes_per_token)
    }

    /// Time to move the KV of `tokens` tokens over `link`.
    pub fn kv_transfer_time(&self, tokens: u64, link: Link) -> Micros {
        transfer_time(self.kv_bytes(tokens), link)
    }

    /// Serialises the profile (the profile file a profiling command writes).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Parses a profile file.
    pub fn from_json(s: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(s)
    }

    /// A LLaMA-2-70B-class model served by one instance of 8×A800-SXM4-80GB (tensor parallel 8),
    /// from a roofline of published figures:
    ///
    /// - model (Touvron et al., "Llama 2", arXiv:2307.09288, Table 1 and §2.2): 69·10⁹ parameters,
    ///   80 layers, hidden size 8192, grouped-query attention with 8 KV heads of dimension 128, BF16;
    ///   so 2·80·8·128·2 = 327,680 KV bytes per token and ≈2·69·10⁹ FLOPs per prompt token.
    /// - GPU (NVIDIA A100/A800 80GB SXM datasheet): 312 TFLOP/s dense BF16, 2,039 GB/s HBM2e.
    ///   We assume 50% of peak FLOPs in prefill (model-FLOPs utilisation typical of Megatron-style
    ///   TP=8 prefill) and 80% of peak memory bandwidth in decode.
    /// - attention FLOPs of causal prefill: 2·d·L·(x² − c²) (QKᵀ and AV, multiply-add, halved for
    ///   the causal mask) = 1.31·10⁶·(x² − c²).
    /// - decode step: the 138 GB of weights are read once per step (≈10.6 ms at 80% of 8×2,039 GB/s);
    ///   each token of context reads 327,680 bytes of KV (0.025 µs); each sequence costs its GEMM FLOPs
    ///   (the sum is an upper bound of the roofline's max(compute, memory)).
    /// - network: Mooncake (§7.1, arXiv:2407.00079) nodes have RDMA NICs of up to 800 Gbps
    ///   (100 GB/s); host→device is 8 PCIe 4.0 ×16 links at ≈25 GB/s each; NVMe at 6 GB/s.
    pub fn llama2_70b_8xa800() -> Self {
        Self::llama2_70b(
            "llama2-70b/8xA800",
            "roofline: Llama 2 paper (shape), NVIDIA A800 SXM datasheet (312 TFLOP/s BF16, 2039 GB/s), Mooncake §7.1 (800 Gbps RDMA)",
            8.0 * 312e12,
            8.0 * 2039e9,
            100_000_000_000,
        )
    }

    /// The same model on 8×H100-SXM5-80GB (NVIDIA H100 datasheet: 989 TFLOP/s dense BF16,
    /// 3,350 GB/s HBM3), same utilisation assumptions as [`llama2_70b_8xa800`](Self::llama2_70b_8xa800),
    /// 8×400 Gbps NICs (400 GB/s in all).
    pub fn llama2_70b_8xh100() -> Self {
        Self::llama2_70b(
            "llama2-70b/8xH100",
            "roofline: Llama 2 paper (shape), NVIDIA H100 SXM datasheet (989 TFLOP/s BF16, 3350 GB/s), 8x400 Gbps NICs",
            8.0 * 989e12,
            8.0 * 3350e9,
            400_000_000_000,
        )
    }

    fn llama2_70b(name: &str, source: &str, peak_flops: f64, peak_mem_bw: f64, nic: u64) -> Self {
        const PARAMS: f64 = 69e9;
        const LAYERS: f64 = 80.0;
        const HIDDEN: f64 = 8192.0;
        const KV_BYTES_PER_TOKEN: u64 = 2 * 80 * 8 * 128 * 2;
        let flops = peak_flops * 0.5;
        let mem = peak_mem_bw * 0.8;
        let weight_bytes = PARAMS * 2.0;
        Self {
            name: name.to_owned(),
            source: source.to_owned(),
            kv_bytes_per_token: KV_BYTES_PER_TOKEN,
            layers: Some(LAYERS as u32),
            prefill: PrefillCoeffs {
                fixed_us: weight_bytes / mem * 1e6,
                per_token_us: 2.0 * PARAMS / flops * 1e6,
                attention_us: 2.0 * HIDDEN * LAYERS / flops * 1e6,
            },
            decode: DecodeCoeffs {
                fixed_us: weight_bytes / mem * 1e6,
                per_seq_us: 2.0 * PARAMS / flops * 1e6,
                per_context_token_us: KV_BYTES_PER_TOKEN as f64 / mem * 1e6,
            },
            network: Link { bytes_per_s: nic, latency_us: 20 },
            host_to_device: Link { bytes_per_s: 200_000_000_000, latency_us: 10 },
            disk_to_device: Link { bytes_per_s: 6_000_000_000, latency_us: 100 },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_is_monotone_and_cache_helps() {
        let p = CostProfile::llama2_70b_8xa800();
        let t8k = p.prefill_time(8192, 0.0);
        let t16k = p.prefill_time(16384, 0.0);
        assert!(t16k > 2 * t8k - p.prefill.fixed_us as u64, "attention makes it superlinear");
        assert!(p.prefill_time(16384, 0.5) < t16k);
        assert_eq!(p.prefill_time(16384, 1.0), p.prefill.fixed_us.round() as u64);
        // An 8k prompt on 8×A800 takes about a second (roofline), not milliseconds or minutes.
        assert!((500_000..2_000_000).contains(&t8k), "{t8k}");
    }

    #[test]
    fn decode_and_transfer_are_sane() {
        let p = CostProfile::llama2_70b_8xa800();
        assert_eq!(p.decode_step(0, 0), 0);
        let one = p.decode_step(1, 1000);
        assert!((8_000..20_000).contains(&one), "{one}");
        assert!(p.decode_step(64, 64 * 16_000) > 2 * one);
        // 1 GB over 100 GB/s: 10 ms plus latency.
        assert_eq!(transfer_time(1_000_000_000, Link { bytes_per_s: 100_000_000_000, latency_us: 20 }), 10_020);
        assert_eq!(transfer_time(0, p.network), 0);
    }

    #[test]
    fn batch_time_reduces_to_prefill_and_decode() {
        let p = CostProfile::llama2_70b_8xa800();
        assert_eq!(p.batch_time(&[(512, 2048)], 0, 0), p.prefill_time_cached(2048, 512));
        assert_eq!(p.batch_time(&[], 8, 8000), p.decode_step(8, 8000));
        assert_eq!(p.batch_time(&[], 0, 0), 0);
        // A mixed step reads the weights once: cheaper than the two steps apart.
        let mixed = p.batch_time(&[(0, 1024)], 8, 8000);
        assert!(mixed < p.prefill_time(1024, 0.0) + p.decode_step(8, 8000));
        assert!(mixed > p.prefill_time(1024, 0.0));
    }

    #[test]
    fn profile_round_trips_through_json() {
        let p = CostProfile::llama2_70b_8xh100();
        assert_eq!(CostProfile::from_json(&p.to_json()).ok(), Some(p));
    }
}
