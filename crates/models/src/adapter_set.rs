//! Several LoRA adapters loaded side by side on one base model, each in a numbered slot, for
//! serving them in one batch ([`crate::layers::served::BatchLora`]). The base weights are
//! shared; a slot holds only its adapter's factors, by product `site`, where the model's
//! backend keeps tensors.
//!
//! The set is its owner's, not the model's: the server's engine thread owns one and changes it
//! between steps, so the model itself stays immutable and shared. A set belongs to the model
//! whose [`Model::read_adapter`] made its adapters.
//!
//! Not here: reading and checking adapter files (`crate::adapter`), names and reference counts
//! (the server's engine).

use crate::adapter::LoraConfig;
use crate::layers::lora::Lora;
use crate::model::Model;
use crate::{Error, Result};
use hf2q_tensor::Tensor;

/// An adapter read from its files, not attached to the model: its settings and its factors by
/// product site.
pub struct ReadAdapter {
    pub config: LoraConfig,
    /// By site: the factors on that product, if the adapter targets it.
    pub(crate) factors: Vec<Option<Lora>>,
}

impl ReadAdapter {
    /// Products the adapter has factors on.
    pub fn products(&self) -> usize {
        self.factors.iter().flatten().count()
    }
    /// Bytes of its factors (f32).
    pub fn bytes(&self) -> usize {
        self.factors
            .iter()
            .flatten()
            .map(|l| (l.a.len() + l.b.len()) * 4)
            .sum()
    }
}

/// Adapters in slots: per slot, per product, the factors and, for host factors, `Bᵀ (r, R)`
/// (what the CPU's segmented product reads: its second product runs along output rows).
#[derive(Default)]
pub struct AdapterSet {
    slots: Vec<Option<Vec<Option<(Lora, Option<Tensor>)>>>>,
}

impl AdapterSet {
    pub fn new() -> AdapterSet {
        AdapterSet::default()
    }

    /// Puts `adapter` into the first free slot, its factors moved to where `model`'s backend
    /// keeps tensors, and returns the slot.
    pub fn insert(&mut self, model: &Model, adapter: ReadAdapter) -> Result<usize> {
        if adapter.factors.len() != model.sites() {
            return Err(Error::Msg(format!(
                "an adapter read for a model of {} products given to one of {}",
                adapter.factors.len(),
                model.sites()
            )));
        }
        let be = model.be();
        let mut factors = Vec::with_capacity(adapter.factors.len());
        for l in adapter.factors {
            factors.push(match l {
                Some(mut l) => {
                    l.a = be.upload(&l.a)?;
                    l.b = be.upload(&l.b)?;
                    let b_t = l.b.is_host().then(|| transposed(&l.b)).transpose()?;
                    Some((l, b_t))
                }
                None => None,
            });
        }
        let slot = match self.slots.iter().position(Option::is_none) {
            Some(s) => s,
            None => {
                self.slots.push(None);
                self.slots.len() - 1
            }
        };
        self.slots[slot] = Some(factors);
        Ok(slot)
    }

    /// Empties `slot` (its factors are freed); false when it held nothing.
    pub fn remove(&mut self, slot: usize) -> bool {
        self.slots.get_mut(slot).and_then(Option::take).is_some()
    }

    pub fn contains(&self, slot: usize) -> bool {
        self.slots.get(slot).is_some_and(Option::is_some)
    }

    /// Adapters loaded.
    pub fn len(&self) -> usize {
        self.slots.iter().flatten().count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The factors slot `slot` holds for the product `site`, and `Bᵀ` when they are on the host.
    pub(crate) fn lora(&self, slot: usize, site: usize) -> Option<(&Lora, Option<&Tensor>)> {
        let (l, b_t) = self.slots.get(slot)?.as_ref()?.get(site)?.as_ref()?;
        Some((l, b_t.as_ref()))
    }
}

/// `m (R, C)` -> `mᵀ (C, R)`, host tensors.
fn transposed(m: &Tensor) -> Result<Tensor> {
    let (r, c) = m.dims2();
    Ok(Tensor::new(
        &[c, r],
        crate::adapter::mlx::transpose(m.data(), r, c),
    )?)
}
