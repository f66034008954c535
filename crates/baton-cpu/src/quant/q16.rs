//! Activation rows rounded to int16 for the integer decode-and-dot kernels ([`super::avx512_q16`],
//! [`super::avx2_q16`]).
//!
//! Each run of `block` values of a row gets its own scale (`max |x| / 32767`), so a value is
//! off by at most 1/65534 of its block's largest — about 250 times finer than the 8-bit
//! activations of llama.cpp (and candle), whose rounding moves Gemma 3 270M's logits enough to
//! flip near-ties. The weights' integers multiply these in int16 lanes (`vpmaddwd`), exact in
//! int32, and only each block's sum is scaled in float32.
//!
//! `block` is 32 for formats with a float scale per 32 weights (Q8_0, Q4_0, Q5_0) and 256 for
//! the K formats, whose 256-value super-blocks share one float scale: the kernel then sums a
//! whole super-block in int32 before converting once.

use super::BlockFormat;

/// The largest magnitude of a rounded activation.
pub(crate) const Q16_MAX: f32 = 32767.0;

/// Values per activation scale the int16 kernels expect for `format`.
pub(crate) fn q16_block(format: BlockFormat) -> usize {
    match format {
        BlockFormat::Q2K | BlockFormat::Q3K | BlockFormat::Q4K | BlockFormat::Q5K | BlockFormat::Q6K => 256,
        BlockFormat::Q8_0 | BlockFormat::Q4_0 | BlockFormat::Q4_1 | BlockFormat::Q5_0 | BlockFormat::Q5_1 => 32,
    }
}

/// `m` rows of `k` activations as int16 with a float scale per `block` values, and the float
/// sums of every 32 values (Q4_K's minimums multiply those) and of every 16 (Q2_K's).
#[derive(Debug, Clone)]
pub(crate) struct Q16Rows {
    /// `[m][k]`: `x ≈ q · scale` of the value's block.
    pub(crate) q: Vec<i16>,
    /// `[m][k / block]`.
    pub(crate) scale: Vec<f32>,
    /// `[m][k / 32]`: sums of the float32 values.
    pub(crate) sum32: Vec<f32>,
    /// `[m][k / 16]`: sums of the float32 values.
    pub(crate) sum16: Vec<f32>,
    /// `[m][·]`: the activations split into bytes for a VNNI kernel ([`super::x8::byte_planes`]),
    /// where the kernel takes them; empty otherwise.
    pub(crate) bytes: Vec<u8>,
    pub(crate) k: usize,
    pub(crate) block: usize,
}

impl Q16Rows {
    /// Rounds `x` (`[m][k]`, `k` a multiple of `block`, `block` of 32) to int16.
    pub(crate) fn new(x: &[f32], k: usize, block: usize) -> Self {
        assert!(block.is_multiple_of(32) && k.is_multiple_of(block) && x.len().is_multiple_of(k));
        let mut q = Self {
            q: vec![0i16; x.len()],
            scale: vec![0.0; x.len() / block],
            sum32: vec![0.0; x.len() / 32],
            sum16: vec![0.0; x.len() / 16],
            bytes: Vec::new(),
            k,
            block,
        };
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            #[allow(unsafe_code)]
            // SAFETY: the CPU has AVX2 and FMA, checked just above.
            unsafe {
                q.fill_avx2(x)
            };
            return q;
        }
        q.fill(x);
        q
    }

    /// [`Self::fill`] compiled for AVX2 (the crate is built for SSE2, where `f32::round` is a
    /// call per value and nothing here vectorizes): the same values, computed alike.
    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn fill_avx2(&mut self, x: &[f32]) {
        self.fill(x);
    }

    /// Rounds `x` into `self`'s (zeroed, rightly sized) buffers: written to vectorize, every
    /// sum in lanes of 8 then a fixed tree.
    #[inline(always)]
    #[allow(unsafe_code)]
    fn fill(&mut self, x: &[f32]) {
        let block = self.block;
        for ((xs, qs), scale) in x.chunks_exact(block).zip(self.q.chunks_exact_mut(block)).zip(&mut self.scale) {
            let mut lanes = [0f32; 8];
            for c in xs.chunks_exact(8) {
                for (m, v) in lanes.iter_mut().zip(c) {
                    *m = m.max(v.abs());
                }
            }
            let amax = lanes.iter().fold(0f32, |m, &v| m.max(v));
            let inv = if amax > 0.0 { Q16_MAX / amax } else { 0.0 };
            for (q, &v) in qs.iter_mut().zip(xs) {
                // `max` first: a NaN becomes −Q16_MAX, so the conversion below is always in
                // range (a saturating `as` does not vectorize).
                #[allow(clippy::manual_clamp)] // `clamp` keeps a NaN
                let r = (v * inv).round().max(-Q16_MAX).min(Q16_MAX);
                // SAFETY: `r` is an integer in ±Q16_MAX, as the line above makes it.
                *q = unsafe { r.to_int_unchecked::<i32>() } as i16;
            }
            *scale = amax / Q16_MAX;
        }
        for (c, s) in x.chunks_exact(16).zip(&mut self.sum16) {
            let mut l = [0f32; 8];
            for i in 0..8 {
                l[i] = c[i] + c[i + 8];
            }
            *s = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
        }
        for (s32, s16) in self.sum32.iter_mut().zip(self.sum16.chunks_exact(2)) {
            *s32 = s16[0] + s16[1];
        }
    }

    /// Rows `r0..r0 + n` (borrowed).
    pub(crate) fn rows(&self, r0: usize, n: usize) -> Q16View<'_> {
        self.view().rows(r0, n)
    }

    /// All rows.
    pub(crate) fn view(&self) -> Q16View<'_> {
        Q16View {
            q: &self.q,
            scale: &self.scale,
            sum32: &self.sum32,
            sum16: &self.sum16,
            bytes: &self.bytes,
            k: self.k,
            block: self.block,
        }
    }
}

