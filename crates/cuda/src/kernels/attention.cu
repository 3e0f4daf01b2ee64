// Causal grouped-query attention over a KV cache laid out (Hkv, S_cap, Dh), f16 or f32.
//
// Query t sits at position pos0 + t and sees cached keys j <= pos0 + t, and with a window W only
// those with pos0 + t - j < W. pos0 is read from device memory (graph replay at new positions).
//
// * Decode (one query): split-K ("flash decoding"). Block (kv head, split, head chunk) walks one
//   slice of the visible keys for up to eight query heads sharing that kv head: each warp takes
//   every fourth key, one lane per DPL dims, keeps a running max / sum / weighted V sum per head
//   (online softmax), the four warps merge in shared memory and write one partial (max, sum,
//   o[Dh]) per head and split; the last block of a kv head to finish (a counter in device
//   memory, reset by that block) merges the splits.
//   The split count is fixed at launch from the capacity, so a graph stays valid as the
//   position moves. Head widths over 256 (Gemma 4's global layers, 512) take 16 dims per lane
//   and four query heads per block (registers and the 32 KB of static shared memory).
// * Prefill with an f16 cache and Dh 64 or 128: tensor cores (`attn_fa_impl`, below).
// * Other prefills: flash-attention style. Block (16 queries, head); K/V tiles of 32 keys go
//   through shared memory as f32, each warp owns two queries: lane j scores key j of the tile,
//   the warp updates its online softmax and accumulates P·V with each lane owning dims
//   lane + 32 i. Memory is O(tile), never O(T * S). CUDA cores in f32. At Dh = 512 the tiles
//   take 160 KB of shared memory (one block per multiprocessor; the launcher raises the limit).
// * Sinks (GPT-OSS): `sinks (H)`, or null for none, gives each query head one more logit that
//   joins the softmax's max and denominator and nothing of its numerator (the CPU reference's
//   rule). Every path applies it once, where a row's sums are final (`sink_norm`), so the
//   per-key loops are those of a plain softmax.
#include "common.cuh"

#define NEG_INF (-__int_as_float(0x7f800000))

template <int N>
__device__ __forceinline__ void load_row(const u16* p, float* o) {
    if (N == 2) {
        const u32 a = *(const u32*)p;
        o[0] = h2f((u16)(a & 0xffffu));
        o[1] = h2f((u16)(a >> 16));
    } else if (N == 4) {
        const uint2 a = *(const uint2*)p;
        const u32 w[2] = {a.x, a.y};
#pragma unroll
        for (int i = 0; i < 2; i++) {
            o[2 * i] = h2f((u16)(w[i] & 0xffffu));
            o[2 * i + 1] = h2f((u16)(w[i] >> 16));
        }
    } else if (N == 8) {
        const uint4 a = *(const uint4*)p;
        const u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            o[2 * i] = h2f((u16)(w[i] & 0xffffu));
            o[2 * i + 1] = h2f((u16)(w[i] >> 16));
        }
    } else {
        // Both 16-byte loads issued before either is converted.
        uint4 a[N >= 16 ? N / 8 : 1];
#pragma unroll
        for (int k = 0; k < N / 8; k++) a[k] = ((const uint4*)p)[k];
#pragma unroll
        for (int k = 0; k < N / 8; k++) {
            const u32 w[4] = {a[k].x, a[k].y, a[k].z, a[k].w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                o[8 * k + 2 * i] = h2f((u16)(w[i] & 0xffffu));
                o[8 * k + 2 * i + 1] = h2f((u16)(w[i] >> 16));
            }
        }
    }
}

template <int N>
__device__ __forceinline__ void load_row(const float* p, float* o) {
    if (N == 2) {
        const float2 a = *(const float2*)p;
        o[0] = a.x;
        o[1] = a.y;
    } else {
#pragma unroll
        for (int i = 0; i < N / 4; i++) {
            const float4 a = ((const float4*)p)[i];
            o[4 * i] = a.x;
            o[4 * i + 1] = a.y;
            o[4 * i + 2] = a.z;
            o[4 * i + 3] = a.w;
        }
    }
}

__device__ __forceinline__ float kv_f32(u16 v) { return h2f(v); }
__device__ __forceinline__ float kv_f32(float v) { return v; }

#define AD_WARPS 4
#define AD_MAXG 8
// Query heads per decode block at DPL dims per lane: AD_MAXG, four at 16 (Dh over 256).
#define AD_HEADS(DPL) ((DPL) >= 16 ? 4 : AD_MAXG)

