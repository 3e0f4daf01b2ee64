// Matrix-vector products for one token, the hot loop of a decode step, for the formats whose
// device layout lets one lane read a whole 32-element block with wide aligned loads:
// Q4_0 and Q8_0 in the split layout made at upload (quant.cuh: all quants of the matrix
// block after block, then all scales), Q4_K as stored and re-laid, Q6_K padded to 224-byte
// super-blocks and re-laid, and dense f16 / bf16 / f32 rows.
//
//   lane <-> unit: lane l of a warp takes units l, l + 32 ks, ... of its rows (a quarter of a
//   32-element block, or a whole 256-element super-block's 32-element share for the k-quants),
//   loads the unit's activations once into registers and dots them with the unit of each of the
//   warp's rows, so every activation load feeds several rows and a warp's loads of weights and
//   of activations are contiguous pieces.
//
// Quants are turned into exact floats with one byte permute and one subtraction (byte_magic),
// then multiplied and added in f32; the block's scale multiplies the block's sum. Each block
// has two accumulator chains (its low and high sixteen elements) for instruction-level
// parallelism. The same kernels fuse what follows a projection in a decode step:
//   * mvf: up to three matrices sharing the input (q, k and v) in one launch; the result is
//     stored, or added to the output (the residual stream) when `accumulate` is set;
//   * mvg: the gate and up projections of a gated MLP, writing act(gate) * up.
// Needs cols % 32 == 0 (the host checks and otherwise uses linear.cuh).
#pragma once
#include "common.cuh"
#include "quant.cuh"

#define MVF_WARPS 4

// Each format is a struct with
//     N: activations per unit of work (one lane's share of a block);
//     load_x(x, u, xr): the N activations that unit u pairs with, into registers;
//     XA prep(xr): per-unit values of those activations shared by every row (sums, for formats
//         with a per-block offset);
//     dot(w, row, u, xr, xa): the dot product of unit u of row `row` with them.
// The 32-element formats use quads (pairs for Q4_0): four lanes per block, lane q of the quad
// taking elements 4q .. 4q + 4 and 16 + 4q .. 16 + 4q + 4 (the low and high nibbles of one
// 4-byte word in ggml's order). A warp's loads of activations and of quants are then contiguous
// pieces (eight blocks per instruction), the block's scale one broadcast load per quad.
// Weight loads that bypass L1 allocation: the weights are read once, and the activations, which
// every row re-reads, should keep the L1 to themselves.
__device__ __forceinline__ u32 ld_stream_u32(const void* p) {
    u32 v;
    asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ uint2 ld_stream_u2(const void* p) {
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
__device__ __forceinline__ uint4 ld_stream_u4(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// Asks the L2 to fetch `bytes` from `p` (the range rounded out to 16 bytes), in 4 KB pieces
// spread over the block's threads (`cp.async.bulk.prefetch`, Hopper's bulk copy engine: one
// instruction per piece, nothing waits for it). The one-token kernels call it for their own
// rows *before* `pdl_wait`: the weights do not depend on the previous kernel, so their stream
// from memory starts while that kernel is still finishing, instead of after it.
__device__ __forceinline__ void prefetch_l2(const void* p, i64 bytes) {
#if __CUDA_ARCH__ >= 900
    const u64 a = (u64)p & ~(u64)15;
    const i64 len = (i64)(((u64)p + (u64)bytes + 15) & ~(u64)15) - (i64)a;
    for (i64 off = (i64)threadIdx.x * 4096; off < len; off += (i64)blockDim.x * 4096) {
        const u32 n = (u32)(len - off < 4096 ? len - off : 4096);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a + off), "r"(n) : "memory");
    }
#endif
}

// Formats whose device layout is split (all quants of the matrix, then all f16 block scales):
// their rows' scales are a second range to prefetch.
template <class F>
struct SplitScales {
    static constexpr bool V = false;
};

// Formats whose one-token kernel prefetches its rows when asked (flag MV_PREFETCH): only the
// f32-activation Q4_K kernel measured faster with it (cuda/NOTES.md); the others are compiled
// without the code, which changed their register allocation for the worse.
template <class F>
struct Prefetch {
    static constexpr bool V = false;
};

// Prefetches rows row0 .. row0 + n (clamped to the matrix) of `w`.
template <class F>
__device__ __forceinline__ void prefetch_rows(const WRef& w, int rows, int row0, int n) {
    n = min(n, rows - row0);
    if (n <= 0) return;
    prefetch_l2(row_ptr(w, row0), w.row_bytes * n);
    if (SplitScales<F>::V) {
        const i64 sb = 2 * (i64)(w.cols >> 5);
        prefetch_l2((const u8*)w.scales + sb * row0, sb * n);
    }
}

struct NoAux {
    struct XA {};
    static __device__ __forceinline__ XA prep(const float* xr) { return XA{}; }
};

// xr[0..4] = p[0..4] (16-byte aligned).
__device__ __forceinline__ void ld4(const float* __restrict__ p, float* xr) {
    const float4 a = *(const float4*)p;
    xr[0] = a.x;
    xr[1] = a.y;
    xr[2] = a.z;
    xr[3] = a.w;
}

// The activations of quad lane u: x[32 b + 4 q .. + 4] and x[32 b + 16 + 4 q .. + 4].
__device__ __forceinline__ void load_x_quad(const float* __restrict__ x, int u, float* xr) {
    const float* p = x + 32 * (u >> 2) + 4 * (u & 3);
    ld4(p, xr);
    ld4(p + 16, xr + 4);
}

struct Quad : NoAux {
    static constexpr int N = 8, RPW = 2, GNR = 2;
    static __device__ __forceinline__ void load_x(const float* __restrict__ x, int u, float* xr) {
        load_x_quad(x, u, xr);
    }
};

// sum_j (byte j of lo - off) * xr[j] + (byte j of hi - off) * xr[4 + j], two chains.
__device__ __forceinline__ float dot_bytes8(u32 lo, u32 hi, float off, const float* xr) {
    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        s0 = fmaf(byte_magic(lo, j) - (MAGIC + off), xr[j], s0);
        s1 = fmaf(byte_magic(hi, j) - (MAGIC + off), xr[4 + j], s1);
    }
    return s0 + s1;
}

