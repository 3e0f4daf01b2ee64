//! The CPU backend's segmented low-rank product (`add_row_terms`: served LoRA adapters' terms
//! on their rows in place) against a dense reference written here and against the op set's
//! composed form (`add_row_terms_composed`: gather, two products, scatter-add).

use hf2q_cpu::CpuBackend;
use hf2q_tensor::lora_rows::{add_row_terms_composed, RowsTerm};
use hf2q_tensor::op::Backend;
use hf2q_tensor::Tensor;

/// Deterministic values in about [-0.5, 0.5).
fn noise(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            let h =
                (i.wrapping_mul(2654435761) ^ seed.wrapping_mul(40503)).wrapping_mul(2246822519);
            (h >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        })
        .collect()
}

fn t(shape: &[usize], seed: u32) -> Tensor {
    Tensor::new(shape, noise(shape.iter().product(), seed)).unwrap()
}

/// `y[row] += scale · (x[row] · Aᵀ) · Bᵀ` row by row in f64.
fn naive(x: &Tensor, y: &Tensor, terms: &[RowsTerm<'_>]) -> Vec<f32> {
    let ((_, c), (_, r)) = (x.dims2(), y.dims2());
    let mut out = y.data().to_vec();
    for term in terms {
        let rank = term.a.dims2().0;
        for &(s, n) in term.runs {
            for row in s..s + n {
                let xa: Vec<f64> = (0..rank)
                    .map(|j| {
                        (0..c)
                            .map(|k| x.data()[row * c + k] as f64 * term.a.data()[j * c + k] as f64)
                            .sum()
                    })
                    .collect();
                for o in 0..r {
                    let d: f64 = (0..rank)
                        .map(|j| xa[j] * term.b.data()[o * rank + j] as f64)
                        .sum();
                    out[row * r + o] += (term.scale as f64 * d) as f32;
                }
            }
        }
    }
    out
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// `m (R, C)` -> `(C, R)`.
fn transposed(m: &Tensor) -> Tensor {
    let (r, c) = m.dims2();
    let d = m.data();
    Tensor::new(
        &[c, r],
        (0..c * r).map(|i| d[(i % r) * c + i / r]).collect(),
    )
    .unwrap()
}

/// The in-place product, from `B` (general products) and from `Bᵀ` (the direct kernel of a
/// served adapter's host factors), against the f64 reference and the composed form.
#[test]
fn segmented_terms_match_the_reference_and_the_composed_form() {
    let be = CpuBackend::default();
    let (rows, c, r) = (23, 40, 36);
    let x = t(&[rows, c], 1);
    let y0 = t(&[rows, r], 2);
    let (a1, b1) = (t(&[4, c], 3), t(&[r, 4], 4));
    let (a2, b2) = (t(&[2, c], 5), t(&[r, 2], 6));
    let (a3, b3) = (t(&[8, c], 7), t(&[r, 8], 8));
    let (bt1, bt2, bt3) = (transposed(&b1), transposed(&b2), transposed(&b3));
    // Interleaved runs (one adapter in two places), base rows between and at both ends, and an
    // empty run.
    let runs1 = [(1, 3), (12, 5)];
    let runs2 = [(4, 6), (20, 0)];
    let runs3 = [(17, 2)];
    for direct in [false, true] {
        let terms = [
            RowsTerm {
                a: &a1,
                b: &b1,
                b_t: direct.then_some(&bt1),
                scale: 2.0,
                runs: &runs1,
            },
            RowsTerm {
                a: &a2,
                b: &b2,
                b_t: direct.then_some(&bt2),
                scale: 0.5,
                runs: &runs2,
            },
            RowsTerm {
                a: &a3,
                b: &b3,
                b_t: direct.then_some(&bt3),
                scale: 1.5,
                runs: &runs3,
            },
        ];
        let want = naive(&x, &y0, &terms);
        let mut fast = y0.clone();
        be.add_row_terms(&x, &mut fast, &terms).unwrap();
        let mut composed = y0.clone();
        add_row_terms_composed(&be, &x, &mut composed, &terms).unwrap();
        // Why 1e-5: f32 sums of at most 40 products of values below 0.5, against f64.
        let e = max_diff(fast.data(), &want);
        assert!(e < 1e-5, "direct {direct}: {e}");
        assert!(max_diff(composed.data(), &want) < 1e-5);
        // Base rows are left exactly as they were.
        for row in [0, 10, 11, 19, 20, 21, 22] {
            assert_eq!(fast.row(row), y0.row(row), "row {row}");
            assert_eq!(composed.row(row), y0.row(row), "row {row}");
        }

        // One term over the whole batch.
        let all = [(0, rows)];
        let one = [RowsTerm {
            a: &a1,
            b: &b1,
            b_t: direct.then_some(&bt1),
            scale: 1.0,
            runs: &all,
        }];
        let want = naive(&x, &y0, &one);
        let mut fast = y0.clone();
        be.add_row_terms(&x, &mut fast, &one).unwrap();
        assert!(max_diff(fast.data(), &want) < 1e-5);
    }
}

/// A served adapter's shapes (SmolLM2's MLP: 576 -> 1536, rank 16) on a decode step's runs of
/// four rows, through the direct kernel: within f32 rounding of the reference (sums of 576
/// products, then of 16).
#[test]
fn direct_kernel_at_a_served_adapters_shape() {
    let be = CpuBackend::default();
    let (rows, c, r, k) = (16, 576, 1536, 16);
    let x = t(&[rows, c], 11);
    let y0 = t(&[rows, r], 12);
    let (a, b) = (t(&[k, c], 13), t(&[r, k], 14));
    let bt = transposed(&b);
    let runs = [(0, 4), (8, 4)];
    let terms = [RowsTerm {
        a: &a,
        b: &b,
        b_t: Some(&bt),
        scale: 2.0,
        runs: &runs,
    }];
    let want = naive(&x, &y0, &terms);
    let mut fast = y0.clone();
    be.add_row_terms(&x, &mut fast, &terms).unwrap();
    let e = max_diff(fast.data(), &want);
    // Why 1e-4: |x · a| up to ~3 over 576 products of values below 0.5, times 16 more.
    assert!(e < 1e-4, "{e}");
    for row in 4..8 {
        assert_eq!(fast.row(row), y0.row(row), "row {row}");
    }
}

#[test]
fn bad_terms_are_refused() {
    let be = CpuBackend::default();
    let x = t(&[6, 8], 1);
    let (a, b) = (t(&[2, 8], 2), t(&[5, 2], 3));
    let term = |runs| RowsTerm {
        a: &a,
        b: &b,
        b_t: None,
        scale: 1.0,
        runs,
    };
    let mut y = t(&[6, 5], 4);
    // Past the batch; overlapping; a factor of the wrong width.
    assert!(be.add_row_terms(&x, &mut y, &[term(&[(4, 3)])]).is_err());
    assert!(be
        .add_row_terms(&x, &mut y, &[term(&[(0, 3)]), term(&[(2, 2)])])
        .is_err());
    let mut narrow = t(&[6, 4], 5);
    assert!(be
        .add_row_terms(&x, &mut narrow, &[term(&[(0, 2)])])
        .is_err());
    let mut short = t(&[5, 5], 6);
    assert!(be
        .add_row_terms(&x, &mut short, &[term(&[(0, 2)])])
        .is_err());
    // A Bᵀ that is not B's transpose's shape.
    let wrong = t(&[5, 2], 7);
    let bad = RowsTerm {
        b_t: Some(&wrong),
        ..term(&[(0, 2)])
    };
    let e = be
        .add_row_terms(&x, &mut y, &[bad])
        .unwrap_err()
        .to_string();
    assert!(e.contains("Bᵀ"), "{e}");
}