/// Some rows of a [`Q16Rows`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Q16View<'a> {
    pub(crate) q: &'a [i16],
    pub(crate) scale: &'a [f32],
    pub(crate) sum32: &'a [f32],
    pub(crate) sum16: &'a [f32],
    pub(crate) bytes: &'a [u8],
    pub(crate) k: usize,
    pub(crate) block: usize,
}

impl<'a> Q16View<'a> {
    pub(crate) fn m(&self) -> usize {
        self.q.len() / self.k
    }

    /// Rows `r0..r0 + n` of these.
    pub(crate) fn rows(&self, r0: usize, n: usize) -> Q16View<'a> {
        let (k, b, m) = (self.k, self.block, self.m());
        let per_row = self.bytes.len() / m.max(1);
        Q16View {
            q: &self.q[r0 * k..(r0 + n) * k],
            scale: &self.scale[r0 * k / b..(r0 + n) * k / b],
            sum32: &self.sum32[r0 * k / 32..(r0 + n) * k / 32],
            sum16: &self.sum16[r0 * k / 16..(r0 + n) * k / 16],
            bytes: &self.bytes[r0 * per_row..(r0 + n) * per_row],
            k,
            block: b,
        }
    }
}

/// `out` (`[rows][m]` for the `m` rows of `x`) filled `step` activation rows at a time, for
/// kernels whose registers hold no more: `f(rows r0.., part)` fills `part` (`[rows][mr]`).
pub(crate) fn by_row_chunks(x: Q16View<'_>, step: usize, out: &mut [f32], mut f: impl FnMut(Q16View<'_>, &mut [f32])) {
    let m = x.m();
    let rows = out.len() / m;
    let mut part = vec![0f32; rows * step];
    for r0 in (0..m).step_by(step) {
        let mr = step.min(m - r0);
        f(x.rows(r0, mr), &mut part[..rows * mr]);
        for (o, p) in out.chunks_exact_mut(m).zip(part.chunks_exact(mr)) {
            o[r0..r0 + mr].copy_from_slice(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_is_within_half_a_step_of_each_block() {
        let (k, block) = (512, 256);
        let x: Vec<f32> =
            (0..2 * k).map(|i| ((i * 37 % 101) as f32 - 50.0) * if i % 300 == 0 { 40.0 } else { 0.1 }).collect();
        let q = Q16Rows::new(&x, k, block);
        for (i, &v) in x.iter().enumerate() {
            let s = q.scale[i / block];
            assert!((f32::from(q.q[i]) * s - v).abs() <= 0.5 * s * 1.001, "{i}");
        }
        let v = q.rows(1, 1);
        assert_eq!(v.m(), 1);
        let close = |a: f32, b: f32| (a - b).abs() <= 1e-5 * b.abs().max(1.0);
        assert!(close(v.sum32[0], x[k..k + 32].iter().sum::<f32>()));
        assert!(close(v.sum16[1], x[k + 16..k + 32].iter().sum::<f32>()));
        let zeros = Q16Rows::new(&[0.0; 32], 32, 32);
        assert!(zeros.q.iter().all(|&q| q == 0) && zeros.scale == [0.0]);
    }
}
