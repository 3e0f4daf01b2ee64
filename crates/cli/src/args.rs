//! Pieces shared by `run` and `chat`: sampling flags, loading the model, the context size, and
//! turning a conversation into prompt tokens.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use hf2q_models::chat_template::{self, ChatMessage};
use hf2q_models::generate::GenerateParams;
use hf2q_models::generation::GenerationDefaults;
use hf2q_models::kv_cache::{AffineKv, KeyCentering, KvType, KvTypes};
use hf2q_models::sampler::SamplerConfig;
use hf2q_models::Model;

use crate::pull;

/// Default KV-cache size when the model allows more (llama.cpp's default too): big enough for
/// chats, small enough that the cache of a large model fits in memory.
const DEFAULT_CTX: usize = 4096;

fn d() -> SamplerConfig {
    SamplerConfig::default()
}

/// Sampling and stopping flags. Temperature, top-k, top-p, min-p and the repetition penalty
/// default to the model's recommended sampling (`hf2q inspect` shows it), else llama.cpp's
/// defaults (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, penalty 1).
#[derive(clap::Args, Debug, Clone)]
pub struct SampleArgs {
    /// Temperature: higher is more random; 0 = greedy (always the most likely token)
    /// [default: the model's recommended, else 0.8].
    #[arg(long, value_name = "T")]
    pub temp: Option<f32>,
    /// Sample only among the K most likely tokens (0 = all) [default: the model's, else 40].
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// Nucleus sampling: keep the most likely tokens until their probabilities add up to P
    /// (1 = off) [default: the model's, else 0.95].
    #[arg(long, value_name = "P")]
    pub top_p: Option<f32>,
    /// Drop tokens less likely than P times the most likely one (0 = off) [default: the
    /// model's, else 0.05].
    #[arg(long, value_name = "P")]
    pub min_p: Option<f32>,
    /// Penalise tokens seen in the last --repeat-last-n tokens: positive logits are divided by
    /// it, negative ones multiplied (1 = off) [default: the model's, else 1].
    #[arg(long, value_name = "X")]
    pub repeat_penalty: Option<f32>,
    /// How many recent tokens (prompt included) the penalties look at.
    #[arg(long, value_name = "N", default_value_t = d().penalty_last_n)]
    pub repeat_last_n: usize,
    /// Subtract X from the logit of every token seen recently (0 = off).
    #[arg(long, value_name = "X", default_value_t = d().presence_penalty, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Subtract X times its count from the logit of every token seen recently (0 = off).
    #[arg(long, value_name = "X", default_value_t = d().frequency_penalty, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Random seed: the same seed, settings and prompt give the same text (default: from the
    /// clock).
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,
    /// Stop when the model writes TEXT (not printed). Repeat for several.
    #[arg(long = "stop", value_name = "TEXT")]
    pub stop: Vec<String>,
    /// Keep generating past end-of-generation tokens (for benchmarks).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Context size in tokens: prompt plus reply must fit [default: the model's, at most 4096].
    #[arg(short = 'c', long, value_name = "N")]
    pub ctx_size: Option<usize>,
    /// Matmul kernels for quantized weights (CPU).
    #[arg(long, value_enum, value_name = "PATH", default_value_t = MatmulChoice::Fast)]
    pub matmul: MatmulChoice,
    /// Where to run: `auto` uses the first NVIDIA GPU when there is one, else the CPU.
    #[arg(long, value_enum, value_name = "DEVICE", default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    #[command(flatten)]
    pub cuda: CudaOptArgs,
    #[command(flatten)]
    pub kv: KvArgs,
    /// A LoRA adapter to apply: a PEFT folder (adapter_config.json + adapter_model.safetensors,
    /// from `hf2q train` or `peft`), a llama.cpp LoRA .gguf, or an mlx-lm adapter folder
    /// (adapters.safetensors); told apart by content.
    #[arg(long, value_name = "PATH")]
    pub adapter: Option<PathBuf>,
}

