// One-token products with 8-bit activations: the integer dot product (`dp4a`, four byte
// products and a sum per instruction) in place of matvec.cuh's per-weight conversion to float
// and multiply-add, for the quantized formats (Q4_0, Q8_0, Q4_K, Q6_K).
//
// Each block first quantizes the input row x into its shared memory, per 32 elements in two
// 8-bit terms (`XQ`). The weights' lanes, units and loads are those of matvec.cuh (the same
// coalescing), so only the activations' side changes: a unit's activations are a few 8- or
// 16-byte shared-memory loads instead of 32-128 bytes through L1, and sixteen weights cost eight
// `dp4a` instead of sixteen permutes, subtractions and multiply-adds.
//
// Error: every activation moves by at most max|x_block| / 64516, so a row's result moves by at
// most the sum over blocks of that times sum |w| in the block (the tests check this bound).
#pragma once
#include "matvec.cuh"

__device__ __forceinline__ int dp4a(u32 a, u32 b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// The quantized row in shared memory, in two terms: x ~ d1 q1 + d2 q2 per 32-element block,
// q1 = round(x / d1) with d1 = max|x| / 127, then the remainder r = x - d1 q1 (|r| <= d1 / 2)
// as q2 = round(r / d2) with d2 = d1 / 254. One term alone (ggml's Q8_1) moves an element by up
// to max|x| / 254, which put the synthesized 8B's decode at 92/100 argmax agreement with the
// reference (mean KL 5.8e-4) where the gate asks 98; with the second term the error is at most
// max|x| / 64516, finer than rounding x to f16. Each product is then two integer dot products.
struct XQ {
    const u8* q1;
    const u8* q2;
    const float4* ds;  // per block: d1, d1 * sum q1, d2, d2 * sum q2
};

__device__ __forceinline__ u32 pack_i8x4(int a, int b, int c, int d) {
    return (u32)(a & 0xff) | ((u32)(b & 0xff) << 8) | ((u32)(c & 0xff) << 16) |
           ((u32)(d & 0xff) << 24);
}

__device__ __forceinline__ int sum8(int s) {  // over the eight lanes of one block
    s += __shfl_xor_sync(FULL_MASK, s, 1);
    s += __shfl_xor_sync(FULL_MASK, s, 2);
    return s + __shfl_xor_sync(FULL_MASK, s, 4);
}

// Quantizes x (cols f32, 16-byte aligned, cols % 32 == 0) into the two terms. Eight lanes per
// block (a float4 each), four blocks per warp and round; R rounds' loads are issued before any
// is used, so at R = 8 a block of four warps has 128 loads in flight (one trip through L2 for
// 4096 columns). Lane `sub` of block b's eight hands its four elements' codes h (first term), l
// (second) and the block's scales to put(b, sub, h, l, d1, d2), which stores them in its
// kernel's layout; every lane calls it, b >= nb included (it may shuffle; it stores nothing then).
// With NORM the row quantized is x * (w + offset) (`MvNorm`), and the lane's share of the sum
// of the squares of x is returned (0 otherwise). R rounds per pass (8; fewer where registers
// are short: the norm's weights double the loads in flight).
template <bool NORM, int R = 8, class Put>
__device__ __forceinline__ float quantize_row_q8(const float* __restrict__ x, int cols,
                                                 const MvNorm& nm, Put put) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int nb = cols >> 5, sub = lane & 7, mine = warp * 4 + (lane >> 3);
    float ss = 0.0f;
    for (int base = 0; base < nb; base += 4 * R * nw) {  // block-uniform
        float4 v[R], g[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            const int b = base + 4 * nw * r + mine;
            if (b < nb) {
                v[r] = *(const float4*)(x + 32 * b + 4 * sub);
                if (NORM) g[r] = *(const float4*)(nm.w + 32 * b + 4 * sub);
            } else {
                v[r].x = v[r].y = v[r].z = v[r].w = 0.0f;
                if (NORM) g[r] = v[r];
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            const int b = base + 4 * nw * r + mine;
            float e[4] = {v[r].x, v[r].y, v[r].z, v[r].w};
            if (NORM) {
                const float gw[4] = {g[r].x, g[r].y, g[r].z, g[r].w};
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    ss = fmaf(e[i], e[i], ss);
                    e[i] *= gw[i] + nm.offset;
                }
            }
            float a = fmaxf(fmaxf(fabsf(e[0]), fabsf(e[1])), fmaxf(fabsf(e[2]), fabsf(e[3])));
            a = fmaxf(a, __shfl_xor_sync(FULL_MASK, a, 1));
            a = fmaxf(a, __shfl_xor_sync(FULL_MASK, a, 2));
            a = fmaxf(a, __shfl_xor_sync(FULL_MASK, a, 4));
            const float d1 = a / 127.0f, id1 = a > 0.0f ? 127.0f / a : 0.0f;
            const float d2 = d1 / 254.0f, id2 = a > 0.0f ? 254.0f * id1 : 0.0f;
            int h[4], l[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                h[i] = __float2int_rn(e[i] * id1);
                // The remainder is at most d1 / 2 up to rounding: clamp its code to 127.
                l[i] = max(-127, min(127, __float2int_rn(fmaf(-d1, (float)h[i], e[i]) * id2)));
            }
            put(b, sub, h, l, d1, d2);
        }
    }
    return ss;
}

