// The decode megakernel (step (a) of the persistent-decode work): one launch runs every layer of
// a dense Llama-family model's batch-1 decode step, Q4_0 products (split layout, quant.cuh), an
// f16 KV cache, and the final RMSNorm. The embedding before it and the output product and token
// pick after it stay ordinary kernels of the captured step (crates/cuda/src/mega.rs).
//
//   grid: every block resident at once (the host sizes it from the occupancy API), MG_THREADS
//   threads each. A layer is six phases; between two phases, a grid-wide barrier in device
//   memory: an arrival counter and a generation word; the last block to arrive resets the
//   counter and advances the generation, the others poll it (acquire loads), fences on both
//   sides. Both words, and the attention's merge counters, are left ready for the next launch,
//   so the step needs no memset (the buffer is zeroed once when it is made).
//     1. q, k, v = Wq|Wk|Wv · rmsnorm(x)       work item: two rows of one matrix, per warp
//     2. RoPE on q (into a buffer of its own) and on k; k, v stored at `pos` in the cache
//     3. attention of the H query heads over positions 0..pos (attention.cu's split decode:
//        items (kv head, head chunk, split) per block; the last split of a group merges them)
//     4. x += Wo · attention output              (two rows per warp)
//     5. act = silu(Wg · rmsnorm(x)) * (Wu · rmsnorm(x))   (two rows of each per warp)
//     6. x += Wd · act
//   then block 0 writes rmsnorm(x) with the final norm's weights to `out`.
//
// Visibility: every buffer written by one block and read by another lives in per-layer scratch
// (nothing is written at an address another phase of the same launch has already read), and
// the residual stream `x`, the one buffer rewritten every layer, is only read through L2
// (`__ldcg`), so no multiprocessor's L1 can hold a stale line. Each phase's input vector is
// staged into shared memory (normalised there when the phase starts with an RMSNorm), and the
// products read it from there (`mvf_rows` of matvec.cuh).
#include "common.cuh"
#include "matvec.cuh"
#include "attention.cu"

#define MG_WARPS MVF_WARPS
#define MG_THREADS (MG_WARPS * 32)

// One layer's weights and cache; mirrors `MegaLayer` in mega.rs (#[repr(C)], same order).
struct MegaLayer {
    WRef q, k, v, o, gate, up, down;
    const float* attn_norm;  // (D)
    const float* mlp_norm;   // (D)
    u16* kc;                 // (hkv, cap, dh) f16
    u16* vc;
};

// The launch's arguments; mirrors `MegaArgs` in mega.rs.
struct MegaArgs {
    const MegaLayer* layers;  // n_layers
    float* x;                 // (D): the embedding in, the residual stream after the last layer out
    float* out;               // (D): rmsnorm(x) with the final norm
    const float* final_norm;  // (D)
    const float* inv_freq;    // (rot_half)
    const i32* pos0p;         // the step's position
    float* scratch;           // n_layers * layer_stride floats (offsets below)
    u32* sync;                // [0] arrivals, [1] generation, [2 + l * groups + g] merge counters
    i32 n_layers, D, F, H, hkv, dh, cap, nsplit, rot_half, neox;
    i32 off_qr, off_att, off_act, off_part, layer_stride;
    i32 max_phases;  // debug: run only this many phases (negative: all), then the final norm
    float eps, offset, scale, linear_scale;
};

