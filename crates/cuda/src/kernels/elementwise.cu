// Row and element-wise ops: RMSNorm, RoPE, gated activations, residual add, KV-cache write and
// greedy argmax. Positions are read from a device int32 (`pos0p`) so that a captured graph can
// be replayed at a new position by rewriting that one word.
#include "common.cuh"

#define NORM_THREADS 256

// Float4 pieces of a row each thread holds in registers in rms_norm's one-pass form: rows of
// up to NORM_THREADS * NORM_V4 * 4 = 8192 values.
#define NORM_V4 8

// out[r] = x[r] / rms(x[r]) * (w + offset), one block per row. The sum of squares is reduced in
// f32 (per thread, then across warps), the scale computed as the CPU reference does.
//
// Rows whose width is a multiple of 4 (at most 8192, 16-byte aligned) take one pass: every
// thread issues all its float4 loads of the row before using any (one trip through L2 rather
// than one per element), keeps them in registers for the output, and loads its weights before
// waiting for the previous kernel (they do not depend on it). A decode step runs two of these
// per layer on one multiprocessor each, so their latency is what counts. Other widths loop per
// element.
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    rms_norm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out,
             int C, float eps, float offset) {
    __shared__ float red[NORM_THREADS / 32];
    const float* xr = x + (i64)blockIdx.x * C;
    float* orow = out + (i64)blockIdx.x * C;
    const int t = threadIdx.x;
    float ss = 0.0f;
    const bool a16 = (((u64)xr | (u64)w | (u64)orow) & 15) == 0;
    if (a16 && (C & 3) == 0 && C <= NORM_THREADS * NORM_V4 * 4) {
        const int n4 = C >> 2;
        float4 g[NORM_V4], v[NORM_V4];
#pragma unroll
        for (int k = 0; k < NORM_V4; k++) {
            const int i = t + k * NORM_THREADS;
            if (i < n4) g[k] = ((const float4*)w)[i];
        }
        pdl_wait();
#pragma unroll
        for (int k = 0; k < NORM_V4; k++) {
            const int i = t + k * NORM_THREADS;
            if (i < n4) v[k] = ((const float4*)xr)[i];
        }
#pragma unroll
        for (int k = 0; k < NORM_V4; k++) {
            const int i = t + k * NORM_THREADS;
            if (i < n4) ss = sumsq4(v[k], ss);
        }
        ss = warp_sum(ss);
        if ((t & 31) == 0) red[t >> 5] = ss;
        __syncthreads();
        float tot = 0.0f;
#pragma unroll
        for (int i = 0; i < NORM_THREADS / 32; i++) tot += red[i];
        const float inv = 1.0f / sqrtf(tot / (float)C + eps);
#pragma unroll
        for (int k = 0; k < NORM_V4; k++) {
            const int i = t + k * NORM_THREADS;
            if (i < n4) {
                float4 o;
                o.x = v[k].x * inv * (g[k].x + offset);
                o.y = v[k].y * inv * (g[k].y + offset);
                o.z = v[k].z * inv * (g[k].z + offset);
                o.w = v[k].w * inv * (g[k].w + offset);
                ((float4*)orow)[i] = o;
            }
        }
        return;
    }
    pdl_wait();
#pragma unroll 4
    for (int i = t; i < C; i += NORM_THREADS) ss += xr[i] * xr[i];
    ss = warp_sum(ss);
    if ((t & 31) == 0) red[t >> 5] = ss;
    __syncthreads();
    float tot = 0.0f;
#pragma unroll
    for (int i = 0; i < NORM_THREADS / 32; i++) tot += red[i];
    const float inv = 1.0f / sqrtf(tot / (float)C + eps);
#pragma unroll 4
    for (int i = t; i < C; i += NORM_THREADS) orow[i] = xr[i] * inv * (w[i] + offset);
}

