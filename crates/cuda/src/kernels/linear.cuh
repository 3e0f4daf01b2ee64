// Linear layers and embedding gathers, templated over a weight format (quant.cuh).
//
//   out (T, R) = x (T, C) · Wᵀ (+ bias)
//
// * T <= 8 (decode): matrix-vector kernels. One warp per weight row (per 2 or 4 rows for several
//   tokens, see MvShape), or 2 or 4 warps per row splitting its columns when the matrix has few
//   rows (`ks`); each lane walks the row eight elements (one deq8) at a time, several groups
//   unrolled, and accumulates every token's dot product in f32 (NT tokens, templated, so the
//   weight row is read once for all of them). Activations are read as f32 from global memory
//   (they are small and stay in L1/L2).
// * T > 8 (prefill): a tiled tensor-core kernel. 64 tokens x 128 rows per block, K in steps of
//   32; activations are converted to f16 and weights dequantized to f16 into shared memory once
//   per tile (double-buffered: the next step is loaded while this one multiplies), and eight
//   warps (2 x 4, 32 x 32 each) run mma.sync m16n8k16 with f32 accumulators.
#pragma once
#include "common.cuh"
#include "quant.cuh"
#include "linear_tc.cuh"

#define MV_WARPS 4

// sum_i v[i] * x[e0 + i], x aligned for float4 when `vec` (C % 8 == 0), else read element-wise
// with the tail beyond C treated as zero (the dequantizer zeroes it too).
// acc += sum_i v[i] * x[e0 + i]: x aligned for float4 when `vec` (C % 8 == 0), else read
// element-wise with the tail beyond C treated as zero (the dequantizer zeroes it too).
template <bool vec>
__device__ __forceinline__ void dot8(float& acc, const float* v, const float* __restrict__ x,
                                     int e0, int C) {
    if (vec) {
        const float4 a = *(const float4*)(x + e0), b = *(const float4*)(x + e0 + 4);
        acc = fmaf(v[0], a.x, acc);
        acc = fmaf(v[1], a.y, acc);
        acc = fmaf(v[2], a.z, acc);
        acc = fmaf(v[3], a.w, acc);
        acc = fmaf(v[4], b.x, acc);
        acc = fmaf(v[5], b.y, acc);
        acc = fmaf(v[6], b.z, acc);
        acc = fmaf(v[7], b.w, acc);
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (e0 + i < C) acc = fmaf(v[i], x[e0 + i], acc);
    }
}

// Rows per warp for NT tokens: one for a single token; more when several tokens share the
// activations, so each x load feeds several rows (x traffic through L1 is what limits NT > 1).
template <int NT>
struct MvShape {
    static constexpr int RPW = NT == 1 ? 1 : (NT <= 4 ? 2 : 4);
    // Groups per lane per row unrolled in one iteration.
    static constexpr int U = 8 / RPW;
};

// The warps of a block split into MV_WARPS / ks row groups of ks warps; the ks warps of a group
// share its rows and split the columns (warp k takes groups of eight k, k + ks, ... per lane
// stride), and their sums meet in shared memory. ks > 1 gives short-R, long-C matrices enough
// warps to fill the GPU (a 2048-row matrix is only 2048 warps at ks = 1).
template <class F, int NT, bool AL>
__device__ __forceinline__ void matvec_body(const WRef& w, const float* __restrict__ x,
                                            const float* __restrict__ bias,
                                            float* __restrict__ out, int rows, int T, int row0,
                                            int lane, int kpart, int ks, float* red) {
    constexpr int RPW = MvShape<NT>::RPW, U = MvShape<NT>::U;
    int rr[RPW];
    const u8* rp[RPW];
#pragma unroll
    for (int r = 0; r < RPW; r++) {
        rr[r] = min(row0 + r, rows - 1);  // edge rows recomputed, not written
        rp[r] = row_ptr(w, rr[r]);
    }
    const int C = w.cols, ng = (C + 7) >> 3, S = 32 * ks;
    float acc[RPW][NT];
#pragma unroll
    for (int r = 0; r < RPW; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[r][t] = 0.0f;
    int g = lane + 32 * kpart;
    for (; g + S * (U - 1) < ng; g += S * U) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int gg = g + S * u;
            float v[RPW][8];
#pragma unroll
            for (int r = 0; r < RPW; r++) F::template deq8<AL>(w, rp[r], rr[r], gg, v[r]);
#pragma unroll
            for (int t = 0; t < NT; t++)
                if (t < T) {
#pragma unroll
                    for (int r = 0; r < RPW; r++)
                        dot8<AL>(acc[r][t], v[r], x + (i64)t * C, 8 * gg, C);
                }
        }
    }
    for (; g < ng; g += S) {
        float v[RPW][8];
#pragma unroll
        for (int r = 0; r < RPW; r++) F::template deq8<AL>(w, rp[r], rr[r], g, v[r]);
#pragma unroll
        for (int t = 0; t < NT; t++)
            if (t < T) {
#pragma unroll
                for (int r = 0; r < RPW; r++) dot8<AL>(acc[r][t], v[r], x + (i64)t * C, 8 * g, C);
            }
    }