/// `--kv-type`, `--kv-type-k`, `--kv-type-v` (llama.cpp's types), or `--kv-bits` and
/// `--kv-group-size` (mlx-lm's affine layout): what the KV cache stores keys and values as, on
/// every command that runs a model.
#[derive(clap::Args, Debug, Clone, Copy, Default)]
pub struct KvArgs {
    #[arg(long, value_enum, value_name = "TYPE", help = KV_TYPE_HELP, long_help = KV_TYPE_LONG_HELP)]
    pub kv_type: Option<KvTypeChoice>,
    /// The keys' type (llama.cpp's -ctk), instead of --kv-type's.
    #[arg(long, value_enum, value_name = "TYPE")]
    pub kv_type_k: Option<KvTypeChoice>,
    /// The values' type (llama.cpp's -ctv), instead of --kv-type's.
    #[arg(long, value_enum, value_name = "TYPE")]
    pub kv_type_v: Option<KvTypeChoice>,
    #[arg(long, value_enum, value_name = "BITS", conflicts_with_all = ["kv_type", "kv_type_k", "kv_type_v"], help = KV_BITS_HELP, long_help = KV_BITS_LONG_HELP)]
    pub kv_bits: Option<KvBitsChoice>,
    /// Values per scale and bias of --kv-bits (mlx-lm's --kv-group-size); the head width must be
    /// a multiple of it.
    #[arg(long, value_enum, value_name = "N", default_value_t = KvGroupChoice::G64, requires = "kv_bits")]
    pub kv_group_size: KvGroupChoice,
    /// Quantized keys (a block type or --kv-bits): this many first positions of a sequence are
    /// kept in f16 and every later key is stored less their mean, which attention adds back
    /// (key centring: a few large key channels no longer set every block's scale; the largest
    /// rotary pairs' mean follows the rotation). 0 stores keys as written. f16 and f32 keys are
    /// never centred.
    #[arg(long, value_name = "N", default_value_t = KeyCentering::DEFAULT.sinks)]
    pub kv_key_sinks: usize,
}

impl KvArgs {
    /// The key and value types when any of the flags was given: `--kv-bits` (with
    /// `--kv-group-size`) where given, else `--kv-type-k` / `--kv-type-v` where given, else
    /// `--kv-type`.
    pub fn chosen(&self) -> Option<KvTypes> {
        if let Some(bits) = self.kv_bits {
            return Some(KvType::Affine(bits.layout(self.kv_group_size)).into());
        }
        if (self.kv_type, self.kv_type_k, self.kv_type_v) == (None, None, None) {
            return None;
        }
        let one = self.kv_type.unwrap_or_default();
        Some(KvTypes {
            k: self.kv_type_k.unwrap_or(one).kv_type(),
            v: self.kv_type_v.unwrap_or(one).kv_type(),
        })
    }
    /// Sets `model`'s KV cache types and checks them against its head widths: the flags' when
    /// any was given, else the per-layer affine layouts of the model folder's `kv_config.json`
    /// when it has one (said on stderr), else f16. Returns the types a device must take (a
    /// per-layer cache: its first layer's, which the GPU refuses by name).
    pub fn apply(&self, model: &mut Model) -> Result<KvTypes> {
        let device_types = match (self.chosen(), model.kv_layer_types()) {
            (None, Some(layers)) => {
                let first = layers.first().copied().unwrap_or_default();
                eprintln!(
                    "kv cache: {} (the model folder's {})",
                    model.kv_type_name(),
                    hf2q_models::kv_config::FILE
                );
                first
            }
            (chosen, _) => {
                model.set_kv_type(chosen.unwrap_or_default());
                model.kv_type()
            }
        };
        model.set_kv_key_centering(KeyCentering {
            sinks: self.kv_key_sinks,
            ..KeyCentering::DEFAULT
        });
        model.check_kv_type()?;
        Ok(device_types)
    }
}

/// `--kv-bits`'s help, the same for every command that runs a model.
pub const KV_BITS_HELP: &str = "mlx-lm's quantized KV cache: 4 or 8 bits a value, with an f16 \
scale and bias per --kv-group-size values (CPU); instead of --kv-type";
pub const KV_BITS_LONG_HELP: &str = "mlx-lm's quantized KV cache (its --kv-bits, \
QuantizedKVCache): keys and values stored as 4- or 8-bit unsigned integers with an f16 scale \
and bias for each group of --kv-group-size (32, 64 or 128; default 64) values along the head, \
quantized when written as mx.quantize does and read directly by the attention. 8 bits in \
groups of 64 takes 68 bytes per 64 values (53 % of f16), 4 bits 36 (28 %). The head width must \
be a multiple of the group size; CPU only for now (--device auto then stays on the CPU). Cannot \
be combined with --kv-type, --kv-type-k or --kv-type-v.";