// Visible key range [lo, total) of the query at position qpos.
__device__ __forceinline__ void visible_range(int qpos, int cap, int window, int& lo, int& total) {
    total = min(qpos + 1, cap);
    lo = window > 0 ? max(0, qpos + 1 - window) : 0;
}

// Head h's sink logit, NEG_INF where there are none.
__device__ __forceinline__ float sink_of(const float* __restrict__ sinks, int h) {
    return sinks ? sinks[h] : NEG_INF;
}

// A row's final softmax scale with its sink: from the running max m and sum l of its keys
// (weighted values acc summed at e^(s - m)), returns f with out = acc * f, i.e.
// e^(m - M) / (l e^(m - M) + e^(sink - M)), M = max(m, sink); without a sink (NEG_INF) 1 / l.
// Zero when nothing is weighed (no visible key, no sink). `ex` is the exponential of the
// row's units (expf, or exp2 where m, l and sink are in base 2).
template <class Ex>
__device__ __forceinline__ float sink_norm(float m, float l, float sink, Ex ex) {
    if (sink == NEG_INF) return l > 0.0f ? 1.0f / l : 0.0f;
    const float M = fmaxf(m, sink);
    const float c = m == NEG_INF ? 0.0f : ex(m - M);
    return c / (l * c + ex(sink - M));
}
struct ExpE {
    __device__ __forceinline__ float operator()(float x) const { return expf(x); }
};

// out[d] for d = t0, t0 + nt, ... of one head from its nsplit partials (max, sum, o[dh]) and
// its sink: sum_s O_s e^(M_s - M) / (sum_s L_s e^(M_s - M) + e^(sink - M)).
__device__ __forceinline__ void merge_splits(const float* ph, float* oh, int dh, int nsplit,
                                             int t0, int nt, float sink) {
    float M = sink;
#pragma unroll 8
    for (int s = 0; s < nsplit; s++) M = fmaxf(M, ph[(i64)s * (dh + 2)]);
    for (int d = t0; d < dh; d += nt) {
        float L = 0.0f, O = 0.0f;
        if (M != NEG_INF) {
#pragma unroll 4
            for (int s = 0; s < nsplit; s++) {
                const float* pr = ph + (i64)s * (dh + 2);
                const float e = expf(pr[0] - M);
                L += pr[1] * e;
                O += pr[2 + d] * e;
            }
            if (sink != NEG_INF) L += expf(sink - M);
        }
        oh[d] = L > 0.0f ? O / L : 0.0f;
    }
}

// Where key (and value) j of one kv head lives, as an element offset from the pool's start.
// A contiguous cache `(Hkv, S_cap, Dh)`: the head's rows one after another.
struct ContigKeys {
    i64 base;  // kvh * cap * dh
    int dh;
    __device__ __forceinline__ i64 row(int j) const { return base + (i64)j * dh; }
};
// A paged cache `(n_blocks, Hkv, B, Dh)` (B = 1 << lb) read through one sequence's block table.
struct PagedKeys {
    const i32* __restrict__ table;
    int kvh, hkv, lb, dh;
    __device__ __forceinline__ i64 row(int j) const {
        const i64 b = table[j >> lb];
        return (((b * hkv + kvh) << lb) + (j & ((1 << lb) - 1))) * dh;
    }
};

