//! `DeviceWeight`: a [`QTensor`] resident on the GPU, in its stored form.
//!
//! The bytes are copied unchanged: ggml blocks (packed structs of 18, 20, ..., 292 bytes, so only
//! 2-byte alignment inside a row is assumed by the kernels), dense f32/f16/bf16 rows, or MLX
//! packed words with their f32 scales and biases. One kernel set per format dequantizes on the
//! fly (`kernels/quant.cuh`); the format picks the kernel names.

use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, DeviceRepr};

use super::{CudaDev, Program};
use crate::{Error, GgmlType, QTensor, Result, WeightData};

/// The kernel argument describing a weight; mirrors `struct WRef` in `kernels/quant.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct WeightArgs {
    pub data: u64,
    pub scales: u64,
    pub biases: u64,
    pub row_bytes: i64,
    pub cols: i32,
    pub group_size: i32,
}

// SAFETY: a plain #[repr(C)] struct of integers with the layout of the device struct.
unsafe impl DeviceRepr for WeightArgs {}

/// A weight `(R, C)` on the device. Built by [`CudaDev::upload_weight`].
pub struct DeviceWeight {
    pub name: String,
    /// R: output features.
    pub rows: usize,
    /// C: input features.
    pub cols: usize,
    /// Kernel-name suffix of the format (`q4_k`, `f16`, `mlx4`, ...).
    pub(crate) kind: &'static str,
    data: CudaSlice<u8>,
    /// MLX affine only: (R, C / group) scales and biases.
    affine: Option<(CudaSlice<f32>, CudaSlice<f32>, usize)>,
    row_bytes: usize,
    /// The format's kernels, looked up once: mv1, mv2, mv4, mv8, gemm, embed.
    pub(crate) kernels: Vec<CudaFunction>,
}

/// Index into [`DeviceWeight::kernels`] of the matrix-vector kernel for up to `nt` tokens
/// (1, 2, 4 or 8), the tiled kernel and the embedding gather.
pub(crate) fn mv_kernel(nt: usize) -> usize {
    match nt {
        1 => 0,
        2 => 1,
        4 => 2,
        _ => 3,
    }
}
pub(crate) const GEMM_KERNEL: usize = 4;
pub(crate) const EMBED_KERNEL: usize = 5;

impl std::fmt::Debug for DeviceWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceWeight({} {}x{} {})",
            self.name, self.rows, self.cols, self.kind
        )
    }
}

fn ggml_kind(ty: GgmlType) -> Option<(&'static str, Program)> {
    use GgmlType::*;
    Some(match ty {
        Q4_0 => ("q4_0", Program::LinearLegacy),
        Q4_1 => ("q4_1", Program::LinearLegacy),
        Q5_0 => ("q5_0", Program::LinearLegacy),
        Q5_1 => ("q5_1", Program::LinearLegacy),
        Q8_0 => ("q8_0", Program::LinearLegacy),
        F32 => ("f32", Program::LinearLegacy),
        F16 => ("f16", Program::LinearLegacy),
        BF16 => ("bf16", Program::LinearLegacy),
        Q2_K => ("q2_k", Program::LinearKquant),
        Q3_K => ("q3_k", Program::LinearKquant),
        Q4_K => ("q4_k", Program::LinearKquant),
        Q5_K => ("q5_k", Program::LinearKquant),
        Q6_K => ("q6_k", Program::LinearKquant),
        Q8_K => ("q8_k", Program::LinearKquant),
        _ => return None,
    })
}

fn mlx_kind(bits: u32) -> Option<&'static str> {
    Some(match bits {
        2 => "mlx2",
        3 => "mlx3",
        4 => "mlx4",
        5 => "mlx5",
        6 => "mlx6",
        8 => "mlx8",
        _ => return None,
    })
}

impl DeviceWeight {
    /// Bytes resident on the device.
    pub fn device_bytes(&self) -> usize {
        self.data.len()
            + self
                .affine
                .as_ref()
                .map_or(0, |(s, b, _)| 4 * (s.len() + b.len()))
    }

    /// Kernel-name suffix of the stored format, e.g. `q4_k` or `mlx4`.
    pub fn kind(&self) -> &'static str {
        self.kind
    }

    pub(crate) fn args(&self, dev: &CudaDev) -> WeightArgs {
        let s = dev.stream();
        let ptr = |b: &CudaSlice<f32>| b.device_ptr(s).0;
        let (scales, biases, group) = match &self.affine {
            Some((sc, bi, g)) => (ptr(sc), ptr(bi), *g),
            None => (0, 0, 0),
        };
        WeightArgs {
            data: self.data.device_ptr(s).0,
            scales,
            biases,
            row_bytes: self.row_bytes as i64,
            cols: self.cols as i32,
            group_size: group as i32,
        }
    }
}

impl CudaDev {
    /// Copies a weight to the device in its stored form (any ggml type hf2q computes with, or
    /// MLX affine at 2, 3, 4, 5, 6 or 8 bits).
    pub fn upload_weight(&self, w: &QTensor) -> Result<DeviceWeight> {
        if w.rows == 0 || w.cols == 0 {
            return Err(Error::Shape(format!(
                "cuda: weight '{}' is empty ({}x{})",
                w.name, w.rows, w.cols
            )));
        }
        if w.rows > i32::MAX as usize || w.cols > i32::MAX as usize {
            return Err(Error::Shape(format!(
                "cuda: weight '{}' ({}x{}) is too large for 32-bit indices",
                w.name, w.rows, w.cols
            )));
        }
        self.bind()?;
        let unsupported = || Error::UnsupportedType {
            ty: w.type_name(),
            tensor: w.name.clone(),
        };
        let (kind, program, data, affine, row_bytes) = match &w.data {
            WeightData::Ggml { ty, data } => {
                let (kind, program) = ggml_kind(*ty).ok_or_else(unsupported)?;
                let rb = ty
                    .row_bytes(w.cols)
                    .ok_or_else(|| Error::Shape(format!("cuda: weight '{}' rows", w.name)))?;
                (kind, program, self.upload(data.as_slice())?, None, rb)
            }
            WeightData::Affine {
                params,
                packed,
                scales,
                biases,
            } => {
                let kind = mlx_kind(params.bits).ok_or_else(unsupported)?;
                let rb = w.cols * params.bits as usize / 8;
                let affine = (
                    self.upload(scales)?,
                    self.upload(biases)?,
                    params.group_size,
                );
                (
                    kind,
                    Program::LinearMlx,
                    self.upload(packed.as_slice())?,
                    Some(affine),
                    rb,
                )
            }
        };
        let kernels = ["mv1", "mv2", "mv4", "mv8", "gemm", "embed"]
            .iter()
            .map(|k| self.function(program, &format!("{k}_{kind}")))
            .collect::<Result<Vec<_>>>()?;
        Ok(DeviceWeight {
            kernels,
            name: w.name.clone(),
            rows: w.rows,
            cols: w.cols,
            kind,
            data,
            affine,
            row_bytes,
        })
    }
}
