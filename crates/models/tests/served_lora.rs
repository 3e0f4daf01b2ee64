//! Served adapters (`AdapterSet` + `Model::step_batch_served`) on the tiny random checkpoints of
//! every family: a batch mixing two adapters and the base, in interleaved order, prefill then
//! decode, gives each sequence the logits of that sequence run alone on a model with its
//! adapter attached (`Model::load_adapter`, the `run --adapter` path), which is the reference.
//! On a machine with a CUDA device, four adapters and the base in one batch on the GPU, through
//! the per-sequence and the paged steps, against their solo GPU runs (otherwise "skipped").

mod common;

use std::path::{Path, PathBuf};

use hf2q_cpu::MatmulPath;
use hf2q_models::adapter::LoraConfig;
use hf2q_models::adapter_set::AdapterSet;
use hf2q_models::kv_cache::KvType;
use hf2q_models::{BatchItem, Model, PagedItem, Picked, RowPick};
use hf2q_tensor::paged::BlockTable;
use hf2q_tensor::Tensor;

fn tiny(name: &str) -> Model {
    let p: PathBuf = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tiny")
        .join(name);
    let mut m = Model::load(&p).unwrap();
    m.set_matmul_path(MatmulPath::Reference);
    m.set_kv_type(KvType::F32);
    m
}

/// Saves an adapter of `cfg` with B drawn from `seed` (PEFT's B = 0 would change nothing).
fn make_adapter(name: &str, cfg: &LoraConfig, seed: u64, dir: &Path) {
    let mut m = tiny(name);
    m.attach_lora(cfg, seed).unwrap();
    let mut s = seed | 1;
    for (_, l) in m.adapters_mut() {
        let shape = l.b.shape().to_vec();
        let v = (0..l.b.len())
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * 0.3
            })
            .collect();
        l.b = Tensor::new(&shape, v).unwrap();
    }
    m.save_adapter(dir, cfg, name).unwrap();
}