// RoPE in place on x (T, nh, dh): one thread per (token, head, pair). Pair i rotates by angle
// (pos0 + t) / linear_scale * inv_freq[i]; NEOX pairs (i, i + half), interleaved (2i, 2i + 1).
extern "C" __global__ void rope(float* __restrict__ x, const float* __restrict__ inv_freq,
                                const i32* __restrict__ pos0p, int T, int nh, int dh, int half,
                                int neox, float linear_scale) {
    pdl_wait();
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)T * nh * half) return;
    const int i = (int)(idx % half);
    const i64 th = idx / half;
    const int t = (int)(th / nh);
    const float pos = (float)(*pos0p + t) / linear_scale;
    float s, c;
    sincosf(pos * inv_freq[i], &s, &c);
    float* head = x + th * dh;
    const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
    const float x0 = head[a], x1 = head[b];
    head[a] = x0 * c - x1 * s;
    head[b] = x0 * s + x1 * c;
}

extern "C" __global__ void silu_mul(const float* __restrict__ gate, const float* __restrict__ up,
                                    float* __restrict__ out, i64 n) {
    pdl_wait();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = silu_f(gate[i]) * up[i];
}

// GELU, tanh approximation (as the CPU reference and PyTorch's approximate="tanh").
extern "C" __global__ void gelu_tanh_mul(const float* __restrict__ gate,
                                         const float* __restrict__ up, float* __restrict__ out,
                                         i64 n) {
    pdl_wait();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = gelu_tanh_f(gate[i]) * up[i];
}

// GPT-OSS's clamped SwiGLU (`clamped_swiglu_f`, common.cuh).
extern "C" __global__ void clamped_swiglu_mul(const float* __restrict__ gate,
                                              const float* __restrict__ up,
                                              float* __restrict__ out, i64 n, float alpha,
                                              float limit) {
    pdl_wait();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = clamped_swiglu_f(gate[i], up[i], alpha, limit);
}

extern "C" __global__ void add_assign(float* __restrict__ x, const float* __restrict__ y, i64 n) {
    pdl_wait();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// Constrained decoding: logits (rows, C) whose bit in `mask` (ceil(C / 32) words, the same for
// every row; bit i % 32 of word i / 32 = token i allowed) is clear become -inf, so the pick that
// follows (argmax or sampling) chooses among the allowed tokens only. One thread per logit.
extern "C" __global__ void apply_token_mask(float* __restrict__ x, const u32* __restrict__ mask,
                                            int C, i64 n) {
    pdl_wait();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int col = (int)(i % C);
    if (!((mask[col >> 5] >> (col & 31)) & 1u)) x[i] = -__int_as_float(0x7f800000);
}

// Activations to f16 (round to nearest even) for the cuBLAS prefill product, four per thread.
extern "C" __global__ void to_f16(const float* __restrict__ x, u16* __restrict__ out, i64 n) {
    pdl_wait();
    const i64 i = 4 * ((i64)blockIdx.x * blockDim.x + threadIdx.x);
    if (i + 3 < n) {
        const float4 a = *(const float4*)(x + i);
        *(uint2*)(out + i) = make_uint2(pack_h2(a.x, a.y), pack_h2(a.z, a.w));
    } else {
        for (i64 j = i; j < n; j++) out[j] = f2h(x[j]);
    }
}

// Activations (T rows of C, C % 4 == 0) as f16 pairs for the cuBLAS prefill product on pairs:
// row t of out is [hi | hi | lo], 3C wide, hi = f16(x) and lo = f16(x - hi) (the remainder is
// exact in f32). The weight's pairs are laid [Wh | Wl] per row, so one product over the first 2C
// columns forms Wh·hi + Wl·hi and a second over Wh and the last C columns adds Wh·lo. Four per
// thread.
extern "C" __global__ void to_f16_pairs(const float* __restrict__ x, u16* __restrict__ out,
                                        int C, i64 n) {
    pdl_wait();
    const i64 i = 4 * ((i64)blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= n) return;
    const i64 t = i / C, c = i % C;
    const float4 a = *(const float4*)(x + i);
    const float v[4] = {a.x, a.y, a.z, a.w};
    u16 h[4];
    float l[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        h[j] = f2h(v[j]);
        l[j] = v[j] - h2f(h[j]);
    }
    const uint2 hi = make_uint2((u32)h[0] | ((u32)h[1] << 16), (u32)h[2] | ((u32)h[3] << 16));
    u16* row = out + t * 3 * C + c;
    *(uint2*)row = hi;
    *(uint2*)(row + C) = hi;
    *(uint2*)(row + 2 * C) = make_uint2(pack_h2(l[0], l[1]), pack_h2(l[2], l[3]));
}

// Activations in two 8-bit parts per 32 elements for the integer prefill product (mmq.cuh),
// operation for operation as the CPU fast path quantizes them (cpu/kernels/q8act.rs,
// quantize_row_split): dx = max|x| / 127, q = round(x / dx) (ties to even, through the
// reciprocal as there), l = round(256 (x / dx - q)), both clamped to +-127. One warp per block of
// 32; q goes to q[0 .. n), l to q[n .. 2n), and per block {dx, dx Σq + dx / 256 Σl} to s.
// n = T * C, a multiple of 32.
extern "C" __global__ void quantize_split16(const float* __restrict__ x, i8* __restrict__ q,
                                            float2* __restrict__ s, i64 n) {
    pdl_wait();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i - (threadIdx.x & 31) >= n) return;  // whole warps only
    const float v = x[i];
    const float m = warp_max(fabsf(v));
    const float d = __fdiv_rn(m, 127.0f), id = d > 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    const float y = __fmul_rn(v, id);
    const int h = max(-127, min(127, __float2int_rn(y)));
    const int l = max(-127, min(127, __float2int_rn(__fmul_rn(__fsub_rn(y, (float)h), 256.0f))));
    q[i] = (i8)h;
    q[n + i] = (i8)l;
    int s1 = h, s2 = l;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        s1 += __shfl_xor_sync(FULL_MASK, s1, o);
        s2 += __shfl_xor_sync(FULL_MASK, s2, o);
    }
    if ((threadIdx.x & 31) == 0)
        s[i >> 5] = make_float2(d, fmaf(d * 0.00390625f, (float)s2, d * (float)s1));
}

