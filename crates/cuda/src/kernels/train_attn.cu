// Attention of a training forward over a packed batch, and its backward (cpu/train/attention.rs
// is the reference): causal within each sequence, grouped KV heads, an optional window and an
// optional soft cap of the scores. `seq[row]` holds (start, end) of the row's sequence; row i
// sees keys first_visible(i) ..= i. Nothing of size N x N is stored: the forward keeps each
// row's log-sum-exp, the backward recomputes the probabilities from it tile by tile.
//
// * Tensor cores (Dh = 64 or 128), flash-attention 2 style, mma.sync m16n8k16 on bf16 operands
//   with f32 sums. q, k, v (and dout) are first rounded to bf16 copies (q times the score scale)
//   by the host's launcher, so every tile load is a 16-byte cp.async, double-buffered:
//   - `ta_fwd_D`: block (64 queries, head), four warps of 16 queries, key tiles of 64; online
//     softmax in base 2 on the accumulators, which become the A operand of P·V.
//   - `ta_dq_D`: block (64 queries, head): S and dP = dO·Vᵀ per key tile, dS = P (dP - D),
//     dQ += dS·K in registers; stored once (no atomics: deterministic).
//   - `ta_dkdv_D`: block (64 keys, kv head), four warps of 16 keys: for every head of the group
//     and every query tile that sees the keys, Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ, then dV += Pᵀ·dO and
//     dK += dSᵀ·Q, accumulated over the whole group in registers.
//   Two kernels instead of one with atomic dQ: seven products per tile pair instead of five, and
//   the same bits on every run.
// * Any other head width (up to 256): one warp per (row, head) or (key, kv head) on CUDA cores
//   in f32 (`ta_*_simt`): the reference path on the device.
// * `ta_prep`: D = rowsum(dO ∘ O) per (row, head) in f32, and dO as bf16 for the tensor cores.
#include "train.cuh"

#define TA_B 64
#define TA_WARPS 4
#define TA_THREADS (TA_WARPS * 32)

// Rows r0 .. r0 + 63 of a bf16 matrix with `stride` values per row, columns col0 .. col0 + DH,
// into a shared tile of pitch DH + 8; rows at or past N are zeros.
template <int DH>
__device__ __forceinline__ void ta_load(u16* dst, const u16* __restrict__ src, i64 stride, int r0,
                                        int N, int col0) {
    constexpr int P = DH + 8, CH = DH / 8;
    for (int idx = threadIdx.x; idx < TA_B * CH; idx += TA_THREADS) {
        const int r = idx / CH, ch = idx % CH, row = r0 + r;
        const bool ok = row < N;
        cp_async16(dst + r * P + ch * 8, src + (i64)(ok ? row : 0) * stride + col0 + ch * 8, ok);
    }
}

// A fragment (16 x 16 at rows r .. r + 15, columns k0 ..) of a shared tile of pitch P.
template <int P>
__device__ __forceinline__ void ta_afrag(u32* a, const u16* t, int r, int k0, int g, int c) {
    const u16* p = t + (r + g) * P + k0 + 2 * c;
    a[0] = *(const u32*)p;
    a[1] = *(const u32*)(p + 8 * P);
    a[2] = *(const u32*)(p + 8);
    a[3] = *(const u32*)(p + 8 * P + 8);
}

// B fragment (k = columns k0 .. k0 + 15, n = rows r .. r + 7) of a shared tile whose rows are n.
template <int P>
__device__ __forceinline__ void ta_bfrag(u32* b, const u16* t, int r, int k0, int g, int c) {
    const u16* p = t + (r + g) * P + k0 + 2 * c;
    b[0] = *(const u32*)p;
    b[1] = *(const u32*)(p + 8);
}

// acc[DT][4] (16 x DH) += A (16 x 16, in registers) · T[k0 .. k0 + 16][0 .. DH) where the
// shared tile's rows are k: B fragments through ldmatrix.trans.
template <int DH>
__device__ __forceinline__ void ta_mma_rows(float (*acc)[4], const u32* a, const u16* t, int k0,
                                            int lane) {
    constexpr int P = DH + 8;
    const u16* row = t + (k0 + ((lane >> 3) & 1) * 8 + (lane & 7)) * P + (lane >> 4) * 8;
#pragma unroll
    for (int dt = 0; dt < DH / 16; dt++) {
        u32 b0[2], b1[2];
        tr_ldsm_x4_t(tr_smem_addr(row + dt * 16), b0[0], b0[1], b1[0], b1[1]);
        mma_bf16(acc[2 * dt], a, b0);
        mma_bf16(acc[2 * dt + 1], a, b1);
    }
}

