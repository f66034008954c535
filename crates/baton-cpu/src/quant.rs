//! Products of float32 activations with GGUF-quantized weights, the weights decoded block by
//! block as they stream through (never a whole float32 copy of a matrix).
//!
//! candle's quantized kernels quantize the activations to 8 bits first (as llama.cpp does);
//! that rounding moves Gemma 3 270M's logits by ~0.1, enough to flip near-ties the float32
//! reference resolves the other way within its first dozen greedy tokens. Here activations
//! stay float32, or are rounded to int16 with a scale per block of 32 or 256 ([`q16`]), 250
//! times finer than 8 bits: the held-out reference checks pass either way.
//!
//! Few rows (decode batches, short prompts: up to 32 with the int16 kernels, 8 with the
//! others, [`DotKernel::dot_rows`]), in parallel over weight rows (about eight tasks a thread):
//! each block is decoded into registers and multiplied into every activation row right there,
//! in int16 ([`avx512_q16`], [`avx2_q16`]) or float32 ([`avx512`]); elsewhere each weight row
//! is decoded into a small buffer and dotted with every activation row.
//!
//! More rows (prefill chunks), where the products are compute-bound: a chunk of weight rows is
//! decoded once, then multiplied with all activation rows. With the int16 kernels (AVX2, or
//! AVX-512 with VNNI) the chunk is packed into int16 panels ([`panel16`]), half the
//! instructions of a float32 product; with AVX-512 without VNNI into float32 panels run through
//! a 12×32 register tile; elsewhere candle's float GEMM multiplies it. The decoders are checked against
//! candle's, every kernel against the float product of the decoded matrix.
//!
//! A row's products do not depend on its batch (issue #63): a greedy request's tokens must not
//! change with what it is batched with or how its prompt was chunked. The dot kernels sum each
//! activation row alone, with as many accumulators for one row as for eight (and the last
//! blocks of a row in the lanes of their place in a group of eight); products of more rows go
//! to the int16 panels only for the 32-value formats, whose panels sum and round each row as
//! the dot kernels do, bit for bit; the K formats, and every format on a CPU without int16
//! panels, take the dot path at every size ([`batch_invariant`]; `BATON_BATCH_INVARIANT=0`
//! gives them their faster panels back). Tests hold every kernel's rows to the bits of the
//! row alone, and the panels to the dot kernels'.

use candle_core::quantized::GgmlDType;

use half::f16;
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod avx2_q16;
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod avx512;
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod avx512_q16;
mod panel16;
mod q16;
mod x8;

use q16::Q16Rows;

/// A block format this module decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BlockFormat {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
}

impl BlockFormat {
    pub(crate) fn of(dtype: GgmlDType) -> Option<Self> {
        Some(match dtype {
            GgmlDType::Q4_0 => Self::Q4_0,
            GgmlDType::Q4_1 => Self::Q4_1,
            GgmlDType::Q5_0 => Self::Q5_0,
            GgmlDType::Q5_1 => Self::Q5_1,
            GgmlDType::Q8_0 => Self::Q8_0,
            GgmlDType::Q2K => Self::Q2K,
            GgmlDType::Q3K => Self::Q3K,
            GgmlDType::Q4K => Self::Q4K,
            GgmlDType::Q5K => Self::Q5K,
            GgmlDType::Q6K => Self::Q6K,
            _ => return None,
        })
    }

    /// The GGUF type of these blocks.
    pub(crate) fn dtype(self) -> GgmlDType {
        match self {
            Self::Q4_0 => GgmlDType::Q4_0,
            Self::Q4_1 => GgmlDType::Q4_1,
            Self::Q5_0 => GgmlDType::Q5_0,
            Self::Q5_1 => GgmlDType::Q5_1,
            Self::Q8_0 => GgmlDType::Q8_0,
            Self::Q2K => GgmlDType::Q2K,
            Self::Q3K => GgmlDType::Q3K,
            Self::Q4K => GgmlDType::Q4K,
            Self::Q5K => GgmlDType::Q5K,
            Self::Q6K => GgmlDType::Q6K,
        }
    }

    /// Values per block.
    fn block_len(self) -> usize {
        match self {
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 => 32,
            Self::Q2K | Self::Q3K | Self::Q4K | Self::Q5K | Self::Q6K => 256,
        }
    }

    /// Bytes per block.
    fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q2K => 84,
            Self::Q3K => 110,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
        }
    }

    /// Decodes one block `b` into `y` (`block_len` values).
    #[inline(always)]
    fn decode(self, b: &[u8], y: &mut [f32]) {
        let half = |i: usize| f16::from_le_bytes([b[i], b[i + 1]]).to_f32();
        match self {
            Self::Q8_0 => {
                let d = half(0);
                for (y, &q) in y[..32].iter_mut().zip(&b[2..34]) {
                    *y = d * f32::from(q as i8);
                }
            }
            Self::Q4_0 => {
                let d = half(0);
                let qs = &b[2..18];
                for j in 0..16 {
                    y[j] = d * (i32::from(qs[j] & 0x0f) - 8) as f32;
                    y[j + 16] = d * (i32::from(qs[j] >> 4) - 8) as f32;
                }
            }
            Self::Q5_0 => {
                let d = half(0);
                let qh = &b[2..6];
                let qs = &b[6..22];
                // Bit `j` of the little-endian `qh` is the fifth bit of value `j`.
                let high = |j: usize| i32::from((qh[j / 8] >> (j % 8)) & 1) << 4;
                let (lo, hi) = y[..32].split_at_mut(16);
                for j in 0..16 {
                    lo[j] = d * ((i32::from(qs[j] & 0x0f) | high(j)) - 16) as f32;
                    hi[j] = d * ((i32::from(qs[j] >> 4) | high(j + 16)) - 16) as f32;
                }
            }
            Self::Q4_1 => {
                let (d, m) = (half(0), half(2));
                let qs = &b[4..20];
                for j in 0..16 {
                    y[j] = d * f32::from(qs[j] & 0x0f) + m;
                    y[j + 16] = d * f32::from(qs[j] >> 4) + m;
                }
            }
            Self::Q5_1 => {
                let (d, m) = (half(0), half(2));
                let qh = &b[4..8];
                let qs = &b[8..24];
                let high = |j: usize| ((qh[j / 8] >> (j % 8)) & 1) << 4;
                let (lo, hi) = y[..32].split_at_mut(16);
                for j in 0..16 {
                    lo[j] = d * f32::from((qs[j] & 0x0f) | high(j)) + m;
                    hi[j] = d * f32::from((qs[j] >> 4) | high(j + 16)) + m;
                }
            }
            Self::Q2K => {
                // scales[16] (low nibble scale, high nibble min), qs[64] (2 bits), d, dmin.
                let (d, dmin) = (half(80), half(82));
                let scales = &b[0..16];
                for n in 0..2 {
                    let q = &b[16 + 32 * n..16 + 32 * n + 32];
                    for j in 0..4 {
                        let shift = 2 * j;
                        for h in 0..2 {
                            let sc = scales[8 * n + 2 * j + h];
                            let (dl, ml) = (d * f32::from(sc & 0x0f), dmin * f32::from(sc >> 4));
                            let y = &mut y[128 * n + 32 * j + 16 * h..][..16];
                            for (l, y) in y.iter_mut().enumerate() {
                                *y = dl * f32::from((q[16 * h + l] >> shift) & 3) - ml;
                            }
                        }
                    }
                }
            }
            Self::Q3K => {
                // hmask[32] (the third bit, set: no offset), qs[64] (low 2 bits), 12 bytes of
                // 6-bit scales offset by 32, d.
                let d = half(108);
                let hmask = &b[0..32];
                let scales = scales_k3(&b[96..108]);
                for n in 0..2 {
                    let q = &b[32 + 32 * n..32 + 32 * n + 32];
                    for j in 0..4 {
                        let (shift, bit) = (2 * j, 4 * n + j);
                        for h in 0..2 {
                            let dl = d * f32::from(scales[8 * n + 2 * j + h]);
                            let y = &mut y[128 * n + 32 * j + 16 * h..][..16];
                            for (l, y) in y.iter_mut().enumerate() {
                                let i = 16 * h + l;
                                let low = ((q[i] >> shift) & 3) as i8;
                                let q3 = if (hmask[i] >> bit) & 1 == 1 { low } else { low - 4 };
                                *y = dl * f32::from(q3);
                            }
                        }
                    }
                }
            }
            Self::Q5K => {
                let (d, dmin) = (half(0), half(2));
                let scales = &b[4..16];
                let qh = &b[16..48];
                let qs = &b[48..176];
                for (g, (q, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
                    let (s1, m1) = scale_min_k4(2 * g, scales);
                    let (s2, m2) = scale_min_k4(2 * g + 1, scales);
                    let (d1, m1) = (d * f32::from(s1), dmin * f32::from(m1));
                    let (d2, m2) = (d * f32::from(s2), dmin * f32::from(m2));
                    let (lo, hi) = y.split_at_mut(32);
                    for l in 0..32 {
                        let h1 = ((qh[l] >> (2 * g)) & 1) << 4;
                        let h2 = ((qh[l] >> (2 * g + 1)) & 1) << 4;
                        lo[l] = d1 * f32::from((q[l] & 0x0f) | h1) - m1;
                        hi[l] = d2 * f32::from((q[l] >> 4) | h2) - m2;
                    }
                }
            }
            Self::Q4K => {
                let (d, dmin) = (half(0), half(2));
                let scales = &b[4..16];
                let qs = &b[16..144];
                for (g, (q, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
                    let (s1, m1) = scale_min_k4(2 * g, scales);
                    let (s2, m2) = scale_min_k4(2 * g + 1, scales);
                    let (d1, m1) = (d * f32::from(s1), dmin * f32::from(m1));
                    let (d2, m2) = (d * f32::from(s2), dmin * f32::from(m2));
                    let (lo, hi) = y.split_at_mut(32);
                    for l in 0..32 {
                        lo[l] = d1 * f32::from(q[l] & 0x0f) - m1;
                        hi[l] = d2 * f32::from(q[l] >> 4) - m2;
                    }
                }
            }
            Self::Q6K => {
                let d = half(208);
                for n in 0..2 {
                    let ql = &b[64 * n..64 * n + 64];
                    let qh = &b[128 + 32 * n..128 + 32 * n + 32];
                    let sc = &b[192 + 8 * n..192 + 8 * n + 8];
                    let y = &mut y[128 * n..128 * n + 128];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = (i32::from(ql[l] & 0x0f) | (i32::from(qh[l] & 3) << 4)) - 32;
                        let q2 = (i32::from(ql[l + 32] & 0x0f) | (i32::from((qh[l] >> 2) & 3) << 4)) - 32;
                        let q3 = (i32::from(ql[l] >> 4) | (i32::from((qh[l] >> 4) & 3) << 4)) - 32;
                        let q4 = (i32::from(ql[l + 32] >> 4) | (i32::from((qh[l] >> 6) & 3) << 4)) - 32;
                        let s = |i: usize| d * f32::from(sc[i] as i8);
                        y[l] = s(is) * q1 as f32;
                        y[l + 32] = s(is + 2) * q2 as f32;
                        y[l + 64] = s(is + 4) * q3 as f32;
                        y[l + 96] = s(is + 6) * q4 as f32;
                    }
                }
            }
        }
    }
}