// The block's 1 / rms(x) from each thread's share of the sum of squares (`quantize_row_q8`),
// `slots` one float per warp of shared memory; synchronises the block (the staging's barrier).
template <bool NORM>
__device__ __forceinline__ float block_inv_rms(float ss, float* slots, int cols,
                                               const MvNorm& nm) {
    if (NORM) {
        ss = warp_sum(ss);
        if ((threadIdx.x & 31) == 0) slots[threadIdx.x >> 5] = ss;
    }
    __syncthreads();
    if (!NORM) return 1.0f;
    float s = 0.0f;
    for (int k = 0; k < (int)(blockDim.x >> 5); k++) s += slots[k];
    return inv_rms(s, cols, nm.eps);
}

__device__ __forceinline__ void stage_q8(const float* __restrict__ x, int cols, u8* q1, u8* q2,
                                         float4* ds) {
    const int nb = cols >> 5;
    quantize_row_q8<false>(x, cols, MvNorm{}, [&](int b, int sub, const int* h, const int* l,
                                                  float d1, float d2) {
        const int s1 = sum8(h[0] + h[1] + h[2] + h[3]), s2 = sum8(l[0] + l[1] + l[2] + l[3]);
        if (b < nb) {
            *(u32*)(q1 + 32 * b + 4 * sub) = pack_i8x4(h[0], h[1], h[2], h[3]);
            *(u32*)(q2 + 32 * b + 4 * sub) = pack_i8x4(l[0], l[1], l[2], l[3]);
            if (sub == 0) ds[b] = float4{d1, d1 * (float)s1, d2, d2 * (float)s2};
        }
    });
}

#define ONES 0x01010101u
#define LO4 0x0F0F0F0Fu

__device__ __forceinline__ int sum_u2(uint2 a, uint2 b) {  // of the 16 int8 in a and b
    return dp4a(ONES, a.x, dp4a(ONES, a.y, dp4a(ONES, b.x, dp4a(ONES, b.y, 0))));
}
__device__ __forceinline__ int sum_u4(uint4 a) {
    return dp4a(ONES, a.x, dp4a(ONES, a.y, dp4a(ONES, a.z, dp4a(ONES, a.w, 0))));
}
__device__ __forceinline__ int dot_u4(uint4 w, uint4 x, int c) {
    return dp4a(w.x, x.x, dp4a(w.y, x.y, dp4a(w.z, x.z, dp4a(w.w, x.w, c))));
}

// Split Q4_0 (DQ4_0S's layout and lanes: pairs, lane p of a block taking bytes 8p .. 8p + 8).
// q - 8 is folded into the sums: sum (q - 8) x = sum q x - 8 sum x.
struct EQ4_0S {
    static constexpr int N = 16, RPW = 2, GNR = 2;
    struct XR {
        uint2 lo, hi, lo2, hi2;  // elements 8p .. 8p + 8 and 16 + 8p .. 16 + 8p + 8, both terms
        float d1, d2;
        int s8a, s8b;  // 8 * their sums
    };
    static __device__ __forceinline__ void load(const XQ& x, int u, XR& r) {
        const int off = 32 * (u >> 1) + 8 * (u & 1);
        r.lo = *(const uint2*)(x.q1 + off);
        r.hi = *(const uint2*)(x.q1 + off + 16);
        r.lo2 = *(const uint2*)(x.q2 + off);
        r.hi2 = *(const uint2*)(x.q2 + off + 16);
        const float4 ds = x.ds[u >> 1];
        r.d1 = ds.x;
        r.d2 = ds.z;
        r.s8a = 8 * sum_u2(r.lo, r.hi);
        r.s8b = 8 * sum_u2(r.lo2, r.hi2);
    }
    static __device__ __forceinline__ float dot(const WRef& w, int row, int u, const XR& r) {
        const i64 blk = (i64)row * (w.cols >> 5) + (u >> 1);
        const uint2 q = ld_stream_u2((const uint2*)w.data + 2 * blk + (u & 1));
        const float d = h2f(((const u16*)w.scales)[blk]);
        const u32 a0 = q.x & LO4, a1 = q.y & LO4, a2 = (q.x >> 4) & LO4, a3 = (q.y >> 4) & LO4;
        const int s1 = dp4a(a0, r.lo.x, dp4a(a1, r.lo.y, dp4a(a2, r.hi.x, dp4a(a3, r.hi.y, -r.s8a))));
        const int s2 =
            dp4a(a0, r.lo2.x, dp4a(a1, r.lo2.y, dp4a(a2, r.hi2.x, dp4a(a3, r.hi2.y, -r.s8b))));
        return d * fmaf(r.d1, i2f(s1), r.d2 * i2f(s2));
    }
};

