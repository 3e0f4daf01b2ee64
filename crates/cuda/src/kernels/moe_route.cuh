// Mixture-of-experts routing and the sum over a token's experts, on the device (included by
// elementwise.cu). The expert products between them are matvec_id.cuh's.
//
//   moe_route:   logits (T, E) (given, or the router product of x) -> ids (T, k) (expert
//                indices, stored as exact floats) and wts (T, k), one block per token: the
//                choice of hf2q_tensor::moe::route (softmax
//                over all E in f32 with the max subtracted, the k largest, ties to the lower
//                index, NaN never before a number; optional renormalisation, then an optional
//                per-expert scale).
//   moe_sort:    perm (P) = the pairs' indices ordered by expert (a counting sort in one block;
//                the order among one expert's pairs is arbitrary: each pair's products are
//                computed alone, so the results do not depend on it).
//   moe_combine: out (T, D) = sum over j of y (T·k, D) row t·k + j, j ascending.
#pragma once
#include "common.cuh"

// Most experts per token the routing kernel takes (the host checks).
#define MOE_MAX_K 32

// One block per token. Its logits come from `logits (T, E)`, or, where `router` is given (an
// f32 `(E, D)` matrix), are computed here from `x (T, D)` (one warp per expert row, lanes over
// float4 pieces: the router product folded into the routing, one kernel fewer per layer).
// The first warp then chooses; `pr` (dynamic shared memory, E floats) holds the logits, then the
// unnormalised probabilities, chosen ones overwritten with -1.
extern "C" __global__ void __launch_bounds__(256)
    moe_route(const float* __restrict__ logits, const float* __restrict__ x,
              const float* __restrict__ router, int D, float* __restrict__ ids,
              float* __restrict__ wts, const float* __restrict__ scale, int E, int k, int renorm) {
    extern __shared__ float pr[];
    pdl_wait();
    const int t = (int)blockIdx.x, lane = (int)threadIdx.x & 31, warp = (int)threadIdx.x >> 5;
    if (router) {
        const float4* xr = (const float4*)(x + (i64)t * D);
        for (int e = warp; e < E; e += (int)blockDim.x >> 5) {
            const float4* w = (const float4*)(router + (i64)e * D);
            float s = 0.0f;
            for (int i = lane; i < D / 4; i += 32) {
                const float4 a = xr[i], b = w[i];
                s = fmaf(a.x, b.x, s);
                s = fmaf(a.y, b.y, s);
                s = fmaf(a.z, b.z, s);
                s = fmaf(a.w, b.w, s);
            }
            s = warp_sum(s);
            if (lane == 0) pr[e] = s;
        }
    } else {
        for (int e = (int)threadIdx.x; e < E; e += (int)blockDim.x) pr[e] = logits[(i64)t * E + e];
    }
    __syncthreads();
    if (warp != 0) return;
    float m = -__int_as_float(0x7f800000);
    for (int e = lane; e < E; e += 32) m = fmaxf(m, pr[e]);  // fmaxf skips NaN, as f32::max
    m = warp_max(m);
    float s = 0.0f;
    for (int e = lane; e < E; e += 32) {
        const float v = expf(pr[e] - m);
        pr[e] = v;
        s += v;
    }
    s = warp_sum(s);
    __syncwarp();
    int chosen[MOE_MAX_K];
    float p[MOE_MAX_K];
    float psum = 0.0f;
    for (int j = 0; j < k; j++) {
        // This lane's best (largest, then lowest index; a NaN counts below every number, and
        // a chosen expert below a NaN), then the warp's.
        float best = -2.0f;
        int bi = E;
        for (int e = lane; e < E; e += 32) {
            float v = pr[e];
            if (v != v) v = -0.5f;
            if (v > best) {
                best = v;
                bi = e;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(FULL_MASK, best, o);
            const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
            if (ov > best || (ov == best && oi < bi)) {
                best = ov;
                bi = oi;
            }
        }
        chosen[j] = bi;
        p[j] = pr[bi] / s;
        psum += p[j];
        __syncwarp();
        if (lane == 0) pr[bi] = -1.0f;
        __syncwarp();
    }
    if (lane == 0) {
        for (int j = 0; j < k; j++) {
            float w = p[j];
            if (renorm && psum > 0.0f) w /= psum;
            if (scale) w *= scale[chosen[j]];
            ids[(i64)t * k + j] = (float)chosen[j];
            wts[(i64)t * k + j] = w;
        }
    }
}

// Most experts `moe_sort` takes (its shared memory: one counter each).
#define MOE_SORT_MAX_E 8192

// perm (P): the pairs ordered by expert; offs (E + 1, where set): where each expert's pairs
// start in perm, then P.
extern "C" __global__ void __launch_bounds__(1024)
    moe_sort(const float* __restrict__ ids, int P, int E, int* __restrict__ perm,
             int* __restrict__ offs) {
    __shared__ int count[MOE_SORT_MAX_E];
    pdl_wait();
    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += blockDim.x) atomicAdd(&count[(int)ids[p]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int at = 0;
        for (int e = 0; e < E; e++) {
            const int c = count[e];
            count[e] = at;
            if (offs) offs[e] = at;
            at += c;
        }
        if (offs) offs[E] = at;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += blockDim.x) perm[atomicAdd(&count[(int)ids[p]], 1)] = p;
}

// out[t, i] = sum_j y[t k + j, i]; n = T·D.
extern "C" __global__ void moe_combine(const float* __restrict__ y, float* __restrict__ out,
                                       int D, int k, i64 n) {
    pdl_wait();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const i64 t = i / D, c = i - t * D;
    const float* r = y + t * k * D + c;
    float s = 0.0f;
    for (int j = 0; j < k; j++) s += r[(i64)j * D];
    out[i] = s;
}
