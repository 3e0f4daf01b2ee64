//! Contract of `--target-bpw` mixed precision, on the committed tiny checkpoints (fast): the
//! budget is respected, a bigger budget never measures worse, budgets below the floors are
//! refused with the reachable minimum, and the written model's real KL on the calibration tokens
//! is no worse than the uniform floor model it grew from.

use std::path::Path;

use hf2q_models::convert::source::SourceModel;
use hf2q_models::convert::NoProgress;
use hf2q_models::quantize::mixed::{plan_mixed, quantize_mixed, MixedOptions};
use hf2q_models::Model;
use hf2q_tensor::io::gguf::GgufFile;

fn ids() -> Vec<u32> {
    let p =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny/tiny-qwen2/golden.json");
    let g: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    g["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn kl_vs(base: &Path, q: &Path, ids: &[u32]) -> f64 {
    let run = |p: &Path| {
        let m = Model::load(p).unwrap();
        let l = m.session(ids.len()).forward_all(ids).unwrap();
        (l.dims2().1, l.into_data())
    };
    let ((v, a), (_, b)) = (run(base), run(q));
    let lsm = |r: &[f32]| {
        let m = r.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let z = r.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m;
        r.iter().map(|&x| x as f64 - z).collect::<Vec<_>>()
    };
    a.chunks(v)
        .zip(b.chunks(v))
        .map(|(x, y)| {
            lsm(x)
                .iter()
                .zip(lsm(y))
                .map(|(p, q)| p.exp() * (p - q))
                .sum::<f64>()
        })
        .sum::<f64>()
        / ids.len() as f64
}

#[test]
fn budget_floors_and_monotonicity() {
    let src_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny/tiny-qwen2");
    let src = SourceModel::open(&src_path).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let opts = |bpw: f64| MixedOptions {
        exhaustive: true,
        ..MixedOptions::new(bpw, ids())
    };
    // Every group of a 2-layer model is protected (first or last layer, embeddings): the floor
    // is Q3_K's fallback for 64-wide rows, Q4_0 (4.5 bits) plus F32 norms and biases.
    let e = plan_mixed(&src, &opts(4.5), &NoProgress)
        .unwrap_err()
        .to_string();
    assert!(e.contains("below what this model can reach"), "{e}");
    let mut last = f64::INFINITY;
    for bpw in [5.0, 6.0, 7.0, 9.0] {
        let (_, a) = plan_mixed(&src, &opts(bpw), &NoProgress).unwrap();
        eprintln!(
            "target {bpw}: {:.3} bpw, estimated KL {:.6}",
            a.bits_per_weight, a.estimated_kl
        );
        assert!(
            a.bits_per_weight <= bpw + 1e-9,
            "{} > {bpw}",
            a.bits_per_weight
        );
        assert!(
            a.estimated_kl <= last + 1e-12,
            "bigger budget, worse estimate"
        );
        last = a.estimated_kl;
    }
    // The default mode measures one level per group and scales the others by weight error.
    let (_, a) = plan_mixed(
        &src,
        &MixedOptions {
            exhaustive: false,
            ..opts(7.0)
        },
        &NoProgress,
    )
    .unwrap();
    assert!(a.bits_per_weight <= 7.0 && a.estimated_kl > 0.0);
    // The written file: its real KL against the source is no worse than the floor-only model
    // (every group at its floor), which is the mixed plan at the smallest feasible budget.
    let (floor_report, floor) = quantize_mixed(
        &src,
        &dir.path().join("floor.gguf"),
        &opts(4.75),
        &NoProgress,
        &NoProgress,
    )
    .unwrap();
    let (report, mixed) = quantize_mixed(
        &src,
        &dir.path().join("mixed.gguf"),
        &opts(7.0),
        &NoProgress,
        &NoProgress,
    )
    .unwrap();
    assert!(
        mixed
            .groups
            .iter()
            .zip(&floor.groups)
            .any(|(m, f)| m.level > f.level),
        "nothing upgraded"
    );
    let k_floor = kl_vs(&src_path, &dir.path().join("floor.gguf"), &ids());
    let k_mixed = kl_vs(&src_path, &dir.path().join("mixed.gguf"), &ids());
    eprintln!(
        "floor {:.3} bpw KL {k_floor:.6}; mixed {:.3} bpw KL {k_mixed:.6}",
        floor_report.bits_per_weight(),
        report.bits_per_weight()
    );
    assert!(k_mixed <= k_floor, "{k_mixed} > {k_floor}");
    let f = GgufFile::open(&dir.path().join("mixed.gguf")).unwrap();
    assert!(f
        .tensors
        .iter()
        .any(|t| t.ty == hf2q_tensor::GgmlType::Q8_0));
}
