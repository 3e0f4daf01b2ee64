// The training op set's element-wise and row kernels, and the dense f32 products
// (`Backend::matmul`) where cuBLAS does not do them: the backward of RoPE, RMSNorm and the gated
// activations, dropout, the optimizer and gradient-norm kernels, the row kernel of the fused
// output layer + log-softmax, and conversions to bf16. Each follows its CPU reference
// (`cpu/train/*.rs`) operation for operation where that is cheap; the CPU file named beside
// each kernel is its reference. Attention's kernels are in train_attn.cu.
#include "train.cuh"

// ---------------------------------------------------------------------------------------------
// RoPE at per-row positions (cpu/train/rope.rs): x (N, nh, dh) in place, one thread per (row,
// head, pair); row t is at position t - seq[t].x of its sequence; `sign` -1 rotates back.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void rope_rows(float* __restrict__ x, const float* __restrict__ inv_freq,
                                     const int2* __restrict__ seq, int N, int nh, int dh,
                                     int half, int neox, float linear_scale, float sign) {
    pdl_wait();
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)N * nh * half) return;
    const int i = (int)(idx % half);
    const i64 th = idx / half;
    const int t = (int)(th / nh);
    const float pos = (float)(t - seq[t].x) / linear_scale;
    float s, c;
    sincosf(pos * inv_freq[i], &s, &c);
    s *= sign;
    float* head = x + th * dh;
    const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
    const float x0 = head[a], x1 = head[b];
    head[a] = x0 * c - x1 * s;
    head[b] = x0 * s + x1 * c;
}

// ---------------------------------------------------------------------------------------------
// RMSNorm's backward (cpu/train/norm.rs), one block per row of C:
// dx = inv (dy w') - x inv^3 / C sum(dy w' x), inv = 1 / sqrt(mean(x^2) + eps), w' = w + offset.
// ---------------------------------------------------------------------------------------------
#define TR_THREADS 256

// Both sums of a block, in f32 (per thread, then per warp, then across warps).
__device__ __forceinline__ float2 block_sum2(float a, float b) {
    __shared__ float2 red[TR_THREADS / 32];
    a = warp_sum(a);
    b = warp_sum(b);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) red[warp] = make_float2(a, b);
    __syncthreads();
    float2 t = make_float2(0.f, 0.f);
#pragma unroll
    for (int w = 0; w < TR_THREADS / 32; w++) {
        t.x += red[w].x;
        t.y += red[w].y;
    }
    return t;
}

extern "C" __global__ void __launch_bounds__(TR_THREADS)
    rms_norm_bwd(const float* __restrict__ x, const float* __restrict__ w,
                 const float* __restrict__ dy, float* __restrict__ dx, int C, float eps,
                 float offset) {
    pdl_wait();
    const i64 base = (i64)blockIdx.x * C;
    float ss = 0.f, dot = 0.f;
    for (int i = threadIdx.x; i < C; i += TR_THREADS) {
        const float xv = x[base + i];
        ss = fmaf(xv, xv, ss);
        dot = fmaf(dy[base + i] * (w[i] + offset), xv, dot);
    }
    const float2 t = block_sum2(ss, dot);
    const float inv = 1.0f / sqrtf(t.x / (float)C + eps);
    const float k = inv * inv * inv * t.y / (float)C;
    for (int i = threadIdx.x; i < C; i += TR_THREADS)
        dx[base + i] = inv * dy[base + i] * (w[i] + offset) - x[base + i] * k;
}

// ---------------------------------------------------------------------------------------------
// The gated activations' backward (cpu/train/act.rs): dgate = dy up act'(g), dup = dy act(g).
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void gated_act_bwd(const float* __restrict__ gate,
                                         const float* __restrict__ up,
                                         const float* __restrict__ dy, float* __restrict__ dg,
                                         float* __restrict__ du, i64 n, int gelu) {
    pdl_wait();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float g = gate[i], d = dy[i];
    float a, slope;
    if (gelu) {
        const float c = 0.7978846f;
        const float t = tanhf(c * (g + 0.044715f * g * g * g));
        const float da = c * (1.0f + 3.0f * 0.044715f * g * g);
        a = 0.5f * g * (1.0f + t);
        slope = 0.5f * (1.0f + t) + 0.5f * g * (1.0f - t * t) * da;
    } else {
        const float s = 1.0f / (1.0f + expf(-g));
        a = g * s;
        slope = s * (1.0f + g * (1.0f - s));
    }
    dg[i] = d * up[i] * slope;
    du[i] = d * a;
}