// A pair lane's eight bytes of 4-bit quants (split Q4_0's order) dotted with its sixteen
// activations, each quant less `off`: word k of the pair holds elements 8p + 4k .. + 4 (low
// nibbles, xr[4k ..]) and 16 + 8p + 4k .. (high, xr[8 + 4k ..]); two chains.
__device__ __forceinline__ float dot_nibbles8(uint2 q, float off, const float* xr) {
    float s0 = 0.0f, s1 = 0.0f;
    const u32 ws[2] = {q.x, q.y};
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const u32 lo = ws[k] & 0x0F0F0F0Fu, hi = (ws[k] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            s0 = fmaf(byte_magic(lo, j) - (MAGIC + off), xr[4 * k + j], s0);
            s1 = fmaf(byte_magic(hi, j) - (MAGIC + off), xr[8 + 4 * k + j], s1);
        }
    }
    return s0 + s1;
}

// Split Q4_0: quants (16 bytes per block, ggml order: element i in the low nibble of byte i,
// element i + 16 in the high nibble) at data + 16 blk, the f16 scale at scales[blk],
// blk = row * nb + b. Pairs rather than quads: two lanes per block, lane p taking bytes
// 8p .. 8p + 8, i.e. elements 8p .. 8p + 8 and 16 + 8p .. 16 + 8p + 8 (eight bytes per lane and
// load, as the Q8_0 quads read; four bytes per lane measured at half the bandwidth).
struct DQ4_0S : NoAux {
    static constexpr int N = 16, RPW = 2, GNR = 2;
    static __device__ __forceinline__ void load_x(const float* __restrict__ x, int u, float* xr) {
        const float* p = x + 32 * (u >> 1) + 8 * (u & 1);
#pragma unroll
        for (int h = 0; h < 4; h++) ld4(p + 16 * (h >> 1) + 4 * (h & 1), xr + 4 * h);
    }
    struct WR {
        uint2 q;
        float d;
    };
    static __device__ __forceinline__ WR ldw(const WRef& w, int row, int u) {
        const i64 blk = (i64)row * (w.cols >> 5) + (u >> 1);
        return WR{ld_stream_u2((const uint2*)w.data + 2 * blk + (u & 1)),
                  h2f(((const u16*)w.scales)[blk])};
    }
    static __device__ __forceinline__ float dotw(const WR& a, int, const float* xr, XA) {
        return dot_nibbles8(a.q, 8.0f, xr) * a.d;
    }
};

// Split Q8_0: 32 int8 quants in order at data + 32 blk, the f16 scale at scales[blk]. Flipping
// the sign bit maps int8 q to the byte q + 128.
struct DQ8_0S : Quad {
    static constexpr int RPW = 4;
    struct WR {
        u32 lo, hi;
        float d;
    };
    static __device__ __forceinline__ WR ldw(const WRef& w, int row, int u) {
        const i64 blk = (i64)row * (w.cols >> 5) + (u >> 2);
        const u32* q = (const u32*)w.data + 8 * blk + (u & 3);
        return WR{ld_stream_u32(q), ld_stream_u32(q + 4), h2f(((const u16*)w.scales)[blk])};
    }
    static __device__ __forceinline__ float dotw(const WR& a, int, const float* xr, XA) {
        return dot_bytes8(a.lo ^ 0x80808080u, a.hi ^ 0x80808080u, 128.0f, xr) * a.d;
    }
};

