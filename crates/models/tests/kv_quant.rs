//! The quantized KV cache end to end: a Q8_0 cache (`KvType::Q8_0`, ggml blocks quantized when
//! written) against the default f16 cache on the same model and path (fast kernels),
//! teacher-forced over 100 positions, prefilled at once and decoded one token at a time:
//! argmax agreement >= 98/100 and mean KL(f16 || q8_0) <= 1e-3.
//!
//! - Tiny committed checkpoints with head widths of 32 (Qwen3's q/k norm; Gemma 3's sliding
//!   window of 4 positions and global layers): always run.
//! - Real SmolLM2 (`HF2Q_TEST_SMOLLM2_GGUF`, as `parity.rs`), over its golden text's ids; prints
//!   "skipped" and passes without it.
//! - Q4_0, Q4_1, Q5_0 and Q5_1 on the tiny checkpoints and on SmolLM2, against looser stated
//!   bounds (`low_bit_kv_bound_*`); keys and values of two types (`split_kv_types_tiny`).
//! - Prefill and decode read the same stored values: on the reference path (every op computes
//!   a row the same way whatever the batch) their logits are equal bit for bit for every cache
//!   type; on the fast path they differ as the stated bound of `gate` allows (why: `gate`).
//! - A model whose head width is not a multiple of 32 (tiny-llama, 16) is refused, naming it.
//! - mlx-lm's affine layouts (`--kv-bits 8|4`, groups of 64) on SmolLM2 against the f16 cache
//!   (`affine_kv_gate_smollm2`: 8 bits to q8_0's gate, 4 bits to a measured bound); groups of
//!   32 on the tiny checkpoints (prefill equals decode on the reference path); head widths off
//!   the group refused naming both numbers; a folder's `kv_config.json` giving each layer its
//!   own bits (`per_layer_affine_from_kv_config`).

mod common;

use std::path::{Path, PathBuf};

use common::{argmax, kl};
use hf2q_cpu::MatmulPath;
use hf2q_models::Model;
use hf2q_tensor::kv::{AffineKv, KvType, KvTypes};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// `n` token ids below `vocab` from a fixed generator (a text the model did not see; the tiny
/// models are random anyway).
fn ids(n: usize, vocab: usize, mut seed: u64) -> Vec<u32> {
    (0..n)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % vocab as u64) as u32
        })
        .collect()
}

/// (argmax agreement, mean KL) of `q8_0` against `f16` logits over their last 100 rows.
fn compare(name: &str, what: &str, f16: &[Vec<f32>], q8: &[Vec<f32>]) -> (usize, f64) {
    assert_eq!(f16.len(), 100);
    let (mut agree, mut kl_sum) = (0usize, 0f64);
    for (p, q) in f16.iter().zip(q8) {
        if argmax(p) == argmax(q) {
            agree += 1;
        }
        kl_sum += kl(p, q);
    }
    let kl_mean = kl_sum / 100.0;
    eprintln!("{name}: vs f16 KV cache, {what}: argmax {agree}/100, mean KL {kl_mean:.2e}");
    (agree, kl_mean)
}

/// The logits of the last 100 positions of `ids`: one prefill of all of them, and a prefill of
/// the rest followed by one-token decode steps.
fn logits(model: &Model, ids: &[u32]) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    last_logits(model, ids, 100)
}

/// [`logits`] of the last `last` positions.
fn last_logits(model: &Model, ids: &[u32], last: usize) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let first = ids.len() - last;
    let all = model.session(ids.len()).forward_all(ids).unwrap();
    let prefill = (first..ids.len()).map(|p| all.row(p).to_vec()).collect();
    let mut s = model.session(ids.len());
    s.prefill(&ids[..first]).unwrap();
    let decode = (first..ids.len())
        .map(|p| s.prefill(&ids[p..p + 1]).unwrap())
        .collect();
    (prefill, decode)
}

