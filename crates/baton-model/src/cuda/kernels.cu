// Baton's CUDA kernels: everything of the forward pass that has no library call (the GEMMs go
// to cuBLAS). Compiled at run time by NVRTC, once per model, with
//   -DACT_KIND=k  activations and weights: 0 float32, 1 bfloat16, 2 float16
//   -DKV_KIND=k   the KV cache's element type, same codes
// No CUDA header is included: 16-bit types are raw `unsigned short` converted here, so the
// source compiles with NVRTC alone (CI checks that it does, without a GPU).
//
// Layouts (row-major):
//   activations  [rows][width]
//   qkv          [rows][(heads + 2 * kv_heads) * head_dim]: q, then k, then v
//   gate_up      [rows][2 * inter]: gate, then up
//   KV cache     block-major [blocks][layers][2][block_size][kv_heads * head_dim]

#ifndef ACT_KIND
#define ACT_KIND 1
#endif
#ifndef KV_KIND
#define KV_KIND ACT_KIND
#endif

typedef unsigned long long u64;
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf16_to_f32(unsigned short v) { return __uint_as_float(((unsigned)v) << 16); }
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40); // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u); // round to nearest even
    return (unsigned short)(u >> 16);
}
__device__ __forceinline__ float f16_to_f32(unsigned short v) {
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(v));
    return f;
}
__device__ __forceinline__ unsigned short f32_to_f16(float f) {
    unsigned short v;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(v) : "f"(f));
    return v;
}

#if ACT_KIND == 0
typedef float act_t;
__device__ __forceinline__ float ld(act_t v) { return v; }
__device__ __forceinline__ act_t st(float v) { return v; }
#elif ACT_KIND == 1
typedef unsigned short act_t;
__device__ __forceinline__ float ld(act_t v) { return bf16_to_f32(v); }
__device__ __forceinline__ act_t st(float v) { return f32_to_bf16(v); }
#else
typedef unsigned short act_t;
__device__ __forceinline__ float ld(act_t v) { return f16_to_f32(v); }
__device__ __forceinline__ act_t st(float v) { return f32_to_f16(v); }
#endif

#if KV_KIND == 0
typedef float kv_t;
__device__ __forceinline__ float kv_ld(kv_t v) { return v; }
__device__ __forceinline__ kv_t kv_st(float v) { return v; }
#elif KV_KIND == 1
typedef unsigned short kv_t;
__device__ __forceinline__ float kv_ld(kv_t v) { return bf16_to_f32(v); }
__device__ __forceinline__ kv_t kv_st(float v) { return f32_to_bf16(v); }
#else
typedef unsigned short kv_t;
__device__ __forceinline__ float kv_ld(kv_t v) { return f16_to_f32(v); }
__device__ __forceinline__ kv_t kv_st(float v) { return f32_to_f16(v); }
#endif

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The sum of `v` over the block, returned to every thread. `scratch` holds 32 floats.
__device__ float block_sum(float v, float* scratch) {
    v = warp_sum(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

// out[r] = table[ids[r]] * scale. Grid: rows.
extern "C" __global__ void embed(const act_t* table, const unsigned* ids, act_t* out, int hidden, float scale) {
    const u64 r = blockIdx.x;
    const act_t* src = table + (u64)ids[r] * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[r * hidden + i] = st(ld(src[i]) * scale);
}

// Values of a row each thread of a norm holds in registers: a row is read once, in one round
// trip (a decode step's norms are one row each, and latency is all they cost). The host launches
// at least width / NORM_PER threads, at most 1024 (so at most 64 registers a thread).
#define NORM_PER 16

// RMSNorm of `width` values at x + r * x_stride + h * width, into out + r * out_stride + h * width
// (in place when they alias). Grid: (rows, heads): heads > 1 normalises each head of a row.
extern "C" __global__ void __launch_bounds__(1024) rms_norm(const act_t* x, const float* w, act_t* out, int width, long long x_stride,
                                    long long out_stride, float eps) {
    __shared__ float scratch[32];
    const act_t* in = x + blockIdx.x * x_stride + (long long)blockIdx.y * width;
    act_t* o = out + blockIdx.x * out_stride + (long long)blockIdx.y * width;
    float v[NORM_PER];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < NORM_PER; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        v[k] = i < width ? ld(in[i]) : 0.0f;
        ss += v[k] * v[k];
    }
    const float inv = 1.0f / sqrtf(block_sum(ss, scratch) / (float)width + eps);
#pragma unroll
    for (int k = 0; k < NORM_PER; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < width) o[i] = st((v[k] * inv) * w[i]);
    }
}