// out (T, R) += bias (R) on every row.
extern "C" __global__ void add_bias_rows(float* __restrict__ out, const float* __restrict__ bias,
                                         i64 n, int R) {
    pdl_wait();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] += bias[i % R];
}

// k, v (T, hkv*dh) into caches (hkv, cap, dh) at positions pos0 + t; positions at or past the
// capacity are dropped (never written out of bounds).
template <typename KV>
__device__ __forceinline__ KV to_kv(float v);
template <>
__device__ __forceinline__ u16 to_kv<u16>(float v) { return f2h(v); }
template <>
__device__ __forceinline__ float to_kv<float>(float v) { return v; }

template <typename KV>
__device__ __forceinline__ void kv_write_impl(const float* __restrict__ k,
                                              const float* __restrict__ v, KV* __restrict__ kc,
                                              KV* __restrict__ vc, const i32* __restrict__ pos0p,
                                              int T, int hkv, int dh, int cap) {
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)T * hkv * dh) return;
    const int d = (int)(idx % dh);
    const i64 th = idx / dh;
    const int h = (int)(th % hkv), t = (int)(th / hkv);
    const int pos = *pos0p + t;
    if (pos < 0 || pos >= cap) return;
    const i64 dst = ((i64)h * cap + pos) * dh + d;
    kc[dst] = to_kv<KV>(k[idx]);
    vc[dst] = to_kv<KV>(v[idx]);
}

extern "C" __global__ void kv_write_f16(const float* k, const float* v, u16* kc, u16* vc,
                                        const i32* pos0p, int T, int hkv, int dh, int cap) {
    pdl_wait();
    kv_write_impl<u16>(k, v, kc, vc, pos0p, T, hkv, dh, cap);
}
extern "C" __global__ void kv_write_f32(const float* k, const float* v, float* kc, float* vc,
                                        const i32* pos0p, int T, int hkv, int dh, int cap) {
    pdl_wait();
    kv_write_impl<float>(k, v, kc, vc, pos0p, T, hkv, dh, cap);
}

// Rows of k, v (R, hkv, dh) into a paged cache `(n_blocks, hkv, B, dh)` (B = 1 << lb) at
// slots[r] = block * B + offset; a negative slot is a padding row (skipped). The host checked
// every slot against the pool before the launch.
template <typename KV>
__device__ __forceinline__ void paged_kv_write_impl(const float* __restrict__ k,
                                                    const float* __restrict__ v,
                                                    KV* __restrict__ kc, KV* __restrict__ vc,
                                                    const i32* __restrict__ slots, int R, int hkv,
                                                    int dh, int lb) {
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)R * hkv * dh) return;
    const int d = (int)(idx % dh);
    const i64 th = idx / dh;
    const int h = (int)(th % hkv), r = (int)(th / hkv);
    const int slot = slots[r];
    if (slot < 0) return;
    const i64 block = slot >> lb, off = slot & ((1 << lb) - 1);
    const i64 dst = (((block * hkv + h) << lb) + off) * dh + d;
    kc[dst] = to_kv<KV>(k[idx]);
    vc[dst] = to_kv<KV>(v[idx]);
}

