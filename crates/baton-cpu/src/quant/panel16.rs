//! Prefill's products (many activation rows) in int16: weight rows decoded once into packed
//! int16 panels, activations rounded to int16 as the decode kernels round them ([`super::q16`]),
//! and register tiles of `vpdpwssd` (AVX-512 VNNI) or `vpmaddwd` (AVX2) with no horizontal sums.
//!
//! A panel holds `NR` weight rows (32 for AVX-512, 16 for AVX2) as their raw block integers,
//! pairs of consecutive values interleaved (`[k / 2][NR][2]`), so one 32-bit broadcast of an
//! activation pair multiplies a whole register of weight rows. Every *group* of [`group`]
//! values (a block, or a K format's sub-block) has one float factor per weight row (`d`, times
//! the sub-block's integer scale) and, for formats with minimums, one coefficient of the
//! group's float activation sum. The kernels sum a group in int32 — a lane adds at most 32
//! products of an integer of at most 8 bits (Q8_0's ±128; the others' are smaller) and an
//! int16, under 2²⁸ — then scale it once in float32.
//!
//! Products take these panels only for the 32-value formats, where `panel_gemm` sums and
//! rounds each row as the decode kernels do, bit for bit (a row's products do not depend on
//! its batch: [`super::QuantMatrix::matmul_xwt`]); the K formats' groups are packed here too,
//! for the measurements, but those products take the decode kernels at every size.
//!
//! Against the float32 panels of [`super::avx512`] this does half the instructions per
//! product (an int16 pair per lane); against float32 the activations are rounded to 1/65534 of
//! their block's largest value, as the decode path has always rounded them.

use super::q16::Q16View;
use super::{BlockFormat, QuantMatrix};

/// Values per group of `format`: one float factor (and minimum) each.
pub(super) fn group(format: BlockFormat) -> usize {
    match format {
        BlockFormat::Q2K | BlockFormat::Q3K | BlockFormat::Q6K => 16,
        _ => 32,
    }
}

/// Whether `format` has minimums (a value is `d·q − m`, or `d·q + m`).
pub(super) fn has_mins(format: BlockFormat) -> bool {
    matches!(format, BlockFormat::Q4_1 | BlockFormat::Q5_1 | BlockFormat::Q2K | BlockFormat::Q4K | BlockFormat::Q5K)
}