// The A fragment of k-chunk kk from accumulators s[2kk], s[2kk + 1] (16 x 8 each), as bf16.
__device__ __forceinline__ void ta_pack(u32* a, const float (*s)[4], int kk) {
    a[0] = pack_bf2(s[2 * kk][0], s[2 * kk][1]);
    a[1] = pack_bf2(s[2 * kk][2], s[2 * kk][3]);
    a[2] = pack_bf2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[3] = pack_bf2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// The score of a raw product (q·scale)·k in base 2, soft-capped when cap > 0, and the cap's
// slope 1 - tanh² there.
__device__ __forceinline__ float ta_score(float raw, float cap, float& slope) {
    if (cap > 0.f) {
        const float t = tanhf(raw / cap);
        slope = 1.f - t * t;
        return cap * t * TR_LOG2E;
    }
    slope = 1.f;
    return raw * TR_LOG2E;
}

template <int DH>
__device__ __forceinline__ void ta_fwd(const u16* __restrict__ qb, const u16* __restrict__ kb,
                                       const u16* __restrict__ vb, const int2* __restrict__ seq,
                                       float* __restrict__ out, float* __restrict__ lse, int N,
                                       int H, int hkv, int window, float cap) {
    constexpr int P = DH + 8, KS = DH / 16, NT = TA_B / 8, DT = DH / 8;
    extern __shared__ __align__(16) u16 tsm[];
    u16* Qs = tsm;
    u16* Ks = Qs + TA_B * P;
    u16* Vs = Ks + 2 * TA_B * P;
    const int h = blockIdx.y, kvh = h / (H / hkv), q0 = blockIdx.x * TA_B;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const i64 qst = (i64)H * DH, kst = (i64)hkv * DH;
    const int kbeg = first_visible(seq, q0, window), kend = min(q0 + TA_B, N);
    ta_load<DH>(Qs, qb, qst, q0, N, h * DH);
    ta_load<DH>(Ks, kb, kst, kbeg, N, kvh * DH);
    ta_load<DH>(Vs, vb, kst, kbeg, N, kvh * DH);
    cp_async_commit();

    const int w0 = q0 + warp * 16;
    const int rows[2] = {w0 + g, w0 + g + 8};
    const bool rv[2] = {rows[0] < N, rows[1] < N};
    const int lo[2] = {rv[0] ? first_visible(seq, rows[0], window) : 0,
                       rv[1] ? first_visible(seq, rows[1], window) : 0};
    const bool live = w0 < N;
    const int wlo = live ? first_visible(seq, w0, window) : 0, whi = min(w0 + 15, N - 1);
    float m[2] = {TR_NEG_INF, TR_NEG_INF}, l[2] = {0.f, 0.f};
    float o[DT][4];
#pragma unroll
    for (int i = 0; i < DT; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

    int buf = 0;
    for (int kt = kbeg; kt < kend; kt += TA_B, buf ^= 1) {
        if (kt + TA_B < kend) {
            ta_load<DH>(Ks + (buf ^ 1) * TA_B * P, kb, kst, kt + TA_B, N, kvh * DH);
            ta_load<DH>(Vs + (buf ^ 1) * TA_B * P, vb, kst, kt + TA_B, N, kvh * DH);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const u16* Kt = Ks + buf * TA_B * P;
        const u16* Vt = Vs + buf * TA_B * P;
        if (live && kt <= whi && kt + TA_B > wlo) {  // warp-uniform
            float s[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                u32 a[4];
                ta_afrag<P>(a, Qs, warp * 16, ks * 16, g, c);
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    u32 b[2];
                    ta_bfrag<P>(b, Kt, nt * 8, ks * 16, g, c);
                    mma_bf16(s[nt], a, b);
                }
            }
            float mx[2] = {TR_NEG_INF, TR_NEG_INF};
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int j = kt + nt * 8 + 2 * c + (e & 1), r = e >> 1;
                    float slope;
                    const float v = ta_score(s[nt][e], cap, slope);
                    const bool vis = rv[r] && j <= rows[r] && j >= lo[r];
                    s[nt][e] = vis ? v : TR_NEG_INF;
                    mx[r] = fmaxf(mx[r], s[nt][e]);
                }
            float corr[2], base[2];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 2));
                const float mn = fmaxf(m[r], mx[r]);
                // Nothing visible to this row yet: subtract 0 (every p is 0, and so is corr).
                base[r] = mn == TR_NEG_INF ? 0.f : mn;
                corr[r] = tr_exp2(m[r] - base[r]);
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
                    s[nt][e] = tr_exp2(s[nt][e] - base[e >> 1]);
                    l[e >> 1] += s[nt][e];
                }
#pragma unroll
            for (int kk = 0; kk < TA_B / 16; kk++) {
                u32 pa[4];
                ta_pack(pa, s, kk);
                ta_mma_rows<DH>(o, pa, Vt, kk * 16, lane);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 1);
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 2);
        if (!rv[r]) continue;
        const float inv = 1.0f / l[r];
        float* orow = out + (i64)rows[r] * qst + (i64)h * DH + 2 * c;
