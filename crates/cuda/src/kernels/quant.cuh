// One device dequantizer per weight format, over the stored bytes unchanged.
//
// Every format is a struct with one function,
//     deq8<AL>(w, rp, row, g, v): v[0..8] = elements 8g .. 8g+8 of row `row` (whose bytes start
//     at rp = row_ptr(w, row), computed once by the caller),
// so every kernel (matrix-vector, tiled matrix product, embedding gather) is a template over the
// format and never knows a block layout. Eight consecutive elements always share one scale in
// every format here (the smallest scale group is 16), so a call decodes one scale and eight
// quants.
//
// The formats that the 8-bit prefill kernel (mmq.cuh) multiplies also have
//     codes8(w, rp, row, g, c0, c1, a, c): the same eight elements as signed 8-bit codes (bytes
//     0..3 of c0 are elements 0..3, c1 the rest) with v[i] = a * code_i + c up to the rounding
//     of the f32 products,
// and say how often a and c change: MMQ_GROUP elements share a (16 or 32), and c is 0 unless
// MMQ_OFFSET (then it is shared by 32 elements). Both read the group through the layout's
// raw8 (its stored codes as bytes and its scale, and min where it has one), so the two cannot
// disagree on the layout; where several layouts share a value rule, one template adds both to
// each layout's raw8 (NibblesMin for Q4_K stored and re-laid, OffsetBytes for split Q4_0 and
// Q8_0 and for Q6_K stored, padded and re-laid).
//
// The float operations follow the CPU reference (`quant/*.rs`, itself ggml's scalar code)
// operation for operation, with `__fmul_rn`/`__fadd_rn` where the reference multiplies then adds,
// so the compiler cannot fuse them: dequantized values are bit-identical to the CPU's.
#pragma once
#include "common.cuh"

// A weight as the kernels see it. `data` holds R rows of `row_bytes` bytes: ggml blocks, dense
// values, or MLX packed words. `scales`/`biases` (f32, R * cols / group_size) are for MLX affine
// only. Mirrors `WeightArgs` on the host (same field order, #[repr(C)]).
struct WRef {
    const u8* data;
    const float* scales;
    const float* biases;
    i64 row_bytes;
    i32 cols;
    i32 group_size;
};

__device__ __forceinline__ const u8* row_ptr(const WRef& w, int row) {
    return w.data + (i64)row * w.row_bytes;
}

// Byte i (0..7) of the little-endian pair of words (lo, hi).
__device__ __forceinline__ u32 byte_of(u32 lo, u32 hi, int i) {
    return ((i < 4 ? lo : hi) >> (8 * (i & 3))) & 0xffu;
}

// ---------------------------------------------------------------------------------------------
// ggml legacy formats, 32 elements per block. Element e of a block: byte (e & 15) of qs, low
// nibble for e < 16, high nibble otherwise; the fifth bit (Q5_*) is bit e of qh. A group of eight
// (p = g & 3) is bytes 8*(p&1) .. +8, nibble (p >> 1).
// ---------------------------------------------------------------------------------------------

// v[i] = (byte i of q0 - off) * d and v[4 + i] = (byte i of q1 - off) * d, rounded as the CPU
// reference's multiply (the subtraction is exact).
__device__ __forceinline__ void deq_bytes8(u32 q0, u32 q1, float off, float d, float* v) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        v[i] = __fmul_rn(byte_magic(q0, i) - (MAGIC + off), d);
        v[i + 4] = __fmul_rn(byte_magic(q1, i) - (MAGIC + off), d);
    }
}

// Bytes b of w (each under 2 OFF, OFF one of 8, 32, 128) as the signed bytes b - OFF: adding
// 128 - OFF cannot carry into the next byte, and flipping bit 7 then subtracts 128.
template <int OFF>
__device__ __forceinline__ u32 minus_x4(u32 w) {
    return (w + (u32)(128 - OFF) * 0x01010101u) ^ 0x80808080u;
}

