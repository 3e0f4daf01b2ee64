//! Fast CPU matmul kernels for every weight type hf2q computes with: `out (T, R) = x (T, C) · Wᵀ`
//! for a [`QTensor`] `W (R, C)`. The reference they are held to is [`QTensor::matmul`]
//! (dequantize a row, f32 dot); the contract tests are `tests/kernels_*.rs`.
//!
//! How it works (the same for every quantized type, llama.cpp's idea in a uniform form):
//! - The activation rows are quantized once per call to 8-bit blocks of 32 ([`q8act`]: one f32
//!   scale per 32 values, like ggml's Q8_0, plus the block sums the offsets need). By default
//!   ([`ActBits::Split16`]) each row is quantized in two 8-bit parts, `dx * (q + l / 256)`, and
//!   the engines multiply the 2T rows (first parts, then remainders) and add the halves: 16-bit
//!   accuracy from 8-bit multiplies. [`ActBits::Q8`] keeps one part (llama.cpp's rounding).
//! - A tile of weight rows is decoded ([`unpack`]) into unsigned 8-bit codes `u` with, per 16
//!   elements, a scale `a` and an offset `c`, so that the weight is `a * u + c`. Every ggml block
//!   format and MLX affine fits this form (Q4_0: `a = d`, `c = -8d`; Q4_K: `a = d * sc`,
//!   `c = -dmin * m`; ...).
//! - An integer engine per ISA (`dot_x86.rs`, `dot_neon.rs`, [`scalar`]) forms `Σ u * q` with
//!   8-bit multiplies (AVX-512 VNNI `vpdpbusd`, AVX2 `vpmaddubsw`), scales each 16-element
//!   partial sum by `a * dx` in f32, and adds the offsets as `Σ c * (dx * Σ q)`.
//! - Each decoded tile is reused for all T activation rows (`matmul.rs`), so prefill decodes every
//!   weight block once per call; rayon splits the output rows.
//! - Two AVX-512 VNNI specialisations on top: at T = 1 the 32-element ggml blocks are decoded in
//!   registers and dotted without scratch (`fused_x86.rs`: the decode is the whole cost of a
//!   matvec); at T >= 2 a 16-row panel is laid out row-interleaved (the 32-element ggml blocks
//!   straight from the mapped bytes) so one `vpdpbusd` serves 16 rows and the f32 work per
//!   multiply-add drops 5x, and the two activation parts meet in one integer sum
//!   (`gemm_x86.rs`).
//! - Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K can be packed once into 16-row groups
//!   ([`pack`], [`linear_packed`]; `packed.rs`): the one-token kernel then multiplies 16 rows per
//!   `vpdpbusd` with no per-row work and streams at memory speed, and the GEMM panels are laid
//!   out from it with a mask and a shift. `CpuBackend` packs the weights it runs on the fast
//!   paths.
//!
//! MXFP4 (GPT-OSS's experts) is the same integer product, its non-uniform E2M1 codes made
//! unsigned codes through a 16-entry table (`mxfp4.rs`): the generic engines on every ISA, and
//! on AVX-512 VNNI the fused one-token kernel and the GEMM panels straight from its blocks.
//!
//! F32 / F16 / BF16 weights take an f32 FMA path (converted on the fly), no activation rounding.
//!
//! The ISA is picked at run time (the best the CPU has); [`set_isa_override`] forces one (for
//! tests and benchmarks), and [`linear_with`] runs one path directly.
//!
//! Not here: attention, norms and the rest of the op set (they stay in `cpu/mod.rs`).

#[cfg(target_arch = "aarch64")]
mod dot_neon;
#[cfg(target_arch = "x86_64")]
mod dot_x86;
#[cfg(target_arch = "x86_64")]
mod float_x86;
#[cfg(target_arch = "x86_64")]
mod fused_x86;
#[cfg(target_arch = "x86_64")]
mod gemm_x86;
/// The 32-element ggml formats as the x86 kernels number them (fused decode and GEMM panels).
#[cfg(target_arch = "x86_64")]
mod legacy {
    pub(super) const Q4_0: u8 = 0;
    pub(super) const Q4_1: u8 = 1;
    pub(super) const Q5_0: u8 = 2;
    pub(super) const Q5_1: u8 = 3;
    pub(super) const Q8_0: u8 = 4;
    /// One E8M0 scale byte, then Q4_0's nibble order; codes through a table (`mxfp4.rs`).
    pub(super) const MXFP4: u8 = 5;

