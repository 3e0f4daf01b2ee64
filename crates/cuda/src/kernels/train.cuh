// Device helpers of the training kernels (train.cu, train_attn.cu): bf16 tensor-core products,
// asynchronous copies into shared memory, and the row layout of a packed batch.
#pragma once
#include "common.cuh"

// D (16 x 8, f32) += A (16 x 16, bf16, row-major) · B (16 x 8, bf16, column-major): one warp,
// the fragment layouts of the PTX ISA (as `mma_16816`, with bf16 operands: f32's exponent range,
// so gradients neither overflow nor flush to zero).
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ u32 tr_smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// Four 8 x 8 16-bit matrices, transposed on the way: lanes 8i .. 8i + 7 name the rows of
// matrix i.
__device__ __forceinline__ void tr_ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// 16 bytes from global to shared memory without passing through registers; `full` false
// writes zeros instead (rows past the end of the batch).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool full) {
    const u32 s = tr_smem_addr(smem);
    const int n = full ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(n)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
// Waits until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ float tr_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

#define TR_NEG_INF (-__int_as_float(0x7f800000))
#define TR_LOG2E 1.4426950408889634f
#define TR_LN2 0.6931471805599453f

// The first key row `row` may attend to: its sequence's start (`seq[row].x`), and with a window
// w > 0 no key at distance >= w. `seq[row]` is (start, end) of the row's sequence.
__device__ __forceinline__ int first_visible(const int2* seq, int row, int window) {
    const int s = seq[row].x;
    return window > 0 ? max(s, row + 1 - window) : s;
}