// deq8 and codes8 of a layout R whose raw8 gives unsigned codes b as bytes and the scale d of
// their group of GROUP elements: x = d (b - OFF) (split Q4_0, split Q8_0 as b = q + 128, and
// Q6_K stored, padded and re-laid).
template <class R, int OFF, int GROUP>
struct OffsetBytes : R {
    using R::raw8;
    template <bool AL = true>
    static __device__ __forceinline__ void deq8(const WRef& w, const u8* rp, int row, int g,
                                                float* v) {
        u32 q0, q1;
        float d;
        raw8(w, rp, row, g, q0, q1, d);
        deq_bytes8(q0, q1, (float)OFF, d, v);
    }
    static constexpr int MMQ_GROUP = GROUP;
    static constexpr bool MMQ_OFFSET = false;
    static __device__ __forceinline__ void codes8(const WRef& w, const u8* rp, int row, int g,
                                                  u32& c0, u32& c1, float& a, float& c) {
        raw8(w, rp, row, g, c0, c1, a);
        c = 0.0f;
        c0 = minus_x4<OFF>(c0);
        c1 = minus_x4<OFF>(c1);
    }
};

struct FQ4_0 {  // { half d; u8 qs[16]; } x = d * (q - 8)
    template <bool AL = true>
    static __device__ __forceinline__ void deq8(const WRef& w, const u8* rp, int row, int g,
                                                float* v) {
        const u8* b = rp + (g >> 2) * 18;
        const int p = g & 3, sh = (p >> 1) * 4;
        const float d = h2f(ld_u16(b));
        const u8* q = b + 2 + (p & 1) * 8;
        const u32 q0 = (ld_u32_a2(q) >> sh) & 0x0F0F0F0Fu, q1 = (ld_u32_a2(q + 4) >> sh) & 0x0F0F0F0Fu;
        deq_bytes8(q0, q1, 8.0f, d, v);
    }
};

struct FQ4_1 {  // { half d; half m; u8 qs[16]; } x = d * q + m
    template <bool AL = true>
    static __device__ __forceinline__ void deq8(const WRef& w, const u8* rp, int row, int g,
                                                float* v) {
        const u8* b = rp + (g >> 2) * 20;
        const int p = g & 3, sh = (p >> 1) * 4;
        const float d = h2f(ld_u16(b)), m = h2f(ld_u16(b + 2));
        const u8* q = b + 4 + (p & 1) * 8;
        const u32 q0 = (ld_u32_a2(q) >> sh) & 0x0F0F0F0Fu, q1 = (ld_u32_a2(q + 4) >> sh) & 0x0F0F0F0Fu;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[i] = __fadd_rn(__fmul_rn(byte_magic(q0, i) - MAGIC, d), m);
            v[i + 4] = __fadd_rn(__fmul_rn(byte_magic(q1, i) - MAGIC, d), m);
        }
    }
};

struct FQ5_0 {  // { half d; u32 qh; u8 qs[16]; } x = d * (q - 16)
    template <bool AL = true>
    static __device__ __forceinline__ void deq8(const WRef& w, const u8* rp, int row, int g,
                                                float* v) {
        const u8* b = rp + (g >> 2) * 22;
        const int p = g & 3, sh = (p >> 1) * 4;
        const float d = h2f(ld_u16(b));
        const u32 qh = ld_u32_a2(b + 2);
        const u8* q = b + 6 + (p & 1) * 8;
        const u32 q0 = ld_u32_a2(q), q1 = ld_u32_a2(q + 4);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int e = 8 * p + i;
            const int n = (int)(((byte_of(q0, q1, i) >> sh) & 15u) | (((qh >> e) & 1u) << 4));
            v[i] = __fmul_rn(i2f(n - 16), d);
        }
    }
};

struct FQ5_1 {  // { half d; half m; u32 qh; u8 qs[16]; } x = d * q + m
    template <bool AL = true>
    static __device__ __forceinline__ void deq8(const WRef& w, const u8* rp, int row, int g,
                                                float* v) {
        const u8* b = rp + (g >> 2) * 24;
        const int p = g & 3, sh = (p >> 1) * 4;
        const float d = h2f(ld_u16(b)), m = h2f(ld_u16(b + 2));
        const u32 qh = ld_u32_a2(b + 4);
        const u8* q = b + 8 + (p & 1) * 8;
        const u32 q0 = ld_u32_a2(q), q1 = ld_u32_a2(q + 4);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int e = 8 * p + i;
            const u32 n = ((byte_of(q0, q1, i) >> sh) & 15u) | (((qh >> e) & 1u) << 4);
            v[i] = __fadd_rn(__fmul_rn(i2f((int)n), d), m);
        }
    }
};