// One decode block's share of the work: query heads h0 .. h0 + ng (sharing one kv head) of the
// query row `q (H, Dh)` over keys s0 .. s1 at `keys`' rows, written as one partial
// (max, sum, o[dh]) per head to `part + (h * nsplit + split) * (dh + 2)`.
template <int DPL, typename KV, int MAXG, typename Keys>
__device__ __forceinline__ void attn_decode_split(const float* __restrict__ q,
                                                  const KV* __restrict__ kc,
                                                  const KV* __restrict__ vc, Keys keys, int h0,
                                                  int ng, int dh, int s0, int s1, float scale,
                                                  float* __restrict__ part, int nsplit,
                                                  int split) {
    __shared__ float sm_m[AD_WARPS][MAXG], sm_l[AD_WARPS][MAXG];
    __shared__ float sm_acc[AD_WARPS][MAXG][DPL * 32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int dbase = lane * DPL;
    const bool lane_on = dbase < dh;

    float qr[MAXG][DPL], m[MAXG], l[MAXG], acc[MAXG][DPL];
#pragma unroll
    for (int hh = 0; hh < MAXG; hh++) {
        m[hh] = NEG_INF;
        l[hh] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; i++) {
            acc[hh][i] = 0.0f;
            qr[hh][i] = (hh < ng && lane_on) ? q[(i64)(h0 + hh) * dh + dbase + i] : 0.0f;
        }
    }
    const KV* kbase = kc + dbase;
    const KV* vbase = vc + dbase;
    // A warp takes keys s0 + warp, + AD_WARPS, ... in order, AD_KEYS of them per round: their
    // rows are all loaded before the first is used, so a round costs one trip through L2, not
    // one per key (the update per key is the same, in the same order).
    constexpr int AD_KEYS = DPL >= 8 ? 2 : 4;
    for (int j0 = s0 + warp; j0 < s1; j0 += AD_KEYS * AD_WARPS) {
        float kr[AD_KEYS][DPL], vr[AD_KEYS][DPL];
#pragma unroll
        for (int c = 0; c < AD_KEYS; c++) {
            const int j = j0 + c * AD_WARPS;
            if (lane_on && j < s1) {
                const i64 at = keys.row(j);
                load_row<DPL>(kbase + at, kr[c]);
                load_row<DPL>(vbase + at, vr[c]);
            } else {
#pragma unroll
                for (int i = 0; i < DPL; i++) kr[c][i] = vr[c][i] = 0.0f;
            }
        }
#pragma unroll
        for (int c = 0; c < AD_KEYS; c++) {
            if (j0 + c * AD_WARPS >= s1) break;  // warp-uniform
#pragma unroll
            for (int hh = 0; hh < MAXG; hh++) {
                if (hh < ng) {
                    float s = 0.0f;
#pragma unroll
                    for (int i = 0; i < DPL; i++) s += qr[hh][i] * kr[c][i];
                    s = warp_sum(s) * scale;
                    const float mn = fmaxf(m[hh], s);
                    const float corr = expf(m[hh] - mn), p = expf(s - mn);
                    l[hh] = l[hh] * corr + p;
#pragma unroll
                    for (int i = 0; i < DPL; i++) acc[hh][i] = acc[hh][i] * corr + p * vr[c][i];
                    m[hh] = mn;
                }
            }
        }
    }
#pragma unroll
    for (int hh = 0; hh < MAXG; hh++) {
        if (hh < ng) {
            if (lane == 0) {
                sm_m[warp][hh] = m[hh];
                sm_l[warp][hh] = l[hh];
            }
#pragma unroll
            for (int i = 0; i < DPL; i++) sm_acc[warp][hh][dbase + i] = acc[hh][i];
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < ng * dh; idx += AD_WARPS * 32) {
        const int hh = idx / dh, d = idx % dh;
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < AD_WARPS; w++) M = fmaxf(M, sm_m[w][hh]);
        float L = 0.0f, O = 0.0f;
        if (M != NEG_INF) {
#pragma unroll
            for (int w = 0; w < AD_WARPS; w++) {
                const float e = expf(sm_m[w][hh] - M);
                L += sm_l[w][hh] * e;
                O += sm_acc[w][hh][d] * e;
            }
        }
        float* pr = part + ((i64)(h0 + hh) * nsplit + split) * (dh + 2);
        if (d == 0) {
            pr[0] = M;
            pr[1] = L;
        }
        pr[2 + d] = O;
    }
}

template <int DPL, typename KV, int MAXG = AD_HEADS(DPL)>
__device__ __forceinline__ void attn_decode_impl(const float* __restrict__ q,
                                                 const KV* __restrict__ kc,
                                                 const KV* __restrict__ vc,
                                                 const i32* __restrict__ pos0p,
                                                 float* __restrict__ part, int H, int hkv, int dh,
                                                 int cap, float scale, int window, int nsplit,
                                                 float* __restrict__ out, u32* counters,
                                                 const float* __restrict__ sinks) {
    const int kvh = blockIdx.x, split = blockIdx.y;
    const int G = H / hkv, hc0 = blockIdx.z * MAXG;
    const int ng = min(MAXG, G - hc0), h0 = kvh * G + hc0;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    // The position word is written before the step starts, not by the previous kernel: read
    // before waiting for it (q and the cache rows are its outputs).
    int lo, total;
    visible_range(*pos0p, cap, window, lo, total);
    const int n = max(total - lo, 0), per = (n + nsplit - 1) / nsplit;
    const int s0 = lo + split * per, s1 = min(s0 + per, total);
    pdl_wait();
    attn_decode_split<DPL, KV, MAXG>(q, kc, vc, ContigKeys{(i64)kvh * cap * dh, dh}, h0, ng, dh,
                                     s0, s1, scale, part, nsplit, split);
    // The last block of this (kv head, head chunk) to finish merges its heads' splits, so no
    // second kernel is needed: every block makes its partials visible, then counts itself in.
    // Plain loads of the other blocks' partials are safe after the fence that follows the
    // counter (their writes were fenced before counting; nothing read those lines earlier).
    __shared__ u32 sm_last;
    const int slot = kvh * gridDim.z + blockIdx.z;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) sm_last = atomicAdd(counters + slot, 1u) == (u32)(nsplit - 1);
    __syncthreads();
    if (!sm_last) return;
    __threadfence();
    for (int hh = warp; hh < ng; hh += AD_WARPS)
        merge_splits(part + (i64)(h0 + hh) * nsplit * (dh + 2), out + (i64)(h0 + hh) * dh, dh,
                     nsplit, lane, 32, sink_of(sinks, h0 + hh));
    if (threadIdx.x == 0) counters[slot] = 0;  // ready for the next call (or graph replay)
}

