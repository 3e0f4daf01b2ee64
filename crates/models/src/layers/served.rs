//! The inference forward's context ([`Fwd`]) and the served-adapter term of one batch
//! ([`BatchLora`]): several LoRA adapters on one base in one continuous batch, as S-LoRA and
//! vLLM's multi-LoRA run them. The base product runs once over every row of the batch (the
//! same fused products as a batch without adapters); then every adapter's term
//! (`x · Aᵀ`, then `· Bᵀ · scale`) is added onto the rows of its sequences in one segmented
//! product ([`hf2q_tensor::lora_rows`]).
//!
//! Architectures only pass the context on; [`crate::layers::linear::Linear`] adds the terms
//! (through its `site`, its index among the model's products), and the attention and MLP
//! layers only ask whether a batch has terms on their products, to keep the normed rows.
//!
//! Not here: where the factors come from and which slot holds which adapter
//! (`crate::adapter_set`); an adapter attached to the model itself, for training and
//! `run --adapter` (`Linear::lora`).

use hf2q_tensor::lora_rows::RowsTerm;
use hf2q_tensor::op::Backend;
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
    /// Each slot present in the batch with its maximal runs of consecutive rows, in row order:
    /// (first row, rows).
    groups: Vec<(usize, Vec<(usize, usize)>)>,
}

impl<'a> BatchLora<'a> {
    /// From the sequences of a batch in row order: `(rows, slot)` each (`None`: the base).
    /// Every slot must hold an adapter of `set`.
    pub fn new(set: &'a AdapterSet, seqs: &[(usize, Option<usize>)]) -> Result<BatchLora<'a>> {
        let mut b = BatchLora {
            set,
            rows: 0,
            groups: Vec::new(),
        };
        let mut last: Option<usize> = None;
        for &(n, slot) in seqs {
            if let Some(s) = slot {
                if !set.contains(s) {
                    return Err(Error::Msg(format!("adapter slot {s} holds no adapter")));
                }
                let g = match b.groups.iter().position(|(gs, _)| *gs == s) {
                    Some(g) => g,
                    None => {
                        b.groups.push((s, Vec::new()));
                        b.groups.len() - 1
                    }
                };
                let runs = &mut b.groups[g].1;
                match runs.last_mut() {
                    Some(run) if last == slot && run.0 + run.1 == b.rows => run.1 += n,
                    _ => runs.push((b.rows, n)),
                }
            }
            last = slot;
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
    /// with the factors each slot holds for the product `site`: one segmented product
    /// ([`Backend::add_row_terms`]).
    pub fn apply(&self, be: &dyn Backend, site: usize, x: &Tensor, y: &mut Tensor) -> Result<()> {
        if x.dims2().0 != self.rows || y.dims2().0 != self.rows {
            return Err(Error::Msg(format!(
                "served adapters: a batch of {} rows was given {} input and {} output rows",
                self.rows,
                x.dims2().0,
                y.dims2().0
            )));
        }
        let terms: Vec<RowsTerm<'_>> = self
            .groups
            .iter()
            .filter_map(|(slot, runs)| {
                self.set.lora(*slot, site).map(|(l, b_t)| RowsTerm {
                    a: &l.a,
                    b: &l.b,
                    b_t,
                    scale: l.scale,
                    runs,
                })
            })
            .collect();
        if terms.is_empty() {
            return Ok(());
        }
        Ok(be.add_row_terms(x, y, &terms)?)
    }
}