// ---------------------------------------------------------------------------------------------
// Dropout by a counter hash (train_op.rs `dropout_keep`, bit for bit): element i is kept when
// the top 24 bits of SplitMix64's finalizer over seed ^ i·φ, as a number in [0, 1), are >= p.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void dropout_fwd(const float* __restrict__ x, float* __restrict__ out,
                                       i64 n, u64 seed, float p, float keep_scale) {
    pdl_wait();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    u64 z = seed ^ ((u64)i * 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = (float)(u32)(z >> 40) * (1.0f / 16777216.0f);
    out[i] = u >= p ? __fmul_rn(x[i], keep_scale) : 0.0f;
}

// ---------------------------------------------------------------------------------------------
// Vector ops of the optimizer (cpu/train/mod.rs), rounded as the CPU rounds them (no fused
// multiply-adds: `__fmul_rn` / `__fadd_rn`), so that they agree bit for bit.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void add_scaled(float* __restrict__ x, const float* __restrict__ y, i64 n,
                                      float alpha) {
    pdl_wait();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = __fadd_rn(x[i], __fmul_rn(alpha, y[i]));
}

extern "C" __global__ void scale_inplace(float* __restrict__ x, i64 n, float s) {
    pdl_wait();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = __fmul_rn(x[i], s);
}

// Partial sums of squares in f64, one per block of a fixed grid (the host adds the partials).
extern "C" __global__ void __launch_bounds__(TR_THREADS)
    sum_squares_part(const float* __restrict__ x, i64 n, double* __restrict__ part) {
    __shared__ double red[TR_THREADS / 32];
    pdl_wait();
    double s = 0.0;
    for (i64 i = (i64)blockIdx.x * TR_THREADS + threadIdx.x; i < n;
         i += (i64)gridDim.x * TR_THREADS) {
        const double v = x[i];
        s += v * v;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) red[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
#pragma unroll
        for (int w = 0; w < TR_THREADS / 32; w++) t += red[w];
        part[blockIdx.x] = t;
    }
}

// One AdamW step (`AdamCoefficients::update`): p *= 1 - lr wd; m += (g - m)(1 - b1);
// v = v b2 + (1 - b2) g g; p -= step_size m / (sqrt(v) / sqrt(1 - b2^t) + eps).
struct AdamArgs {
    float decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, bias2_sqrt, eps;
};

extern "C" __global__ void adamw_step(float* __restrict__ p, const float* __restrict__ g,
                                      float* __restrict__ m, float* __restrict__ v, i64 n,
                                      AdamArgs a) {
    pdl_wait();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float gi = g[i];
    const float pi = __fmul_rn(p[i], a.decay);
    const float mi = __fadd_rn(m[i], __fmul_rn(__fsub_rn(gi, m[i]), a.one_minus_beta1));
    const float vi =
        __fadd_rn(__fmul_rn(v[i], a.beta2), __fmul_rn(__fmul_rn(a.one_minus_beta2, gi), gi));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), a.bias2_sqrt), a.eps);
    p[i] = __fsub_rn(pi, __fmul_rn(a.step_size, __fdiv_rn(mi, denom)));
    m[i] = mi;
    v[i] = vi;
}

// ---------------------------------------------------------------------------------------------
// Conversions and row gathers for the bf16 products.
// ---------------------------------------------------------------------------------------------

// out = bf16(x * s), n values (n % 4 == 0 and 16-byte aligned take float4 loads).
extern "C" __global__ void to_bf16_scaled(const float* __restrict__ x, u16* __restrict__ out,
                                          i64 n, float s) {
    pdl_wait();
    const i64 i = 4 * ((i64)blockIdx.x * blockDim.x + threadIdx.x);
    if (i + 3 < n && ((n & 3) == 0)) {
        const float4 a = *(const float4*)(x + i);
        *(uint2*)(out + i) = make_uint2(pack_bf2(a.x * s, a.y * s), pack_bf2(a.z * s, a.w * s));
    } else {
        for (i64 j = i; j < n && j < i + 4; j++) out[j] = f2bf(x[j] * s);
    }
}

