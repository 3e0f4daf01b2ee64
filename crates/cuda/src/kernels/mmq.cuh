// Prefill products with 8-bit integer tensor cores: out (T, R) = x (T, C) · Wᵀ, for the weight
// formats with `codes8` (quant.cuh). Dense products: selected by PrefillGemm::Int8 (mmq.rs), not
// the default. Expert products (`mmqi_*`, the same tiles over expert-ordered pairs): the
// default for prefill batches of routed layers (backend_moe.rs).
//
// The activations arrive quantized by `quantize_split16` (elementwise.cu) as the CPU fast path
// quantizes them (cpu/kernels/q8act.rs, two 8-bit parts per value: x ~ dx (q + l / 256) per 32
// elements), and the weights are decoded to their signed 8-bit codes with, per group, a scale a
// and an offset c (value = a code + c). Per 32 elements of K, the tensor cores form the exact
// integer sums S1 = Σ code q and S2 = Σ code l (mma.sync m16n8k32, or two m16n8k16 where a
// changes every 16 elements), and the f32 sum gains a dx / 256 (256 S1 + S2) + c sx, with sx =
// dx Σq + dx / 256 Σl. Neither operand is rounded to f16 (one f16 pass through cuBLAS moves each
// product by up to 2^-10 of itself): the only rounding is the activations' 16-bit one (at most
// max|x_block| / 65024 per element, / 32512 where the second part's code is clamped), then f32
// sums, the accuracy of the one-token 8-bit kernels.
//
// Tiles: 128 weight rows x 64 tokens per block of eight warps (4 x 2, 32 x 32 each), K in
// stages of 64 staged in shared memory (codes, and per row and 16 elements the scale, per 32
// the offset; per token and 32 elements dx / 256 and sx), two stage buffers so that the next
// stage is written while this one is multiplied (one barrier per stage). Rows are padded to 80
// bytes so that the eight rows of a fragment load fall in different banks.
//
// Speed: about 80 TFLOP/s at 4096 x 4096 x 512 (Q4_K 0.233 ms, Q8_0 0.214), against cuBLAS's
// 380 on f16 operands. The per-32 scaling (five or six float operations per output and 32
// elements of K, next to two integer mma) bounds it near 240; the rest is stalls (Nsight
// Compute: issue slots 37 % busy, two warps per scheduler, the largest stall on global loads;
// asynchronous activation copies and an L1 prefetch of the next stage's weights did not help).
// cuda/NOTES.md has the measurements and what would close the gap.
#pragma once
#include "quant.cuh"

#define MQ_BM 128
#define MQ_BN 64
#define MQ_KT 64
#define MQ_PITCH (MQ_KT + 16)

// d += a · b, A 16 x 32 (row), B 32 x 8 (col), signed bytes, int32 sums.
__device__ __forceinline__ void mma_s8_k32(int* d, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += a · b, A 16 x 16, B 16 x 8.
__device__ __forceinline__ void mma_s8_k16(int* d, u32 a0, u32 a1, u32 b) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(b));
}

// One K stage in shared memory (two of them: 48 KB, the static limit).
struct MmqStage {
    u8 wq[MQ_BM][MQ_PITCH];         // weight codes
    u8 xq[2][MQ_BN][MQ_PITCH];      // activation parts q and l
    float wa[MQ_BM][MQ_KT / 16];    // weight scale per 16 elements
    float wc[MQ_BM][MQ_KT / 32];    // weight offset per 32
    float2 xs[MQ_BN][MQ_KT / 32];   // dx / 256 and sx per token and 32
};

// The integer sums start at the bits of the float 1.5 * 2^23 (`i2f` in common.cuh), so the
// tensor cores leave the float 1.5 * 2^23 + S (exact: |S| <= 32 * 128 * 127 < 2^22).
#define MQ_MAGIC 0x4B400000
#define MQ_M 12582912.0f

