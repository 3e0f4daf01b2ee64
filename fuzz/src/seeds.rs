//! The seed corpora (`hf2q-fuzz seeds`): small valid inputs per target, made from the repository's
//! fixtures and from models synthesised at a micro shape (width 32, one layer) so that each seed
//! is a few kilobytes and AFL runs thousands of them per second. The output is committed under
//! `fuzz/corpus/`; the command is deterministic, so re-running it reproduces the files.

use std::collections::BTreeMap;
use std::path::Path;

use hf2q_models::config::Arch;
use hf2q_models::convert::mlx_out::MlxOptions;
use hf2q_models::convert::{self, ConvertTarget, NoProgress};
use hf2q_models::quantize::imatrix::{Imatrix, ImatrixEntry};
use hf2q_models::quantize::presets::{GgufRecipe, Preset};
use hf2q_models::synth::{self, SynthOptions, SynthShape};
use hf2q_tensor::io::gguf::{GgufArray, GgufFile, GgufValue, GgufValueType, GgufWriter};
use hf2q_tensor::io::safetensors::{write_safetensors_to, StDtype};
use hf2q_tensor::quant::mlx::AffineParams;
use serde_json::json;

use crate::{fixtures_dir, join2, targets, Target};

type Result<T> = std::result::Result<T, String>;

