// Shared device helpers for every hf2q kernel file.
//
// NVRTC compiles these sources without the CUDA toolkit's headers, so nothing here includes a
// system header: integer types are spelled out and half-precision conversions use PTX `cvt`
// directly (bit patterns travel as unsigned short).
#pragma once

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;

#define FULL_MASK 0xffffffffu

// Programmatic dependent launch (Hopper): the host launches every kernel allowed to start
// before the previous one in the stream has finished; each kernel first waits here until that
// one has completed and its writes are visible (so every read and write after this line is
// ordered as without the overlap), then lets the next kernel be scheduled. What overlaps is
// launch latency and block scheduling, about 1-2 us per kernel boundary. Without the launch
// attribute (or before sm_90) both are no-ops.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Two floats to a packed f16x2 word (low half = a), round to nearest even.
__device__ __forceinline__ u32 pack_h2(float a, float b) {
    return (u32)f2h(a) | ((u32)f2h(b) << 16);
}

// Exact int -> float for |n| < 2^22 on the full-rate ALUs: the bits 0x4B400000 + n are the float
// 1.5 * 2^23 + n (unit last place), so subtracting 1.5 * 2^23 leaves n exactly. A plain (float)n
// goes through the conversion unit, a quarter of the FMA rate, which bounds the dequantizing
// kernels (one conversion per weight) well below the memory bandwidth.
__device__ __forceinline__ float i2f(int n) {
    return __int_as_float(0x4B400000 + n) - 12582912.0f;
}

// The float 2^23 + (byte k of w), built with one byte permute: the bytes (b_k, 0, 0, 0x4B) are
// the bits of 2^23 + b_k. Subtracting a constant then gives the small integer exactly, at one
// permute and one add per element instead of shift, mask and convert.
__device__ __forceinline__ float byte_magic(u32 w, int k) {
    return __int_as_float(__byte_perm(w, 0x4B000000u, 0x7540u | (u32)k));
}
#define MAGIC 8388608.0f

__device__ __forceinline__ float bf2f(u16 h) { return __uint_as_float(((u32)h) << 16); }

// f32 to bf16, round to nearest even (the training kernels' operands).
__device__ __forceinline__ u16 f2bf(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Two floats to a packed bf16x2 word (low half = a), round to nearest even.
__device__ __forceinline__ u32 pack_bf2(float a, float b) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    return r;
}

// s + the squares of v's four values (fused multiply-adds, in order).
__device__ __forceinline__ float sumsq4(float4 v, float s) {
    s = fmaf(v.x, v.x, s);
    s = fmaf(v.y, v.y, s);
    s = fmaf(v.z, v.z, s);
    return fmaf(v.w, v.w, s);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// A 2-byte-aligned little-endian u16 / u32 load. ggml blocks are packed structs of 18, 22, 84 ...
// bytes, so inside a tensor only 2-byte alignment of their fields is guaranteed.
__device__ __forceinline__ u32 ld_u16(const u8* p) { return *(const u16*)p; }
__device__ __forceinline__ u32 ld_u32_a2(const u8* p) {
    return (u32)(*(const u16*)p) | ((u32)(*(const u16*)(p + 2)) << 16);
}

// The gated-MLP activations, shared by the element-wise kernels and the fused matrix-vector
// kernels so both give the same bits. SiLU: g * sigmoid(g). GELU with the tanh approximation (as
// the CPU reference and PyTorch's approximate="tanh").
__device__ __forceinline__ float silu_f(float g) { return g / (1.0f + expf(-g)); }
__device__ __forceinline__ float gelu_tanh_f(float g) {
    const float k = 0.7978846f * (g + 0.044715f * g * g * g);
    return 0.5f * g * (1.0f + tanhf(k));
}

// GPT-OSS's clamped SwiGLU (the CPU reference `op::clamped_swiglu`): g = min(gate, limit),
// u = clamp(up, -limit, limit), (u + 1) * (g / (1 + e^(-alpha g))).
__device__ __forceinline__ float clamped_swiglu_f(float gate, float up, float alpha, float limit) {
    const float g = fminf(gate, limit), u = fminf(fmaxf(up, -limit), limit);
    return (u + 1.0f) * (g / (1.0f + expf(-alpha * g)));
}

// D (16 x 8, f32) += A (16 x 16, f16, row-major) · B (16 x 8, f16, column-major): one warp, the
// fragment layouts of the PTX ISA (a: 4 words, b: 2 words, c/d: 4 floats per lane).
__device__ __forceinline__ void mma_16816(float* c, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