/// `--kv-bits`: mlx-lm's affine KV bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum KvBitsChoice {
    /// 4-bit integers (4.5 bits a value in groups of 64): 28 % of f16's memory.
    #[value(name = "4")]
    B4,
    /// 8-bit integers (8.5 bits a value in groups of 64): 53 % of f16's memory.
    #[value(name = "8")]
    B8,
}

/// `--kv-group-size`: values per scale and bias of `--kv-bits` (mlx's group sizes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum KvGroupChoice {
    #[value(name = "32")]
    G32,
    #[default]
    #[value(name = "64")]
    G64,
    #[value(name = "128")]
    G128,
}

impl KvBitsChoice {
    /// The affine layout of these bits in groups of `g`.
    pub fn layout(self, g: KvGroupChoice) -> AffineKv {
        match (self, g) {
            (KvBitsChoice::B8, KvGroupChoice::G32) => AffineKv::B8G32,
            (KvBitsChoice::B8, KvGroupChoice::G64) => AffineKv::B8G64,
            (KvBitsChoice::B8, KvGroupChoice::G128) => AffineKv::B8G128,
            (KvBitsChoice::B4, KvGroupChoice::G32) => AffineKv::B4G32,
            (KvBitsChoice::B4, KvGroupChoice::G64) => AffineKv::B4G64,
            (KvBitsChoice::B4, KvGroupChoice::G128) => AffineKv::B4G128,
        }
    }
}

/// `--kv-type`'s help, the same for every command that runs a model.
pub const KV_TYPE_HELP: &str = "What the KV cache stores: f16 (half the memory), f32 (exact), \
q8_0, q4_0, q4_1, q5_0 or q5_1 (ggml blocks, CPU); --kv-type-k / --kv-type-v for each \
[default: f16, or the model folder's kv_config.json]";
pub const KV_TYPE_LONG_HELP: &str = "What the KV cache stores keys and values as (llama.cpp's \
--cache-type-k/-v). f16, the default, halves the cache's memory (and what each generated token \
reads); keys and values are rounded to f16 once, when written (next-token distributions move \
by a mean KL of about 1e-6 on the tested models). f32 keeps what the model computed bit for \
bit: for exact comparisons with the reference (--matmul reference) or with transformers. \
q8_0, q4_0, q4_1, q5_0 and q5_1 store llama.cpp's blocks of 32 values; q8_0 stores Q8_0 blocks (32 values as an f16 scale and 32 8-bit integers, 34 bytes \
against f16's 64; -ctk/-ctv q8_0), quantized when written and read directly by the attention; \
it needs head widths that are multiples of 32 and runs on the CPU only for now (--device auto \
then stays on the CPU). q4_0 (4-bit values, 18 bytes per 32; 28 % of f16), q4_1 (4-bit with an \
offset, 20), q5_0 (5-bit, 22) and q5_1 (5-bit with an offset, 24) are stored and read the same \
way, with a larger effect on the output. --kv-type-k and --kv-type-v (llama.cpp's -ctk/-ctv) \
choose the keys' and the values' type apart (keys are the more sensitive). f16 and f32 apply \
to the CPU and the GPU cache (one type for both there).";

/// `--kv-type`: what the KV cache stores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum KvTypeChoice {
    /// Half precision: half the memory; values rounded once when written.
    #[default]
    F16,
    /// Single precision: bit-exact with the reference.
    F32,
    /// llama.cpp's Q8_0 blocks (8.5 bits a value): 53 % of f16's memory; CPU only for now.
    #[value(name = "q8_0")]
    Q8_0,
    /// llama.cpp's Q4_0 blocks (4.5 bits a value): 28 % of f16's memory, less exact; CPU only.
    #[value(name = "q4_0")]
    Q4_0,
    /// llama.cpp's Q4_1 blocks (5 bits a value, 4-bit with an offset): 31 % of f16; CPU only.
    #[value(name = "q4_1")]
    Q4_1,
    /// llama.cpp's Q5_0 blocks (5.5 bits a value): 34 % of f16; CPU only.
    #[value(name = "q5_0")]
    Q5_0,
    /// llama.cpp's Q5_1 blocks (6 bits a value, 5-bit with an offset): 38 % of f16; CPU only.
    #[value(name = "q5_1")]
    Q5_1,
}