#pragma unroll
    for (int r = 0; r < RPW; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) {
            acc[r][t] = warp_sum(acc[r][t]);
            if (lane == 0) red[r * NT + t] = acc[r][t];
        }
}

template <class F, int NT>
__device__ __forceinline__ void matvec_impl(const WRef w, const float* __restrict__ x,
                                            const float* __restrict__ bias,
                                            float* __restrict__ out, int rows, int T, int ks) {
    constexpr int RPW = MvShape<NT>::RPW;
    __shared__ float red[MV_WARPS][RPW * NT];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rg = warp / ks, kpart = warp % ks;
    const int row0 = (blockIdx.x * (MV_WARPS / ks) + rg) * RPW;
    if (row0 < rows) {
        if ((w.cols & 7) == 0)
            matvec_body<F, NT, true>(w, x, bias, out, rows, T, row0, lane, kpart, ks, red[warp]);
        else
            matvec_body<F, NT, false>(w, x, bias, out, rows, T, row0, lane, kpart, ks, red[warp]);
    }
    if (ks > 1)
        __syncthreads();
    else
        __syncwarp();
    // The first warp of each row group adds the group's partial sums (in a fixed order) and
    // writes the rows.
    if (kpart == 0 && row0 < rows && lane < RPW * NT) {
        const int r = lane / NT, t = lane % NT;
        float s = 0.0f;
        for (int k = 0; k < ks; k++) s += red[warp + k][lane];
        if (t < T && row0 + r < rows)
            out[(i64)t * rows + row0 + r] = s + (bias ? bias[row0 + r] : 0.0f);
    }
}

#define GM_BM 64
#define GM_BN 128
#define GM_BK 32
#define GM_THREADS 256
// Row pitch of the shared tiles in halves: 40 (80 bytes) keeps 16-byte alignment for the tile
// stores and puts the eight rows a fragment load touches in eight different bank groups.
#define GM_PITCH 40


// One K step of tiles in registers, as f16 pairs: 64 x 32 activations (two float4 per thread)
// and 128 rows x 32 weights (two groups of eight per thread).
struct GemmStage {
    uint2 a[2];
    uint4 b[2];
};