#define AP_BQ 16
#define AP_BK 32
#define AP_WARPS 8

// Dynamic shared memory: Qs[16][dh], Ks[32][dh + 1] (padded: lane j reads row j, conflict-free),
// Vs[32][dh], all f32.
template <int DPL, typename KV>
__device__ __forceinline__ void attn_prefill_impl(const float* __restrict__ q,
                                                  const KV* __restrict__ kc,
                                                  const KV* __restrict__ vc,
                                                  const i32* __restrict__ pos0p,
                                                  float* __restrict__ out, int T, int H, int hkv,
                                                  int dh, int cap, float scale, int window,
                                                  const float* __restrict__ sinks) {
    extern __shared__ float smem[];
    float* Qs = smem;
    float* Ks = Qs + AP_BQ * dh;
    float* Vs = Ks + AP_BK * (dh + 1);
    const int h = blockIdx.y, kvh = h / (H / hkv), qt0 = blockIdx.x * AP_BQ;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int pos0 = *pos0p;
    const i64 qstride = (i64)H * dh;

    for (int idx = threadIdx.x; idx < AP_BQ * dh; idx += AP_WARPS * 32) {
        const int i = idx / dh, d = idx % dh;
        Qs[idx] = qt0 + i < T ? q[(i64)(qt0 + i) * qstride + (i64)h * dh + d] : 0.0f;
    }
    const int qlast = min(qt0 + AP_BQ, T) - 1;
    int kbeg, kend, unused;
    visible_range(pos0 + qt0, cap, window, kbeg, unused);
    kend = min(pos0 + qlast + 1, cap);

    float m[2], l[2], acc[2][DPL];
    int qpos[2];
    bool valid[2];
#pragma unroll
    for (int a = 0; a < 2; a++) {
        const int qi = warp * 2 + a;
        valid[a] = qt0 + qi < T;
        qpos[a] = pos0 + qt0 + qi;
        m[a] = NEG_INF;
        l[a] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[a][i] = 0.0f;
    }
    const KV* kb = kc + (i64)kvh * cap * dh;
    const KV* vb = vc + (i64)kvh * cap * dh;
    const float* q0 = Qs + (warp * 2) * dh;
    const float* q1 = q0 + dh;

    for (int kt = kbeg; kt < kend; kt += AP_BK) {
        __syncthreads();
        for (int idx = threadIdx.x; idx < AP_BK * dh; idx += AP_WARPS * 32) {
            const int j = idx / dh, d = idx % dh;
            const bool in = kt + j < kend;
            Ks[j * (dh + 1) + d] = in ? kv_f32(kb[(i64)(kt + j) * dh + d]) : 0.0f;
            Vs[j * dh + d] = in ? kv_f32(vb[(i64)(kt + j) * dh + d]) : 0.0f;
        }
        __syncthreads();
        const int j = kt + lane;
        const float* kr = Ks + lane * (dh + 1);
        float s[2] = {0.0f, 0.0f};
        for (int d = 0; d < dh; d++) {
            const float kv = kr[d];
            s[0] += q0[d] * kv;
            s[1] += q1[d] * kv;
        }
#pragma unroll
        for (int a = 0; a < 2; a++) {
            const bool vis = valid[a] && j < kend && j <= qpos[a] &&
                             (window <= 0 || qpos[a] - j < window);
            const float sa = vis ? s[a] * scale : NEG_INF;
            const float mn = fmaxf(m[a], warp_max(sa));
            if (mn == NEG_INF) continue;  // nothing visible yet for this query (warp-uniform)
            const float p = vis ? expf(sa - mn) : 0.0f;
            const float corr = expf(m[a] - mn);
            l[a] = l[a] * corr + warp_sum(p);
#pragma unroll
            for (int i = 0; i < DPL; i++) acc[a][i] *= corr;
            for (int jj = 0; jj < AP_BK; jj++) {
                const float pj = __shfl_sync(FULL_MASK, p, jj);
                if (pj != 0.0f) {
                    const float* vr = Vs + jj * dh;
#pragma unroll
                    for (int i = 0; i < DPL; i++) {
                        const int d = lane + 32 * i;
                        if (d < dh) acc[a][i] += pj * vr[d];
                    }
                }
            }
            m[a] = mn;
        }
    }
#pragma unroll
    for (int a = 0; a < 2; a++) {
        if (!valid[a]) continue;
        const int qi = warp * 2 + a;
        float* o = out + (i64)(qt0 + qi) * qstride + (i64)h * dh;
        const float inv = sink_norm(m[a], l[a], sink_of(sinks, h), ExpE{});
#pragma unroll
        for (int i = 0; i < DPL; i++) {
            const int d = lane + 32 * i;
            if (d < dh) o[d] = acc[a][i] * inv;
        }
    }
}