impl KvTypeChoice {
    pub fn kv_type(self) -> KvType {
        match self {
            KvTypeChoice::F16 => KvType::F16,
            KvTypeChoice::F32 => KvType::F32,
            KvTypeChoice::Q8_0 => KvType::Q8_0,
            KvTypeChoice::Q4_0 => KvType::Q4_0,
            KvTypeChoice::Q4_1 => KvType::Q4_1,
            KvTypeChoice::Q5_0 => KvType::Q5_0,
            KvTypeChoice::Q5_1 => KvType::Q5_1,
        }
    }
    pub fn name(self) -> &'static str {
        self.kv_type().name()
    }
}

impl From<KvTypeChoice> for KvTypes {
    fn from(c: KvTypeChoice) -> KvTypes {
        c.kv_type().into()
    }
}

/// `--device`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceChoice {
    /// The GPU when one works, else the CPU.
    #[default]
    Auto,
    Cpu,
    /// The first NVIDIA GPU (an error when there is none).
    Cuda,
}

/// `--cuda-opt`: the CUDA tuning switches, on every command that takes `--device`.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct CudaOptArgs {
    #[arg(long = "cuda-opt", value_name = "KEY=VALUE", value_parser = check_cuda_opt, help = CUDA_OPT_HELP, long_help = cuda_opt_long_help())]
    pub cuda_opt: Vec<String>,
}

/// Checks a `--cuda-opt` value when the command line is read (before any model is loaded).
fn check_cuda_opt(list: &str) -> std::result::Result<String, String> {
    hf2q_cuda::CudaOptions::default()
        .set_list(list)
        .map(|()| list.to_string())
        .map_err(|e| e.to_string())
}

const CUDA_OPT_HELP: &str = "A CUDA kernel switch, KEY=VALUE (repeatable; comma-separated \
lists too): gemm, attn-tc, p8, act8, ... (--help lists them all)";

/// `--cuda-opt`'s long help: every key with its values and what it does.
fn cuda_opt_long_help() -> String {
    use hf2q_cuda::CudaOptions;
    let mut h = format!(
        "A CUDA kernel switch as KEY=VALUE; repeat the flag or give a comma-separated list \
         (gemm=f16,p8=off). The defaults are what measured fastest; the switches compare paths \
         and reproduce measurements. ${} takes the same list and applies first. Keys:",
        CudaOptions::ENV
    );
    for k in CudaOptions::KEYS {
        h.push_str(&format!("\n  {}={}: {}", k.key, k.values, k.help));
    }
    h
}

impl CudaOptArgs {
    /// The options a device opens with: the kernel cache and `$HF2Q_CUDA_OPT` from the
    /// environment, then the flags in order (a later setting wins).
    pub fn options(&self) -> Result<hf2q_cuda::CudaOptions> {
        let mut o = hf2q_cuda::CudaOptions::from_environment(|k| std::env::var_os(k))?;
        for list in &self.cuda_opt {
            o.set_list(list)
                .map_err(|e| anyhow::anyhow!("--cuda-opt {list}: {e}"))?;
        }
        Ok(o)
    }
}

/// Opens the device `choice` asks for, with the CUDA options of `cuda`, its KV caches of types
/// `kv`: `None` means the CPU. Bad `--cuda-opt` settings are an error even on the CPU.
/// The flags that choose cache types `kv`, as a message names them.
fn kv_flags(kv: KvTypes) -> String {
    match kv.same() {
        Some(KvType::Affine(a)) => {
            format!("--kv-bits {} --kv-group-size {}", a.bits(), a.group())
        }
        _ => format!("--kv-type {}", kv.name()),
    }
}