// x[r] += d[r]; out[r] = RMSNorm(x[r]). Grid: rows.
extern "C" __global__ void __launch_bounds__(1024) add_rms_norm(act_t* x, const act_t* d, const float* w, act_t* out, int width, float eps) {
    __shared__ float scratch[32];
    const u64 base = (u64)blockIdx.x * width;
    float v[NORM_PER];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < NORM_PER; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        // The sum is rounded to the activation type, as the residual stream keeps it.
        v[k] = i < width ? ld(st(ld(x[base + i]) + ld(d[base + i]))) : 0.0f;
        ss += v[k] * v[k];
    }
    const float inv = 1.0f / sqrtf(block_sum(ss, scratch) / (float)width + eps);
#pragma unroll
    for (int k = 0; k < NORM_PER; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < width) {
            x[base + i] = st(v[k]);
            out[base + i] = st((v[k] * inv) * w[i]);
        }
    }
}

// x[r] += d[r]. Grid-stride over n values.
extern "C" __global__ void add(act_t* x, const act_t* d, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        x[i] = st(ld(x[i]) + ld(d[i]));
}

// x[r][i] += b[i] over rows of `width`. Grid-stride over n = rows * width values.
extern "C" __global__ void add_bias(act_t* x, const float* b, int width, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        x[i] = st(ld(x[i]) + b[i % width]);
}

// Rotary embedding (rotate-half) of the q and k heads of each row of qkv, in place, and each
// row's keys (rotated) and values into its slot of layer `layer` of the cache.
// Grid: (rows, heads + 2 * kv_heads): q heads, then k heads, then v heads (copied); the angle of
// pair i at position p is p * inv_freq[i]. block[r] / slot[r] locate row r's token.
__device__ __forceinline__ u64 slab(u64 block, int layer, int part, int layers, int block_size, int width);
extern "C" __global__ void rope_store_kv(act_t* qkv, const int* pos, const float* inv_freq, int stride, int head_dim,
                                         int heads, int kv_heads, kv_t* cache, const unsigned* block,
                                         const int* slot, int layer, int layers, int block_size) {
    const int half = head_dim >> 1, y = blockIdx.y, r = blockIdx.x;
    act_t* h = qkv + (u64)r * stride + (u64)y * head_dim;
    const int width = kv_heads * head_dim;
    const bool is_k = y >= heads && y < heads + kv_heads, is_v = y >= heads + kv_heads;
    kv_t* dst = 0;
    if (is_k || is_v) {
        const int kh = is_k ? y - heads : y - heads - kv_heads;
        dst = cache + slab(block[r], layer, is_v ? 1 : 0, layers, block_size, width) + (u64)slot[r] * width +
              (u64)kh * head_dim;
    }
    if (is_v) {
        for (int i = threadIdx.x; i < head_dim; i += blockDim.x) dst[i] = kv_st(ld(h[i]));
        return;
    }
    const float p = (float)pos[r];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float angle = p * inv_freq[i];
        float s, c;
        sincosf(angle, &s, &c);
        const float x1 = ld(h[i]), x2 = ld(h[i + half]);
        const act_t y1 = st(x1 * c - x2 * s), y2 = st(x2 * c + x1 * s);
        h[i] = y1;
        h[i + half] = y2;
        if (is_k) {
            // The key as the activation type rounded it, then as the cache stores it.
            dst[i] = kv_st(ld(y1));
            dst[i + half] = kv_st(ld(y2));
        }
    }
}

// Offset in elements of (block, layer, part, slot 0) in the block-major cache.
__device__ __forceinline__ u64 slab(u64 block, int layer, int part, int layers, int block_size, int width) {
    return ((block * layers + layer) * 2 + part) * (u64)block_size * width;
}

// Copies new tokens out of the cache, every layer, for the host's copy of the arena: row
// rows[i]'s to out[i][layer][part][width]. Grid: (staged rows, layers * 2).
extern "C" __global__ void gather_new_kv(const kv_t* cache, kv_t* out, const unsigned* block, const int* slot,
                                         const int* rows, int width, int layers, int block_size) {
    const int r = rows[blockIdx.x], layer = blockIdx.y >> 1, part = blockIdx.y & 1;
    const kv_t* src = cache + slab(block[r], layer, part, layers, block_size, width) + (u64)slot[r] * width;
    kv_t* dst = out + ((u64)blockIdx.x * layers * 2 + blockIdx.y) * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) dst[i] = src[i];
}

// The attention kernel's shape, fixed per model at compile time so its per-lane arrays are
// exactly as large as they need to be: HEAD_DIM (<= 256) and GROUP, the query heads per KV head
// (<= 8).
#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef GROUP
#define GROUP 4
#endif
#define PER_LANE ((HEAD_DIM + 31) / 32)
// Keys each warp loads before it uses them: loads in flight hide the memory's latency.
#if PER_LANE <= 4
#define UNROLL 8
#else
#define UNROLL 4
#endif