/// The 16 signed scales of a Q3_K block from its 12 bytes of packed 6-bit fields (low 4 bits
/// in bytes 0-7, high 2 bits in bytes 8-11), offset by 32.
#[inline]
fn scales_k3(packed: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        let low = if j < 8 { packed[j] & 0x0f } else { packed[j - 8] >> 4 };
        let high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
        *o = ((low | (high << 4)) as i8) - 32;
    }
    out
}

/// Scale and min of sub-block `j` of a Q4_K block's packed 6-bit fields.
#[inline]
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Up to this many activation rows take the decode-and-dot path with an int16 kernel; more
/// decode the weights into panels first ([`DotKernel::dot_rows`]). The panels cost a decode of
/// every weight per product, repaid only by the cheaper multiply-adds of many rows: two
/// threads, SmolLM2's and Gemma 3's shapes (`dot_or_gemm`), the int16 dot kernels are faster at
/// every width up to 32 rows (16 rows, `avx512-q16`: 0.53 against 1.07 ms for SmolLM2's
/// gate_up, 8.1 against 16.0 for its output head; `avx2` alike) and slower from 48. At 8, a
/// decode batch of 9–32 sequences stepped at half the speed of one of 8.
const DOT_ROWS_INT16: usize = 32;
/// [`DOT_ROWS_INT16`] for the float32 kernels, which decode rows or blocks to float32 and so
/// cost more per activation row: by `dot_or_gemm`, `avx2-f32` and `avx512` lose to the GEMM
/// paths from 16–32 rows on some shapes (`avx2-f32`, SmolLM2's head at 16 rows: 26.5 against
/// 20.2 ms), `portable` already near 8 (Q4_1 gate_up at 8: 1.22 against 0.96 ms).
const DOT_ROWS_F32: usize = 8;
/// Tasks per thread of the dot path: enough that a thread that finishes early takes more work,
/// and that the tasks split evenly between the threads (a product of 9 tasks of 64 rows left
/// one of two threads idle a ninth of it).
const TASKS_PER_THREAD: usize = 8;
/// Fewest weight rows per task of the dot path.
const MIN_ROWS_PER_TASK: usize = 16;
thread_local! {
    /// [`QuantMatrix::matmul_panels16`]'s panels, kept between products on each thread (taken
    /// out while in use: a product nested in another's wait on rayon's pool gets its own).
    static PANEL_SCRATCH: std::cell::Cell<(Vec<i16>, Vec<f32>, Vec<f32>)> = const { std::cell::Cell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// Float32 elements of one decoded tile on the GEMM paths.
const TILE_ELEMS: usize = 1 << 20;
/// Activation rows per task of the AVX-512 GEMM path (two register tiles of 12).
#[cfg(target_arch = "x86_64")]
const GEMM_ROW_BLOCK: usize = 24;

/// A quantized matrix `[rows][cols]`, rows of whole blocks.
#[derive(Debug, Clone)]
pub struct QuantMatrix {
    format: BlockFormat,
    /// Rows `row_bytes` apart: GGUF's blocks, or with `interleaved` [`x8`]'s groups.
    bytes: Vec<u8>,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    /// Q4_1 or Q5_0 rows regrouped eight blocks at a time for the int16 decode kernels
    /// ([`x8`]); only where the process's kernel is one of those, and the rows have a whole
    /// group.
    interleaved: bool,
}

impl QuantMatrix {
    /// Copies GGUF block bytes; `None` when the format is not one this module decodes or the
    /// shape does not fill whole blocks.
    pub fn new(dtype: GgmlDType, bytes: &[u8], rows: usize, cols: usize) -> Option<Self> {
        let format = BlockFormat::of(dtype)?;
        if cols == 0 || !cols.is_multiple_of(format.block_len()) {
            return None;
        }
        let row_bytes = cols / format.block_len() * format.block_bytes();
        if bytes.len() != rows * row_bytes {
            return None;
        }
        let interleaved = x8::can_group(format)
            && cols / format.block_len() >= x8::BLOCKS
            && DotKernel::detect().for_format(format).int16();
        let mut bytes = bytes.to_vec();
        if interleaved {
            bytes.par_chunks_mut(row_bytes).for_each(|row| x8::interleave(format, row));
        }
        Some(Self { format, bytes, rows, cols, row_bytes, interleaved })
    }

    /// Calls `f(i, block)` for each block of row `r` in turn, its bytes as GGUF lays them out.
    #[inline(always)]
    fn gguf_blocks(&self, r: usize, mut f: impl FnMut(usize, &[u8])) {
        let bb = self.format.block_bytes();
        let row = &self.bytes[r * self.row_bytes..(r + 1) * self.row_bytes];
        if !self.interleaved {
            row.chunks_exact(bb).enumerate().for_each(|(i, b)| f(i, b));
            return;
        }
        let mut buf = [0u8; x8::MAX_GROUP_BYTES];
        let gguf = &mut buf[..x8::group_bytes(self.format)];
        let groups = row.chunks_exact(gguf.len());
        let tail = groups.remainder();
        for (g, group) in groups.enumerate() {
            x8::gguf_order(self.format, group, gguf);
            gguf.chunks_exact(bb).enumerate().for_each(|(j, b)| f(g * x8::BLOCKS + j, b));
        }
        let first = (row.len() - tail.len()) / bb;
        tail.chunks_exact(bb).enumerate().for_each(|(j, b)| f(first + j, b));
    }

    /// Rows: the matrix's output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns: the matrix's input features, a whole number of blocks.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes the blocks take, which a product reads once.
    pub fn byte_len(&self) -> usize {
        self.bytes.len()
    }

    /// Stacks `other`'s rows under these, when both are of one format and width.
    pub fn stack(&self, other: &Self) -> Option<Self> {
        if self.format != other.format || self.cols != other.cols {
            return None;
        }
        // Both laid out alike (the same format and width, the same process's kernel).
        let mut bytes = self.bytes.clone();
        bytes.extend_from_slice(&other.bytes);
        Some(Self { bytes, rows: self.rows + other.rows, ..*self })
    }

    /// The rows of `ranges` in turn, columns `cols` (whole blocks) of each: a new matrix laid
    /// out as [`Self::new`] lays one out; `None` when `cols` splits a block.
    pub fn part(&self, ranges: &[std::ops::Range<usize>], cols: std::ops::Range<usize>) -> Option<Self> {
        let (n, bb) = (self.format.block_len(), self.format.block_bytes());
        if !cols.start.is_multiple_of(n) || !cols.end.is_multiple_of(n) || cols.end > self.cols || cols.is_empty() {
            return None;
        }
        let blocks = cols.start / n..cols.end / n;
        let rows: usize = ranges.iter().map(|r| r.len()).sum();
        let mut bytes = Vec::with_capacity(rows * blocks.len() * bb);
        for r in ranges.iter().flat_map(|r| r.clone()) {
            self.gguf_blocks(r, |i, b| {
                if blocks.contains(&i) {
                    bytes.extend_from_slice(b);
                }
            });
        }
        Self::new(self.format.dtype(), &bytes, rows, cols.len())
    }

    /// `x · Wᵀ` for one row `x`, on the calling thread alone.
    pub fn matvec_alone(&self, x: &[f32]) -> Vec<f32> {
        let kernel = DotKernel::detect().for_format(self.format);
        let q16 = kernel.q16(self, x);
        let mut y = vec![0f32; self.rows];
        let mut row = if kernel.decodes_rows() { vec![0f32; self.cols] } else { Vec::new() };
        kernel.run(self, 0, x, q16.as_ref(), 1, &mut y, &mut row);
        y
    }

    /// Decodes row `r` into `out` (`cols` values).
    #[inline(always)]
    fn decode_row(&self, r: usize, out: &mut [f32]) {
        let n = self.format.block_len();
        self.gguf_blocks(r, |i, b| self.format.decode(b, &mut out[i * n..(i + 1) * n]));
    }

    /// Decodes the rows listed in `ids` into `[ids.len()][cols]` (an embedding gather).
    pub fn gather(&self, ids: &[u32]) -> Vec<f32> {
        let mut out = vec![0f32; ids.len() * self.cols];
        for (&id, y) in ids.iter().zip(out.chunks_exact_mut(self.cols)) {
            self.decode_row(id as usize, y);
        }
        out
    }

    /// `x · Wᵀ` for `m` rows of `x` (`[m][cols]`), into `[m][rows]`. Each row's outputs are
    /// the same bits whatever `m` (see the module's docs), unless `BATON_BATCH_INVARIANT=0`.
    pub fn matmul_xwt(&self, x: &[f32], m: usize) -> candle_core::Result<Vec<f32>> {
        if m <= self.dot_rows() || batch_invariant() && !self.panels_round_as_dot() {
            return Ok(self.matmul_dot(x, m));
        }
        self.matmul_gemm(x, m)
    }

    /// Whether [`Self::matmul_gemm`] rounds each row as [`Self::matmul_dot`] does: the int16
    /// panels ([`panel16`]) of a 32-value format whose dot kernel is an int16 one. Their
    /// `panel_gemm`s sum a block in int32 as the dot kernels do, and keep the dot kernels' float
    /// order: block `b` into the `b % 8`-th of eight accumulators, minimums apart, the eight
    /// summed in one fixed tree.
    fn panels_round_as_dot(&self) -> bool {
        let kernel = DotKernel::detect();
        self.format.block_len() == 32 && kernel.panel16().is_some() && kernel.for_format(self.format).int16()
    }

    /// Most activation rows [`Self::matmul_xwt`] takes down the decode-and-dot path.
    fn dot_rows(&self) -> usize {
        DotKernel::detect().for_format(self.format).dot_rows()
    }

    /// [`Self::matmul_xwt`] above [`Self::dot_rows`]: the weights decoded a chunk at a time into
    /// panels or tiles, each multiplied with every activation row.
    fn matmul_gemm(&self, x: &[f32], m: usize) -> candle_core::Result<Vec<f32>> {
        #[cfg(target_arch = "x86_64")]
        if let Some(isa) = DotKernel::detect().panel16()
            && self.format.block_len() == 32
        {
            return Ok(self.matmul_panels16(x, m, isa));
        }
        // `available` lists an AVX-512 kernel only on a CPU with AVX-512F and FMA.
        #[cfg(target_arch = "x86_64")]
        if DotKernel::detect().avx512() {
            return Ok(self.matmul_panels(x, m));
        }
        self.matmul_tiles(x, m)
    }

    /// Decodes weight rows `first..first + rows` (at most [`avx512::PANEL`]) into `panel`,
    /// packed `[cols][PANEL]` with zeros past `rows`; `buf` holds one row.
    #[cfg(target_arch = "x86_64")]
    fn pack_panel(&self, first: usize, rows: usize, panel: &mut [f32], buf: &mut [f32]) {
        const P: usize = avx512::PANEL;
        for c in 0..P {
            if c < rows {
                self.decode_row(first + c, buf);
                for (t, &v) in buf.iter().enumerate() {
                    panel[t * P + c] = v;
                }
            } else {
                (0..self.cols).for_each(|t| panel[t * P + c] = 0.0);
            }
        }
    }

    /// More rows, on a CPU with AVX-512: chunks of weight rows are decoded once into packed
    /// panels (in parallel over panels), then blocks of activation rows run against every panel
    /// of the chunk (in parallel over blocks, each owning its rows of `y`), in register tiles
    /// of 12 rows × 32 weight rows with no horizontal sums.
    #[cfg(target_arch = "x86_64")]
    fn matmul_panels(&self, x: &[f32], m: usize) -> Vec<f32> {
        const P: usize = avx512::PANEL;
        let (n, k) = (self.rows, self.cols);
        let chunk = (TILE_ELEMS / k / P).max(1) * P;
        let mut y = vec![0f32; m * n];
        let mut packed = vec![0f32; chunk.min(n.next_multiple_of(P)) * k];
        for j0 in (0..n).step_by(chunk) {
            let rows = chunk.min(n - j0);
            let panels = rows.div_ceil(P);
            packed[..panels * P * k].par_chunks_mut(P * k).enumerate().for_each_init(
                || vec![0f32; k],
                |buf, (p, panel)| self.pack_panel(j0 + p * P, P.min(rows - p * P), panel, buf),
            );
            let packed = &packed[..panels * P * k];
            y.par_chunks_mut(GEMM_ROW_BLOCK * n).enumerate().for_each(|(b, yb)| {
                let (r0, mr) = (b * GEMM_ROW_BLOCK, yb.len() / n);
                let xb = &x[r0 * k..(r0 + mr) * k];
                for (p, panel) in packed.chunks_exact(P * k).enumerate() {
                    let cols = P.min(rows - p * P);
                    #[allow(unsafe_code)]
                    // SAFETY: `matmul_xwt` comes here only on a CPU with AVX-512F and FMA.
                    unsafe {
                        avx512::panel_gemm(panel, k, xb, k, mr, &mut yb[j0 + p * P..], n, cols);
                    }
                }
            });
        }
        y
    }

    /// More rows, with the int16 kernels: chunks of weight rows are decoded once into packed
    /// int16 panels ([`panel16`], in parallel over panels), then blocks of activation rows,
    /// rounded to int16 once, run against every panel of the chunk (in parallel over blocks).
    #[cfg(target_arch = "x86_64")]
    fn matmul_panels16(&self, x: &[f32], m: usize, isa: panel16::PanelIsa) -> Vec<f32> {
        let nr = match isa {
            panel16::PanelIsa::Avx512Vnni => avx512_q16::PANEL16,
            panel16::PanelIsa::Avx2 => avx2_q16::PANEL16,
        };
        let (n, k, g) = (self.rows, self.cols, panel16::group(self.format));
        let xq = Q16Rows::new(x, k, q16::q16_block(self.format));
        // Two-byte integers: twice the float32 panels' rows in the same memory.
        let chunk = (2 * TILE_ELEMS / k / nr).max(1) * nr;
        let (qs, fs) = (nr * k, nr * (k / g));
        let most = chunk.min(n.next_multiple_of(nr)) / nr;
        let mins = panel16::has_mins(self.format);
        // The panels' storage, this thread's from its last product (fresh pages cost a fault
        // and a clearing each, a tenth of a product this size); `pack` writes all it reads.
        let mut scratch = PANEL_SCRATCH.take();
        let (q, f, mn) = (&mut scratch.0, &mut scratch.1, &mut scratch.2);
        q.resize(q.len().max(most * qs), 0);
        f.resize(f.len().max(most * fs), 0.0);
        mn.resize(mn.len().max(if mins { most * fs } else { 0 }), 0.0);
        let mut y = vec![0f32; m * n];
        for j0 in (0..n).step_by(chunk) {
            let rows = chunk.min(n - j0);
            let panels = rows.div_ceil(nr);
            let mn_parts: Vec<&mut [f32]> = if mins {
                mn[..panels * fs].chunks_mut(fs).collect()
            } else {
                (0..panels).map(|_| &mut [][..]).collect()
            };
            q[..panels * qs]
                .par_chunks_mut(qs)
                .zip(f[..panels * fs].par_chunks_mut(fs))
                .zip(mn_parts)
                .enumerate()
                .for_each_init(panel16::PackBuf::default, |buf, (p, ((q, f), mn))| {
                    let (first, rows) = (j0 + p * nr, nr.min(rows - p * nr));
                    let out = panel16::PanelMut { q, f, mn };
                    match isa {
                        panel16::PanelIsa::Avx512Vnni => {
                            panel16::pack::<{ avx512_q16::PANEL16 }>(self, first, rows, out, buf)
                        }
                        panel16::PanelIsa::Avx2 => panel16::pack::<{ avx2_q16::PANEL16 }>(self, first, rows, out, buf),
                    }
                });
            let (q, f, mn) = (&q[..panels * qs], &f[..panels * fs], &mn[..if mins { panels * fs } else { 0 }]);
            y.par_chunks_mut(GEMM_ROW_BLOCK * n).enumerate().for_each(|(b, yb)| {
                let (r0, mr) = (b * GEMM_ROW_BLOCK, yb.len() / n);
                let xv = xq.rows(r0, mr);
                for p in 0..panels {
                    let mn = if mins { &mn[p * fs..(p + 1) * fs] } else { &[][..] };
                    let panel =
                        panel16::Panel16 { q: &q[p * qs..(p + 1) * qs], f: &f[p * fs..(p + 1) * fs], mn, k, group: g };
                    let (yp, cols) = (&mut yb[j0 + p * nr..], nr.min(rows - p * nr));
                    #[allow(unsafe_code)]
                    // SAFETY: `DotKernel::panel16` names an ISA only on a CPU that runs it.
                    unsafe {
                        match isa {
                            panel16::PanelIsa::Avx512Vnni => avx512_q16::panel_gemm(panel, xv, yp, n, cols),
                            panel16::PanelIsa::Avx2 => avx2_q16::panel_gemm(panel, xv, yp, n, cols),
                        }
                    }
                }
            });
        }
        PANEL_SCRATCH.set(scratch);
        y
    }

    /// Few rows: each weight row is decoded once into a small buffer and dotted with every
    /// activation row; tasks own runs of weight rows.
    fn matmul_dot(&self, x: &[f32], m: usize) -> Vec<f32> {
        let (n, k) = (self.rows, self.cols);
        // `[n][m]`, transposed at the end when `m > 1`: each task owns whole rows of it.
        let mut yt = vec![0f32; n * m];
        let kernel = DotKernel::detect().for_format(self.format);
        // Rounded once per product, not per task.
        let q16 = kernel.q16(self, x);
        let rows = n.div_ceil(rayon::current_num_threads() * TASKS_PER_THREAD).max(MIN_ROWS_PER_TASK);
        // The row buffer is only the fallback kernels' (one per thread or rayon job, not per
        // task).
        crate::pool::for_each_chunk(
            &mut yt,
            rows * m,
            || if kernel.decodes_rows() { vec![0f32; k] } else { Vec::new() },
            |w, task, out| kernel.run(self, task * rows, x, q16.as_ref(), m, out, w),
        );
        if m == 1 {
            return yt;
        }
        let mut y = vec![0f32; m * n];
        for (j, col) in yt.chunks_exact(m).enumerate() {
            for (r, &v) in col.iter().enumerate() {
                y[r * n + j] = v;
            }
        }
        y
    }

    /// More rows: tiles of weight rows are decoded and multiplied with candle's float GEMM.
    fn matmul_tiles(&self, x: &[f32], m: usize) -> candle_core::Result<Vec<f32>> {
        let (n, k) = (self.rows, self.cols);
        assert_eq!(x.len(), m * k);
        let tile_rows = (TILE_ELEMS / k).clamp(1, n);
        let mut y = vec![0f32; m * n];
        let mut w = vec![0f32; tile_rows * k];
        let threads = rayon::current_num_threads();
        for r0 in (0..n).step_by(tile_rows) {
            let t = tile_rows.min(n - r0);
            w[..t * k].par_chunks_mut(k).enumerate().for_each(|(i, row)| self.decode_row(r0 + i, row));
            // y[.., r0..r0 + t] = x · w[..t]ᵀ, written in place: the float32 GEMM candle calls,
            // without the tensors around it (each of which copied x, the tile or the product).
            // SAFETY: x is [m][k] (rows k apart), w's first t rows are [t][k] read as wᵀ
            // (k × t: rows 1 apart, columns k apart), and y's columns r0..r0 + t of its m rows
            // (n apart) are inside y; nothing else reads or writes them during the call.
            #[allow(unsafe_code)]
            unsafe {
                gemm::gemm(
                    m,
                    t,
                    k,
                    y.as_mut_ptr().add(r0),
                    1,
                    n as isize,
                    false,
                    x.as_ptr(),
                    1,
                    k as isize,
                    w.as_ptr(),
                    k as isize,
                    1,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None },
                );
            }
        }
        Ok(y)
    }
}

/// Decodes weight rows `first..` (as many as `out` has room for, `m` outputs each) and dots
/// each with every row of `x`, into `out` (`[rows][m]`).
#[inline(always)]
fn dot_rows(w: &QuantMatrix, first: usize, x: &[f32], m: usize, out: &mut [f32], row: &mut [f32]) {
    for (i, out) in out.chunks_exact_mut(m).enumerate() {
        w.decode_row(first + i, row);
        for (o, xr) in out.iter_mut().zip(x.chunks_exact(w.cols)) {
            *o = dot32(row, xr);
        }
    }
}

/// Dot product with 32 independent accumulators (four AVX registers), so the adds do not wait
/// on each other; the lengths are whole blocks (multiples of 32).
#[inline(always)]
fn dot32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 32];
    for (x, y) in a.chunks_exact(32).zip(b.chunks_exact(32)) {
        for i in 0..32 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum()
}