struct FQ8_0 {  // { half d; i8 qs[32]; } x = q * d
    template <bool AL = true>
    static __device__ __forceinline__ void deq8(const WRef& w, const u8* rp, int row, int g,
                                                float* v) {
        const u8* b = rp + (g >> 2) * 34;
        const float d = h2f(ld_u16(b));
        const u8* q = b + 2 + (g & 3) * 8;
        // Flipping the sign bit maps int8 q to the byte q + 128.
        const u32 q0 = ld_u32_a2(q) ^ 0x80808080u, q1 = ld_u32_a2(q + 4) ^ 0x80808080u;
        deq_bytes8(q0, q1, 128.0f, d, v);
    }
};

// The split layouts made at upload for Q4_0 and Q8_0 (weight.rs): the quants of every block of
// the matrix, block after block (16 or 32 bytes, 16-byte aligned), then the f16 scales, one per
// block, at `scales` (read as u16). `rp` is the row's first quant byte (row_bytes = quant bytes
// per row). Same values as FQ4_0 / FQ8_0; matvec.cuh reads these layouts a block per lane.
struct RQ4_0S {
    // The group's nibbles (0..15) as bytes, and d.
    static __device__ __forceinline__ void raw8(const WRef& w, const u8* rp, int row, int g,
                                                u32& q0, u32& q1, float& d) {
        const int b = g >> 2, p = g & 3, sh = (p >> 1) * 4;
        d = h2f(((const u16*)w.scales)[(i64)row * (w.cols >> 5) + b]);
        const uint2 q = *(const uint2*)(rp + 16 * b + (p & 1) * 8);
        q0 = (q.x >> sh) & 0x0F0F0F0Fu;
        q1 = (q.y >> sh) & 0x0F0F0F0Fu;
    }
};
typedef OffsetBytes<RQ4_0S, 8, 32> FQ4_0S;

struct RQ8_0S {
    // The group's signed quants plus 128 (bit 7 flipped) as bytes, and d.
    static __device__ __forceinline__ void raw8(const WRef& w, const u8* rp, int row, int g,
                                                u32& q0, u32& q1, float& d) {
        const int b = g >> 2;
        d = h2f(((const u16*)w.scales)[(i64)row * (w.cols >> 5) + b]);
        const uint2 q = *(const uint2*)(rp + 32 * b + (g & 3) * 8);
        q0 = q.x ^ 0x80808080u;
        q1 = q.y ^ 0x80808080u;
    }
};
typedef OffsetBytes<RQ8_0S, 128, 32> FQ8_0S;

// ---------------------------------------------------------------------------------------------
// MXFP4 (GPT-OSS's experts), ggml's block_mxfp4 { u8 e; u8 qs[16]; } (17 bytes): code q of
// element i (Q4_0's nibble order) gives x = kv[q] * 2^(e - 128), kv the E2M1 values doubled as
// integers {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, ..., -12} (code 8, E2M1's -0, is +0), exactly as
// the CPU decoder (`quant/mxfp4.rs`): the product of a small integer and a power of two is
// exact, so the values are the CPU's bit for bit (subnormal scales included: NVRTC keeps
// denormals unless asked for fast math).
// ---------------------------------------------------------------------------------------------

// 2^(e - 128) as f32, exactly (ggml's GGML_E8M0_TO_FP32_HALF): subnormal for e < 2.
__device__ __forceinline__ float e8m0_half(u32 e) {
    return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}

// The four codes in the bytes of w (each 0..15) as their doubled E2M1 values: the magnitudes
// (0, 1, 2, 3, 4, 6, 8, 12) picked by one byte permute of the three low bits, then the sign of
// bit 3 (a - MAGIC or MAGIC - a: zero stays +0).
__device__ __forceinline__ void e2m1x4(u32 w, float* v) {
    const u32 m = w & 0x07070707u, t = m | (m >> 4);
    const u32 mags = __byte_perm(0x03020100u, 0x0C080604u, (t & 0xffu) | ((t >> 8) & 0xff00u));
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float a = byte_magic(mags, j);
        v[j] = (w >> (8 * j + 3)) & 1u ? MAGIC - a : a - MAGIC;
    }
}