// A warp holds a head's HEAD_DIM values PER_LANE to a lane, contiguous: lane l has
// [l * PER_LANE, (l + 1) * PER_LANE), so a key is one wide load a lane and one contiguous span a
// warp. Loads the lane's values of the head at `p` (guarded where HEAD_DIM is not 32 · PER_LANE).
__device__ __forceinline__ void load_lane(const kv_t* p, int lane, float* out) {
    const kv_t* q = p + lane * PER_LANE;
#if HEAD_DIM == 32 * PER_LANE && KV_KIND != 0 && (PER_LANE == 2 || PER_LANE == 4 || PER_LANE == 8)
#if PER_LANE == 8
    const uint4 u = *(const uint4*)q;
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#elif PER_LANE == 4
    const uint2 u = *(const uint2*)q;
    const unsigned w[2] = {u.x, u.y};
#else
    const unsigned w[1] = {*(const unsigned*)q};
#endif
#pragma unroll
    for (int e = 0; e < PER_LANE / 2; e++) {
        out[2 * e] = kv_ld((kv_t)(w[e] & 0xffffu));
        out[2 * e + 1] = kv_ld((kv_t)(w[e] >> 16));
    }
#elif HEAD_DIM == 32 * PER_LANE && KV_KIND == 0 && PER_LANE % 4 == 0
#pragma unroll
    for (int e = 0; e < PER_LANE; e += 4) {
        const float4 f = *(const float4*)(q + e);
        out[e] = f.x;
        out[e + 1] = f.y;
        out[e + 2] = f.z;
        out[e + 3] = f.w;
    }
#else
#pragma unroll
    for (int e = 0; e < PER_LANE; e++) out[e] = lane * PER_LANE + e < HEAD_DIM ? kv_ld(q[e]) : 0.0f;
#endif
}

