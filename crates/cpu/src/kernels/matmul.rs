//! The driver: activation quantization once per call, rayon over output rows, and the tiling
//! that makes each decoded weight tile serve every activation row.
//!
//! Loop nest for a quantized weight (R rows, C columns, T tokens):
//! ```text
//! quantize x (T, C) -> 8-bit blocks                          (once, rows over rayon if T >= 16)
//! par over tasks (contiguous row ranges):
//!   for panel of P rows (P = NR for T < 16 so the panel stays in L1, 64 otherwise):
//!     decode the panel into scratch (codes, a, c)            (each weight block read once)
//!     for token tile of NT tokens:
//!       for row tile of NR rows: engine tile (NR x NT dot products over all of C)
//! ```
//! The decoded panel is read T/NT times from cache, the activations R/P times. Scratch lives in
//! thread-locals (per worker: the decoded panel; per caller: the quantized activations) that grow
//! to the largest shape seen and are then reused: no allocation per call in steady state.
//!
//! ISA tables may replace two steps: a fused `matvec` for T = 1 (no panel, no scratch) and a
//! `gemm` panel function for T >= 2 (AVX-512: 16-row interleaved panels, `gemm_x86.rs`), which
//! also takes two-part activations as T pairs and adds the parts in its integer sums (no
//! temporary 2T-row output and no second pass).
//!
//! Float weights (F32/F16/BF16) skip decoding: the engine converts rows on the fly.

use std::cell::RefCell;

use rayon::prelude::*;

use super::q8act::{self, ActBits, ActQ8};
use super::unpack::{unpack_rows, WView};
use super::{scalar, Isa};
use hf2q_tensor::{Error, GgmlType, QTensor, Result, WeightData};

/// One quantized tile for an engine: `nr` decoded rows and `nt` quantized tokens.
pub struct QTile {
    /// C.
    pub k: usize,
    /// Codes use all 8 bits (see `unpack.rs`).
    pub wide: bool,
    /// (nr, C) codes, (nr, C/16) scales `a` and offsets `c`.
    pub codes: *const u8,
    pub a: *const f32,
    pub c: *const f32,
    /// (nt, C) activations, (nt, C/16) `dx` and `sx`.
    pub qx: *const i8,
    pub dx: *const f32,
    pub sx: *const f32,
    /// `out[t * ldo + r]` for t < nt, r < nr.
    pub out: *mut f32,
    pub ldo: usize,
}

/// One float tile: `nr` raw rows of `ty` (F32/F16/BF16) and `nt` f32 activation rows.
pub struct FTile {
    pub k: usize,
    pub ty: GgmlType,
    /// First row; rows `row_bytes` apart.
    pub w: *const u8,
    pub row_bytes: usize,
    /// (nt, C).
    pub x: *const f32,
    pub out: *mut f32,
    pub ldo: usize,
}

pub type QTileFn = unsafe fn(usize, usize, &QTile);
pub type FTileFn = unsafe fn(usize, usize, &FTile);
pub type PanelFn = unsafe fn(&PanelArgs<'_>, &mut Scratch);
pub type MatvecFn = unsafe fn(&WView<'_>, usize, usize, &ActQ8, bool, *mut f32) -> bool;

/// Decoded weight panel of one worker.
#[derive(Default)]
pub struct Scratch {
    pub codes: Vec<u8>,
    pub a: Vec<f32>,
    pub c: Vec<f32>,
    /// The same panel rearranged for a GEMM kernel (`gemm_x86.rs`).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub icodes: Vec<u32>,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub ia: Vec<f32>,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub ic: Vec<f32>,
}

impl Scratch {
    fn reserve(&mut self, rows: usize, k: usize) {
        if self.codes.len() < rows * k {
            self.codes.resize(rows * k, 0);
        }
        if self.a.len() < rows * k / 16 {
            self.a.resize(rows * k / 16, 0.0);
            self.c.resize(rows * k / 16, 0.0);
        }
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
    static ACT: RefCell<ActQ8> = RefCell::new(ActQ8::default());
    static SPLIT_OUT: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on this thread's reusable buffer, or on a fresh one if the buffer is already in use
/// (a `linear` nested inside another on the same thread, e.g. from a task rayon ran while this
/// thread waited): never a `RefCell` panic.
fn with_reused<B: Default + 'static, R>(
    key: &'static std::thread::LocalKey<RefCell<B>>,
    f: impl FnOnce(&mut B) -> R,
) -> R {
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut b) => f(&mut b),
        Err(_) => f(&mut B::default()),
    })
}