/// The gate on `model` over `ids` (at least 101 of them): q8_0 KV against f16 KV, both on the
/// fast path; and prefill against decode of the q8_0 cache.
///
/// Prefill and decode store the same blocks for the same keys (quantized per row on write) and
/// read them alike (`reference_prefill_equals_decode*` proves it to the bit), but on the fast
/// path a batch's products and one row's differ in their last bits (the sum order, then the
/// rounding of activations to 16-bit parts), about 1e-3 in SmolLM2's keys by its 6th layer with
/// an f32 cache. An f16 cache rounds that away mostly (max |Δlogit| 1e-2), but a q8_0 cache
/// turns a key near a step's midpoint into either neighbour, a whole step (amax / 127) apart, and
/// the next layers see it: prefill and decode then carry different draws of the cache's rounding
/// noise, so their distance is of the order of q8_0's own distance to f16 (SmolLM2: mean KL
/// 2.1e-4 against 4.7e-4, max |Δlogit| 0.33), not of f16's. Their bound is therefore the
/// gate's own: argmax >= 98/100 and mean KL <= 1e-3.
fn gate(name: &str, model: &mut Model, ids: &[u32]) {
    model.set_matmul_path(MatmulPath::Fast);
    model.set_kv_type(KvType::F16);
    let (want_p, want_d) = logits(model, ids);
    model.set_kv_type(KvType::Q8_0);
    model.check_kv_type().unwrap();
    let (got_p, got_d) = logits(model, ids);
    for (what, want, got) in [
        ("prefill", &want_p, &got_p),
        ("decode", &want_d, &got_d),
        ("its own prefill against decode", &got_p, &got_d),
    ] {
        let (agree, kl_mean) = compare(name, what, want, got);
        assert!(agree >= 98, "{name} {what}: argmax agreement {agree}/100");
        assert!(kl_mean <= 1e-3, "{name} {what}: mean KL {kl_mean}");
    }
    let (s16, s8) = (spread(&want_p, &want_d), spread(&got_p, &got_d));
    eprintln!("{name}: prefill vs decode max |Δlogit|: f16 {s16:.2e}, q8_0 {s8:.2e}");
}

/// The largest |a - b| over all logits.
fn spread(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(u, v)| (u - v).abs()))
        .fold(0f32, f32::max)
}

/// On the reference path, prefill and decode logits of `model` over `ids` are equal bit for bit
/// for each cache type of `types`: every op there computes a row the same way whatever the
/// batch, so any difference would be the cache's (prefill reading values other than the stored
/// ones decode reads). Tolerance 0.
///
/// The last 24 positions are decoded: the reference path is slow, and a cache that stored or
/// read a block differently would show at the first position past a block boundary.
fn reference_prefill_equals_decode(name: &str, model: &mut Model, ids: &[u32], types: &[KvTypes]) {
    model.set_matmul_path(MatmulPath::Reference);
    for &ty in types {
        model.set_kv_type(ty);
        let (p, d) = last_logits(model, ids, 24);
        let s = spread(&p, &d);
        eprintln!(
            "{name}: {} cache, reference path: prefill vs decode max |Δlogit| {s}",
            ty.name()
        );
        assert_eq!(s, 0.0, "{name}: {} prefill vs decode", ty.name());
    }
}

#[test]
fn reference_prefill_equals_decode_tiny() {
    for (name, seed) in [("tiny-qwen3", 11u64), ("tiny-gemma3", 12)] {
        let mut model = Model::load(&fixtures().join("tiny").join(name))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let ids = ids(140, model.vocab_size(), 0x5eed ^ seed);
        // Every type whose blocks fit a head of 32: the affine layouts in groups of 32 too.
        let affine = [AffineKv::B8G32, AffineKv::B4G32].map(KvType::Affine);
        let types: Vec<KvTypes> = KvType::ALL
            .into_iter()
            .chain(affine)
            .map(KvTypes::from)
            .collect();
        reference_prefill_equals_decode(name, &mut model, &ids, &types);
    }
}

#[test]
fn q8_0_kv_gate_tiny() {
    for (name, seed) in [("tiny-qwen3", 11u64), ("tiny-gemma3", 12)] {
        let mut model = Model::load(&fixtures().join("tiny").join(name))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let ids = ids(140, model.vocab_size(), 0x5eed ^ seed);
        gate(name, &mut model, &ids);
        // Bytes per position: 34 per 32 values against f16's 64.
        let (q8, f16) = (
            model.kv_bytes_per_token_as(KvType::Q8_0),
            model.kv_bytes_per_token_as(KvType::F16),
        );
        assert_eq!(q8 * 64, f16 * 34, "{name}");
    }
}

/// The f16 cache's logits on the fast path ([`logits`]): what [`bound`] compares against.
type F16Logits = (Vec<Vec<f32>>, Vec<Vec<f32>>);

fn f16_logits(model: &mut Model, ids: &[u32]) -> F16Logits {
    model.set_matmul_path(MatmulPath::Fast);
    model.set_kv_type(KvType::F16);
    logits(model, ids)
}