/// One block `b` of `format` as integers `q` (`block_len` of them) with, per group, a factor
/// `f` and a minimum `mn`: value `j` is `q[j] · f[j / G] + mn[j / G]` (`mn` is left alone for
/// formats without minimums).
#[inline(always)]
pub(super) fn decode_ints(format: BlockFormat, b: &[u8], q: &mut [i16], f: &mut [f32], mn: &mut [f32]) {
    let half = |i: usize| half::f16::from_le_bytes([b[i], b[i + 1]]).to_f32();
    /// 32 values from 16 bytes: their low nibbles, then their high ones, less `off`.
    #[inline(always)]
    fn nibbles(qs: &[u8], q: &mut [i16], off: i16) {
        let (lo, hi) = q[..32].split_at_mut(16);
        for ((lo, hi), &v) in lo.iter_mut().zip(hi).zip(&qs[..16]) {
            (*lo, *hi) = (i16::from(v & 0x0f) - off, i16::from(v >> 4) - off);
        }
    }
    /// Adds the fifth bits of Q5_0 and Q5_1 (bit `j` of the little-endian `qh`) to `q`.
    #[inline(always)]
    fn fifth(qh: &[u8], q: &mut [i16]) {
        let bits = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
        for (j, q) in q[..32].iter_mut().enumerate() {
            *q |= (((bits >> j) & 1) << 4) as i16;
        }
    }
    match format {
        BlockFormat::Q8_0 => {
            f[0] = half(0);
            for (q, &v) in q[..32].iter_mut().zip(&b[2..34]) {
                *q = i16::from(v as i8);
            }
        }
        BlockFormat::Q4_0 => {
            f[0] = half(0);
            nibbles(&b[2..18], q, 8);
        }
        BlockFormat::Q4_1 => {
            (f[0], mn[0]) = (half(0), half(2));
            nibbles(&b[4..20], q, 0);
        }
        BlockFormat::Q5_0 => {
            f[0] = half(0);
            nibbles(&b[6..22], q, 0);
            fifth(&b[2..6], q);
            q[..32].iter_mut().for_each(|q| *q -= 16);
        }
        BlockFormat::Q5_1 => {
            (f[0], mn[0]) = (half(0), half(2));
            nibbles(&b[8..24], q, 0);
            fifth(&b[4..8], q);
        }
        BlockFormat::Q2K => {
            let (d, dmin) = (half(80), half(82));
            for n in 0..2 {
                let qs = &b[16 + 32 * n..16 + 32 * n + 32];
                for j in 0..4 {
                    for h in 0..2 {
                        let s = 8 * n + 2 * j + h;
                        let sc = b[s];
                        (f[s], mn[s]) = (d * f32::from(sc & 0x0f), -dmin * f32::from(sc >> 4));
                        for (q, &v) in q[16 * s..16 * s + 16].iter_mut().zip(&qs[16 * h..16 * h + 16]) {
                            *q = i16::from((v >> (2 * j)) & 3);
                        }
                    }
                }
            }
        }
        BlockFormat::Q3K => {
            let d = half(108);
            let hmask = &b[0..32];
            let scales = super::scales_k3(&b[96..108]);
            for n in 0..2 {
                let qs = &b[32 + 32 * n..32 + 32 * n + 32];
                for j in 0..4 {
                    for h in 0..2 {
                        let s = 8 * n + 2 * j + h;
                        f[s] = d * f32::from(scales[s]);
                        let (qs, hm) = (&qs[16 * h..16 * h + 16], &hmask[16 * h..16 * h + 16]);
                        for ((q, &v), &m) in q[16 * s..16 * s + 16].iter_mut().zip(qs).zip(hm) {
                            // The third bit, when clear, means the value is offset by −4.
                            *q = i16::from((v >> (2 * j)) & 3) - 4 * i16::from(((m >> (4 * n + j)) & 1) ^ 1);
                        }
                    }
                }
            }
        }
        BlockFormat::Q4K | BlockFormat::Q5K => {
            let (d, dmin) = (half(0), half(2));
            let scales = &b[4..16];
            let (qh, qs) =
                if format == BlockFormat::Q5K { (Some(&b[16..48]), &b[48..176]) } else { (None, &b[16..144]) };
            for g in 0..4 {
                let (lo, hi) = q[64 * g..64 * g + 64].split_at_mut(32);
                for ((lo, hi), &v) in lo.iter_mut().zip(hi.iter_mut()).zip(&qs[32 * g..32 * g + 32]) {
                    (*lo, *hi) = (i16::from(v & 0x0f), i16::from(v >> 4));
                }
                if let Some(qh) = qh {
                    for (l, &h) in qh.iter().enumerate() {
                        lo[l] |= i16::from((h >> (2 * g)) & 1) << 4;
                        hi[l] |= i16::from((h >> (2 * g + 1)) & 1) << 4;
                    }
                }
                for s in [2 * g, 2 * g + 1] {
                    let (sc, m) = super::scale_min_k4(s, scales);
                    (f[s], mn[s]) = (d * f32::from(sc), -dmin * f32::from(m));
                }
            }
        }
        BlockFormat::Q6K => {
            let d = half(208);
            for n in 0..2 {
                let (ql, qh) = (&b[64 * n..64 * n + 64], &b[128 + 32 * n..128 + 32 * n + 32]);
                let q = &mut q[128 * n..128 * n + 128];
                for l in 0..32 {
                    let h = qh[l];
                    q[l] = i16::from((ql[l] & 0x0f) | ((h & 3) << 4)) - 32;
                    q[l + 32] = i16::from((ql[l + 32] & 0x0f) | (((h >> 2) & 3) << 4)) - 32;
                    q[l + 64] = i16::from((ql[l] >> 4) | (((h >> 4) & 3) << 4)) - 32;
                    q[l + 96] = i16::from((ql[l + 32] >> 4) | (((h >> 6) & 3) << 4)) - 32;
                }
                for s in 0..8 {
                    f[8 * n + s] = d * f32::from(b[192 + 8 * n + s] as i8);
                }
            }
        }
    }
}