extern "C" __global__ void paged_kv_write_f16(const float* k, const float* v, u16* kc, u16* vc,
                                              const i32* slots, int R, int hkv, int dh, int lb) {
    pdl_wait();
    paged_kv_write_impl<u16>(k, v, kc, vc, slots, R, hkv, dh, lb);
}
extern "C" __global__ void paged_kv_write_f32(const float* k, const float* v, float* kc,
                                              float* vc, const i32* slots, int R, int hkv, int dh,
                                              int lb) {
    pdl_wait();
    paged_kv_write_impl<float>(k, v, kc, vc, slots, R, hkv, dh, lb);
}

// Where the rotated keys and the values of row t, kv head h go, as an element offset into the
// cache (-1: nowhere). A contiguous cache `(Hkv, S_cap, Dh)`: row t at position *pos0p + t,
// dropped at or past the capacity.
struct ContigStore {
    const i32* __restrict__ pos0p;
    int cap;
    __device__ __forceinline__ int pos(int t) const { return *pos0p + t; }
    __device__ __forceinline__ i64 row(int t, int h, int pos, int hkv, int dh) const {
        return (pos < 0 || pos >= cap) ? -1 : ((i64)h * cap + pos) * dh;
    }
};
// A paged cache `(n_blocks, Hkv, B, Dh)` (B = 1 << lb): row t at position row_pos[t], stored at
// slots[t] = block * B + offset (negative: a padding row, not stored).
struct PagedStore {
    const i32* __restrict__ row_pos;
    const i32* __restrict__ slots;
    int lb;
    __device__ __forceinline__ int pos(int t) const { return row_pos[t]; }
    __device__ __forceinline__ i64 row(int t, int h, int, int hkv, int dh) const {
        const int s = slots[t];
        if (s < 0) return -1;
        return (((((i64)(s >> lb)) * hkv + h) << lb) + (s & ((1 << lb) - 1))) * dh;
    }
};

// The three steps before attention in one kernel: RoPE on q (T, nh, dh) in place, RoPE on
// k (T, hkv, dh) into the cache (k itself is left as it was), v into the cache. One thread per
// (token, head of q or of k/v, pair of elements); the same angles and arithmetic as `rope`.
// Pairs past the rotated ones (partial rotary) carry k's other elements; rows the store maps
// nowhere are dropped. Waits for the previous kernel (`pdl_wait`) itself.
template <typename KV, typename Store>
__device__ __forceinline__ void rope_store_impl(float* __restrict__ q, const float* __restrict__ k,
                                                const float* __restrict__ v, KV* __restrict__ kc,
                                                KV* __restrict__ vc,
                                                const float* __restrict__ inv_freq, Store store,
                                                int T, int nh, int hkv, int dh, int half, int neox,
                                                float linear_scale) {
    const int pairs = dh >> 1, slots = nh + hkv;
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const bool live = idx < (i64)T * slots * pairs;
    const int j = (int)(idx % pairs);
    const i64 ts = idx / pairs;
    const int slot = (int)(ts % slots), t = (int)(ts / slots);
    // The position and the angle do not depend on the previous kernel (the position words are
    // written before the step starts): computed before waiting for it.
    const int pos = live ? store.pos(t) : 0;
    float s = 0.0f, c = 1.0f;
    if (live && j < half) sincosf((float)pos / linear_scale * inv_freq[j], &s, &c);
    pdl_wait();
    if (!live) return;
    const int a = neox ? j : 2 * j, b = neox ? j + half : 2 * j + 1;
    if (slot < nh) {
        if (j < half) {
            float* head = q + ((i64)t * nh + slot) * dh;
            const float x0 = head[a], x1 = head[b];
            head[a] = x0 * c - x1 * s;
            head[b] = x0 * s + x1 * c;
        }
        return;
    }
    const int h = slot - nh;
    const i64 dst = store.row(t, h, pos, hkv, dh);
    if (dst < 0) return;
    const float* kh = k + ((i64)t * hkv + h) * dh;
    const float* vh = v + ((i64)t * hkv + h) * dh;
    if (j < half) {
        const float x0 = kh[a], x1 = kh[b];
        kc[dst + a] = to_kv<KV>(x0 * c - x1 * s);
        kc[dst + b] = to_kv<KV>(x0 * s + x1 * c);
    } else {
        const int e = 2 * j;  // past the 2 * half rotated elements
        kc[dst + e] = to_kv<KV>(kh[e]);
        kc[dst + e + 1] = to_kv<KV>(kh[e + 1]);
    }
    vc[dst + 2 * j] = to_kv<KV>(vh[2 * j]);
    vc[dst + 2 * j + 1] = to_kv<KV>(vh[2 * j + 1]);
}