/// (argmax agreement, mean KL) of a `ty` cache against the f16 cache's logits `f16`
/// ([`f16_logits`]) on the fast path, for prefill and for decode, checked against
/// `(min agreement, max mean KL)`.
fn bound(
    name: &str,
    model: &mut Model,
    ids: &[u32],
    (want_p, want_d): &F16Logits,
    ty: KvTypes,
    (agree_min, kl_max): (usize, f64),
) {
    model.set_matmul_path(MatmulPath::Fast);
    model.set_kv_type(ty);
    model.check_kv_type().unwrap();
    let (got_p, got_d) = logits(model, ids);
    for (what, want, got) in [("prefill", want_p, &got_p), ("decode", want_d, &got_d)] {
        let what = format!("{} {what}", ty.name());
        let (agree, kl_mean) = compare(name, &what, want, got);
        assert!(
            agree >= agree_min,
            "{name} {what}: argmax agreement {agree}/100"
        );
        assert!(kl_mean <= kl_max, "{name} {what}: mean KL {kl_mean}");
    }
}

/// The 4- and 5-bit types move the output more; their bound on the tiny checkpoints: mean KL <=
/// 5e-3 against the f16 cache and argmax agreement >= 70/100, prefill and decode (the random
/// tiny models' logits are nearly flat, so near-ties flip: measured KL 1.0e-3 and 82/100 for
/// q4_0 on tiny Qwen3, 2.2e-3 and 76/100 on tiny Gemma 3; the offset and 5-bit types less).
/// Bytes per position: each type's ggml block bytes per 32 values against f16's 64.
#[test]
fn low_bit_kv_bound_tiny() {
    for (name, seed) in [("tiny-qwen3", 11u64), ("tiny-gemma3", 12)] {
        let mut model = Model::load(&fixtures().join("tiny").join(name))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let ids = ids(140, model.vocab_size(), 0x5eed ^ seed);
        let f16 = f16_logits(&mut model, &ids);
        for (ty, per32) in [
            (KvType::Q4_0, 18),
            (KvType::Q4_1, 20),
            (KvType::Q5_0, 22),
            (KvType::Q5_1, 24),
        ] {
            bound(name, &mut model, &ids, &f16, ty.into(), (70, 5e-3));
            let (q, f16) = (
                model.kv_bytes_per_token_as(ty),
                model.kv_bytes_per_token_as(KvType::F16),
            );
            assert_eq!(q * 64, f16 * per32, "{name} {}", ty.name());
        }
    }
}

/// Keys and values of different types (llama.cpp's `-ctk q8_0 -ctv q4_0`): each stored in its
/// own type (bytes per position the sum of the halves), within the looser type's bound.
#[test]
fn split_kv_types_tiny() {
    let split = KvTypes {
        k: KvType::Q8_0,
        v: KvType::Q4_0,
    };
    for (name, seed) in [("tiny-qwen3", 11u64), ("tiny-gemma3", 12)] {
        let mut model = Model::load(&fixtures().join("tiny").join(name))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let ids = ids(140, model.vocab_size(), 0x5eed ^ seed);
        let f16 = f16_logits(&mut model, &ids);
        bound(name, &mut model, &ids, &f16, split, (70, 5e-3));
        let (s, f16) = (
            model.kv_bytes_per_token_as(split),
            model.kv_bytes_per_token_as(KvType::F16),
        );
        assert_eq!(s * 128, f16 * (34 + 18), "{name}");
        let types = [
            split,
            KvTypes {
                k: KvType::F16,
                v: KvType::Q5_1,
            },
        ];
        reference_prefill_equals_decode(name, &mut model, &ids, &types);
    }
}

/// The 4- and 5-bit types (and q8_0 keys with q4_0 values) on real SmolLM2 against the f16
/// cache, prefill and decode (fast path, the golden text's ids). Bounds set from measurement,
/// (prefill, decode) in each row's comment: SmolLM2-135M's keys are what 4-bit blocks hurt
/// (a few large channels set each block's scale, the rest round to a few steps; with 3 kv heads
/// every query head shares them), which is why q8_0 keys with q4_0 values sit 20x closer to f16
/// than q4_0 for both. The margin covers the batch-dependent last bits of the fast path, which
/// a block cache turns into whole-step differences (`gate`); these bounds state how far each
/// type moves this model, not a quality promise.
#[test]
fn low_bit_kv_bound_smollm2() {
    let Some((mut model, ids)) = smollm2() else {
        return;
    };
    let split = KvTypes {
        k: KvType::Q8_0,
        v: KvType::Q4_0,
    };
    let f16 = f16_logits(&mut model, &ids);
    for (ty, limits) in [
        (KvType::Q4_0.into(), (65, 0.3)),  // 74/74, KL 0.19/0.18
        (KvType::Q4_1.into(), (80, 0.15)), // 88/90, KL 0.084/0.086
        (KvType::Q5_0.into(), (85, 6e-2)), // 96/92, KL 0.035/0.034
        (KvType::Q5_1.into(), (88, 3e-2)), // 97/95, KL 0.016/0.017
        (split, (90, 1.5e-2)),             // 96/97, KL 8.4e-3/8.5e-3
    ] {
        bound("smollm2", &mut model, &ids, &f16, ty, limits);
    }
}