fn err(what: &str) -> impl Fn(hf2q_models::Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// A micro Llama (or Qwen3) shape: one layer, width 32, the tiny model's 259 tokens.
fn micro(arch: Arch) -> SynthShape {
    let mut s = SynthShape::by_name("tiny").expect("the tiny shape");
    s.arch = arch;
    s.hidden_size = 32;
    s.intermediate_size = 64;
    s.n_layers = 1;
    s.n_heads = 2;
    s.n_kv_heads = 1;
    s.head_dim = 16;
    s.context_length = 64;
    if arch != Arch::Llama {
        s.llama3_rope = None;
    }
    s
}

/// Writes every target's seeds under `out/NAME/`; returns (target, files, bytes) per target.
pub fn write_all(out: &Path) -> Result<Vec<(Target, usize, u64)>> {
    let work = tempfile::tempdir().map_err(|e| e.to_string())?;
    let tiny = fixtures_dir().join("tiny/tiny-llama");
    let (tok_meta, _) = synth::tokenizer_metadata(&tiny).map_err(err("tokenizer metadata"))?;

    // Micro models, GGUF.
    let mut ggufs = Vec::new();
    for (name, arch, preset) in [
        ("llama-q4_0", Arch::Llama, Preset::Q4_0),
        ("llama-q8_0", Arch::Llama, Preset::Q8_0),
        ("qwen3-q4_0", Arch::Qwen3, Preset::Q4_0),
    ] {
        let p = work.path().join(format!("{name}.gguf"));
        let opts = SynthOptions {
            shape: micro(arch),
            recipe: GgufRecipe { preset, pure: true },
            seed: 1,
            tokenizer: tok_meta.clone(),
        };
        synth::synthesize(&opts, &p, &NoProgress).map_err(err("synthesize"))?;
        ggufs.push((name, std::fs::read(&p).map_err(|e| e.to_string())?));
    }
    let gguf_py =
        std::fs::read(fixtures_dir().join("../../../tensor/tests/fixtures/gguf/gguf_py.gguf"))
            .map_err(|e| format!("gguf_py.gguf: {e}"))?;

    let mut out_files: Vec<(Target, String, Vec<u8>)> = Vec::new();
    let mut put =
        |t: Target, name: &str, bytes: Vec<u8>| out_files.push((t, name.to_string(), bytes));

    for (name, bytes) in &ggufs {
        put(Target::Gguf, name, bytes.clone());
    }
    put(Target::Gguf, "gguf-py-fixture", gguf_py);

    // safetensors: a shard of three dtypes, with and without an index.
    let f32s: Vec<u8> = (0..12)
        .flat_map(|i| (i as f32 * 0.5).to_le_bytes())
        .collect();
    let f16s: Vec<u8> = [0x3c00u16, 0xc000, 0x7bff, 0x0001, 0x8000, 0x3555]
        .iter()
        .flat_map(|h| h.to_le_bytes())
        .collect();
    let bf16s: Vec<u8> = [0x3f80u16, 0xbf80, 0x4049, 0x0000]
        .iter()
        .flat_map(|h| h.to_le_bytes())
        .collect();
    let mut shard = Vec::new();
    let mut meta = BTreeMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    write_safetensors_to(
        &mut shard,
        &[
            (
                "model.embed_tokens.weight".into(),
                StDtype::F32,
                vec![3, 4],
                &f32s,
            ),
            ("model.norm.weight".into(), StDtype::F16, vec![6], &f16s),
            ("lm_head.weight".into(), StDtype::BF16, vec![2, 2], &bf16s),
        ],
        &meta,
    )
    .map_err(|e| e.to_string())?;
    let index = json!({
        "metadata": {"total_size": 68},
        "weight_map": {
            "model.embed_tokens.weight": targets::safetensors::SHARD,
            "model.norm.weight": targets::safetensors::SHARD,
            "lm_head.weight": targets::safetensors::SHARD,
        }
    });
    put(
        Target::Safetensors,
        "with-index",
        join2(index.to_string().as_bytes(), &shard),
    );
    put(Target::Safetensors, "no-index", join2(b"", &shard));

    // tokenizer.json, and GGUF tokenizer metadata (the tiny BPE one and an SPM-style one).
    let texts = [
        "Hello world",
        "<s>user: hi</s> ünïcödé \u{1f600}\n\ttabs  and  spaces",
    ];
    for (i, t) in texts.iter().enumerate() {
        put(
            Target::TokenizerJson,
            &format!("tiny-{i}"),
            join2(targets::tiny::TOKENIZER_JSON, t.as_bytes()),
        );
    }
    let tok_only = |meta: &[(String, GgufValue)]| -> Result<Vec<u8>> {
        let mut w = GgufWriter::new();
        for (k, v) in meta {
            w.add_metadata(k.clone(), v.clone())
                .map_err(|e| e.to_string())?;
        }
        let mut b = Vec::new();
        w.write(&mut b).map_err(|e| e.to_string())?;
        Ok(b)
    };
    put(
        Target::GgufTokenizer,
        "tiny-bpe",
        join2(&tok_only(&tok_meta)?, texts[1].as_bytes()),
    );
    put(
        Target::GgufTokenizer,
        "spm",
        join2(&tok_only(&spm_meta(&tok_meta))?, texts[0].as_bytes()),
    );

    // Chat templates: the fixtures' templates over a conversation with a tool call.
    let conv = json!({
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "{\"temp\": 21}"},
            {"role": "assistant", "content": "21 degrees."},
            {"role": "user", "content": "<s>thanks</s>"}
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
        "extra": {"enable_thinking": false}
    });
    let tdir = fixtures_dir().join("tokenizer/templates");
    let mut names: Vec<_> = std::fs::read_dir(&tdir)
        .map_err(|e| format!("{}: {e}", tdir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    names.sort();
    for p in names {
        let src = std::fs::read(&p).map_err(|e| e.to_string())?;
        let stem = p
            .file_stem()
            .unwrap_or_default()
            .to_string_lossy()
            .to_string();
        put(
            Target::ChatTemplate,
            &stem,
            join2(&src, conv.to_string().as_bytes()),
        );
    }
    let tiny_tmpl = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}";
    put(
        Target::ChatTemplate,
        "tiny",
        join2(tiny_tmpl.as_bytes(), br#"[{"role":"user","content":"hi"}]"#),
    );

    // MLX: the micro Llama converted to a 4-bit, group-32 MLX folder.
    let mlx_dir = work.path().join("mlx");
    let src = convert::source::SourceModel::open(&work.path().join("llama-q8_0.gguf"))
        .map_err(err("open micro GGUF"))?;
    let target = ConvertTarget::Mlx(MlxOptions {
        params: AffineParams {
            bits: 4,
            group_size: 32,
        },
        overrides: BTreeMap::new(),
        dtype: Some(StDtype::F16),
    });
    convert::convert(&src, &mlx_dir, &target, &NoProgress).map_err(err("convert to MLX"))?;
    let cfg = std::fs::read(mlx_dir.join("config.json")).map_err(|e| e.to_string())?;
    let st = std::fs::read(mlx_dir.join("model.safetensors")).map_err(|e| e.to_string())?;
    put(Target::Mlx, "micro-llama-q4g32", join2(&cfg, &st));

    // imatrix: one entry per linear of the micro model, as llama-imatrix would write.
    let micro_gguf =
        GgufFile::open(&work.path().join("llama-q4_0.gguf")).map_err(|e| e.to_string())?;
    let mut entries = BTreeMap::new();
    for t in micro_gguf
        .tensors
        .iter()
        .filter(|t| t.name.starts_with("blk.") && t.dims.len() == 2)
    {
        let ne0 = t.dims[0] as usize;
        entries.insert(
            t.name.clone(),
            ImatrixEntry {
                sums: (0..ne0).map(|j| 1.0 + j as f32 * 0.25).collect(),
                counts: vec![8.0],
            },
        );
    }
    let im = Imatrix::new(entries, vec!["seed.txt".into()], 2, 8);
    let im_path = work.path().join("micro.imatrix.gguf");
    im.save(&im_path).map_err(err("imatrix save"))?;
    put(
        Target::Imatrix,
        "micro",
        std::fs::read(&im_path).map_err(|e| e.to_string())?,
    );

    // OpenAI request bodies: the first byte picks the route (see targets::openai::ROUTES).
    let bodies: [(u8, serde_json::Value); 9] = [
        (
            0,
            json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
        ),
        (
            0,
            json!({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "parts"}]}], "max_tokens": 3, "stream": true, "stream_options": {"include_usage": true}, "logprobs": true, "top_logprobs": 2, "n": 2, "stop": ["\n"]}),
        ),
        (
            0,
            json!({"messages": [{"role": "user", "content": "json"}], "max_tokens": 6, "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}}),
        ),
        (
            0,
            json!({"messages": [{"role": "user", "content": "call"}], "max_tokens": 6, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}], "tool_choice": "required", "temperature": 0.7, "top_p": 0.9, "seed": 3}),
        ),
        (
            1,
            json!({"model": "tiny", "prompt": "Once", "max_tokens": 4, "logprobs": 2, "presence_penalty": 0.5}),
        ),
        (
            1,
            json!({"prompt": ["a", "b"], "max_tokens": 2, "stream": true, "temperature": 0, "echo": true}),
        ),
        (
            2,
            json!({"content": "hello <s>", "add_special": true, "with_pieces": true}),
        ),
        (2, json!({"messages": [{"role": "user", "content": "hi"}]})),
        (3, json!({"tokens": [72, 105, 256]})),
    ];
    for (i, (route, body)) in bodies.iter().enumerate() {
        let mut b = vec![*route];
        b.extend_from_slice(body.to_string().as_bytes());
        put(Target::OpenaiRequest, &format!("body-{i}"), b);
    }

    // SSE/JSON text.
    for (i, s) in [
        "plain words",
        "new\nline\r\nand \"quotes\" \\ back\\slash",
        "\u{0}\u{1f}\u{7f} controls, \u{2028}\u{2029} separators, data: [DONE]\n\ndata: x",
        "ünïcödé \u{1f600} 日本語",
    ]
    .iter()
    .enumerate()
    {
        put(Target::SseJson, &format!("text-{i}"), s.as_bytes().to_vec());
    }

    let mut report = Vec::new();
    for t in Target::ALL {
        let dir = out.join(t.name());
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let (mut n, mut bytes) = (0, 0u64);
        for (_, name, b) in out_files.iter().filter(|(tt, _, _)| *tt == t) {
            std::fs::write(dir.join(name), b).map_err(|e| format!("{name}: {e}"))?;
            n += 1;
            bytes += b.len() as u64;
        }
        report.push((t, n, bytes));
    }
    Ok(report)
}

/// The tiny tokenizer's metadata turned SentencePiece-style (`llama` model, scores, byte
/// tokens typed as such), for the GGUF vocabulary builder's other branch.
fn spm_meta(bpe: &[(String, GgufValue)]) -> Vec<(String, GgufValue)> {
    let mut out = Vec::new();
    for (k, v) in bpe {
        match k.as_str() {
            "tokenizer.ggml.model" => out.push((k.clone(), GgufValue::from("llama"))),
            "tokenizer.ggml.merges" | "tokenizer.ggml.pre" => {}
            _ => out.push((k.clone(), v.clone())),
        }
    }
    let n = bpe
        .iter()
        .find(|(k, _)| k == "tokenizer.ggml.tokens")
        .and_then(|(_, v)| match v {
            GgufValue::Array(a) => Some(a.len()),
            _ => None,
        })
        .unwrap_or(0);
    let scores = (0..n).map(|i| GgufValue::F32(-(i as f32))).collect();
    let scores = GgufArray::new(GgufValueType::F32, scores).expect("f32 scores");
    out.push(("tokenizer.ggml.scores".into(), GgufValue::Array(scores)));
    out
}
