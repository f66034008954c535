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

// RMSNorm of `width` values at x + r * x_stride + h * width, into out + r * out_stride + h * width
// (in place when they alias). Grid: (rows, heads): heads > 1 normalises each head of a row.
extern "C" __global__ void rms_norm(const act_t* x, const float* w, act_t* out, int width, long long x_stride,
                                    long long out_stride, float eps) {
    __shared__ float scratch[32];
    const act_t* in = x + blockIdx.x * x_stride + (long long)blockIdx.y * width;
    act_t* o = out + blockIdx.x * out_stride + (long long)blockIdx.y * width;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const float v = ld(in[i]);
        ss += v * v;
    }
    const float inv = 1.0f / sqrtf(block_sum(ss, scratch) / (float)width + eps);
    for (int i = threadIdx.x; i < width; i += blockDim.x) o[i] = st((ld(in[i]) * inv) * w[i]);
}

// x[r] += d[r]; out[r] = RMSNorm(x[r]). Grid: rows.
extern "C" __global__ void add_rms_norm(act_t* x, const act_t* d, const float* w, act_t* out, int width, float eps) {
    __shared__ float scratch[32];
    const u64 base = (u64)blockIdx.x * width;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const act_t s = st(ld(x[base + i]) + ld(d[base + i]));
        x[base + i] = s;
        const float v = ld(s);
        ss += v * v;
    }
    const float inv = 1.0f / sqrtf(block_sum(ss, scratch) / (float)width + eps);
    for (int i = threadIdx.x; i < width; i += blockDim.x) out[base + i] = st((ld(x[base + i]) * inv) * w[i]);
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

// Rotary embedding (rotate-half) of the q and k heads of each row of qkv, in place.
// Grid: (rows, heads + kv_heads); the angle of pair i at position p is p * inv_freq[i].
extern "C" __global__ void rope(act_t* qkv, const int* pos, const float* inv_freq, int stride, int head_dim) {
    const int half = head_dim >> 1;
    act_t* h = qkv + (u64)blockIdx.x * stride + (u64)blockIdx.y * head_dim;
    const float p = (float)pos[blockIdx.x];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float angle = p * inv_freq[i];
        float s, c;
        sincosf(angle, &s, &c);
        const float x1 = ld(h[i]), x2 = ld(h[i + half]);
        h[i] = st(x1 * c - x2 * s);
        h[i + half] = st(x2 * c + x1 * s);
    }
}

// Offset in elements of (block, layer, part, slot 0) in the block-major cache.
__device__ __forceinline__ u64 slab(u64 block, int layer, int part, int layers, int block_size, int width) {
    return ((block * layers + layer) * 2 + part) * (u64)block_size * width;
}

// Writes each row's k and v (from qkv, after RoPE) into its slot of layer `layer`.
// Grid: (rows, 2); block[r] / slot[r] locate row r's token.
extern "C" __global__ void store_kv(const act_t* qkv, kv_t* cache, const unsigned* block, const int* slot, int stride,
                                    int k_offset, int width, int layer, int layers, int block_size) {
    const int r = blockIdx.x, part = blockIdx.y;
    const act_t* src = qkv + (u64)r * stride + k_offset + part * width;
    kv_t* dst = cache + slab(block[r], layer, part, layers, block_size, width) + (u64)slot[r] * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) dst[i] = kv_st(ld(src[i]));
}

