//! [`Session::forward_all`] in parts split at block boundaries: the embedding, a range of
//! blocks, the rest with the logits. Running the parts over the same tokens gives what
//! `forward_all` gives; splitting lets a caller run a shared prefix of the network once and
//! vary only what follows (e.g. sensitivity measurements of one layer's weights). The
//! residual streams between parts are host tensors on every backend (the blocks update a
//! stream in place, so each part works on its own copy).

use hf2q_tensor::Tensor;

use super::{BatchItem, Session};
use crate::layers::served::Fwd;
use crate::{Error, Result};

impl Session<'_> {
    /// The first part: the residual stream `(T, D)` of `tokens` (fed after what is cached)
    /// entering block 0.
    pub fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        let m = self.model;
        let be = m.be();
        Ok(be.to_host(&be.embedding(&m.embed, tokens, m.config.embed_scale)?)?)
    }
    /// Blocks `layers` over `x (T, D)`, the residual stream of `tokens` entering
    /// `layers.start`: the stream leaving `layers.end - 1`, on the host. Writes those blocks'
    /// caches; the position does not move (the parts end in [`Session::forward_from`]).
    pub fn run_blocks(
        &mut self,
        tokens: &[u32],
        layers: std::ops::Range<usize>,
        x: &Tensor,
    ) -> Result<Tensor> {
        let m = self.model;
        let be = m.be();
        let mut x = self.stream(tokens, x)?;
        let mut item = [BatchItem {
            cache: &mut self.cache,
            pos0: self.pos,
            tokens,
        }];
        let cx = Fwd { be, lora: None };
        m.run_blocks(&cx, layers, &mut x, &mut item)?;
        Ok(be.to_host(&x)?)
    }
    /// The last part of [`Session::forward_all`]: blocks `layer..` over `x (T, D)`, the
    /// residual stream of `tokens` entering block `layer` (`n_layers`: none), then the final
    /// norm and the output layer: the logits of every position `(T, V)`. Advances the
    /// position by T. Equal to `forward_all(tokens)` when `x` is what the parts before made.
    pub fn forward_from(&mut self, tokens: &[u32], layer: usize, x: &Tensor) -> Result<Tensor> {
        let m = self.model;
        let be = m.be();
        let mut x = self.stream(tokens, x)?;
        let mut item = [BatchItem {
            cache: &mut self.cache,
            pos0: self.pos,
            tokens,
        }];
        let cx = Fwd { be, lora: None };
        m.run_blocks(&cx, layer..m.blocks.len(), &mut x, &mut item)?;
        let h = be.rms_norm(&x, &m.final_norm, m.config.rms_eps, m.config.norm_offset)?;
        let l = be.to_host(&m.logits(&h)?)?;
        self.pos += tokens.len();
        Ok(l)
    }
    /// `x`, checked to be the `(T, D)` stream of `tokens` that fit the cache, where the
    /// backend computes (a copy: the blocks update it in place).
    fn stream(&self, tokens: &[u32], x: &Tensor) -> Result<Tensor> {
        let d = self.model.config.hidden_size;
        if tokens.is_empty() || x.shape() != [tokens.len(), d] {
            return Err(Error::Msg(format!(
                "a residual stream of shape {:?} for {} tokens of width {d}",
                x.shape(),
                tokens.len()
            )));
        }
        if self.pos + tokens.len() > self.cache.limit {
            return Err(Error::Msg(format!(
                "context full: {} + {} tokens exceed the context size {}",
                self.pos,
                tokens.len(),
                self.cache.limit
            )));
        }
        Ok(self.model.be().upload(x)?)
    }
}
