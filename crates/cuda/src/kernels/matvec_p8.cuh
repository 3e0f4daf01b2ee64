// Persistent one-token products with 8-bit activations, for the large products of a decode step
// (an 8B model's, output layers): Q4_0 and Q8_0 in the split layout, Q4_K as stored and
// re-laid, Q6_K re-laid.
//
// matvec_q8.cuh's kernels quantize the input row in every block; with eight rows per block that
// staging was read once per eight rows (an 8B's gate/up: 1792 blocks, each reading the 16 KB
// row through L2) and lost what the integer products gained. Here a grid of a few blocks per
// multiprocessor stays resident: each block stages the row once into its shared memory, then its
// warps walk row groups g, g + W, ... (W warps in the grid) until the matrix is done.
//
// The staged row is laid out for the lanes: lane l of a warp takes 32-column unit l + 32 k of its
// rows (one 16-byte load of Q4_0 or Q4_K quants, two of Q8_0), so its activations are whole
// 16-byte pieces of planes a0 / a1 (the first term's codes of elements 0..15 / 16..31 of each
// 32-element block) and c0 / c1 (the second term's): a warp's loads of one plane are 512
// contiguous bytes, four shared-memory wavefronts, no bank conflicts. The planes are padded by 16
// bytes each so that Q4_K's units (one plane, blocks 2c and 2c + 1 of a super-block) land in
// different banks too. Per block, the codes' sums over each half (for formats with an offset)
// and the two scales.
//
// As in matvec.cuh, each warp loads its first units of weights before waiting for the previous
// kernel (they do not depend on it).
//
// Error: the two-term quantization of matvec_q8.cuh (every activation within max|x_block| /
// 64516).
#pragma once
#include "matvec_q8.cuh"

#define MP_WARPS 8
// Rows per row group of the plain / fused kernels: two. An 8B Q4_0 decoded 406-410 tokens/s at
// four rows, 422-426 at two, 387-390 at one: its down projection has 4096 rows, which at four
// rows per group left half of the grid's 2112 warps without a group. The `p8-rows=1|2|4` option
// at open compiles another (measurements); the host mirrors it (`CudaDev::mp_rows`).
#ifndef HF2Q_MP_RPW
#define HF2Q_MP_RPW 2
#endif
// Units of the first row group loaded before the wait.
#define MP_U 1

struct XP {
    const uint4* a0;
    const uint4* a1;
    const uint4* c0;
    const uint4* c1;
    const int4* s;     // per block: sums of q1 over elements 0..15, 16..31, of q2 likewise
    const float2* d;   // per block: d1, d2
};

// Bytes of dynamic shared memory for `cols` columns (mirrored by `mp_smem` in ops.rs).
__device__ __forceinline__ int mp_plane_bytes(int nb) { return 16 * nb + 16; }

extern __shared__ __align__(16) u8 mp_smem[];

