//! `Model`: a loaded checkpoint (any format) with its config, weights, tokenizer and template;
//! `Session`: one sequence's KV cache and position over a borrowed model.
//!
//! Every op goes through the model's backend (`hf2q_tensor::op::Backend`); on the CPU the matmul
//! path is chosen with [`Model::set_matmul_path`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use hf2q_cpu::{CpuBackend, LinearObserver, MatmulPath};
use hf2q_cuda::backend::{CudaBackend, StepOutput};
use hf2q_cuda::SampleArgs;
use hf2q_tensor::io::gguf::GgufFile;
use hf2q_tensor::op::Backend;
use hf2q_tensor::{QTensor, Tensor};
use serde::Serialize;

use crate::adapter_set::AdapterSet;
use crate::arch::{load_blocks, Block};
use crate::chat_template::ChatTemplate;
use crate::config::ModelConfig;
use crate::kv_cache::{KvCache, LayerKv, SeqRef};
use crate::layers::served::{BatchLora, Fwd};
use crate::source::{config_from_source, read_config_json, resolve_hf_cache, Format, WeightSource};
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};
use hf2q_tensor::kv::{KvStore, KvTypes};

mod kv;
mod mega;
mod paged;
mod paged_graph;
pub use paged::{PagedItem, PagedKvCache, Picked, RowPick};
mod parts;
mod swap;

/// What `hf2q inspect` prints (also as JSON).
#[derive(Clone, Debug, Serialize)]
pub struct ModelInfo {
    pub path: String,
    /// "gguf", "safetensors" or "mlx".
    pub format: String,
    /// "llama", "qwen2", "qwen3", "gemma3".
    pub architecture: String,
    pub name: Option<String>,
    pub parameters: u64,
    pub file_bytes: u64,
    pub bits_per_weight: f64,
    /// Stored type name -> (tensor count, element count).
    pub tensor_types: BTreeMap<String, (usize, u64)>,
    pub context_length: usize,
    pub n_layers: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rope_theta: f32,
    pub sliding_window: Option<usize>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub eog_tokens: Vec<String>,
    pub add_bos: bool,
    pub chat_template: bool,
    /// Recommended sampling (the defaults of run, chat and serve for this model).
    pub generation: crate::generation::GenerationDefaults,
    /// Routed experts, for a mixture of experts.
    pub experts: Option<ExpertsInfo>,
}

/// A mixture of experts as `inspect` shows it.
#[derive(Clone, Debug, Serialize)]
pub struct ExpertsInfo {
    /// E
    pub experts: usize,
    /// k: experts per token.
    pub experts_per_token: usize,
    /// F_e
    pub expert_width: usize,
    pub routed_layers: usize,
    /// Parameters one token's forward reads: all, less the experts it does not use
    /// (`(E - k) · 3 · D · F_e` per routed layer).
    pub active_parameters: u64,
}

pub struct Model {
    path: PathBuf,
    format: Format,
    name: Option<String>,
    file_bytes: u64,
    tensor_summary: Vec<(String, String, u64)>,
    pub config: ModelConfig,
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    /// (V, D)
    embed: QTensor,
    blocks: Vec<Box<dyn Block>>,
    /// (D)
    final_norm: Vec<f32>,
    /// (V, D); the embedding table when tied.
    lm_head: QTensor,
    backend: CpuBackend,
    /// Set: every op runs on this GPU instead of `backend`.
    cuda: Option<Arc<CudaBackend>>,
    cuda_graphs: bool,
    /// Paged decode steps of at most this many rows replay a graph per batch-size bucket
    /// (`paged_graph.rs`; 0: never): the device's `paged-graphs` option when
    /// [`Model::set_cuda`] is given one.
    paged_graph_rows: usize,
    /// A capture was refused (a step has an op that only runs eagerly): decode eagerly.
    graphs_refused: std::sync::atomic::AtomicBool,
    /// What new host KV caches store (`kv.rs`).
    kv_type: KvTypes,
    /// Each layer's type instead, from the folder's `kv_config.json` or the caller (`kv.rs`).
    kv_layers: Option<Vec<KvTypes>>,
    /// Whether new host caches with quantized keys centre them (`kv.rs`).
    kv_centering: hf2q_tensor::kv::KeyCentering,
    /// Recommended sampling: the folder's generation_config.json, or what the caller set.
    generation: crate::generation::GenerationDefaults,
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    path.is_file()
        && std::fs::File::open(path)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok()
        && &magic == b"GGUF"
}