// v[i] = kv(byte i of q0) * d, v[4 + i] likewise of q1 (bytes are codes 0..15).
__device__ __forceinline__ void deq_e2m1x8(u32 q0, u32 q1, float d, float* v) {
    e2m1x4(q0, v);
    e2m1x4(q1, v + 4);
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = __fmul_rn(v[i], d);
}

struct FMXFP4 {  // { u8 e; u8 qs[16]; } as stored (byte reads: blocks are 17 bytes)
    template <bool AL = true>
    static __device__ __forceinline__ void deq8(const WRef& w, const u8* rp, int row, int g,
                                                float* v) {
        const u8* b = rp + (g >> 2) * 17;
        const int p = g & 3, sh = (p >> 1) * 4;
        const u8* q = b + 1 + (p & 1) * 8;
        u32 q0 = 0, q1 = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            q0 |= (u32)q[i] << (8 * i);
            q1 |= (u32)q[4 + i] << (8 * i);
        }
        deq_e2m1x8((q0 >> sh) & 0x0F0F0F0Fu, (q1 >> sh) & 0x0F0F0F0Fu, e8m0_half(b[0]), v);
    }
};

// The split layout made at upload ("mxfp4s", weight.rs `split_blocks` with a one-byte scale):
// the 16 quant bytes of block blk = row * (cols / 32) + b at data + 16 blk (aligned as split
// Q4_0's), the scale byte e at ((u8*)scales)[blk].
struct FMXFP4S {
    template <bool AL = true>
    static __device__ __forceinline__ void deq8(const WRef& w, const u8* rp, int row, int g,
                                                float* v) {
        const int b = g >> 2, p = g & 3, sh = (p >> 1) * 4;
        const float d = e8m0_half(((const u8*)w.scales)[(i64)row * (w.cols >> 5) + b]);
        const uint2 q = *(const uint2*)(rp + 16 * b + (p & 1) * 8);
        deq_e2m1x8((q.x >> sh) & 0x0F0F0F0Fu, (q.y >> sh) & 0x0F0F0F0Fu, d, v);
    }
};

// ---------------------------------------------------------------------------------------------
// k-quants, 256-element super-blocks; `kb` the super-block, `e0` the group's first element in it.
// ---------------------------------------------------------------------------------------------

// Q2_K { u8 scales[16]; u8 qs[64]; half d; half dmin; } (84 bytes). Per 128 elements (n), four
// 2-bit planes (shift 0,2,4,6) of 32 bytes, each plane two 16-element sub-blocks with a 4-bit scale
// and 4-bit min: x = d*sc * q - dmin*m.
struct FQ2_K {
    template <bool AL = true>
    static __device__ __forceinline__ void deq8(const WRef& w, const u8* rp, int row, int g,
                                                float* v) {
        const u8* b = rp + (g >> 5) * 84;
        const int e0 = (g & 31) * 8;
        const int n = e0 >> 7, r = e0 & 127, si = r >> 5, half = (r >> 4) & 1, l0 = r & 15;
        const u32 sc = b[n * 8 + si * 2 + half];
        const float d = h2f(ld_u16(b + 80)), dmin = h2f(ld_u16(b + 82));
        const float dl = __fmul_rn(d, i2f((int)(sc & 15u))), ml = __fmul_rn(dmin, i2f((int)(sc >> 4)));
        const u8* q = b + 16 + n * 32 + half * 16 + l0;
        const u32 q0 = ld_u32_a2(q), q1 = ld_u32_a2(q + 4);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const float x = i2f((int)((byte_of(q0, q1, i) >> (2 * si)) & 3u));
            v[i] = __fsub_rn(__fmul_rn(dl, x), ml);
        }
    }
};

