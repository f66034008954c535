//! Where a model computes (`--device cpu|cuda[:N]`) and in what type (`--dtype`), and the host
//! side of a device's step: a batch packed into the flat index arrays its kernels read.
//!
//! Everything here is plain data, compiled with or without the `cuda` feature, so the packing
//! the CUDA backend relies on is unit-tested on any machine.
//! Which backend a device means is `model.rs`'s to say (`Model::load_on`,
//! [`ComputeDevice::measure_limits`]): the backends build on this module, not it on them.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use crate::error::{ModelError, Result};
use crate::step::{LogitsWanted, SeqStep};

/// The device a model computes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ComputeDevice {
    /// The host's cores (the default).
    #[default]
    Cpu,
    /// CUDA device `N` (`cuda` is `cuda:0`).
    Cuda(usize),
    /// A testing device: the CPU's kernels over KV in host memory of its own (a memfd named
    /// `baton-device-arena`) that is offered to peers on this host as a device arena, so the
    /// device paths (device-to-device hand-offs, copy counters, the memory split between the
    /// device arena and the host tier) run where there is no GPU. Texts equal the CPU's.
    StandIn,
}

impl FromStr for ComputeDevice {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "stand-in" => Ok(Self::StandIn),
            "cuda" => Ok(Self::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Self::Cuda(n)),
                _ => Err(format!("unknown device `{s}`: expected `cpu`, `cuda`, `cuda:N` or `stand-in`")),
            },
        }
    }
}

impl fmt::Display for ComputeDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
            Self::StandIn => f.write_str("stand-in"),
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
    /// How a GPU backend runs (ignored by the CPU and the stand-in).
    pub gpu: GpuOptions,
}

/// How a GPU backend runs: its fast paths, each on by default and off to measure what it buys,
/// and its measurements, off by default. `--help`'s Device group sets them (they were
/// environment switches once).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuOptions {
    /// Replay decode steps as captured CUDA graphs, one launch a step (`--enforce-eager` turns
    /// them off, as vLLM's flag does).
    pub graphs: bool,
    /// Which attention takes prefill chunks (`--prefill-attention`).
    pub prefill_attention: PrefillAttention,
    /// How the device KV arena is offered to peer processes on the host (`--kv-export`).
    pub kv_export: KvExport,
    /// Page-lock the host arena, so a step's whole blocks go down to it by DMA
    /// (`--pin-host-kv off`: through staging).
    pub pin_host_kv: bool,
    /// Print where steps spend their wall time (packing, enqueueing, waiting, unpacking) when
    /// an engine ends (`--device-timing`).
    pub timing: bool,
    /// Time every launch with an event, graphs off, and print the GPU time by kernel when an
    /// engine ends (`--device-profile`).
    pub profile: bool,
}

impl Default for GpuOptions {
    fn default() -> Self {
        Self {
            graphs: true,
            prefill_attention: PrefillAttention::Auto,
            kv_export: KvExport::Vmm,
            pin_host_kv: true,
            timing: false,
            profile: false,
        }
    }
}

/// Which attention kernel takes a GPU's prefill chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillAttention {
    /// Tiles on the tensor cores with asynchronous key copies where the device and types allow,
    /// else tiles loaded through registers, else row by row.
    #[default]
    Auto,
    /// Tiles loaded through registers (no asynchronous copies).
    TiledSync,
    /// Every row one by one (the decode kernel).
    Rows,
}

/// How a GPU's KV arena is offered to peer processes on the same host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvExport {
    /// A CUDA virtual-memory allocation exported as a descriptor the peer imports: the peer
    /// then holds the memory too, so a copy after the exporter died touches memory still there.
    #[default]
    Vmm,
    /// A plain allocation shared by legacy CUDA IPC.
    Ipc,
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

/// One case of [`ComputeDevice::check_kernels`]: a fast kernel against the plain one on the same random data.
#[derive(Debug, Clone, serde::Serialize)]
pub struct KernelCheck {
    /// What ran.
    pub name: String,
    /// Largest |fast − plain| over the outputs.
    pub max_abs_diff: f32,
    /// Largest |plain| (the scale the difference is read against).
    pub max_abs: f32,
    /// The tolerance the case is held to.
    pub tolerance: f32,
}

