//! Replacing a loaded model's stored weights in place ([`Model::replace_weight`]): the same
//! model with some matrices in another stored form (another quantization of the same values,
//! say), without writing or loading a file. Only the swap lives here; what is swapped in, and
//! why, is the caller's business.

use hf2q_tensor::{QTensor, WeightData};

use super::Model;
use crate::{Error, Result};

/// Name of the embedding table (also the output layer when the two are tied).
const EMBED: &str = "model.embed_tokens.weight";
/// Name of the output layer.
const LM_HEAD: &str = "lm_head.weight";

/// Whether two weights are one stored tensor (the same bytes).
fn same_storage(a: &QTensor, b: &QTensor) -> bool {
    let bytes = |w: &QTensor| match &w.data {
        WeightData::Ggml { data, .. } => (data.as_slice().as_ptr(), data.len()),
        WeightData::Affine { packed, .. } => (packed.as_slice().as_ptr(), packed.len()),
    };
    bytes(a) == bytes(b)
}

impl Model {
    /// Puts `w` in the place of the weight named `name` and returns the weight it held, so that
    /// a second call can put that one back. Names are the Hugging Face names the model loads its
    /// weights by, whatever the file's format: `model.embed_tokens.weight`, `lm_head.weight`,
    /// `model.layers.{i}.{self_attn.q_proj | ... | mlp.down_proj}.weight`. Where the output
    /// layer is the embedding table (tied), replacing the table replaces both. `w` must have the
    /// shape `(R, C)` of the weight it replaces; it takes over that weight's name. The backends'
    /// prepared copies of the weight taken out (CPU packed layout, GPU upload) are dropped, so
    /// only the weights in use keep one; `w`'s are made on its first use.
    pub fn replace_weight(&mut self, name: &str, w: QTensor) -> Result<QTensor> {
        let cuda = self.cuda.clone();
        let packed = &self.backend.packed;
        let put = |slot: &mut QTensor, mut w: QTensor| -> Result<QTensor> {
            if (slot.rows, slot.cols) != (w.rows, w.cols) {
                return Err(Error::Msg(format!(
                    "weight '{name}' is {}x{}, its replacement {}x{}",
                    slot.rows, slot.cols, w.rows, w.cols
                )));
            }
            w.name = slot.name.clone();
            let old = std::mem::replace(slot, w);
            packed.forget(&old);
            if let Some(c) = &cuda {
                c.forget_weight(&old);
            }
            Ok(old)
        };
        if name == EMBED {
            let tied = same_storage(&self.embed, &self.lm_head);
            let old = put(&mut self.embed, w)?;
            if tied {
                self.lm_head = self.embed.clone();
            }
            return Ok(old);
        }
        if name == LM_HEAD {
            return put(&mut self.lm_head, w);
        }
        let layer = name
            .strip_prefix("model.layers.")
            .and_then(|r| r.split_once('.'))
            .and_then(|(i, path)| Some((i.parse::<usize>().ok()?, path.strip_suffix(".weight")?)));
        if let Some((i, path)) = layer {
            if let Some(block) = self.blocks.get_mut(i) {
                if let Some((_, lin)) = block.linears_mut().into_iter().find(|(p, _)| *p == path) {
                    return put(&mut lin.w, w);
                }
            }
        }
        Err(Error::MissingTensor(format!(
            "{name} (not a matrix of this {}-layer model)",
            self.blocks.len()
        )))
    }
}