// Split MXFP4 ("mxfp4s"): split Q4_0's quants and lanes, the E8M0 scale byte at scales[blk].
// A lane's sixteen codes as doubled E2M1 values (e2m1x4), dotted in two chains, times 2^(e - 128).
struct DMXFP4S : NoAux {
    static constexpr int N = 16, RPW = 2, GNR = 2;
    static __device__ __forceinline__ void load_x(const float* __restrict__ x, int u, float* xr) {
        DQ4_0S::load_x(x, u, xr);
    }
    struct WR {
        uint2 q;
        float d;
    };
    static __device__ __forceinline__ WR ldw(const WRef& w, int row, int u) {
        const i64 blk = (i64)row * (w.cols >> 5) + (u >> 1);
        return WR{ld_stream_u2((const uint2*)w.data + 2 * blk + (u & 1)),
                  e8m0_half(((const u8*)w.scales)[blk])};
    }
    static __device__ __forceinline__ float dotw(const WR& a, int, const float* xr, XA) {
        float s0 = 0.0f, s1 = 0.0f;
        const u32 ws[2] = {a.q.x, a.q.y};
#pragma unroll
        for (int k = 0; k < 2; k++) {
            float lo[4], hi[4];
            e2m1x4(ws[k] & 0x0F0F0F0Fu, lo);
            e2m1x4((ws[k] >> 4) & 0x0F0F0F0Fu, hi);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                s0 = fmaf(lo[j], xr[4 * k + j], s0);
                s1 = fmaf(hi[j], xr[8 + 4 * k + j], s1);
            }
        }
        return (s0 + s1) * a.d;
    }
};

template <>
struct SplitScales<DQ4_0S> {
    static constexpr bool V = true;
};
template <>
struct SplitScales<DQ8_0S> {
    static constexpr bool V = true;
};

// Dense rows of `row_bytes` (16-byte aligned when cols % 32 == 0: the allocation is).
// The dense formats' unit: four elements at 32 (u / 4) + 4 (u % 4) and four 16 further.
struct WR16 {
    uint2 a, c;
};

struct DF16 : Quad {
    using WR = WR16;
    static __device__ __forceinline__ WR ldw(const WRef& w, int row, int u) {
        const u16* p = (const u16*)row_ptr(w, row) + 32 * (u >> 2) + 4 * (u & 3);
        return WR{ld_stream_u2(p), ld_stream_u2(p + 16)};
    }
    static __device__ __forceinline__ float dotw(const WR& wr, int, const float* xr, XA) {
        const uint2 a = wr.a, c = wr.c;
        const u32 ws[4] = {a.x, a.y, c.x, c.y};
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            s0 = fmaf(h2f((u16)(ws[k] & 0xffffu)), xr[2 * k], s0);
            s1 = fmaf(h2f((u16)(ws[k] >> 16)), xr[2 * k + 1], s1);
        }
        return s0 + s1;
    }
};

struct DBF16 : Quad {
    using WR = WR16;
    static __device__ __forceinline__ WR ldw(const WRef& w, int row, int u) {
        const u16* p = (const u16*)row_ptr(w, row) + 32 * (u >> 2) + 4 * (u & 3);
        return WR{*(const uint2*)p, *(const uint2*)(p + 16)};
    }
    static __device__ __forceinline__ float dotw(const WR& wr, int, const float* xr, XA) {
        const uint2 a = wr.a, c = wr.c;
        const u32 ws[4] = {a.x, a.y, c.x, c.y};
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            s0 = fmaf(__uint_as_float(ws[k] << 16), xr[2 * k], s0);
            s1 = fmaf(__uint_as_float(ws[k] & 0xffff0000u), xr[2 * k + 1], s1);
        }
        return s0 + s1;
    }
};

struct DF32 : Quad {
    struct WR {
        float4 a, c;
    };
    static __device__ __forceinline__ WR ldw(const WRef& w, int row, int u) {
        const float* p = (const float*)row_ptr(w, row) + 32 * (u >> 2) + 4 * (u & 3);
        return WR{*(const float4*)p, *(const float4*)(p + 16)};
    }
    static __device__ __forceinline__ float dotw(const WR& wr, int, const float* xr, XA) {
        const float4 a = wr.a, c = wr.c;
        float s0 = a.x * xr[0], s1 = c.x * xr[4];
        s0 = fmaf(a.y, xr[1], s0);
        s1 = fmaf(c.y, xr[5], s1);
        s0 = fmaf(a.z, xr[2], s0);
        s1 = fmaf(c.z, xr[6], s1);
        s0 = fmaf(a.w, xr[3], s0);
        s1 = fmaf(c.w, xr[7], s1);
        return s0 + s1;
    }
};