// Paged attention with an online softmax, for any mix of prefill and decode rows, one row at a
// time (decode rows, and every row of a float32 model; attention_tiled takes prefill chunks).
// Grid: (row_ids, kv_heads, splits); block: a whole number of warps. Block (i, h, z) computes the
// GROUP query heads of KV head h (so each key and value is read once for the group) for row r,
// over the z-th of `splits` equal parts of the row's keys (split-K: a decode step of a small
// batch still fills the GPU) of row r = row_ids[i]. Warp w takes keys w, w + warps, ... of the
// part; the warps' partial softmaxes are merged in shared memory. Row r attends to positions
// [max(0, pos - window + 1), pos] of its sequence, whose block table is
// tables[table_start[r] ..]. With one split the block writes `out`; with more it writes its
// (max, sum, unnormalised output) to `partial` (indexed by i), and the last split of (i, h) to
// finish merges them into `out` (counters[i * kv_heads + h] counts the splits done; zero between
// launches).
// Dynamic shared memory: warps * GROUP * (HEAD_DIM + 2) floats.
extern "C" __global__ void attention(const act_t* qkv, act_t* out, float* partial, unsigned* counters, const kv_t* cache,
                                     const unsigned* tables, const int* table_start, const int* pos,
                                     const int* row_ids, int stride, int heads, int kv_heads, int layer, int layers,
                                     int block_size, int window, float scale, int splits) {
    extern __shared__ float smem[];
    const int r = row_ids[blockIdx.x], kvh = blockIdx.y, z = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int width = kv_heads * HEAD_DIM;
    const int p = pos[r];
    const int first = window > 0 ? max(0, p - window + 1) : 0;
    const int part = (p - first + splits) / splits; // ceil((p - first + 1) / splits)
    const int lo = first + z * part, hi = min(p, lo + part - 1);
    const unsigned* table = tables + table_start[r];
    const act_t* q = qkv + (u64)r * stride + (u64)kvh * GROUP * HEAD_DIM;

    float qr[GROUP][PER_LANE];
    float acc[GROUP][PER_LANE];
    float m[GROUP], l[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
        m[g] = NEG_INF;
        l[g] = 0.0f;
#pragma unroll
        for (int e = 0; e < PER_LANE; e++) {
            const int d = lane * PER_LANE + e;
            qr[g][e] = d < HEAD_DIM ? ld(q[g * HEAD_DIM + d]) * scale : 0.0f;
            acc[g][e] = 0.0f;
        }
    }
    for (int j0 = lo + warp; j0 <= hi; j0 += warps * UNROLL) {
        float kr[UNROLL][PER_LANE], vr[UNROLL][PER_LANE];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int j = j0 + u * warps;
            if (j <= hi) {
                const u64 block = table[j / block_size];
                const int s = j % block_size;
                const u64 at = (u64)s * width + kvh * HEAD_DIM;
                load_lane(cache + slab(block, layer, 0, layers, block_size, width) + at, lane, kr[u]);
                load_lane(cache + slab(block, layer, 1, layers, block_size, width) + at, lane, vr[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            if (j0 + u * warps > hi) break;
#pragma unroll
            for (int g = 0; g < GROUP; g++) {
                float dot = 0.0f;
#pragma unroll
                for (int e = 0; e < PER_LANE; e++) dot += qr[g][e] * kr[u][e];
                const float score = warp_sum(dot);
                const float m_new = fmaxf(m[g], score);
                const float correction = expf(m[g] - m_new);
                const float weight = expf(score - m_new);
                l[g] = l[g] * correction + weight;
#pragma unroll
                for (int e = 0; e < PER_LANE; e++) acc[g][e] = acc[g][e] * correction + weight * vr[u][e];
                m[g] = m_new;
            }
        }
    }
    // Merge the warps: each writes (acc, m, l) per head, then thread t combines (head, dim)
    // pairs t, t + blockDim.x, ...
    const int rec = HEAD_DIM + 2;
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
        float* slot = smem + (warp * GROUP + g) * rec;
#pragma unroll
        for (int e = 0; e < PER_LANE; e++) {
            const int d = lane * PER_LANE + e;
            if (d < HEAD_DIM) slot[d] = acc[g][e];
        }
        if (lane == 0) {
            slot[HEAD_DIM] = m[g];
            slot[HEAD_DIM + 1] = l[g];
        }
    }
    __syncthreads();
    const int h0 = kvh * GROUP;
    for (int t = threadIdx.x; t < GROUP * HEAD_DIM; t += blockDim.x) {
        const int g = t / HEAD_DIM, d = t % HEAD_DIM;
        float mx = NEG_INF;
        for (int w = 0; w < warps; w++) mx = fmaxf(mx, smem[(w * GROUP + g) * rec + HEAD_DIM]);
        float num = 0.0f, den = 0.0f;
        for (int w = 0; w < warps; w++) {
            const float* slot = smem + (w * GROUP + g) * rec;
            if (slot[HEAD_DIM + 1] == 0.0f) continue; // a warp that saw no key
            const float c = expf(slot[HEAD_DIM] - mx);
            num += slot[d] * c;
            den += slot[HEAD_DIM + 1] * c;
        }
        if (splits == 1) {
            out[(u64)r * heads * HEAD_DIM + (u64)(h0 + g) * HEAD_DIM + d] = st(num / den);
        } else {
            float* rec_out = partial + (((u64)blockIdx.x * heads + h0 + g) * splits + z) * rec;
            rec_out[d] = num;
            if (d == 0) {
                rec_out[HEAD_DIM] = den == 0.0f ? NEG_INF : mx;
                rec_out[HEAD_DIM + 1] = den;
            }
        }
    }
    if (splits == 1) return;
    // The last of the splits to finish merges them all (no second launch): each block makes its
    // partials visible, then counts itself in; the one that counts last reads every split's
    // partials past the L1 cache and resets the counter for the next step.
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned* c = counters + blockIdx.x * kv_heads + kvh;
        last = atomicAdd(c, 1u) == (unsigned)splits - 1;
        if (last) *c = 0;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int t = threadIdx.x; t < GROUP * HEAD_DIM; t += blockDim.x) {
        const int g = t / HEAD_DIM, d = t % HEAD_DIM;
        const float* base = partial + ((u64)blockIdx.x * heads + h0 + g) * splits * rec;
        // Unrolled, so that the loads of several splits are in flight at once: the merge is
        // on the step's critical path, and a loop of one load at a time measured slower than
        // a second kernel.
        float mx = NEG_INF;
#pragma unroll 8
        for (int zz = 0; zz < splits; zz++) mx = fmaxf(mx, __ldcg(base + zz * rec + HEAD_DIM));
        float num = 0.0f, den = 0.0f;
#pragma unroll 8
        for (int zz = 0; zz < splits; zz++) {
            const float dz = __ldcg(base + zz * rec + HEAD_DIM + 1);
            if (dz == 0.0f) continue;
            const float c = expf(__ldcg(base + zz * rec + HEAD_DIM) - mx);
            num += __ldcg(base + zz * rec + d) * c;
            den += dz * c;
        }
        out[(u64)r * heads * HEAD_DIM + (u64)(h0 + g) * HEAD_DIM + d] = st(num / den);
    }
}