// Quantizes x (cols f32, 16-byte aligned, cols % 32 == 0; times the norm's weights when NORM)
// into the planes (`quantize_row_q8`) and synchronises the block; `scale` is 1 / rms(x) when
// NORM, else 1.
template <bool NORM>
__device__ __forceinline__ XP mp_stage(const float* __restrict__ x, int cols, const MvNorm& nm,
                                       float& scale) {
    __shared__ float slots[MP_WARPS];
    const int nb = cols >> 5, ps = mp_plane_bytes(nb);
    u8* base = mp_smem;
    int4* sums = (int4*)(base + 4 * ps);
    float2* ds = (float2*)(base + 4 * ps + 16 * nb);
    // Four rounds of loads in flight when folding the norm (its weights beside x's), eight
    // otherwise: eight with the weights spilled at the 128 registers of two resident blocks.
    constexpr int R = NORM ? 4 : 8;
    auto put = [&](int b, int sub, const int* h, const int* l, float d1, float d2) {
        // Sums over the half (four lanes: sub 0..3 hold elements 0..15, 4..7 16..31).
        int s1 = h[0] + h[1] + h[2] + h[3], s2 = l[0] + l[1] + l[2] + l[3];
        s1 += __shfl_xor_sync(FULL_MASK, s1, 1);
        s2 += __shfl_xor_sync(FULL_MASK, s2, 1);
        s1 += __shfl_xor_sync(FULL_MASK, s1, 2);
        s2 += __shfl_xor_sync(FULL_MASK, s2, 2);
        if (b < nb) {
            const int half = sub >> 2;
            u32* p1 = (u32*)(base + half * ps) + 4 * b + (sub & 3);
            u32* p2 = (u32*)(base + (2 + half) * ps) + 4 * b + (sub & 3);
            *p1 = pack_i8x4(h[0], h[1], h[2], h[3]);
            *p2 = pack_i8x4(l[0], l[1], l[2], l[3]);
            if ((sub & 3) == 0) {
                int* s = (int*)(sums + b);
                s[half] = s1;
                s[2 + half] = s2;
            }
            if (sub == 0) ds[b] = float2{d1, d2};
        }
    };
    const float ss = quantize_row_q8<NORM, R>(x, cols, nm, put);
    scale = block_inv_rms<NORM>(ss, slots, cols, nm);
    return XP{(const uint4*)base,          (const uint4*)(base + ps),
              (const uint4*)(base + 2 * ps), (const uint4*)(base + 3 * ps),
              sums,                          ds};
}

// Split Q4_0, one lane per block: the 16 quant bytes (element i in the low nibble of byte i,
// i + 16 in the high), q - 8 folded into the sums.
struct PQ4_0 {
    static constexpr int RPW = HF2Q_MP_RPW, GNR = 2, UNROLL = 2;
    struct XR {
        uint4 a0, a1, c0, c1;
        float d1, d2;
        int o1, o2;  // -8 * the block's sums of q1, q2
    };
    static __device__ __forceinline__ XR load(const XP& x, int b) {
        const int4 s = x.s[b];
        const float2 d = x.d[b];
        return XR{x.a0[b], x.a1[b], x.c0[b], x.c1[b], d.x, d.y, -8 * (s.x + s.y), -8 * (s.z + s.w)};
    }
    struct WR {
        uint4 q;
        float d;
    };
    static __device__ __forceinline__ WR ldw(const WRef& w, int row, int b) {
        const i64 blk = (i64)row * (w.cols >> 5) + b;
        return WR{ld_stream_u4((const uint4*)w.data + blk), h2f(((const u16*)w.scales)[blk])};
    }
    static __device__ __forceinline__ float dot(const WR& w, int, const XR& r) {
        const uint4 q = w.q;
        const uint4 lo = {q.x & LO4, q.y & LO4, q.z & LO4, q.w & LO4};
        const uint4 hi = {(q.x >> 4) & LO4, (q.y >> 4) & LO4, (q.z >> 4) & LO4, (q.w >> 4) & LO4};
        const int s1 = dot_u4(hi, r.a1, dot_u4(lo, r.a0, r.o1));
        const int s2 = dot_u4(hi, r.c1, dot_u4(lo, r.c0, r.o2));
        return w.d * fmaf(r.d1, i2f(s1), r.d2 * i2f(s2));
    }
};

// Split Q8_0, one lane per block: 32 int8 quants in order.
struct PQ8_0 {
    static constexpr int RPW = HF2Q_MP_RPW, GNR = 2, UNROLL = 2;
    struct XR {
        uint4 a0, a1, c0, c1;
        float d1, d2;
    };
    static __device__ __forceinline__ XR load(const XP& x, int b) {
        const float2 d = x.d[b];
        return XR{x.a0[b], x.a1[b], x.c0[b], x.c1[b], d.x, d.y};
    }
    struct WR {
        uint4 q0, q1;
        float d;
    };
    static __device__ __forceinline__ WR ldw(const WRef& w, int row, int b) {
        const i64 blk = (i64)row * (w.cols >> 5) + b;
        const uint4* q = (const uint4*)w.data + 2 * blk;
        return WR{ld_stream_u4(q), ld_stream_u4(q + 1), h2f(((const u16*)w.scales)[blk])};
    }
    static __device__ __forceinline__ float dot(const WR& w, int, const XR& r) {
        const int s1 = dot_u4(w.q1, r.a1, dot_u4(w.q0, r.a0, 0));
        const int s2 = dot_u4(w.q1, r.c1, dot_u4(w.q0, r.c0, 0));
        return w.d * fmaf(r.d1, i2f(s1), r.d2 * i2f(s2));
    }
};