/// The output pointer shared by the tasks; each task writes a disjoint set of columns.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint output elements (their own row range) and the caller's `&mut`
// outlives the parallel loop.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// A method (not the field) so closures capture the whole `Send` wrapper.
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Rows per panel for T tokens (see the module header).
fn panel_rows(t: usize, nr: usize) -> usize {
    if t < 16 {
        nr
    } else {
        64
    }
}

/// Row ranges for the tasks: multiples of `unit`, about 4 tasks per thread (load balance)
/// but not less than 32 rows each for matvecs (scheduling cost).
fn tasks(r: usize, unit: usize, t: usize) -> Vec<(usize, usize)> {
    let threads = rayon::current_num_threads().max(1);
    let min_rows = if t < 16 { 32 } else { unit };
    let per = r.div_ceil(threads * 4).max(min_rows).div_ceil(unit) * unit;
    (0..r)
        .step_by(per)
        .map(|r0| (r0, (r0 + per).min(r)))
        .collect()
}

/// Runs `f` on every task: on the calling thread when there is one task or one thread (a
/// handoff to a sleeping pool worker costs tens of microseconds, as much as a small matvec),
/// else over rayon.
fn for_each_task(tasks: Vec<(usize, usize)>, f: impl Fn((usize, usize)) + Send + Sync) {
    if tasks.len() <= 1 || rayon::current_num_threads() <= 1 {
        tasks.into_iter().for_each(f);
    } else {
        tasks.into_par_iter().for_each(f);
    }
}

/// The per-ISA pieces the driver needs (each ISA module defines one as a const).
pub(crate) struct Kernels {
    pub quantize_row: q8act::QuantRowFn,
    pub quantize_row_split: q8act::SplitRowFn,
    /// Decodes a panel and runs the tiles over it: the ISA's `#[target_feature]` wrapper of
    /// [`quant_panel`].
    pub panel: PanelFn,
    pub ftile: FTileFn,
    /// Fused T = 1 kernel for some formats: rows r0..r1 into `out[r]`; false if the format is
    /// not one it handles.
    pub matvec: Option<MatvecFn>,
    /// Panel function and panel rows for T >= 16, when the ISA has a dedicated GEMM.
    pub gemm: Option<(PanelFn, usize)>,
    /// Rows and tokens per engine tile.
    pub nr: usize,
    pub nt: usize,
}

/// One panel's work: rows `r0..r0 + n` of `w` against all of `act`.
pub struct PanelArgs<'a> {
    pub w: &'a WView<'a>,
    pub r0: usize,
    pub n: usize,
    pub act: &'a ActQ8,
    pub out: *mut f32,
    /// R (the output row stride).
    pub ldo: usize,
    /// `act` holds two-part rows (T first parts, then T remainders) and `out` T rows, each the
    /// sum of both parts' products (only the ISA `gemm` panels take this).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub split: bool,
}

/// The generic panel loop; each ISA instantiates it inside a `#[target_feature]` function so
/// that `unpack_rows` is compiled (vectorised) for that ISA.
///
/// # Safety
/// `p.out` must cover the (T, R) output; `tile` must be runnable on this CPU.
#[inline(always)]
pub unsafe fn quant_panel(p: &PanelArgs<'_>, s: &mut Scratch, nr: usize, nt: usize, tile: QTileFn) {
    let (k, g) = (p.act.k, p.act.k / 16);
    unpack_rows(p.w, p.r0, p.n, k, &mut s.codes, &mut s.a, &mut s.c);
    let wide = p.w.wide();
    for t0 in (0..p.act.t).step_by(nt) {
        let mt = nt.min(p.act.t - t0);
        for i in (0..p.n).step_by(nr) {
            let mr = nr.min(p.n - i);
            let tl = QTile {
                k,
                wide,
                codes: s.codes.as_ptr().add(i * k),
                a: s.a.as_ptr().add(i * g),
                c: s.c.as_ptr().add(i * g),
                qx: p.act.qx.as_ptr().add(t0 * k),
                dx: p.act.dx.as_ptr().add(t0 * g),
                sx: p.act.sx.as_ptr().add(t0 * g),
                out: p.out.add(t0 * p.ldo + p.r0 + i),
                ldo: p.ldo,
            };
            tile(mr, mt, &tl);
        }
    }
}