// ---- Prefill attention on the tensor cores -------------------------------------------------
//
// attention_tiled: a tile of consecutive query rows of one sequence (a prefill chunk) against
// its keys, flash-attention style. Block (t, h) takes tile t = (row0, rows) of `tiles` and KV
// head h: its TILE_Q query vectors are the GROUP heads of h for each of TILE_ROWS rows (so a
// key tile loaded once serves the whole GQA group), four warps of 16 query vectors each. For
// each tile of TILE_K keys: S = Q·Kᵀ and O += P·V are mma.sync m16n8k16 on 16-bit operands
// with float32 accumulation; the online softmax stays in registers (the accumulator fragment of
// S is, element for element, the A fragment of P). Masks as `attention`: row r sees positions
// [max(0, pos[r] - window + 1), pos[r]]. Only for 16-bit activations and KV of the same type, on
// compute capability 8.0 and newer.
//
// Two variants of one body: `attention_tiled` loads each key tile through registers (V
// transposed on its way into shared memory); `attention_tiled_async` copies key tiles with
// cp.async into two buffers, the next tile's copy in flight while the current one is computed,
// and reads V's fragments with ldmatrix.trans. Dynamic shared memory: tiled_smem(HEAD_DIM, async).
#define TILE_Q 64
#define TILE_ROWS (TILE_Q / GROUP)
#define TILE_K 64
#define QK_LD (HEAD_DIM + 8) // halves; the padding spreads a fragment's rows over the banks
#define VT_LD (TILE_K + 8)

#if ACT_KIND != 0 && KV_KIND == ACT_KIND && HEAD_DIM % 16 == 0 && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800)
#if ACT_KIND == 1
#define MMA_TYPE "bf16"
#else
#define MMA_TYPE "f16"
#endif
// d += a · b: a 16×16 (row), b 16×8 (col), d 16×8 float32.
__device__ __forceinline__ void mma16816(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    return (unsigned)st(lo) | ((unsigned)st(hi) << 16);
}
__device__ __forceinline__ unsigned ld32(const unsigned short* p) { return *(const unsigned*)p; }
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
// 16 bytes global → shared without registers; `bytes` 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }
// Four 8×8 16-bit matrices from shared memory, transposed: lane l gives the address of row l % 8
// of matrix l / 8, and r[i] is matrix i as a B fragment half.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