// Prefill on tensor cores (f16 cache, Dh = 64 or 128), flash-attention 2 style. Block (64
// queries, head), four warps of 16 queries; K/V tiles of 64 keys in shared memory as f16.
// S = Q·Kᵀ and O += P·V run as mma.sync m16n8k16 with f32 accumulators; the scores stay in
// registers (their accumulator layout is the A-operand layout of the P·V product), the online
// softmax runs on them in base 2 (q pre-scaled by scale·log2 e), and a row's running sum is kept
// per lane and reduced over its four lanes once at the end. Rounding: q and p to f16 (relative
// 2^-11 each), sums in f32.
#define FA_BQ 64
#define FA_BK 64
#define FA_WARPS 4

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

struct Exp2 {
    __device__ __forceinline__ float operator()(float x) const { return exp2f(x); }
};

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// Four 8 x 8 f16 matrices, transposed on the way: lanes 8i .. 8i + 7 name the rows of matrix i.
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// The block's queries are rows qt0 .. qt0 + 64 (those below T) of `q (T, H*DH)` at positions
// pos0 + row, its head blockIdx.y; `keys` places key j of that head's kv head (contiguous or
// paged: the same arithmetic either way, so both forms give the same bits for the same keys).
template <int DH, typename Keys>
__device__ __forceinline__ void attn_fa_impl(const float* __restrict__ q,
                                             const u16* __restrict__ kc,
                                             const u16* __restrict__ vc, const Keys keys,
                                             int pos0, float* __restrict__ out, int qt0, int T,
                                             int H, int cap, float scale, int window,
                                             const float* __restrict__ sinks) {
    // Row pitch in halves: 16-byte aligned rows, and the eight rows one fragment load or
    // ldmatrix touches start in eight different bank groups.
    constexpr int P = DH + 8, KS = DH / 16, NT = FA_BK / 8, DT = DH / 8;
    extern __shared__ __align__(16) u16 fsm[];
    u16* Qs = fsm;
    u16* Ks = Qs + FA_BQ * P;
    u16* Vs = Ks + FA_BK * P;
    const int h = blockIdx.y;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
    const i64 qstride = (i64)H * DH;
    const float qscale = scale * 1.44269504f;

    for (int idx = tid; idx < FA_BQ * DH / 4; idx += FA_WARPS * 32) {
        const int i = idx / (DH / 4), d = (idx % (DH / 4)) * 4;
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
        if (qt0 + i < T) a = *(const float4*)(q + (i64)(qt0 + i) * qstride + (i64)h * DH + d);
        *(uint2*)&Qs[i * P + d] = make_uint2(pack_h2(a.x * qscale, a.y * qscale),
                                             pack_h2(a.z * qscale, a.w * qscale));
    }
    const int qlast = min(qt0 + FA_BQ, T) - 1;
    int kbeg, unused;
    visible_range(pos0 + qt0, cap, window, kbeg, unused);
    const int kend = min(pos0 + qlast + 1, cap);
    __syncthreads();

    u32 qa[KS][4];
    const int r0 = warp * 16 + g;
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
        const int col = ks * 16 + 2 * c;
        qa[ks][0] = *(const u32*)&Qs[r0 * P + col];
        qa[ks][1] = *(const u32*)&Qs[(r0 + 8) * P + col];
        qa[ks][2] = *(const u32*)&Qs[r0 * P + col + 8];
        qa[ks][3] = *(const u32*)&Qs[(r0 + 8) * P + col + 8];
    }
    // This lane's two query rows (g and g + 8 of the warp's 16).
    const int qp[2] = {pos0 + qt0 + r0, pos0 + qt0 + r0 + 8};
    const bool qv[2] = {qt0 + r0 < T, qt0 + r0 + 8 < T};
    // Keys past this warp's last query are masked for all of its rows.
    const int wlast = pos0 + min(qt0 + warp * 16 + 15, T - 1);
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    float o[DT][4];
#pragma unroll
    for (int i = 0; i < DT; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

    for (int kt = kbeg; kt < kend; kt += FA_BK) {
        __syncthreads();
        for (int idx = tid; idx < FA_BK * DH / 8; idx += FA_WARPS * 32) {
            const int j = idx / (DH / 8), d = (idx % (DH / 8)) * 8;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = kv;
            if (kt + j < kend) {
                const i64 row = keys.row(kt + j);
                kv = *(const uint4*)(kc + row + d);
                vv = *(const uint4*)(vc + row + d);
            }
            *(uint4*)&Ks[j * P + d] = kv;
            *(uint4*)&Vs[j * P + d] = vv;
        }
        __syncthreads();
        if (kt > wlast || qt0 + warp * 16 >= T) continue;  // warp-uniform: nothing visible

        float s[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const u16* kr = Ks + (nt * 8 + g) * P + ks * 16 + 2 * c;
                const u32 b[2] = {*(const u32*)kr, *(const u32*)(kr + 8)};
                mma_16816(s[nt], qa[ks], b);
            }
        }
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int j = kt + nt * 8 + 2 * c + (e & 1), r = e >> 1;
                const bool vis = qv[r] && j < kend && j <= qp[r] &&
                                 (window <= 0 || qp[r] - j < window);
                s[nt][e] = vis ? s[nt][e] : NEG_INF;
                mx[r] = fmaxf(mx[r], s[nt][e]);
            }
        float corr[2], base[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 2));
            const float mn = fmaxf(m[r], mx[r]);
            // Nothing visible to this row yet: subtract 0 (every p is 0, and so is corr).
            base[r] = mn == NEG_INF ? 0.f : mn;
            corr[r] = fast_exp2(m[r] - base[r]);
            m[r] = mn;
            l[r] *= corr[r];
        }