pub fn open_device(
    choice: DeviceChoice,
    cuda: &CudaOptArgs,
    kv: impl Into<KvTypes>,
) -> Result<Option<std::sync::Arc<hf2q_cuda::backend::CudaBackend>>> {
    use hf2q_cuda::backend::CudaBackend;
    use hf2q_cuda::CudaDev;
    let (options, kv) = (cuda.options()?, kv.into());
    if choice == DeviceChoice::Cpu {
        return Ok(None);
    }
    match CudaDev::open(0, &options) {
        Ok(Some(dev)) => {
            // A cache type the GPU has no kernels for: an error when the GPU was asked for,
            // else the CPU.
            let kv_dtype = match hf2q_cuda::KvDtype::try_from(kv) {
                Ok(t) => t,
                Err(e) if choice == DeviceChoice::Cuda => {
                    bail!("--device cuda {}: {e}", kv_flags(kv))
                }
                Err(_) => {
                    eprintln!(
                        "note: {} runs on the CPU (the GPU has no such cache yet)",
                        kv_flags(kv)
                    );
                    return Ok(None);
                }
            };
            let info = dev.info();
            let changed = options.changed();
            eprintln!(
                "device: {} (compute capability {}.{}){}",
                info.name,
                info.compute_capability.0,
                info.compute_capability.1,
                if changed.is_empty() {
                    String::new()
                } else {
                    format!(", options {}", changed.join(","))
                }
            );
            Ok(Some(std::sync::Arc::new(CudaBackend::new(dev, kv_dtype)?)))
        }
        Ok(None) if choice == DeviceChoice::Cuda => {
            bail!("--device cuda: no NVIDIA GPU or CUDA driver found")
        }
        Ok(None) => Ok(None),
        Err(e) if choice == DeviceChoice::Cuda => Err(e.into()),
        Err(e) => {
            eprintln!("warning: the GPU could not be used ({e}); running on the CPU");
            Ok(None)
        }
    }
}

/// `--matmul`: which CPU matmul path runs the quantized weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum MatmulChoice {
    /// SIMD kernels, activations as two 8-bit parts (16-bit precision): within 1e-6 mean KL of
    /// the reference on every tested model.
    #[default]
    Fast,
    /// SIMD kernels, 8-bit activations as llama.cpp computes them: faster prefill, less exact
    /// (mean KL about 3e-3 against the reference on SmolLM2).
    Fast8,
    /// The scalar f32 reference (dequantize a row, f32 dot): slow; matches transformers.
    Reference,
}

impl MatmulChoice {
    pub fn path(self) -> hf2q_cpu::MatmulPath {
        use hf2q_cpu::MatmulPath;
        match self {
            MatmulChoice::Fast => MatmulPath::Fast,
            MatmulChoice::Fast8 => MatmulPath::Fast8,
            MatmulChoice::Reference => MatmulPath::Reference,
        }
    }
}

impl SampleArgs {
    /// Applies the adapter, device, matmul-path and KV-cache-type choices to a loaded model.
    pub fn configure(&self, model: &mut Model) -> Result<()> {
        if let Some(dir) = &self.adapter {
            let cfg = model
                .load_adapter(dir)
                .with_context(|| format!("loading the adapter {}", dir.display()))?;
            eprintln!(
                "adapter: {} (rank {}, {} modules)",
                dir.display(),
                cfg.r,
                model.adapters().len()
            );
        }
        model.set_matmul_path(self.matmul.path());
        let kv = self.kv.apply(model)?;
        model.set_cuda(open_device(self.device, &self.cuda, kv)?)?;
        model.warm_up()?;
        Ok(())
    }
}

impl SampleArgs {
    /// The generation parameters: the flags given, else the model's recommended sampling
    /// (`model`), else llama.cpp's defaults.
    pub fn params(&self, max_tokens: usize, model: &GenerationDefaults) -> Result<GenerateParams> {
        let mut sampler = SamplerConfig {
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            penalty_last_n: self.repeat_last_n,
            seed: self.seed,
            logit_bias: Vec::new(),
            ..SamplerConfig::default()
        };
        model.apply(&mut sampler);
        let given = GenerationDefaults {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repeat_penalty,
            source: "flags",
        };
        given.apply(&mut sampler);
        sampler.validate()?;
        Ok(GenerateParams {
            max_tokens,
            sampler,
            stop: self.stop.clone(),
            ignore_eos: self.ignore_eos,
        })
    }

