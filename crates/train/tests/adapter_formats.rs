//! Adapters in every format and fused into their base:
//! - fuse: the fused F32 model's logits equal base + adapter (HF and GGUF Llama bases, the
//!   latter with llama.cpp's permuted q/k rows); fused + Q8_0 within the quantizer's Q8_0 bound;
//! - PEFT -> llama.cpp GGUF LoRA -> PEFT and PEFT -> mlx-lm -> PEFT are bit-exact, the GGUF holds
//!   llama.cpp's names, dims, metadata and permuted q/k B rows, and `load_adapter` reads all three
//!   formats to the same logits;
//! - hostile GGUF / mlx adapters are refused by name, nothing left loaded;
//! - with `HF2Q_TEST_MLX_PY` (mlx-lm) and `HF2Q_TEST_SMOLLM2_GGUF`: mlx-lm loads our mlx adapter
//!   on SmolLM2 and its logits match ours; with `HF2Q_TEST_LLAMA_CLI` (llama.cpp's `llama-cli`,
//!   or `llama-completion` where its `llama-cli` is chat-only) and `HF2Q_TEST_BIN`: llama.cpp's
//!   greedy text with `--lora` equals `hf2q run --adapter` (32 tokens, 5 prompts). Each prints
//!   "skipped" without its inputs.

use std::path::{Path, PathBuf};

use hf2q_models::adapter::factors::read_peft;
use hf2q_models::adapter::fuse::fuse_into;
use hf2q_models::adapter::{gguf_lora, mlx, read_adapter, write_dir_atomically, AdapterFactors};
use hf2q_models::convert::hf_out::HfOptions;
use hf2q_models::convert::source::SourceModel;
use hf2q_models::convert::{convert, ConvertTarget, NoProgress};
use hf2q_models::quantize::presets::{GgufRecipe, Preset};
use hf2q_models::Model;
use hf2q_tensor::io::gguf::GgufFile;
use hf2q_tensor::io::safetensors::StDtype;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}
fn tiny() -> PathBuf {
    root().join("../models/tests/fixtures/tiny/tiny-llama")
}
/// PEFT's own trained adapter on the tiny Llama (large factors: it moves the logits by 1.45).
fn trained() -> PathBuf {
    root().join("tests/fixtures/peft/tiny-llama/peft_trained")
}
/// hf2q's random adapter (A and B drawn at random: it moves the logits by 0.73).
fn random() -> PathBuf {
    root().join("tests/fixtures/peft/tiny-llama/ours_random")
}
fn ids() -> Vec<u32> {
    (0..24u32).map(|i| (i * 37 + 5) % 256).collect()
}

fn logits(m: &mut Model, ids: &[u32]) -> Vec<f32> {
    m.set_matmul_path(hf2q_cpu::MatmulPath::Reference);
    m.session(ids.len()).forward_all(ids).unwrap().into_data()
}
fn with_adapter(base: &Path, adapter: &Path) -> Vec<f32> {
    let mut m = Model::load(base).unwrap();
    m.load_adapter(adapter).unwrap();
    logits(&mut m, &ids())
}
fn plain(path: &Path) -> Vec<f32> {
    logits(&mut Model::load(path).unwrap(), &ids())
}
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The tiny Llama as an F32 GGUF (q/k rows permuted for interleaved RoPE).
fn gguf_base(dir: &Path) -> PathBuf {
    let out = dir.join("tiny-f32.gguf");
    convert(
        &SourceModel::open(&tiny()).unwrap(),
        &out,
        &ConvertTarget::Gguf(None),
        &NoProgress,
    )
    .unwrap();
    out
}

fn fused(base: &Path, adapter: &Path, out: &Path, target: &ConvertTarget) {
    let mut src = SourceModel::open(base).unwrap();
    let f = read_adapter(adapter, Some(&src.config)).unwrap();
    assert_eq!(fuse_into(&mut src, &f, adapter).unwrap(), 14);
    convert(&src, out, target, &NoProgress).unwrap();
}

