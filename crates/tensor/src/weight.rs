//! `QTensor`: a 2-D weight `(R, C)` (R output rows, C input columns; ggml's ne1 = R, ne0 = C)
//! kept in its stored form. Dense, ggml-block and MLX-affine weights differ only here.
//!
//! The reference matmul dequantizes one row at a time into scratch and accumulates in f32; it is
//! the slow, obvious path every fast kernel is held to.

use rayon::prelude::*;

use crate::quant::{self, mlx::AffineParams};
use crate::{Bytes, Error, GgmlType, Result};

#[derive(Clone, Debug)]
pub enum WeightData {
    /// `R` rows of `ty.row_bytes(C)` bytes each.
    Ggml { ty: GgmlType, data: Bytes },
    /// MLX affine: `packed` (R, C*bits/32) uint32 words, `scales`/`biases` (R, C/group) as f32.
    Affine {
        params: AffineParams,
        packed: Bytes,
        scales: Vec<f32>,
        biases: Vec<f32>,
    },
}

#[derive(Clone, Debug)]
pub struct QTensor {
    pub name: String,
    /// R: output features.
    pub rows: usize,
    /// C: input features.
    pub cols: usize,
    pub data: WeightData,
}

impl QTensor {
    /// A ggml-typed weight; checks the byte count and that the type is one hf2q computes with.
    pub fn ggml(
        name: &str,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: Bytes,
    ) -> Result<QTensor> {
        if !ty.is_supported() {
            return Err(Error::UnsupportedType {
                ty: ty.to_string(),
                tensor: name.to_string(),
            });
        }
        let rb = ty.row_bytes(cols).ok_or_else(|| {
            Error::Shape(format!(
                "tensor '{name}': {cols} columns is not a whole number of {ty} blocks"
            ))
        })?;
        let need = rb
            .checked_mul(rows)
            .ok_or_else(|| Error::Shape(format!("tensor '{name}': size overflows")))?;
        if data.len() != need {
            return Err(Error::Shape(format!(
                "tensor '{name}': {} bytes of data, {} expected for {rows}x{cols} {ty}",
                data.len(),
                need
            )));
        }
        Ok(QTensor {
            name: name.to_string(),
            rows,
            cols,
            data: WeightData::Ggml { ty, data },
        })
    }

    /// A dense f32 weight from values (used for small tensors and tests).
    pub fn from_f32(name: &str, rows: usize, cols: usize, values: &[f32]) -> Result<QTensor> {
        let mut b = Vec::with_capacity(values.len() * 4);
        for v in values {
            b.extend_from_slice(&v.to_le_bytes());
        }
        QTensor::ggml(name, GgmlType::F32, rows, cols, Bytes::from_vec(b))
    }

    /// An MLX affine weight; checks every length against the shape and parameters.
    pub fn affine(
        name: &str,
        params: AffineParams,
        rows: usize,
        cols: usize,
        packed: Bytes,
        scales: Vec<f32>,
        biases: Vec<f32>,
    ) -> Result<QTensor> {
        let bad = |m: String| Error::Shape(format!("tensor '{name}': {m}"));
        if !matches!(params.bits, 2 | 3 | 4 | 5 | 6 | 8)
            || !matches!(params.group_size, 32 | 64 | 128)
        {
            return Err(bad(format!(
                "unsupported affine bits {} / group {}",
                params.bits, params.group_size
            )));
        }
        if !cols.is_multiple_of(params.group_size)
            || !(cols * params.bits as usize).is_multiple_of(32)
        {
            return Err(bad(format!(
                "{cols} columns do not fit group {} at {} bits",
                params.group_size, params.bits
            )));
        }
        let groups = rows
            .checked_mul(cols / params.group_size)
            .ok_or_else(|| bad("size overflows".into()))?;
        let pbytes = rows
            .checked_mul(cols * params.bits as usize / 8)
            .ok_or_else(|| bad("size overflows".into()))?;
        if packed.len() != pbytes {
            return Err(bad(format!(
                "packed weight has {} bytes, {} expected",
                packed.len(),
                pbytes
            )));
        }
        if scales.len() != groups || biases.len() != groups {
            return Err(bad(format!(
                "{} scales and {} biases, {} groups expected",
                scales.len(),
                biases.len(),
                groups
            )));
        }
        Ok(QTensor {
            name: name.to_string(),
            rows,
            cols,
            data: WeightData::Affine {
                params,
                packed,
                scales,
                biases,
            },
        })
    }

