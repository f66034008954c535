//! Where a model computes (`--device cpu|cuda[:N]`) and in what type (`--dtype`), and the host
//! side of a device's step: a batch packed into the flat index arrays its kernels read.
//!
//! Everything here is plain data, compiled with or without the `cuda` feature, so the packing
//! the CUDA backend relies on is unit-tested on any machine.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use crate::error::{ModelError, Result};
use crate::model::{LogitsWanted, SeqStep};

/// The device a model computes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ComputeDevice {
    /// The host's cores (the default).
    #[default]
    Cpu,
    /// CUDA device `N` (`cuda` is `cuda:0`).
    Cuda(usize),
}

impl FromStr for ComputeDevice {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Self::Cuda(n)),
                _ => Err(format!("unknown device `{s}`: expected `cpu`, `cuda` or `cuda:N`")),
            },
        }
    }
}

impl fmt::Display for ComputeDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// The type a device backend keeps weights and activations in. The CPU backend computes in
/// float32 whatever is asked (its weights stay as stored: float32 or GGUF blocks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ComputeDtype {
    /// bfloat16 on a GPU, float32 on the CPU (the default).
    #[default]
    Auto,
    /// float32: on a GPU, for checking its kernels against the CPU engine token for token.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE float16.
    F16,
}

impl FromStr for ComputeDtype {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "float32" | "f32" => Ok(Self::F32),
            "bfloat16" | "bf16" => Ok(Self::Bf16),
            "float16" | "f16" | "half" => Ok(Self::F16),
            _ => Err(format!("unknown dtype `{s}`: expected auto, float32, bfloat16 or float16")),
        }
    }
}

impl fmt::Display for ComputeDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::F32 => "float32",
            Self::Bf16 => "bfloat16",
            Self::F16 => "float16",
        })
    }
}

/// Where and how a model is loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeviceOptions {
    /// The device.
    pub device: ComputeDevice,
    /// The compute type (a GPU's; the CPU computes in float32).
    pub dtype: ComputeDtype,
}

/// A device's limits, measured: what `baton bench engine --device cuda` sets its figures beside.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct DeviceLimits {
    /// Device-to-device copy, bytes read plus bytes written per second (GB/s): the memory
    /// roofline of a step that reads its bytes once.
    pub copy_gb_s: f64,
    /// TFLOP/s of one large bfloat16 GEMM.
    pub gemm_tflops: f64,
}

impl ComputeDevice {
    /// Measures the device's copy bandwidth and GEMM peak; `None` for the CPU (whose benchmark
    /// measures its memory bandwidth itself). An error where the device is missing or this
    /// build has no support for it.
    pub fn measure_limits(self) -> Result<Option<DeviceLimits>> {
        match self {
            Self::Cpu => Ok(None),
            #[cfg(feature = "cuda")]
            Self::Cuda(n) => crate::cuda::measure_limits(n).map(Some),
            #[cfg(not(feature = "cuda"))]
            Self::Cuda(_) => Err(ModelError::Device(NO_CUDA.into())),
        }
    }
}

/// The error of a CUDA request to a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub(crate) const NO_CUDA: &str =
    "this baton was built without CUDA support: rebuild with `cargo build --release --features cuda`";

/// A batch step flattened for a device: one entry per new token (row) and one block table per
/// sequence, as the kernels index them. Built and checked on the host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPack {
    /// Token id of each row.
    pub ids: Vec<u32>,
    /// Position of each row in its sequence.
    pub pos: Vec<i32>,
    /// KV block each row's keys and values go to.
    pub block: Vec<u32>,
    /// Slot in that block.
    pub slot: Vec<i32>,
    /// Where each row's sequence's block table starts in `tables`.
    pub table_start: Vec<i32>,
    /// Every sequence's block table (as far as its last new token needs), one after another.
    pub tables: Vec<u32>,
    /// Rows whose logits are wanted, in batch order.
    pub logit_rows: Vec<i32>,
    /// For each sequence, its range of `logit_rows`.
    pub ranges: Vec<Range<usize>>,
    /// For each sequence, whether it wants only the argmax of its logits.
    pub argmax: Vec<bool>,
}

