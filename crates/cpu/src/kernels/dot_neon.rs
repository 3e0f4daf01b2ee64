//! aarch64 engine: baseline Advanced SIMD (no `dotprod` extension assumed). One step is one
//! 16-element group: `vmull_s8` products of codes and activations (i16), pairwise-added into
//! i32 lanes, converted and scaled by the group's `a * dx`.
//!
//! Codes are read as signed bytes: the 4..6-bit codes are below 128 already; wide codes
//! (Q8_0, Q8_K, MLX 8-bit) are read as `u - 128` and `128 * Σ a * sx` is added back, as in the
//! AVX2 engine. Float weights use the portable `scalar::ftile` (vectorised by the compiler).
//!
//! Compiled by `cargo check --target aarch64-unknown-linux-gnu`; not run on this project's x86
//! machines.

// Tiles index several arrays by row and token; index loops read clearest here.
#![allow(clippy::needless_range_loop)]

use std::arch::aarch64::*;

use super::matmul::{quant_panel, Kernels, PanelArgs, QTile, Scratch};
use super::{q8act, scalar};

pub(crate) const NEON: Kernels = Kernels {
    quantize_row: q8act::quantize_row_scalar,
    quantize_row_split: q8act::quantize_row_split_scalar,
    panel: panel_neon,
    ftile: scalar::ftile,
    matvec: None,
    gemm: None,
    nr: 2,
    nt: 2,
};

unsafe fn panel_neon(p: &PanelArgs<'_>, s: &mut Scratch) {
    quant_panel(p, s, 2, 2, tile_neon)
}

unsafe fn tile_neon(nr: usize, nt: usize, p: &QTile) {
    match (nr, nt, p.wide) {
        (2, 2, false) => qtile::<2, 2, false>(p),
        (2, 1, false) => qtile::<2, 1, false>(p),
        (1, 2, false) => qtile::<1, 2, false>(p),
        (1, 1, false) => qtile::<1, 1, false>(p),
        (2, 2, true) => qtile::<2, 2, true>(p),
        (2, 1, true) => qtile::<2, 1, true>(p),
        (1, 2, true) => qtile::<1, 2, true>(p),
        (1, 1, true) => qtile::<1, 1, true>(p),
        _ => unreachable!("tile beyond the engine's maximum"),
    }
}

#[inline(always)]
unsafe fn qtile<const NR: usize, const NT: usize, const WIDE: bool>(p: &QTile) {
    let (k, g) = (p.k, p.k / 16);
    let mut acc = [[vdupq_n_f32(0.0); NT]; NR];
    for j in 0..g {
        let kk = 16 * j;
        let mut w = [vdupq_n_s8(0); NR];
        for r in 0..NR {
            let u = vld1q_u8(p.codes.add(r * k + kk));
            w[r] = if WIDE {
                vreinterpretq_s8_u8(veorq_u8(u, vdupq_n_u8(0x80)))
            } else {
                vreinterpretq_s8_u8(u)
            };
        }
        for t in 0..NT {
            let x = vld1q_s8(p.qx.add(t * k + kk));
            let dx = *p.dx.add(t * g + j);
            for r in 0..NR {
                let lo = vmull_s8(vget_low_s8(w[r]), vget_low_s8(x));
                let hi = vmull_high_s8(w[r], x);
                let s32 = vpadalq_s16(vpaddlq_s16(lo), hi);
                acc[r][t] = vfmaq_n_f32(acc[r][t], vcvtq_f32_s32(s32), *p.a.add(r * g + j) * dx);
            }
        }
    }
    for r in 0..NR {
        for t in 0..NT {
            let mut off = 0f32;
            for j in 0..g {
                let sx = *p.sx.add(t * g + j);
                off += *p.c.add(r * g + j) * sx;
                if WIDE {
                    off += 128.0 * *p.a.add(r * g + j) * sx;
                }
            }
            *p.out.add(t * p.ldo + r) = vaddvq_f32(acc[r][t]) + off;
        }
    }
}