    /// Rows `start..start+n` as a weight of its own named `name`: the stored bytes shared, not
    /// copied (an MLX weight's scales and biases are copied).
    pub fn row_range(&self, start: usize, n: usize, name: &str) -> Result<QTensor> {
        if start.checked_add(n).is_none_or(|end| end > self.rows) {
            return Err(Error::Shape(format!(
                "rows {start}..{} of '{}', which has {}",
                start.saturating_add(n),
                self.name,
                self.rows
            )));
        }
        match &self.data {
            WeightData::Ggml { ty, data } => {
                let rb = ty.row_bytes(self.cols).expect("checked at construction");
                QTensor::ggml(
                    name,
                    *ty,
                    n,
                    self.cols,
                    data.slice(start * rb..(start + n) * rb)?,
                )
            }
            WeightData::Affine {
                params,
                packed,
                scales,
                biases,
            } => {
                let rb = self.cols * params.bits as usize / 8;
                let g = self.cols / params.group_size;
                QTensor::affine(
                    name,
                    *params,
                    n,
                    self.cols,
                    packed.slice(start * rb..(start + n) * rb)?,
                    scales[start * g..(start + n) * g].to_vec(),
                    biases[start * g..(start + n) * g].to_vec(),
                )
            }
        }
    }

    /// A short description of the stored type, e.g. `Q4_K` or `mlx4g64`.
    pub fn type_name(&self) -> String {
        match &self.data {
            WeightData::Ggml { ty, .. } => ty.to_string(),
            WeightData::Affine { params, .. } => {
                format!("mlx{}g{}", params.bits, params.group_size)
            }
        }
    }

    /// Stored bytes (including scales and biases for affine, counted at 16 bits as MLX stores them).
    pub fn stored_bytes(&self) -> usize {
        match &self.data {
            WeightData::Ggml { data, .. } => data.len(),
            WeightData::Affine {
                packed,
                scales,
                biases,
                ..
            } => packed.len() + 2 * (scales.len() + biases.len()),
        }
    }

    pub fn numel(&self) -> usize {
        self.rows * self.cols
    }

    /// Dequantizes row `r` into `dst` (`C` elements).
    pub fn dequantize_row(&self, r: usize, dst: &mut [f32]) -> Result<()> {
        if r >= self.rows || dst.len() != self.cols {
            return Err(Error::Shape(format!(
                "tensor '{}': row {r} / {} columns requested of {}x{}",
                self.name,
                dst.len(),
                self.rows,
                self.cols
            )));
        }
        match &self.data {
            WeightData::Ggml { ty, data } => {
                let rb = ty.row_bytes(self.cols).expect("checked at construction");
                quant::dequantize(*ty, &data.as_slice()[r * rb..(r + 1) * rb], dst)
            }
            WeightData::Affine {
                params,
                packed,
                scales,
                biases,
            } => {
                let rb = self.cols * params.bits as usize / 8;
                let g = self.cols / params.group_size;
                quant::mlx::dequantize_affine(
                    *params,
                    &packed.as_slice()[r * rb..(r + 1) * rb],
                    &scales[r * g..(r + 1) * g],
                    &biases[r * g..(r + 1) * g],
                    dst,
                )
            }
        }
    }