// Split Q8_0, pairs: lane p of a block takes quants 16p .. 16p + 16 (one 16-byte load).
struct EQ8_0S {
    static constexpr int N = 16, RPW = 4, GNR = 2;
    struct XR {
        uint4 x1, x2;
        float d1, d2;
    };
    static __device__ __forceinline__ void load(const XQ& x, int u, XR& r) {
        r.x1 = *(const uint4*)(x.q1 + 16 * u);
        r.x2 = *(const uint4*)(x.q2 + 16 * u);
        const float4 ds = x.ds[u >> 1];
        r.d1 = ds.x;
        r.d2 = ds.z;
    }
    static __device__ __forceinline__ float dot(const WRef& w, int row, int u, const XR& r) {
        const i64 blk = (i64)row * (w.cols >> 5) + (u >> 1);
        const uint4 q = ld_stream_u4((const uint4*)w.data + 2 * blk + (u & 1));
        const float d = h2f(((const u16*)w.scales)[blk]);
        return d * fmaf(r.d1, i2f(dot_u4(q, r.x1, 0)), r.d2 * i2f(dot_u4(q, r.x2, 0)));
    }
};

// Q4_K as stored, DQ4_K's units: 16 quant bytes of super-block b / 8, the low nibbles sixteen
// elements of sub-block 2c, the high nibbles the same sixteen of sub-block 2c + 1.
struct EQ4_K {
    static constexpr int N = 32, RPW = 4, GNR = 2;
    struct XR {
        uint4 lo, hi, lo2, hi2;
        float dlo, dhi, dlo2, dhi2;  // the two x blocks' scales, both terms
        float slo, shi;              // the sums of the sixteen x of each half
    };
    static __device__ __forceinline__ void load(const XQ& x, int b, XR& r) {
        const int blk = 8 * (b >> 3) + 2 * ((b >> 1) & 3);
        const int off = 32 * blk + 16 * (b & 1);
        r.lo = *(const uint4*)(x.q1 + off);
        r.hi = *(const uint4*)(x.q1 + off + 32);
        r.lo2 = *(const uint4*)(x.q2 + off);
        r.hi2 = *(const uint4*)(x.q2 + off + 32);
        const float4 a = x.ds[blk], c = x.ds[blk + 1];
        r.dlo = a.x;
        r.dlo2 = a.z;
        r.dhi = c.x;
        r.dhi2 = c.z;
        r.slo = fmaf(r.dlo, i2f(sum_u4(r.lo)), r.dlo2 * i2f(sum_u4(r.lo2)));
        r.shi = fmaf(r.dhi, i2f(sum_u4(r.hi)), r.dhi2 * i2f(sum_u4(r.hi2)));
    }
    static __device__ __forceinline__ float dot(const WRef& w, int row, int b, const XR& r) {
        const u8* sb = row_ptr(w, row) + 144 * (b >> 3);
        const int c = (b >> 1) & 3;
        const uint4 h = *(const uint4*)sb;
        const uint4 q = *(const uint4*)(sb + 16 + 32 * c + 16 * (b & 1));
        const uint4 ql = {q.x & LO4, q.y & LO4, q.z & LO4, q.w & LO4};
        const uint4 qh = {(q.x >> 4) & LO4, (q.y >> 4) & LO4, (q.z >> 4) & LO4, (q.w >> 4) & LO4};
        const float xl = fmaf(r.dlo, i2f(dot_u4(ql, r.lo, 0)), r.dlo2 * i2f(dot_u4(ql, r.lo2, 0)));
        const float xh = fmaf(r.dhi, i2f(dot_u4(qh, r.hi, 0)), r.dhi2 * i2f(dot_u4(qh, r.hi2, 0)));
        float sc0, m0, sc1, m1;
        scale_min_k4_reg(2 * c, h, sc0, m0);
        scale_min_k4_reg(2 * c + 1, h, sc1, m1);
        const float d = h2f((u16)(h.x & 0xffffu)), dmin = h2f((u16)(h.x >> 16));
        return d * (sc0 * xl + sc1 * xh) - dmin * (m0 * r.slo + m1 * r.shi);
    }
};