    /// Bytes per block.
    pub(super) const fn block_bytes(f: u8) -> usize {
        match f {
            Q4_0 => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            MXFP4 => 17,
            _ => 34,
        }
    }

    /// Offset of the packed quants in a block.
    pub(super) const fn qs_at(f: u8) -> usize {
        match f {
            MXFP4 => 1,
            Q4_0 | Q8_0 => 2,
            Q4_1 => 4,
            Q5_0 => 6,
            _ => 8,
        }
    }
}
mod matmul;
mod mxfp4;
mod packed;
pub use packed::{PackArena, Packed};
pub mod q8act;
pub use q8act::ActBits;
pub mod scalar;
pub mod unpack;

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use hf2q_tensor::{Error, QTensor, Result};

/// An instruction-set level a kernel is written for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable Rust; always available.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C (Haswell, Zen 1 and later): `vpmaddubsw` integer dots.
    Avx2,
    /// x86-64 AVX-512 F/BW/VL + VNNI (Ice Lake, Zen 4 and later): `vpdpbusd` on 512-bit vectors.
    Avx512Vnni,
    /// aarch64 Advanced SIMD (baseline on every aarch64 CPU).
    Neon,
}

impl Isa {
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni, Isa::Neon];

    /// Whether this CPU can run the kernels of this level.
    pub fn is_available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                Isa::Avx2.is_available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => true,
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The best level this CPU runs (detected once).
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            [Isa::Avx512Vnni, Isa::Avx2, Isa::Neon]
                .into_iter()
                .find(|i| i.is_available())
                .unwrap_or(Isa::Scalar)
        })
    }

    /// Every level this CPU runs, scalar first.
    pub fn available() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_available()).collect()
    }

    fn code(self) -> u8 {
        match self {
            Isa::Scalar => 1,
            Isa::Avx2 => 2,
            Isa::Avx512Vnni => 3,
            Isa::Neon => 4,
        }
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512Vnni => "avx512vnni",
            Isa::Neon => "neon",
        })
    }
}

/// 0: no override; otherwise `Isa::code`.
static OVERRIDE: AtomicU8 = AtomicU8::new(0);

/// Forces every later [`linear`] call (process-wide) onto one ISA level, or back to the best
/// available with `None`. Errors if this CPU cannot run the level asked for.
pub fn set_isa_override(isa: Option<Isa>) -> Result<()> {
    match isa {
        None => OVERRIDE.store(0, Ordering::Relaxed),
        Some(i) if i.is_available() => OVERRIDE.store(i.code(), Ordering::Relaxed),
        Some(i) => return Err(Error::Msg(format!("this CPU cannot run the {i} kernels"))),
    }
    Ok(())
}

/// The level [`linear`] uses now: the override if one is set, else [`Isa::best`].
pub fn active_isa() -> Isa {
    let c = OVERRIDE.load(Ordering::Relaxed);
    Isa::ALL
        .into_iter()
        .find(|i| i.code() == c)
        .unwrap_or_else(Isa::best)
}

/// `out (T, R) = x (T, C) · Wᵀ` with the fastest kernels this CPU has (see the module header).
/// Quantized weights compute against activations quantized as `bits` says (error bounds in
/// `q8act`); float weights in f32.
pub fn linear(w: &QTensor, x: &[f32], t: usize, out: &mut [f32], bits: ActBits) -> Result<()> {
    linear_with(active_isa(), bits, w, x, t, out)
}

/// [`linear`] on one ISA level; errors if this CPU cannot run it.
pub fn linear_with(
    isa: Isa,
    bits: ActBits,
    w: &QTensor,
    x: &[f32],
    t: usize,
    out: &mut [f32],
) -> Result<()> {
    checked_run(isa, bits, w, None, x, t, out)
}