#pragma unroll
        for (int i = 0; i < DT; i++)
            *(float2*)(orow + i * 8) = make_float2(o[i][2 * r] * inv, o[i][2 * r + 1] * inv);
        if (c == 0) lse[(i64)rows[r] * H + h] = (m[r] + log2f(l[r])) * TR_LN2;
    }
}

template <int DH>
__device__ __forceinline__ void ta_dq(const u16* __restrict__ qb, const u16* __restrict__ kb,
                                      const u16* __restrict__ vb, const u16* __restrict__ dob,
                                      const float* __restrict__ lse,
                                      const float* __restrict__ Dd, const int2* __restrict__ seq,
                                      float* __restrict__ dq, int N, int H, int hkv, float scale,
                                      int window, float cap) {
    constexpr int P = DH + 8, KS = DH / 16, NT = TA_B / 8, DT = DH / 8;
    extern __shared__ __align__(16) u16 tsm[];
    u16* Qs = tsm;
    u16* Os = Qs + TA_B * P;
    u16* Ks = Os + TA_B * P;
    u16* Vs = Ks + 2 * TA_B * P;
    const int h = blockIdx.y, kvh = h / (H / hkv), q0 = blockIdx.x * TA_B;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const i64 qst = (i64)H * DH, kst = (i64)hkv * DH;
    const int kbeg = first_visible(seq, q0, window), kend = min(q0 + TA_B, N);
    ta_load<DH>(Qs, qb, qst, q0, N, h * DH);
    ta_load<DH>(Os, dob, qst, q0, N, h * DH);
    ta_load<DH>(Ks, kb, kst, kbeg, N, kvh * DH);
    ta_load<DH>(Vs, vb, kst, kbeg, N, kvh * DH);
    cp_async_commit();

    const int w0 = q0 + warp * 16;
    const int rows[2] = {w0 + g, w0 + g + 8};
    const bool rv[2] = {rows[0] < N, rows[1] < N};
    int lo[2];
    float l2[2], dd[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        lo[r] = rv[r] ? first_visible(seq, rows[r], window) : 0;
        l2[r] = rv[r] ? lse[(i64)rows[r] * H + h] * TR_LOG2E : 0.f;
        dd[r] = rv[r] ? Dd[(i64)rows[r] * H + h] : 0.f;
    }
    const bool live = w0 < N;
    const int wlo = live ? first_visible(seq, w0, window) : 0, whi = min(w0 + 15, N - 1);
    float acc[DT][4];
#pragma unroll
    for (int i = 0; i < DT; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

    int buf = 0;
    for (int kt = kbeg; kt < kend; kt += TA_B, buf ^= 1) {
        if (kt + TA_B < kend) {
            ta_load<DH>(Ks + (buf ^ 1) * TA_B * P, kb, kst, kt + TA_B, N, kvh * DH);
            ta_load<DH>(Vs + (buf ^ 1) * TA_B * P, vb, kst, kt + TA_B, N, kvh * DH);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const u16* Kt = Ks + buf * TA_B * P;
        const u16* Vt = Vs + buf * TA_B * P;
        if (live && kt <= whi && kt + TA_B > wlo) {
            float s[NT][4], dp[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[nt][e] = dp[nt][e] = 0.f;
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                u32 a[4], ao[4];
                ta_afrag<P>(a, Qs, warp * 16, ks * 16, g, c);
                ta_afrag<P>(ao, Os, warp * 16, ks * 16, g, c);
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    u32 b[2];
                    ta_bfrag<P>(b, Kt, nt * 8, ks * 16, g, c);
                    mma_bf16(s[nt], a, b);
                    ta_bfrag<P>(b, Vt, nt * 8, ks * 16, g, c);
                    mma_bf16(dp[nt], ao, b);
                }
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int j = kt + nt * 8 + 2 * c + (e & 1), r = e >> 1;
                    float slope;
                    const float v = ta_score(s[nt][e], cap, slope);
                    const bool vis = rv[r] && j <= rows[r] && j >= lo[r];
                    const float p = vis ? tr_exp2(v - l2[r]) : 0.f;
                    s[nt][e] = p * (dp[nt][e] - dd[r]) * slope;
                }
#pragma unroll
            for (int kk = 0; kk < TA_B / 16; kk++) {
                u32 da[4];
                ta_pack(da, s, kk);
                ta_mma_rows<DH>(acc, da, Kt, kk * 16, lane);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (!rv[r]) continue;
        float* row = dq + (i64)rows[r] * qst + (i64)h * DH + 2 * c;
#pragma unroll
        for (int i = 0; i < DT; i++)
            *(float2*)(row + i * 8) =
                make_float2(acc[i][2 * r] * scale, acc[i][2 * r + 1] * scale);
    }
}

template <int DH>
__device__ __forceinline__ void ta_dkdv(const u16* __restrict__ qb, const u16* __restrict__ kb,
                                        const u16* __restrict__ vb, const u16* __restrict__ dob,
                                        const float* __restrict__ lse,
                                        const float* __restrict__ Dd,
                                        const int2* __restrict__ seq, float* __restrict__ dk,
                                        float* __restrict__ dv, int N, int H, int hkv,
                                        int window, float cap) {
    constexpr int P = DH + 8, KS = DH / 16, DT = DH / 8;
    extern __shared__ __align__(16) u16 tsm[];
    u16* Ks = tsm;
    u16* Vs = Ks + TA_B * P;
    u16* Qs = Vs + TA_B * P;
    u16* Os = Qs + 2 * TA_B * P;
    float* Ls = (float*)(Os + 2 * TA_B * P);
    float* Ds = Ls + 2 * TA_B;
    int* Lo = (int*)(Ds + 2 * TA_B);
    const int kvh = blockIdx.y, G = H / hkv, k0 = blockIdx.x * TA_B;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const i64 qst = (i64)H * DH, kst = (i64)hkv * DH;
    const int klast = min(k0 + TA_B, N) - 1;
    int row_end = seq[klast].y;
    if (window > 0) row_end = min(row_end, klast + window);
    const int tiles = (row_end - k0 + TA_B - 1) / TA_B, items = G * tiles;

    // Item i: head kvh * G + i / tiles, query rows k0 + (i % tiles) * 64 ...
    auto issue = [&](int item, int b) {
        const int hh = kvh * G + item / tiles, qt = k0 + (item % tiles) * TA_B;
        ta_load<DH>(Qs + b * TA_B * P, qb, qst, qt, N, hh * DH);
        ta_load<DH>(Os + b * TA_B * P, dob, qst, qt, N, hh * DH);
        for (int i = threadIdx.x; i < TA_B; i += TA_THREADS) {
            const int row = qt + i;
            const bool ok = row < N;
            Ls[b * TA_B + i] = ok ? lse[(i64)row * H + hh] * TR_LOG2E : 0.f;
            Ds[b * TA_B + i] = ok ? Dd[(i64)row * H + hh] : 0.f;
            Lo[b * TA_B + i] = ok ? first_visible(seq, row, window) : 0x7fffffff;
        }
    };
    ta_load<DH>(Ks, kb, kst, k0, N, kvh * DH);
    ta_load<DH>(Vs, vb, kst, k0, N, kvh * DH);
    issue(0, 0);
    cp_async_commit();

    const int kw = k0 + warp * 16;
    const int keys[2] = {kw + g, kw + g + 8};
    const bool kv_ok[2] = {keys[0] < N, keys[1] < N};
    float adk[DT][4], adv[DT][4];
#pragma unroll
    for (int i = 0; i < DT; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) adk[i][e] = adv[i][e] = 0.f;

    for (int item = 0; item < items; item++) {
        const int b = item & 1, qt = k0 + (item % tiles) * TA_B;
        if (item + 1 < items) {
            issue(item + 1, b ^ 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const u16* Qt = Qs + b * TA_B * P;
        const u16* Ot = Os + b * TA_B * P;
        const float* lt = Ls + b * TA_B;
        const float* dt_ = Ds + b * TA_B;
        const int* lot = Lo + b * TA_B;
        // Keys of this warp past the tile's last query, or (windowed) too far before its first.
        const bool live = kw < N && kw <= qt + TA_B - 1 && (window <= 0 || qt < kw + 15 + window);
        if (live) {
#pragma unroll
            for (int half = 0; half < 2; half++) {
                float s[4][4], dp[4][4];
#pragma unroll
                for (int nt = 0; nt < 4; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) s[nt][e] = dp[nt][e] = 0.f;
#pragma unroll
                for (int ks = 0; ks < KS; ks++) {
                    u32 ak[4], av[4];
                    ta_afrag<P>(ak, Ks, warp * 16, ks * 16, g, c);
                    ta_afrag<P>(av, Vs, warp * 16, ks * 16, g, c);
#pragma unroll
                    for (int nt = 0; nt < 4; nt++) {
                        u32 bq[2];
                        ta_bfrag<P>(bq, Qt, half * 32 + nt * 8, ks * 16, g, c);
                        mma_bf16(s[nt], ak, bq);
                        ta_bfrag<P>(bq, Ot, half * 32 + nt * 8, ks * 16, g, c);
                        mma_bf16(dp[nt], av, bq);
                    }
                }
#pragma unroll
                for (int nt = 0; nt < 4; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int qi = half * 32 + nt * 8 + 2 * c + (e & 1), r = e >> 1;
                        const int query = qt + qi, key = keys[r];
                        float slope;
                        const float v = ta_score(s[nt][e], cap, slope);
                        const bool vis = kv_ok[r] && query < N && key <= query && key >= lot[qi];
                        const float p = vis ? tr_exp2(v - lt[qi]) : 0.f;
                        s[nt][e] = p;
                        dp[nt][e] = p * (dp[nt][e] - dt_[qi]) * slope;
                    }
#pragma unroll
                for (int kk = 0; kk < 2; kk++) {
                    u32 pa[4];
                    ta_pack(pa, s, kk);
                    ta_mma_rows<DH>(adv, pa, Ot, half * 32 + kk * 16, lane);
                    ta_pack(pa, dp, kk);
                    ta_mma_rows<DH>(adk, pa, Qt, half * 32 + kk * 16, lane);
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (!kv_ok[r]) continue;
        const i64 at = (i64)keys[r] * kst + (i64)kvh * DH + 2 * c;
#pragma unroll
        for (int i = 0; i < DT; i++) {
            *(float2*)(dk + at + i * 8) = make_float2(adk[i][2 * r], adk[i][2 * r + 1]);
            *(float2*)(dv + at + i * 8) = make_float2(adv[i][2 * r], adv[i][2 * r + 1]);
        }
    }
}

#define TA_KERNELS(DH)                                                                          \
    extern "C" __global__ void __launch_bounds__(TA_THREADS)                                    \
        ta_fwd_##DH(const u16* qb, const u16* kb, const u16* vb, const int2* seq, float* out,   \
                    float* lse, int N, int H, int hkv, int window, float cap) {                 \
        pdl_wait();                                                                             \
        ta_fwd<DH>(qb, kb, vb, seq, out, lse, N, H, hkv, window, cap);                          \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(TA_THREADS)                                    \
        ta_dq_##DH(const u16* qb, const u16* kb, const u16* vb, const u16* dob,                 \
                   const float* lse, const float* Dd, const int2* seq, float* dq, int N, int H, \
                   int hkv, float scale, int window, float cap) {                               \
        pdl_wait();                                                                             \
        ta_dq<DH>(qb, kb, vb, dob, lse, Dd, seq, dq, N, H, hkv, scale, window, cap);            \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(TA_THREADS)                                    \
        ta_dkdv_##DH(const u16* qb, const u16* kb, const u16* vb, const u16* dob,               \
                     const float* lse, const float* Dd, const int2* seq, float* dk, float* dv,  \
                     int N, int H, int hkv, int window, float cap) {                            \
        pdl_wait();                                                                             \
        ta_dkdv<DH>(qb, kb, vb, dob, lse, Dd, seq, dk, dv, N, H, hkv, window, cap);             \
    }

TA_KERNELS(64)
TA_KERNELS(128)

// ---------------------------------------------------------------------------------------------
// Any head width up to 256 on CUDA cores in f32, one warp per (row, head) (forward, dq) or per
// (key, kv head) (dk, dv); lane l holds dims l, l + 32, ... Natural exponentials, as the CPU.
// ---------------------------------------------------------------------------------------------
#define SA_MAXD 8

__device__ __forceinline__ void sa_load(float* r, const float* __restrict__ p, int dh, int lane) {
#pragma unroll
    for (int i = 0; i < SA_MAXD; i++) {
        const int d = lane + 32 * i;
        r[i] = d < dh ? p[d] : 0.f;
    }
}

__device__ __forceinline__ float sa_dot(const float* a, const float* b) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < SA_MAXD; i++) s = fmaf(a[i], b[i], s);
    return warp_sum(s);
}

// (score, slope) of a raw scaled product, natural units.
__device__ __forceinline__ float sa_score(float raw, float cap, float& slope) {
    if (cap > 0.f) {
        const float t = tanhf(raw / cap);
        slope = 1.f - t * t;
        return cap * t;
    }
    slope = 1.f;
    return raw;
}

extern "C" __global__ void ta_fwd_simt(const float* __restrict__ q, const float* __restrict__ k,
                                       const float* __restrict__ v, const int2* __restrict__ seq,
                                       float* __restrict__ out, float* __restrict__ lse, int N,
                                       int H, int hkv, int dh, float scale, int window,
                                       float cap) {
    pdl_wait();
    const i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (w >= (i64)N * H) return;
    const int row = (int)(w / H), h = (int)(w % H), kvh = h / (H / hkv);
    const i64 qst = (i64)H * dh, kst = (i64)hkv * dh;
    float qr[SA_MAXD], acc[SA_MAXD], kr[SA_MAXD], vr[SA_MAXD];
    sa_load(qr, q + row * qst + (i64)h * dh, dh, lane);
#pragma unroll
    for (int i = 0; i < SA_MAXD; i++) acc[i] = 0.f;
    float m = TR_NEG_INF, l = 0.f;
    for (int j = first_visible(seq, row, window); j <= row; j++) {
        sa_load(kr, k + j * kst + (i64)kvh * dh, dh, lane);
        sa_load(vr, v + j * kst + (i64)kvh * dh, dh, lane);
        float slope;
        const float s = sa_score(sa_dot(qr, kr) * scale, cap, slope);
        const float mn = fmaxf(m, s), corr = expf(m - mn), p = expf(s - mn);
        l = l * corr + p;
#pragma unroll
        for (int i = 0; i < SA_MAXD; i++) acc[i] = acc[i] * corr + p * vr[i];
        m = mn;
    }
    float* o = out + row * qst + (i64)h * dh;
#pragma unroll
    for (int i = 0; i < SA_MAXD; i++)
        if (lane + 32 * i < dh) o[lane + 32 * i] = acc[i] / l;
    if (lane == 0) lse[w] = m + logf(l);
}

extern "C" __global__ void ta_dq_simt(const float* __restrict__ q, const float* __restrict__ k,
                                      const float* __restrict__ v, const float* __restrict__ dout,
                                      const float* __restrict__ lse, const float* __restrict__ Dd,
                                      const int2* __restrict__ seq, float* __restrict__ dq, int N,
                                      int H, int hkv, int dh, float scale, int window,
                                      float cap) {
    pdl_wait();
    const i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (w >= (i64)N * H) return;
    const int row = (int)(w / H), h = (int)(w % H), kvh = h / (H / hkv);
    const i64 qst = (i64)H * dh, kst = (i64)hkv * dh;
    float qr[SA_MAXD], gr[SA_MAXD], acc[SA_MAXD], kr[SA_MAXD], vr[SA_MAXD];
    sa_load(qr, q + row * qst + (i64)h * dh, dh, lane);
    sa_load(gr, dout + row * qst + (i64)h * dh, dh, lane);
#pragma unroll
    for (int i = 0; i < SA_MAXD; i++) acc[i] = 0.f;
    const float L = lse[w], D = Dd[w];
    for (int j = first_visible(seq, row, window); j <= row; j++) {
        sa_load(kr, k + j * kst + (i64)kvh * dh, dh, lane);
        sa_load(vr, v + j * kst + (i64)kvh * dh, dh, lane);
        float slope;
        const float s = sa_score(sa_dot(qr, kr) * scale, cap, slope);
        const float p = expf(s - L);
        const float dr = p * (sa_dot(gr, vr) - D) * slope * scale;
#pragma unroll
        for (int i = 0; i < SA_MAXD; i++) acc[i] = fmaf(dr, kr[i], acc[i]);
    }
    float* o = dq + row * qst + (i64)h * dh;
#pragma unroll
    for (int i = 0; i < SA_MAXD; i++)
        if (lane + 32 * i < dh) o[lane + 32 * i] = acc[i];
}

extern "C" __global__ void ta_dkdv_simt(const float* __restrict__ q, const float* __restrict__ k,
                                        const float* __restrict__ v,
                                        const float* __restrict__ dout,
                                        const float* __restrict__ lse,
                                        const float* __restrict__ Dd,
                                        const int2* __restrict__ seq, float* __restrict__ dk,
                                        float* __restrict__ dv, int N, int H, int hkv, int dh,
                                        float scale, int window, float cap) {
    pdl_wait();
    const i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (w >= (i64)N * hkv) return;
    const int j = (int)(w / hkv), kvh = (int)(w % hkv), G = H / hkv;
    const i64 qst = (i64)H * dh, kst = (i64)hkv * dh;
    float kr[SA_MAXD], vr[SA_MAXD], qr[SA_MAXD], gr[SA_MAXD], ak[SA_MAXD], av[SA_MAXD];
    sa_load(kr, k + j * kst + (i64)kvh * dh, dh, lane);
    sa_load(vr, v + j * kst + (i64)kvh * dh, dh, lane);
#pragma unroll
    for (int i = 0; i < SA_MAXD; i++) ak[i] = av[i] = 0.f;
    int end = seq[j].y;
    if (window > 0) end = min(end, j + window);
    for (int row = j; row < end; row++) {
        for (int gi = 0; gi < G; gi++) {
            const int h = kvh * G + gi;
            sa_load(qr, q + row * qst + (i64)h * dh, dh, lane);
            sa_load(gr, dout + row * qst + (i64)h * dh, dh, lane);
            float slope;
            const float s = sa_score(sa_dot(qr, kr) * scale, cap, slope);
            const float p = expf(s - lse[(i64)row * H + h]);
            const float dr = p * (sa_dot(gr, vr) - Dd[(i64)row * H + h]) * slope * scale;
#pragma unroll
            for (int i = 0; i < SA_MAXD; i++) {
                ak[i] = fmaf(dr, qr[i], ak[i]);
                av[i] = fmaf(p, gr[i], av[i]);
            }
        }
    }
    float* ko = dk + j * kst + (i64)kvh * dh;
    float* vo = dv + j * kst + (i64)kvh * dh;
#pragma unroll
    for (int i = 0; i < SA_MAXD; i++)
        if (lane + 32 * i < dh) {
            ko[lane + 32 * i] = ak[i];
            vo[lane + 32 * i] = av[i];
        }
}

// D[w] = sum_d dout * out over the dh values of (row, head) w, one warp each; with dob, dout as
// bf16 too (the tensor-core backward's operand).
extern "C" __global__ void ta_prep(const float* __restrict__ dout, const float* __restrict__ out,
                                   float* __restrict__ Dd, u16* __restrict__ dob, i64 rows,
                                   int dh) {
    pdl_wait();
    const i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (w >= rows) return;
    const float* g = dout + w * dh;
    const float* o = out + w * dh;
    float s = 0.f;
    for (int d = lane; d < dh; d += 32) {
        const float gv = g[d];
        s = fmaf(gv, o[d], s);
        if (dob != nullptr) dob[w * dh + d] = f2bf(gv);
    }
    s = warp_sum(s);
    if (lane == 0) Dd[w] = s;
}