fn solo(m: &Model, prompt: &[u32], next: u32) -> (Vec<f32>, Vec<f32>) {
    let mut s = m.session(64);
    let a = s.prefill(prompt).unwrap();
    let b = s.decode(next).unwrap();
    (a, b)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Sequences of a test batch: `(prompt, token fed next, adapter slot)`.
type Seqs = [(Vec<u32>, u32, Option<usize>)];

/// Every sequence in one `step_batch_served` prefill, then one decode step of its next token:
/// each sequence's logits of both steps.
fn batched_served(
    base: &Model,
    set: &AdapterSet,
    seqs: &Seqs,
    slots: &[Option<usize>],
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let mut caches: Vec<_> = seqs.iter().map(|_| base.new_cache(64)).collect();
    let mut items: Vec<BatchItem> = caches
        .iter_mut()
        .zip(seqs)
        .map(|(c, s)| BatchItem {
            cache: c,
            pos0: 0,
            tokens: &s.0,
        })
        .collect();
    let first = base
        .step_batch_served(&mut items, Some((set, slots)))
        .unwrap();
    let nexts: Vec<[u32; 1]> = seqs.iter().map(|s| [s.1]).collect();
    let mut items: Vec<BatchItem> = caches
        .iter_mut()
        .zip(seqs)
        .zip(&nexts)
        .map(|((c, s), n)| BatchItem {
            cache: c,
            pos0: s.0.len(),
            tokens: n,
        })
        .collect();
    let second = base
        .step_batch_served(&mut items, Some((set, slots)))
        .unwrap();
    (first, second)
}

#[test]
fn a_mixed_batch_equals_each_sequence_alone_with_its_adapter() {
    let tmp = std::env::temp_dir().join(format!("hf2q-served-lora-{}", std::process::id()));
    for name in ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3"] {
        let (da, db) = (tmp.join(format!("{name}-a")), tmp.join(format!("{name}-b")));
        let all = LoraConfig {
            r: 4,
            alpha: 8.0,
            ..LoraConfig::default()
        };
        let some = LoraConfig {
            r: 2,
            alpha: 3.0,
            rslora: true,
            targets: vec!["q_proj".into(), "v_proj".into(), "down_proj".into()],
            ..LoraConfig::default()
        };
        make_adapter(name, &all, 11, &da);
        make_adapter(name, &some, 23, &db);

        let base = tiny(name);
        let mut set = AdapterSet::new();
        let sa = set.insert(&base, base.read_adapter(&da).unwrap()).unwrap();
        let sb = set.insert(&base, base.read_adapter(&db).unwrap()).unwrap();
        let mut with_a = tiny(name);
        with_a.load_adapter(&da).unwrap();
        let mut with_b = tiny(name);
        with_b.load_adapter(&db).unwrap();

        // (prompt, token fed next, slot): adapters interleaved, so each gathers two runs.
        let seqs: Vec<(Vec<u32>, u32, Option<usize>)> = vec![
            ((0..5).map(|i| 40 + i * 3).collect(), 90, Some(sa)),
            ((0..3).map(|i| 70 + i).collect(), 91, None),
            ((0..6).map(|i| 50 + i * 5).collect(), 92, Some(sb)),
            ((0..2).map(|i| 60 + i).collect(), 93, Some(sa)),
            ((0..4).map(|i| 80 + i * 2).collect(), 94, Some(sb)),
        ];
        let slots: Vec<Option<usize>> = seqs.iter().map(|s| s.2).collect();
        let (first, second) = batched_served(&base, &set, &seqs, &slots);

        for (i, (prompt, next, slot)) in seqs.iter().enumerate() {
            let m = match *slot {
                None => &base,
                Some(s) if s == sa => &with_a,
                _ => &with_b,
            };
            let (want1, want2) = solo(m, prompt, *next);
            let (plain1, _) = solo(&base, prompt, *next);
            // Why 1e-4: f32 sums of the same terms, grouped by a batch of another size.
            let (d1, d2) = (max_diff(&first[i], &want1), max_diff(&second[i], &want2));
            assert!(
                d1 < 1e-4 && d2 < 1e-4,
                "{name} seq {i}: prefill {d1}, decode {d2}"
            );
            // The adapters have a visible effect (so the comparison can fail).
            if slot.is_some() {
                let effect = max_diff(&want1, &plain1);
                assert!(
                    effect > 1e-2,
                    "{name} seq {i}: the adapter changes logits by {effect}"
                );
            }
        }
        // A slot that holds nothing is refused, an emptied one too.
        assert!(set.remove(sb));
        let mut c = base.new_cache(8);
        let mut one = [BatchItem {
            cache: &mut c,
            pos0: 0,
            tokens: &[1, 2],
        }];
        let err = base
            .step_batch_served(&mut one, Some((&set, &[Some(sb)])))
            .unwrap_err();
        assert!(err.to_string().contains("holds no adapter"), "{err}");
        assert_eq!(set.len(), 1);
    }
    let _ = std::fs::remove_dir_all(&tmp);
}

