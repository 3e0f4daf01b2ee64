// Expert products of a mixture-of-experts MLP for a few tokens: llama.cpp's `mul_mv_id` idea.
// The experts of a layer are one stacked matrix (`ffn_{gate,up}_exps (E·F, D)`, `ffn_down_exps
// (E·D, F)`, in any device layout of matvec.cuh: every layout addresses rows as row · row_bytes,
// and scales per row); each (token, slot) pair `p = t · k + j` of the routing reads only the
// rows of its expert `ids[p]`, which the routing kernel wrote on the device, so a decode step
// keeps its graph (no host round trip for the choice).
//
//   mvgi_NAME: h (P, F) = act(x_t · G_eᵀ + bg_e, x_t · U_eᵀ + bu_e) grid (row blocks of F, P)
//   mvdi_NAME: y (P, D) = w_p · (h_p · Down_eᵀ + bd_e)                grid (row blocks of D, P)
//
// The biases (GPT-OSS: `(E·F)`, `(E·F)`, `(E·D)`, expert e's rows at e·F.., e·D..) may be null;
// act 0 is SiLU, 1 GELU (tanh), 2 GPT-OSS's clamped SwiGLU at (alpha, limit): act(g, u) =
// silu(g)·u, gelu(g)·u or clamped_swiglu_f(g, u, alpha, limit).
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

// The gated pair's store: the first warp of each row group writes act(gate + bg, up + bu) of
// its rows (`base` the expert's first row in the stacked matrices and the biases).
template <int NR>
__device__ __forceinline__ void mgi_store(float* __restrict__ out, int rows, int base, int act,
                                          const float* __restrict__ bg,
                                          const float* __restrict__ bu, float alpha,
                                          float limit, const MvPlace& p,
                                          float (*red)[MVF_WARPS][4]) {
    if (p.kpart == 0 && p.row0 < rows && p.lane < NR && p.row0 + p.lane < rows) {
        const int row = p.row0 + p.lane;
        float gs = mvf_total(red, 0, p.warp, p.ks, p.lane);
        float us = mvf_total(red, 1, p.warp, p.ks, p.lane);
        if (bg) gs += bg[base + row];
        if (bu) us += bu[base + row];
        out[row] = act == 2   ? clamped_swiglu_f(gs, us, alpha, limit)
                   : act == 0 ? silu_f(gs) * us
                              : gelu_tanh_f(gs) * us;
    }
}

template <class F>
__device__ __forceinline__ void mvgi_impl(const WRef g, const WRef u, const float* __restrict__ x,
                                          float* __restrict__ out,
                                          const float* __restrict__ ids,
                                          const int* __restrict__ perm, int rows, int act,
                                          int ks, int k, const float* __restrict__ bg,
                                          const float* __restrict__ bu, float alpha,
                                          float limit) {
    constexpr int NR = F::GNR;
    __shared__ float red[2][MVF_WARPS][4];
    pdl_wait();
    const int p = perm ? perm[blockIdx.y] : (int)blockIdx.y;
    const int base = (int)ids[p] * rows;
    const MvPlace pl = mg_place<NR>(ks);
    const float* xp = x + (i64)(p / k) * g.cols;
    mvf_rows<F, NR, 2>(g, u, xp, base + rows, base + pl.row0, ks, red);
    __syncthreads();
    mgi_store<NR>(out + (i64)p * rows, rows, base, act, bg, bu, alpha, limit, pl, red);
}

template <class F>
__device__ __forceinline__ void mvdi_impl(const WRef w, const float* __restrict__ h,
                                          float* __restrict__ y, const float* __restrict__ ids,
                                          const float* __restrict__ wts,
                                          const int* __restrict__ perm, int rows, int ks,
                                          const float* __restrict__ bd) {
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
        const float s = mvf_total(red, 0, pl.warp, pl.ks, pl.lane) + (bd ? bd[base + row] : 0.0f);
        y[(i64)p * rows + row] = wts[p] * s;
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
                                          int accumulate, const float* __restrict__ bd) {
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
        if (store)
            acc += wts[p] * (mvf_total(red, 0, pl.warp, pl.ks, pl.lane) +
                             (bd ? bd[base + pl.row0 + pl.lane] : 0.0f));
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
                    const int* perm, int rows, int act, int ks, int k, const float* bg,         \
                    const float* bu, float alpha, float limit) {                                \
        mvgi_impl<DOT>(g, u, x, o, ids, perm, rows, act, ks, k, bg, bu, alpha, limit);          \
    }                                                                                           \
    extern "C" __global__ void MV_BOUNDS(MINB)                                                  \
        mvdi_##NAME(WRef w, const float* h, float* y, const float* ids, const float* wts,       \
                    const int* perm, int rows, int ks, const float* bd) {                       \
        mvdi_impl<DOT>(w, h, y, ids, wts, perm, rows, ks, bd);                                  \
    }                                                                                           \
    extern "C" __global__ void MV_BOUNDS(MINB)                                                  \
        mvdc_##NAME(WRef w, const float* h, float* o, const float* ids, const float* wts,       \
                    int rows, int ks, int k, int accumulate, const float* bd) {                 \
        mvdc_impl<DOT>(w, h, o, ids, wts, rows, ks, k, accumulate, bd);                         \
    }