// Q3_K { u8 hmask[32]; u8 qs[64]; u8 scales[12]; half d; } (110 bytes). Layout of q as Q2_K;
// the third bit is hmask[l] bit (4n + plane), *clear* meaning -4; 16 six-bit signed scales.
struct FQ3_K {
    template <bool AL = true>
    static __device__ __forceinline__ void deq8(const WRef& w, const u8* rp, int row, int g,
                                                float* v) {
        const u8* b = rp + (g >> 5) * 110;
        const int e0 = (g & 31) * 8;
        const int n = e0 >> 7, r = e0 & 127, si = r >> 5, half = (r >> 4) & 1;
        const int l = half * 16 + (r & 15);
        const int is = n * 8 + si * 2 + half;
        const u8* sc = b + 96;
        const u32 lo = is < 8 ? (sc[is] & 15u) : (sc[is - 8] >> 4);
        const u32 hi = (sc[8 + (is & 3)] >> (2 * (is >> 2))) & 3u;
        const int s = (int)(lo | (hi << 4)) - 32;
        const float dl = __fmul_rn(h2f(ld_u16(b + 108)), i2f(s));
        const u8* q = b + 32 + n * 32 + l;
        const u32 q0 = ld_u32_a2(q), q1 = ld_u32_a2(q + 4);
        const u32 h0 = ld_u32_a2(b + l), h1 = ld_u32_a2(b + l + 4);
        const int mbit = n * 4 + si;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int low = (int)((byte_of(q0, q1, i) >> (2 * si)) & 3u);
            const int sub = ((byte_of(h0, h1, i) >> mbit) & 1u) ? 0 : 4;
            v[i] = __fmul_rn(dl, i2f(low - sub));
        }
    }
};

// The 6-bit scale and min of sub-block j (0..7) of Q4_K / Q5_K (ggml's get_scale_min_k4).
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, u32& sc, u32& m) {
    if (j < 4) {
        sc = q[j] & 63u;
        m = q[j + 4] & 63u;
    } else {
        sc = (q[j + 4] & 15u) | ((u32)(q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((u32)(q[j] >> 6) << 4);
    }
}

// v[i] = d1 * (byte i of q0) - m1 and v[4 + i] likewise of q1, each product rounded as the CPU
// reference's (Q4_K and its re-laid form).
__device__ __forceinline__ void deq_nibbles_min8(u32 q0, u32 q1, float d1, float m1, float* v) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        v[i] = __fsub_rn(__fmul_rn(d1, byte_magic(q0, i) - MAGIC), m1);
        v[i + 4] = __fsub_rn(__fmul_rn(d1, byte_magic(q1, i) - MAGIC), m1);
    }
}

// deq8 and codes8 of a layout R whose raw8 gives nibbles, d sc and dmin m (Q4_K stored and
// re-laid): x = (d sc) q - (dmin m).
template <class R>
struct NibblesMin : R {
    using R::raw8;
    template <bool AL = true>
    static __device__ __forceinline__ void deq8(const WRef& w, const u8* rp, int row, int g,
                                                float* v) {
        u32 q0, q1;
        float d1, m1;
        raw8(w, rp, row, g, q0, q1, d1, m1);
        deq_nibbles_min8(q0, q1, d1, m1, v);
    }
    static constexpr int MMQ_GROUP = 32;
    static constexpr bool MMQ_OFFSET = true;
    static __device__ __forceinline__ void codes8(const WRef& w, const u8* rp, int row, int g,
                                                  u32& c0, u32& c1, float& a, float& c) {
        raw8(w, rp, row, g, c0, c1, a, c);
        c = -c;
    }
};

// Q4_K { half d; half dmin; u8 scales[12]; u8 qs[128]; } (144 bytes). Per 64 elements (c),
// 32 bytes: low nibbles are elements 0..32 (sub-block 2c), high nibbles 32..64 (sub-block 2c+1).
struct RQ4_K {
    // The group's nibbles (0..15) as bytes, its sub-block's d sc and dmin m.
    static __device__ __forceinline__ void raw8(const WRef& w, const u8* rp, int row, int g,
                                                u32& q0, u32& q1, float& d1, float& m1) {
        const u8* b = rp + (g >> 5) * 144;
        const int e0 = (g & 31) * 8;
        const int c = e0 >> 6, hi = (e0 >> 5) & 1, l0 = e0 & 31;
        u32 sc, m;
        scale_min_k4(2 * c + hi, b + 4, sc, m);
        d1 = __fmul_rn(h2f(ld_u16(b)), i2f((int)sc));
        m1 = __fmul_rn(h2f(ld_u16(b + 2)), i2f((int)m));
        const u8* q = b + 16 + c * 32 + l0;
        q0 = (ld_u32_a2(q) >> (4 * hi)) & 0x0F0F0F0Fu;
        q1 = (ld_u32_a2(q + 4) >> (4 * hi)) & 0x0F0F0F0Fu;
    }
};
typedef NibblesMin<RQ4_K> FQ4_K;