#[test]
fn fused_models_equal_base_plus_adapter() {
    let h = tempfile::tempdir().unwrap();
    let gguf = gguf_base(h.path());
    let f32_hf = ConvertTarget::Hf(HfOptions {
        dtype: Some(StDtype::F32),
        ..Default::default()
    });
    // f32 throughout: the fused weight W + s·B·A is rounded once per element and the products
    // are summed in another order (x·W + s·(x·Aᵀ)·Bᵀ against x·(W + s·B·A)); over the tiny
    // model's two 64-wide blocks with |logits| < 2 that is a few ulps of the logits (measured
    // 6e-7 with the random adapter): 1e-5 leaves a tenfold margin, and is 1e5 times below the
    // adapter's own effect. PEFT's trained adapter has factors large enough that the hidden
    // states, and the reordering error with them, grow through the blocks (measured 1.8e-5):
    // it is held to convert_tiny's bound for f32 forwards that differ in summation order, 1e-4.
    for (adapter, tol) in [(random(), 1e-5), (trained(), 1e-4)] {
        let moved = max_diff(&plain(&tiny()), &with_adapter(&tiny(), &adapter));
        assert!(
            moved > 0.1,
            "the adapter hardly changes the model ({moved})"
        );
        for (name, base, target) in [
            ("hf", tiny(), f32_hf.clone()),
            ("gguf", gguf.clone(), ConvertTarget::Gguf(None)),
        ] {
            let out = h.path().join(format!(
                "fused-{name}-{}",
                adapter.file_name().unwrap().to_string_lossy()
            ));
            fused(&base, &adapter, &out, &target);
            let d = max_diff(&with_adapter(&base, &adapter), &plain(&out));
            eprintln!("fused {name} F32 ({}): max |logit difference| {d:.2e} (the adapter moves them {moved:.2e})", adapter.display());
            assert!(d < tol, "{name}: fused F32 logits differ by {d}");
        }
    }
    // Fused and quantized: the bound of the quantizer's own Q8_0 test on the tiny models
    // (convert_tiny.rs: about 1% of the weight scale per element, 0.05 on the logits).
    let q8 = h.path().join("fused-q8.gguf");
    let recipe = GgufRecipe {
        preset: Preset::Q8_0,
        pure: false,
    };
    fused(&gguf, &trained(), &q8, &ConvertTarget::Gguf(Some(recipe)));
    let d = max_diff(&with_adapter(&gguf, &trained()), &plain(&q8));
    eprintln!("fused Q8_0: max |logit difference| {d:.2e}");
    assert!(d < 0.05, "fused Q8_0 logits differ by {d}");
    // A Q8_0 base fused without --type stays Q8_0 (its own type), re-quantized after the sum.
    let base_q8 = h.path().join("base-q8.gguf");
    convert(
        &SourceModel::open(&tiny()).unwrap(),
        &base_q8,
        &ConvertTarget::Gguf(Some(recipe)),
        &NoProgress,
    )
    .unwrap();
    let keep = h.path().join("fused-keep.gguf");
    fused(&base_q8, &trained(), &keep, &ConvertTarget::Gguf(None));
    let f = GgufFile::open(&keep).unwrap();
    assert_eq!(
        f.tensor("blk.0.attn_q.weight").unwrap().ty,
        hf2q_tensor::GgmlType::Q8_0
    );
    let d = max_diff(&with_adapter(&base_q8, &trained()), &plain(&keep));
    assert!(d < 0.05, "fused onto Q8_0 differs by {d}");
}

fn tiny_config() -> hf2q_models::config::ModelConfig {
    SourceModel::open(&tiny()).unwrap().config
}