// 256 S1 + S2 from two sums started at MQ_MAGIC: 256 (F1 - M) is exact in one multiply-add, so
// the only rounding is the final sum's, as for 256 S1 + S2 computed from exact floats.
__device__ __forceinline__ float join_parts(int d1, int d2) {
    return fmaf(__int_as_float(d1), 256.0f, -256.0f * MQ_M) + (__int_as_float(d2) - MQ_M);
}

// Which activation row each of a block's tokens reads and which output row it writes. The dense
// product: token n of T reads and writes row n. Experts (`perm` set): the block's tokens are
// expert-ordered pairs start + n of one expert (perm, from moe_sort), pair p reading row
// p / div (div = k: a token's activations serve its k pairs; 1: each pair has its own) and
// writing row p. Tokens at or past `count` are padding.
struct MmqTokens {
    const int* perm;
    int start, count, div;
    __device__ __forceinline__ int out_row(int n) const { return perm ? perm[start + n] : n; }
    __device__ __forceinline__ int in_row(int n) const {
        return n < count ? out_row(n) / div : -1;
    }
};

// Stage k0 (K elements k0 .. k0 + 32 steps) of the block's weights and activations into st.
// Weight rows w0 + r0 .. (of `rows`, clamped to the last); xa: the activation row this thread
// copies (token tid / 4 of the block), xr: the row of its scales (token tid / 2, threads below
// 128); -1 for padding.
template <class F>
__device__ __forceinline__ void mmq_load(const WRef& w, const i8* __restrict__ xq,
                                         const float2* __restrict__ xs, MmqStage& st, int w0,
                                         int rows, int r0, int xa, int xr, int k0, int steps,
                                         i64 part) {
    const int tid = threadIdx.x, C = w.cols;
    // Weights: 128 rows x 8 groups of eight, 8 threads per row.
#pragma unroll
    for (int i = 0; i < MQ_BM * MQ_KT / 8 / 256; i++) {
        const int idx = tid + 256 * i, r = idx >> 3, gi = idx & 7;
        const int row = w0 + min(r0 + r, rows - 1);
        u32 c0 = 0, c1 = 0;
        float a = 0.0f, c = 0.0f;
        if (gi < 4 * steps) F::codes8(w, row_ptr(w, row), row, (k0 >> 3) + gi, c0, c1, a, c);
        *(uint2*)&st.wq[r][gi * 8] = make_uint2(c0, c1);
        if ((gi & 1) == 0) st.wa[r][gi >> 1] = a;
        if (F::MMQ_OFFSET && (gi & 3) == 0) st.wc[r][gi >> 2] = c;
    }
    // Activations: 2 parts x 64 tokens x 4 pieces of 16 bytes; part pt by the pt-th pass, token
    // tid / 4, piece tid % 4.
    const int n = tid >> 2, pc = tid & 3;
#pragma unroll
    for (int pt = 0; pt < 2; pt++) {
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (xa >= 0 && pc < 2 * steps)
            v = *(const uint4*)(xq + pt * part + (i64)xa * C + k0 + 16 * pc);
        *(uint4*)&st.xq[pt][n][16 * pc] = v;
    }
    if (tid < MQ_BN * MQ_KT / 32) {
        const int j = tid & 1;
        float2 v = make_float2(0.0f, 0.0f);
        if (xr >= 0 && j < steps) {
            v = xs[(i64)xr * (C >> 5) + (k0 >> 5) + j];
            v.x *= 0.00390625f;  // dx / 256: the unit of 256 S1 + S2
        }
        st.xs[tid >> 1][j] = v;
    }
}