/// The checks every entry point makes, then the product.
fn checked_run(
    isa: Isa,
    bits: ActBits,
    w: &QTensor,
    packed: Option<&Packed>,
    x: &[f32],
    t: usize,
    out: &mut [f32],
) -> Result<()> {
    if !isa.is_available() {
        return Err(Error::Msg(format!("this CPU cannot run the {isa} kernels")));
    }
    let (r, c) = (w.rows, w.cols);
    let need_x = t.checked_mul(c);
    let need_out = t.checked_mul(r);
    if need_x != Some(x.len()) || need_out != Some(out.len()) {
        return Err(Error::Shape(format!(
            "linear with '{}' ({r}x{c}): x has {} values, out {}, for T={t}",
            w.name,
            x.len(),
            out.len()
        )));
    }
    check_storage(w)?;
    if t == 0 || r == 0 {
        return Ok(());
    }
    matmul::run(isa, bits, w, packed, x, t, out)
}

/// `w` re-laid out for the fastest kernels this CPU has, where they read a layout of their own
/// (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q5_K on AVX-512 VNNI, Q6_K with VBMI too: 16 rows
/// interleaved, `packed.rs`); `None` for every other weight and CPU. The copy is about as large
/// as `w`'s bytes, whose mapped pages (if `w` is in a mapped file) are handed back as they are
/// copied; run it with [`linear_packed`].
pub fn pack(w: &QTensor) -> Option<Packed> {
    pack_in(&mut PackArena::new(), w)
}

/// [`pack`] into `arena`: weights packed one after another lie one after another in memory.
pub fn pack_in(arena: &mut PackArena, w: &QTensor) -> Option<Packed> {
    if active_isa() != Isa::Avx512Vnni || check_storage(w).is_err() {
        return None;
    }
    arena.pack(w)
}

/// Whether [`pack`] would make a packed copy of `w` (cheap: format, shape and CPU only).
pub fn packs(w: &QTensor) -> bool {
    active_isa() == Isa::Avx512Vnni && Packed::fits(w)
}

/// [`linear`] reading `packed` (made by [`pack`] from `w`) instead of `w`'s bytes, with the same
/// results up to f32 summation order. On a CPU or ISA override without the packed kernels it
/// runs on `w` itself.
pub fn linear_packed(
    w: &QTensor,
    packed: &Packed,
    x: &[f32],
    t: usize,
    out: &mut [f32],
    bits: ActBits,
) -> Result<()> {
    linear_packed_with(active_isa(), bits, w, packed, x, t, out)
}

/// [`linear_packed`] on one ISA level; errors if this CPU cannot run it or `packed` is not
/// the packed form of a weight of `w`'s type and shape.
pub fn linear_packed_with(
    isa: Isa,
    bits: ActBits,
    w: &QTensor,
    packed: &Packed,
    x: &[f32],
    t: usize,
    out: &mut [f32],
) -> Result<()> {
    if !packed.matches(w) {
        return Err(Error::Shape(format!(
            "linear with '{}' ({}x{}): the packed copy given ({packed:?}) is of another weight",
            w.name, w.rows, w.cols
        )));
    }
    checked_run(isa, bits, w, Some(packed), x, t, out)
}

/// The kernels read weights through raw pointers: re-check that the stored lengths match the
/// shape (`QTensor`'s constructors do, but its fields are public).
fn check_storage(w: &QTensor) -> Result<()> {
    let bad = || {
        Error::Shape(format!(
            "tensor '{}': stored data does not match its {}x{} shape",
            w.name, w.rows, w.cols
        ))
    };
    match &w.data {
        hf2q_tensor::WeightData::Ggml { ty, data } => {
            let rb = ty.row_bytes(w.cols).ok_or_else(bad)?;
            if rb.checked_mul(w.rows) != Some(data.len()) {
                return Err(bad());
            }
        }
        hf2q_tensor::WeightData::Affine {
            params,
            packed,
            scales,
            biases,
        } => {
            params.validate()?;
            let groups = w
                .rows
                .checked_mul(w.cols / params.group_size)
                .ok_or_else(bad)?;
            let bytes = w
                .rows
                .checked_mul(w.cols * params.bits as usize / 8)
                .ok_or_else(bad)?;
            if !w.cols.is_multiple_of(params.group_size)
                || packed.len() != bytes
                || scales.len() != groups
                || biases.len() != groups
            {
                return Err(bad());
            }
        }
    }
    Ok(())
}
