// Row and element-wise ops: RMSNorm, RoPE, gated activations, residual add, KV-cache write and
// greedy argmax. Positions are read from a device int32 (`pos0p`) so that a captured graph can
// be replayed at a new position by rewriting that one word.
#include "common.cuh"

#define NORM_THREADS 256

// out[r] = x[r] / rms(x[r]) * (w + offset), one block per row. The sum of squares is reduced in
// f32 (per thread, then across warps), the scale computed as the CPU reference does.
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    rms_norm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out,
             int C, float eps, float offset) {
    __shared__ float red[NORM_THREADS / 32];
    const float* xr = x + (i64)blockIdx.x * C;
    float* orow = out + (i64)blockIdx.x * C;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < C; i += NORM_THREADS) ss += xr[i] * xr[i];
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    float tot = 0.0f;
#pragma unroll
    for (int i = 0; i < NORM_THREADS / 32; i++) tot += red[i];
    const float inv = 1.0f / sqrtf(tot / (float)C + eps);
    for (int i = threadIdx.x; i < C; i += NORM_THREADS) orow[i] = xr[i] * inv * (w[i] + offset);
}

// RoPE in place on x (T, nh, dh): one thread per (token, head, pair). Pair i rotates by angle
// (pos0 + t) / linear_scale * inv_freq[i]; NEOX pairs (i, i + half), interleaved (2i, 2i + 1).
extern "C" __global__ void rope(float* __restrict__ x, const float* __restrict__ inv_freq,
                                const i32* __restrict__ pos0p, int T, int nh, int dh, int half,
                                int neox, float linear_scale) {
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
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
}

// GELU, tanh approximation (as the CPU reference and PyTorch's approximate="tanh").
extern "C" __global__ void gelu_tanh_mul(const float* __restrict__ gate,
                                         const float* __restrict__ up, float* __restrict__ out,
                                         i64 n) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float g = gate[i];
    const float k = 0.7978846f * (g + 0.044715f * g * g * g);
    out[i] = 0.5f * g * (1.0f + tanhf(k)) * up[i];
}

extern "C" __global__ void add_assign(float* __restrict__ x, const float* __restrict__ y, i64 n) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
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
    kv_write_impl<u16>(k, v, kc, vc, pos0p, T, hkv, dh, cap);
}
extern "C" __global__ void kv_write_f32(const float* k, const float* v, float* kc, float* vc,
                                        const i32* pos0p, int T, int hkv, int dh, int cap) {
    kv_write_impl<float>(k, v, kc, vc, pos0p, T, hkv, dh, cap);
}

#define ARGMAX_THREADS 1024

// Index of the largest value of each row: first index on ties, NaN ignored, 0 for a row of NaN
// (the CPU sampler's rule). One block per row.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    // bi == -1: nothing found yet.
    return bi < 0 || v > bv || (v == bv && i < bi);
}

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_rows(const float* __restrict__ x, u32* __restrict__ out, int C) {
    __shared__ float sv[ARGMAX_THREADS / 32];
    __shared__ int si[ARGMAX_THREADS / 32];
    const float* xr = x + (i64)blockIdx.x * C;
    float bv = -__int_as_float(0x7f800000);
    int bi = -1;
    for (int i = threadIdx.x; i < C; i += ARGMAX_THREADS) {
        const float v = xr[i];
        if (v == v && better(v, i, bv, bi)) {
            bv = v;
            bi = i;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
        const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
        if (oi >= 0 && better(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
    if ((threadIdx.x & 31) == 0) {
        sv[threadIdx.x >> 5] = bv;
        si[threadIdx.x >> 5] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < ARGMAX_THREADS / 32; w++)
            if (si[w] >= 0 && better(sv[w], si[w], bv, bi)) {
                bv = sv[w];
                bi = si[w];
            }
        out[blockIdx.x] = bi < 0 ? 0u : (u32)bi;
    }
}