// Columns col0 .. col0 + w of dst (rows of ld 16-bit values) = src (rows, w) times scale, as
// bf16 (bf16 != 0) or f16, then `pad` zeros: the operands of a product with a low-rank term
// appended along its depth ([x | s u] and [W | B], backend_train/lowrank.rs). Four values per
// thread, with one float4 load and one 8-byte store where every offset is a multiple of 4
// (element by element the conversion of an (8192, 8192) input ran at a third of the bandwidth).
extern "C" __global__ void pack_cols(const float* __restrict__ src, u16* __restrict__ dst,
                                     int rows, int w, int ld, int col0, int pad, float scale,
                                     int bf16) {
    pdl_wait();
    const int span = w + pad, per = (span + 3) >> 2;
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)rows * per) return;
    const int r = (int)(idx / per), j0 = (int)(idx % per) * 4;
    u16* o = dst + (i64)r * ld + col0 + j0;
    if (((w | pad | ld | col0) & 3) == 0) {
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (j0 < w) v = *(const float4*)(src + (i64)r * w + j0);
        v = make_float4(v.x * scale, v.y * scale, v.z * scale, v.w * scale);
        *(uint2*)o = bf16 ? make_uint2(pack_bf2(v.x, v.y), pack_bf2(v.z, v.w))
                          : make_uint2(pack_h2(v.x, v.y), pack_h2(v.z, v.w));
    } else {
        for (int j = j0; j < j0 + 4 && j < span; j++) {
            const float v = j < w ? src[(i64)r * w + j] * scale : 0.0f;
            o[j - j0] = bf16 ? f2bf(v) : f2h(v);
        }
    }
}

// out row r (D values) = h row rows[r], as bf16 (bf16 != 0) or f32; one thread per value.
extern "C" __global__ void gather_rows(const float* __restrict__ h, const i32* __restrict__ rows,
                                       void* __restrict__ out, int n, int D, int bf16) {
    pdl_wait();
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)n * D) return;
    const int r = (int)(idx / D), d = (int)(idx % D);
    const float v = h[(i64)rows[r] * D + d];
    if (bf16)
        ((u16*)out)[idx] = f2bf(v);
    else
        ((float*)out)[idx] = v;
}

// dst row rows[r] = src row r (D values).
extern "C" __global__ void scatter_rows(const float* __restrict__ src,
                                        const i32* __restrict__ rows, float* __restrict__ dst,
                                        int n, int D) {
    pdl_wait();
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)n * D) return;
    const int r = (int)(idx / D), d = (int)(idx % D);
    dst[(i64)rows[r] * D + d] = src[idx];
}

// ---------------------------------------------------------------------------------------------
// The output layer's row kernel (cpu/train/head.rs `row_logprob`): one block per row of V
// logits z (soft-capped first when cap > 0): the log-softmax at the target, whether the target
// is the argmax (the first of equal maxima), and with g != null the gradient
// g (onehot - softmax) (times 1 - tanh^2 under a cap) as bf16 (dzb) or f32 (dzf).
// One pass keeps a running max, sum of exponentials and argmax per thread (online softmax,
// natural exp), merged across the block; a second pass writes the gradient.
// ---------------------------------------------------------------------------------------------
#define HEAD_THREADS 512

struct SoftmaxAcc {
    float m, s;
    int arg;
};

__device__ __forceinline__ SoftmaxAcc sm_merge(SoftmaxAcc a, SoftmaxAcc b) {
    SoftmaxAcc r;
    r.m = fmaxf(a.m, b.m);
    if (r.m == TR_NEG_INF) {
        r.s = 0.f;
    } else {
        r.s = a.s * expf(a.m - r.m) + b.s * expf(b.m - r.m);
    }
    r.arg = a.m > b.m ? a.arg : (b.m > a.m ? b.arg : min(a.arg, b.arg));
    return r;
}

__device__ __forceinline__ float cap_logit(float z, float cap) {
    return cap > 0.f ? cap * tanhf(z / cap) : z;
}

