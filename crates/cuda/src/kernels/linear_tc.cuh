// Products of a few rows on the tensor cores: the batched decode step's
//
//   out (T, R) = x (T, C) · Wᵀ (+ bias),   9 <= T <= 8 * NT (NT = 2, 4 or 8: up to 16, 32, 64)
//
// reading each weight once for all T rows, straight from its stored format into the registers
// of mma.sync m16n8k16 (f16 operands, f32 sums): no shared-memory tile of weights, no dequantized
// copy. What the matrix-vector kernels (matvec.cuh, T <= 8) do with f32 FMAs, which at 16 rows
// and more become the limit, and what the tiled kernel (linear.cuh, T > 8) does through shared
// memory in 128-row tiles, too few blocks for a decode-sized matrix.
//
// Layout. A block of KW warps (blockDim.x = 32 KW) owns 16 * MT weight rows; its warps take the
// row's 32-element chunks round-robin (warp w: chunks w, w + KW, ...) and their partial sums meet
// in shared memory at the end, added in warp order (deterministic). In a chunk, lane (g = lane/4,
// q = lane%4) dequantizes elements 8q .. 8q+8 of rows g and g + 8 of each 16-row tile (one deq8
// each) and reads the same eight columns of token g of each 8-token tile as f32. The chunk's 32
// columns are permuted so those eight values are exactly the lane's fragment slots
// ({2q, 2q+1, 2q+8, 2q+9} of two k16 steps): element 8q + j of the chunk is slot (j < 4 ? step 0
// : step 1), position j % 4. A and B use the same permutation, so the sums are the product's.
//
// Numerics: as the default prefill path (cuBLAS on f16 pairs, blas.rs): every weight and
// activation as hi + lo, two f16 whose sum carries about 22 bits of it, and the products
// Wh·xh + Wl·xh + Wh·xl (the dropped Wl·xl is about 2^-22 of the sum) with f32 sums: near-f32
// products at three times the tensor-core work of one pass, which a decode-sized product has to
// spare.
#pragma once
#include "common.cuh"
#include "quant.cuh"

#define TC_RED_FLOATS 8192

// The lane's fragments of one 8-element group as f16 pairs: v[0..8] -> two k16 steps, each
// {v[j], v[j+1]} for slots (2q, 2q+1) and {v[j+2], v[j+3]} for (2q+8, 2q+9); hi = f16(v),
// lo = f16(v - hi) (the remainder is exact in f32).
__device__ __forceinline__ void tc_pack(const float* v, u32* hi0, u32* hi1, u32* lo0, u32* lo1) {
    float l[8];
    u16 h[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        h[j] = f2h(v[j]);
        l[j] = v[j] - h2f(h[j]);
    }
    hi0[0] = (u32)h[0] | ((u32)h[1] << 16);
    hi0[1] = (u32)h[2] | ((u32)h[3] << 16);
    hi1[0] = (u32)h[4] | ((u32)h[5] << 16);
    hi1[1] = (u32)h[6] | ((u32)h[7] << 16);
    lo0[0] = pack_h2(l[0], l[1]);
    lo0[1] = pack_h2(l[2], l[3]);
    lo1[0] = pack_h2(l[4], l[5]);
    lo1[1] = pack_h2(l[6], l[7]);
}

template <class F, int MT, int NT>
__device__ __forceinline__ void mt_impl(const WRef w, const float* __restrict__ x,
                                        const float* __restrict__ bias, float* __restrict__ out,
                                        int rows, int T) {
    __shared__ float red[TC_RED_FLOATS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, kw = blockDim.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    const int row0 = blockIdx.x * 16 * MT;
    const int C = w.cols, chunks = C >> 5;  // C % 32 == 0 (the host checks)
    // Rows g and g + 8 of each tile (edge rows clamped: computed, not written).
    const u8* rp[MT][2];
    int rr[MT][2];
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            rr[m][h] = min(row0 + 16 * m + g + 8 * h, rows - 1);
            rp[m][h] = row_ptr(w, rr[m][h]);
        }
    // Token g of each 8-token tile (rows past T read token 0 and are not written).
    const float* xp[NT];
#pragma unroll
    for (int n = 0; n < NT; n++) {
        const int t = 8 * n + g;
        xp[n] = x + (i64)(t < T ? t : 0) * C + 8 * q;
    }
    float acc[MT][NT][4];
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[m][n][i] = 0.0f;

#pragma unroll 2
    for (int c = warp; c < chunks; c += kw) {
        // Activations: token tiles' B fragments, two k16 steps each, hi and lo.
        u32 b[NT][2][2], bl[NT][2][2];
#pragma unroll
        for (int n = 0; n < NT; n++) {
            const float4 x0 = *(const float4*)(xp[n] + 32 * c);
            const float4 x1 = *(const float4*)(xp[n] + 32 * c + 4);
            const float v[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
            tc_pack(v, b[n][0], b[n][1], bl[n][0], bl[n][1]);
        }
#pragma unroll
        for (int m = 0; m < MT; m++) {
            float v0[8], v1[8];
            F::template deq8<true>(w, rp[m][0], rr[m][0], 4 * c + q, v0);
            F::template deq8<true>(w, rp[m][1], rr[m][1], 4 * c + q, v1);
            // A fragment registers: {row g k-low, row g+8 k-low, row g k-high, row g+8 k-high},
            // of the weights' hi and lo halves.
            u32 h0[2], h0s1[2], l0[2], l0s1[2], h1[2], h1s1[2], l1[2], l1s1[2];
            tc_pack(v0, h0, h0s1, l0, l0s1);
            tc_pack(v1, h1, h1s1, l1, l1s1);
            const u32 a0[4] = {h0[0], h1[0], h0[1], h1[1]};
            const u32 a1[4] = {h0s1[0], h1s1[0], h0s1[1], h1s1[1]};
            const u32 w0[4] = {l0[0], l1[0], l0[1], l1[1]};
            const u32 w1[4] = {l0s1[0], l1s1[0], l0s1[1], l1s1[1]};
#pragma unroll
            for (int n = 0; n < NT; n++) {
                mma_16816(acc[m][n], a0, b[n][0]);
                mma_16816(acc[m][n], a1, b[n][1]);
                mma_16816(acc[m][n], w0, b[n][0]);
                mma_16816(acc[m][n], w1, b[n][1]);
                mma_16816(acc[m][n], a0, bl[n][0]);
                mma_16816(acc[m][n], a1, bl[n][1]);
            }
        }
    }
    // Partial sums of every warp, then warp 0 adds them in order and writes.
    constexpr int PER = MT * NT * 4;
    if (kw > 1) {
        float* mine = red + (warp * 32 + lane) * PER;
#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int i = 0; i < 4; i++) mine[(m * NT + n) * 4 + i] = acc[m][n][i];
        __syncthreads();
        if (warp != 0) return;
        for (int k = 1; k < kw; k++) {
            const float* other = red + (k * 32 + lane) * PER;
#pragma unroll
            for (int m = 0; m < MT; m++)
#pragma unroll
                for (int n = 0; n < NT; n++)
#pragma unroll
                    for (int i = 0; i < 4; i++) acc[m][n][i] += other[(m * NT + n) * 4 + i];
        }
    }
    // C fragment: {row g, tokens 2q, 2q+1}, {row g+8, same tokens}.
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = row0 + 16 * m + g + 8 * h;
            if (r >= rows) continue;
            const float bv = bias ? bias[r] : 0.0f;
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int t = 8 * n + 2 * q + j;
                    if (t < T) out[(i64)t * rows + r] = acc[m][n][2 * h + j] + bv;
                }
        }
}
