//! Fusing an adapter into its base: every targeted weight becomes `W + scale · B·A` (`(out, in)`,
//! summed in f32 after the base weight is decoded), as PEFT's `merge_and_unload` and mlx-lm's
//! `fuse` compute it. The sums are attached to a [`SourceModel`] as deltas, so any writer of
//! `crate::convert` / `crate::quantize` writes the fused model in any format and type.
//!
//! Not here: choosing the output type (the caller's `ConvertTarget`), the layer math at run time
//! (`layers::lora`).

use std::path::Path;

use rayon::prelude::*;

use super::AdapterFactors;
use crate::convert::source::SourceModel;
use crate::Result;

/// `scale · B·A`, `(out, in)` row-major; B `(out, r)`, A `(r, in)`.
pub fn delta(f: &AdapterFactors, m: &super::ModuleFactors) -> Vec<f32> {
    let s = f.scale_of(m);
    let (r, cols) = (m.r, m.cols);
    let mut d = vec![0f32; m.rows * cols];
    d.par_chunks_mut(cols.max(1))
        .enumerate()
        .for_each(|(o, row)| {
            for k in 0..r {
                let bk = s * m.b[o * r + k];
                let a = &m.a[k * cols..(k + 1) * cols];
                row.iter_mut().zip(a).for_each(|(x, &y)| *x += bk * y);
            }
        });
    d
}

/// Checks `f` against the source's weights and attaches every module's delta to `src`
/// (replacing earlier ones). `file` names the adapter in errors. Returns the modules fused.
pub fn fuse_into(src: &mut SourceModel, f: &AdapterFactors, file: &Path) -> Result<usize> {
    let dims = |l: usize, p: &str| {
        src.tensor_by_hf(&format!("model.layers.{l}.{p}.weight"))
            .filter(|t| t.shape.len() == 2)
            .map(|t| (t.rows(), t.cols()))
    };
    f.check(file, src.config.n_layers, &dims)?;
    src.deltas.clear();
    for m in &f.modules {
        src.deltas
            .insert(format!("{}.weight", m.name()), delta(f, m));
    }
    Ok(f.modules.len())
}