// Q6_K padded to 224 bytes, DQ6_KP's units: eight columns l0 .. l0 + 8 of the four quarters of
// half n of super-block b / 8. Quarter qq's elements lie in x block 8 (b / 8) + 4 n + qq;
// q - 32 is folded into the sums as for Q4_0.
struct EQ6_KP {
    static constexpr int N = 32, RPW = 2, GNR = 1;
    struct XR {
        uint2 x1[4], x2[4];
        float d1[4], d2[4];
        int s1[4], s2[4];  // 32 * the sum of each quarter's eight codes, both terms
    };
    static __device__ __forceinline__ void load(const XQ& x, int b, XR& r) {
        const int blk = 8 * (b >> 3) + 4 * ((b >> 2) & 1);
        const int off = 32 * blk + 8 * (b & 3);
#pragma unroll
        for (int qq = 0; qq < 4; qq++) {
            r.x1[qq] = *(const uint2*)(x.q1 + off + 32 * qq);
            r.x2[qq] = *(const uint2*)(x.q2 + off + 32 * qq);
            const float4 ds = x.ds[blk + qq];
            r.d1[qq] = ds.x;
            r.d2[qq] = ds.z;
            r.s1[qq] = 32 * dp4a(ONES, r.x1[qq].x, dp4a(ONES, r.x1[qq].y, 0));
            r.s2[qq] = 32 * dp4a(ONES, r.x2[qq].x, dp4a(ONES, r.x2[qq].y, 0));
        }
    }
    static __device__ __forceinline__ float dot(const WRef& w, int row, int b, const XR& r) {
        const u8* sb = row_ptr(w, row) + 224 * (b >> 3);
        const int n = (b >> 2) & 1, l0 = 8 * (b & 3);
        const uint2 qa = *(const uint2*)(sb + 64 * n + l0);
        const uint2 qb = *(const uint2*)(sb + 64 * n + 32 + l0);
        const uint2 qh = *(const uint2*)(sb + 128 + 32 * n + l0);
        const uint2 sc = *(const uint2*)(sb + 192 + 8 * n);
        const float d = h2f(*(const u16*)(sb + 208));
        const int sb16 = l0 >> 4;
        float tot = 0.0f;
#pragma unroll
        for (int qq = 0; qq < 4; qq++) {
            const uint2 ql = (qq & 1) ? qb : qa;
            const int sh = 4 * (qq >> 1);
            const u32 n0 = ((ql.x >> sh) & LO4) | (((qh.x >> (2 * qq)) & 0x03030303u) << 4);
            const u32 n1 = ((ql.y >> sh) & LO4) | (((qh.y >> (2 * qq)) & 0x03030303u) << 4);
            const int s1 = dp4a(n0, r.x1[qq].x, dp4a(n1, r.x1[qq].y, -r.s1[qq]));
            const int s2 = dp4a(n0, r.x2[qq].x, dp4a(n1, r.x2[qq].y, -r.s2[qq]));
            const int k = sb16 + 2 * qq;
            const u32 word = k < 4 ? sc.x : sc.y;
            const float scale = (float)(i8)((word >> (8 * (k & 3))) & 0xffu);
            tot = fmaf(scale, fmaf(r.d1[qq], i2f(s1), r.d2[qq] * i2f(s2)), tot);
        }
        return d * tot;
    }
};

// The host picks the grid from one table of rows per group for both kinds of kernel
// (`mvf_rows_per_group` in ops.rs).
static_assert(EQ4_0S::RPW == DQ4_0S::RPW && EQ4_0S::GNR == DQ4_0S::GNR, "Q4_0 rows per group");
static_assert(EQ8_0S::RPW == DQ8_0S::RPW && EQ8_0S::GNR == DQ8_0S::GNR, "Q8_0 rows per group");
static_assert(EQ4_K::RPW == DQ4_K::RPW && EQ4_K::GNR == DQ4_K::GNR, "Q4_K rows per group");
static_assert(EQ6_KP::RPW == DQ6_KP::RPW && EQ6_KP::GNR == DQ6_KP::GNR, "Q6_K rows per group");

