//! The portable engines: the integer dot of decoded weights (`unpack.rs`) with 8-bit activations
//! (`q8act.rs`), and the f32 dot for float weights, in plain Rust. They run wherever no SIMD
//! engine does and are the simplest statement of what the SIMD engines compute:
//!
//! `out[t][r] = Σ_j (a_j * dx_j) * Σ_{i in j} u_i * q_i  +  Σ_j c_j * sx_j`
//!
//! over the 16-element groups `j` of a row, with `sx_j = dx_j * Σ_{i in j} q_i`.

use super::matmul::{FTile, QTile};
use hf2q_tensor::quant::float::{bf16_bits_to_f32, f16_bits_to_f32};
use hf2q_tensor::GgmlType;

/// One (row, token) integer dot: codes/a/c of the row, q/dx/sx of the token, C elements.
#[inline(always)]
pub fn qdot(k: usize, u: &[u8], a: &[f32], c: &[f32], q: &[i8], dx: &[f32], sx: &[f32]) -> f32 {
    let mut acc = 0f32;
    for j in 0..k / 16 {
        let mut s = 0i32;
        for i in 16 * j..16 * j + 16 {
            s += u[i] as i32 * q[i] as i32;
        }
        acc += a[j] * dx[j] * s as f32 + c[j] * sx[j];
    }
    acc
}

/// The scalar quantized tile: `nr` decoded rows x `nt` tokens.
///
/// # Safety
/// The pointers of `p` must cover `nr` rows and `nt` tokens of `p.k` elements, and `p.out` the
/// `nt` x `nr` outputs at stride `p.ldo`.
pub unsafe fn qtile(nr: usize, nt: usize, p: &QTile) {
    let (k, g) = (p.k, p.k / 16);
    for r in 0..nr {
        let u = std::slice::from_raw_parts(p.codes.add(r * k), k);
        let a = std::slice::from_raw_parts(p.a.add(r * g), g);
        let c = std::slice::from_raw_parts(p.c.add(r * g), g);
        for t in 0..nt {
            let q = std::slice::from_raw_parts(p.qx.add(t * k), k);
            let dx = std::slice::from_raw_parts(p.dx.add(t * g), g);
            let sx = std::slice::from_raw_parts(p.sx.add(t * g), g);
            *p.out.add(t * p.ldo + r) = qdot(k, u, a, c, q, dx, sx);
        }
    }
}

/// Converts element `i` of a float row of type `ty` (F32, F16 or BF16) to f32.
#[inline(always)]
fn felem(ty: GgmlType, row: *const u8, i: usize) -> f32 {
    // SAFETY (of the reads): the caller's row covers i.
    unsafe {
        match ty {
            GgmlType::F32 => f32::from_le_bytes(*(row.add(4 * i) as *const [u8; 4])),
            GgmlType::F16 => {
                f16_bits_to_f32(u16::from_le_bytes(*(row.add(2 * i) as *const [u8; 2])))
            }
            _ => bf16_bits_to_f32(u16::from_le_bytes(*(row.add(2 * i) as *const [u8; 2]))),
        }
    }
}

/// The scalar float tile: f32 dot of `nr` weight rows with `nt` activation rows, eight partial
/// sums like `weight::dot`.
///
/// # Safety
/// As [`qtile`], for the raw rows of `p.w` (stride `p.row_bytes`) and f32 activations.
pub unsafe fn ftile(nr: usize, nt: usize, p: &FTile) {
    let k = p.k;
    for r in 0..nr {
        let row = p.w.add(r * p.row_bytes);
        for t in 0..nt {
            let x = std::slice::from_raw_parts(p.x.add(t * k), k);
            let mut acc = [0f32; 8];
            for (i, xv) in x.iter().enumerate() {
                acc[i % 8] += felem(p.ty, row, i) * xv;
            }
            *p.out.add(t * p.ldo + r) = acc.iter().sum();
        }
    }
}