template <bool ASYNC>
__device__ __forceinline__ void attention_tiled_impl(const act_t* qkv, act_t* out, const kv_t* cache,
                                                     const unsigned* tables, const int* table_start, const int* pos,
                                                     const int* tiles, int stride, int heads, int kv_heads, int layer,
                                                     int layers, int block_size, int window, float scale) {
    extern __shared__ __align__(16) unsigned char tiled_smem[];
    // Shared memory: Q, then the key tiles (one K and one V buffer; two of each when ASYNC, V
    // row-major [key][d]; else V transposed [d][key]), then each query vector's position and
    // first visible position.
    constexpr int KV_TILE = TILE_K * QK_LD;
    constexpr int V_TILE = ASYNC ? TILE_K * QK_LD : HEAD_DIM * VT_LD;
    constexpr int BUFS = ASYNC ? 2 : 1;
    unsigned short* qs = (unsigned short*)tiled_smem;
    unsigned short* ks0 = qs + TILE_Q * QK_LD;
    unsigned short* vs0 = ks0 + BUFS * KV_TILE;
    int* qpos = (int*)(vs0 + BUFS * V_TILE);
    int* qfirst = qpos + TILE_Q;
    const int row0 = tiles[2 * blockIdx.x], nrows = tiles[2 * blockIdx.x + 1], kvh = blockIdx.y;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
    const int width = kv_heads * HEAD_DIM;
    const unsigned* table = tables + table_start[row0];
    const int p_first = pos[row0], p_last = pos[row0 + nrows - 1];
    const int lo = window > 0 ? max(0, p_first - window + 1) : 0;

    // Q: query vector i is head kvh * GROUP + i % GROUP of row row0 + i / GROUP.
    for (int c = tid; c < TILE_Q * (HEAD_DIM / 8); c += blockDim.x) {
        const int i = c / (HEAD_DIM / 8), d = (c % (HEAD_DIM / 8)) * 8, r = i / GROUP;
        const bool valid = r < nrows && r < TILE_ROWS;
        const act_t* src = qkv + (u64)(row0 + (valid ? r : 0)) * stride + (u64)(kvh * GROUP + i % GROUP) * HEAD_DIM + d;
        if (ASYNC) {
            cp_async16(qs + i * QK_LD + d, src, valid ? 16 : 0);
        } else {
            *(uint4*)(qs + i * QK_LD + d) = valid ? *(const uint4*)src : make_uint4(0, 0, 0, 0);
        }
    }
    for (int i = tid; i < TILE_Q; i += blockDim.x) {
        const int r = i / GROUP;
        const bool valid = r < nrows && r < TILE_ROWS;
        qpos[i] = valid ? pos[row0 + r] : -1;
        qfirst[i] = valid && window > 0 ? max(0, pos[row0 + r] - window + 1) : 0;
    }
    // Loads key tile starting at j0 into buffer b: K row-major; V row-major (ASYNC) or
    // transposed. Keys past p_last are zeros (their scores are masked; zero values keep P · V
    // finite).
    auto load_tile = [&](int j0, int b) {
        unsigned short* ks = ks0 + b * KV_TILE;
        unsigned short* vs = vs0 + b * V_TILE;
        for (int c = tid; c < TILE_K * (HEAD_DIM / 8); c += blockDim.x) {
            const int jj = c / (HEAD_DIM / 8), d = (c % (HEAD_DIM / 8)) * 8, j = j0 + jj;
            const bool valid = j <= p_last;
            const u64 block = table[valid ? j / block_size : 0];
            const u64 at = (u64)((valid ? j : 0) % block_size) * width + kvh * HEAD_DIM + d;
            const kv_t* k = cache + slab(block, layer, 0, layers, block_size, width) + at;
            const kv_t* v = cache + slab(block, layer, 1, layers, block_size, width) + at;
            if (ASYNC) {
                cp_async16(ks + jj * QK_LD + d, k, valid ? 16 : 0);
                cp_async16(vs + jj * QK_LD + d, v, valid ? 16 : 0);
            } else {
                *(uint4*)(ks + jj * QK_LD + d) = valid ? *(const uint4*)k : make_uint4(0, 0, 0, 0);
            }
        }
        if (!ASYNC) {
            // V transposed: a warp's lanes take consecutive keys of one 8-wide slice of dims, so
            // the 16-bit stores into vs[d][key] fall on distinct banks.
            for (int c = tid; c < TILE_K * (HEAD_DIM / 8); c += blockDim.x) {
                const int jj = c % TILE_K, d = (c / TILE_K) * 8, j = j0 + jj;
                uint4 vv = make_uint4(0, 0, 0, 0);
                if (j <= p_last) {
                    const u64 block = table[j / block_size];
                    vv = *(const uint4*)(cache + slab(block, layer, 1, layers, block_size, width) +
                                         (u64)(j % block_size) * width + kvh * HEAD_DIM + d);
                }
                const unsigned short* ve = (const unsigned short*)&vv;
#pragma unroll
                for (int e = 0; e < 8; e++) vs[(d + e) * VT_LD + jj] = ve[e];
            }
        }
    };

    // This lane's two query vectors (rows gq and gq + 8 of the warp's 16).
    const int i0 = warp * 16 + gq, i1 = i0 + 8;
    float o[HEAD_DIM / 8][4];
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;
    if (ASYNC) {
        load_tile(lo, 0);
        cp_async_commit();
    }
    __syncthreads();
    const int pos0 = qpos[i0], pos1 = qpos[i1], first0 = qfirst[i0], first1 = qfirst[i1];

    int b = 0;
    for (int j0 = lo; j0 <= p_last; j0 += TILE_K, b ^= 1) {
        if (ASYNC) {
            if (j0 + TILE_K <= p_last) {
                load_tile(j0 + TILE_K, b ^ 1);
                cp_async_commit();
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
            __syncthreads();
        } else {
            __syncthreads(); // the previous tile is no longer read
            load_tile(j0, 0);
            __syncthreads();
        }
        const unsigned short* ks = ks0 + (ASYNC ? b : 0) * KV_TILE;
        const unsigned short* vs = vs0 + (ASYNC ? b : 0) * V_TILE;
        // S = Q · Kᵀ for the warp's 16 query vectors and the tile's keys: 8 n-tiles of 8 keys.
        float s[TILE_K / 8][4];
#pragma unroll
        for (int n = 0; n < TILE_K / 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int k0 = 0; k0 < HEAD_DIM; k0 += 16) {
            unsigned a[4];
            const unsigned short* qa = qs + (warp * 16 + gq) * QK_LD + k0 + 2 * tq;
            a[0] = ld32(qa);
            a[1] = ld32(qa + 8 * QK_LD);
            a[2] = ld32(qa + 8);
            a[3] = ld32(qa + 8 * QK_LD + 8);
#pragma unroll
            for (int n = 0; n < TILE_K / 8; n++) {
                const unsigned short* kb = ks + (n * 8 + gq) * QK_LD + k0 + 2 * tq;
                mma16816(s[n], a, ld32(kb), ld32(kb + 8));
            }
        }
        // Online softmax: element (n, c) of s is query vector i0 (c < 2) or i1 (c >= 2) against
        // key j0 + n * 8 + 2 * tq + (c & 1); the four lanes of a group share a query vector.
        float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
        for (int n = 0; n < TILE_K / 8; n++) {
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int j = j0 + n * 8 + 2 * tq + (c & 1);
                const int p = c < 2 ? pos0 : pos1, f = c < 2 ? first0 : first1;
                const float v = (j <= p && j >= f) ? s[n][c] * scale : NEG_INF;
                s[n][c] = v;
                if (c < 2) mx0 = fmaxf(mx0, v); else mx1 = fmaxf(mx1, v);
            }
        }
#pragma unroll
        for (int off = 1; off < 4; off <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
        }
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        // A query vector that has seen no key yet keeps m = -inf and weights 0.
        const float c0 = mn0 == NEG_INF ? 1.0f : expf(m0 - mn0), c1 = mn1 == NEG_INF ? 1.0f : expf(m1 - mn1);
        float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
        for (int n = 0; n < TILE_K / 8; n++) {
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const float mn = c < 2 ? mn0 : mn1;
                const float w = s[n][c] == NEG_INF ? 0.0f : expf(s[n][c] - mn);
                s[n][c] = w;
                if (c < 2) sum0 += w; else sum1 += w;
            }
        }
#pragma unroll
        for (int off = 1; off < 4; off <<= 1) {
            sum0 += __shfl_xor_sync(0xffffffffu, sum0, off);
            sum1 += __shfl_xor_sync(0xffffffffu, sum1, off);
        }
        l0 = l0 * c0 + sum0;
        l1 = l1 * c1 + sum1;
        m0 = mn0;
        m1 = mn1;
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 8; n++) {
            o[n][0] *= c0;
            o[n][1] *= c0;
            o[n][2] *= c1;
            o[n][3] *= c1;
        }
        // O += P · V: P's A fragment for keys 16 kc .. 16 kc + 15 is s's n-tiles 2 kc and 2 kc + 1.