// Q4_K re-laid at upload ("q4_ks", `q4k_split` in weight.rs): sub-block blk = row * (cols / 32)
// + b has its 16 quant bytes in split Q4_0's order (element i in the low nibble of byte i, i + 16
// in the high) at data + 16 blk, its 6-bit scale and min as bytes (sc | m << 8) at
// ((u16*)scales)[blk], and its super-block's f16 d, dmin at ((u32*)biases)[row * (cols / 256) +
// b / 8]. Values as Q4_K's: (d sc) q - (dmin m), each product rounded to f32.
__device__ __forceinline__ void q4ks_scales(const WRef& w, int row, int b, float& d1, float& m1) {
    const u32 sm = ((const u16*)w.scales)[(i64)row * (w.cols >> 5) + b];
    const u32 dd = ((const u32*)w.biases)[(i64)row * (w.cols >> 8) + (b >> 3)];
    d1 = __fmul_rn(h2f((u16)(dd & 0xffffu)), i2f((int)(sm & 0xffu)));
    m1 = __fmul_rn(h2f((u16)(dd >> 16)), i2f((int)(sm >> 8)));
}

struct RQ4_KS {
    // As RQ4_K::raw8.
    static __device__ __forceinline__ void raw8(const WRef& w, const u8* rp, int row, int g,
                                                u32& q0, u32& q1, float& d1, float& m1) {
        const int b = g >> 2, p = g & 3, sh = (p >> 1) * 4;
        q4ks_scales(w, row, b, d1, m1);
        const uint2 q = *(const uint2*)(rp + 16 * b + (p & 1) * 8);
        q0 = (q.x >> sh) & 0x0F0F0F0Fu;
        q1 = (q.y >> sh) & 0x0F0F0F0Fu;
    }
};
typedef NibblesMin<RQ4_KS> FQ4_KS;

// Q5_K { half d; half dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]; } (176 bytes). Q4_K plus a
// fifth bit: qh[l] bit 2c (low nibbles) or 2c+1 (high nibbles).
struct FQ5_K {
    template <bool AL = true>
    static __device__ __forceinline__ void deq8(const WRef& w, const u8* rp, int row, int g,
                                                float* v) {
        const u8* b = rp + (g >> 5) * 176;
        const int e0 = (g & 31) * 8;
        const int c = e0 >> 6, hi = (e0 >> 5) & 1, l0 = e0 & 31;
        u32 sc, m;
        scale_min_k4(2 * c + hi, b + 4, sc, m);
        const float d1 = __fmul_rn(h2f(ld_u16(b)), i2f((int)sc));
        const float m1 = __fmul_rn(h2f(ld_u16(b + 2)), i2f((int)m));
        const u8* q = b + 48 + c * 32 + l0;
        const u32 q0 = ld_u32_a2(q), q1 = ld_u32_a2(q + 4);
        const u32 h0 = ld_u32_a2(b + 16 + l0), h1 = ld_u32_a2(b + 16 + l0 + 4);
        const int hb = 2 * c + hi;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const u32 x = ((byte_of(q0, q1, i) >> (4 * hi)) & 15u) +
                          (((byte_of(h0, h1, i) >> hb) & 1u) << 4);
            v[i] = __fsub_rn(__fmul_rn(d1, i2f((int)x)), m1);
        }
    }
};

// Q6_K { u8 ql[128]; u8 qh[64]; i8 scales[16]; half d; } (210 bytes). Per 128 elements (n) and
// quarter (0..3) of 32: low 4 bits from ql[64n + 32*(quarter&1) + l] (nibble quarter>>1), high 2
// bits from qh[32n + l] bits 2*quarter; x = d * scale * (q - 32).
// STRIDE: 210 as stored, 224 as padded at upload for the one-token kernels (matvec.cuh).
template <int STRIDE>
struct RQ6_Kt {
    // The group's 6-bit values (0..63) as bytes, and d sc.
    static __device__ __forceinline__ void raw8(const WRef& w, const u8* rp, int row, int g,
                                                u32& n0, u32& n1, float& ds) {
        const u8* b = rp + (g >> 5) * STRIDE;
        const int e0 = (g & 31) * 8;
        const int n = e0 >> 7, quarter = (e0 >> 5) & 3, l0 = e0 & 31;
        const float d = h2f(ld_u16(b + 208));
        const float s = i2f((int)(i8)b[192 + n * 8 + (l0 >> 4) + 2 * quarter]);
        ds = __fmul_rn(d, s);
        const u8* ql = b + 64 * n + 32 * (quarter & 1) + l0;
        const u8* qh = b + 128 + 32 * n + l0;
        const u32 q0 = ld_u32_a2(ql), q1 = ld_u32_a2(ql + 4);
        const u32 h0 = ld_u32_a2(qh), h1 = ld_u32_a2(qh + 4);
        const int sh = 4 * (quarter >> 1);
        n0 = ((q0 >> sh) & 0x0F0F0F0Fu) | (((h0 >> (2 * quarter)) & 0x03030303u) << 4);
        n1 = ((q1 >> sh) & 0x0F0F0F0Fu) | (((h1 >> (2 * quarter)) & 0x03030303u) << 4);
    }
};