    /// The whole weight as f32, `(R, C)` row-major.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let mut out = vec![0f32; self.rows * self.cols];
        out.par_chunks_mut(self.cols.max(1))
            .enumerate()
            .try_for_each(|(r, dst)| self.dequantize_row(r, dst))?;
        Ok(out)
    }

    /// Reference matmul: `out (T, R) = x (T, C) · Wᵀ`, f32 accumulation over dequantized rows.
    pub fn matmul(&self, x: &[f32], t: usize, out: &mut [f32]) -> Result<()> {
        let (r, c) = (self.rows, self.cols);
        if x.len() != t * c || out.len() != t * r {
            return Err(Error::Shape(format!(
                "matmul with '{}' ({r}x{c}): x has {} values, out {}, for T={t}",
                self.name,
                x.len(),
                out.len()
            )));
        }
        // Rows are processed in chunks; each chunk writes a (rows_in_chunk, T) block of the
        // transposed result, which is scattered into `out` afterwards.
        const CHUNK: usize = 16;
        let mut tr = vec![0f32; r * t];
        tr.par_chunks_mut(CHUNK * t)
            .enumerate()
            .try_for_each(|(ci, block)| -> Result<()> {
                let mut row = vec![0f32; c];
                for (j, dst) in block.chunks_mut(t).enumerate() {
                    self.dequantize_row(ci * CHUNK + j, &mut row)?;
                    for (ti, d) in dst.iter_mut().enumerate() {
                        *d = dot(&row, &x[ti * c..(ti + 1) * c]);
                    }
                }
                Ok(())
            })?;
        for ri in 0..r {
            for ti in 0..t {
                out[ti * r + ri] = tr[ri * t + ti];
            }
        }
        Ok(())
    }
}

/// f32 dot product with eight partial sums (the compiler vectorises it; the order is fixed, so
/// results are deterministic).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = [0f32; 8];
    let chunks = n / 8;
    for i in 0..chunks {
        for k in 0..8 {
            acc[k] += a[i * 8 + k] * b[i * 8 + k];
        }
    }
    let mut s = 0f32;
    for i in chunks * 8..n {
        s += a[i] * b[i];
    }
    s + acc.iter().sum::<f32>()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn matmul_matches_naive() {
        let (r, c, t) = (37, 19, 5);
        let w: Vec<f32> = (0..r * c)
            .map(|i| ((i * 7919) % 23) as f32 * 0.1 - 1.0)
            .collect();
        let x: Vec<f32> = (0..t * c)
            .map(|i| ((i * 104729) % 17) as f32 * 0.05 - 0.4)
            .collect();
        let q = QTensor::from_f32("w", r, c, &w).unwrap();
        let mut out = vec![0f32; t * r];
        q.matmul(&x, t, &mut out).unwrap();
        for ti in 0..t {
            for ri in 0..r {
                let want: f32 = (0..c).map(|k| w[ri * c + k] * x[ti * c + k]).sum();
                assert!((out[ti * r + ri] - want).abs() < 1e-4);
            }
        }
        assert!(q.matmul(&x, t + 1, &mut out).is_err());
    }

    #[test]
    fn unsupported_and_inconsistent_weights_are_named() {
        let e = QTensor::ggml(
            "blk.0.attn_q.weight",
            GgmlType::IQ2_XXS,
            2,
            256,
            Bytes::from_vec(vec![0; 132]),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "unsupported tensor type IQ2_XXS for tensor 'blk.0.attn_q.weight'"
        );
        let e =
            QTensor::ggml("w", GgmlType::Q4_0, 2, 64, Bytes::from_vec(vec![0; 10])).unwrap_err();
        assert!(
            e.to_string()
                .contains("tensor 'w': 10 bytes of data, 72 expected"),
            "{e}"
        );
        let e =
            QTensor::ggml("w", GgmlType::Q4_K, 1, 576, Bytes::from_vec(vec![0; 10])).unwrap_err();
        assert!(
            e.to_string().contains("not a whole number of Q4_K blocks"),
            "{e}"
        );
    }
}