// Re-laid Q4_K (FQ4_KS in quant.cuh), one lane per sub-block as split Q4_0; the min term takes
// the block's sum of activations, d1 * (sum of q1) + d2 * (sum of q2).
struct PQ4_KS {
    static constexpr int RPW = HF2Q_MP_RPW, GNR = 2, UNROLL = 2;
    struct XR {
        uint4 a0, a1, c0, c1;
        float d1, d2, sx;
    };
    static __device__ __forceinline__ XR load(const XP& x, int b) {
        const int4 s = x.s[b];
        const float2 d = x.d[b];
        return XR{x.a0[b], x.a1[b], x.c0[b], x.c1[b], d.x, d.y,
                  fmaf(d.x, i2f(s.x + s.y), d.y * i2f(s.z + s.w))};
    }
    struct WR {
        uint4 q;
        float d, m;
    };
    static __device__ __forceinline__ WR ldw(const WRef& w, int row, int b) {
        WR r;
        r.q = ld_stream_u4((const uint4*)w.data + (i64)row * (w.cols >> 5) + b);
        q4ks_scales(w, row, b, r.d, r.m);
        return r;
    }
    static __device__ __forceinline__ float dot(const WR& w, int, const XR& r) {
        const uint4 q = w.q;
        const uint4 lo = {q.x & LO4, q.y & LO4, q.z & LO4, q.w & LO4};
        const uint4 hi = {(q.x >> 4) & LO4, (q.y >> 4) & LO4, (q.z >> 4) & LO4, (q.w >> 4) & LO4};
        const int s1 = dot_u4(hi, r.a1, dot_u4(lo, r.a0, 0));
        const int s2 = dot_u4(hi, r.c1, dot_u4(lo, r.c0, 0));
        return fmaf(w.d, fmaf(r.d1, i2f(s1), r.d2 * i2f(s2)), -w.m * r.sx);
    }
};

// Re-laid Q6_K (FQ6_KS in quant.cuh), one lane per unit: the 6-bit values as bytes (low nibbles
// and high bits), q - 32 folded into the sums per half, each half with its own scale.
struct PQ6_KS {
    static constexpr int RPW = HF2Q_MP_RPW, GNR = 2, UNROLL = 2;
    struct XR {
        uint4 a0, a1, c0, c1;
        float d1, d2;
        int4 o;  // -32 * the sums of q1 over elements 0..15, 16..31, of q2 likewise
    };
    static __device__ __forceinline__ XR load(const XP& x, int b) {
        const int4 s = x.s[b];
        const float2 d = x.d[b];
        return XR{x.a0[b], x.a1[b], x.c0[b], x.c1[b], d.x, d.y,
                  int4{-32 * s.x, -32 * s.y, -32 * s.z, -32 * s.w}};
    }
    struct WR {
        uint4 q;
        uint2 h;
        u32 s;
    };
    static __device__ __forceinline__ WR ldw(const WRef& w, int row, int b) {
        const i64 blk = (i64)row * (w.cols >> 5) + b;
        return WR{ld_stream_u4((const uint4*)w.data + blk),
                  ld_stream_u2((const uint2*)w.scales + blk),
                  ld_stream_u32((const u32*)w.biases + blk)};
    }
    static __device__ __forceinline__ float dot(const WR& w, int, const XR& r) {
        const uint4 q = w.q;
        const uint4 lo = {q6ks_word(q.x, w.h.x, 0), q6ks_word(q.y, w.h.x, 1),
                          q6ks_word(q.z, w.h.x, 2), q6ks_word(q.w, w.h.x, 3)};
        const uint4 hi = {q6ks_word(q.x >> 4, w.h.y, 0), q6ks_word(q.y >> 4, w.h.y, 1),
                          q6ks_word(q.z >> 4, w.h.y, 2), q6ks_word(q.w >> 4, w.h.y, 3)};
        const float sl = fmaf(r.d1, i2f(dot_u4(lo, r.a0, r.o.x)), r.d2 * i2f(dot_u4(lo, r.c0, r.o.z)));
        const float sh = fmaf(r.d1, i2f(dot_u4(hi, r.a1, r.o.y)), r.d2 * i2f(dot_u4(hi, r.c1, r.o.w)));
        const float sc0 = (float)(i8)(w.s & 0xffu), sc1 = (float)(i8)((w.s >> 8) & 0xffu);
        return h2f((u16)(w.s >> 16)) * fmaf(sc0, sl, sc1 * sh);
    }
};