// Q6_K stored and padded: x = (d sc) (q - 32), a scale per 16.
typedef OffsetBytes<RQ6_Kt<210>, 32, 16> FQ6_K;
typedef OffsetBytes<RQ6_Kt<224>, 32, 16> FQ6_KP;

// Q6_K re-laid at upload ("q6_ks", `q6k_split` in weight.rs), per 32-element unit blk = row *
// (cols / 32) + b, q the unit's 6-bit values (0..63, x = d sc (q - 32)):
//   data + 16 blk: the low four bits in split Q4_0's order (element i in the low nibble of byte
//     i, element i + 16 in the high one);
//   ((uint2*)scales)[blk]: the high two bits, .x of elements 0..15 and .y of 16..31, element
//     4k + j (of its half) at bits 2k, 2k + 1 of byte j, so that word k of the quants takes
//     them with one shift and mask;
//   ((u32*)biases)[blk]: the two sub-block scales (i8: elements 0..15, 16..31) in bytes 0, 1
//     and the super-block's f16 d in bytes 2, 3.
// 224 bytes per 256 weights (Q6_K's 210, its scales and d repeated per unit).
// Word k (0..3) of a half's quants with the high bits of `h` (that half's word of the unit's
// high bits), as bytes 0..63.
__device__ __forceinline__ u32 q6ks_word(u32 q4, u32 h, int k) {
    return (q4 & 0x0F0F0F0Fu) | (((h >> (2 * k)) & 0x03030303u) << 4);
}

struct RQ6_KS {
    // As RQ6_Kt::raw8.
    static __device__ __forceinline__ void raw8(const WRef& w, const u8* rp, int row, int g,
                                                u32& n0, u32& n1, float& ds) {
        const int b = g >> 2, p = g & 3, hi = p >> 1, k0 = 2 * (p & 1);
        const i64 blk = (i64)row * (w.cols >> 5) + b;
        const uint2 q = *(const uint2*)(rp + 16 * b + (p & 1) * 8);
        const uint2 hb = ((const uint2*)w.scales)[blk];
        const u32 s = ((const u32*)w.biases)[blk];
        const u32 h = hi ? hb.y : hb.x;
        ds = __fmul_rn(h2f((u16)(s >> 16)), i2f((int)(i8)((s >> (8 * hi)) & 0xffu)));
        n0 = q6ks_word(q.x >> (4 * hi), h, k0);
        n1 = q6ks_word(q.y >> (4 * hi), h, k0 + 1);
    }
};
typedef OffsetBytes<RQ6_KS, 32, 16> FQ6_KS;

// Q8_K { f32 d; i8 qs[256]; i16 bsums[16]; } (292 bytes): x = d * q.
struct FQ8_K {
    template <bool AL = true>
    static __device__ __forceinline__ void deq8(const WRef& w, const u8* rp, int row, int g,
                                                float* v) {
        const u8* b = rp + (g >> 5) * 292;
        const float d = __uint_as_float(ld_u32_a2(b));
        const u8* q = b + 4 + (g & 31) * 8;
        const u32 q0 = ld_u32_a2(q) ^ 0x80808080u, q1 = ld_u32_a2(q + 4) ^ 0x80808080u;
        deq_bytes8(q0, q1, 128.0f, d, v);
    }
};