/// Four adapters and the base in one batch with the model on the GPU (every served term a
/// device product), through the per-sequence batched step (`step_batch_served`) and the paged
/// one (`step_paged_served`, what `serve --device cuda --kv-paged` runs), prefill then decode,
/// against each sequence alone on the GPU with its adapter attached (`run --adapter`'s path on
/// the GPU, held to the CPU by the training crate's GPU tests). Without a GPU: "skipped".
#[test]
fn a_mixed_batch_on_the_gpu_equals_each_sequence_alone_with_its_adapter() {
    let Some(gpu) = common::gpu() else { return };
    let tmp = std::env::temp_dir().join(format!("hf2q-served-lora-gpu-{}", std::process::id()));
    // The checkpoint as a GPU run loads it (the device's f16 KV cache, its products); with an
    // adapter attached first when `adapter` names one.
    let on_gpu = |name: &str, adapter: Option<&Path>| {
        let mut m = Model::load(&common::tiny(name)).unwrap();
        if let Some(d) = adapter {
            m.load_adapter(d).unwrap();
        }
        m.set_cuda(Some(gpu.clone())).unwrap();
        m
    };
    for name in ["tiny-llama", "tiny-qwen3"] {
        let configs = [
            LoraConfig {
                r: 4,
                alpha: 8.0,
                ..LoraConfig::default()
            },
            LoraConfig {
                r: 2,
                alpha: 3.0,
                rslora: true,
                targets: vec!["q_proj".into(), "v_proj".into(), "down_proj".into()],
                ..LoraConfig::default()
            },
            LoraConfig {
                r: 8,
                alpha: 16.0,
                targets: vec!["o_proj".into(), "gate_proj".into(), "up_proj".into()],
                ..LoraConfig::default()
            },
            LoraConfig {
                r: 1,
                alpha: 2.0,
                targets: vec!["k_proj".into()],
                ..LoraConfig::default()
            },
        ];
        let dirs: Vec<PathBuf> = (0..configs.len())
            .map(|i| tmp.join(format!("{name}-{i}")))
            .collect();
        for (i, (cfg, dir)) in configs.iter().zip(&dirs).enumerate() {
            make_adapter(name, cfg, 11 + 12 * i as u64, dir);
        }
        let base = on_gpu(name, None);
        let mut set = AdapterSet::new();
        let slots_of: Vec<usize> = dirs
            .iter()
            .map(|d| set.insert(&base, base.read_adapter(d).unwrap()).unwrap())
            .collect();
        let attached: Vec<Model> = dirs.iter().map(|d| on_gpu(name, Some(d))).collect();
        // Ten sequences: each adapter twice and the base twice, interleaved.
        let seqs: Vec<(Vec<u32>, u32, Option<usize>)> = (0..10u32)
            .map(|i| {
                let prompt = (0..2 + i % 5).map(|j| 40 + i * 7 + j * 3).collect();
                let slot = (i % 5 < 4).then(|| slots_of[(i % 5) as usize]);
                (prompt, 90 + i, slot)
            })
            .collect();
        let slots: Vec<Option<usize>> = seqs.iter().map(|s| s.2).collect();
        let want: Vec<(Vec<f32>, Vec<f32>)> = seqs
            .iter()
            .map(|(prompt, next, slot)| {
                let m = match slot {
                    None => &base,
                    Some(s) => &attached[slots_of.iter().position(|x| x == s).unwrap()],
                };
                solo(m, prompt, *next)
            })
            .collect();

        // The per-sequence batched step.
        let (first, second) = batched_served(&base, &set, &seqs, &slots);

        // The paged step, logits of every item's last row.
        let nexts: Vec<[u32; 1]> = seqs.iter().map(|s| [s.1]).collect();
        let blocks = seqs.len() * 2;
        let mut cache = base.paged_cache(blocks, 16, 64).unwrap();
        let mut tables = vec![BlockTable::new(); seqs.len()];
        let picks = vec![RowPick::Logits; seqs.len()];
        let logits = |p: Vec<Picked>| -> Vec<Vec<f32>> {
            p.into_iter()
                .map(|x| match x {
                    Picked::Logits(l) => l,
                    other => panic!("asked for logits, got {other:?}"),
                })
                .collect()
        };
        let mut items: Vec<PagedItem> = tables
            .iter_mut()
            .zip(&seqs)
            .map(|(t, s)| PagedItem {
                table: t,
                pos0: 0,
                tokens: &s.0,
            })
            .collect();
        let paged_first = logits(
            base.step_paged_served(&mut cache, &mut items, &picks, Some((&set, &slots)))
                .unwrap(),
        );
        let mut items: Vec<PagedItem> = tables
            .iter_mut()
            .zip(&seqs)
            .zip(&nexts)
            .map(|((t, s), n)| PagedItem {
                table: t,
                pos0: s.0.len(),
                tokens: n,
            })
            .collect();
        let paged_second = logits(
            base.step_paged_served(&mut cache, &mut items, &picks, Some((&set, &slots)))
                .unwrap(),
        );

        let mut worst = 0f32;
        for (i, (w1, w2)) in want.iter().enumerate() {
            // Why 2e-3: the device's batched products and the paged attention sum the same
            // terms in other orders than the solo run (f16 KV in both; the paged step's bound
            // in paged_step.rs), on logits of magnitude < 20; a wrong adapter or a term on the
            // wrong rows moves them by > 1e-2 (the CPU test checks the adapters' effect).
            for (what, got, want) in [
                ("batched prefill", &first[i], w1),
                ("batched decode", &second[i], w2),
                ("paged prefill", &paged_first[i], w1),
                ("paged decode", &paged_second[i], w2),
            ] {
                let d = max_diff(got, want);
                assert!(d < 2e-3, "{name} seq {i} ({what}): max |diff| {d}");
                worst = worst.max(d);
            }
        }
        println!("{name}: 4 adapters + base on the GPU, max |batch - solo| {worst:.2e}");
        for t in &mut tables {
            t.clear(cache.pool_mut());
        }
    }
    let _ = std::fs::remove_dir_all(&tmp);
}