#[test]
fn peft_gguf_lora_and_mlx_round_trips_are_bit_exact() {
    let h = tempfile::tempdir().unwrap();
    let cfg = tiny_config();
    let f0 = read_peft(&trained(), Some(&cfg)).unwrap();

    // PEFT -> GGUF LoRA -> PEFT.
    let g = h.path().join("a.gguf");
    gguf_lora::write(&g, &f0, &cfg).unwrap();
    let file = GgufFile::open(&g).unwrap();
    assert_eq!(file.get_str("general.type"), Some("adapter"));
    assert_eq!(file.get_str("adapter.type"), Some("lora"));
    assert_eq!(file.get_str("general.architecture"), Some("llama"));
    assert_eq!(file.get_f32("adapter.lora.alpha"), Some(f0.config.alpha));
    let (a, b) = (
        file.tensor("blk.1.attn_q.weight.lora_a").unwrap(),
        file.tensor("blk.1.attn_q.weight.lora_b").unwrap(),
    );
    let r = f0.config.r as u64;
    assert_eq!((a.dims.clone(), b.dims.clone()), (vec![64, r], vec![r, 64]));
    // llama.cpp's converter permutes q's B rows as it permutes the base's q rows: within a head
    // of 16 rows, GGUF row 2i + j is HF row j·8 + i.
    let gb: Vec<f32> = file
        .tensor_data(b)
        .unwrap()
        .as_slice()
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let q = f0
        .modules
        .iter()
        .find(|m| m.layer == 1 && m.path == "self_attn.q_proj")
        .unwrap();
    let r = f0.config.r;
    for head in 0..4 {
        for i in 0..8 {
            for j in 0..2 {
                let (gr, hr) = (head * 16 + 2 * i + j, head * 16 + j * 8 + i);
                assert_eq!(gb[gr * r..(gr + 1) * r], q.b[hr * r..(hr + 1) * r]);
            }
        }
    }
    let f1 = read_adapter(&g, Some(&cfg)).unwrap();
    assert_same(&f0, &f1, "gguf-lora");
    let back = h.path().join("back-gguf");
    write_dir_atomically(&back, |d| {
        hf2q_models::adapter::factors::write_peft_files(d, &f1, "tiny-llama")
    })
    .unwrap();
    assert_same(
        &f0,
        &read_peft(&back, Some(&cfg)).unwrap(),
        "gguf-lora -> peft",
    );

    // PEFT -> mlx-lm -> PEFT.
    let m = h.path().join("mlx");
    mlx::write(&m, &f0, &cfg).unwrap();
    let st =
        hf2q_tensor::io::safetensors::SafeTensors::open(&m.join("adapters.safetensors")).unwrap();
    assert_eq!(
        st.tensor("model.layers.0.mlp.down_proj.lora_a")
            .unwrap()
            .shape,
        vec![128, r]
    );
    assert_eq!(
        st.tensor("model.layers.0.mlp.down_proj.lora_b")
            .unwrap()
            .shape,
        vec![r, 64]
    );
    let f2 = read_adapter(&m, Some(&cfg)).unwrap();
    assert_same(&f0, &f2, "mlx");
    let back = h.path().join("back-mlx");
    write_dir_atomically(&back, |d| {
        hf2q_models::adapter::factors::write_peft_files(d, &f2, "tiny-llama")
    })
    .unwrap();
    assert_same(&f0, &read_peft(&back, Some(&cfg)).unwrap(), "mlx -> peft");

    // `--adapter` reads all three, on an HF base and on a GGUF (permuted) base, to the same logits.
    let gguf = gguf_base(h.path());
    for base in [tiny(), gguf] {
        let want = with_adapter(&base, &trained());
        for a in [&g, &m] {
            assert_eq!(
                with_adapter(&base, a),
                want,
                "{} on {}",
                a.display(),
                base.display()
            );
        }
    }
}

/// Same settings that change the function, same factors bit for bit.
fn assert_same(a: &AdapterFactors, b: &AdapterFactors, what: &str) {
    assert_eq!(a.modules.len(), b.modules.len(), "{what}");
    for (x, y) in a.modules.iter().zip(&b.modules) {
        assert_eq!(
            (x.layer, &x.path, x.r, x.rows, x.cols),
            (y.layer, &y.path, y.r, y.rows, y.cols),
            "{what}"
        );
        assert_eq!(
            a.scale_of(x).to_bits(),
            b.scale_of(y).to_bits(),
            "{what}: scale of {}",
            x.name()
        );
        assert!(
            x.a.iter()
                .zip(&y.a)
                .all(|(p, q)| p.to_bits() == q.to_bits()),
            "{what}: A of {}",
            x.name()
        );
        assert!(
            x.b.iter()
                .zip(&y.b)
                .all(|(p, q)| p.to_bits() == q.to_bits()),
            "{what}: B of {}",
            x.name()
        );
    }
    assert_eq!(
        (
            a.config.r,
            a.config.alpha,
            &a.config.targets,
            &a.config.layers
        ),
        (
            b.config.r,
            b.config.alpha,
            &b.config.targets,
            &b.config.layers
        ),
        "{what}: config"
    );
}