/// [`dot_rows`] compiled for AVX2 (the crate is built for the x86-64 baseline, SSE2): the
/// float32-activation fallback of the AVX-512 float kernel's missing formats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_rows_avx2(w: &QuantMatrix, first: usize, x: &[f32], m: usize, out: &mut [f32], row: &mut [f32]) {
    dot_rows(w, first, x, m, out, row);
}

/// Whether a row's products are the same bits whatever else is in its batch (read once per
/// process): products of more rows than a dot kernel takes go to panels only where those
/// round each row as the dot kernel does ([`QuantMatrix::panels_round_as_dot`]), else to the
/// dot kernel at every size; float32 weights go to [`crate::gemv`] at every size.
/// `BATON_BATCH_INVARIANT=0` gives prefill the faster paths back (the float32 panels, the
/// tiles through `gemm`, candle's float GEMM) at the cost of a row's last bits depending on
/// its batch.
pub fn batch_invariant() -> bool {
    static INVARIANT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *INVARIANT.get_or_init(|| std::env::var("BATON_BATCH_INVARIANT").map_or(true, |v| v.trim() != "0"))
}

/// Whether the decode-and-dot kernel picked for this process is an AVX-512 one: the float32
/// kernels of [`crate::gemv`] follow it, so `BATON_DOT_KERNEL=avx2` on an AVX-512 CPU runs no
/// AVX-512 in this crate.
pub(crate) fn avx512_chosen() -> bool {
    DotKernel::detect().avx512()
}