#pragma unroll
        for (int i = 0; i < DT; i++) {
            o[i][0] *= corr[0];
            o[i][1] *= corr[0];
            o[i][2] *= corr[1];
            o[i][3] *= corr[1];
        }
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                s[nt][e] = fast_exp2(s[nt][e] - base[e >> 1]);
                l[e >> 1] += s[nt][e];
            }
#pragma unroll
        for (int kk = 0; kk < FA_BK / 16; kk++) {
            const u32 pa[4] = {pack_h2(s[2 * kk][0], s[2 * kk][1]),
                               pack_h2(s[2 * kk][2], s[2 * kk][3]),
                               pack_h2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                               pack_h2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            // Lane l names row l % 8 of matrix l / 8: keys kk*16 + (0 | 8) + l % 8, dims
            // dt*16 + (0 | 8): the B operands of dim tiles 2 dt and 2 dt + 1.
            const u16* vrow = Vs + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * P +
                              (lane >> 4) * 8;
#pragma unroll
            for (int dt = 0; dt < DT / 2; dt++) {
                u32 b0[2], b1[2];
                ldsm_x4_t(smem_addr(vrow + dt * 16), b0[0], b0[1], b1[0], b1[1]);
                mma_16816(o[2 * dt], pa, b0);
                mma_16816(o[2 * dt + 1], pa, b1);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 1);
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 2);
        if (!qv[r]) continue;
        // The sink in the scores' base-2 units (they were scaled by log2 e with q).
        const float sk = sink_of(sinks, h);
        const float inv = sink_norm(m[r], l[r], sk == NEG_INF ? NEG_INF : sk * 1.44269504f,
                                    Exp2{});
        float* orow = out + (i64)(qt0 + r0 + 8 * r) * qstride + (i64)h * DH + 2 * c;
#pragma unroll
        for (int i = 0; i < DT; i++)
            *(float2*)(orow + i * 8) = make_float2(o[i][2 * r] * inv, o[i][2 * r + 1] * inv);
    }
}