#define HF2Q_ROPE_STORE(NAME, KV)                                                              \
    extern "C" __global__ void rope_store_##NAME(float* q, const float* k, const float* v,     \
                                                 KV* kc, KV* vc, const float* inv_freq,        \
                                                 const i32* pos0p, int T, int nh, int hkv,     \
                                                 int dh, int half, int neox,                   \
                                                 float linear_scale, int cap) {                \
        rope_store_impl<KV>(q, k, v, kc, vc, inv_freq, ContigStore{pos0p, cap}, T, nh, hkv,    \
                            dh, half, neox, linear_scale);                                     \
    }                                                                                          \
    extern "C" __global__ void paged_rope_store_##NAME(                                        \
        float* q, const float* k, const float* v, KV* kc, KV* vc, const float* inv_freq,       \
        const i32* row_pos, const i32* slots, int R, int nh, int hkv, int dh, int half,        \
        int neox, float linear_scale, int lb) {                                                \
        rope_store_impl<KV>(q, k, v, kc, vc, inv_freq, PagedStore{row_pos, slots, lb}, R, nh,  \
                            hkv, dh, half, neox, linear_scale);                                \
    }
HF2Q_ROPE_STORE(f16, u16)
HF2Q_ROPE_STORE(f32, float)

#define ARGMAX_THREADS 256
#define ARGMAX_BLOCKS 128

// Index of the largest value of each row: first index on ties, NaN ignored, 0 for a row of NaN
// (the CPU sampler's rule). ARGMAX_BLOCKS blocks per row each reduce a slice to one key, the
// last block of the row to finish reduces the keys (a vocabulary-sized row is read by the whole
// GPU, not by one multiprocessor). A key orders (value, -index): the value's bits made
// monotonic in the high word, the bitwise complement of the index in the low word; 0 is "no
// value" (below every real one).
__device__ __forceinline__ u64 argmax_key(float v, int i) {
    if (v == 0.0f) v = 0.0f;  // -0 equals +0: the index decides, as on the CPU
    const u32 b = __float_as_uint(v);
    const u32 k = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)k << 32) | (u64)(~(u32)i);
}

__device__ __forceinline__ u64 block_max_u64(u64 k, u64* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 ok = __shfl_xor_sync(FULL_MASK, k, o);
        k = ok > k ? ok : k;
    }
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = k;
    __syncthreads();
    k = 0;
#pragma unroll
    for (int w = 0; w < ARGMAX_THREADS / 32; w++) k = red[w] > k ? red[w] : k;
    return k;
}