/// A packed panel of `NR` weight rows over `k` values.
#[derive(Debug, Clone, Copy)]
pub(super) struct Panel16<'a> {
    /// `[k / 2][NR][2]`: value pairs `(2t, 2t + 1)` of each weight row, rows side by side.
    pub(super) q: &'a [i16],
    /// `[k / G][NR]`: each group's factor per weight row.
    pub(super) f: &'a [f32],
    /// `[k / G][NR]`: each group's minimum per weight row (empty without minimums).
    pub(super) mn: &'a [f32],
    pub(super) k: usize,
    /// Values per group ([`group`]).
    pub(super) group: usize,
}

/// One panel's storage, as [`pack`] fills it: `q` of `k·NR` integers, `f` and `mn` of
/// `k / G · NR` floats (`mn` empty for formats without minimums).
#[derive(Debug)]
pub(super) struct PanelMut<'a> {
    pub(super) q: &'a mut [i16],
    pub(super) f: &'a mut [f32],
    pub(super) mn: &'a mut [f32],
}

/// Decodes weight rows `first..first + rows` of `w` (at most `NR`) into `out`, zeros past
/// `rows`; `buf` is scratch.
pub(super) fn pack<const NR: usize>(w: &QuantMatrix, first: usize, rows: usize, out: PanelMut<'_>, buf: &mut PackBuf) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        /// [`pack_rows`] compiled for AVX2, where its loops vectorize.
        #[target_feature(enable = "avx2")]
        fn avx2<const NR: usize>(w: &QuantMatrix, first: usize, rows: usize, out: PanelMut<'_>, buf: &mut PackBuf) {
            pack_rows::<NR>(w, first, rows, out, buf);
        }
        #[allow(unsafe_code)]
        // SAFETY: the CPU has AVX2, checked just above.
        unsafe {
            avx2::<NR>(w, first, rows, out, buf)
        };
        return;
    }
    pack_rows::<NR>(w, first, rows, out, buf);
}

#[inline(always)]
fn pack_rows<const NR: usize>(w: &QuantMatrix, first: usize, rows: usize, out: PanelMut<'_>, buf: &mut PackBuf) {
    let PanelMut { q, f, mn } = out;
    let (k, format) = (w.cols, w.format);
    let (bl, g) = (format.block_len(), group(format));
    let groups = k / g;
    assert!(rows <= NR && q.len() == k * NR && f.len() == groups * NR && (mn.is_empty() || mn.len() == f.len()));
    buf.q.resize(k, 0);
    buf.f.resize(groups, 0.0);
    buf.mn.resize(groups, 0.0);
    if rows < NR {
        q.fill(0);
        f.fill(0.0);
        mn.fill(0.0);
    }
    for c in 0..rows {
        let (bq, bf, bm) = (&mut buf.q[..], &mut buf.f[..], &mut buf.mn[..]);
        w.gguf_blocks(first + c, |i, b| {
            let s = i * bl / g..(i + 1) * bl / g;
            decode_ints(format, b, &mut bq[i * bl..(i + 1) * bl], &mut bf[s.clone()], &mut bm[s]);
        });
        // Value pairs into the row's column of pairs, one 32-bit store each (the pair's first
        // value at the lower address, as the kernels' little-endian lanes read it).
        assert!(2 * c + 1 < 2 * NR && (k / 2 - 1) * 2 * NR + 2 * c + 1 < q.len());
        let column = q[2 * c..].as_mut_ptr();
        for (t2, pair) in bq.chunks_exact(2).enumerate() {
            let v = u32::from(pair[0] as u16) | (u32::from(pair[1] as u16) << 16);
            #[allow(unsafe_code)]
            // SAFETY: values `t2·2·NR + 2c` and `+ 1` of `q`, `t2 < k / 2`: the assert above
            // bounds the last of them.
            unsafe {
                column.add(t2 * 2 * NR).cast::<u32>().write_unaligned(v)
            };
        }
        for s in 0..groups {
            f[s * NR + c] = bf[s];
        }
        if !mn.is_empty() {
            for s in 0..groups {
                mn[s * NR + c] = bm[s];
            }
        }
    }
}