// Q4_K as stored ({ half d; half dmin; u8 scales[12]; u8 qs[128]; }, 144 bytes, so every
// super-block and its quants are 16-byte aligned). x = d sc q - dmin m per 32-element
// sub-block, so a unit's dot is d sc sum(q x) - dmin m sum(x): the sums of x are shared by all
// rows.
__device__ __forceinline__ u32 byte12(uint4 h, int k) {  // byte k of the 12 scale bytes
    const u32 w = k < 4 ? h.y : (k < 8 ? h.z : h.w);
    return (w >> (8 * (k & 3))) & 0xffu;
}
__device__ __forceinline__ void scale_min_k4_reg(int j, uint4 h, float& sc, float& m) {
    if (j < 4) {
        sc = (float)(byte12(h, j) & 63u);
        m = (float)(byte12(h, j + 4) & 63u);
    } else {
        sc = (float)((byte12(h, j + 4) & 15u) | ((byte12(h, j - 4) >> 6) << 4));
        m = (float)((byte12(h, j + 4) >> 4) | ((byte12(h, j) >> 6) << 4));
    }
}

struct DQ4_K {
    static constexpr int N = 32, RPW = 4, GNR = 2;
    struct XA {
        float lo, hi;
    };
    // Unit b: super-block b / 8, quant bytes 16 (b % 8) .. + 16 of its 128, i.e. sixteen
    // elements of sub-block 2c (low nibbles) and the same sixteen of sub-block 2c + 1 (high
    // nibbles), c = (b % 8) / 2. (Quads over this layout measured slower: each lane then decodes
    // two 6-bit scales per eight weights.)
    static __device__ __forceinline__ void load_x(const float* __restrict__ x, int b, float* xr) {
        const float* p = x + 256 * (b >> 3) + 64 * ((b >> 1) & 3) + 16 * (b & 1);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            ld4(p + 4 * i, xr + 4 * i);
            ld4(p + 32 + 4 * i, xr + 16 + 4 * i);
        }
    }
    static __device__ __forceinline__ XA prep(const float* xr) {
        XA a = {0.0f, 0.0f};
#pragma unroll
        for (int i = 0; i < 16; i++) {
            a.lo += xr[i];
            a.hi += xr[16 + i];
        }
        return a;
    }
    struct WR {
        uint4 h, q;  // the super-block's header (d, dmin, scales) and the unit's quants
    };
    static __device__ __forceinline__ WR ldw(const WRef& w, int row, int b) {
        const u8* sb = row_ptr(w, row) + 144 * (b >> 3);
        return WR{*(const uint4*)sb, *(const uint4*)(sb + 16 + 32 * ((b >> 1) & 3) + 16 * (b & 1))};
    }
    static __device__ __forceinline__ float dotw(const WR& wr, int b, const float* xr, XA xa) {
        const int c = (b >> 1) & 3;
        const uint4 h = wr.h, q = wr.q;
        const u32 ws[4] = {q.x, q.y, q.z, q.w};
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const u32 lo = ws[k] & 0x0F0F0F0Fu, hi = (ws[k] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                s0 = fmaf(byte_magic(lo, j) - MAGIC, xr[4 * k + j], s0);
                s1 = fmaf(byte_magic(hi, j) - MAGIC, xr[16 + 4 * k + j], s1);
            }
        }
        float sc0, m0, sc1, m1;
        scale_min_k4_reg(2 * c, h, sc0, m0);
        scale_min_k4_reg(2 * c + 1, h, sc1, m1);
        const float d = h2f((u16)(h.x & 0xffffu)), dmin = h2f((u16)(h.x >> 16));
        return d * (sc0 * s0 + sc1 * s1) - dmin * (m0 * xa.lo + m1 * xa.hi);
    }
};

template <>
struct Prefetch<DQ4_K> {
    static constexpr bool V = true;
};

// Re-laid Q4_K (FQ4_KS in quant.cuh), pairs as split Q4_0: lane p of a sub-block's pair takes
// bytes 8p .. 8p + 8, elements 8p .. 8p + 8 and 16 + 8p .. 16 + 8p + 8. The min term uses the
// sum of the lane's sixteen activations (XA), shared by the rows.
struct DQ4_KS {
    static constexpr int N = 16, RPW = 2, GNR = 2;
    struct XA {
        float s;
    };
    static __device__ __forceinline__ void load_x(const float* __restrict__ x, int u, float* xr) {
        DQ4_0S::load_x(x, u, xr);
    }
    static __device__ __forceinline__ XA prep(const float* xr) {
        float a = 0.0f, b = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            a += xr[i];
            b += xr[8 + i];
        }
        return XA{a + b};
    }
    struct WR {
        uint2 q;
        float d, m;
    };
    static __device__ __forceinline__ WR ldw(const WRef& w, int row, int u) {
        const i64 blk = (i64)row * (w.cols >> 5) + (u >> 1);
        WR r;
        r.q = ld_stream_u2((const uint2*)w.data + 2 * blk + (u & 1));
        q4ks_scales(w, row, u >> 1, r.d, r.m);
        return r;
    }
    static __device__ __forceinline__ float dotw(const WR& a, int, const float* xr, XA xa) {
        return fmaf(dot_nibbles8(a.q, 0.0f, xr), a.d, -a.m * xa.s);
    }
};