// Grid (ARGMAX_BLOCKS, rows); `part` holds rows x ARGMAX_BLOCKS keys, `counters` one zeroed
// word per row (left at zero).
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_rows(const float* __restrict__ x, u32* __restrict__ out, int C, u64* part,
                u32* counters) {
    pdl_wait();
    __shared__ u64 red[ARGMAX_THREADS / 32];
    __shared__ u32 last;
    const int row = blockIdx.y;
    const float* xr = x + (i64)row * C;
    // Slices of whole float4s when the row allows it.
    const bool vec = (C & 3) == 0 && ((u64)xr & 15) == 0;
    const int per = vec ? ((C >> 2) + ARGMAX_BLOCKS - 1) / ARGMAX_BLOCKS * 4
                        : (C + ARGMAX_BLOCKS - 1) / ARGMAX_BLOCKS;
    const int e0 = blockIdx.x * per, e1 = min(e0 + per, C);
    u64 k = 0;
    if (vec) {
        for (int e = e0 + 4 * threadIdx.x; e < e1; e += 4 * ARGMAX_THREADS) {
            const float4 v = *(const float4*)(xr + e);
            const float w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const u64 kj = w[j] == w[j] ? argmax_key(w[j], e + j) : 0;
                k = kj > k ? kj : k;
            }
        }
    } else {
        for (int e = e0 + threadIdx.x; e < e1; e += ARGMAX_THREADS) {
            const float v = xr[e];
            const u64 kj = v == v ? argmax_key(v, e) : 0;
            k = kj > k ? kj : k;
        }
    }
    k = block_max_u64(k, red);
    if (threadIdx.x == 0) part[(i64)row * ARGMAX_BLOCKS + blockIdx.x] = k;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counters + row, 1u) == ARGMAX_BLOCKS - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    k = threadIdx.x < ARGMAX_BLOCKS ? part[(i64)row * ARGMAX_BLOCKS + threadIdx.x] : 0;
    __syncthreads();  // red is reused
    k = block_max_u64(k, red);
    if (threadIdx.x == 0) {
        out[row] = k == 0 ? 0u : ~(u32)(k & 0xffffffffu);
        counters[row] = 0;  // ready for the next call (or graph replay)
    }
}

// ---------------------------------------------------------------------------------------------
// Sampling on the device (top-k, then top-p, min-p, temperature, one draw), the CPU sampler's
// steps in its order and arithmetic (`hf2q_models::sampler`), so that with the same uniform
// number both pick the same token (up to the last bit of expf in a cumulative sum at a bucket
// edge). One block of SAMPLE_THREADS threads per row; the settings shared by every row, or
// (per_row) one entry per row.
// ---------------------------------------------------------------------------------------------

#define SAMPLE_THREADS 1024
#define SAMPLE_MAX_K 1024

// Mirrors `SampleArgs` on the host (#[repr(C)]): written before each replay of a graph.
struct SampleArgs {
    double u;  // uniform in [0, 1)
    float top_p, min_p, temperature;
    i32 top_k;  // 1 ..= SAMPLE_MAX_K
};