impl Model {
    /// Loads a `.gguf` file, a Hugging Face folder (or HF cache `models--ORG--NAME` folder) or an
    /// MLX folder; the format is detected from what is there.
    pub fn load(path: &Path) -> Result<Model> {
        if !path.exists() {
            return Err(Error::Msg(format!(
                "{}: no such file or directory",
                path.display()
            )));
        }
        if is_gguf(path) {
            return Self::load_gguf(path);
        }
        if path.is_file() {
            return Err(Error::Msg(format!(
                "{}: not a GGUF file (expected a .gguf file or a folder with config.json and *.safetensors)",
                path.display()
            )));
        }
        let dir = resolve_hf_cache(path)?;
        if !dir.join("config.json").is_file() {
            return Err(Error::Msg(format!(
                "{}: folder has no config.json",
                dir.display()
            )));
        }
        let mut m = Self::load_folder(&dir)?;
        m.generation = crate::generation::GenerationDefaults::from_folder(&dir)?;
        m.kv_layers = crate::kv_config::from_folder(&dir, m.config.n_layers)?;
        Ok(m)
    }

    fn load_gguf(path: &Path) -> Result<Model> {
        // One file, or the first part of a split model with its other parts.
        let file = GgufFile::open_joined(path)?;
        let tokenizer = Tokenizer::from_gguf(&file)?;
        let name = file.get_str("general.name").map(str::to_string);
        let src_arch_probe = {
            let has_output = file.tensor("output.weight").is_some();
            ModelConfig::from_gguf(&file, has_output)?
        };
        let file_bytes = file.total_len();
        let src = WeightSource::gguf(file, src_arch_probe.arch);
        Self::assemble(path.to_path_buf(), src, None, tokenizer, name, file_bytes)
    }

    fn load_folder(dir: &Path) -> Result<Model> {
        let cfg_json = read_config_json(dir)?;
        let src = WeightSource::safetensors(dir, &cfg_json)?;
        let tj = dir.join("tokenizer.json");
        if !tj.is_file() {
            return Err(Error::Msg(format!(
                "{}: folder has no tokenizer.json",
                dir.display()
            )));
        }
        let tc = dir.join("tokenizer_config.json");
        let tokenizer = Tokenizer::from_hf_files(&tj, tc.is_file().then_some(tc.as_path()))?;
        let name = dir.file_name().map(|s| s.to_string_lossy().to_string());
        Self::assemble(
            dir.to_path_buf(),
            src,
            Some(cfg_json),
            tokenizer,
            name,
            dir_bytes(dir),
        )
    }

    fn assemble(
        path: PathBuf,
        src: WeightSource,
        cfg_json: Option<serde_json::Value>,
        tokenizer: Tokenizer,
        name: Option<String>,
        file_bytes: u64,
    ) -> Result<Model> {
        let config = config_from_source(&src, cfg_json.as_ref())?;
        let embed = src.matrix("model.embed_tokens.weight")?;
        if embed.cols != config.hidden_size {
            return Err(Error::Config(format!(
                "embedding width {} != hidden_size {}",
                embed.cols, config.hidden_size
            )));
        }
        let lm_head = if src.contains("lm_head.weight") && !config.tie_embeddings {
            src.matrix("lm_head.weight")?
        } else {
            embed.clone()
        };
        let mut config = config;
        // The weights are the truth about the vocabulary size.
        config.vocab_size = lm_head.rows;
        let mut blocks = load_blocks(&src, &config)?;
        let mut site = 0;
        for b in blocks.iter_mut() {
            for (_, lin) in b.linears_mut() {
                lin.site = site;
                site += 1;
            }
        }
        let host_steps = config.residual_scale != 1.0
            || config
                .longrope
                .as_ref()
                .is_some_and(|l| l.attn_factor != 1.0 && config.rope_dims != config.head_dim);
        let mut final_norm = src.vector("model.norm.weight")?;
        // Granite divides the logits by `logits_scaling`: the final norm's scale carries it
        // (the logits are linear in it), so every backend and the decode graph see one model.
        if config.logit_scale != 1.0 {
            final_norm.iter_mut().for_each(|w| *w *= config.logit_scale);
        }
        let template = match tokenizer.chat_template() {
            Some(t) => Some(ChatTemplate::new(
                t,
                tokenizer.bos_token(),
                tokenizer.eos_token(),
            )?),
            None => None,
        };
        Ok(Model {
            path,
            format: src.format(),
            name,
            file_bytes,
            tensor_summary: src.tensor_summary(),
            config,
            tokenizer,
            template,
            embed,
            blocks,
            final_norm,
            lm_head,
            backend: CpuBackend::default(),
            cuda: None,
            cuda_graphs: true,
            paged_graph_rows: 0,
            // Granite's residual multiplier and LongRoPE's attention factor on a partly rotated
            // head scale through the host (no device op scales a tensor yet): a step with them
            // cannot be captured, so such a model decodes eagerly on a GPU.
            graphs_refused: std::sync::atomic::AtomicBool::new(host_steps),
            kv_type: KvTypes::default(),
            kv_layers: None,
            kv_centering: Default::default(),
            generation: Default::default(),
        })
    }