/// The implementation of the decode-and-dot path, picked once per process (see
/// [`DotKernel::detect`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DotKernel {
    /// Blocks decoded into int16 registers against int16 activations ([`avx512_q16`]).
    Avx512Q16,
    /// Blocks decoded into float32 registers against float32 activations ([`avx512`]).
    Avx512,
    /// Blocks decoded into int16 registers against int16 activations, in 256-bit registers
    /// ([`avx2_q16`]).
    Avx2Q16,
    /// [`dot_rows`] compiled for AVX2.
    Avx2F32,
    /// [`dot_rows`] for the baseline target.
    Portable,
}

impl DotKernel {
    /// The fastest kernel this CPU runs, or the one `BATON_DOT_KERNEL` names (`avx512-q16`,
    /// `avx512`, `avx2`, `avx2-f32`, `portable`) when the CPU runs that one too.
    fn detect() -> Self {
        static KERNEL: std::sync::OnceLock<DotKernel> = std::sync::OnceLock::new();
        *KERNEL.get_or_init(|| {
            let available = Self::available();
            let wanted = std::env::var("BATON_DOT_KERNEL")
                .ok()
                .and_then(|name| available.iter().copied().find(|k| k.name() == name));
            wanted.unwrap_or(available[0])
        })
    }

    fn name(self) -> &'static str {
        match self {
            Self::Avx512Q16 => "avx512-q16",
            Self::Avx512 => "avx512",
            Self::Avx2Q16 => "avx2",
            Self::Avx2F32 => "avx2-f32",
            Self::Portable => "portable",
        }
    }

    /// Whether [`Self::run`] needs a row buffer.
    fn decodes_rows(self) -> bool {
        matches!(self, Self::Avx2F32 | Self::Portable)
    }

    /// Most activation rows a product takes down this kernel's decode-and-dot path.
    fn dot_rows(self) -> usize {
        if self.int16() { DOT_ROWS_INT16 } else { DOT_ROWS_F32 }
    }

    /// Whether this kernel rounds the activations to int16 ([`Self::q16`]).
    fn int16(self) -> bool {
        matches!(self, Self::Avx512Q16 | Self::Avx2Q16)
    }

    /// Whether this is one of the AVX-512 kernels (which the prefill path follows: a CPU, or a
    /// `BATON_DOT_KERNEL`, without them takes no AVX-512 anywhere in this module).
    fn avx512(self) -> bool {
        matches!(self, Self::Avx512Q16 | Self::Avx512)
    }

    /// The int16 panel kernels prefill takes with this kernel ([`panel16`]): the int16 decode
    /// kernels' activations, so prefill and decode round alike. AVX-512 without VNNI keeps the
    /// float32 panels (its `vpmaddwd` then needs an add per product pair, no faster than FMA).
    fn panel16(self) -> Option<panel16::PanelIsa> {
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Avx512Q16 if std::is_x86_feature_detected!("avx512vnni") => Some(panel16::PanelIsa::Avx512Vnni),
            Self::Avx2Q16 => Some(panel16::PanelIsa::Avx2),
            _ => None,
        }
    }

    /// Whether this kernel multiplies blocks of `format` itself. The decode-then-dot kernels
    /// take every format; the fused AVX-512 ones have a kernel per format.
    fn supports(self, format: BlockFormat) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Avx512Q16 => avx512_q16::supports(format),
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => avx512::supports(format),
            // Every format.
            _ => true,
        }
    }

    /// This kernel, or where it has none for `format`, the next slower one this CPU runs that
    /// has, and whose activations are no coarser (a float32 kernel never hands a format to an
    /// int16 one; an int16 kernel may hand it to either).
    fn for_format(self, format: BlockFormat) -> Self {
        if self.supports(format) {
            return self;
        }
        Self::available()
            .into_iter()
            .skip_while(|&k| k != self)
            .find(|k| k.supports(format) && (self.int16() || !k.int16()))
            .unwrap_or(Self::Portable)
    }

    /// The activations rounded to int16 as this kernel takes them, for the int16 kernels.
    fn q16(self, w: &QuantMatrix, x: &[f32]) -> Option<Q16Rows> {
        self.for_format(w.format).int16().then(|| {
            let mut q = Q16Rows::new(x, w.cols, q16::q16_block(w.format));
            // The VNNI kernel reads the int16 values only past the last whole group, where
            // they keep their order.
            if self.byte_planes(w) {
                q.bytes = x8::byte_planes(&q.q, w.cols);
            } else if w.interleaved {
                x8::permute_activations(&mut q.q, w.cols);
            }
            q
        })
    }

    /// Whether this kernel multiplies `w` against the activations' bytes
    /// ([`x8::byte_planes`]): grouped Q4_1 rows (not Q5_0's) under the AVX-512 int16 kernel on
    /// a CPU with AVX-512 VNNI ([`avx512_q16::q4_1_x8_band`]), unless `BATON_DOT_VNNI=0` (read
    /// once per process: the same kernel's `vpmaddwd` path then, for measuring one against the
    /// other).
    fn byte_planes(self, w: &QuantMatrix) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            static VNNI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
            let vnni = *VNNI.get_or_init(|| {
                std::is_x86_feature_detected!("avx512vnni")
                    && std::env::var("BATON_DOT_VNNI").map_or(true, |v| v.trim() != "0")
            });
            self == Self::Avx512Q16 && w.interleaved && w.format == BlockFormat::Q4_1 && vnni
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = w;
            false
        }
    }

    /// The kernels this CPU runs, fastest first.
    fn available() -> Vec<Self> {
        let mut kernels = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            let fma_f16c = std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("f16c");
            if fma_f16c && std::is_x86_feature_detected!("avx512f") {
                // AVX2 too: the 32-value formats take AVX2's kernels (every AVX-512 CPU has it).
                if std::is_x86_feature_detected!("avx512bw")
                    && std::is_x86_feature_detected!("avx512vl")
                    && std::is_x86_feature_detected!("avx2")
                {
                    kernels.push(Self::Avx512Q16);
                }
                kernels.push(Self::Avx512);
            }
            if fma_f16c && std::is_x86_feature_detected!("avx2") {
                kernels.push(Self::Avx2Q16);
                kernels.push(Self::Avx2F32);
            }
        }
        kernels.push(Self::Portable);
        kernels
    }

    /// Weight rows `first..` (as many as `out` has room for) dotted with the `m` rows of `x`,
    /// into `out` (`[rows][m]`); `q16` is `x` as [`Self::q16`] rounds it (rounded here when
    /// `None`), and `row` a buffer of `w.cols` floats where [`Self::decodes_rows`].
    #[allow(clippy::too_many_arguments)]
    fn run(
        self,
        w: &QuantMatrix,
        first: usize,
        x: &[f32],
        q16: Option<&Q16Rows>,
        m: usize,
        out: &mut [f32],
        row: &mut [f32],
    ) {
        let kernel = self.for_format(w.format);
        if kernel != self {
            let mut own = Vec::new();
            let row = if kernel.decodes_rows() && row.len() < w.cols {
                own.resize(w.cols, 0.0);
                &mut own[..]
            } else {
                row
            };
            return kernel.run(w, first, x, q16, m, out, row);
        }
        match self {
            #[cfg(target_arch = "x86_64")]
            #[allow(unsafe_code)]
            Self::Avx512Q16 | Self::Avx2Q16 => {
                // The caller's int16 activations, or this call's own.
                let q = match q16 {
                    Some(q) => std::borrow::Cow::Borrowed(q),
                    None => std::borrow::Cow::Owned(self.q16(w, x).expect("int16 activations")),
                };
                debug_assert_eq!(q.view().m(), m);
                let (format, bytes, row_bytes, cols, x) = (w.format, &w.bytes, w.row_bytes, w.cols, q.view());
                // Interleaved rows go to the VNNI kernel where this kernel rounds the
                // activations into bytes, else to the AVX2 kernel straight (the AVX-512 one
                // hands it every 32-value format anyway).
                if self.byte_planes(w) {
                    // Without the bytes the int16 values were left in GGUF's order, which no
                    // kernel here could read against grouped rows.
                    assert!(!x.bytes.is_empty(), "activations for grouped rows rounded without their bytes");
                    // SAFETY: `byte_planes` holds only on a CPU with AVX-512 VNNI, and
                    // `available` lists this kernel only with AVX-512F, AVX-512BW, AVX-512VL,
                    // AVX2, FMA and F16C.
                    unsafe { avx512_q16::q4_1_x8_band(bytes, row_bytes, cols, first, x, out) }
                } else if self == Self::Avx512Q16 && !w.interleaved {
                    // SAFETY: `available` lists this kernel only on a CPU with AVX-512F,
                    // AVX-512BW, AVX-512VL, AVX2, FMA and F16C.
                    unsafe { avx512_q16::band(format, bytes, row_bytes, cols, first, x, out) }
                } else {
                    // SAFETY: `available` lists this kernel only on a CPU with AVX2, FMA and F16C.
                    unsafe { avx2_q16::band(format, w.interleaved, bytes, row_bytes, cols, first, x, out) }
                }
            }
            #[cfg(target_arch = "x86_64")]
            #[allow(unsafe_code)]
            // SAFETY: `detect` picked this kernel only on a CPU with AVX-512F, FMA and F16C.
            Self::Avx512 => {
                if w.interleaved {
                    // Grouped rows are the int16 kernels' layout: a float32 kernel meets them
                    // only where tests run every kernel on one matrix, and decodes them a row
                    // at a time (Q4_1's never come here: this kernel hands that format on).
                    let mut row = vec![0f32; w.cols];
                    return dot_rows(w, first, x, m, out, &mut row);
                }
                unsafe { avx512::band(w.format, &w.bytes, w.row_bytes, w.cols, first, x, m, out) }
            }
            #[cfg(target_arch = "x86_64")]
            #[allow(unsafe_code)]
            // SAFETY: `detect` picked this kernel only on a CPU with AVX2, FMA and F16C.
            Self::Avx2F32 => unsafe { dot_rows_avx2(w, first, x, m, out, row) },
            _ => dot_rows(w, first, x, m, out, row),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::dot;
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};

    /// The portable GEMM path over a matrix of more than one tile (each tile's product lands in
    /// its own columns of the output) against the float product of the decoded matrix.
    #[test]
    fn the_tiled_gemm_puts_each_tile_in_its_columns() {
        let (rows, cols, m_rows) = (TILE_ELEMS / 256 + 37, 256, 19);
        let values: Vec<f32> = (0..rows * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
        let t = Tensor::from_vec(values, (rows, cols), &Device::Cpu).expect("tensor");
        let q = QTensor::quantize(&t, GgmlDType::Q8_0).expect("quantizes");
        let want: Vec<f32> =
            q.dequantize(&Device::Cpu).expect("dequantizes").flatten_all().expect("flat").to_vec1().expect("vec");
        let m = QuantMatrix::new(GgmlDType::Q8_0, &q.data().expect("bytes"), rows, cols).expect("decodable");
        let x: Vec<f32> = (0..m_rows * cols).map(|i| ((i * 13 % 29) as f32 - 14.0) / 9.0).collect();
        let y = m.matmul_tiles(&x, m_rows).expect("product");
        assert!(rows > TILE_ELEMS / cols, "two tiles");
        for r in 0..m_rows {
            for j in [0, 1, TILE_ELEMS / cols - 1, TILE_ELEMS / cols, rows - 1] {
                let want = dot(&x[r * cols..(r + 1) * cols], &want[j * cols..(j + 1) * cols]);
                assert!((y[r * rows + j] - want).abs() < 1e-3, "[{r},{j}]: {} against {want}", y[r * rows + j]);
            }
        }
    }

    fn check(dtype: GgmlDType) {
        let (rows, cols) = (300, 512);
        let values: Vec<f32> = (0..rows * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
        let t = Tensor::from_vec(values, (rows, cols), &Device::Cpu).expect("tensor");
        let q = QTensor::quantize(&t, dtype).expect("quantizes");
        let want: Vec<f32> =
            q.dequantize(&Device::Cpu).expect("dequantizes").flatten_all().expect("flat").to_vec1().expect("vec");
        let m = QuantMatrix::new(dtype, &q.data().expect("bytes"), rows, cols).expect("decodable");
        let got = m.gather(&(0..rows as u32).collect::<Vec<_>>());
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-5, "{dtype:?}: decode differs from candle's by {worst}");
        // Every decode-and-dot kernel this CPU runs, then both product paths, against the
        // float product of the decoded matrix.
        let want_row = |j: usize| want[j * cols..(j + 1) * cols].to_vec();
        for kernel in DotKernel::available() {
            for m_rows in [1, 2, 3, 4, 5, 8, 11] {
                let x: Vec<f32> = (0..m_rows * cols).map(|i| ((i * 11 % 31) as f32 - 15.0) / 7.0).collect();
                let mut out = vec![0f32; rows * m_rows];
                kernel.run(&m, 0, &x, None, m_rows, &mut out, &mut vec![0f32; cols]);
                for r in 0..m_rows {
                    for j in 0..rows {
                        let want = dot(&x[r * cols..(r + 1) * cols], &want[j * cols..(j + 1) * cols]);
                        let got = out[j * m_rows + r];
                        let tol = 1e-3 + rounding_bound(kernel, &m, &x[r * cols..(r + 1) * cols], &want_row(j));
                        assert!((got - want).abs() < tol, "{dtype:?} {kernel:?} m={m_rows}: [{r},{j}]");
                    }
                }
            }
        }
        for m_rows in [1, 2, 3, 5, 8, 9, 20, 37] {
            let x: Vec<f32> = (0..m_rows * cols).map(|i| ((i * 13 % 29) as f32 - 14.0) / 9.0).collect();
            let y = m.matmul_xwt(&x, m_rows).expect("product");
            if m_rows > m.dot_rows() {
                // The portable GEMM path, which this CPU may not take above.
                let tiles = m.matmul_tiles(&x, m_rows).expect("product");
                assert!(tiles.iter().zip(&y).all(|(a, b)| (a - b).abs() < 1e-3), "{dtype:?} m={m_rows}: tiles");
            }
            for r in 0..m_rows {
                for j in 0..rows {
                    let want = dot(&x[r * cols..(r + 1) * cols], &want[j * cols..(j + 1) * cols]);
                    assert!((y[r * rows + j] - want).abs() < 1e-3, "{dtype:?} m={m_rows}: [{r},{j}]");
                }
            }
        }
    }

    /// How far `kernel`'s `x · w` may be from the float product beyond float rounding: half a
    /// step of int16 rounding of each activation, times its weight, for the int16 kernels.
    fn rounding_bound(kernel: DotKernel, m: &QuantMatrix, x: &[f32], w: &[f32]) -> f32 {
        if !kernel.for_format(m.format).int16() {
            return 0.0;
        }
        let q = kernel.q16(m, x).expect("int16 activations");
        let block = q.block;
        w.iter().enumerate().map(|(i, w)| w.abs() * 0.5 * q.scale[i / block]).sum::<f32>() * 1.01
    }

    /// Every kernel against dequantize-then-dot on random weights and activations (some of
    /// them outliers, as a Gemma hidden state has): shapes with tails past every unrolled loop
    /// (odd block counts, row counts off the task and tile sizes), 1 to 11 activation rows.
    #[test]
    fn every_kernel_matches_dequantize_then_dot_on_random_data() {
        use rand::{Rng, SeedableRng, rngs::StdRng};
        let mut rng = StdRng::seed_from_u64(7);
        for (dtype, cols) in [
            (GgmlDType::Q8_0, 32),
            (GgmlDType::Q8_0, 160),
            (GgmlDType::Q4_0, 96),
            (GgmlDType::Q4_1, 32),
            (GgmlDType::Q4_1, 576),
            (GgmlDType::Q5_0, 224),
            (GgmlDType::Q5_0, 640),
            (GgmlDType::Q5_1, 96),
            (GgmlDType::Q5_1, 640),
            (GgmlDType::Q2K, 256),
            (GgmlDType::Q2K, 768),
            (GgmlDType::Q3K, 256),
            (GgmlDType::Q3K, 768),
            (GgmlDType::Q4K, 256),
            (GgmlDType::Q4K, 768),
            (GgmlDType::Q5K, 256),
            (GgmlDType::Q5K, 768),
            (GgmlDType::Q6K, 256),
            (GgmlDType::Q6K, 768),
        ] {
            let rows = 37;
            let values: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            let t = Tensor::from_vec(values, (rows, cols), &Device::Cpu).expect("tensor");
            let q = QTensor::quantize(&t, dtype).expect("quantizes");
            let w: Vec<f32> =
                q.dequantize(&Device::Cpu).expect("dequantizes").flatten_all().expect("flat").to_vec1().expect("vec");
            let mat = QuantMatrix::new(dtype, &q.data().expect("bytes"), rows, cols).expect("decodable");
            for m in 1..=11 {
                let x: Vec<f32> = (0..m * cols)
                    .map(|_| {
                        let v = rng.random_range(-1.0f32..1.0);
                        if rng.random_range(0..50) == 0 { v * 300.0 } else { v }
                    })
                    .collect();
                for kernel in DotKernel::available() {
                    // From a row other than the first, as a task past the first does.
                    let first = 3;
                    let mut out = vec![0f32; (rows - first) * m];
                    kernel.run(&mat, first, &x, None, m, &mut out, &mut vec![0f32; cols]);
                    for r in 0..m {
                        let xr = &x[r * cols..(r + 1) * cols];
                        for j in first..rows {
                            let wr = &w[j * cols..(j + 1) * cols];
                            let want = dot(xr, wr);
                            let scale: f32 = xr.iter().zip(wr).map(|(a, b)| (a * b).abs()).sum();
                            let tol = 1e-5 * scale + 1e-5 + rounding_bound(kernel, &mat, xr, wr);
                            let got = out[(j - first) * m + r];
                            assert!(
                                (got - want).abs() <= tol,
                                "{dtype:?} cols {cols} {kernel:?} m={m}: [{r},{j}] {got} vs {want} (tol {tol})"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Real blocks: SmolLM2 135M Instruct's Q4_1 matrices, as llama.cpp quantized them, through
    /// every kernel and both product paths against candle's dequantization then a float dot.
    /// Needs the model (`scripts/fetch-model.sh`; fails, not skips, without it).
    #[test]
    fn real_q4_1_blocks_of_smollm2_match_dequantize_then_dot() {
        use rand::{Rng, SeedableRng, rngs::StdRng};
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let path = baton_gguf::known::known_model_path(&root, "smollm2-135m-instruct").expect("a known model");
        assert!(path.is_file(), "{} is missing: run `scripts/fetch-model.sh smollm2-135m-instruct`", path.display());
        let file = baton_gguf::GgufFile::open(&path).expect("the GGUF opens");
        let mut rng = StdRng::seed_from_u64(11);
        for name in ["blk.0.attn_k.weight", "blk.7.ffn_down.weight", "blk.29.attn_output.weight"] {
            let (_, dtype, bytes) = file.tensor_data(name).expect("tensor");
            assert_eq!(dtype, GgmlDType::Q4_1, "{name}");
            let q = file.qtensor(name, &Device::Cpu).expect("qtensor");
            let (rows, cols) = q.shape().dims2().expect("a matrix");
            let w: Vec<f32> =
                q.dequantize(&Device::Cpu).expect("dequantizes").flatten_all().expect("flat").to_vec1().expect("vec");
            let mat = QuantMatrix::new(dtype, bytes, rows, cols).expect("decodable");
            assert_eq!(mat.gather(&(0..rows as u32).collect::<Vec<_>>()), w, "{name}: decoded values");
            for m in [1, 3, 20, 40] {
                let x: Vec<f32> = (0..m * cols).map(|_| rng.random_range(-2.0f32..2.0)).collect();
                // Each product as `[m][rows]`, with the kernel whose int16 rounding it may carry.
                let mut outs = vec![(None, mat.matmul_xwt(&x, m).expect("product"))];
                if m <= DOT_ROWS_INT16 {
                    for kernel in DotKernel::available() {
                        let mut out = vec![0f32; rows * m];
                        kernel.run(&mat, 0, &x, None, m, &mut out, &mut vec![0f32; cols]);
                        let y = (0..m * rows).map(|i| out[(i % rows) * m + i / rows]).collect();
                        outs.push((Some(kernel), y));
                    }
                }
                for (kernel, y) in outs {
                    // `matmul_xwt` takes the detected kernel up to its `dot_rows`; above, its int16
                    // panels where it has them, else a float32 GEMM.
                    let detected = DotKernel::detect();
                    let rounds = m <= mat.dot_rows() || cfg!(target_arch = "x86_64") && detected.panel16().is_some();
                    let rounding = kernel.or(rounds.then_some(detected));
                    for r in 0..m {
                        let xr = &x[r * cols..(r + 1) * cols];
                        for j in 0..rows {
                            let wr = &w[j * cols..(j + 1) * cols];
                            let want = dot(xr, wr);
                            let scale: f32 = xr.iter().zip(wr).map(|(a, b)| (a * b).abs()).sum();
                            let bound = rounding.map_or(0.0, |k| rounding_bound(k, &mat, xr, wr));
                            let tol = 1e-5 * scale + 1e-5 + bound;
                            let got = y[r * rows + j];
                            assert!(
                                (got - want).abs() <= tol,
                                "{name} {kernel:?} m={m}: [{r},{j}] {got} vs {want} (tol {tol})"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Where each format keeps its float16 fields; every other bit of a block is integers.
    pub(super) fn half_fields(format: BlockFormat) -> &'static [usize] {
        match format {
            BlockFormat::Q4_0 | BlockFormat::Q5_0 | BlockFormat::Q8_0 => &[0],
            BlockFormat::Q4_1 | BlockFormat::Q5_1 | BlockFormat::Q4K | BlockFormat::Q5K => &[0, 2],
            BlockFormat::Q2K => &[80, 82],
            BlockFormat::Q3K => &[108],
            BlockFormat::Q6K => &[208],
        }
    }

    /// `rows` rows of `blocks` blocks of `format` whose integer bytes come from `byte` and whose
    /// float16 fields (scales, minimums) from `half`: bit patterns quantizing never makes, such
    /// as every sub-block scale at its extreme.
    fn raw_matrix(
        format: BlockFormat,
        rows: usize,
        blocks: usize,
        mut byte: impl FnMut() -> u8,
        mut half: impl FnMut() -> f32,
    ) -> QuantMatrix {
        let bb = format.block_bytes();
        let mut bytes: Vec<u8> = (0..rows * blocks * bb).map(|_| byte()).collect();
        for b in bytes.chunks_exact_mut(bb) {
            for &i in half_fields(format) {
                b[i..i + 2].copy_from_slice(&f16::from_f32(half()).to_le_bytes());
            }
        }
        QuantMatrix::new(format.dtype(), &bytes, rows, blocks * format.block_len()).expect("whole blocks")
    }

    /// Every int16 kernel this CPU runs against the portable decoder ([`BlockFormat::decode`])
    /// and a float64 dot, for the `m` rows of `x`. The int16 rounding of an activation moves
    /// the product by at most half its step times the scaled integer part of its weight (the
    /// weight less its block's minimum, which multiplies float sums), so that is the bound, with
    /// float32 rounding relative to the magnitudes summed.
    fn check_int16_kernels(mat: &QuantMatrix, x: &[f32], m: usize) -> Result<(), String> {
        let (rows, cols) = (mat.rows, mat.cols);
        let all: Vec<u32> = (0..rows as u32).collect();
        let w = mat.gather(&all);
        // The same blocks with their minimums zeroed: the scaled integer part of each weight.
        let min_field = match mat.format {
            BlockFormat::Q4_1 | BlockFormat::Q5_1 | BlockFormat::Q4K | BlockFormat::Q5K => Some(2),
            BlockFormat::Q2K => Some(82),
            _ => None,
        };
        let mut gguf = Vec::with_capacity(mat.bytes.len());
        for r in 0..rows {
            mat.gguf_blocks(r, |_, b| gguf.extend_from_slice(b));
        }
        if let Some(i) = min_field {
            for b in gguf.chunks_exact_mut(mat.format.block_bytes()) {
                b[i..i + 2].fill(0);
            }
        }
        let no_min = QuantMatrix::new(mat.format.dtype(), &gguf, rows, cols).expect("the same shape");
        let w_int = no_min.gather(&all);
        let kernels: Vec<DotKernel> = DotKernel::available().into_iter().filter(|k| k.int16()).collect();
        if kernels.is_empty() {
            return Ok(());
        }
        // Each int16 kernel's products (`[rows][m]`), then the int16 panels' of prefill
        // (`[m][rows]`, transposed here), checked alike.
        let mut runs: Vec<(String, DotKernel, Vec<f32>)> = Vec::new();
        for &kernel in &kernels {
            let mut out = vec![0f32; rows * m];
            kernel.run(mat, 0, x, None, m, &mut out, &mut []);
            runs.push((format!("{kernel:?}"), kernel, out));
        }
        #[cfg(target_arch = "x86_64")]
        for &kernel in &kernels {
            let Some(isa) = kernel.panel16().filter(|_| mat.format.block_len() == 32) else { continue };
            let y = mat.matmul_panels16(x, m, isa);
            let out = (0..rows * m).map(|i| y[(i % m) * rows + i / m]).collect();
            runs.push((format!("{isa:?} panels"), kernel, out));
        }
        // The 32-value formats: every int16 kernel (the AVX-512 one for Q4_1's grouped rows
        // against the activations' bytes where the CPU has VNNI, the AVX2 ones) and the int16
        // panels of prefill sum the same integers and scale and add them in one order, bit for
        // bit (a row's products the same in a decode step and in a prompt's chunk).
        if mat.format.block_len() == 32
            && let Some((first, _, a)) = runs.first()
        {
            for (name, _, b) in &runs[1..] {
                if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
                    return Err(format!(
                        "{:?} {rows}x{cols} m={m}: [{}, {}] {} ({first}) vs {} ({name})",
                        mat.format,
                        i % m,
                        i / m,
                        a[i],
                        b[i]
                    ));
                }
            }
        }
        for (kernel, k16, out) in runs {
            let kernel_name = kernel;
            let kernel = k16;
            for r in 0..m {
                let xr = &x[r * cols..(r + 1) * cols];
                for j in 0..rows {
                    let (wr, wi) = (&w[j * cols..(j + 1) * cols], &w_int[j * cols..(j + 1) * cols]);
                    let want: f64 = xr.iter().zip(wr).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
                    let scale: f64 = xr
                        .iter()
                        .zip(wr.iter().zip(wi))
                        .map(|(&a, (&b, &c))| f64::from(a).abs() * (f64::from(c).abs() + f64::from(b - c).abs()))
                        .sum();
                    let tol = 1e-5 * scale + 1e-6 + f64::from(rounding_bound(kernel, mat, xr, wi));
                    let got = f64::from(out[j * m + r]);
                    if (got - want).abs() > tol {
                        return Err(format!(
                            "{:?} {kernel_name} {rows}x{cols} m={m}: [{r},{j}] {got} vs {want} (tol {tol})",
                            mat.format
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    proptest::proptest! {
        /// The int16 kernels on random bits: any integer in every field (so every sub-block
        /// scale, minimum, high bit and sign pattern), random float16 scales, 1 to 14 activation
        /// rows (past every register-count split) with outliers and all-zero rows, 1 to 11
        /// blocks a row (the 32-value formats' kernels sum eight at a time, the rest alone).
        #[test]
        fn int16_kernels_match_the_portable_decoder_on_random_blocks(
            format in 0..CLAIMED.len(),
            blocks in 1..12usize,
            rows in 1..70usize,
            m in 1..=14usize,
            seed: u64,
        ) {
            use rand::{Rng, SeedableRng, rngs::StdRng};
            let format = BlockFormat::of(CLAIMED[format]).expect("claimed");
            let mut rng = StdRng::seed_from_u64(seed);
            let bytes: Vec<u8> = (0..rows * blocks * format.block_bytes()).map(|_| rng.random()).collect();
            let mut it = bytes.into_iter();
            let halves: Vec<f32> = (0..rows * blocks * 2).map(|_| rng.random_range(-2.0f32..2.0)).collect();
            let mut hs = halves.into_iter();
            let mat = raw_matrix(format, rows, blocks, || it.next().unwrap_or(0), || hs.next().unwrap_or(1.0));
            let cols = mat.cols;
            let x: Vec<f32> = (0..m)
                .flat_map(|r| {
                    let zero = r == 1 && seed % 4 == 0;
                    (0..cols)
                        .map(|_| {
                            let v = rng.random_range(-1.0f32..1.0);
                            if zero { 0.0 } else if rng.random_range(0..50) == 0 { v * 300.0 } else { v }
                        })
                        .collect::<Vec<_>>()
                })
                .collect();
            check_int16_kernels(&mat, &x, m).map_err(proptest::test_runner::TestCaseError::fail)?;
            check_rows_alone(&mat, &x, m).map_err(proptest::test_runner::TestCaseError::fail)?;
        }
    }

    /// Every kernel this CPU runs: each row of an `m`-row product is the same bits as that
    /// row's product alone (a decode row sums alike in a batch of one and of 14).
    fn check_rows_alone(mat: &QuantMatrix, x: &[f32], m: usize) -> Result<(), String> {
        let (rows, cols) = (mat.rows, mat.cols);
        for kernel in DotKernel::available() {
            let run = |x: &[f32], m: usize| {
                let mut out = vec![0f32; rows * m];
                kernel.run(mat, 0, x, None, m, &mut out, &mut vec![0f32; cols]);
                out
            };
            let all = run(x, m);
            for r in 0..m {
                let alone = run(&x[r * cols..(r + 1) * cols], 1);
                if let Some(j) = (0..rows).find(|&j| all[j * m + r].to_bits() != alone[j].to_bits()) {
                    return Err(format!(
                        "{:?} {kernel:?} {rows}x{cols}: row {r} of {m} {} vs {} alone, output {j}",
                        mat.format,
                        all[j * m + r],
                        alone[j]
                    ));
                }
            }
        }
        Ok(())
    }

    /// Through the path the model takes ([`QuantMatrix::matmul_xwt`]: the dot kernels up to
    /// their `dot_rows`, the int16 panels past it for the 32-value formats, the dot kernels at
    /// every size for the others): a row's products are the same bits alone and among 5, 33 or
    /// 70 rows, at SmolLM2's and Gemma 3's widths (whose last blocks are not a whole group of
    /// eight) and a K format's.
    #[test]
    fn a_rows_product_does_not_depend_on_its_batch() {
        if !batch_invariant() {
            return;
        }
        for (dtype, cols) in [
            (GgmlDType::Q4_1, 576),
            (GgmlDType::Q8_0, 576),
            (GgmlDType::Q5_0, 640),
            (GgmlDType::Q4_0, 352),
            (GgmlDType::Q5_1, 288),
            (GgmlDType::Q4K, 512),
            (GgmlDType::Q6K, 768),
        ] {
            let values: Vec<f32> = (0..70 * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
            let t = Tensor::from_vec(values, (70, cols), &Device::Cpu).expect("tensor");
            let q = QTensor::quantize(&t, dtype).expect("quantizes");
            let w = QuantMatrix::new(dtype, &q.data().expect("bytes"), 70, cols).expect("decodable");
            let x: Vec<f32> = (0..70 * cols).map(|i| ((i * 13 % 29) as f32 - 14.0) / 9.0).collect();
            let alone: Vec<Vec<f32>> =
                (0..70).map(|r| w.matmul_xwt(&x[r * cols..(r + 1) * cols], 1).expect("product")).collect();
            for m in [5, 33, 70] {
                let y = w.matmul_xwt(&x[..m * cols], m).expect("product");
                for (r, alone) in alone.iter().take(m).enumerate() {
                    let row = &y[r * 70..(r + 1) * 70];
                    let same = row.iter().zip(alone).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{dtype:?} row {r} of {m}: {:?} vs {:?} alone", &row[..4], &alone[..4]);
                }
            }
        }
    }

    /// Grouped rows against the same rows in GGUF's order, through the int16 kernels: the
    /// same products bit for bit (the kernels sum the same integers and scale them alike), for
    /// rows of one group, a group and a tail, and several groups, at one to six activation rows.
    #[test]
    fn grouped_rows_multiply_as_their_gguf_order_does() {
        use rand::{Rng, SeedableRng, rngs::StdRng};
        let mut rng = StdRng::seed_from_u64(7);
        for format in [BlockFormat::Q4_1, BlockFormat::Q5_0] {
            for blocks in [8, 11, 20, 27] {
                let rows = 13;
                let mut bytes: Vec<u8> = (0..rows * blocks * format.block_bytes()).map(|_| rng.random()).collect();
                for b in bytes.chunks_exact_mut(format.block_bytes()) {
                    for &i in half_fields(format) {
                        b[i..i + 2].copy_from_slice(&f16::from_f32(rng.random_range(-2.0f32..2.0)).to_le_bytes());
                    }
                }
                let cols = blocks * 32;
                let grouped = QuantMatrix::new(format.dtype(), &bytes, rows, cols).expect("whole blocks");
                if !grouped.interleaved {
                    // A CPU (or a `BATON_DOT_KERNEL`) without the int16 kernels groups nothing.
                    return;
                }
                let gguf = QuantMatrix { bytes: bytes.clone(), interleaved: false, ..grouped.clone() };
                for m in 1..=6 {
                    let x: Vec<f32> = (0..m * cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                    for kernel in DotKernel::available().into_iter().filter(|k| k.int16()) {
                        let (mut a, mut b) = (vec![0f32; rows * m], vec![0f32; rows * m]);
                        kernel.run(&grouped, 0, &x, None, m, &mut a, &mut []);
                        kernel.run(&gguf, 0, &x, None, m, &mut b, &mut []);
                        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&a), bits(&b), "{format:?} {kernel:?} {blocks} blocks, m={m}");
                    }
                }
            }
        }
    }

    /// The int32 sums at their bounds: every integer field at its extreme (all bits clear, all
    /// set, alternating) under activations of one sign at full int16 scale, where the largest
    /// sums of a lane meet 2³¹ (Q6_K's half super-block, Q5_K's whole one).
    #[test]
    fn int16_kernels_do_not_overflow_on_extreme_blocks() {
        for dtype in CLAIMED {
            let format = BlockFormat::of(dtype).expect("claimed");
            for fill in [0x00, 0xff, 0x80, 0x55] {
                // 11 blocks: a group of eight and three alone in the 32-value formats' kernels.
                let mat = raw_matrix(format, 5, 11, || fill, || 1.0);
                for sign in [1.0f32, -1.0] {
                    let x = vec![sign; 4 * mat.cols];
                    if let Err(e) = check_int16_kernels(&mat, &x, 4) {
                        panic!("fill {fill:#04x} sign {sign}: {e}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_kernel_named_in_the_environment_is_one_this_cpu_runs() {
        assert!(DotKernel::available().contains(&DotKernel::detect()));
        assert_eq!(DotKernel::available().last(), Some(&DotKernel::Portable));
    }

    #[test]
    fn decoding_matches_candle_for_every_format() {
        for dtype in CLAIMED {
            check(dtype);
        }
    }

    /// Every quantized type Baton claims to run: each must have its own decoder here (so none
    /// falls to candle's 8-bit-activation kernels).
    const CLAIMED: [GgmlDType; 10] = [
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q8_0,
        GgmlDType::Q2K,
        GgmlDType::Q3K,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ];

    #[test]
    fn every_claimed_type_has_its_own_kernels_with_activations_at_least_int16_fine() {
        for dtype in CLAIMED {
            let format = BlockFormat::of(dtype).unwrap_or_else(|| panic!("{dtype:?} has no decoder here"));
            for kernel in DotKernel::available() {
                let used = kernel.for_format(format);
                assert!(used.supports(format), "{dtype:?}: {kernel:?} -> {used:?}");
                // Never coarser than the kernel asked for: int16 only where int16 was asked.
                assert!(used == kernel || kernel.int16() || !used.int16(), "{dtype:?}: {kernel:?} -> {used:?}");
            }
        }
        for other in [GgmlDType::F32, GgmlDType::F16, GgmlDType::Q8_1, GgmlDType::Q8K] {
            assert_eq!(BlockFormat::of(other), None, "{other:?}");
        }
    }
}

#[cfg(test)]
mod speed {
    use super::*;
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};

    /// A `rows × cols` matrix of fixed values quantized to `dtype` by candle.
    fn quantized(dtype: GgmlDType, rows: usize, cols: usize) -> QuantMatrix {
        let values: Vec<f32> = (0..rows * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
        let t = Tensor::from_vec(values, (rows, cols), &Device::Cpu).expect("tensor");
        let q = QTensor::quantize(&t, dtype).expect("quantizes");
        QuantMatrix::new(dtype, &q.data().expect("bytes"), rows, cols).expect("decodable")
    }

    /// The shortest of `n` runs of `f`, in seconds.
    fn best_secs(n: usize, mut f: impl FnMut()) -> f64 {
        (0..n)
            .map(|_| {
                let t = std::time::Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::MAX, f64::min)
    }

    /// Single-threaded throughput of the decode path for each format at Gemma 3 270M's and
    /// SmolLM2's shapes, best of 100 (this VM's quiet windows are short): `cargo test --release
    /// -p baton-cpu --lib decode_path -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement, not a check"]
    fn decode_path_throughput() {
        for (dtype, rows, cols) in [
            (GgmlDType::Q8_0, 16384, 640),
            (GgmlDType::Q8_0, 131_072, 640),
            (GgmlDType::Q5_0, 4096, 640),
            (GgmlDType::Q4K, 640, 1024),
            (GgmlDType::Q6K, 640, 2048),
            // SmolLM2-135M's MLP, and a Q4_1 matrix larger than the caches.
            (GgmlDType::Q4_1, 3072, 576),
            (GgmlDType::Q4_1, 131_072, 576),
        ] {
            let w = quantized(dtype, rows, cols);
            for m in [1, 4] {
                let x: Vec<f32> = (0..m * cols).map(|i| ((i * 13 % 29) as f32 - 14.0) / 9.0).collect();
                let mut out = vec![0f32; rows * m];
                let mut row = vec![0f32; cols];
                let q16 = DotKernel::detect().q16(&w, &x);
                let best = best_secs(100, || DotKernel::detect().run(&w, 0, &x, q16.as_ref(), m, &mut out, &mut row));
                // Rounding the activations, once a product, on the stepping thread.
                let round = best_secs(100, || drop(std::hint::black_box(DotKernel::detect().q16(&w, &x))));
                let weights = (rows * cols) as f64;
                println!(
                    "{dtype:?} {rows}x{cols} m={m}: {:.3} ms, {:.2} Gweights/s, {:.1} GB/s; activations rounded in {:.2} µs",
                    best * 1e3,
                    weights / best / 1e9,
                    w.byte_len() as f64 / best / 1e9,
                    round * 1e6
                );
            }
        }
    }

    /// Where the decode-and-dot path stops paying against the path above it (int16 or float32
    /// panels, or tiles, as the kernel has them), on the machine's threads, at SmolLM2's and
    /// Gemma 3's shapes: `[BATON_DOT_KERNEL=name] cargo test --release -p baton-cpu --lib
    /// dot_or_gemm -- --ignored --nocapture`. Sets [`DOT_ROWS_INT16`] and [`DOT_ROWS_F32`].
    #[test]
    #[ignore = "a measurement, not a check"]
    fn dot_or_gemm() {
        println!("kernel {}", DotKernel::detect().name());
        for (dtype, rows, cols) in [
            // SmolLM2 135M: gate_up, down, the output head.
            (GgmlDType::Q4_1, 3072, 576),
            (GgmlDType::Q4_1, 576, 1536),
            (GgmlDType::Q8_0, 49152, 576),
            // Gemma 3 270M's MLP (its formats vary by tensor).
            (GgmlDType::Q5_0, 4096, 640),
            (GgmlDType::Q6K, 640, 2048),
        ] {
            let w = quantized(dtype, rows, cols);
            for m in [4, 8, 12, 16, 24, 32, 48, 64] {
                let x: Vec<f32> = (0..m * cols).map(|i| ((i * 13 % 29) as f32 - 14.0) / 9.0).collect();
                let dot = best_secs(20, || drop(crate::pool::step_in_pool(|| w.matmul_dot(&x, m))));
                let gemm = best_secs(20, || drop(crate::pool::step_in_pool(|| w.matmul_gemm(&x, m))));
                println!("{dtype:?} {rows}x{cols} m={m}: dot {:.3} ms, gemm {:.3} ms", dot * 1e3, gemm * 1e3);
            }
        }
    }

    /// Single-threaded prefill products (512 activation rows) at Gemma 3 270M's shapes, in
    /// multiply-adds per second: the int16 panels of each ISA this CPU runs against the float32
    /// panels (`cargo test --release -p baton-cpu prefill_path -- --ignored --nocapture`).
    #[test]
    #[ignore = "a measurement, not a check"]
    fn prefill_path_throughput() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("a pool");
        for (dtype, rows, cols) in [
            (GgmlDType::Q5_0, 2048, 640),
            (GgmlDType::Q8_0, 1024, 640),
            (GgmlDType::Q4K, 640, 1024),
            (GgmlDType::Q6K, 640, 2048),
            (GgmlDType::Q4_1, 1536, 576),
        ] {
            let w = quantized(dtype, rows, cols);
            let m = 512;
            let x: Vec<f32> = (0..m * cols).map(|i| ((i * 13 % 29) as f32 - 14.0) / 9.0).collect();
            type Run = Box<dyn Fn() -> Vec<f32> + Send + Sync>;
            let mut runs: Vec<(String, Run)> = Vec::new();
            #[cfg(target_arch = "x86_64")]
            for kernel in DotKernel::available() {
                if let Some(isa) = kernel.panel16().filter(|_| w.format.block_len() == 32) {
                    let (w, x) = (w.clone(), x.clone());
                    runs.push((format!("{isa:?} int16 panels"), Box::new(move || w.matmul_panels16(&x, m, isa))));
                }
                if kernel == DotKernel::Avx512 {
                    let (w, x) = (w.clone(), x.clone());
                    runs.push(("float32 panels".into(), Box::new(move || w.matmul_panels(&x, m))));
                }
            }
            // The dot kernel at every size: where batch invariance sends the K formats.
            let (wd, xd) = (w.clone(), x.clone());
            runs.push(("dot kernel".into(), Box::new(move || wd.matmul_dot(&xd, m))));
            // Where prefill takes them (`panel16()`): a CPU with what `panel_gemm` requires.
            #[cfg(target_arch = "x86_64")]
            if DotKernel::available().iter().any(|k| k.panel16() == Some(panel16::PanelIsa::Avx512Vnni))
                && w.format.block_len() == 32
            {
                // The kernel alone: the panels packed and the activations rounded beforehand.
                use avx512_q16::PANEL16 as NR;
                let (g, mins) = (panel16::group(w.format), panel16::has_mins(w.format));
                let (qs, fs) = (NR * cols, NR * (cols / g));
                let panels = rows.div_ceil(NR);
                let (mut q, mut f) = (vec![0i16; panels * qs], vec![0f32; panels * fs]);
                let mut mn = vec![0f32; if mins { panels * fs } else { 0 }];
                let mut buf = panel16::PackBuf::default();
                for p in 0..panels {
                    let mnp = if mins { &mut mn[p * fs..(p + 1) * fs] } else { &mut [][..] };
                    let out =
                        panel16::PanelMut { q: &mut q[p * qs..(p + 1) * qs], f: &mut f[p * fs..(p + 1) * fs], mn: mnp };
                    panel16::pack::<NR>(&w, p * NR, NR.min(rows - p * NR), out, &mut buf);
                }
                let xq = Q16Rows::new(&x, cols, q16::q16_block(w.format));
                let mut y = vec![0f32; m * rows];
                let best = best_secs(5, || {
                    for r0 in (0..m).step_by(GEMM_ROW_BLOCK) {
                        let xv = xq.rows(r0, GEMM_ROW_BLOCK.min(m - r0));
                        for p in 0..panels {
                            let mnp = if mins { &mn[p * fs..(p + 1) * fs] } else { &[][..] };
                            let panel = panel16::Panel16 {
                                q: &q[p * qs..(p + 1) * qs],
                                f: &f[p * fs..(p + 1) * fs],
                                mn: mnp,
                                k: cols,
                                group: g,
                            };
                            #[allow(unsafe_code)]
                            // SAFETY: the CPU has what prefill's VNNI panels need (checked
                            // above): AVX-512F, BW, VL, VNNI and FMA.
                            unsafe {
                                avx512_q16::panel_gemm(
                                    panel,
                                    xv,
                                    &mut y[r0 * rows + p * NR..],
                                    rows,
                                    NR.min(rows - p * NR),
                                )
                            };
                        }
                    }
                });
                let macs = (m * rows * cols) as f64;
                println!(
                    "{dtype:?} {rows}x{cols} m={m} Avx512Vnni kernel alone: {:.2} ms, {:.1} GMAC/s",
                    best * 1e3,
                    macs / best / 1e9
                );
            }
            for (name, run) in runs {
                let best = pool.install(|| {
                    best_secs(5, || {
                        std::hint::black_box(run());
                    })
                });
                let macs = (m * rows * cols) as f64;
                println!("{dtype:?} {rows}x{cols} m={m} {name}: {:.2} ms, {:.1} GMAC/s", best * 1e3, macs / best / 1e9);
            }
        }
    }

    /// The decode products of a SmolLM2-shaped step alone (30 layers of Q4_1 qkv, o, gate_up
    /// and down and a Q8_0 output head: 96 MB, more than the caches hold), beside the read probe
    /// of `baton bench engine` measured in the same round, four ways: as decode runs them
    /// (`matmul_dot` on the step's team: activations rounded and the output allocated each
    /// product); on the team with both made before the step; each thread half of every matrix
    /// with one join a step (no hand-off per product: what the split itself allows); one thread.
    /// `cargo test --release -p baton-cpu --lib team_products -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement, not a check"]
    fn team_products_cold() {
        use rayon::prelude::*;
        let layer = [(960, 576), (576, 576), (3072, 576), (576, 1536)];
        let mats: Vec<QuantMatrix> = (0..30)
            .flat_map(|_| layer.iter().map(|&(r, c)| quantized(GgmlDType::Q4_1, r, c)))
            .chain(std::iter::once(quantized(GgmlDType::Q8_0, 49152, 576)))
            .collect();
        let bytes = mats.iter().map(QuantMatrix::byte_len).sum::<usize>() as f64;
        let xs: Vec<Vec<f32>> =
            [576, 1536].iter().map(|&k| (0..k).map(|i| ((i * 13 % 29) as f32 - 14.0) / 9.0).collect()).collect();
        let x_of = |w: &QuantMatrix| if w.cols == 576 { &xs[0] } else { &xs[1] };
        let kernel = DotKernel::detect();
        let q16s: Vec<Option<Q16Rows>> = mats.iter().map(|w| kernel.q16(w, x_of(w))).collect();
        let mut outs: Vec<Vec<f32>> = mats.iter().map(|w| vec![0f32; w.rows]).collect();
        let probe: Vec<f32> = (0..(1usize << 28)).into_par_iter().map(|i| (i % 7) as f32).collect();
        let chunk = probe.len().div_ceil(rayon::current_num_threads() * 4);
        let median = |n: usize, f: &mut dyn FnMut()| {
            let mut t: Vec<f64> = (0..n)
                .map(|_| {
                    let t = std::time::Instant::now();
                    f();
                    t.elapsed().as_secs_f64()
                })
                .collect();
            t.sort_by(f64::total_cmp);
            t[n / 2]
        };
        // Rows `part` of two of every matrix.
        let half = |part: usize, outs: &mut [Vec<f32>]| {
            for ((w, q), out) in mats.iter().zip(&q16s).zip(outs.iter_mut()) {
                let (a, b) = if part == 0 { (0, w.rows / 2) } else { (w.rows / 2, w.rows) };
                kernel.run(w, a, x_of(w), q.as_ref(), 1, &mut out[a..b], &mut []);
            }
        };
        println!("kernel {}, {} threads, {:.1} MB a step", kernel.name(), rayon::current_num_threads(), bytes / 1e6);
        for round in 0..6 {
            let read = (probe.len() * 4) as f64
                / best_secs(3, || {
                    let s: f32 = probe.par_chunks(chunk).map(crate::gemv::sum).sum();
                    std::hint::black_box(s);
                })
                / 1e9;
            let decode = median(20, &mut || {
                crate::pool::step_in_pool(|| {
                    for w in &mats {
                        std::hint::black_box(w.matmul_dot(x_of(w), 1));
                    }
                })
            });
            let made_before = median(20, &mut || {
                crate::pool::step_in_pool(|| {
                    for ((w, q), out) in mats.iter().zip(&q16s).zip(outs.iter_mut()) {
                        let rows =
                            w.rows.div_ceil(rayon::current_num_threads() * TASKS_PER_THREAD).max(MIN_ROWS_PER_TASK);
                        crate::pool::for_each_chunk(
                            out,
                            rows,
                            || (),
                            |_, task, o| kernel.run(w, task * rows, x_of(w), q.as_ref(), 1, o, &mut []),
                        );
                    }
                })
            });
            let (mut o1, mut o2) = (outs.clone(), outs.clone());
            let halves = median(20, &mut || {
                rayon::join(|| half(0, &mut o1), || half(1, &mut o2));
            });
            let one = median(10, &mut || {
                half(0, &mut o1);
                half(1, &mut o1);
            });
            let show = |secs: f64| format!("{:.3} ms ({:.0}%)", secs * 1e3, 100.0 * bytes / secs / 1e9 / read);
            println!(
                "round {round}: read {read:.1} GB/s; as decode runs them {}, made before {}, halves with one join {}, one thread {}",
                show(decode),
                show(made_before),
                show(halves),
                show(one)
            );
        }
    }
}