// Q4_K as stored, DQ4_K's units: unit b is quant bytes 16 (b % 8) .. + 16 of super-block b / 8,
// the low nibbles elements 16 h .. 16 h + 16 of sub-block 2c, the high nibbles the same of
// sub-block 2c + 1 (c = (b / 2) % 4, h = b % 2): half h of x blocks 2c and 2c + 1.
struct PQ4_K {
    // One unit at a time: two units' activations, headers and quants of four rows did not fit
    // in the 128 registers of two resident blocks (measured at four rows per group).
    static constexpr int RPW = HF2Q_MP_RPW, GNR = 2, UNROLL = 1;
    struct XR {
        uint4 xl, xh, cl, ch;
        float dl1, dl2, dh1, dh2;
        float sl, sh;  // the sums of the sixteen activations of each half
    };
    static __device__ __forceinline__ XR load(const XP& x, int b) {
        const int blo = 8 * (b >> 3) + 2 * ((b >> 1) & 3), h = b & 1;
        const uint4* A = h ? x.a1 : x.a0;
        const uint4* C = h ? x.c1 : x.c0;
        const float2 dl = x.d[blo], dh = x.d[blo + 1];
        const int4 sl = x.s[blo], sh = x.s[blo + 1];
        XR r;
        r.xl = A[blo];
        r.xh = A[blo + 1];
        r.cl = C[blo];
        r.ch = C[blo + 1];
        r.dl1 = dl.x;
        r.dl2 = dl.y;
        r.dh1 = dh.x;
        r.dh2 = dh.y;
        r.sl = fmaf(dl.x, i2f(h ? sl.y : sl.x), dl.y * i2f(h ? sl.w : sl.z));
        r.sh = fmaf(dh.x, i2f(h ? sh.y : sh.x), dh.y * i2f(h ? sh.w : sh.z));
        return r;
    }
    using WR = DQ4_K::WR;
    static __device__ __forceinline__ WR ldw(const WRef& w, int row, int b) {
        return DQ4_K::ldw(w, row, b);
    }
    static __device__ __forceinline__ float dot(const WR& w, int b, const XR& r) {
        const int c = (b >> 1) & 3;
        const uint4 q = w.q, h = w.h;
        const uint4 ql = {q.x & LO4, q.y & LO4, q.z & LO4, q.w & LO4};
        const uint4 qh = {(q.x >> 4) & LO4, (q.y >> 4) & LO4, (q.z >> 4) & LO4, (q.w >> 4) & LO4};
        const float xl = fmaf(r.dl1, i2f(dot_u4(ql, r.xl, 0)), r.dl2 * i2f(dot_u4(ql, r.cl, 0)));
        const float xh = fmaf(r.dh1, i2f(dot_u4(qh, r.xh, 0)), r.dh2 * i2f(dot_u4(qh, r.ch, 0)));
        float sc0, m0, sc1, m1;
        scale_min_k4_reg(2 * c, h, sc0, m0);
        scale_min_k4_reg(2 * c + 1, h, sc1, m1);
        const float d = h2f((u16)(h.x & 0xffffu)), dmin = h2f((u16)(h.x >> 16));
        return d * (sc0 * xl + sc1 * xh) - dmin * (m0 * r.sl + m1 * r.sh);
    }
};