/// The issue's gate on real weights: q8_0 KV against f16 KV (measured: argmax 99/100, mean KL
/// 4.7e-4 prefill and 5.1e-4 decode; its own prefill against decode 98/100 and 2.1e-4).
#[test]
fn q8_0_kv_gate_smollm2() {
    if let Some((mut model, ids)) = smollm2() {
        gate("smollm2", &mut model, &ids);
    }
}

/// Prefill and decode over a scaled (q8_0) and an offset (q4_1) block cache of SmolLM2 on the
/// reference path: equal bit for bit (as f16's are). Every block type is checked so on the tiny
/// checkpoints (`reference_prefill_equals_decode_tiny`); the reference path over a real model
/// is slow, so here two types over the first 64 of the golden text's ids.
#[test]
fn q8_0_kv_prefill_equals_decode_smollm2() {
    if let Some((mut model, ids)) = smollm2() {
        let types = [KvType::Q8_0, KvType::Q4_1].map(KvTypes::from);
        reference_prefill_equals_decode("smollm2", &mut model, &ids[..64], &types);
    }
}

/// SmolLM2 and its golden text's ids, or `None` (printing "skipped") without the model.
fn smollm2() -> Option<(Model, Vec<u32>)> {
    let var = "HF2Q_TEST_SMOLLM2_GGUF";
    let path = match std::env::var(var) {
        Ok(p) if !p.is_empty() => p,
        _ => {
            eprintln!("skipped: {var} is not set (the real-model KV cache gate needs SmolLM2)");
            return None;
        }
    };
    let model = Model::load(Path::new(&path)).unwrap_or_else(|e| panic!("{path}: {e}"));
    let g: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("goldens/smollm2.json")).unwrap(),
    )
    .unwrap();
    let ids: Vec<u32> = g["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    Some((model, ids))
}

/// mlx-lm's affine KV cache on real SmolLM2 (head width 64) in groups of 64, against the f16
/// cache, prefill and decode on the fast path (the golden text's ids).
///
/// 8 bits is held to q8_0's gate (argmax >= 98/100, mean KL <= 1e-3; measured 98/98, KL
/// 4.4e-4/4.1e-4 prefill/decode, against q8_0's 99/100 and 4.7e-4: an 8-bit grid over 64
/// values with its own offset is about as fine as Q8_0's over 32 around zero). 4 bits: a bound
/// from measurement (prefill/decode: argmax 83/79, mean KL 0.19/0.18) with a margin for the
/// fast path's batch-dependent last bits, which a quantized cache turns into whole-step
/// differences (`gate`): argmax >= 70, KL <= 0.3, where Q4_0 lands (`low_bit_kv_bound_
/// smollm2`). It is further from f16 than Q4_1 (4 bits with an offset too, KL 0.084) because a
/// group spans 64 values, so SmolLM2's few large key channels set each scale for twice as many
/// others. Bytes per position: 68 (8 bits) and 36 (4 bits) per 64 values against f16's 128.
#[test]
fn affine_kv_gate_smollm2() {
    let Some((mut model, ids)) = smollm2() else {
        return;
    };
    let (a8, a4) = (
        KvType::Affine(AffineKv::B8G64),
        KvType::Affine(AffineKv::B4G64),
    );
    let f16 = f16_logits(&mut model, &ids);
    bound("smollm2", &mut model, &ids, &f16, a8.into(), (98, 1e-3));
    bound("smollm2", &mut model, &ids, &f16, a4.into(), (70, 0.3));
    let f16b = model.kv_bytes_per_token_as(KvType::F16);
    assert_eq!(model.kv_bytes_per_token_as(a8) * 128, f16b * 68);
    assert_eq!(model.kv_bytes_per_token_as(a4) * 128, f16b * 36);
}