impl StepPack {
    /// Packs `batch`, refusing what the CPU backend refuses: an empty batch, a token outside
    /// the vocabulary, a block table too short for the positions.
    pub fn new(batch: &[SeqStep<'_>], block_size: usize, vocab: usize) -> Result<Self> {
        let mut p = Self::default();
        for s in batch {
            s.check(block_size, vocab)?;
            let end = s.start_pos + s.tokens.len();
            let start = i32::try_from(p.tables.len())
                .map_err(|_| ModelError::InvalidInput("block tables too large for one step".into()))?;
            let used = end.div_ceil(block_size);
            p.tables.extend(s.blocks[..used].iter().map(|b| b.0));
            let row0 = p.ids.len();
            for (i, &t) in s.tokens.iter().enumerate() {
                let pos = s.start_pos + i;
                p.ids.push(t);
                p.pos.push(pos as i32);
                p.block.push(s.blocks[pos / block_size].0);
                p.slot.push((pos % block_size) as i32);
                p.table_start.push(start);
            }
            let first = p.logit_rows.len();
            p.logit_rows.extend(s.logit_rows().map(|r| (row0 + r) as i32));
            p.ranges.push(first..p.logit_rows.len());
            p.argmax.push(s.logits == LogitsWanted::Argmax);
        }
        if p.ids.is_empty() {
            return Err(ModelError::InvalidInput("empty batch".into()));
        }
        Ok(p)
    }

    /// Rows (new tokens) in the step.
    pub fn rows(&self) -> usize {
        self.ids.len()
    }

    /// Every integer array, one after another, as the one upload a step makes:
    /// ids, pos, block, slot, table_start (`rows` each), logit_rows, tables. Returns the words
    /// and the offset of each array in them.
    pub fn words(&self) -> (Vec<u32>, PackOffsets) {
        let n = self.rows();
        let mut w = Vec::with_capacity(5 * n + self.logit_rows.len() + self.tables.len());
        w.extend_from_slice(&self.ids);
        w.extend(self.pos.iter().map(|&x| x as u32));
        w.extend_from_slice(&self.block);
        w.extend(self.slot.iter().map(|&x| x as u32));
        w.extend(self.table_start.iter().map(|&x| x as u32));
        w.extend(self.logit_rows.iter().map(|&x| x as u32));
        w.extend_from_slice(&self.tables);
        let off = PackOffsets {
            ids: 0,
            pos: n,
            block: 2 * n,
            slot: 3 * n,
            table_start: 4 * n,
            logit_rows: 5 * n,
            tables: 5 * n + self.logit_rows.len(),
        };
        (w, off)
    }
}

/// Word offsets of [`StepPack::words`]' arrays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackOffsets {
    /// Token ids.
    pub ids: usize,
    /// Positions.
    pub pos: usize,
    /// Each row's block.
    pub block: usize,
    /// Each row's slot.
    pub slot: usize,
    /// Each row's table start.
    pub table_start: usize,
    /// Rows whose logits are wanted.
    pub logit_rows: usize,
    /// Block tables.
    pub tables: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_kv::BlockId;

    #[test]
    fn devices_and_dtypes_parse_as_vllm_spells_them() {
        assert_eq!("cpu".parse(), Ok(ComputeDevice::Cpu));
        assert_eq!("cuda".parse(), Ok(ComputeDevice::Cuda(0)));
        assert_eq!("cuda:3".parse(), Ok(ComputeDevice::Cuda(3)));
        assert!("gpu".parse::<ComputeDevice>().is_err());
        assert!("cuda:x".parse::<ComputeDevice>().is_err());
        assert_eq!(ComputeDevice::Cuda(1).to_string(), "cuda:1");
        assert_eq!("bfloat16".parse(), Ok(ComputeDtype::Bf16));
        assert_eq!("float32".parse(), Ok(ComputeDtype::F32));
        assert!("int8".parse::<ComputeDtype>().is_err());
    }

    #[test]
    fn a_mixed_batch_packs_rows_slots_and_tables() {
        let b = |v: &[u32]| v.iter().map(|&x| BlockId(x)).collect::<Vec<_>>();
        let (t0, t1) = (b(&[7, 3, 9]), b(&[4, 5]));
        // A prefill chunk at positions 3..6 (block size 4: the chunk crosses into block 3), and
        // a decode token at position 5 of a sequence with a spare block in its table.
        let batch = [
            SeqStep { start_pos: 3, tokens: &[10, 11, 12], blocks: &t0, logits: LogitsWanted::Last },
            SeqStep { start_pos: 5, tokens: &[20], blocks: &t1, logits: LogitsWanted::All },
        ];
        let p = StepPack::new(&batch, 4, 100).expect("packs");
        assert_eq!(p.ids, [10, 11, 12, 20]);
        assert_eq!(p.pos, [3, 4, 5, 5]);
        assert_eq!(p.block, [7, 3, 3, 5]);
        assert_eq!(p.slot, [3, 0, 1, 1]);
        assert_eq!(p.tables, [7, 3, 4, 5], "only the blocks the positions reach");
        assert_eq!(p.table_start, [0, 0, 0, 2]);
        assert_eq!(p.logit_rows, [2, 3]);
        assert_eq!(p.ranges, [0..1, 1..2]);
        let (w, off) = p.words();
        assert_eq!(&w[off.block..off.block + 4], &[7, 3, 3, 5]);
        assert_eq!(&w[off.logit_rows..off.tables], &[2, 3]);
        assert_eq!(&w[off.tables..], &[7, 3, 4, 5]);
    }

    #[test]
    fn packing_refuses_what_the_cpu_refuses() {
        let t = [BlockId(0)];
        let long = [SeqStep { start_pos: 3, tokens: &[1, 2], blocks: &t, logits: LogitsWanted::Last }];
        assert!(StepPack::new(&long, 4, 10).is_err(), "five positions in one block of four");
        let bad = [SeqStep { start_pos: 0, tokens: &[10], blocks: &t, logits: LogitsWanted::Last }];
        assert!(StepPack::new(&bad, 4, 10).is_err(), "token outside the vocabulary");
        assert!(StepPack::new(&[], 4, 10).is_err(), "empty batch");
        let none = [SeqStep { start_pos: 0, tokens: &[1, 2], blocks: &t, logits: LogitsWanted::None }];
        let p = StepPack::new(&none, 4, 10).expect("packs");
        assert!(p.logit_rows.is_empty());
        assert_eq!(p.ranges.len(), 1);
        assert!(p.ranges[0].is_empty());
    }
}