// Contiguous cache `(Hkv, cap, DH)`: block (64 queries, head).
template <int DH>
__device__ __forceinline__ void attn_prefill_tc(const float* q, const u16* kc, const u16* vc,
                                                const i32* pos0p, float* out, int T, int H,
                                                int hkv, int cap, float scale, int window,
                                                const float* sinks) {
    pdl_wait();
    const int kvh = blockIdx.y / (H / hkv);
    const ContigKeys keys{(i64)kvh * cap * DH, DH};
    attn_fa_impl<DH>(q, kc, vc, keys, *pos0p, out, blockIdx.x * FA_BQ, T, H, cap, scale, window,
                     sinks);
}
extern "C" __global__ void __launch_bounds__(FA_WARPS * 32)
    attn_prefill_tc_64(const float* q, const u16* kc, const u16* vc, const i32* pos0p, float* out,
                       int T, int H, int hkv, int cap, float scale, int window,
                       const float* sinks) {
    attn_prefill_tc<64>(q, kc, vc, pos0p, out, T, H, hkv, cap, scale, window, sinks);
}
extern "C" __global__ void __launch_bounds__(FA_WARPS * 32)
    attn_prefill_tc_128(const float* q, const u16* kc, const u16* vc, const i32* pos0p,
                        float* out, int T, int H, int hkv, int cap, float scale, int window,
                        const float* sinks) {
    attn_prefill_tc<128>(q, kc, vc, pos0p, out, T, H, hkv, cap, scale, window, sinks);
}

#define HF2Q_ATTN_KERNELS(KVN, KV, DPL)                                                        \
    extern "C" __global__ void __launch_bounds__(AD_WARPS * 32) attn_decode_##KVN##_##DPL(     \
        const float* q, const KV* kc, const KV* vc, const i32* pos0p, float* part, int H,      \
        int hkv, int dh, int cap, float scale, int window, int nsplit, float* out,             \
        u32* counters, const float* sinks) {                                                   \
        attn_decode_impl<DPL, KV>(q, kc, vc, pos0p, part, H, hkv, dh, cap, scale, window,      \
                                  nsplit, out, counters, sinks);                               \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(AP_WARPS * 32) attn_prefill_##KVN##_##DPL(    \
        const float* q, const KV* kc, const KV* vc, const i32* pos0p, float* out, int T,       \
        int H, int hkv, int dh, int cap, float scale, int window, const float* sinks) {        \
        pdl_wait();                                                                            \
        attn_prefill_impl<DPL, KV>(q, kc, vc, pos0p, out, T, H, hkv, dh, cap, scale, window,   \
                                   sinks);                                                     \
    }

HF2Q_ATTN_KERNELS(f16, u16, 2)
HF2Q_ATTN_KERNELS(f16, u16, 4)
HF2Q_ATTN_KERNELS(f16, u16, 8)
HF2Q_ATTN_KERNELS(f16, u16, 16)
HF2Q_ATTN_KERNELS(f32, float, 2)
HF2Q_ATTN_KERNELS(f32, float, 4)
HF2Q_ATTN_KERNELS(f32, float, 8)
HF2Q_ATTN_KERNELS(f32, float, 16)

// ---- Paged attention: a batch of query rows, each of its own sequence and position ----------
// Keys and values live in a pool `(n_blocks, Hkv, B, Dh)` (B = 1 << lb); sequence s's block
// table is `tables[s * max_blocks ..]`. Row r is the query `q[r] (H, Dh)` of sequence
// row_seq[r] at position row_pos[r] (a prefill chunk is several rows of one sequence); a row
// with a negative position is padding and yields zeros. Block (kv head, split, row x head
// chunk) walks its split of the row's visible keys as the one-token decode does, writing
// partials `part (R, H, nsplit, Dh + 2)`; `paged_attn_merge` then merges each (row, head)'s
// splits. The split count is a launch argument: fixed per captured graph, whatever the rows'
// lengths (a split past a row's keys writes an empty partial).
template <int DPL, typename KV, int MAXG = AD_HEADS(DPL)>
__device__ __forceinline__ void paged_attn_impl(const float* __restrict__ q,
                                                const KV* __restrict__ kc,
                                                const KV* __restrict__ vc,
                                                const i32* __restrict__ row_seq,
                                                const i32* __restrict__ row_pos,
                                                const i32* __restrict__ tables, int max_blocks,
                                                int lb, float* __restrict__ part, int H, int hkv,
                                                int dh, float scale, int window, int nsplit) {
    const int kvh = blockIdx.x, split = blockIdx.y;
    const int G = H / hkv, chunks = (G + MAXG - 1) / MAXG;
    const int r = blockIdx.z / chunks, hc0 = (blockIdx.z % chunks) * MAXG;
    const int ng = min(MAXG, G - hc0), h0 = kvh * G + hc0;
    pdl_wait();
    const int pos = row_pos[r];
    if (pos < 0) return;  // padding: the merge writes zeros without reading partials
    int lo, total;
    visible_range(pos, pos + 1, window, lo, total);
    const int n = total - lo, per = (n + nsplit - 1) / nsplit;
    const int s0 = lo + split * per, s1 = min(s0 + per, total);
    const PagedKeys keys{tables + (i64)row_seq[r] * max_blocks, kvh, hkv, lb, dh};
    attn_decode_split<DPL, KV, MAXG>(q + (i64)r * H * dh, kc, vc, keys, h0, ng, dh, s0, s1,
                                     scale, part + (i64)r * H * nsplit * (dh + 2), nsplit, split);
}