/// Where the served adapters' time goes on the CPU (a benchmark, not a check): SmolLM2 from
/// `HF2Q_TEST_SMOLLM2_GGUF` on `serve`'s default (fast) matmul path, 16 sequences of 48 prompt
/// tokens, then decode steps of 16 rows through `step_batch_served`, the base alone against
/// four adapters (PEFT's r 16 / alpha 32 on every linear, 4 sequences each, rows grouped by
/// adapter as the server's planner orders them). The two batches alternate step by step so
/// they share the machine's load.
/// `cargo test --release --workspace --test served_lora -- --ignored --nocapture speed`.
#[test]
#[ignore]
fn speed_of_four_adapters_at_sixteen_rows_on_the_cpu() {
    let Ok(gguf) = std::env::var("HF2Q_TEST_SMOLLM2_GGUF") else {
        eprintln!("skipped: HF2Q_TEST_SMOLLM2_GGUF is not set");
        return;
    };
    let steps = common::bench_knobs().steps.unwrap_or(24);
    let gguf = PathBuf::from(gguf);
    let tmp = std::env::temp_dir().join(format!("hf2q-served-lora-speed-{}", std::process::id()));
    let cfg = LoraConfig {
        r: 16,
        alpha: 32.0,
        ..LoraConfig::default()
    };
    let mut base = Model::load(&gguf).unwrap();
    // `serve`'s default matmul path.
    base.set_matmul_path(MatmulPath::Fast);
    let mut set = AdapterSet::new();
    let mut slots = Vec::new();
    for i in 0..4u64 {
        let dir = tmp.join(format!("a{i}"));
        let mut m = Model::load(&gguf).unwrap();
        m.attach_lora(&cfg, 7 + i).unwrap();
        for (_, l) in m.adapters_mut() {
            let shape = l.b.shape().to_vec();
            let v = (0..l.b.len())
                .map(|j| ((j * 37 + i as usize) % 19) as f32 * 1e-3 - 9e-3)
                .collect();
            l.b = Tensor::new(&shape, v).unwrap();
        }
        m.save_adapter(&dir, &cfg, "smollm2").unwrap();
        slots.push(set.insert(&base, base.read_adapter(&dir).unwrap()).unwrap());
    }
    let n = 16;
    let vocab = base.config.vocab_size as u32;
    let prompts: Vec<Vec<u32>> = (0..n as u32)
        .map(|i| (0..48).map(|j| (i * 131 + j * 17 + 5) % vocab).collect())
        .collect();
    let with: Vec<Option<usize>> = (0..n).map(|i| Some(slots[i / 4])).collect();
    let without = vec![None; n];
    // (caches, slots, seconds of decode steps)
    let mut runs = [(Vec::new(), without, 0f64), (Vec::new(), with, 0f64)];
    for (caches, sl, _) in &mut runs {
        *caches = (0..n).map(|_| base.new_cache(48 + steps + 1)).collect();
        let mut items: Vec<BatchItem> = caches
            .iter_mut()
            .zip(&prompts)
            .map(|(c, p)| BatchItem {
                cache: c,
                pos0: 0,
                tokens: p,
            })
            .collect();
        base.step_batch_served(&mut items, Some((&set, sl)))
            .unwrap();
    }
    for s in 0..steps {
        for (caches, sl, secs) in &mut runs {
            let toks: Vec<[u32; 1]> = (0..n as u32)
                .map(|i| [(i * 7 + s as u32 * 3) % vocab])
                .collect();
            let mut items: Vec<BatchItem> = caches
                .iter_mut()
                .zip(&toks)
                .map(|(c, t)| BatchItem {
                    cache: c,
                    pos0: 48 + s,
                    tokens: t,
                })
                .collect();
            let t0 = std::time::Instant::now();
            base.step_batch_served(&mut items, Some((&set, sl)))
                .unwrap();
            *secs += t0.elapsed().as_secs_f64();
        }
    }
    let (b, a) = (runs[0].2 / steps as f64, runs[1].2 / steps as f64);
    println!(
        "16 rows, {steps} decode steps: base {:.1} ms/step, 4 adapters {:.1} ms/step, ratio {:.2}x",
        b * 1e3,
        a * 1e3,
        b / a
    );
    let _ = std::fs::remove_dir_all(&tmp);
}
