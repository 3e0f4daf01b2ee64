// Linear / embedding kernels for the 256-element ggml k-quant formats.
#include "linear.cuh"

HF2Q_LINEAR_KERNELS(q2_k, FQ2_K)
HF2Q_LINEAR_KERNELS(q3_k, FQ3_K)
HF2Q_LINEAR_KERNELS(q4_k, FQ4_K)
HF2Q_LINEAR_KERNELS(q5_k, FQ5_K)
HF2Q_LINEAR_KERNELS(q6_k, FQ6_K)
HF2Q_LINEAR_KERNELS(q8_k, FQ8_K)