template <>
struct SplitScales<EQ4_0S> {
    static constexpr bool V = true;
};
template <>
struct SplitScales<EQ8_0S> {
    static constexpr bool V = true;
};

// mvf_rows with the activations from the shared-memory row.
template <class F, int NR, int NW>
__device__ __forceinline__ void mq_rows(const WRef& w0, const WRef& w1, const XQ& x, int rows,
                                        int row0, int ks, float (*red)[MVF_WARPS][4]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, kpart = warp % ks;
    int rr[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) rr[r] = min(row0 + r, rows - 1);
    float acc[NW][NR];
#pragma unroll
    for (int m = 0; m < NW; m++)
#pragma unroll
        for (int r = 0; r < NR; r++) acc[m][r] = 0.0f;
    const int nu = w0.cols / F::N, S = 32 * ks;
    auto step = [&](int u) {
        typename F::XR xr;
        F::load(x, u, xr);
#pragma unroll
        for (int r = 0; r < NR; r++) {
            acc[0][r] += F::dot(w0, rr[r], u, xr);
            if (NW > 1) acc[NW - 1][r] += F::dot(w1, rr[r], u, xr);
        }
    };
    if (F::N <= 16) {
#pragma unroll 4
        for (int u = lane + 32 * kpart; u < nu; u += S) step(u);
    } else {
#pragma unroll 2
        for (int u = lane + 32 * kpart; u < nu; u += S) step(u);
    }
#pragma unroll
    for (int m = 0; m < NW; m++)
#pragma unroll
        for (int r = 0; r < NR; r++) {
            const float s = warp_sum(acc[m][r]);
            if (lane == 0) red[m][warp][r] = s;
        }
}

// Dynamic shared memory of the 8-bit kernels: q1 and q2 (cols bytes each), then cols / 32
// float4 (`XQ`).
extern __shared__ __align__(16) u8 mq_smem[];

__device__ __forceinline__ XQ mq_stage(const float* __restrict__ x, int cols) {
    float4* ds = (float4*)(mq_smem + 2 * cols);
    stage_q8(x, cols, mq_smem, mq_smem + cols, ds);
    __syncthreads();
    return XQ{mq_smem, mq_smem + cols, ds};
}

template <class F>
__device__ __forceinline__ void mqf_impl(const MvJobs& jobs, const float* __restrict__ x) {
    constexpr int RPW = F::RPW;
    __shared__ float red[1][MVF_WARPS][4];
    const MvPlace p = mv_place<RPW>(jobs);
    const MvJob& J = jobs.j[p.ji];
    pdl_wait();
    const XQ xq = mq_stage(x, J.w.cols);
    if (p.row0 < J.rows) mq_rows<F, RPW, 1>(J.w, J.w, xq, J.rows, p.row0, p.ks, red);
    __syncthreads();
    mv_store<RPW>(jobs, J, p, red);
}

template <class F>
__device__ __forceinline__ void mqg_impl(const WRef g, const WRef u, const float* __restrict__ x,
                                         float* __restrict__ out, int rows, int act, int ks) {
    constexpr int NR = F::GNR;
    __shared__ float red[2][MVF_WARPS][4];
    const MvPlace p = mg_place<NR>(ks);
    pdl_wait();
    const XQ xq = mq_stage(x, g.cols);
    if (p.row0 < rows) mq_rows<F, NR, 2>(g, u, xq, rows, p.row0, ks, red);
    __syncthreads();
    mg_store<NR>(out, rows, act, p, red);
}

// mqf_NAME / mqg_NAME: the launches of mvf_NAME / mvg_NAME with 2 cols + cols / 32 * 16 bytes of
// dynamic shared memory (mqg takes mvg's arguments; its `flags` has nothing to ask: the 8-bit
// kernels do not prefetch).
#define HF2Q_MATVEC_Q8(NAME, DOT)                                                               \
    extern "C" __global__ void __launch_bounds__(MVF_WARPS * 32)                                \
        mqf_##NAME(MvJobs jobs, const float* x) {                                               \
        mqf_impl<DOT>(jobs, x);                                                                 \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(MVF_WARPS * 32)                                \
        mqg_##NAME(WRef g, WRef u, const float* x, float* o, int rows, int act, int ks,         \
                   int flags, MvNorm nm) {                                                      \
        mqg_impl<DOT>(g, u, x, o, rows, act, ks);                                               \
    }