    pub fn info(&self) -> ModelInfo {
        let mut types: BTreeMap<String, (usize, u64)> = BTreeMap::new();
        let mut params = 0u64;
        for (_, ty, n) in &self.tensor_summary {
            let e = types.entry(ty.clone()).or_default();
            e.0 += 1;
            e.1 += n;
            params += n;
        }
        let c = &self.config;
        let tok = &self.tokenizer;
        ModelInfo {
            path: self.path.display().to_string(),
            format: self.format.name().to_string(),
            architecture: c.arch.name().to_string(),
            name: self.name.clone(),
            parameters: params,
            file_bytes: self.file_bytes,
            bits_per_weight: if params > 0 {
                self.file_bytes as f64 * 8.0 / params as f64
            } else {
                0.0
            },
            tensor_types: types,
            context_length: c.context_length,
            n_layers: c.n_layers,
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            vocab_size: c.vocab_size,
            rope_theta: c.rope_theta,
            sliding_window: c.sliding_window,
            bos_token: tok.bos_token().map(str::to_string),
            eos_token: tok.eos_token().map(str::to_string),
            eog_tokens: tok
                .eog_ids()
                .iter()
                .filter_map(|&i| tok.token_to_str(i).map(str::to_string))
                .collect(),
            add_bos: tok.add_bos(),
            chat_template: self.template.is_some(),
            generation: self.generation.clone(),
            experts: c.moe.as_ref().map(|m| {
                let routed = m.layers.iter().filter(|&&r| r).count();
                let unused = (m.n_experts - m.n_used) * m.expert_params(c.hidden_size) * routed;
                ExpertsInfo {
                    experts: m.n_experts,
                    experts_per_token: m.n_used,
                    expert_width: m.expert_width,
                    routed_layers: routed,
                    active_parameters: params.saturating_sub(unused as u64),
                }
            }),
        }
    }

    /// The model's recommended sampling (empty when it recommends none).
    pub fn generation_defaults(&self) -> &crate::generation::GenerationDefaults {
        &self.generation
    }