template <class F, bool AL>
__device__ __forceinline__ void gemm_load(const WRef& w, const float* __restrict__ x, int T,
                                          int rows, int m0, int n0, int k0, int tid,
                                          GemmStage& st) {
    const int C = w.cols, ng = (C + 7) >> 3;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int idx = tid + GM_THREADS * i, r = idx >> 3, c = (idx & 7) * 4;
        const int m = m0 + r, k = k0 + c;
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
        if (m < T) {
            const float* xr = x + (i64)m * C;
            if (AL || (C & 3) == 0) {
                if (k < C) a = *(const float4*)(xr + k);
            } else {
                a.x = k < C ? xr[k] : 0.f;
                a.y = k + 1 < C ? xr[k + 1] : 0.f;
                a.z = k + 2 < C ? xr[k + 2] : 0.f;
                a.w = k + 3 < C ? xr[k + 3] : 0.f;
            }
        }
        st.a[i] = make_uint2(pack_h2(a.x, a.y), pack_h2(a.z, a.w));
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int idx = tid + GM_THREADS * i, r = idx >> 2, gi = idx & 3;
        const int n = n0 + r, gg = (k0 >> 3) + gi;
        float v[8];
        if (n < rows && gg < ng) {
            F::template deq8<AL>(w, row_ptr(w, n), n, gg, v);
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = 0.0f;
        }
        st.b[i] = make_uint4(pack_h2(v[0], v[1]), pack_h2(v[2], v[3]), pack_h2(v[4], v[5]),
                             pack_h2(v[6], v[7]));
    }
}

typedef u16 GemmTileA[GM_BM][GM_PITCH];
typedef u16 GemmTileB[GM_BN][GM_PITCH];

// Two buffers (As[2], Bs[2]): while the tensor cores work on one K step, the next one is loaded
// (and dequantized) into registers and then stored to the other buffer; one barrier per step.
template <class F, bool AL>
__device__ __forceinline__ void gemm_body(const WRef w, const float* __restrict__ x,
                                          const float* __restrict__ bias,
                                          float* __restrict__ out, int rows, int T,
                                          GemmTileA* As, GemmTileB* Bs) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wm = warp >> 2, wn = warp & 3;  // 2 x 4 warps, 32 x 32 each
    const int m0 = blockIdx.y * GM_BM, n0 = blockIdx.x * GM_BN;
    const int C = w.cols;
    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int k = 0; k < 4; k++) acc[i][j][k] = 0.0f;

    GemmStage st;
    gemm_load<F, AL>(w, x, T, rows, m0, n0, 0, tid, st);
    int buf = 0;
    for (int k0 = 0; k0 < C; k0 += GM_BK) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int idx = tid + GM_THREADS * i;
            *(uint2*)&As[buf][idx >> 3][(idx & 7) * 4] = st.a[i];
            *(uint4*)&Bs[buf][idx >> 2][(idx & 3) * 8] = st.b[i];
        }
        __syncthreads();
        if (k0 + GM_BK < C) gemm_load<F, AL>(w, x, T, rows, m0, n0, k0 + GM_BK, tid, st);
#pragma unroll
        for (int ks = 0; ks < 2; ks++) {
            const int col = ks * 16 + (lane & 3) * 2;
            u32 a[2][4], b[4][2];
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                const int r = wm * 32 + mt * 16 + (lane >> 2);
                a[mt][0] = *(const u32*)&As[buf][r][col];
                a[mt][1] = *(const u32*)&As[buf][r + 8][col];
                a[mt][2] = *(const u32*)&As[buf][r][col + 8];
                a[mt][3] = *(const u32*)&As[buf][r + 8][col + 8];
            }
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                const int r = wn * 32 + nt * 8 + (lane >> 2);
                b[nt][0] = *(const u32*)&Bs[buf][r][col];
                b[nt][1] = *(const u32*)&Bs[buf][r][col + 8];
            }
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int nt = 0; nt < 4; nt++) mma_16816(acc[mt][nt], a[mt], b[nt]);
        }
        // The next iteration writes the other buffer; the barrier after that write orders it
        // against this iteration's reads of the other buffer (two iterations back).
        buf ^= 1;
    }
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int m = m0 + wm * 32 + mt * 16 + (lane >> 2) + 8 * h;
                    const int n = n0 + wn * 32 + nt * 8 + (lane & 3) * 2 + j;
                    if (m < T && n < rows)
                        out[(i64)m * rows + n] = acc[mt][nt][2 * h + j] + (bias ? bias[n] : 0.0f);
                }
}