// ---------------------------------------------------------------------------------------------
// Dense rows. Any column count: with AL (the caller checked cols % 8 == 0) every group is one
// aligned 16/32-byte load, otherwise elements are read one by one and the tail of the last group
// is zero. AL is a template parameter so that the kernels' inner loops have no branch on it
// (a branch there keeps the compiler from issuing several groups' loads before the first use).
// ---------------------------------------------------------------------------------------------

struct FF32 {
    template <bool AL = true>
    static __device__ __forceinline__ void deq8(const WRef& w, const u8* rp, int row, int g,
                                                float* v) {
        const float* p = (const float*)rp + 8 * g;
        if (AL) {
            const float4 a = ((const float4*)p)[0], c = ((const float4*)p)[1];
            v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
            v[4] = c.x; v[5] = c.y; v[6] = c.z; v[7] = c.w;
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) v[i] = (8 * g + i < w.cols) ? p[i] : 0.0f;
        }
    }
};

struct FF16 {
    template <bool AL = true>
    static __device__ __forceinline__ void deq8(const WRef& w, const u8* rp, int row, int g,
                                                float* v) {
        const u16* p = (const u16*)rp + 8 * g;
        if (AL) {
            const uint4 a = *(const uint4*)p;
            const u32 words[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                v[2 * i] = h2f((u16)(words[i] & 0xffffu));
                v[2 * i + 1] = h2f((u16)(words[i] >> 16));
            }
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) v[i] = (8 * g + i < w.cols) ? h2f(p[i]) : 0.0f;
        }
    }
};

struct FBF16 {
    template <bool AL = true>
    static __device__ __forceinline__ void deq8(const WRef& w, const u8* rp, int row, int g,
                                                float* v) {
        const u16* p = (const u16*)rp + 8 * g;
        if (AL) {
            const uint4 a = *(const uint4*)p;
            const u32 words[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                v[2 * i] = __uint_as_float(words[i] << 16);
                v[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) v[i] = (8 * g + i < w.cols) ? bf2f(p[i]) : 0.0f;
        }
    }
};

// ---------------------------------------------------------------------------------------------
// MLX affine: element k of a row at bit offset k*BITS of the row's little-endian packed words;
// x = q * scale + bias per group of `group_size` (32, 64 or 128). Eight elements are exactly BITS
// bytes, at byte offset 8*g*BITS/8 = g*BITS of the row.
// ---------------------------------------------------------------------------------------------

template <int BITS>
struct FMlx {
    template <bool AL = true>
    static __device__ __forceinline__ void deq8(const WRef& w, const u8* rp, int row, int g,
                                                float* v) {
        const u8* p = rp + g * BITS;
        u64 bits;
        if (BITS == 4) {
            bits = *(const u32*)p;  // rows are C/2 bytes, C a multiple of 32: 4-byte aligned
        } else if (BITS == 8) {
            const uint2 a = *(const uint2*)p;  // 8-byte aligned likewise
            bits = (u64)a.x | ((u64)a.y << 32);
        } else if (BITS == 2) {
            bits = *(const u16*)p;
        } else {
            bits = 0;
#pragma unroll
            for (int k = 0; k < BITS; k++) bits |= (u64)p[k] << (8 * k);
        }
        const int groups = w.cols / w.group_size;
        const int gi = row * groups + (8 * g) / w.group_size;
        const float s = w.scales[gi], bias = w.biases[gi];
        if (BITS == 4) {
            // Even elements are the low nibbles of the four bytes, odd ones the high nibbles.
            const u32 lo = (u32)bits & 0x0F0F0F0Fu, hi = ((u32)bits >> 4) & 0x0F0F0F0Fu;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                v[2 * i] = __fadd_rn(__fmul_rn(byte_magic(lo, i) - MAGIC, s), bias);
                v[2 * i + 1] = __fadd_rn(__fmul_rn(byte_magic(hi, i) - MAGIC, s), bias);
            }
            return;
        }
        if (BITS == 8) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                v[i] = __fadd_rn(__fmul_rn(byte_magic((u32)bits, i) - MAGIC, s), bias);
                v[i + 4] = __fadd_rn(__fmul_rn(byte_magic((u32)(bits >> 32), i) - MAGIC, s), bias);
            }
            return;
        }
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const float q = i2f((int)((bits >> (BITS * i)) & ((1u << BITS) - 1u)));
            v[i] = __fadd_rn(__fmul_rn(q, s), bias);
        }
    }
};