    /// Sets the recommended sampling (e.g. from a model card, for a file that carries none).
    pub fn set_generation_defaults(&mut self, g: crate::generation::GenerationDefaults) {
        self.generation = g;
    }
    /// Chooses the CPU matmul path: `Reference` (the default here: f32 activations over
    /// dequantized rows, what golden parity is measured on), `Fast` (SIMD kernels, activations in
    /// two 8-bit parts; within the end-to-end gate) or `Fast8` (one 8-bit part, as llama.cpp).
    pub fn set_matmul_path(&mut self, path: MatmulPath) {
        self.backend.matmul = path;
    }
    /// Sets (or clears) the observer that sees the input of every matmul, e.g. an
    /// importance-matrix collector.
    pub fn set_linear_observer(&mut self, observer: Option<Arc<dyn LinearObserver>>) {
        self.backend.observer = observer;
    }
    /// Runs every op on a GPU from now on (weights are uploaded as they are first used), or back
    /// on the CPU with `None`. Caches made before keep their device: make new ones.
    /// Adapters move with the model (see [`Model::place_adapters`]).
    pub fn set_cuda(&mut self, cuda: Option<Arc<CudaBackend>>) -> Result<()> {
        self.adapters_to_host()?;
        self.paged_graph_rows = cuda
            .as_ref()
            .map_or(0, |c| c.device().options().paged_graphs);
        self.cuda = cuda;
        self.place_adapters()
    }
    /// The GPU this model runs on, if any.
    pub fn cuda(&self) -> Option<&Arc<CudaBackend>> {
        self.cuda.as_ref()
    }
    /// Does the one-time preparation of the weights for the CPU fast paths now, not in the
    /// first request: one forward of one token, which makes the packed copies the kernels read
    /// (`hf2q_cpu::PackedWeights`, in the order the forward uses the weights). Nothing
    /// on the reference path or a GPU.
    pub fn warm_up(&self) -> Result<()> {
        if self.cuda.is_none() && self.backend.matmul != MatmulPath::Reference {
            self.session(1).prefill(&[0])?;
        }
        Ok(())
    }
    pub fn matmul_path(&self) -> MatmulPath {
        self.backend.matmul
    }
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }
    /// The model's chat template, if it ships one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }
    /// Context length the model was trained for.
    pub fn context_length(&self) -> usize {
        self.config.context_length
    }
    pub fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }
    /// A new sequence holding at most `max_context` positions (0 = the model's context length).
    pub fn session(&self, max_context: usize) -> Session<'_> {
        Session {
            model: self,
            pos: 0,
            cache: self.new_cache(max_context),
        }
    }

    /// Products of the blocks (the sites of [`crate::layers::linear::Linear`]).
    pub fn sites(&self) -> usize {
        self.blocks.iter().map(|b| b.linears().len()).sum()
    }

    /// Runs a batch of sequences through the blocks in one forward: their tokens are concatenated
    /// for every matmul, attention runs per sequence over its own cache; `lora`: the rows'
    /// served adapters. Returns the normed hidden states `(ΣT, D)`.
    fn hidden_batch(
        &self,
        items: &mut [BatchItem<'_>],
        lora: Option<&BatchLora<'_>>,
    ) -> Result<Tensor> {
        let be = self.be();
        let cx = Fwd { be, lora };
        let mut ids = Vec::new();
        for it in items.iter() {
            if it.tokens.is_empty() {
                return Err(Error::Msg("no tokens to run".into()));
            }
            if it.pos0 + it.tokens.len() > it.cache.limit {
                return Err(Error::Msg(format!(
                    "context full: {} + {} tokens exceed the context size {}",
                    it.pos0,
                    it.tokens.len(),
                    it.cache.limit
                )));
            }
            ids.extend_from_slice(it.tokens);
        }
        let mut x = be.embedding(&self.embed, &ids, self.config.embed_scale)?;
        self.run_blocks(&cx, 0..self.blocks.len(), &mut x, items)?;
        Ok(be.rms_norm(
            &x,
            &self.final_norm,
            self.config.rms_eps,
            self.config.norm_offset,
        )?)
    }

    /// Blocks `layers` over the residual stream `x (ΣT, D)` of a batch (see
    /// [`Model::hidden_batch`]).
    fn run_blocks(
        &self,
        cx: &Fwd<'_>,
        layers: std::ops::Range<usize>,
        x: &mut Tensor,
        items: &mut [BatchItem<'_>],
    ) -> Result<()> {
        self.run_blocks_kv(cx, layers, x, &mut StepKv::Seqs(items))
    }

    /// [`Model::run_blocks`] over either per-sequence caches or a paged store.
    fn run_blocks_kv(
        &self,
        cx: &Fwd<'_>,
        layers: std::ops::Range<usize>,
        x: &mut Tensor,
        kv: &mut StepKv<'_, '_>,
    ) -> Result<()> {
        let n = self.blocks.len();
        if layers.start > layers.end || layers.end > n {
            return Err(Error::Msg(format!(
                "blocks {}..{} of a model of {n}",
                layers.start, layers.end
            )));
        }
        // The tokens and their embeddings, for blocks that read them (Gemma 4's per-layer
        // embeddings): gathered again here, so a run from any block has them.
        let ids: Vec<u32>;
        let embed;
        let inputs = if self.blocks[layers.clone()].iter().any(|b| b.wants_inputs()) {
            ids = match kv {
                StepKv::Seqs(items) => items
                    .iter()
                    .flat_map(|it| it.tokens.iter().copied())
                    .collect(),
                StepKv::Paged { ids, .. } => ids.to_vec(),
            };
            embed = cx
                .be
                .embedding(&self.embed, &ids, self.config.embed_scale)?;
            Some(crate::arch::BlockInputs {
                ids: &ids,
                embed: &embed,
            })
        } else {
            None
        };
        for li in layers {
            let block = &self.blocks[li];
            // A KV-shared layer attends over an earlier layer's cache.
            let kv_li = block.kv_source().filter(|&s| s < li).unwrap_or(li);
            let mut seqs: Vec<SeqRef<'_>> = match kv {
                StepKv::Seqs(items) => {
                    let mut start = 0;
                    items
                        .iter_mut()
                        .map(|it| {
                            let len = it.tokens.len();
                            let limit = it.cache.limit;
                            let r = SeqRef {
                                kv: LayerKv::Seq(&mut it.cache.layers[kv_li]),
                                start,
                                len,
                                pos0: it.pos0,
                                limit,
                            };
                            start += len;
                            r
                        })
                        .collect()
                }
                StepKv::Paged { layers, step, .. } => vec![SeqRef {
                    kv: LayerKv::Paged {
                        store: &mut layers[kv_li],
                        step,
                    },
                    start: 0,
                    len: step.len(),
                    pos0: 0,
                    limit: usize::MAX,
                }],
            };
            block.forward_with(cx, x, &mut seqs, inputs.as_ref())?;
        }
        Ok(())
    }

    /// One batched step: for each sequence, feeds its tokens after `pos0` and returns the logits
    /// `(V)` of its last token. The caller advances positions.
    pub fn step_batch(&self, items: &mut [BatchItem<'_>]) -> Result<Vec<Vec<f32>>> {
        self.step_batch_served(items, None)
    }

    /// [`Model::step_batch`] with served adapters: `served = (set, slot of each item)` (`None`
    /// for an item on the base alone). The base products run once over the whole batch; each
    /// adapter's term over the rows of its items ([`BatchLora`]).
    pub fn step_batch_served(
        &self,
        items: &mut [BatchItem<'_>],
        served: Option<(&AdapterSet, &[Option<usize>])>,
    ) -> Result<Vec<Vec<f32>>> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let lens: Vec<usize> = items.iter().map(|it| it.tokens.len()).collect();
        let lora = batch_lora(served, &lens)?;
        let h = self.hidden_batch(items, lora.as_ref())?;
        self.last_logits(&h, &lens)
    }

    /// The logits `(V)` of the last row of each sequence of `h (ΣT, D)`, whose rows are
    /// sequences of `lens` rows one after another.
    fn last_logits(&self, h: &Tensor, lens: &[usize]) -> Result<Vec<Vec<f32>>> {
        let be = self.be();
        let l = be.to_host(&self.logits(&self.last_rows(h, lens)?)?)?;
        let v = l.dims2().1;
        Ok(l.into_data().chunks(v).map(<[f32]>::to_vec).collect())
    }

    /// The last row of each sequence of `h (ΣT, D)` (sequences of `lens` rows one after
    /// another) -> `(lens.len(), D)`.
    fn last_rows(&self, h: &Tensor, lens: &[usize]) -> Result<Tensor> {
        let be = self.be();
        let total = h.dims2().0;
        Ok(if lens.len() == 1 && lens[0] == total {
            be.rows(h, total - 1, 1)?
        } else {
            let mut end = 0;
            let mut rows = Vec::with_capacity(lens.len());
            for &n in lens {
                end += n;
                rows.push(be.rows(h, end - 1, 1)?);
            }
            be.concat_rows(&rows)?
        })
    }

    /// `h (T, D)` -> logits `(T, V)`.
    fn logits(&self, h: &Tensor) -> Result<Tensor> {
        let be = self.be();
        let mut l = be.linear(h, &self.lm_head, None)?;
        if let Some(cap) = self.config.final_logit_softcap {
            be.softcap(&mut l, cap)?;
        }
        Ok(l)
    }

    /// Enables (default) or disables CUDA-graph decode ([`Session::decode`] on a GPU).
    pub fn set_cuda_graphs(&mut self, on: bool) {
        self.cuda_graphs = on;
    }

    /// Enables (for every bucket, up to 128 rows) or disables replaying paged decode steps as
    /// one graph per batch-size bucket ([`Model::step_paged_pick`] on a GPU; the default is the
    /// device's `paged-graphs` option). Graphs already captured in a paged cache stay there.
    pub fn set_paged_graphs(&mut self, on: bool) {
        self.paged_graph_rows = if on { 128 } else { 0 };
    }

    /// One-token decode of one sequence as a replayed CUDA graph: `None` when this model does
    /// not run that way (CPU, graphs off, a step with an op that only runs eagerly) or the cache
    /// is not ready for a capture yet (not every layer on the device: the first step runs
    /// eagerly). Soft-capped logits are capped inside the graph. With
    /// [`StepMode::Argmax`] or [`StepMode::Sample`] the graph ends in picking the token on the
    /// device and only its id comes back.
    ///
    /// `mask`: the allowed-token bits of a constrained step (pick modes only): the graph bans
    /// the other tokens before its pick (a masked graph, captured once per cache like the
    /// others).
    fn decode_graph(
        &self,
        cache: &mut KvCache,
        pos0: usize,
        token: u32,
        mode: StepMode,
        mask: Option<StepMask<'_>>,
    ) -> Result<Option<StepOut>> {
        let Some(cuda) = self
            .cuda
            .as_ref()
            .filter(|_| self.cuda_graphs && !self.graphs_refused.load(Ordering::Relaxed))
        else {
            return Ok(None);
        };
        // A replay reads the id on the device, past every host check: check it here.
        if token as usize >= self.embed.rows {
            return Err(Error::Msg(format!(
                "token id {token} is outside the vocabulary of {} tokens",
                self.embed.rows
            )));
        }
        if cache
            .layers
            .iter()
            .any(|l| !matches!(l, KvStore::Device(_)))
        {
            return Ok(None);
        }
        if pos0 + 1 > cache.limit {
            return Err(Error::Msg(format!(
                "context full: {} tokens exceed the context size {}",
                pos0 + 1,
                cache.limit
            )));
        }
        // A graph of another kind (logits, argmax, sampling) is dropped and captured again.
        let kind = match mode {
            StepMode::Logits => StepOutput::Logits,
            StepMode::Argmax => StepOutput::Argmax,
            StepMode::Sample(_) => StepOutput::Sample,
        };
        if mask.is_some() && kind == StepOutput::Logits {
            return Ok(None);
        }
        let mut graph = match cache
            .graph
            .take()
            .filter(|g| g.output() == kind && g.is_masked() == mask.is_some())
        {
            Some(g) => g,
            None => {
                let vocab = self.lm_head.rows;
                // `decode=mega`: the layers as one persistent kernel where it runs this model
                // (its buffers are made here: a capture cannot upload).
                let mega = self.mega_prepare(cuda, cache)?;
                let step = || {
                    if mega {
                        if let Some(h) = self.mega_hidden(cuda, cache, pos0, token)? {
                            return self.logits(&h);
                        }
                    }
                    let mut item = [BatchItem {
                        cache: &mut *cache,
                        pos0,
                        tokens: &[token],
                    }];
                    let h = self.hidden_batch(&mut item, None)?;
                    self.logits(&h)
                };
                let captured = if mask.is_some() {
                    cuda.capture_masked(&[token], pos0, vocab, kind, step)
                } else {
                    cuda.capture(&[token], pos0, vocab, kind, step)
                };
                match captured {
                    Ok(g) => g,
                    // A step with an op that only runs eagerly (experts without device
                    // kernels): this model decodes eagerly from now on.
                    Err(Error::Tensor(hf2q_tensor::Error::NotCapturable(_))) => {
                        self.graphs_refused.store(true, Ordering::Relaxed);
                        return Ok(None);
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        let sample = match mode {
            StepMode::Sample(a) => Some(a),
            _ => None,
        };
        let out = match (mode, mask) {
            (StepMode::Logits, _) => cuda
                .replay(&mut graph, &[token], pos0)
                .map(|l| StepOut::Logits(l.into_data()))
                .map_err(Error::from),
            (_, None) => cuda
                .replay_pick(&mut graph, &[token], pos0, sample, None)
                .map(|ids| StepOut::Token(ids[0]))
                .map_err(Error::from),
            (_, Some(StepMask::Bits(m))) => cuda
                .replay_pick(&mut graph, &[token], pos0, sample, Some(m))
                .map(|ids| StepOut::Token(ids[0]))
                .map_err(Error::from),
            // The grammar computes this step's mask while the forward runs.
            (_, Some(StepMask::Constraint(c))) => cuda
                .replay_pick_overlapped(&mut graph, &[token], pos0, sample, move || c.mask())
                .map(|ids| StepOut::Token(ids[0])),
        };
        cache.graph = Some(graph);
        Ok(Some(out?))
    }

    /// The decoder blocks (adapters, training passes).
    pub(crate) fn blocks(&self) -> &[Box<dyn Block>] {
        &self.blocks
    }
    pub(crate) fn blocks_mut(&mut self) -> &mut [Box<dyn Block>] {
        &mut self.blocks
    }
    /// `(embedding table, final norm, output layer)`.
    pub(crate) fn ends(&self) -> (&QTensor, &[f32], &QTensor) {
        (&self.embed, &self.final_norm, &self.lm_head)
    }
    /// Where the model was loaded from (a file or a folder).
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// The checkpoint's own name, when it records one (GGUF `general.name`, the folder name).
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }
    /// The training op set of the backend this model runs on (the GPU when one is set).
    pub fn train_backend(&self) -> &dyn hf2q_tensor::train_op::TrainBackend {
        match &self.cuda {
            Some(c) => &**c,
            None => &self.backend,
        }
    }

    /// [`Model::train_backend`] as a handle that does not borrow the model (an optimizer
    /// updates the adapters through it while it holds the model mutably).
    pub fn train_backend_handle(&self) -> Arc<dyn hf2q_tensor::train_op::TrainBackend> {
        match &self.cuda {
            Some(c) => c.clone(),
            None => Arc::new(CpuBackend {
                matmul: self.backend.matmul,
                ..CpuBackend::default()
            }),
        }
    }

    /// The backend every op of this model runs on.
    pub(crate) fn be(&self) -> &dyn Backend {
        match &self.cuda {
            Some(c) => &**c,
            None => &self.backend,
        }
    }
}

/// What a decode graph ends in (see [`StepOutput`]), with the sampling settings of this step.
#[derive(Clone, Copy, Debug)]
enum StepMode {
    Logits,
    Argmax,
    Sample(SampleArgs),
}

/// The token mask of a constrained decode step: bits known before the step, or the constraint
/// that computes them (on a GPU, while the forward runs).
enum StepMask<'a> {
    Bits(&'a [u32]),
    Constraint(&'a mut crate::constraint::Constraint),
}

/// What a replayed decode graph returns.
enum StepOut {
    Logits(Vec<f32>),
    Token(u32),
}

/// One sequence's part of a batched step ([`Model::step_batch`]).
/// Where a batched forward's layers keep keys and values: each sequence's own cache, or one
/// paged store per layer shared by the step's rows (`model/paged.rs`).
pub(crate) enum StepKv<'a, 's> {
    Seqs(&'a mut [BatchItem<'s>]),
    Paged {
        layers: &'a mut [hf2q_tensor::paged::PagedStore],
        step: &'a hf2q_tensor::paged::PagedStep,
        /// The step's token ids, row by row.
        ids: &'a [u32],
    },
}

pub struct BatchItem<'s> {
    pub cache: &'s mut KvCache,
    /// Position of the first of `tokens` (tokens already in the cache).
    pub pos0: usize,
    pub tokens: &'s [u32],
}

/// One sequence: KV cache + position.
pub struct Session<'m> {
    model: &'m Model,
    pos: usize,
    cache: KvCache,
}

impl<'m> Session<'m> {
    pub fn model(&self) -> &'m Model {
        self.model
    }
    /// Tokens in the cache.
    pub fn pos(&self) -> usize {
        self.pos
    }
    pub fn max_context(&self) -> usize {
        self.cache.limit
    }
    /// Bytes held by the KV cache.
    pub fn cache_bytes(&self) -> usize {
        self.cache.bytes()
    }
    pub fn reset(&mut self) {
        self.pos = 0;
    }
    /// Feeds `tokens` (appended after what is cached) and returns the logits `(V)` of the last one.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let mut item = [BatchItem {
            cache: &mut self.cache,
            pos0: self.pos,
            tokens,
        }];
        let mut l = self.model.step_batch(&mut item)?;
        self.pos += tokens.len();
        Ok(l.pop().expect("one sequence in, one row out"))
    }
    /// Feeds one token and returns its logits `(V)`. On a GPU, after the first step, this is
    /// one replay of a captured CUDA graph.
    pub fn decode(&mut self, token: u32) -> Result<Vec<f32>> {
        match self
            .model
            .decode_graph(&mut self.cache, self.pos, token, StepMode::Logits, None)?
        {
            Some(StepOut::Logits(l)) => {
                self.pos += 1;
                Ok(l)
            }
            _ => self.prefill(&[token]),
        }
    }
    /// Feeds one token and returns the most likely next token (the first of equal logits, as
    /// [`crate::sampler::argmax`]). On a GPU, after the first step, the argmax runs inside the
    /// replayed graph and only the token id crosses to the host.
    pub fn decode_greedy(&mut self, token: u32) -> Result<u32> {
        match self
            .model
            .decode_graph(&mut self.cache, self.pos, token, StepMode::Argmax, None)?
        {
            Some(StepOut::Token(id)) => {
                self.pos += 1;
                Ok(id)
            }
            _ => Ok(crate::sampler::argmax(&self.prefill(&[token])?)),
        }
    }
    /// Feeds one token and draws the next with `sampler` (`history`: the tokens its penalties
    /// look at). On a GPU, when the sampler's settings allow it (top-k of at most
    /// [`hf2q_cuda::SAMPLE_MAX_K`], no bias, no penalties), the draw runs inside the
    /// replayed graph with the sampler's own uniform number, so only the token id crosses; the
    /// host draw would pick the same token from the same logits.
    pub fn decode_sampled(
        &mut self,
        token: u32,
        sampler: &mut crate::sampler::Sampler,
        history: &[u32],
    ) -> Result<u32> {
        if sampler.config().is_plain_greedy() {
            return self.decode_greedy(token);
        }
        if self.model.cuda.is_some() {
            if let Some(args) = sampler.device_args() {
                if let Some(StepOut::Token(id)) = self.model.decode_graph(
                    &mut self.cache,
                    self.pos,
                    token,
                    StepMode::Sample(args),
                    None,
                )? {
                    sampler.device_drew();
                    self.pos += 1;
                    return Ok(id);
                }
            }
        }
        // The host draw (it uses the uniform number already drawn above, if any).
        let mut logits = self.decode(token)?;
        Ok(sampler.sample(&mut logits, history))
    }
    /// [`Session::decode_sampled`] with only the tokens of `mask` allowed (constrained
    /// decoding; bits as [`crate::constraint`] makes them). On a GPU the mask is uploaded and
    /// applied inside the replayed graph before the on-device pick (argmax or draw); on the
    /// CPU, or when the draw needs the host, it is applied to the logits before sampling.
    pub fn decode_sampled_masked(
        &mut self,
        token: u32,
        sampler: &mut crate::sampler::Sampler,
        history: &[u32],
        mask: &[u32],
    ) -> Result<u32> {
        self.decode_pick_masked(token, sampler, history, StepMask::Bits(mask))
    }
    /// [`Session::decode_sampled_masked`] with the mask taken from `constraint` (which has
    /// committed every token so far). On a GPU the grammar computes the mask while the forward
    /// pass runs, so its time is hidden behind the step's.
    pub fn decode_constrained(
        &mut self,
        token: u32,
        sampler: &mut crate::sampler::Sampler,
        history: &[u32],
        constraint: &mut crate::constraint::Constraint,
    ) -> Result<u32> {
        if !constraint.is_active() {
            // Nothing constrains this step (a lazy grammar not yet triggered).
            return self.decode_sampled(token, sampler, history);
        }
        self.decode_pick_masked(token, sampler, history, StepMask::Constraint(constraint))
    }
    fn decode_pick_masked(
        &mut self,
        token: u32,
        sampler: &mut crate::sampler::Sampler,
        history: &[u32],
        mut mask: StepMask<'_>,
    ) -> Result<u32> {
        if self.model.cuda.is_some() {
            let mode = if sampler.config().is_plain_greedy() {
                Some(StepMode::Argmax)
            } else {
                sampler.device_args().map(StepMode::Sample)
            };
            if let Some(mode) = mode {
                let reborrowed = match &mut mask {
                    StepMask::Bits(m) => StepMask::Bits(m),
                    StepMask::Constraint(c) => StepMask::Constraint(c),
                };
                let out = self.model.decode_graph(
                    &mut self.cache,
                    self.pos,
                    token,
                    mode,
                    Some(reborrowed),
                )?;
                if let Some(StepOut::Token(id)) = out {
                    if matches!(mode, StepMode::Sample(_)) {
                        sampler.device_drew();
                    }
                    self.pos += 1;
                    return Ok(id);
                }
            }
        }
        let mut logits = self.decode(token)?;
        let bits = match mask {
            StepMask::Bits(m) => Some(m),
            StepMask::Constraint(c) => c.mask()?,
        };
        if let Some(m) = bits {
            crate::sampler::apply_mask(&mut logits, m);
        }
        Ok(sampler.sample(&mut logits, history))
    }
    /// The captured decode graph's node count (GPU, after the first decoded token), for
    /// `--stats`.
    pub fn graph_nodes(&self) -> Option<usize> {
        self.cache.graph.as_ref().map(|g| g.node_count())
    }
    /// Feeds `tokens` and returns the logits of every position `(T, V)` (teacher forcing).
    pub fn forward_all(&mut self, tokens: &[u32]) -> Result<Tensor> {
        let mut item = [BatchItem {
            cache: &mut self.cache,
            pos0: self.pos,
            tokens,
        }];
        let h = self.model.hidden_batch(&mut item, None)?;
        let l = self.model.be().to_host(&self.model.logits(&h)?)?;
        self.pos += tokens.len();
        Ok(l)
    }
}

/// Which rows of a batch of sequences (`lens` rows each, one after another) use which served
/// adapter: `served` is the adapters and each sequence's slot (`None`: the base). `None` when
/// no sequence uses an adapter.
fn batch_lora<'a>(
    served: Option<(&'a AdapterSet, &[Option<usize>])>,
    lens: &[usize],
) -> Result<Option<BatchLora<'a>>> {
    match served {
        Some((set, slots)) if slots.iter().any(Option::is_some) => {
            if slots.len() != lens.len() {
                return Err(Error::Msg(format!(
                    "{} adapter slots for a batch of {} sequences",
                    slots.len(),
                    lens.len()
                )));
            }
            let seqs: Vec<(usize, Option<usize>)> =
                lens.iter().copied().zip(slots.iter().copied()).collect();
            Ok(Some(BatchLora::new(set, &seqs)?))
        }
        _ => Ok(None),
    }
}