impl KernelCheck {
    /// Whether the difference is within the tolerance (NaN never is).
    pub fn passed(&self) -> bool {
        self.max_abs_diff <= self.tolerance
    }
}

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
    /// For each sequence, its range of rows.
    pub seqs: Vec<Range<usize>>,
    /// Blocks this step writes whole (every slot, so every layer's keys and values of the
    /// block are new): a device copies them to the host arena as blocks, not token by token.
    pub whole_blocks: Vec<u32>,
    /// Rows of the batch; those after them are padding ([`Self::pad`]).
    pub real_rows: usize,
}

/// New tokens of one sequence from which a step's attention takes them in tiles (a prefill
/// chunk) rather than row by row.
pub(crate) const TILE_MIN_ROWS: usize = 8;

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
            p.seqs.push(row0..p.ids.len());
            // Blocks whose slots [0, block_size) all lie in [start_pos, end).
            let first_whole = s.start_pos.div_ceil(block_size);
            let whole = first_whole..(end / block_size).max(first_whole);
            p.whole_blocks.extend(s.blocks[whole].iter().map(|b| b.0));
            let first = p.logit_rows.len();
            p.logit_rows.extend(s.logit_rows().map(|r| (row0 + r) as i32));
            p.ranges.push(first..p.logit_rows.len());
            p.argmax.push(s.logits == LogitsWanted::Argmax);
        }
        if p.ids.is_empty() {
            return Err(ModelError::InvalidInput("empty batch".into()));
        }
        p.real_rows = p.ids.len();
        Ok(p)
    }

    /// The batch size a decode step of `n` sequences runs as on a device that replays captured
    /// steps: powers of two up to 8, then multiples of 16, so a server whose batch size wanders
    /// captures a handful of steps (8 up to 64 sequences), not one a size. The step is padded
    /// ([`Self::pad`]).
    pub fn decode_bucket(n: usize) -> usize {
        if n <= 8 { n.next_power_of_two() } else { n.next_multiple_of(16) }
    }

    /// Pads the step to `rows` rows: each extra row is token 0 at position 0 of block
    /// `scratch` (one outside the pool, the device's own), attended one by one, its argmax
    /// taken and its new KV staged like a real row's, so that every array has the length a
    /// step of `rows` sequences has. Its outputs belong to no sequence (`ranges` and `seqs`
    /// of the batch's sequences are unchanged) and the host drops its KV (rows from
    /// `real_rows` on).
    pub fn pad(&mut self, rows: usize, scratch: u32) {
        let table = self.tables.len() as i32;
        if rows > self.rows() {
            self.tables.push(scratch);
        }
        while self.rows() < rows {
            let r = self.rows();
            self.ids.push(0);
            self.pos.push(0);
            self.block.push(scratch);
            self.slot.push(0);
            self.table_start.push(table);
            self.logit_rows.push(r as i32);
            self.seqs.push(r..r + 1);
        }
    }

    /// Rows (new tokens) in the step.
    pub fn rows(&self) -> usize {
        self.ids.len()
    }

    /// How attention takes the rows: with `tile_rows` (the device's tiled kernel and its rows a
    /// tile), each sequence of at least `TILE_MIN_ROWS` new tokens in tiles of consecutive rows,
    /// `(first row, rows)`, and every other row one by one; without, every row one by one.
    /// Returns (the rows taken one by one, the tiles).
    pub fn attention_split(&self, tile_rows: Option<usize>) -> (Vec<i32>, Vec<[i32; 2]>) {
        let mut rows = Vec::new();
        let mut tiles = Vec::new();
        for s in &self.seqs {
            match tile_rows {
                Some(t) if t > 0 && s.len() >= TILE_MIN_ROWS => {
                    tiles.extend(s.clone().step_by(t).map(|r0| [r0 as i32, (s.end - r0).min(t) as i32]));
                }
                _ => rows.extend(s.clone().map(|r| r as i32)),
            }
        }
        (rows, tiles)
    }

    /// The rows whose keys and values go to the host token by token (through a staging
    /// buffer): every row, or with `whole_blocks_direct` those not in [`Self::whole_blocks`]
    /// (a block a step writes belongs to one sequence, as the pool hands blocks out).
    pub fn staged_rows(&self, whole_blocks_direct: bool) -> Vec<i32> {
        let whole: std::collections::HashSet<u32> =
            if whole_blocks_direct { self.whole_blocks.iter().copied().collect() } else { Default::default() };
        (0..self.rows()).filter(|&r| !whole.contains(&self.block[r])).map(|r| r as i32).collect()
    }

    /// Every integer array, one after another, as the one upload a step makes:
    /// ids, pos, block, slot, table_start (`rows` each), logit_rows, attention's rows and tiles
    /// ([`Self::attention_split`] with `tile_rows`), the staged rows ([`Self::staged_rows`]),
    /// then the block tables. The tables come
    /// last so that every other offset is the same from one decode step to the next while the
    /// tables grow: a captured decode step (a CUDA graph) bakes the offsets in.
    /// Returns the words and the offset of each array in them.
    pub fn words(&self, tile_rows: Option<usize>, whole_blocks_direct: bool) -> (Vec<u32>, PackOffsets) {
        let n = self.rows();
        let (attn_rows, tiles) = self.attention_split(tile_rows);
        let stage_rows = self.staged_rows(whole_blocks_direct);
        let mut w =
            Vec::with_capacity(5 * n + self.logit_rows.len() + self.tables.len() + attn_rows.len() + 2 * tiles.len());
        w.extend_from_slice(&self.ids);
        w.extend(self.pos.iter().map(|&x| x as u32));
        w.extend_from_slice(&self.block);
        w.extend(self.slot.iter().map(|&x| x as u32));
        w.extend(self.table_start.iter().map(|&x| x as u32));
        w.extend(self.logit_rows.iter().map(|&x| x as u32));
        w.extend(attn_rows.iter().map(|&x| x as u32));
        w.extend(tiles.iter().flatten().map(|&x| x as u32));
        w.extend(stage_rows.iter().map(|&x| x as u32));
        w.extend_from_slice(&self.tables);
        let attn = 5 * n + self.logit_rows.len();
        let off = PackOffsets {
            ids: 0,
            pos: n,
            block: 2 * n,
            slot: 3 * n,
            table_start: 4 * n,
            logit_rows: 5 * n,
            attn_rows: attn,
            attn_rows_len: attn_rows.len(),
            tiles: attn + attn_rows.len(),
            tiles_len: tiles.len(),
            stage_rows: attn + attn_rows.len() + 2 * tiles.len(),
            stage_rows_len: stage_rows.len(),
            tables: attn + attn_rows.len() + 2 * tiles.len() + stage_rows.len(),
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
    /// Rows attention takes one by one.
    pub attn_rows: usize,
    /// How many rows attention takes one by one.
    pub attn_rows_len: usize,
    /// Attention's tiles, `(first row, rows)` pairs.
    pub tiles: usize,
    /// How many tiles.
    pub tiles_len: usize,
    /// Rows whose new keys and values are staged for the host.
    pub stage_rows: usize,
    /// How many staged rows.
    pub stage_rows_len: usize,
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
        let (w, off) = p.words(None, false);
        assert_eq!(&w[off.block..off.block + 4], &[7, 3, 3, 5]);
        assert_eq!(&w[off.logit_rows..off.attn_rows], &[2, 3]);
        assert_eq!(&w[off.attn_rows..off.tiles], &[0, 1, 2, 3], "no tiles: every row one by one");
        assert_eq!(&w[off.stage_rows..off.tables], &[0, 1, 2, 3], "every row staged");
        assert_eq!(&w[off.tables..], &[7, 3, 4, 5]);
        assert_eq!((off.attn_rows_len, off.tiles_len), (4, 0));
    }

    #[test]
    fn a_decode_steps_offsets_stay_put_while_its_tables_grow() {
        // A captured decode step reads every array at the offsets of its capture: only the
        // tables, which grow by a block now and then, may change length.
        let blocks: Vec<BlockId> = (0..4).map(BlockId).collect();
        let step = |pos: usize| {
            let batch = [
                SeqStep { start_pos: pos, tokens: &[1], blocks: &blocks, logits: LogitsWanted::Argmax },
                SeqStep { start_pos: 2, tokens: &[2], blocks: &blocks, logits: LogitsWanted::Argmax },
            ];
            StepPack::new(&batch, 4, 10).expect("packs").words(Some(16), true)
        };
        // Position 3 needs one block of four, position 4 two.
        let ((w3, before), (w4, after)) = (step(3), step(4));
        assert_eq!(w4.len(), w3.len() + 1, "the first sequence's table grew a block");
        assert_eq!(before, after, "every array starts where it did");
        assert_eq!(w3[before.attn_rows..before.attn_rows + 2], [0, 1]);
        assert_eq!(w4[after.attn_rows..after.attn_rows + 2], [0, 1]);
    }

    #[test]
    fn prefill_chunks_go_to_tiles_that_stay_inside_their_sequence() {
        // Each sequence writes its own blocks (as a pool hands them out).
        let table = |first: u32| (first..first + 8).map(BlockId).collect::<Vec<_>>();
        let (b0, b1, b2) = (table(0), table(10), table(20));
        let prompt: Vec<u32> = (0..21).collect();
        let short: Vec<u32> = (0..7).collect();
        // A 21-token chunk, a decode token, a chunk just under the tiling threshold.
        let batch = [
            SeqStep { start_pos: 4, tokens: &prompt, blocks: &b0, logits: LogitsWanted::Last },
            SeqStep { start_pos: 9, tokens: &[1], blocks: &b1, logits: LogitsWanted::Argmax },
            SeqStep { start_pos: 0, tokens: &short, blocks: &b2, logits: LogitsWanted::Last },
        ];
        let p = StepPack::new(&batch, 4, 100).expect("packs");
        assert_eq!(p.seqs, [0..21, 21..22, 22..29]);
        let (rows, tiles) = p.attention_split(Some(8));
        assert_eq!(tiles, [[0, 8], [8, 8], [16, 5]], "tiles of 8 rows, the last one short");
        assert_eq!(rows, (21..29).collect::<Vec<_>>(), "the decode row and the short chunk row by row");
        // Block size 4: the chunk at positions 4..25 writes blocks 1..=5 whole and block 6 in
        // part; the decode row and the short chunk (positions 0..7: block 0 whole) as well.
        assert_eq!(p.whole_blocks, [1, 2, 3, 4, 5, 20]);
        assert_eq!(p.staged_rows(true), [20, 21, 26, 27, 28], "rows outside whole blocks");
        assert_eq!(p.staged_rows(false).len(), 29);
        let (none, no_tiles) = p.attention_split(None);
        assert_eq!((none.len(), no_tiles.len()), (29, 0));
        let (w, off) = p.words(Some(8), true);
        assert_eq!((off.attn_rows_len, off.tiles_len), (8, 3));
        assert_eq!(&w[off.tiles..off.stage_rows], &[0, 8, 8, 8, 16, 5]);
        assert_eq!(&w[off.stage_rows..off.tables], &[20, 21, 26, 27, 28]);
        assert_eq!(&w[off.attn_rows..off.tiles], &[21, 22, 23, 24, 25, 26, 27, 28]);
    }

    proptest::proptest! {
        /// For any batch of chunks and decode rows: attention takes every row exactly once,
        /// tiles stay inside their sequence and hold consecutive rows; the rows the host gets
        /// by staging and the rows in whole blocks partition the step; a whole block's every
        /// slot is written this step; and the upload's arrays sit where the offsets say.
        #[test]
        fn a_packs_splits_partition_its_rows(
            seqs in proptest::collection::vec((0usize..40, 1usize..40), 1..6),
            tile_rows in proptest::option::of(1usize..20),
        ) {
            let bs = 4;
            let blocks: Vec<Vec<BlockId>> = seqs
                .iter()
                .enumerate()
                .map(|(i, &(start, len))| (0..(start + len).div_ceil(bs)).map(|b| BlockId((i * 100 + b) as u32)).collect())
                .collect();
            let tokens: Vec<Vec<u32>> = seqs.iter().map(|&(_, len)| vec![1; len]).collect();
            let batch: Vec<SeqStep<'_>> = seqs
                .iter()
                .zip(&blocks)
                .zip(&tokens)
                .map(|((&(start, _), b), t)| SeqStep { start_pos: start, tokens: t, blocks: b, logits: LogitsWanted::Last })
                .collect();
            let p = StepPack::new(&batch, bs, 10).expect("packs");
            let n = p.rows();
            let (rows, tiles) = p.attention_split(tile_rows);
            let mut seen = vec![0; n];
            rows.iter().for_each(|&r| seen[r as usize] += 1);
            for &[r0, len] in &tiles {
                let seq = p.seqs.iter().find(|s| s.contains(&(r0 as usize))).expect("a tile starts in a sequence");
                proptest::prop_assert!(len > 0 && Some(len as usize) <= tile_rows);
                proptest::prop_assert!((r0 + len) as usize <= seq.end, "a tile stays inside its sequence");
                (r0..r0 + len).for_each(|r| seen[r as usize] += 1);
            }
            proptest::prop_assert!(seen.iter().all(|&c| c == 1), "every row attended exactly once: {seen:?}");
            let staged = p.staged_rows(true);
            for r in 0..n {
                proptest::prop_assert_eq!(staged.contains(&(r as i32)), !p.whole_blocks.contains(&p.block[r]));
            }
            for &b in &p.whole_blocks {
                let written = (0..n).filter(|&r| p.block[r] == b).count();
                proptest::prop_assert_eq!(written, bs, "a whole block has every slot written");
            }
            let (w, off) = p.words(tile_rows, true);
            proptest::prop_assert_eq!(&w[off.pos..off.block], &p.pos.iter().map(|&x| x as u32).collect::<Vec<_>>()[..]);
            proptest::prop_assert_eq!(off.attn_rows_len, rows.len());
            proptest::prop_assert_eq!(off.tiles_len, tiles.len());
            proptest::prop_assert_eq!(off.stage_rows_len, staged.len());
            proptest::prop_assert_eq!(&w[off.tables..], &p.tables[..]);
        }
    }

    #[test]
    fn a_padded_decode_step_has_the_offsets_of_its_bucket() {
        assert_eq!((1..=10).map(StepPack::decode_bucket).collect::<Vec<_>>(), [1, 2, 4, 4, 8, 8, 8, 8, 16, 16]);
        assert_eq!(
            (StepPack::decode_bucket(33), StepPack::decode_bucket(64), StepPack::decode_bucket(65)),
            (48, 64, 80)
        );
        let blocks: Vec<BlockId> = (0..4).map(BlockId).collect();
        let step = |n: usize| {
            let batch: Vec<SeqStep<'_>> = (0..n)
                .map(|i| SeqStep { start_pos: 5 + i, tokens: &[1], blocks: &blocks, logits: LogitsWanted::Argmax })
                .collect();
            StepPack::new(&batch, 4, 10).expect("packs")
        };
        let mut three = step(3);
        three.pad(4, 99);
        let four = step(4);
        let ((w3, off3), (w4, off4)) = (three.words(Some(16), true), four.words(Some(16), true));
        // The tables differ in length (one scratch block at their end), nothing else.
        assert_eq!(off3, off4, "a padded step's arrays sit where its bucket's do");
        assert_eq!(w3.len() - three.tables.len(), w4.len() - four.tables.len());
        assert_eq!(three.tables.len(), 2 + 2 + 2 + 1, "three real tables, one scratch block");
        assert_eq!((three.real_rows, three.rows()), (3, 4));
        assert_eq!((three.block[3], three.pos[3], three.slot[3]), (99, 0, 0));
        assert_eq!(three.tables[three.table_start[3] as usize], 99);
        assert_eq!(three.ranges.len(), 3, "the padding belongs to no sequence");
        assert_eq!(three.staged_rows(true), [0, 1, 2, 3], "staged like a real row; the host drops it");
        assert_eq!(three.attention_split(Some(16)).0, [0, 1, 2, 3]);
        let mut same = step(4);
        same.pad(4, 99);
        assert_eq!(same, four, "padding to its own size changes nothing");
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