// Copies the step's new tokens out of the cache, every layer, for the host's copy of the arena:
// out[r][layer][part][width]. Grid: (rows, layers * 2).
extern "C" __global__ void gather_new_kv(const kv_t* cache, kv_t* out, const unsigned* block, const int* slot, int width,
                                         int layers, int block_size) {
    const int r = blockIdx.x, layer = blockIdx.y >> 1, part = blockIdx.y & 1;
    const kv_t* src = cache + slab(block[r], layer, part, layers, block_size, width) + (u64)slot[r] * width;
    kv_t* dst = out + ((u64)r * layers * 2 + blockIdx.y) * width;
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
#define UNROLL 4

// Paged attention with an online softmax, for any mix of prefill and decode rows.
// Grid: (rows, kv_heads, splits); block: a whole number of warps. Block (r, h, z) computes the
// GROUP query heads of KV head h (so each key and value is read once for the group) for row r,
// over the z-th of `splits` equal parts of the row's keys (split-K: a decode step of a small
// batch still fills the GPU). Warp w takes keys w, w + warps, ... of the part; the warps'
// partial softmaxes are merged in shared memory. Row r attends to positions
// [max(0, pos - window + 1), pos] of its sequence, whose block table is
// tables[table_start[r] ..]. With one split the block writes `out`; with more it writes its
// (max, sum, unnormalised output) to `partial`, which attention_combine reduces.
// Dynamic shared memory: warps * GROUP * (HEAD_DIM + 2) floats.
extern "C" __global__ void attention(const act_t* qkv, act_t* out, float* partial, const kv_t* cache,
                                     const unsigned* tables, const int* table_start, const int* pos, int stride,
                                     int heads, int kv_heads, int layer, int layers, int block_size, int window,
                                     float scale, int splits) {
    extern __shared__ float smem[];
    const int r = blockIdx.x, kvh = blockIdx.y, z = blockIdx.z;
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
            const int d = lane + 32 * e;
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
                const kv_t* k = cache + slab(block, layer, 0, layers, block_size, width) + (u64)s * width + kvh * HEAD_DIM;
                const kv_t* v = cache + slab(block, layer, 1, layers, block_size, width) + (u64)s * width + kvh * HEAD_DIM;
#pragma unroll
                for (int e = 0; e < PER_LANE; e++) {
                    const int d = lane + 32 * e;
                    kr[u][e] = d < HEAD_DIM ? kv_ld(k[d]) : 0.0f;
                    vr[u][e] = d < HEAD_DIM ? kv_ld(v[d]) : 0.0f;
                }
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
            const int d = lane + 32 * e;
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
            float* rec_out = partial + (((u64)r * heads + h0 + g) * splits + z) * rec;
            rec_out[d] = num;
            if (d == 0) {
                rec_out[HEAD_DIM] = den == 0.0f ? NEG_INF : mx;
                rec_out[HEAD_DIM + 1] = den;
            }
        }
    }
}

// Reduces attention's split-K partials: out[r][h] = sum_z num_z e^(m_z - M) / sum_z den_z e^(m_z - M).
// Grid: (rows, heads); block: HEAD_DIM threads (rounded up to a warp).
extern "C" __global__ void attention_combine(const float* partial, act_t* out, int heads, int splits) {
    const int r = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    if (d >= HEAD_DIM) return;
    const int rec = HEAD_DIM + 2;
    const float* base = partial + ((u64)r * heads + h) * splits * rec;
    float mx = NEG_INF;
    for (int z = 0; z < splits; z++) mx = fmaxf(mx, base[z * rec + HEAD_DIM]);
    float num = 0.0f, den = 0.0f;
    for (int z = 0; z < splits; z++) {
        const float dz = base[z * rec + HEAD_DIM + 1];
        if (dz == 0.0f) continue;
        const float c = expf(base[z * rec + HEAD_DIM] - mx);
        num += base[z * rec + d] * c;
        den += dz * c;
    }
    out[((u64)r * heads + h) * HEAD_DIM + d] = st(num / den);
}

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

// out[r] = the first index of the largest value of row r of x (float32 logits), as the host's
// argmax: NaN never wins, ties go to the lower index. Grid: rows; block: 1024 threads.
extern "C" __global__ void argmax_rows(const float* x, unsigned* out, int width) {
    __shared__ float sv[1024];
    __shared__ int si[1024];
    const float* row = x + (u64)blockIdx.x * width;
    const int t = threadIdx.x;
    float best = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = t; i < width; i += blockDim.x) {
        const float v = row[i];
        if (v > best || (v == best && i < bi)) {
            best = v;
            bi = i;
        }
    }
    sv[t] = best;
    si[t] = bi;
    __syncthreads();
    for (int s = blockDim.x >> 1; s > 0; s >>= 1) {
        if (t < s) {
            const float v = sv[t + s];
            const int j = si[t + s];
            if (v > sv[t] || (v == sv[t] && j < si[t])) {
                sv[t] = v;
                si[t] = j;
            }
        }
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = si[0] == 0x7fffffff ? 0u : (unsigned)si[0];
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
