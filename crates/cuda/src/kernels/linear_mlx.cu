// Linear / embedding kernels for MLX affine weights, one set per bit width.
#include "linear.cuh"

HF2Q_LINEAR_KERNELS(mlx2, FMlx<2>)
HF2Q_LINEAR_KERNELS(mlx3, FMlx<3>)
HF2Q_LINEAR_KERNELS(mlx4, FMlx<4>)
HF2Q_LINEAR_KERNELS(mlx5, FMlx<5>)
HF2Q_LINEAR_KERNELS(mlx6, FMlx<6>)
HF2Q_LINEAR_KERNELS(mlx8, FMlx<8>)
