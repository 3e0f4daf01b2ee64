// Linear / embedding kernels for the 256-element ggml k-quant formats.
#include "linear.cuh"
#include "matvec.cuh"
#include "matvec_q8.cuh"
#include "matvec_p8.cuh"

HF2Q_LINEAR_KERNELS(q2_k, FQ2_K)
HF2Q_LINEAR_KERNELS(q3_k, FQ3_K)
HF2Q_LINEAR_KERNELS(q4_k, FQ4_K)
HF2Q_LINEAR_KERNELS(q5_k, FQ5_K)
HF2Q_LINEAR_KERNELS(q6_k, FQ6_K)
HF2Q_LINEAR_KERNELS(q8_k, FQ8_K)
HF2Q_LINEAR_KERNELS(q6_kp, FQ6_KP)
HF2Q_MATVEC_FAST(q4_k, DQ4_K)
HF2Q_MATVEC_FAST(q6_kp, DQ6_KP)
HF2Q_MATVEC_Q8(q4_k, EQ4_K)
HF2Q_MATVEC_P8(q4_k, PQ4_K)
HF2Q_MATVEC_Q8(q6_kp, EQ6_KP)