// Q6_K padded at upload to 224-byte super-blocks (the 210 stored bytes, then zeros: weight.rs)
// so that its pieces are 8-byte aligned: ql[128] at 0, qh[64] at 128, scales[16] at 192, d at
// 208. Lane-block b: super-block b / 8, half n = (b / 4) % 2, the eight columns l0 = 8 (b % 4)
// .. + 8 of all four quarters (element 128 n + 32 quarter + l), i.e. one 8-byte piece of each
// ql row and of qh. x = d sc q - 32 d sc.
struct DQ6_KP {
    static constexpr int N = 32, RPW = 2, GNR = 1;
    struct XA {};
    static __device__ __forceinline__ void load_x(const float* __restrict__ x, int b, float* xr) {
        const float* p = x + 256 * (b >> 3) + 128 * ((b >> 2) & 1) + 8 * (b & 3);
#pragma unroll
        for (int h = 0; h < 8; h++) ld4(p + 32 * (h >> 1) + 4 * (h & 1), xr + 4 * h);
    }
    static __device__ __forceinline__ XA prep(const float* xr) { return XA{}; }
    struct WR {
        uint2 qa, qb, qh, sc;
        float d;
    };
    static __device__ __forceinline__ WR ldw(const WRef& w, int row, int b) {
        const u8* sb = row_ptr(w, row) + 224 * (b >> 3);
        const int n = (b >> 2) & 1, l0 = 8 * (b & 3);
        return WR{*(const uint2*)(sb + 64 * n + l0),        // quarters 0 (lo), 2 (hi)
                  *(const uint2*)(sb + 64 * n + 32 + l0),   // quarters 1 (lo), 3 (hi)
                  *(const uint2*)(sb + 128 + 32 * n + l0),  // their high bits
                  *(const uint2*)(sb + 192 + 8 * n),        // the half's scales
                  h2f(*(const u16*)(sb + 208))};
    }
    static __device__ __forceinline__ float dotw(const WR& wr, int b, const float* xr, XA) {
        const int l0 = 8 * (b & 3);
        const uint2 qa = wr.qa, qb = wr.qb, qh = wr.qh, sc = wr.sc;
        const float d = wr.d;
        const int sb16 = l0 >> 4;  // which of the two 16-column scale groups
        float tot = 0.0f;
#pragma unroll
        for (int qq = 0; qq < 4; qq++) {
            const uint2 ql = (qq & 1) ? qb : qa;
            const int sh = 4 * (qq >> 1);
            const u32 n0 = ((ql.x >> sh) & 0x0F0F0F0Fu) | (((qh.x >> (2 * qq)) & 0x03030303u) << 4);
            const u32 n1 = ((ql.y >> sh) & 0x0F0F0F0Fu) | (((qh.y >> (2 * qq)) & 0x03030303u) << 4);
            float s = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                s = fmaf(byte_magic(n0, j) - (MAGIC + 32.0f), xr[8 * qq + j], s);
                s = fmaf(byte_magic(n1, j) - (MAGIC + 32.0f), xr[8 * qq + 4 + j], s);
            }
            const int k = sb16 + 2 * qq;  // scale index within sc[8n .. 8n + 8]
            const u32 word = k < 4 ? sc.x : sc.y;
            const float scale = (float)(i8)((word >> (8 * (k & 3))) & 0xffu);
            tot = fmaf(scale, s, tot);
        }
        return d * tot;
    }
};