/// (name, shape, f32 values) of every tensor of a safetensors file.
type NamedTensors = Vec<(String, Vec<usize>, Vec<f32>)>;

fn refused(path: &Path, msg: &str) {
    let mut m = Model::load(&tiny()).unwrap();
    let e = m
        .load_adapter(path)
        .expect_err("loaded a broken adapter")
        .to_string();
    assert!(e.contains(msg), "expected '{msg}' in: {e}");
    assert!(
        m.adapters().is_empty(),
        "a refused adapter was left half-loaded"
    );
}

/// Rewrites a GGUF LoRA with `edit` applied to its (name, dims, f32 values) list and metadata.
fn edit_gguf(
    from: &Path,
    to: &Path,
    edit: impl FnOnce(
        &mut Vec<(String, hf2q_tensor::io::gguf::GgufValue)>,
        &mut Vec<(String, Vec<u64>, Vec<f32>)>,
    ),
) {
    let f = GgufFile::open(from).unwrap();
    let mut meta: Vec<_> = f
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let mut t: Vec<(String, Vec<u64>, Vec<f32>)> = f
        .tensors
        .iter()
        .map(|i| {
            let v = f
                .tensor_data(i)
                .unwrap()
                .as_slice()
                .chunks(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            (i.name.clone(), i.dims.clone(), v)
        })
        .collect();
    edit(&mut meta, &mut t);
    let mut w = hf2q_tensor::io::gguf::GgufWriter::new();
    for (k, v) in meta {
        if k != "general.alignment" {
            w.add_metadata(k, v).unwrap();
        }
    }
    for (n, d, v) in t {
        w.add_tensor(
            n,
            d,
            hf2q_tensor::GgmlType::F32,
            hf2q_tensor::Bytes::from_vec(v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        )
        .unwrap();
    }
    w.write_file(to).unwrap();
}

#[test]
fn hostile_gguf_and_mlx_adapters_are_refused_by_name() {
    use hf2q_tensor::io::gguf::GgufValue;
    let h = tempfile::tempdir().unwrap();
    let d = |n: &str| h.path().join(n);
    let cfg = tiny_config();
    let f0 = read_peft(&trained(), Some(&cfg)).unwrap();
    let good = d("good.gguf");
    gguf_lora::write(&good, &f0, &cfg).unwrap();
    let set = |meta: &mut Vec<(String, GgufValue)>, k: &str, v: GgufValue| {
        meta.iter_mut().find(|(key, _)| key == k).unwrap().1 = v;
    };

    edit_gguf(&good, &d("type.gguf"), |m, _| {
        set(m, "general.type", GgufValue::String("model".into()))
    });
    refused(&d("type.gguf"), "general.type is 'model', not 'adapter'");
    edit_gguf(&good, &d("arch.gguf"), |m, _| {
        set(m, "general.architecture", GgufValue::String("qwen2".into()))
    });
    refused(
        &d("arch.gguf"),
        "an adapter for 'qwen2', but the base is 'llama'",
    );
    edit_gguf(&good, &d("missing.gguf"), |_, t| {
        t.retain(|(n, _, _)| n != "blk.0.ffn_up.weight.lora_b");
    });
    refused(
        &d("missing.gguf"),
        "missing tensor 'blk.0.ffn_up.weight.lora_b'",
    );
    edit_gguf(&good, &d("shape.gguf"), |_, t| {
        let e = t
            .iter_mut()
            .find(|(n, _, _)| n == "blk.0.attn_v.weight.lora_a")
            .unwrap();
        e.1 = vec![32, 8];
    });
    refused(
        &d("shape.gguf"),
        "'blk.0.attn_v.weight': lora_a dims [32, 8] and lora_b dims [4, 32]",
    );
    edit_gguf(&good, &d("nan.gguf"), |_, t| t[3].2[1] = f32::NAN);
    refused(&d("nan.gguf"), "non-finite value");
    edit_gguf(&good, &d("extra.gguf"), |_, t| {
        let mut e = t[0].clone();
        e.0 = "blk.0.attn_q.weight.lora_c".into();
        t.push(e);
    });
    refused(&d("extra.gguf"), "unexpected suffix");
    edit_gguf(&good, &d("layer.gguf"), |_, t| {
        for i in 0..2 {
            let mut e = t[i].clone();
            e.0 = e.0.replace("blk.0.", "blk.5.");
            t.push(e);
        }
    });
    refused(
        &d("layer.gguf"),
        "does not belong to a LoRA target of this model",
    );

    // mlx-lm folders.
    let good = d("mlx");
    mlx::write(&good, &f0, &cfg).unwrap();
    let copy = |name: &str,
                cfg_edit: &dyn Fn(&mut serde_json::Value),
                st_edit: &dyn Fn(&mut NamedTensors)|
     -> PathBuf {
        let out = d(name);
        std::fs::create_dir_all(&out).unwrap();
        let mut c: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(good.join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        cfg_edit(&mut c);
        std::fs::write(out.join("adapter_config.json"), c.to_string()).unwrap();
        let st =
            hf2q_tensor::io::safetensors::SafeTensors::open(&good.join("adapters.safetensors"))
                .unwrap();
        let mut t: Vec<_> = st
            .tensors
            .iter()
            .map(|i| (i.name.clone(), i.shape.clone(), st.to_f32(i).unwrap()))
            .collect();
        st_edit(&mut t);
        let bytes: Vec<Vec<u8>> = t
            .iter()
            .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
            .collect();
        let refs: Vec<_> = t
            .iter()
            .zip(&bytes)
            .map(|((n, s, _), b)| (n.clone(), StDtype::F32, s.clone(), b.as_slice()))
            .collect();
        hf2q_tensor::io::safetensors::write_safetensors(
            &out.join("adapters.safetensors"),
            &refs,
            &Default::default(),
        )
        .unwrap();
        out
    };
    let none = |_: &mut serde_json::Value| {};
    let keep = |_: &mut NamedTensors| {};
    refused(
        &copy("rank", &|c| c["lora_parameters"]["rank"] = 8.into(), &keep),
        "expected [in, 8] and [8, out] (rank 8 from adapter_config.json)",
    );
    refused(
        &copy("dora", &|c| c["fine_tune_type"] = "dora".into(), &keep),
        "fine_tune_type 'dora'",
    );
    refused(
        &copy(
            "noscale",
            &|c| {
                c["lora_parameters"]
                    .as_object_mut()
                    .unwrap()
                    .remove("scale");
            },
            &keep,
        ),
        "missing or invalid 'scale'",
    );
    refused(
        &copy("gone", &none, &|t| {
            t.retain(|(n, _, _)| n != "model.layers.1.self_attn.o_proj.lora_a")
        }),
        "missing tensor 'model.layers.1.self_attn.o_proj.lora_a'",
    );
    refused(
        &copy("nan", &none, &|t| t[2].2[0] = f32::INFINITY),
        "non-finite value",
    );
    refused(
        &copy("misshapen", &none, &|t| {
            let e = t
                .iter_mut()
                .find(|(n, _, _)| n == "model.layers.0.self_attn.q_proj.lora_a")
                .unwrap();
            e.1 = vec![32, 4];
            e.2.truncate(128);
        }),
        "model.layers.0.self_attn.q_proj': lora_A [4, 32]",
    );
}

/// A SmolLM2 F32 folder and a random adapter on it (B uniform in ±`b_range`/2), as a PEFT folder.
fn smollm2_with_adapter(h: &Path, gguf: &str, b_range: f32) -> (PathBuf, PathBuf) {
    let folder = h.join("smollm2-f32");
    let src = SourceModel::open(Path::new(gguf)).unwrap();
    let f32_hf = ConvertTarget::Hf(HfOptions {
        dtype: Some(StDtype::F32),
        ..Default::default()
    });
    convert(&src, &folder, &f32_hf, &NoProgress).unwrap();
    let mut m = Model::load(&folder).unwrap();
    let lc = hf2q_models::adapter::LoraConfig {
        r: 8,
        alpha: 16.0,
        ..Default::default()
    };
    m.attach_lora(&lc, 7).unwrap();
    let mut seed = 1u64;
    for (_, l) in m.adapters_mut() {
        let (rows, r) = l.b.dims2();
        let v: Vec<f32> = (0..rows * r)
            .map(|_| {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * b_range
            })
            .collect();
        l.b = hf2q_tensor::Tensor::new(&[rows, r], v).unwrap();
    }
    let peft = h.join("peft");
    m.save_adapter(&peft, &lc, "smollm2").unwrap();
    (folder, peft)
}

#[test]
fn mlx_lm_loads_our_mlx_adapter_on_smollm2() {
    let (Ok(py), Ok(gguf)) = (
        std::env::var("HF2Q_TEST_MLX_PY"),
        std::env::var("HF2Q_TEST_SMOLLM2_GGUF"),
    ) else {
        eprintln!("skipped: HF2Q_TEST_MLX_PY or HF2Q_TEST_SMOLLM2_GGUF is not set");
        return;
    };
    let h = tempfile::tempdir().unwrap();
    let (folder, peft) = smollm2_with_adapter(h.path(), &gguf, 0.02);
    let cfg = SourceModel::open(&folder).unwrap().config;
    let mlx_dir = h.path().join("mlx-adapter");
    mlx::write(&mlx_dir, &read_peft(&peft, Some(&cfg)).unwrap(), &cfg).unwrap();
    let ids: Vec<u32> = vec![
        1, 504, 3458, 282, 4399, 314, 253, 1345, 30, 378, 2114, 282, 6191, 47,
    ];
    let script = root().join("../../scripts/fixtures/mlx_lm_logits.py");
    let list: Vec<String> = ids.iter().map(u32::to_string).collect();
    let o = std::process::Command::new(&py)
        .arg(script)
        .arg(&folder)
        .arg(list.join(","))
        .arg(&mlx_dir)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "mlx-lm: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let mut m = Model::load(&folder).unwrap();
    m.load_adapter(&mlx_dir).unwrap();
    let ours = {
        m.set_matmul_path(hf2q_cpu::MatmulPath::Reference);
        m.session(ids.len()).forward_all(&ids).unwrap()
    };
    let (mut worst, mut moved) = (0f32, 0f32);
    let mut m0 = Model::load(&folder).unwrap();
    m0.set_matmul_path(hf2q_cpu::MatmulPath::Reference);
    let unadapted = m0.session(ids.len()).forward_all(&ids).unwrap();
    for (p, row) in v["rows"].as_array().unwrap().iter().enumerate() {
        let (o, u) = (ours.row(p), unadapted.row(p));
        for (id, lg) in row["ids"]
            .as_array()
            .unwrap()
            .iter()
            .zip(row["logits"].as_array().unwrap())
        {
            let (i, x) = (id.as_u64().unwrap() as usize, lg.as_f64().unwrap() as f32);
            worst = worst.max((o[i] - x).abs());
            moved = moved.max((u[i] - x).abs());
        }
    }
    eprintln!("mlx-lm vs hf2q with the mlx adapter: max |logit diff| {worst:.2e}; the adapter moves them {moved:.2e}");
    // As convert_mlx_lm.rs for SmolLM2: 30 layers, logits ~10-30, summation order, 1e-2.
    assert!(worst < 1e-2, "mlx-lm's logits differ from ours by {worst}");
    assert!(
        moved > 10.0 * worst,
        "the adapter's effect ({moved}) is not above the tolerance"
    );
}

#[test]
fn llama_cpp_greedy_output_with_our_gguf_lora_equals_hf2q() {
    let (Ok(cli), Ok(gguf), Ok(bin)) = (
        std::env::var("HF2Q_TEST_LLAMA_CLI"),
        std::env::var("HF2Q_TEST_SMOLLM2_GGUF"),
        std::env::var("HF2Q_TEST_BIN"),
    ) else {
        eprintln!(
            "skipped: HF2Q_TEST_LLAMA_CLI, HF2Q_TEST_SMOLLM2_GGUF or HF2Q_TEST_BIN is not set"
        );
        return;
    };
    let h = tempfile::tempdir().unwrap();
    // B in ±0.04: large enough to change most greedy continuations.
    let (folder, peft) = smollm2_with_adapter(h.path(), &gguf, 0.08);
    // Both run an F32 GGUF of SmolLM2 (each tensor dequantized once from the pinned Q4_1): on
    // quantized weights llama.cpp rounds activations to 8 bits and hf2q's default path does
    // not, which flips near-tied tokens (BENCHMARKS.md); in f32 only summation order differs.
    let gguf = h.path().join("smollm2-f32.gguf");
    let src = SourceModel::open(&folder).unwrap();
    convert(&src, &gguf, &ConvertTarget::Gguf(None), &NoProgress).unwrap();
    let cfg = src.config;
    let gguf = gguf.to_str().unwrap().to_string();
    let lora = h.path().join("lora.gguf");
    gguf_lora::write(&lora, &read_peft(&peft, Some(&cfg)).unwrap(), &cfg).unwrap();
    let prompts = [
        "The capital of France is",
        "Once upon a time, there was a",
        "The three primary colors are",
        "def fibonacci(n):",
        "Water boils at a temperature of",
    ];
    let (mut same, mut moved) = (0, 0);
    for p in prompts {
        let ours = std::process::Command::new(&bin)
            .args([
                "run",
                &gguf,
                "--raw",
                "--temp",
                "0",
                "-n",
                "32",
                "--adapter",
            ])
            .arg(&lora)
            .args(["-p", p])
            .output()
            .unwrap();
        assert!(
            ours.status.success(),
            "hf2q run: {}",
            String::from_utf8_lossy(&ours.stderr)
        );
        let theirs = std::process::Command::new(&cli)
            .args(["-m", &gguf, "--lora"])
            .arg(&lora)
            .args([
                "-n",
                "32",
                "--temp",
                "0",
                "-no-cnv",
                "--no-display-prompt",
                "--no-warmup",
                "-p",
                p,
            ])
            .output()
            .unwrap();
        assert!(
            theirs.status.success(),
            "llama-cli: {}",
            String::from_utf8_lossy(&theirs.stderr)
        );
        let (a, b) = (
            String::from_utf8_lossy(&ours.stdout).trim().to_string(),
            // llama.cpp marks an end-of-generation token in its output; hf2q just stops.
            String::from_utf8_lossy(&theirs.stdout)
                .trim()
                .trim_end_matches("[end of text]")
                .trim()
                .to_string(),
        );
        let plain = std::process::Command::new(&bin)
            .args(["run", &gguf, "--raw", "--temp", "0", "-n", "32", "-p", p])
            .output()
            .unwrap();
        let plain = String::from_utf8_lossy(&plain.stdout).trim().to_string();
        eprintln!("{p:?}\n  hf2q:      {a:?}\n  llama.cpp: {b:?}\n  no adapter: {plain:?}");
        same += usize::from(a == b);
        moved += usize::from(plain != a);
    }
    // A LoRA that llama.cpp ignored would still match where the adapter changes nothing: it
    // changes 4 of the 5 continuations.
    assert!(
        moved >= 3,
        "the adapter changes no greedy text: the comparison proves nothing"
    );
    assert_eq!(
        same,
        prompts.len(),
        "llama.cpp's greedy text with our LoRA differs from hf2q's"
    );
}