template <class F>
__device__ __forceinline__ void gemm_impl(const WRef w, const float* __restrict__ x,
                                          const float* __restrict__ bias,
                                          float* __restrict__ out, int rows, int T) {
    __shared__ __align__(16) GemmTileA As[2];
    __shared__ __align__(16) GemmTileB Bs[2];
    if ((w.cols & 7) == 0)
        gemm_body<F, true>(w, x, bias, out, rows, T, As, Bs);
    else
        gemm_body<F, false>(w, x, bias, out, rows, T, As, Bs);
}

// Rows `ids[t]` of the table, times `scale`: one thread per (token, group of eight). An id
// outside the table gives a row of NaN (the host cannot see device ids to reject them).
template <class F>
__device__ __forceinline__ void embed_impl(const WRef w, const u32* __restrict__ ids,
                                           float* __restrict__ out, int T, int vocab,
                                           float scale) {
    const int ng = (w.cols + 7) >> 3;
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)T * ng) return;
    const int t = (int)(idx / ng), g = (int)(idx % ng);
    const u32 id = ids[t];
    float v[8];
    if (id < (u32)vocab) {
        if ((w.cols & 7) == 0)
            F::template deq8<true>(w, row_ptr(w, (int)id), (int)id, g, v);
        else
            F::template deq8<false>(w, row_ptr(w, (int)id), (int)id, g, v);
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __int_as_float(0x7fc00000);
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int e = 8 * g + i;
        if (e < w.cols) out[(i64)t * w.cols + e] = scale == 1.0f ? v[i] : v[i] * scale;
    }
}

// Rows row0 .. row0 + n of the weight as f16, row-major with ld elements per row (C % 8 == 0):
// the operand of the cuBLAS prefill product. One thread per group of eight; the same dequantizer
// and f16 rounding as the tiled kernel's shared-memory tiles. Where lo is not null, the rounding
// remainder v - hi (exact in f32) goes there, rounded to f16 in turn, in the same layout: hi + lo
// carries about 22 bits of each value (a remainder under 2^-14 lands among the f16 subnormals,
// spaced 2^-24: off by at most 2^-25, far below the value's own f16 rounding for any value
// above about 1e-4).
template <class F>
__device__ __forceinline__ void deqh_impl(const WRef w, u16* __restrict__ out,
                                          u16* __restrict__ lo, int ld, int row0, int n) {
    const int ng = w.cols >> 3;
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)n * ng) return;
    const int r = (int)(idx / ng), g = (int)(idx % ng), row = row0 + r;
    float v[8];
    F::template deq8<true>(w, row_ptr(w, row), row, g, v);
    u16 h[8];
#pragma unroll
    for (int i = 0; i < 8; i++) h[i] = f2h(v[i]);
    const i64 at = (i64)r * ld + 8 * g;
    *(uint4*)(out + at) =
        make_uint4((u32)h[0] | ((u32)h[1] << 16), (u32)h[2] | ((u32)h[3] << 16),
                   (u32)h[4] | ((u32)h[5] << 16), (u32)h[6] | ((u32)h[7] << 16));
    if (lo != nullptr) {
        float d[8];
#pragma unroll
        for (int i = 0; i < 8; i++) d[i] = v[i] - h2f(h[i]);
        *(uint4*)(lo + at) = make_uint4(pack_h2(d[0], d[1]), pack_h2(d[2], d[3]),
                                        pack_h2(d[4], d[5]), pack_h2(d[6], d[7]));
    }
}

// Rows row0 .. row0 + n of the weight as bf16 (f32out = 0) or f32 (f32out = 1), row-major with
// ld elements per row, any C: the operand of the training products through a frozen weight
// (`linear_backward_input`, the output layer; cuda/train.rs). One thread per group of eight, the
// same dequantizer as every other kernel; bf16 keeps the exponent range of a gradient product.
template <class F>
__device__ __forceinline__ void deqt_impl(const WRef w, void* __restrict__ out, int ld, int row0,
                                          int n, int f32out) {
    const int ng = (w.cols + 7) >> 3;
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)n * ng) return;
    const int r = (int)(idx / ng), g = (int)(idx % ng), row = row0 + r;
    const bool al = (w.cols & 7) == 0;
    float v[8];
    if (al)
        F::template deq8<true>(w, row_ptr(w, row), row, g, v);
    else
        F::template deq8<false>(w, row_ptr(w, row), row, g, v);
    const i64 at = (i64)r * ld + 8 * g;
    if (f32out) {
        float* o = (float*)out + at;
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (8 * g + i < w.cols) o[i] = v[i];
    } else {
        u16* o = (u16*)out + at;
        if (al && (ld & 7) == 0) {
            *(uint4*)o = make_uint4(pack_bf2(v[0], v[1]), pack_bf2(v[2], v[3]),
                                    pack_bf2(v[4], v[5]), pack_bf2(v[6], v[7]));
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++)
                if (8 * g + i < w.cols) o[i] = f2bf(v[i]);
        }
    }
}