unsafe fn scalar_panel(p: &PanelArgs<'_>, s: &mut Scratch) {
    quant_panel(p, s, 4, 4, scalar::qtile)
}

fn kernels(isa: Isa) -> Kernels {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => super::dot_x86::AVX2,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => super::dot_x86::AVX512,
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => super::dot_neon::NEON,
        _ => Kernels {
            quantize_row: q8act::quantize_row_scalar,
            quantize_row_split: q8act::quantize_row_split_scalar,
            panel: scalar_panel,
            ftile: scalar::ftile,
            matvec: None,
            gemm: None,
            nr: 4,
            nt: 4,
        },
    }
}

/// `packed`: `w` re-laid out by `super::pack` (read instead of `w`'s bytes on AVX-512 VNNI,
/// whose one-token kernel and GEMM panels are the only readers of that layout).
pub(crate) fn run(
    isa: Isa,
    bits: ActBits,
    w: &QTensor,
    packed: Option<&super::Packed>,
    x: &[f32],
    t: usize,
    out: &mut [f32],
) -> Result<()> {
    let kern = kernels(isa);
    let (r, k) = (w.rows, w.cols);
    let outp = OutPtr(out.as_mut_ptr());
    if let WeightData::Ggml {
        ty: ty @ (GgmlType::F32 | GgmlType::F16 | GgmlType::BF16),
        data,
    } = &w.data
    {
        let row_bytes = ty.row_bytes(k).expect("float rows always fit");
        let data = data.as_slice();
        let (nr, nt) = (kern.nr, kern.nt);
        for_each_task(tasks(r, panel_rows(t, nr), t), |(r0, r1)| {
            for t0 in (0..t).step_by(nt) {
                let mt = nt.min(t - t0);
                for i in (r0..r1).step_by(nr) {
                    let mr = nr.min(r1 - i);
                    let tl = FTile {
                        k,
                        ty: *ty,
                        w: data[i * row_bytes..].as_ptr(),
                        row_bytes,
                        x: x[t0 * k..].as_ptr(),
                        out: unsafe { outp.get().add(t0 * r + i) },
                        ldo: r,
                    };
                    // SAFETY: the tile covers rows i..i+mr < R and tokens t0..t0+mt < T of
                    // checked buffers; the ISA was checked available by the caller.
                    unsafe { (kern.ftile)(mr, mt, &tl) };
                }
            }
        });
        return Ok(());
    }
    let wv = match packed {
        Some(p) if isa == Isa::Avx512Vnni => WView::Packed {
            data: p.data(),
            nb: p.blocks(),
            fmt: p.fmt(),
        },
        _ => WView::new(w).ok_or_else(|| Error::UnsupportedType {
            ty: w.type_name(),
            tensor: w.name.clone(),
        })?,
    };
    if k % q8act::QA != 0 {
        return Err(Error::Shape(format!(
            "linear '{}': {k} columns is not a multiple of 32",
            w.name
        )));
    }
    with_reused(&ACT, |act: &mut ActQ8| match bits {
        ActBits::Q8 => {
            if !act.holds(isa, bits, x, t) {
                act.reshape(t, k);
                // SAFETY: the ISA was checked available by the caller.
                unsafe { q8act::quantize_rows(x, act, kern.quantize_row) };
                act.remember(isa, bits, x, t);
            }
            quant_matmul(&kern, &wv, r, act, outp);
        }
        ActBits::Split16 => {
            // 2T rows: the first parts, then the remainders; out = first + remainder.
            if !act.holds(isa, bits, x, t) {
                act.reshape(2 * t, k);
                // SAFETY: the ISA was checked available by the caller.
                unsafe { q8act::quantize_rows_split(x, act, kern.quantize_row_split) };
                act.remember(isa, bits, x, t);
            }
            if t == 1 && fused_matvec(&kern, &wv, r, act, true, outp) {
                return;
            }
            if let Some(gemm) = kern.gemm.filter(|_| gemm_pays(&wv, 2 * t)) {
                // The GEMM adds the two parts in its integer sums: no second pass.
                gemm_matmul(gemm, &wv, r, act, true, outp);
                return;
            }
            with_reused(&SPLIT_OUT, |tmp: &mut Vec<f32>| {
                if tmp.len() < 2 * t * r {
                    tmp.resize(2 * t * r, 0.0);
                }
                quant_matmul(&kern, &wv, r, act, OutPtr(tmp.as_mut_ptr()));
                let (hi, lo) = tmp[..2 * t * r].split_at(t * r);
                for ((o, h), l) in out.iter_mut().zip(hi).zip(lo) {
                    *o = h + l;
                }
            });
        }
    });
    Ok(())
}

