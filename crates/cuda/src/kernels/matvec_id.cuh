// Expert products of a mixture-of-experts MLP for a few tokens: llama.cpp's `mul_mv_id` idea.
// The experts of a layer are one stacked matrix (`ffn_{gate,up}_exps (E·F, D)`, `ffn_down_exps
// (E·D, F)`, in any device layout of matvec.cuh: every layout addresses rows as row · row_bytes,
// and scales per row); each (token, slot) pair `p = t · k + j` of the routing reads only the
// rows of its expert `ids[p]`, which the routing kernel wrote on the device, so a decode step
// keeps its graph (no host round trip for the choice).
//
//   mvgi_NAME: h (P, F) = act(x_t · G_eᵀ) * (x_t · U_eᵀ)      grid (row blocks of F, P)
//   mvdi_NAME: y (P, D) = w_p · (h_p · Down_eᵀ)                grid (row blocks of D, P)
//
// Both are the one-token kernels of matvec.cuh (`mvf_rows`, same formats, same sums per row)
// with the row range moved to the pair's expert. Block row y takes pair `perm[y]` where `perm`
// is given (`moe_sort`: pairs ordered by expert, so that the blocks resident at one time read
// the same expert's rows and most of those reads hit L2; prefill), else pair y (decode). They wait for the previous kernel before
// reading `ids` (which it wrote), so their weight loads start after it, not during it.
// Not here: the routing (`moe_route` in moe_route.cuh) and the sum over a token's k pairs
// (`moe_combine`).
#pragma once
#include "matvec.cuh"

template <class F>
__device__ __forceinline__ void mvgi_impl(const WRef g, const WRef u, const float* __restrict__ x,
                                          float* __restrict__ out,
                                          const float* __restrict__ ids,
                                          const int* __restrict__ perm, int rows, int act,
                                          int ks, int k) {
    constexpr int NR = F::GNR;
    __shared__ float red[2][MVF_WARPS][4];
    pdl_wait();
    const int p = perm ? perm[blockIdx.y] : (int)blockIdx.y;
    const int base = (int)ids[p] * rows;
    const MvPlace pl = mg_place<NR>(ks);
    const float* xp = x + (i64)(p / k) * g.cols;
    mvf_rows<F, NR, 2>(g, u, xp, base + rows, base + pl.row0, ks, red);
    __syncthreads();
    mg_store<NR>(out + (i64)p * rows, rows, act, pl, red);
}

template <class F>
__device__ __forceinline__ void mvdi_impl(const WRef w, const float* __restrict__ h,
                                          float* __restrict__ y, const float* __restrict__ ids,
                                          const float* __restrict__ wts,
                                          const int* __restrict__ perm, int rows, int ks) {
    constexpr int RPW = Rpw<F>::V;
    __shared__ float red[1][MVF_WARPS][4];
    pdl_wait();
    const int p = perm ? perm[blockIdx.y] : (int)blockIdx.y;
    const int base = (int)ids[p] * rows;
    const MvPlace pl = mg_place<RPW>(ks);
    mvf_rows<F, RPW, 1>(w, w, h + (i64)p * w.cols, base + rows, base + pl.row0, ks, red);
    __syncthreads();
    if (pl.kpart == 0 && pl.lane < RPW && pl.row0 + pl.lane < rows) {
        const int row = pl.row0 + pl.lane;
        y[(i64)p * rows + row] = wts[p] * mvf_total(red, 0, pl.warp, pl.ks, pl.lane);
    }
}

// out (T, D) (+)= Σ_j wts[t k + j] · (h_{t k + j} · Down_{ids[t k + j]}ᵀ), j ascending: the down
// products of a token's k pairs, their weighted sum and the residual add in one kernel (decode:
// two kernels fewer per layer than mvdi + moe_combine + add). Grid (row blocks of D, T); the
// pairs summed in the order moe_combine sums them.
template <class F>
__device__ __forceinline__ void mvdc_impl(const WRef w, const float* __restrict__ h,
                                          float* __restrict__ out, const float* __restrict__ ids,
                                          const float* __restrict__ wts, int rows, int ks, int k,
                                          int accumulate) {
    constexpr int RPW = Rpw<F>::V;
    __shared__ float red[1][MVF_WARPS][4];
    pdl_wait();
    const int t = (int)blockIdx.y;
    const MvPlace pl = mg_place<RPW>(ks);
    const bool store = pl.kpart == 0 && pl.lane < RPW && pl.row0 + pl.lane < rows;
    float acc = 0.0f;
    for (int j = 0; j < k; j++) {
        const int p = t * k + j;
        const int base = (int)ids[p] * rows;
        mvf_rows<F, RPW, 1>(w, w, h + (i64)p * w.cols, base + rows, base + pl.row0, ks, red);
        __syncthreads();
        if (store) acc += wts[p] * mvf_total(red, 0, pl.warp, pl.ks, pl.lane);
        __syncthreads();
    }
    if (store) {
        float* o = out + (i64)t * rows + pl.row0 + pl.lane;
        *o = accumulate ? *o + acc : acc;
    }
}

#define HF2Q_MATVEC_ID(NAME, DOT, MINB)                                                         \
    extern "C" __global__ void MV_BOUNDS(MINB)                                                  \
        mvgi_##NAME(WRef g, WRef u, const float* x, float* o, const float* ids,                 \
                    const int* perm, int rows, int act, int ks, int k) {                        \
        mvgi_impl<DOT>(g, u, x, o, ids, perm, rows, act, ks, k);                                \
    }                                                                                           \
    extern "C" __global__ void MV_BOUNDS(MINB)                                                  \
        mvdi_##NAME(WRef w, const float* h, float* y, const float* ids, const float* wts,       \
                    const int* perm, int rows, int ks) {                                        \
        mvdi_impl<DOT>(w, h, y, ids, wts, perm, rows, ks);                                      \
    }                                                                                           \
    extern "C" __global__ void MV_BOUNDS(MINB)                                                  \
        mvdc_##NAME(WRef w, const float* h, float* o, const float* ids, const float* wts,       \
                    int rows, int ks, int k, int accumulate) {                                  \
        mvdc_impl<DOT>(w, h, o, ids, wts, rows, ks, k, accumulate);                             \
    }