__device__ __forceinline__ u32 ld_acquire_u32(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_u32(u32* p, u32 v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Grid-wide barrier: every block's writes before it are visible to every block after it.
// bar[0] counts arrivals, bar[1] is the generation: a block reads the generation before it
// arrives (it cannot move before this block arrives), the last to arrive resets the count and
// advances the generation, the others wait for it to move. Needs every block resident (the
// host sizes the grid from the occupancy before launching).
__device__ __forceinline__ void grid_barrier(u32* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 g = ld_acquire_u32(bar + 1);
        __threadfence();
        if (atomicAdd(bar, 1u) == gridDim.x - 1) {
            atomicExch(bar, 0u);
            __threadfence();
            st_release_u32(bar + 1, g + 1);
        } else {
            while (ld_acquire_u32(bar + 1) == g) {
            }
        }
        __threadfence();
    }
    __syncthreads();
}

// xs[0..n) = src[0..n) read through L2, or with `w` rmsnorm(src) (x / rms(x) * (w + offset),
// the RMSNorm kernel's formula). n % 4 == 0, src 16-byte aligned. Block-wide.
__device__ __forceinline__ void mg_stage(float* xs, const float* src, int n, const float* w,
                                         float eps, float offset) {
    __shared__ float sred[MG_WARPS];
    __syncthreads();  // the previous phase's readers of xs are done
    float ss = 0.0f;
    for (int i = threadIdx.x * 4; i < n; i += MG_THREADS * 4) {
        const float4 v = __ldcg((const float4*)(src + i));
        *(float4*)(xs + i) = v;
        ss = sumsq4(v, ss);
    }
    if (w) {
        ss = warp_sum(ss);
        if ((threadIdx.x & 31) == 0) sred[threadIdx.x >> 5] = ss;
        __syncthreads();
        float t = 0.0f;
#pragma unroll
        for (int k = 0; k < MG_WARPS; k++) t += sred[k];
        const float inv = inv_rms(t, n, eps);
        for (int i = threadIdx.x; i < n; i += MG_THREADS) xs[i] = xs[i] * inv * (w[i] + offset);
    }
    __syncthreads();
}

// Products of up to three matrices over the staged input xs: warp item i takes two rows of one
// matrix (items of matrix 0 first); out_m[row] = W_m[row] · xs, or with `acc` out += it (the
// residual stream, read through L2). NW = 2: one matrix pair (gate, up), out0 = silu(g) * u.
template <int NW>
__device__ __forceinline__ void mg_products(const WRef* w, float* const* outs, const int* rows,
                                            int nm, const float* xs, bool acc) {
    constexpr int RP = 2;
    __shared__ float red[2][MVF_WARPS][4];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int total = 0;
    for (int m = 0; m < nm; m++) total += rows[m] / RP;
    const int nw = gridDim.x * MG_WARPS;
    for (int it = blockIdx.x * MG_WARPS + warp; it < total; it += nw) {
        int m = 0, i = it;
        while (i >= rows[m] / RP) {
            i -= rows[m] / RP;
            m++;
        }
        const int row0 = i * RP;
        mvf_rows<DQ4_0S, RP, NW>(w[m], w[NW > 1 ? 1 : m], xs, rows[m], row0, 1, red);
        __syncwarp();
        if (lane < RP) {
            const int row = row0 + lane;
            float* o = outs[m];
            if (NW > 1) {
                o[row] = silu_f(red[0][warp][lane]) * red[1][warp][lane];
            } else {
                const float s = red[0][warp][lane];
                o[row] = acc ? __ldcg(o + row) + s : s;
            }
        }
        __syncwarp();
    }
}

// Phase 2: RoPE of q (qkv -> qr) and k, k and v stored at `pos` (as rope_store in
// elementwise.cu: the same angles and arithmetic; pairs past the rotated ones copied).
__device__ __forceinline__ void mg_rope_store(const MegaArgs& a, const MegaLayer& L,
                                              const float* qkv, float* qr, int pos) {
    const int pairs = a.dh >> 1, half = a.rot_half, slots = a.H + a.hkv;
    const int nq = a.H * a.dh, nk = a.hkv * a.dh;
    for (int idx = blockIdx.x * MG_THREADS + threadIdx.x; idx < slots * pairs;
         idx += gridDim.x * MG_THREADS) {
        const int j = idx % pairs, slot = idx / pairs;
        float s = 0.0f, c = 1.0f;
        if (j < half) sincosf((float)pos / a.linear_scale * a.inv_freq[j], &s, &c);
        const int ia = a.neox ? j : 2 * j, ib = a.neox ? j + half : 2 * j + 1;
        const int e0 = j < half ? ia : 2 * j, e1 = j < half ? ib : 2 * j + 1;
        const float* src = slot < a.H ? qkv + slot * a.dh : qkv + nq + (slot - a.H) * a.dh;
        const float x0 = __ldcg(src + e0), x1 = __ldcg(src + e1);
        const float y0 = j < half ? x0 * c - x1 * s : x0;
        const float y1 = j < half ? x0 * s + x1 * c : x1;
        if (slot < a.H) {
            qr[slot * a.dh + e0] = y0;
            qr[slot * a.dh + e1] = y1;
        } else {
            const int h = slot - a.H;
            const i64 dst = ((i64)h * a.cap + pos) * a.dh;
            L.kc[dst + e0] = f2h(y0);
            L.kc[dst + e1] = f2h(y1);
            const float* v = qkv + nq + nk + h * a.dh;
            L.vc[dst + 2 * j] = f2h(__ldcg(v + 2 * j));
            L.vc[dst + 2 * j + 1] = f2h(__ldcg(v + 2 * j + 1));
        }
    }
}

// Phase 3: attention.cu's split decode over items (kv head, head chunk, split); the last block
// of a (kv head, chunk) to finish merges its splits into att (as attn_decode_impl).
template <int DPL>
__device__ __forceinline__ void mg_attention(const MegaArgs& a, const MegaLayer& L,
                                             const float* qr, float* att, float* part, u32* cnt,
                                             int pos) {
    constexpr int MAXG = AD_HEADS(DPL);
    __shared__ u32 sm_last;
    const int G = a.H / a.hkv, chunks = (G + MAXG - 1) / MAXG, groups = a.hkv * chunks;
    int lo, total;
    visible_range(pos, a.cap, 0, lo, total);
    const int n = max(total - lo, 0), per = (n + a.nsplit - 1) / a.nsplit;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int item = blockIdx.x; item < groups * a.nsplit; item += gridDim.x) {
        const int g = item / a.nsplit, split = item % a.nsplit;
        const int kvh = g / chunks, hc0 = (g % chunks) * MAXG;
        const int ng = min(MAXG, G - hc0), h0 = kvh * G + hc0;
        const int s0 = lo + split * per, s1 = min(s0 + per, total);
        attn_decode_split<DPL, u16, MAXG>(qr, L.kc, L.vc,
                                          ContigKeys{(i64)kvh * a.cap * a.dh, a.dh}, h0, ng, a.dh,
                                          s0, s1, a.scale, part, a.nsplit, split);
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) sm_last = atomicAdd(cnt + g, 1u) == (u32)(a.nsplit - 1);
        __syncthreads();
        if (sm_last) {
            __threadfence();
            for (int hh = warp; hh < ng; hh += MG_WARPS)
                merge_splits(part + (i64)(h0 + hh) * a.nsplit * (a.dh + 2),
                             att + (i64)(h0 + hh) * a.dh, a.dh, a.nsplit, lane, 32,
                             NEG_INF);  // no sinks: models with them run the per-op step
            if (threadIdx.x == 0) cnt[g] = 0;  // ready for the next launch
        }
        __syncthreads();  // shared memory reused by the next item
    }
}