// out (R, H, Dh): block (row x head) merges that head's nsplit partials (zeros for padding).
extern "C" __global__ void __launch_bounds__(64)
    paged_attn_merge(const float* __restrict__ part, const i32* __restrict__ row_pos,
                     float* __restrict__ out, int H, int dh, int nsplit,
                     const float* __restrict__ sinks) {
    pdl_wait();
    const i64 rh = blockIdx.x;
    float* oh = out + rh * dh;
    if (row_pos[rh / H] < 0) {
        for (int d = threadIdx.x; d < dh; d += blockDim.x) oh[d] = 0.0f;
        return;
    }
    merge_splits(part + rh * nsplit * (dh + 2), oh, dh, nsplit, threadIdx.x, blockDim.x,
                 sink_of(sinks, (int)(rh % H)));
}

#define HF2Q_PAGED_KERNELS(KVN, KV, DPL)                                                       \
    extern "C" __global__ void __launch_bounds__(AD_WARPS * 32) paged_attn_##KVN##_##DPL(      \
        const float* q, const KV* kc, const KV* vc, const i32* row_seq, const i32* row_pos,    \
        const i32* tables, int max_blocks, int lb, float* part, int H, int hkv, int dh,        \
        float scale, int window, int nsplit) {                                                 \
        paged_attn_impl<DPL, KV>(q, kc, vc, row_seq, row_pos, tables, max_blocks, lb, part, H, \
                                 hkv, dh, scale, window, nsplit);                              \
    }

HF2Q_PAGED_KERNELS(f16, u16, 2)
HF2Q_PAGED_KERNELS(f16, u16, 4)
HF2Q_PAGED_KERNELS(f16, u16, 8)
HF2Q_PAGED_KERNELS(f16, u16, 16)
HF2Q_PAGED_KERNELS(f32, float, 2)
HF2Q_PAGED_KERNELS(f32, float, 4)
HF2Q_PAGED_KERNELS(f32, float, 8)
HF2Q_PAGED_KERNELS(f32, float, 16)

// ---- Paged prefill on tensor cores: runs of query rows of one sequence at consecutive positions
// A step's prefill chunks as tiles of up to 64 rows: `tiles (n_tiles, 4)` = (first row, rows,
// sequence, position of the first row). Block (tile, head) runs `attn_fa_impl` over the tile's
// rows with the sequence's keys read through its block table (f16 pool, Dh 64 or 128); rows
// outside every tile are left untouched (the row kernel above writes them).
template <int DH>
__device__ __forceinline__ void paged_prefill_tc(const float* q, const u16* kc, const u16* vc,
                                                 const i32* tiles, const i32* tables,
                                                 int max_blocks, int lb, float* out, int H,
                                                 int hkv, float scale, int window,
                                                 const float* sinks) {
    pdl_wait();
    const int4 t = ((const int4*)tiles)[blockIdx.x];
    const int kvh = blockIdx.y / (H / hkv);
    const PagedKeys keys{tables + (i64)t.z * max_blocks, kvh, hkv, lb, DH};
    const i64 first = (i64)t.x * H * DH;
    attn_fa_impl<DH>(q + first, kc, vc, keys, t.w, out + first, 0, t.y, H, 0x7fffffff, scale,
                     window, sinks);
}
extern "C" __global__ void __launch_bounds__(FA_WARPS * 32)
    paged_prefill_tc_64(const float* q, const u16* kc, const u16* vc, const i32* tiles,
                        const i32* tables, int max_blocks, int lb, float* out, int H, int hkv,
                        float scale, int window, const float* sinks) {
    paged_prefill_tc<64>(q, kc, vc, tiles, tables, max_blocks, lb, out, H, hkv, scale, window,
                          sinks);
}
extern "C" __global__ void __launch_bounds__(FA_WARPS * 32)
    paged_prefill_tc_128(const float* q, const u16* kc, const u16* vc, const i32* tiles,
                         const i32* tables, int max_blocks, int lb, float* out, int H, int hkv,
                         float scale, int window, const float* sinks) {
    paged_prefill_tc<128>(q, kc, vc, tiles, tables, max_blocks, lb, out, H, hkv, scale, window,
                          sinks);
}
