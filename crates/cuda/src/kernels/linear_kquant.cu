// Linear / embedding kernels for the 256-element ggml k-quant formats.
#include "linear.cuh"
#include "matvec.cuh"
#include "matvec_id.cuh"
#include "matvec_q8.cuh"
#include "matvec_p8.cuh"
#include "mmq.cuh"

// Resident blocks asked of each one-token kernel family (`MV_BOUNDS` in matvec.cuh).
#ifndef HF2Q_MV_MINB_Q4_K
#define HF2Q_MV_MINB_Q4_K 0
#endif
#ifndef HF2Q_MV_MINB_Q4_KS
#define HF2Q_MV_MINB_Q4_KS 0
#endif
#ifndef HF2Q_MV_MINB_Q6_KP
#define HF2Q_MV_MINB_Q6_KP 0
#endif
#ifndef HF2Q_MV_MINB_Q6_KS
#define HF2Q_MV_MINB_Q6_KS 0
#endif

HF2Q_LINEAR_KERNELS(q2_k, FQ2_K)
HF2Q_LINEAR_KERNELS(q3_k, FQ3_K)
HF2Q_LINEAR_KERNELS(q4_k, FQ4_K)
HF2Q_LINEAR_KERNELS(q5_k, FQ5_K)
HF2Q_LINEAR_KERNELS(q6_k, FQ6_K)
HF2Q_LINEAR_KERNELS(q8_k, FQ8_K)
HF2Q_LINEAR_KERNELS(q6_kp, FQ6_KP)
HF2Q_LINEAR_KERNELS(q4_ks, FQ4_KS)
HF2Q_LINEAR_KERNELS(q6_ks, FQ6_KS)
HF2Q_MATVEC_FAST(q4_k, DQ4_K, HF2Q_MV_MINB_Q4_K)
HF2Q_MATVEC_ID(q4_k, DQ4_K, HF2Q_MV_MINB_Q4_K)
HF2Q_MATVEC_FAST(q6_kp, DQ6_KP, HF2Q_MV_MINB_Q6_KP)
HF2Q_MATVEC_ID(q6_kp, DQ6_KP, HF2Q_MV_MINB_Q6_KP)
HF2Q_MATVEC_FAST(q4_ks, DQ4_KS, HF2Q_MV_MINB_Q4_KS)
HF2Q_MATVEC_ID(q4_ks, DQ4_KS, HF2Q_MV_MINB_Q4_KS)
HF2Q_MATVEC_FAST(q6_ks, DQ6_KS, HF2Q_MV_MINB_Q6_KS)
HF2Q_MATVEC_ID(q6_ks, DQ6_KS, HF2Q_MV_MINB_Q6_KS)
HF2Q_MATVEC_Q8(q4_k, EQ4_K)
HF2Q_MATVEC_P8(q4_k, PQ4_K)
HF2Q_MATVEC_P8(q4_ks, PQ4_KS)
HF2Q_MATVEC_P8(q6_ks, PQ6_KS)
HF2Q_MATVEC_Q8(q6_kp, EQ6_KP)
HF2Q_MMQ_KERNEL(q4_k, FQ4_K)
HF2Q_MMQ_KERNEL(q4_ks, FQ4_KS)
HF2Q_MMQ_KERNEL(q6_kp, FQ6_KP)
HF2Q_MMQ_KERNEL(q6_ks, FQ6_KS)
