//! Records to training samples: token ids and which of them are learned.
//!
//! - A conversation is rendered with the model's chat template (ChatML where the model has
//!   none), tokenized as inference tokenizes a prompt (special tokens recognised only in the
//!   template's own text, so data cannot inject them), and by default only the assistant turns
//!   are learned: each assistant turn is the text between `render(turns before it, with the
//!   generation prompt)` and `render(turns up to it)`, so its end-of-turn marker is learned too
//!   and the model learns to stop. A template that does not render a conversation prefix by
//!   prefix (one that rewrites earlier turns) is an error naming the turn.
//! - Plain text is `prompt` + `completion` + EOS (BOS first where the model wants one); the
//!   completion and the EOS are learned.
//! - A preference pair's reply (`Record::Reply`) is a conversation whose assistant turns are
//!   learned only from the reply's first turn on (the prompt's earlier assistant turns are not).
//! - `train_on_prompt` learns every token but the first.
//!
//! Sequences longer than `max_len` are cut to `max_len` tokens (the report counts them).

use hf2q_models::chat_template::{encode_chat_offsets, ChatTemplate, RenderOptions};
use hf2q_models::Model;
use serde_json::json;

use crate::data::{Record, Turn};

/// One tokenized example.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    /// (T)
    pub ids: Vec<u32>,
    /// (T) whether token t is a target (predicted from token t − 1); `learn[0]` is false.
    pub learn: Vec<bool>,
    /// Tokens before the cut to `max_len` (= `ids.len()` when not cut).
    pub full_len: usize,
}

impl Sample {
    /// Tokens learned.
    pub fn learned(&self) -> usize {
        self.learn.iter().filter(|&&l| l).count()
    }
    /// Whether this sample was cut to the maximum length.
    pub fn truncated(&self) -> bool {
        self.full_len > self.ids.len()
    }
}

#[derive(Clone, Copy, Debug)]
pub struct RenderConfig {
    /// Learn the prompt (user, system turns, template text) too.
    pub train_on_prompt: bool,
    /// Tokens kept per sample.
    pub max_len: usize,
}

/// Renders records for one model (its tokenizer and template).
pub struct Renderer<'m> {
    model: &'m Model,
    template: ChatTemplate,
    cfg: RenderConfig,
}

fn messages(turns: &[Turn]) -> Vec<serde_json::Value> {
    turns
        .iter()
        .map(|t| json!({"role": t.role, "content": t.content}))
        .collect()
}

impl<'m> Renderer<'m> {
    pub fn new(model: &'m Model, cfg: RenderConfig) -> crate::Result<Renderer<'m>> {
        if cfg.max_len < 2 {
            return Err(crate::Error::Config(format!(
                "a maximum sequence length of {} tokens leaves nothing to learn",
                cfg.max_len
            )));
        }
        let template = match model.chat_template() {
            Some(t) => t.clone(),
            None => ChatTemplate::for_tokenizer(model.tokenizer())?,
        };
        Ok(Renderer {
            model,
            template,
            cfg,
        })
    }

    /// The sample of one record; an error message for a record that cannot be rendered.
    pub fn sample(&self, rec: &Record) -> std::result::Result<Sample, String> {
        let (ids, mut learn) = match rec {
            Record::Chat(turns) => self.chat(turns, 0)?,
            Record::Reply { turns, reply_from } => self.chat(turns, *reply_from)?,
            Record::Text { prompt, completion } => self.text(prompt, completion)?,
        };
        if self.cfg.train_on_prompt {
            learn.iter_mut().skip(1).for_each(|l| *l = true);
        }
        if let Some(l) = learn.first_mut() {
            *l = false;
        }
        let full_len = ids.len();
        let keep = full_len.min(self.cfg.max_len);
        let mut s = Sample {
            ids,
            learn,
            full_len,
        };
        s.ids.truncate(keep);
        s.learn.truncate(keep);
        if s.learned() == 0 {
            return Err(if s.truncated() {
                format!(
                    "nothing left to learn after cutting {full_len} tokens to --max-seq-len {}",
                    self.cfg.max_len
                )
            } else {
                "nothing to learn (no completion tokens)".into()
            });
        }
        Ok(s)
    }

    fn text(
        &self,
        prompt: &str,
        completion: &str,
    ) -> std::result::Result<(Vec<u32>, Vec<bool>), String> {
        let tok = self.model.tokenizer();
        let mut ids = Vec::new();
        if let (true, Some(b)) = (tok.add_bos(), tok.bos_id()) {
            ids.push(b);
        }
        let p = tok
            .encode(prompt, false, false)
            .map_err(|e| e.to_string())?;
        let c = tok
            .encode(completion, false, false)
            .map_err(|e| e.to_string())?;
        ids.extend(&p);
        let start = ids.len();
        ids.extend(&c);
        if let Some(e) = tok.eos_id() {
            ids.push(e);
        }
        let learn = (0..ids.len()).map(|i| i >= start).collect();
        Ok((ids, learn))
    }

    fn render(&self, turns: &[Turn], gen: bool) -> std::result::Result<String, String> {
        self.template
            .render_json(
                &messages(turns),
                &RenderOptions {
                    add_generation_prompt: gen,
                    ..Default::default()
                },
            )
            .map_err(|e| e.to_string())
    }

    /// The conversation's ids, learning its assistant turns from `turns[from]` on.
    fn chat(
        &self,
        turns: &[Turn],
        from: usize,
    ) -> std::result::Result<(Vec<u32>, Vec<bool>), String> {
        let enc = encode_chat_offsets(
            self.model.tokenizer(),
            &self.template,
            &messages(turns),
            &RenderOptions::default(),
        )
        .map_err(|e| e.to_string())?;
        if self.cfg.train_on_prompt {
            return Ok((enc.ids.clone(), vec![true; enc.ids.len()]));
        }
        // Byte spans of the assistant turns in the full render.
        let mut spans = Vec::new();
        for (i, t) in turns.iter().enumerate() {
            if t.role != "assistant" || i < from {
                continue;
            }
            let before = self.render(&turns[..i], true)?;
            let upto = self.render(&turns[..=i], false)?;
            if !upto.starts_with(&before) || !enc.text.starts_with(&upto) {
                return Err(format!(
                    "the chat template does not render this conversation turn by turn (turn {i} changes the text before it), so the assistant turns cannot be located; use --train-on-prompt, or prompt/completion records"
                ));
            }
            spans.push((before.len(), upto.len()));
        }
        let learn = enc
            .starts
            .iter()
            .map(|&o| spans.iter().any(|&(lo, hi)| o >= lo && o < hi))
            .collect();
        Ok((enc.ids, learn))
    }
}