// Rows row0 .. row0 + NR (clamped) of NW matrices against the staged row, summed over the warp
// into acc (every lane gets the totals). With `pre`, the first MP_U units' weights were loaded
// before the wait.
template <class F, int NR, int NW>
__device__ __forceinline__ void mp_rows(const WRef& w0, const WRef& w1, const XP& x, int rows,
                                        int row0, float (&acc)[NW][NR],
                                        const typename F::WR (&pre)[MP_U][NW][NR], bool use_pre) {
    const int lane = threadIdx.x & 31, nu = w0.cols >> 5;
    int rr[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) rr[r] = min(row0 + r, rows - 1);
#pragma unroll
    for (int m = 0; m < NW; m++)
#pragma unroll
        for (int r = 0; r < NR; r++) acc[m][r] = 0.0f;
    int u0 = lane;
    if (use_pre) {
#pragma unroll
        for (int k = 0; k < MP_U; k++) {
            const int u = lane + 32 * k;
            if (u < nu) {
                const typename F::XR xr = F::load(x, u);
#pragma unroll
                for (int r = 0; r < NR; r++) {
                    acc[0][r] += F::dot(pre[k][0][r], u, xr);
                    if (NW > 1) acc[NW - 1][r] += F::dot(pre[k][NW - 1][r], u, xr);
                }
            }
        }
        u0 = lane + 32 * MP_U;
    }
#pragma unroll F::UNROLL
    for (int u = u0; u < nu; u += 32) {
        const typename F::XR xr = F::load(x, u);
#pragma unroll
        for (int r = 0; r < NR; r++) {
            acc[0][r] += F::dot(F::ldw(w0, rr[r], u), u, xr);
            if (NW > 1) acc[NW - 1][r] += F::dot(F::ldw(w1, rr[r], u), u, xr);
        }
    }
#pragma unroll
    for (int m = 0; m < NW; m++)
#pragma unroll
        for (int r = 0; r < NR; r++) acc[m][r] = warp_sum(acc[m][r]);
}

template <class F, int NR, int NW>
__device__ __forceinline__ void mp_preload(const WRef& w0, const WRef& w1, int rows, int row0,
                                           typename F::WR (&pre)[MP_U][NW][NR]) {
    const int lane = threadIdx.x & 31, nu = w0.cols >> 5;
#pragma unroll
    for (int k = 0; k < MP_U; k++) {
        const int u = lane + 32 * k;
        if (u < nu) {
#pragma unroll
            for (int r = 0; r < NR; r++) {
                const int row = min(row0 + r, rows - 1);
                pre[k][0][r] = F::ldw(w0, row, u);
                if (NW > 1) pre[k][NW - 1][r] = F::ldw(w1, row, u);
            }
        }
    }
}

// acc[m][lane] without dynamic register indexing.
template <int NR>
__device__ __forceinline__ float mp_pick(const float (&a)[NR], int lane) {
    float s = a[0];
#pragma unroll
    for (int r = 1; r < NR; r++)
        if (lane == r) s = a[r];
    return s;
}

// Row groups of the plain / fused launch: job i's groups are numbered from jobs.j[i].cta0
// (the host sets it to the groups of the jobs before), so a group names its job and first row.
template <int NR>
__device__ __forceinline__ int mp_locate(const MvJobs& jobs, int g, int& ji) {
    ji = 0;
    if (jobs.n > 1 && g >= jobs.j[1].cta0) ji = 1;
    if (jobs.n > 2 && g >= jobs.j[2].cta0) ji = 2;
    return (g - jobs.j[ji].cta0) * NR;
}