/// The ISA's fused T = 1 kernel over all rows, if it has one for this format (`split`: `act`
/// is one two-part row, see `q8act::quantize_row_split`). False if nothing was done.
fn fused_matvec(
    kern: &Kernels,
    wv: &WView<'_>,
    r: usize,
    act: &ActQ8,
    split: bool,
    outp: OutPtr,
) -> bool {
    let Some(mv) = kern.matvec else {
        return false;
    };
    let handled = std::sync::atomic::AtomicBool::new(true);
    for_each_task(tasks(r, 16, 1), |(r0, r1)| {
        // SAFETY: rows r0..r1 are inside the weight and are this task's own outputs; the ISA
        // was checked available by the caller.
        if !unsafe { mv(wv, r0, r1, act, split, outp.get()) } {
            handled.store(false, std::sync::atomic::Ordering::Relaxed);
        }
    });
    handled.into_inner()
}

/// The quantized product of every row of `act` with `w`, into `outp` (act.t, R).
fn quant_matmul(kern: &Kernels, wv: &WView<'_>, r: usize, act: &ActQ8, outp: OutPtr) {
    let t = act.t;
    if t == 1 && fused_matvec(kern, wv, r, act, false, outp) {
        return;
    }
    if let Some(gemm) = kern.gemm.filter(|_| gemm_pays(wv, t)) {
        gemm_matmul(gemm, wv, r, act, false, outp);
        return;
    }
    panels(kern.panel, panel_rows(t, kern.nr), wv, r, act, false, outp);
}

/// Whether the ISA's GEMM panel beats its small tiles for `rows` activation rows (both parts
/// of split rows counted): the 32-element ggml blocks are laid out for it straight from their
/// bytes, cheap enough from 2 rows; other formats are decoded and then transposed, which pays
/// from 16 (at 2 rows, one decode step, it costs a fifth of Q4_K_M's decode speed).
fn gemm_pays(wv: &WView<'_>, rows: usize) -> bool {
    let direct = matches!(
        wv,
        WView::Ggml {
            ty: GgmlType::Q4_0
                | GgmlType::Q4_1
                | GgmlType::Q5_0
                | GgmlType::Q5_1
                | GgmlType::Q8_0
                | GgmlType::MXFP4,
            ..
        } | WView::Packed { .. }
    );
    rows >= if direct { 2 } else { 16 }
}

/// The ISA's GEMM panels over all rows (`split`: see [`PanelArgs::split`]).
fn gemm_matmul(
    gemm: (PanelFn, usize),
    wv: &WView<'_>,
    r: usize,
    act: &ActQ8,
    split: bool,
    outp: OutPtr,
) {
    panels(gemm.0, gemm.1, wv, r, act, split, outp);
}

/// `panel` over all rows in panels of `p` rows, tasks over rayon.
fn panels(
    panel: PanelFn,
    p: usize,
    wv: &WView<'_>,
    r: usize,
    act: &ActQ8,
    split: bool,
    outp: OutPtr,
) {
    let (k, t) = (act.k, act.t);
    for_each_task(tasks(r, p, t), |(r0, r1)| {
        with_reused(&SCRATCH, |s: &mut Scratch| {
            s.reserve(p, k);
            for pr0 in (r0..r1).step_by(p) {
                let args = PanelArgs {
                    w: wv,
                    r0: pr0,
                    n: p.min(r1 - pr0),
                    act,
                    out: outp.get(),
                    ldo: r,
                    split,
                };
                // SAFETY: rows pr0..pr0+n are inside the weight (checked lengths) and this
                // task's own output columns; the ISA was checked available by the caller.
                unsafe { (panel)(&args, s) };
            }
        });
    });
}