/// Scratch of [`pack`]: one weight row's integers, factors and minimums.
#[derive(Debug, Default)]
pub(super) struct PackBuf {
    q: Vec<i16>,
    f: Vec<f32>,
    mn: Vec<f32>,
}

/// Which register width a panel product runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PanelIsa {
    /// 32 weight rows per panel, `vpdpwssd` (AVX-512F, BW, VL and VNNI).
    Avx512Vnni,
    /// 16 weight rows per panel, `vpmaddwd` (AVX2).
    Avx2,
}

impl Panel16<'_> {
    /// Checks what a kernel's tiles rely on: the panel's sizes for `nr` weight rows, `x`'s
    /// against them (scales and sums of every row included), and room in `y` for `cols`
    /// outputs of each of `x`'s rows, `ldy` apart.
    pub(super) fn check(&self, nr: usize, x: &Q16View<'_>, y: &[f32], ldy: usize, cols: usize) {
        let (rows, k, g) = (x.m(), self.k, self.group);
        assert!(
            k == x.k
                && k.is_multiple_of(x.block)
                && x.block.is_multiple_of(g)
                && (x.block / g).is_power_of_two()
                && (g == 16 || g == 32)
        );
        assert!(self.q.len() == k * nr && self.f.len() == k / g * nr);
        assert!(self.mn.is_empty() || self.mn.len() == self.f.len());
        assert!(
            x.scale.len() == rows * (k / x.block) && x.sum16.len() == rows * k / 16 && x.sum32.len() == rows * k / 32
        );
        assert!(cols <= nr && cols <= ldy && (rows == 0 || y.len() >= (rows - 1) * ldy + cols));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every format's integers, factors and minimums give back its float decoding.
    #[test]
    fn integers_times_factors_are_the_decoded_values() {
        let formats = [
            BlockFormat::Q4_0,
            BlockFormat::Q4_1,
            BlockFormat::Q5_0,
            BlockFormat::Q5_1,
            BlockFormat::Q8_0,
            BlockFormat::Q2K,
            BlockFormat::Q3K,
            BlockFormat::Q4K,
            BlockFormat::Q5K,
            BlockFormat::Q6K,
        ];
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for format in formats {
            for _ in 0..20 {
                let mut b: Vec<u8> = (0..format.block_bytes())
                    .map(|_| {
                        seed ^= seed << 13;
                        seed ^= seed >> 7;
                        seed ^= seed << 17;
                        seed as u8
                    })
                    .collect();
                // Finite float16 scales: clear the exponent's top bit of every half field.
                for i in super::super::tests::half_fields(format) {
                    b[i + 1] &= 0x3f;
                }
                let (bl, g) = (format.block_len(), group(format));
                let (mut q, mut f, mut mn) = (vec![0i16; bl], vec![0f32; bl / g], vec![0f32; bl / g]);
                decode_ints(format, &b, &mut q, &mut f, &mut mn);
                let mut want = vec![0f32; bl];
                format.decode(&b, &mut want);
                for j in 0..bl {
                    let got = f32::from(q[j]) * f[j / g] + mn[j / g];
                    let tol = 1e-6 * (want[j].abs() + f[j / g].abs() * 64.0 + mn[j / g].abs());
                    assert!((got - want[j]).abs() <= tol, "{format:?}[{j}]: {got} vs {}", want[j]);
                    assert!(i32::from(q[j]).abs() <= 128, "{format:?}: {} needs more than 8 bits", q[j]);
                }
                if !has_mins(format) {
                    assert!(mn.iter().all(|&m| m == 0.0), "{format:?} has no minimums");
                }
            }
        }
    }
}