// Re-laid Q6_K (FQ6_KS in quant.cuh), pairs as split Q4_0: lane p of a unit takes quant bytes
// 8p .. 8p + 8 (words 2p, 2p + 1 of each half: elements 8p .. 8p + 8 and 16 + 8p ..
// 16 + 8p + 8) with the unit's high bits and scales.
struct DQ6_KS : NoAux {
    static constexpr int N = 16, RPW = 2, GNR = 2;
    static __device__ __forceinline__ void load_x(const float* __restrict__ x, int u, float* xr) {
        DQ4_0S::load_x(x, u, xr);
    }
    struct WR {
        uint2 q, h;
        u32 s;
    };
    static __device__ __forceinline__ WR ldw(const WRef& w, int row, int u) {
        const i64 blk = (i64)row * (w.cols >> 5) + (u >> 1);
        return WR{ld_stream_u2((const uint2*)w.data + 2 * blk + (u & 1)),
                  ld_stream_u2((const uint2*)w.scales + blk),
                  ld_stream_u32((const u32*)w.biases + blk)};
    }
    static __device__ __forceinline__ float dotw(const WR& a, int u, const float* xr, XA) {
        const int k0 = 2 * (u & 1);
        const u32 ws[2] = {a.q.x, a.q.y};
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const u32 lo = q6ks_word(ws[k], a.h.x, k0 + k);
            const u32 hi = q6ks_word(ws[k] >> 4, a.h.y, k0 + k);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                s0 = fmaf(byte_magic(lo, j) - (MAGIC + 32.0f), xr[4 * k + j], s0);
                s1 = fmaf(byte_magic(hi, j) - (MAGIC + 32.0f), xr[8 + 4 * k + j], s1);
            }
        }
        const float d = h2f((u16)(a.s >> 16));
        const float sc0 = (float)(i8)(a.s & 0xffu), sc1 = (float)(i8)((a.s >> 8) & 0xffu);
        return d * fmaf(sc0, s0, sc1 * s1);
    }
};

// One matrix of a fused launch; mirrors `MvJob` on the host (#[repr(C)], same order).
struct MvJob {
    WRef w;
    const float* bias;  // may be null
    float* out;
    i32 rows;
    i32 cta0;  // first block (CTA) of this job in the grid
    i32 ks;    // warps sharing one row group (splitting its blocks)
    i32 pad;
};

// The RMSNorm of the input folded into a product (the persistent kernels' `*n_` forms,
// matvec_p8.cuh): the product of W with n(x) = x / rms(x) * (w + offset) is
// (W · (x * (w + offset))) / rms(x), so the staging of x scales it by the norm's weights and sums
// its squares, and the totals are divided by rms(x) = sqrt(sum / cols + eps) at the end (the
// RMSNorm kernel's formula). Mirrors `MvNorm` on the host.
struct MvNorm {
    const float* w;  // cols values
    float eps, offset;
};

struct MvJobs {
    MvJob j[3];
    i32 n;
    i32 accumulate;  // out += result instead of out = result
    i32 flags;       // MV_PREFETCH
    i32 pad;
    MvNorm norm;  // read by the `*n_` kernels only
};

// 1 / rms(x) from a sum of squares over its `cols` values.
__device__ __forceinline__ float inv_rms(float ss, int cols, float eps) {
    return 1.0f / sqrtf(ss / (float)cols + eps);
}

// Flag bits of the one-token kernels.
#define MV_PREFETCH 1  // prefetch this block's weight rows to L2 before waiting (prefetch_l2)

// Whether the one-token kernels load their first weights before waiting for the previous kernel
// (`mvf_rows`); the `mv-early=off` option compiles them without (for measurements).
#ifndef HF2Q_MV_EARLY
#define HF2Q_MV_EARLY 1
#endif

// The warps of a CTA form MVF_WARPS / ks row groups of ks warps; a group's warps split the
// units of its NR rows, their sums meet in shared memory. NW matrices (1, or 2 for gate and up)
// are read at the same rows. Waits for the previous kernel (`pdl_wait`) itself: the weights do
// not depend on it, so each lane's first U units of weights are loaded into registers before
// the wait and arrive while that kernel finishes (for the small products of a 1B model, U
// units are all a lane has: the whole matrix is then read during the previous kernel).
template <class F, int NR, int NW>
__device__ __forceinline__ void mvf_rows(const WRef& w0, const WRef& w1,
                                         const float* __restrict__ x, int rows, int row0,
                                         int ks, float (*red)[MVF_WARPS][4]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, kpart = warp % ks;
    const bool active = row0 < rows;
    int rr[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) rr[r] = min(row0 + r, rows - 1);  // edge rows not written
    float acc[NW][NR];
#pragma unroll
    for (int m = 0; m < NW; m++)
#pragma unroll
        for (int r = 0; r < NR; r++) acc[m][r] = 0.0f;
    // Units of F::N activations per row; lane l of warp k takes units l + 32 k, + 32 ks, ...
    // Unrolled so that several units' loads are in flight: four for the small units, two for
    // the 32-element ones (registers).
    constexpr int U = F::N <= 16 ? 4 : 2;
    const int nu = w0.cols / F::N, S = 32 * ks, u0 = lane + 32 * kpart;
    auto step = [&](int u) {
        float xr[F::N];
        F::load_x(x, u, xr);
        const typename F::XA xa = F::prep(xr);
#pragma unroll
        for (int r = 0; r < NR; r++) {
            acc[0][r] += F::dotw(F::ldw(w0, rr[r], u), u, xr, xa);
            if (NW > 1) acc[NW - 1][r] += F::dotw(F::ldw(w1, rr[r], u), u, xr, xa);
        }
    };
    int ub = u0;
#if HF2Q_MV_EARLY
    typename F::WR pre[U][NW][NR];
    if (active) {
#pragma unroll
        for (int k = 0; k < U; k++) {
            const int u = u0 + k * S;
            if (u < nu) {
#pragma unroll
                for (int r = 0; r < NR; r++) {
                    pre[k][0][r] = F::ldw(w0, rr[r], u);
                    if (NW > 1) pre[k][NW - 1][r] = F::ldw(w1, rr[r], u);
                }
            }
        }
    }
    pdl_wait();
    if (!active) return;
#pragma unroll
    for (int k = 0; k < U; k++) {
        const int u = u0 + k * S;
        if (u < nu) {
            float xr[F::N];
            F::load_x(x, u, xr);
            const typename F::XA xa = F::prep(xr);
#pragma unroll
            for (int r = 0; r < NR; r++) {
                acc[0][r] += F::dotw(pre[k][0][r], u, xr, xa);
                if (NW > 1) acc[NW - 1][r] += F::dotw(pre[k][NW - 1][r], u, xr, xa);
            }
        }
    }
    ub = u0 + U * S;
#else
    pdl_wait();
    if (!active) return;
#endif
#pragma unroll U
    for (int u = ub; u < nu; u += S) step(u);
#pragma unroll
    for (int m = 0; m < NW; m++)
#pragma unroll
        for (int r = 0; r < NR; r++) {
            const float s = warp_sum(acc[m][r]);
            if (lane == 0) red[m][warp][r] = s;
        }
}