template <int DPL>
__device__ __forceinline__ void mega_impl(const MegaArgs& a) {
    extern __shared__ float4 mg_smem[];
    float* xs = (float*)mg_smem;
    pdl_wait();  // the embedding (previous kernel) wrote x
    const int pos = *a.pos0p;
    const int G = a.H / a.hkv, groups = a.hkv * ((G + AD_HEADS(DPL) - 1) / AD_HEADS(DPL));
    const int nq = a.H * a.dh, nk = a.hkv * a.dh;
    int phase = 0;
    const int stop = a.max_phases < 0 ? 0x7fffffff : a.max_phases;
    for (int l = 0; l < a.n_layers; l++) {
        const MegaLayer& L = a.layers[l];
        float* sc = a.scratch + (i64)l * a.layer_stride;
        float *qkv = sc, *qr = sc + a.off_qr, *att = sc + a.off_att, *act = sc + a.off_act;
        float* part = sc + a.off_part;
        // 1. q | k | v
        if (phase++ >= stop) break;
        mg_stage(xs, a.x, a.D, L.attn_norm, a.eps, a.offset);
        {
            const WRef w[3] = {L.q, L.k, L.v};
            float* const outs[3] = {qkv, qkv + nq, qkv + nq + nk};
            const int rows[3] = {nq, nk, nk};
            mg_products<1>(w, outs, rows, 3, xs, false);
        }
        grid_barrier(a.sync);
        // 2. RoPE, cache store
        if (phase++ >= stop) break;
        mg_rope_store(a, L, qkv, qr, pos);
        grid_barrier(a.sync);
        // 3. attention
        if (phase++ >= stop) break;
        mg_attention<DPL>(a, L, qr, att, part, a.sync + 2 + l * groups, pos);
        grid_barrier(a.sync);
        // 4. x += Wo · att
        if (phase++ >= stop) break;
        mg_stage(xs, att, nq, nullptr, 0.0f, 0.0f);
        {
            const WRef w[1] = {L.o};
            float* const outs[1] = {a.x};
            const int rows[1] = {a.D};
            mg_products<1>(w, outs, rows, 1, xs, true);
        }
        grid_barrier(a.sync);
        // 5. act = silu(gate) * up
        if (phase++ >= stop) break;
        mg_stage(xs, a.x, a.D, L.mlp_norm, a.eps, a.offset);
        {
            const WRef w[2] = {L.gate, L.up};
            float* const outs[1] = {act};
            const int rows[1] = {a.F};
            mg_products<2>(w, outs, rows, 1, xs, false);
        }
        grid_barrier(a.sync);
        // 6. x += Wd · act
        if (phase++ >= stop) break;
        mg_stage(xs, act, a.F, nullptr, 0.0f, 0.0f);
        {
            const WRef w[1] = {L.down};
            float* const outs[1] = {a.x};
            const int rows[1] = {a.D};
            mg_products<1>(w, outs, rows, 1, xs, true);
        }
        grid_barrier(a.sync);
    }
    // Every block leaves the loop at the same phase, after the same barriers.
    if (blockIdx.x != 0) return;
    mg_stage(xs, a.x, a.D, a.final_norm, a.eps, a.offset);
    for (int i = threadIdx.x; i < a.D; i += MG_THREADS) a.out[i] = xs[i];
}

extern "C" __global__ void __launch_bounds__(MG_THREADS) mega_decode_2(MegaArgs a) {
    mega_impl<2>(a);
}
extern "C" __global__ void __launch_bounds__(MG_THREADS) mega_decode_4(MegaArgs a) {
    mega_impl<4>(a);
}