// The kernels of one format: mv{1,2,4,8}_NAME (matrix-vector for up to that many tokens),
// gemm_NAME (tiled, any T), mt{2,4,8}_NAME (up to 16, 32, 64 tokens on the tensor cores,
// linear_tc.cuh), embed_NAME, deqh_NAME (rows to f16) and deqt_NAME (rows to bf16
// or f32). The host looks them up by these names.
#define HF2Q_LINEAR_KERNELS(NAME, FMT)                                                         \
    extern "C" __global__ void __launch_bounds__(128)                                          \
        mv1_##NAME(WRef w, const float* x, const float* b, float* o, int rows, int T,          \
                   int ks) {                                                                   \
        pdl_wait();                                                                            \
        matvec_impl<FMT, 1>(w, x, b, o, rows, T, ks);                                          \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128)                                          \
        mv2_##NAME(WRef w, const float* x, const float* b, float* o, int rows, int T,          \
                   int ks) {                                                                   \
        pdl_wait();                                                                            \
        matvec_impl<FMT, 2>(w, x, b, o, rows, T, ks);                                          \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128)                                          \
        mv4_##NAME(WRef w, const float* x, const float* b, float* o, int rows, int T,          \
                   int ks) {                                                                   \
        pdl_wait();                                                                            \
        matvec_impl<FMT, 4>(w, x, b, o, rows, T, ks);                                          \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128)                                          \
        mv8_##NAME(WRef w, const float* x, const float* b, float* o, int rows, int T,          \
                   int ks) {                                                                   \
        pdl_wait();                                                                            \
        matvec_impl<FMT, 8>(w, x, b, o, rows, T, ks);                                          \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GM_THREADS)                                   \
        gemm_##NAME(WRef w, const float* x, const float* b, float* o, int rows, int T) {       \
        pdl_wait();                                                                            \
        gemm_impl<FMT>(w, x, b, o, rows, T);                                                   \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(512)                                          \
        mt2_##NAME(WRef w, const float* x, const float* b, float* o, int rows, int T) {        \
        pdl_wait();                                                                            \
        mt_impl<FMT, 2, 2>(w, x, b, o, rows, T);                                               \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        mt4_##NAME(WRef w, const float* x, const float* b, float* o, int rows, int T) {        \
        pdl_wait();                                                                            \
        mt_impl<FMT, 2, 4>(w, x, b, o, rows, T);                                               \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128)                                          \
        mt8_##NAME(WRef w, const float* x, const float* b, float* o, int rows, int T) {        \
        pdl_wait();                                                                            \
        mt_impl<FMT, 2, 8>(w, x, b, o, rows, T);                                               \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        embed_##NAME(WRef w, const u32* ids, float* o, int T, int vocab, float scale) {        \
        pdl_wait();                                                                            \
        embed_impl<FMT>(w, ids, o, T, vocab, scale);                                           \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        deqh_##NAME(WRef w, u16* o, u16* lo, int ld, int row0, int n) {                        \
        pdl_wait();                                                                            \
        deqh_impl<FMT>(w, o, lo, ld, row0, n);                                                 \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        deqt_##NAME(WRef w, void* o, int ld, int row0, int n, int f32out) {                    \
        pdl_wait();                                                                            \
        deqt_impl<FMT>(w, o, ld, row0, n, f32out);                                             \
    }