// One 32-element step j of a stage into the warp's 32 x 32 outputs.
template <class F>
__device__ __forceinline__ void mmq_step(const MmqStage& st, int j, int wm, int wn, int g,
                                         int t4, float (&acc)[2][4][4]) {
    const int kk = 32 * j + 4 * t4;
    u32 a[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
        const int r = wm * 32 + mt * 16 + g;
        a[mt][0] = *(const u32*)&st.wq[r][kk];
        a[mt][1] = *(const u32*)&st.wq[r + 8][kk];
        a[mt][2] = *(const u32*)&st.wq[r][kk + 16];
        a[mt][3] = *(const u32*)&st.wq[r + 8][kk + 16];
    }
    float av[2][2][2], cv[2][2];  // [mt][h] (and [half] of the 32 for the scale)
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = wm * 32 + mt * 16 + g + 8 * h;
            av[mt][h][0] = st.wa[r][2 * j];
            av[mt][h][1] = st.wa[r][2 * j + 1];
            cv[mt][h] = F::MMQ_OFFSET ? st.wc[r][j] : 0.0f;
        }
#pragma unroll
    for (int nt = 0; nt < 4; nt++) {
        const int n = wn * 32 + nt * 8 + g;
        const u32 q0 = *(const u32*)&st.xq[0][n][kk], q1 = *(const u32*)&st.xq[0][n][kk + 16];
        const u32 l0 = *(const u32*)&st.xq[1][n][kk], l1 = *(const u32*)&st.xq[1][n][kk + 16];
        const int nn = wn * 32 + nt * 8 + 2 * t4;
        const float2 x0 = st.xs[nn][j], x1 = st.xs[nn + 1][j];
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
            float* o = acc[mt][nt];
            int d1[4] = {MQ_MAGIC, MQ_MAGIC, MQ_MAGIC, MQ_MAGIC};
            int d2[4] = {MQ_MAGIC, MQ_MAGIC, MQ_MAGIC, MQ_MAGIC};
            if (F::MMQ_GROUP == 32) {
                mma_s8_k32(d1, a[mt], q0, q1);
                mma_s8_k32(d2, a[mt], l0, l1);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float2 xv = (e & 1) ? x1 : x0;
                    o[e] = fmaf(av[mt][e >> 1][0] * xv.x, join_parts(d1[e], d2[e]), o[e]);
                    if (F::MMQ_OFFSET) o[e] = fmaf(cv[mt][e >> 1], xv.y, o[e]);
                }
            } else {
                int e1[4] = {MQ_MAGIC, MQ_MAGIC, MQ_MAGIC, MQ_MAGIC};
                int e2[4] = {MQ_MAGIC, MQ_MAGIC, MQ_MAGIC, MQ_MAGIC};
                mma_s8_k16(d1, a[mt][0], a[mt][1], q0);
                mma_s8_k16(d2, a[mt][0], a[mt][1], l0);
                mma_s8_k16(e1, a[mt][2], a[mt][3], q1);
                mma_s8_k16(e2, a[mt][2], a[mt][3], l1);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float2 xv = (e & 1) ? x1 : x0;
                    const float v = fmaf(av[mt][e >> 1][0], join_parts(d1[e], d2[e]),
                                         av[mt][e >> 1][1] * join_parts(e1[e], e2[e]));
                    o[e] = fmaf(xv.x, v, o[e]);
                    if (F::MMQ_OFFSET) o[e] = fmaf(cv[mt][e >> 1], xv.y, o[e]);
                }
            }
        }
    }
}