extern "C" __global__ void __launch_bounds__(HEAD_THREADS)
    head_rows(const float* __restrict__ z, int V, const i32* __restrict__ targets,
              const float* __restrict__ g, float cap, float* __restrict__ logp,
              i32* __restrict__ hit, u16* __restrict__ dzb, float* __restrict__ dzf) {
    __shared__ SoftmaxAcc red[HEAD_THREADS / 32];
    __shared__ float sh_lse;
    pdl_wait();
    const int row = blockIdx.x;
    const float* zr = z + (i64)row * V;
    SoftmaxAcc acc = {TR_NEG_INF, 0.f, 0x7fffffff};
    for (int j = threadIdx.x; j < V; j += HEAD_THREADS) {
        const float v = cap_logit(zr[j], cap);
        if (v > acc.m) {
            acc.s = acc.s * expf(acc.m - v) + 1.0f;
            acc.m = v;
            acc.arg = j;
        } else {
            acc.s += expf(v - acc.m);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        SoftmaxAcc b;
        b.m = __shfl_xor_sync(FULL_MASK, acc.m, o);
        b.s = __shfl_xor_sync(FULL_MASK, acc.s, o);
        b.arg = __shfl_xor_sync(FULL_MASK, acc.arg, o);
        acc = sm_merge(acc, b);
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) red[warp] = acc;
    __syncthreads();
    const int t = targets[row];
    if (threadIdx.x == 0) {
        SoftmaxAcc a = red[0];
        for (int w = 1; w < HEAD_THREADS / 32; w++) a = sm_merge(a, red[w]);
        const float lse = a.m + logf(a.s);
        sh_lse = lse;
        logp[row] = cap_logit(zr[t], cap) - lse;
        hit[row] = a.arg == t;
    }
    if (g == nullptr) return;
    __syncthreads();
    const float lse = sh_lse, gr = g[row];
    for (int j = threadIdx.x; j < V; j += HEAD_THREADS) {
        const float v = cap_logit(zr[j], cap);
        float d = gr * ((j == t ? 1.0f : 0.0f) - expf(v - lse));
        if (cap > 0.f) d *= 1.0f - (v / cap) * (v / cap);
        if (dzb != nullptr)
            dzb[(i64)row * V + j] = f2bf(d);
        else
            dzf[(i64)row * V + j] = d;
    }
}

// ---------------------------------------------------------------------------------------------
// Dense f32 products c (M, N) = alpha op(a) op(b) (+ c when acc), op(a) (M, K) stored (K, M)
// when ta, op(b) (K, N) stored (N, K) when tb, lda / ldb values per stored row (cpu/dense.rs
// `gemm_f32`), on CUDA cores in f32:
// where cuBLAS is missing and inside a captured graph (a LoRA adapter's two products per linear
// at decode). Small outputs take one warp per element (mm_dot), larger ones 64 x 64 tiles.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float op_at(const float* __restrict__ p, bool t, int r, int c, int ld) {
    // Element (r, c) of an operand stored row-major with ld values per row, or transposed.
    return t ? p[(i64)c * ld + r] : p[(i64)r * ld + c];
}

extern "C" __global__ void mm_dot(const float* __restrict__ a, const float* __restrict__ b,
                                  float* __restrict__ c, int M, int N, int K, int ta, int tb,
                                  int lda, int ldb, float alpha, int acc) {
    pdl_wait();
    const i64 o = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (o >= (i64)M * N) return;
    const int m = (int)(o / N), n = (int)(o % N);
    float s = 0.f;
    for (int k = lane; k < K; k += 32) s = fmaf(op_at(a, ta, m, k, lda), op_at(b, tb, k, n, ldb), s);
    s = warp_sum(s);
    if (lane == 0) c[o] = acc ? c[o] + alpha * s : alpha * s;
}

#define MM_T 64
#define MM_K 16
extern "C" __global__ void __launch_bounds__(256)
    mm_tiled(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c,
             int M, int N, int K, int ta, int tb, int lda, int ldb, float alpha, int acc) {
    __shared__ float As[MM_K][MM_T + 4];
    __shared__ float Bs[MM_K][MM_T + 4];
    pdl_wait();
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int m0 = blockIdx.y * MM_T, n0 = blockIdx.x * MM_T;
    float r[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) r[i][j] = 0.f;
    for (int k0 = 0; k0 < K; k0 += MM_K) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int e = tid + 256 * i;
            // A tile: k fastest when a is stored (M, K), m fastest when stored (K, M), so that
            // neighbouring threads read neighbouring addresses either way; B likewise.
            const int am = ta ? e % MM_T : e / MM_K, ak = ta ? e / MM_T : e % MM_K;
            const int gm = m0 + am, gk = k0 + ak;
            As[ak][am] = (gm < M && gk < K) ? op_at(a, ta, gm, gk, lda) : 0.f;
            const int bn = tb ? e / MM_K : e % MM_T, bk = tb ? e % MM_K : e / MM_T;
            const int gn = n0 + bn, gk2 = k0 + bk;
            Bs[bk][bn] = (gn < N && gk2 < K) ? op_at(b, tb, gk2, gn, ldb) : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < MM_K; kk++) {
            float av[4], bv[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                av[i] = As[kk][ty + 16 * i];
                bv[i] = Bs[kk][tx + 16 * i];
            }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) r[i][j] = fmaf(av[i], bv[j], r[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int m = m0 + ty + 16 * i, n = n0 + tx + 16 * j;
            if (m < M && n < N) {
                const i64 at = (i64)m * N + n;
                c[at] = acc ? c[at] + alpha * r[i][j] : alpha * r[i][j];
            }
        }
}