template <class F, bool NORM>
__device__ __forceinline__ void mpf_impl(const MvJobs& jobs, const float* __restrict__ x) {
    constexpr int NR = F::RPW;
    const int lane = threadIdx.x & 31;
    const int gw = (int)blockIdx.x * MP_WARPS + (int)(threadIdx.x >> 5);
    const int W = (int)gridDim.x * MP_WARPS;
    const MvJob& last = jobs.j[jobs.n - 1];
    const int G = last.cta0 + (last.rows + NR - 1) / NR;
    typename F::WR pre[MP_U][1][NR];
    if (gw < G) {
        int ji;
        const int row0 = mp_locate<NR>(jobs, gw, ji);
        mp_preload<F, NR, 1>(jobs.j[ji].w, jobs.j[ji].w, jobs.j[ji].rows, row0, pre);
    }
    pdl_wait();
    float scale;
    const XP xp = mp_stage<NORM>(x, jobs.j[0].w.cols, jobs.norm, scale);
    bool first = true;
    for (int g = gw; g < G; g += W) {
        int ji;
        const int row0 = mp_locate<NR>(jobs, g, ji);
        const MvJob& J = jobs.j[ji];
        float acc[1][NR];
        mp_rows<F, NR, 1>(J.w, J.w, xp, J.rows, row0, acc, pre, first);
        first = false;
        const int row = row0 + lane;
        if (lane < NR && row < J.rows) {
            const float s = mp_pick<NR>(acc[0], lane) * scale + (J.bias ? J.bias[row] : 0.0f);
            if (jobs.accumulate)
                J.out[row] += s;
            else
                J.out[row] = s;
        }
    }
}

template <class F, bool NORM>
__device__ __forceinline__ void mpg_impl(const WRef g, const WRef u, const float* __restrict__ x,
                                         float* __restrict__ out, int rows, int act,
                                         const MvNorm& nm) {
    constexpr int NR = F::GNR;
    const int lane = threadIdx.x & 31;
    const int gw = (int)blockIdx.x * MP_WARPS + (int)(threadIdx.x >> 5);
    const int W = (int)gridDim.x * MP_WARPS;
    const int G = (rows + NR - 1) / NR;
    typename F::WR pre[MP_U][2][NR];
    if (gw < G) mp_preload<F, NR, 2>(g, u, rows, gw * NR, pre);
    pdl_wait();
    float scale;
    const XP xp = mp_stage<NORM>(x, g.cols, nm, scale);
    bool first = true;
    for (int grp = gw; grp < G; grp += W) {
        float acc[2][NR];
        mp_rows<F, NR, 2>(g, u, xp, rows, grp * NR, acc, pre, first);
        first = false;
        const int row = grp * NR + lane;
        if (lane < NR && row < rows) {
            const float gs = mp_pick<NR>(acc[0], lane) * scale;
            const float us = mp_pick<NR>(acc[1], lane) * scale;
            out[row] = (act == 0 ? silu_f(gs) : gelu_tanh_f(gs)) * us;
        }
    }
}

// mpf_NAME / mpg_NAME: the arguments of mvf_NAME / mvg_NAME (mpg ignores ks and flags), a grid of
// a few blocks of MP_WARPS warps per multiprocessor and `mp_smem` bytes of dynamic shared memory;
// mpfn_NAME / mpgn_NAME with the input's RMSNorm folded in.
#define HF2Q_MATVEC_P8(NAME, DOT)                                                               \
    extern "C" __global__ void __launch_bounds__(MP_WARPS * 32, 2)                              \
        mpf_##NAME(MvJobs jobs, const float* x) {                                               \
        mpf_impl<DOT, false>(jobs, x);                                                          \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(MP_WARPS * 32, 2)                              \
        mpfn_##NAME(MvJobs jobs, const float* x) {                                              \
        mpf_impl<DOT, true>(jobs, x);                                                           \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(MP_WARPS * 32, 2)                              \
        mpg_##NAME(WRef g, WRef u, const float* x, float* o, int rows, int act, int ks,         \
                   int flags, MvNorm nm) {                                                      \
        mpg_impl<DOT, false>(g, u, x, o, rows, act, nm);                                        \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(MP_WARPS * 32, 2)                              \
        mpgn_##NAME(WRef g, WRef u, const float* x, float* o, int rows, int act, int ks,        \
                    int flags, MvNorm nm) {                                                     \
        mpg_impl<DOT, true>(g, u, x, o, rows, act, nm);                                         \
    }