#pragma unroll
        for (int kc = 0; kc < TILE_K / 16; kc++) {
            unsigned a[4];
            a[0] = pack2(s[2 * kc][0], s[2 * kc][1]);
            a[1] = pack2(s[2 * kc][2], s[2 * kc][3]);
            a[2] = pack2(s[2 * kc + 1][0], s[2 * kc + 1][1]);
            a[3] = pack2(s[2 * kc + 1][2], s[2 * kc + 1][3]);
            if (ASYNC) {
                // Matrix q of lane l's address: keys 16 kc + (q & 1) * 8 + l % 8, dims
                // n0 + (q >> 1) * 8: r = {b0, b1} of n-tile n0 / 8, then of n0 / 8 + 1.
                const int q = lane >> 3;
                const unsigned short* vrow = vs + (kc * 16 + (q & 1) * 8 + (lane & 7)) * QK_LD + (q >> 1) * 8;
#pragma unroll
                for (int n = 0; n < HEAD_DIM / 8; n += 2) {
                    unsigned r[4];
                    ldmatrix_x4_trans(r, vrow + n * 8);
                    mma16816(o[n], a, r[0], r[1]);
                    mma16816(o[n + 1], a, r[2], r[3]);
                }
            } else {
#pragma unroll
                for (int n = 0; n < HEAD_DIM / 8; n++) {
                    const unsigned short* vb = vs + (n * 8 + gq) * VT_LD + kc * 16 + 2 * tq;
                    mma16816(o[n], a, ld32(vb), ld32(vb + 8));
                }
            }
        }
        if (ASYNC) __syncthreads(); // buffer b is refilled two tiles on
    }
    // out = O / l, for the query vectors that exist.
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int i = half ? i1 : i0, r = i / GROUP;
        const float l = half ? l1 : l0;
        if (r >= nrows || r >= TILE_ROWS || l == 0.0f) continue;
        act_t* dst = out + (u64)(row0 + r) * heads * HEAD_DIM + (u64)(kvh * GROUP + i % GROUP) * HEAD_DIM;
        const float inv = 1.0f / l;
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 8; n++) {
            const int d = n * 8 + 2 * tq;
            *(unsigned*)(dst + d) = pack2(o[n][2 * half] * inv, o[n][2 * half + 1] * inv);
        }
    }
}

#define TILED_PARAMS                                                                                                   \
    const act_t *qkv, act_t *out, const kv_t *cache, const unsigned *tables, const int *table_start, const int *pos,  \
        const int *tiles, int stride, int heads, int kv_heads, int layer, int layers, int block_size, int window,     \
        float scale
#define TILED_ARGS qkv, out, cache, tables, table_start, pos, tiles, stride, heads, kv_heads, layer, layers, block_size, window, scale
extern "C" __global__ void __launch_bounds__(128) attention_tiled(TILED_PARAMS) {
    attention_tiled_impl<false>(TILED_ARGS);
}
extern "C" __global__ void __launch_bounds__(128) attention_tiled_async(TILED_PARAMS) {
    attention_tiled_impl<true>(TILED_ARGS);
}
#else
// No tensor-core path for this combination (float32, KV of another type, or a GPU older than
// Ampere, whose mma.sync has no m16n8k16 on 16-bit types): never launched.
extern "C" __global__ void attention_tiled(const act_t*, act_t*, const kv_t*, const unsigned*, const int*, const int*,
                                           const int*, int, int, int, int, int, int, int, float) {}