// Sum of the ks partial sums of row r of matrix m (fixed order).
__device__ __forceinline__ float mvf_total(float (*red)[MVF_WARPS][4], int m, int warp, int ks,
                                           int r) {
    float s = 0.0f;
    for (int k = 0; k < ks; k++) s += red[m][warp + k][r];
    return s;
}

// Rows per row group: each activation load feeds RPW rows of the plain kernel and GNR rows of
// each matrix of the gated one (the activations' traffic through L1 limited Q4_0 at two rows
// of one matrix: ~70% of L1 throughput, ~20% of DRAM's). Chosen per format by measurement
// (cuda/NOTES.md); the host mirrors them (`mvf_rows_per_group` in ops.rs).
template <class F>
struct Rpw {
    static constexpr int V = F::RPW;
};

// Where a warp of a fused one-token launch works: its job (the block's), the row group's first
// row, and its part of the group's units. Shared by the f32 and the 8-bit kernels.
struct MvPlace {
    int ji, ks, warp, lane, kpart, cta_row0, row0;
};

template <int RPW>
__device__ __forceinline__ MvPlace mv_place(const MvJobs& jobs) {
    MvPlace p;
    p.ji = 0;
    if (jobs.n > 1 && (int)blockIdx.x >= jobs.j[1].cta0) p.ji = 1;
    if (jobs.n > 2 && (int)blockIdx.x >= jobs.j[2].cta0) p.ji = 2;
    const MvJob& J = jobs.j[p.ji];
    p.ks = J.ks;
    p.warp = threadIdx.x >> 5;
    p.lane = threadIdx.x & 31;
    p.kpart = p.warp % p.ks;
    p.cta_row0 = ((int)blockIdx.x - J.cta0) * (MVF_WARPS / p.ks) * RPW;
    p.row0 = p.cta_row0 + (p.warp / p.ks) * RPW;
    return p;
}

// The gated kernels' place: one job, blocks in row order.
template <int NR>
__device__ __forceinline__ MvPlace mg_place(int ks) {
    MvPlace p;
    p.ji = 0;
    p.ks = ks;
    p.warp = threadIdx.x >> 5;
    p.lane = threadIdx.x & 31;
    p.kpart = p.warp % ks;
    p.cta_row0 = (int)blockIdx.x * (MVF_WARPS / ks) * NR;
    p.row0 = p.cta_row0 + (p.warp / ks) * NR;
    return p;
}

// The last step of the plain / fused kernels: the first warp of each row group stores (or adds
// to the output) its rows' totals.
template <int RPW>
__device__ __forceinline__ void mv_store(const MvJobs& jobs, const MvJob& J, const MvPlace& p,
                                         float (*red)[MVF_WARPS][4]) {
    if (p.kpart == 0 && p.row0 < J.rows && p.lane < RPW) {
        const int row = p.row0 + p.lane;
        if (row < J.rows) {
            const float s =
                mvf_total(red, 0, p.warp, p.ks, p.lane) + (J.bias ? J.bias[row] : 0.0f);
            if (jobs.accumulate)
                J.out[row] += s;
            else
                J.out[row] = s;
        }
    }
}