// Order-preserving key of a logit (NaN as -inf, the CPU's rule): larger value, larger key.
__device__ __forceinline__ u32 sample_key(float v) {
    if (v != v) v = -__int_as_float(0x7f800000);
    const u32 b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_value(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_topk(const float* __restrict__ logits, int V, const SampleArgs* __restrict__ args,
                int per_row, u32* __restrict__ out) {
    pdl_wait();
    __shared__ u32 hist[256];
    __shared__ u32 s_prefix, s_need, s_n, s_eq;
    __shared__ u32 ck[SAMPLE_MAX_K];  // candidate keys
    __shared__ u32 ci[SAMPLE_MAX_K];  // candidate ids
    const int tid = threadIdx.x;
    const float* x = logits + (i64)blockIdx.x * V;
    const SampleArgs a = args[per_row ? blockIdx.x : 0];  // one row's settings, or all rows'
    const u32 k = (u32)min(max(a.top_k, 1), min(V, SAMPLE_MAX_K));

    // 1. Radix select of the k-th largest key, eight bits at a time from the top.
    u32 prefix = 0, mask = 0, need = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += SAMPLE_THREADS) hist[i] = 0;
        __syncthreads();
        for (int i = tid; i < V; i += SAMPLE_THREADS) {
            const u32 key = sample_key(x[i]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            u32 cum = 0;
            int b = 255;
            for (; b > 0; b--) {
                if (cum + hist[b] >= need) break;
                cum += hist[b];
            }
            s_prefix = prefix | ((u32)b << shift);
            s_need = need - cum;
        }
        __syncthreads();
        prefix = s_prefix;
        need = s_need;
        mask |= 255u << shift;
    }
    // prefix: the k-th largest key; `need` of the keys equal to it are taken (smallest ids).

    // 2. Candidates: every key above the threshold, and the first `need` equal ones.
    if (tid == 0) {
        s_n = 0;
        s_eq = 0;
    }
    __syncthreads();
    for (int i = tid; i < V; i += SAMPLE_THREADS) {
        const u32 key = sample_key(x[i]);
        if (key > prefix) {
            const u32 p = atomicAdd(&s_n, 1u);
            ck[p] = key;
            ci[p] = (u32)i;
        } else if (key == prefix) {
            atomicAdd(&s_eq, 1u);
        }
    }
    __syncthreads();
    if (s_eq <= need) {
        // Every equal key is in (the usual case: one).
        for (int i = tid; i < V; i += SAMPLE_THREADS) {
            if (sample_key(x[i]) == prefix) {
                const u32 p = atomicAdd(&s_n, 1u);
                ck[p] = prefix;
                ci[p] = (u32)i;
            }
        }
    } else if (tid == 0) {
        // Ties past the k-th place: the smallest ids, in order (rare; one thread).
        u32 p = s_n;
        for (int i = 0; i < V && p < k; i++)
            if (sample_key(x[i]) == prefix) {
                ck[p] = prefix;
                ci[p] = (u32)i;
                p++;
            }
        s_n = p;
    }
    __syncthreads();
    const u32 n = s_n;  // == k

    // 3. Sort by (key descending, id ascending): bitonic over the next power of two.
    u32 m = 1;
    while (m < n) m <<= 1;
    for (u32 i = n + tid; i < m; i += SAMPLE_THREADS) {
        ck[i] = 0;  // below every real key
        ci[i] = 0xffffffffu;
    }
    __syncthreads();
    for (u32 size = 2; size <= m; size <<= 1) {
        for (u32 stride = size >> 1; stride > 0; stride >>= 1) {
            for (u32 i = tid; i < m; i += SAMPLE_THREADS) {
                const u32 j = i ^ stride;
                if (j > i) {
                    // "before(a, b)": a sorts first.
                    const bool ij = ck[i] > ck[j] || (ck[i] == ck[j] && ci[i] < ci[j]);
                    const bool up = (i & size) == 0;
                    if (up ? !ij : ij) {
                        const u32 tk = ck[i], ti = ci[i];
                        ck[i] = ck[j];
                        ci[i] = ci[j];
                        ck[j] = tk;
                        ci[j] = ti;
                    }
                }
            }
            __syncthreads();
        }
    }

    // 4. top-p, min-p, temperature and the draw, sequentially as the CPU does.
    if (tid != 0) return;
    u32 keep = n;
    const float top = key_value(ck[0]);
    if (a.top_p < 1.0f && keep > 1) {
        double total = 0.0;
        for (u32 i = 0; i < keep; i++) total += (double)expf(key_value(ck[i]) - top);
        double cum = 0.0;
        for (u32 i = 0; i < keep; i++) {
            cum += (double)expf(key_value(ck[i]) - top) / total;
            if (cum >= (double)a.top_p) {
                keep = i + 1;
                break;
            }
        }
    }
    if (a.min_p > 0.0f && keep > 1) {
        const float threshold = top + logf(a.min_p);
        u32 c = 0;
        while (c < keep && key_value(ck[c]) >= threshold) c++;
        keep = max(c, 1u);
    }
    if (top == -__int_as_float(0x7f800000)) {
        out[blockIdx.x] = ci[0];
        return;
    }
    const float inv_t = 1.0f / a.temperature;
    double total = 0.0;
    for (u32 i = 0; i < keep; i++) total += (double)expf((key_value(ck[i]) - top) * inv_t);
    const double u = a.u * total;
    double cum = 0.0;
    u32 last = ci[0];
    for (u32 i = 0; i < keep; i++) {
        const float p = expf((key_value(ck[i]) - top) * inv_t);
        cum += (double)p;
        if (u < cum) {
            out[blockIdx.x] = ci[i];
            return;
        }
        if (p > 0.0f) last = ci[i];
    }
    out[blockIdx.x] = last;
}

#include "moe_route.cuh"

// Soft capping in place (final logits of the Gemma families): x = tanh(x / cap) * cap, in the
// CPU reference's order (an IEEE division, tanhf, one product). One thread per value.
extern "C" __global__ void softcap(float* __restrict__ x, float cap, i64 n) {
    pdl_wait();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = tanhf(x[i] / cap) * cap;
}
