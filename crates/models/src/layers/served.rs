//! The inference forward's context ([`Fwd`]) and the served-adapter term of one batch
//! ([`BatchLora`]): several LoRA adapters on one base in one continuous batch, as S-LoRA and
//! vLLM's multi-LoRA run them. The base product runs once over every row of the batch; then,
//! for each adapter present, the rows of its sequences are gathered, multiplied by its factors
//! (`xs · Aᵀ`, then `· Bᵀ · scale`) and added back onto those rows.
//!
//! Architectures only pass the context on; [`crate::layers::linear::Linear`] is the one place
//! that reads it (through its `site`, its index among the model's products).
//!
//! Not here: where the factors come from and which slot holds which adapter
//! (`crate::adapter_set`); an adapter attached to the model itself, for training and
//! `run --adapter` (`Linear::lora`).

use hf2q_tensor::op::{Backend, MatmulSpec};
use hf2q_tensor::Tensor;

use crate::adapter_set::AdapterSet;
use crate::{Error, Result};

/// What an inference forward carries through the layers of one step.
#[derive(Clone, Copy)]
pub struct Fwd<'a> {
    pub be: &'a dyn Backend,
    /// The batch's served adapters (`None`: every row runs on the base alone).
    pub lora: Option<&'a BatchLora<'a>>,
}

impl<'a> Fwd<'a> {
    /// A forward with no served adapter.
    pub fn plain(be: &'a dyn Backend) -> Fwd<'a> {
        Fwd { be, lora: None }
    }
}

/// Which rows of a batch `(ΣT, ·)` use which adapter slot, for one step.
pub struct BatchLora<'a> {
    set: &'a AdapterSet,
    /// ΣT
    rows: usize,
    /// Maximal runs of consecutive rows of one slot, in row order: (first row, rows, index
    /// into `groups`, `None` for base rows).
    runs: Vec<(usize, usize, Option<usize>)>,
    /// Each slot present in the batch with the indices of its runs in `runs`.
    groups: Vec<(usize, Vec<usize>)>,
}

impl<'a> BatchLora<'a> {
    /// From the sequences of a batch in row order: `(rows, slot)` each (`None`: the base).
    /// Every slot must hold an adapter of `set`.
    pub fn new(set: &'a AdapterSet, seqs: &[(usize, Option<usize>)]) -> Result<BatchLora<'a>> {
        let mut b = BatchLora {
            set,
            rows: 0,
            runs: Vec::new(),
            groups: Vec::new(),
        };
        for &(n, slot) in seqs {
            if let Some(s) = slot {
                if !set.contains(s) {
                    return Err(Error::Msg(format!("adapter slot {s} holds no adapter")));
                }
            }
            let g = slot.map(|s| match b.groups.iter().position(|(gs, _)| *gs == s) {
                Some(g) => g,
                None => {
                    b.groups.push((s, Vec::new()));
                    b.groups.len() - 1
                }
            });
            match b.runs.last_mut() {
                Some(last) if last.2 == g => last.1 += n,
                _ => {
                    if let Some(g) = g {
                        b.groups[g].1.push(b.runs.len());
                    }
                    b.runs.push((b.rows, n, g));
                }
            }
            b.rows += n;
        }
        Ok(b)
    }

    /// Whether any adapter of the batch has factors on the product `site`.
    pub fn touches(&self, site: usize) -> bool {
        self.groups
            .iter()
            .any(|(s, _)| self.set.lora(*s, site).is_some())
    }

    /// `y (ΣT, R) += scale · (x Aᵀ) Bᵀ` on the rows of each adapter's sequences, `x (ΣT, C)`,
    /// with the factors each slot holds for the product `site`.
    pub fn apply(&self, be: &dyn Backend, site: usize, x: &Tensor, y: &mut Tensor) -> Result<()> {
        if x.dims2().0 != self.rows || y.dims2().0 != self.rows {
            return Err(Error::Msg(format!(
                "served adapters: a batch of {} rows was given {} input and {} output rows",
                self.rows,
                x.dims2().0,
                y.dims2().0
            )));
        }
        // (group, its rows' adapter term (n_g, R)), in group order.
        let mut deltas: Vec<Option<Tensor>> = (0..self.groups.len()).map(|_| None).collect();
        let mut any = false;
        for (g, (slot, runs)) in self.groups.iter().enumerate() {
            let Some(l) = self.set.lora(*slot, site) else {
                continue;
            };
            let gathered;
            let xs: &Tensor = match runs.as_slice() {
                [r] if self.runs[*r].1 == self.rows => x,
                [r] => {
                    gathered = be.rows(x, self.runs[*r].0, self.runs[*r].1)?;
                    &gathered
                }
                _ => {
                    let parts = runs
                        .iter()
                        .map(|&r| be.rows(x, self.runs[r].0, self.runs[r].1))
                        .collect::<std::result::Result<Vec<_>, _>>()?;
                    gathered = be.concat_rows(&parts)?;
                    &gathered
                }
            };
            // (n_g, r), then (n_g, R)
            let xa = be.matmul(xs, &l.a, MatmulSpec::NT)?;
            let d = be.matmul(&xa, &l.b, MatmulSpec::NT.scaled(l.scale))?;
            if d.dims2().0 == self.rows {
                // The whole batch is this adapter's.
                return Ok(be.add_assign(y, &d)?);
            }
            deltas[g] = Some(d);
            any = true;
        }
        if !any {
            return Ok(());
        }
        // Scatter-add: the output again, run by run, each adapter's rows plus its term.
        let mut used = vec![0usize; self.groups.len()];
        let mut parts = Vec::with_capacity(self.runs.len());
        for &(start, n, g) in &self.runs {
            let mut p = be.rows(y, start, n)?;
            if let Some(g) = g {
                if let Some(d) = &deltas[g] {
                    be.add_assign(&mut p, &be.rows(d, used[g], n)?)?;
                }
                used[g] += n;
            }
            parts.push(p);
        }
        *y = be.concat_rows(&parts)?;
        Ok(())
    }
}