/// An affine layout whose group does not divide the head width is refused, naming both (tiny
/// Qwen3's heads of 32 in groups of 64; tiny-llama's of 16 in groups of 32), before and at the
/// first write.
#[test]
fn affine_kv_refuses_head_widths_off_the_group() {
    for (name, ty, dh, g) in [
        ("tiny-qwen3", AffineKv::B8G64, 32, 64),
        ("tiny-llama", AffineKv::B4G32, 16, 32),
    ] {
        let mut model = Model::load(&fixtures().join("tiny").join(name)).unwrap();
        model.set_kv_type(KvType::Affine(ty));
        let e = model.check_kv_type().unwrap_err().to_string();
        let both = |e: &str| {
            e.contains(&format!("head width {dh}")) && e.contains(&format!("group size {g}"))
        };
        assert!(both(&e), "{name}: {e}");
        let e = model
            .session(8)
            .prefill(&[1, 2, 3])
            .unwrap_err()
            .to_string();
        assert!(both(&e), "{name}: {e}");
    }
}

/// A copy of tiny checkpoint `name` in a temporary folder, with `kv_config` as its
/// `kv_config.json`.
fn tiny_with_kv_config(name: &str, kv_config: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixtures().join("tiny").join(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    std::fs::write(dir.path().join("kv_config.json"), kv_config).unwrap();
    dir
}

/// A folder's `kv_config.json` gives each layer its own affine layout: tiny Qwen3 (2 layers of
/// 2 kv heads of 32) with 8 bits in layer 0 and 4 in layer 1, groups of 32, in either form of
/// the file. Each layer's cache is of its layout, bytes per position are the layers' sum (2
/// heads x keys and values x (36 + 20) bytes), prefill equals decode bit for bit on the
/// reference path, and the logits differ from both one-layout caches (so both layouts are in
/// use). Setting one type replaces the file's; a malformed file fails the load naming the field.
#[test]
fn per_layer_affine_from_kv_config() {
    let (a8, a4) = (
        KvTypes::from(KvType::Affine(AffineKv::B8G32)),
        KvTypes::from(KvType::Affine(AffineKv::B4G32)),
    );
    for text in [
        r#"{"group_size": 32, "bits": [8, 4]}"#,
        r#"{"group_size": 32, "default_bits": 4, "layers": {"0": 8}}"#,
    ] {
        let dir = tiny_with_kv_config("tiny-qwen3", text);
        let mut model = Model::load(dir.path()).unwrap();
        assert_eq!(model.kv_layer_types(), Some(&[a8, a4][..]), "{text}");
        model.check_kv_type().unwrap();
        let types: Vec<KvTypes> = model
            .new_cache(16)
            .layers
            .iter()
            .map(|l| match l {
                hf2q_tensor::kv::KvStore::Host(h) => h.kv_types(),
                _ => panic!("a host cache"),
            })
            .collect();
        assert_eq!(types, vec![a8, a4]);
        assert_eq!(model.kv_bytes_per_token(), 2 * 2 * (36 + 20));
        assert_eq!(model.kv_type_name(), "affine8g32 x1, affine4g32 x1");
        let ids = ids(40, model.vocab_size(), 0x5eed ^ 11);
        model.set_matmul_path(MatmulPath::Reference);
        let (per_layer, decode) = last_logits(&model, &ids, 8);
        assert_eq!(spread(&per_layer, &decode), 0.0, "{text}");
        for one in [a8, a4] {
            let mut m = Model::load(dir.path()).unwrap();
            m.set_matmul_path(MatmulPath::Reference);
            m.set_kv_type(one);
            assert_eq!(m.kv_layer_types(), None);
            let (p, _) = last_logits(&m, &ids, 8);
            assert!(spread(&p, &per_layer) > 0.0, "{text}: as {}", one.name());
        }
    }
    let dir = tiny_with_kv_config("tiny-qwen3", r#"{"bits": [8, 4, 4]}"#);
    let e = Model::load(dir.path()).err().expect("refused").to_string();
    assert!(
        e.contains("kv_config.json") && e.contains("bits has 3 entries for a model of 2 layers"),
        "{e}"
    );
}

#[test]
fn q8_0_kv_refuses_head_widths_off_the_block() {
    let mut model = Model::load(&fixtures().join("tiny/tiny-llama")).unwrap();
    model.set_kv_type(KvType::Q8_0);
    let e = model.check_kv_type().unwrap_err().to_string();
    assert!(e.contains("head width 16") && e.contains("q8_0"), "{e}");
    // Running anyway fails at the first cache write with the same message.
    let e = model
        .session(8)
        .prefill(&[1, 2, 3])
        .unwrap_err()
        .to_string();
    assert!(e.contains("head width 16"), "{e}");
}
