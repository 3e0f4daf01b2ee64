//! Several LoRA adapters' low-rank terms over one batch, each on its own rows (the segmented
//! product of Punica and S-LoRA): `y[rows] += scale · (x[rows] · Aᵀ) · Bᵀ` per adapter, after
//! the base product has run once over every row.
//!
//! - [`RowsTerm`]: one adapter's factors and the runs of rows it applies to.
//! - [`check_terms`]: the shape checks every backend shares.
//! - [`add_row_terms_composed`]: the terms from the closed op set (gather, two products,
//!   scatter-add); a backend overrides [`crate::op::Backend::add_row_terms`] where it can read
//!   and write the rows in place.
//!
//! Not here: which rows use which adapter (the model's batch) or where factors are kept.

use crate::op::{Backend, MatmulSpec};
use crate::{Error, Result, Tensor};

/// One adapter's term: `A (r, C)`, `B (R, r)`, `scale`, on the rows `start..start+len` of each
/// run (runs in ascending order, disjoint from every other term's).
#[derive(Clone, Copy)]
pub struct RowsTerm<'a> {
    pub a: &'a Tensor,
    pub b: &'a Tensor,
    /// `Bᵀ (r, R)`, when the holder keeps one (host factors of served adapters): a backend may
    /// read it instead of `b`, so that the second product runs along rows of `R`.
    pub b_t: Option<&'a Tensor>,
    pub scale: f32,
    /// (first row, rows)
    pub runs: &'a [(usize, usize)],
}

/// Checks `terms` against `x (T, C)` and `y (T, R)`: factor shapes, and runs inside the batch
/// that no two terms share.
pub fn check_terms(x: &Tensor, y: &Tensor, terms: &[RowsTerm<'_>]) -> Result<()> {
    let ((t, c), (ty, r)) = (x.dims2(), y.dims2());
    if t != ty {
        return Err(Error::Shape(format!(
            "low-rank rows: input of {t} rows, output of {ty}"
        )));
    }
    let mut taken: Vec<(usize, usize)> = Vec::new();
    for term in terms {
        let ((ra, ca), (rb, cb)) = (term.a.dims2(), term.b.dims2());
        if ca != c || rb != r || cb != ra {
            return Err(Error::Shape(format!(
                "low-rank rows: A ({ra}, {ca}) and B ({rb}, {cb}) for ({t}, {c}) -> ({t}, {r})"
            )));
        }
        if let Some(bt) = term.b_t.filter(|bt| bt.shape() != [ra, r]) {
            return Err(Error::Shape(format!(
                "low-rank rows: Bᵀ {:?} for B ({rb}, {cb})",
                bt.shape()
            )));
        }
        for &(s, n) in term.runs {
            if s.checked_add(n).is_none_or(|e| e > t) {
                return Err(Error::Shape(format!(
                    "low-rank rows: rows {s}..{} of a batch of {t}",
                    s.saturating_add(n)
                )));
            }
            taken.push((s, n));
        }
    }
    taken.sort_unstable();
    if taken.windows(2).any(|w| w[0].0 + w[0].1 > w[1].0) {
        return Err(Error::Shape("low-rank rows: two terms share rows".into()));
    }
    Ok(())
}

/// [`Backend::add_row_terms`] from the op set: each term's rows gathered (or `x` itself when
/// they are the whole batch), multiplied by its factors, and the output rebuilt run by run with
/// each term added to its rows.
pub fn add_row_terms_composed<B: Backend + ?Sized>(
    be: &B,
    x: &Tensor,
    y: &mut Tensor,
    terms: &[RowsTerm<'_>],
) -> Result<()> {
    check_terms(x, y, terms)?;
    let rows = x.dims2().0;
    // (first row, rows, the term's (rows of its runs, R) and the offset of this run in it)
    let mut pieces: Vec<(usize, usize, usize, usize)> = Vec::new();
    let mut deltas: Vec<Tensor> = Vec::with_capacity(terms.len());
    for term in terms {
        let gathered;
        let xs: &Tensor = match term.runs {
            [] => continue,
            [(s, n)] if *s == 0 && *n == rows => x,
            [(s, n)] => {
                gathered = be.rows(x, *s, *n)?;
                &gathered
            }
            runs => {
                let parts = runs
                    .iter()
                    .map(|&(s, n)| be.rows(x, s, n))
                    .collect::<Result<Vec<_>>>()?;
                gathered = be.concat_rows(&parts)?;
                &gathered
            }
        };
        // (n, r), then (n, R)
        let xa = be.matmul(xs, term.a, MatmulSpec::NT)?;
        let d = be.matmul(&xa, term.b, MatmulSpec::NT.scaled(term.scale))?;
        if d.dims2().0 == rows {
            // The whole batch is this term's.
            return be.add_assign(y, &d);
        }
        let mut off = 0;
        for &(s, n) in term.runs {
            pieces.push((s, n, deltas.len(), off));
            off += n;
        }
        deltas.push(d);
    }
    if pieces.is_empty() {
        return Ok(());
    }
    pieces.sort_unstable();
    // The output again, run by run: rows without a term as they are, the others plus it.
    let mut parts = Vec::with_capacity(2 * pieces.len() + 1);
    let mut at = 0;
    for (s, n, d, off) in pieces {
        if s > at {
            parts.push(be.rows(y, at, s - at)?);
        }
        let mut p = be.rows(y, s, n)?;
        be.add_assign(&mut p, &be.rows(&deltas[d], off, n)?)?;
        parts.push(p);
        at = s + n;
    }
    if at < rows {
        parts.push(be.rows(y, at, rows - at)?);
    }
    *y = be.concat_rows(&parts)?;
    Ok(())
}