// The last step of the gated kernels: out = act(gate total) * up total.
template <int NR>
__device__ __forceinline__ void mg_store(float* __restrict__ out, int rows, int act,
                                         const MvPlace& p, float (*red)[MVF_WARPS][4]) {
    if (p.kpart == 0 && p.row0 < rows && p.lane < NR && p.row0 + p.lane < rows) {
        const float gs = mvf_total(red, 0, p.warp, p.ks, p.lane);
        const float us = mvf_total(red, 1, p.warp, p.ks, p.lane);
        out[p.row0 + p.lane] = (act == 0 ? silu_f(gs) : gelu_tanh_f(gs)) * us;
    }
}

template <class F>
__device__ __forceinline__ void mvf_impl(const MvJobs& jobs, const float* __restrict__ x) {
    constexpr int RPW = Rpw<F>::V;
    __shared__ float red[1][MVF_WARPS][4];
    const MvPlace p = mv_place<RPW>(jobs);
    const MvJob& J = jobs.j[p.ji];
    if (Prefetch<F>::V && (jobs.flags & MV_PREFETCH))
        prefetch_rows<F>(J.w, J.rows, p.cta_row0, (MVF_WARPS / p.ks) * RPW);
    mvf_rows<F, RPW, 1>(J.w, J.w, x, J.rows, p.row0, p.ks, red);
    __syncthreads();
    mv_store<RPW>(jobs, J, p, red);
}

// out[r] = act(gate[r] . x) * (up[r] . x); act 0 = SiLU, 1 = GELU (tanh).
template <class F>
__device__ __forceinline__ void mvg_impl(const WRef g, const WRef u, const float* __restrict__ x,
                                         float* __restrict__ out, int rows, int act, int ks,
                                         int flags) {
    constexpr int NR = F::GNR;
    __shared__ float red[2][MVF_WARPS][4];
    const MvPlace p = mg_place<NR>(ks);
    if (Prefetch<F>::V && (flags & MV_PREFETCH)) {
        prefetch_rows<F>(g, rows, p.cta_row0, (MVF_WARPS / ks) * NR);
        prefetch_rows<F>(u, rows, p.cta_row0, (MVF_WARPS / ks) * NR);
    }
    mvf_rows<F, NR, 2>(g, u, x, rows, p.row0, ks, red);
    __syncthreads();
    mg_store<NR>(out, rows, act, p, red);
}

// Launch bounds of the kernels below: `MV_BOUNDS(N)` asks the compiler for at least N resident
// blocks per multiprocessor, 0 for none. A family's N is `HF2Q_MV_MINB_<FAMILY>` (set per family
// where the kernels are instantiated; the `mv-min-blocks=family:N` option overrides it, a
// measurement switch). Naming a minimum changes the compiler's register choice even where it does
// not bind (a minimum of 1 took Q8_0 from 72 registers to 104), so 0 names none. Q8_0 takes 8:
// its early loads had taken it to 72 registers, seven blocks of 128 threads per multiprocessor,
// and the products that `mv_split` gives 1024 blocks ran a second wave (cuda/NOTES.md).
#define MV_BOUNDS(n) MV_BOUNDS_SEL_(n)
#define MV_BOUNDS_SEL_(n) MV_BOUNDS_##n
#define MV_BOUNDS_0 __launch_bounds__(MVF_WARPS * 32)
#define MV_BOUNDS_4 __launch_bounds__(MVF_WARPS * 32, 4)
#define MV_BOUNDS_5 __launch_bounds__(MVF_WARPS * 32, 5)
#define MV_BOUNDS_6 __launch_bounds__(MVF_WARPS * 32, 6)
#define MV_BOUNDS_7 __launch_bounds__(MVF_WARPS * 32, 7)
#define MV_BOUNDS_8 __launch_bounds__(MVF_WARPS * 32, 8)
#define MV_BOUNDS_9 __launch_bounds__(MVF_WARPS * 32, 9)
#define MV_BOUNDS_10 __launch_bounds__(MVF_WARPS * 32, 10)

// Each kernel waits for its predecessor (`pdl_wait`) inside `mvf_rows`, after its first weight
// loads. The gated kernels take the persistent ones' arguments (`nm` is not read here: the norm
// is folded only where the whole row is staged per block, matvec_p8.cuh).
#define HF2Q_MATVEC_FAST(NAME, DOT, MINB)                                                       \
    extern "C" __global__ void MV_BOUNDS(MINB)                                                  \
        mvf_##NAME(MvJobs jobs, const float* x) {                                               \
        mvf_impl<DOT>(jobs, x);                                                                 \
    }                                                                                           \
    extern "C" __global__ void MV_BOUNDS(MINB)                                                  \
        mvg_##NAME(WRef g, WRef u, const float* x, float* o, int rows, int act, int ks,         \
                   int flags, MvNorm nm) {                                                      \
        mvg_impl<DOT>(g, u, x, o, rows, act, ks, flags);                                        \
    }