// xq: the T first parts (T x C bytes) then the T second parts; xs: (T, C / 32) pairs {dx, sx}.
// Output rows of `rows` values from weight rows w0 .., tokens n0 .. of `tk`, each output times
// scale[output row] where scale is set. Eight warps, 4 along the rows and 2 along the tokens.
// Two stage buffers: each stage is loaded into one while the other is multiplied, one barrier
// per stage.
template <class F>
__device__ __forceinline__ void mmq_impl(const WRef w, const i8* __restrict__ xq,
                                         const float2* __restrict__ xs,
                                         const float* __restrict__ bias, float* __restrict__ out,
                                         int rows, int T, const MmqTokens tk, int w0, int n0,
                                         const float* __restrict__ scale) {
    __shared__ __align__(16) MmqStage s[2];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int wm = warp & 3, wn = warp >> 2;
    const int r0 = blockIdx.x * MQ_BM;
    const int C = w.cols;
    const i64 part = (i64)T * C;
    const int xa = tk.in_row(n0 + (tid >> 2));
    const int xr = tid < MQ_BN * MQ_KT / 32 ? tk.in_row(n0 + (tid >> 1)) : -1;
    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int k = 0; k < 4; k++) acc[i][j][k] = 0.0f;

    mmq_load<F>(w, xq, xs, s[0], w0, rows, r0, xa, xr, 0, min(MQ_KT, C) >> 5, part);
    __syncthreads();
    int buf = 0;
    for (int k0 = 0; k0 < C; k0 += MQ_KT) {
        const int steps = min(MQ_KT, C - k0) >> 5;  // 32-element steps in this stage
        // The other buffer was last read before the barrier that ended the previous stage.
        if (k0 + MQ_KT < C)
            mmq_load<F>(w, xq, xs, s[buf ^ 1], w0, rows, r0, xa, xr, k0 + MQ_KT,
                        min(MQ_KT, C - k0 - MQ_KT) >> 5, part);
        if (steps == MQ_KT / 32) {
#pragma unroll
            for (int j = 0; j < MQ_KT / 32; j++) mmq_step<F>(s[buf], j, wm, wn, g, t4, acc);
        } else {
            for (int j = 0; j < steps; j++) mmq_step<F>(s[buf], j, wm, wn, g, t4, acc);
        }
        __syncthreads();
        buf ^= 1;
    }
#pragma unroll
    for (int nt = 0; nt < 4; nt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int n = n0 + wn * 32 + nt * 8 + 2 * t4 + h;
            if (n >= tk.count) continue;
            const int orow = tk.out_row(n);
            const float sc = scale ? scale[orow] : 1.0f;
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int v = 0; v < 2; v++) {
                    const int row = r0 + wm * 32 + mt * 16 + g + 8 * v;
                    if (row < rows)
                        out[(i64)orow * rows + row] =
                            acc[mt][nt][2 * v + h] * sc + (bias ? bias[row] : 0.0f);
                }
        }
}

// Expert products over expert-ordered pairs (moe_sort's perm and offs: expert e's pairs are
// perm[offs[e] .. offs[e + 1]]): block (x, e, z) multiplies rows x of expert e (rows `rows`
// of the stacked weight from e·rows) with its pairs 64 z .. 64 z + 63, and exits where the
// expert has fewer. xq, xs: Tin quantized activation rows; out (P, rows), scaled by wts[p]
// where wts is set.
#define HF2Q_MMQ_KERNEL(NAME, FMT)                                                            \
    extern "C" __global__ void __launch_bounds__(256, 2)                                       \
        mmq_##NAME(WRef w, const i8* xq, const float2* xs, const float* b, float* o, int rows, \
                   int T) {                                                                    \
        pdl_wait();                                                                            \
        mmq_impl<FMT>(w, xq, xs, b, o, rows, T, MmqTokens{nullptr, 0, T, 1}, 0,                \
                      blockIdx.y * MQ_BN, nullptr);                                            \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256, 2)                                       \
        mmqi_##NAME(WRef w, const i8* xq, const float2* xs, const int* perm, const int* offs,  \
                    const float* wts, float* o, int rows, int Tin, int div) {                  \
        pdl_wait();                                                                            \
        const int e = blockIdx.y, start = offs[e], n0 = blockIdx.z * MQ_BN;                    \
        const int count = offs[e + 1] - start;                                                 \
        if (n0 >= count) return;                                                               \
        mmq_impl<FMT>(w, xq, xs, nullptr, o, rows, Tin, MmqTokens{perm, start, count, div},    \
                      e * rows, n0, wts);                                                      \
    }