    /// The KV-cache size to use with `model`.
    pub fn context(&self, model: &Model) -> Result<usize> {
        let trained = model.context_length();
        match self.ctx_size {
            Some(0) => bail!("--ctx-size must be at least 1"),
            Some(n) => {
                if trained > 0 && n > trained {
                    eprintln!(
                        "warning: --ctx-size {n} is larger than the {trained} tokens the model was \
                         trained for; output past {trained} tokens may degrade"
                    );
                }
                Ok(n)
            }
            None if trained == 0 => Ok(DEFAULT_CTX),
            None => Ok(trained.min(DEFAULT_CTX)),
        }
    }
}

/// Resolves a model argument (default model when absent) and loads it.
pub fn load_model(arg: Option<&str>) -> Result<(PathBuf, Model)> {
    let path = pull::resolve_model_arg(arg.unwrap_or(pull::DEFAULT_MODEL))?;
    let mut model = Model::load(&path).with_context(|| format!("loading {}", path.display()))?;
    // A built-in model's file carries no generation_config.json: its card's settings stand in.
    if model.generation_defaults().is_empty() {
        let file = path.file_name().map(|f| f.to_string_lossy().to_string());
        if let Some(k) = pull::KNOWN.iter().find(|k| file.as_deref() == Some(k.file)) {
            model.set_generation_defaults(k.generation);
        }
    }
    Ok((path, model))
}

/// `[system] + messages` rendered with the model's chat template (or the generic fallback when
/// it has none) and tokenized so that message text cannot inject special tokens.
pub fn chat_tokens(
    model: &Model,
    system: Option<&str>,
    messages: &[ChatMessage],
) -> Result<Vec<u32>> {
    let mut all = Vec::with_capacity(messages.len() + 1);
    if let Some(s) = system {
        all.push(message("system", s));
    }
    all.extend(messages.iter().cloned());
    let tok = model.tokenizer();
    let ids = match model.chat_template() {
        Some(t) => chat_template::encode_chat(tok, t, &all, true)?,
        None => {
            // The generic ChatML fallback, with the tokenizer's special tokens.
            let t = chat_template::ChatTemplate::for_tokenizer(tok)?;
            chat_template::encode_chat(tok, &t, &all, true)?
        }
    };
    Ok(ids)
}

pub fn message(role: &str, content: &str) -> ChatMessage {
    ChatMessage {
        role: role.to_string(),
        content: content.to_string(),
    }
}

/// `prompt: N tokens, X tok/s; generated: M tokens, Y tok/s` on stderr.
pub fn print_stats(st: &hf2q_models::generate::GenerateStats) {
    eprintln!(
        "prompt: {} tokens, {:.1} tok/s; generated: {} tokens, {:.1} tok/s",
        st.prompt_tokens,
        st.prefill_tokens_per_sec(),
        st.completion_tokens,
        st.decode_tokens_per_sec()
    );
}

/// Agent mode's flags, shared by `serve` and `chat`.
#[derive(clap::Args, Debug, Clone)]
pub struct AgentArgs {
    /// Agent mode over folder DIR: the model may list, read and search its files at once, and
    /// write or edit files and run commands there after you approve each action (or allow a
    /// tool for the rest of the chat). Off without it.
    #[arg(long, value_name = "DIR")]
    pub workspace: Option<std::path::PathBuf>,
    /// Seconds a command of the agent may run before it is killed.
    #[arg(long, value_name = "SECS", default_value_t = 60.0)]
    pub command_timeout: f64,
}

impl AgentArgs {
    /// The agent configuration, or `None` without `--workspace`.
    pub fn config(&self) -> Result<Option<hf2q_server::agent::AgentConfig>> {
        let Some(dir) = &self.workspace else {
            return Ok(None);
        };
        if !(self.command_timeout > 0.0 && self.command_timeout <= 86400.0) {
            bail!("--command-timeout must be between 0 and 86400 seconds");
        }
        let mut c = hf2q_server::agent::AgentConfig::new(dir)
            .with_context(|| format!("--workspace {}", dir.display()))?;
        c.command_timeout = std::time::Duration::from_secs_f64(self.command_timeout);
        Ok(Some(c))
    }
}