extern "C" __global__ void attention_tiled_async(const act_t*, act_t*, const kv_t*, const unsigned*, const int*,
                                                 const int*, const int*, int, int, int, int, int, int, int, float) {}
#endif

// out[r][i] = act(gate[r][i]) * up[r][i]; kind 0 SiLU, 1 GELU (tanh). Grid-stride over rows * inter.
extern "C" __global__ void gated_act(const act_t* gate_up, act_t* out, int inter, u64 n, int kind) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / inter, c = i % inter;
        const float g = ld(gate_up[r * 2 * inter + c]), u = ld(gate_up[r * 2 * inter + inter + c]);
        float a;
        if (kind == 0) {
            a = g / (1.0f + expf(-g));
        } else {
            const float y = 0.7978846f * (g + 0.044715f * g * g * g);
            a = g / (1.0f + expf(-2.0f * y));
        }
        out[i] = st(a * u);
    }
}

// out[j] = x[rows[j]], rows of `width`. Grid: picked rows.
extern "C" __global__ void gather_rows(const act_t* x, const int* rows, act_t* out, int width) {
    const act_t* src = x + (u64)rows[blockIdx.x] * width;
    act_t* dst = out + (u64)blockIdx.x * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) dst[i] = src[i];
}

// Each row's argmax over float32 logits, as the host's: NaN never wins, ties go to the lower
// index. Two passes, so a row of a large vocabulary is read by many blocks at once:
// argmax_partial, grid (rows, ARGMAX_PARTS), block 256: part p of row r → (value, index) into
// partial[r][p]; argmax_final, grid rows, block ARGMAX_PARTS: the best of the parts → out[r].
#define ARGMAX_PARTS 32
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }
extern "C" __global__ void argmax_partial(const float* x, float2* partial, int width) {
    __shared__ float sv[256];
    __shared__ int si[256];
    const float* row = x + (u64)blockIdx.x * width;
    const int part = (width + ARGMAX_PARTS - 1) / ARGMAX_PARTS;
    const int lo = blockIdx.y * part, hi = min(width, lo + part);
    const int t = threadIdx.x;
    float best = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = lo + t; i < hi; i += blockDim.x) {
        const float v = row[i];
        if (better(v, i, best, bi)) {
            best = v;
            bi = i;
        }
    }
    sv[t] = best;
    si[t] = bi;
    __syncthreads();
    for (int s = blockDim.x >> 1; s > 0; s >>= 1) {
        if (t < s && better(sv[t + s], si[t + s], sv[t], si[t])) {
            sv[t] = sv[t + s];
            si[t] = si[t + s];
        }
        __syncthreads();
    }
    if (t == 0) partial[blockIdx.x * ARGMAX_PARTS + blockIdx.y] = make_float2(sv[0], __int_as_float(si[0]));
}
extern "C" __global__ void argmax_final(const float2* partial, unsigned* out) {
    const int t = threadIdx.x;
    const float2 p = partial[blockIdx.x * ARGMAX_PARTS + t];
    float best = p.x;
    int bi = __float_as_int(p.y);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v = __shfl_xor_sync(0xffffffffu, best, o);
        const int i = __shfl_xor_sync(0xffffffffu, bi, o);
        if (better(v, i, best, bi)) {
            best = v;
            bi = i;
        }
    }
    if (t == 0) out[blockIdx.x] = bi == 0x7fffffff ? 0u : (unsigned)bi;
}

// x = cap * tanh(x / cap), float32 logits. Grid-stride over n.
extern "C" __global__ void soft_cap(float* x, float cap, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        x[i] = cap * tanhf(x[i] / cap);
}

// Seeded pseudo-random weights made on the device (a benchmark's random model of billions of
// parameters is not generated on the host): a sum of two uniforms, scaled to `std`.
__device__ __forceinline__ unsigned hash32(u64 x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (unsigned)x;
}
extern "C" __global__ void fill_random(act_t* x, u64 n, u64 seed, float std) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const float a = (float)hash32(seed ^ (2 * i)) * 2.3283064e-10f;
        const float b = (float)hash32(seed ^ (2 * i + 1)) * 2.3283064e-10f;
        x[i] = st((a + b - 1.0f) * 2.0f * std);
    }
}

// float32 → the activation type (weights uploaded as float32). Grid-stride over n.
extern "C" __global__ void from_f32(const float* src, act_t* dst, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        dst[i] = st(src[i]);
}
