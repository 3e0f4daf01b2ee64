//! The KV cache's flags on the command line: mlx-lm's affine cache (`--kv-bits`,
//! `--kv-group-size`) parsed and refused alongside `--kv-type*`, its bytes per token in
//! `inspect --kv` and `bench`, and a model folder's `kv_config.json` (per-layer bits).

mod common;

use common::lab::copy_dir;
use common::{fails_with, fixture, hf2q, s, smollm2, stderr, stdout};
use serde_json::Value;

/// `--kv-bits` takes 4 or 8 and `--kv-group-size` mlx's 32, 64 or 128, only with `--kv-bits`;
/// either of the `--kv-type*` flags with `--kv-bits` is refused by the parser, naming both.
#[test]
fn kv_bits_flags_parse_and_conflict() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["run", "-p", "x", "--kv-bits", "8", "--kv-type", "q8_0"],
            "'--kv-bits <BITS>' cannot be used with '--kv-type <TYPE>'",
        ),
        (
            &["run", "-p", "x", "--kv-bits", "4", "--kv-type-k", "f16"],
            "cannot be used with",
        ),
        (
            &["bench", "--kv-type-v", "q4_0", "--kv-bits", "8"],
            "cannot be used with",
        ),
        (
            &["serve", "--kv-bits", "8", "--kv-type", "f32"],
            "cannot be used with",
        ),
        (&["run", "-p", "x", "--kv-bits", "5"], "invalid value '5'"),
        (
            &["run", "-p", "x", "--kv-bits", "8", "--kv-group-size", "48"],
            "invalid value '48'",
        ),
        (&["run", "-p", "x", "--kv-group-size", "32"], "--kv-bits"),
    ];
    for (args, needle) in cases {
        fails_with(&hf2q(args), needle);
    }
    // Accepted: a run over the tiny Qwen3 (heads of 32) in groups of 32.
    let t = fixture("tiny-qwen3");
    let o = hf2q(&[
        "run",
        s(&t),
        "-p",
        "hi",
        "-n",
        "3",
        "--raw",
        "--device",
        "cpu",
        "--kv-bits",
        "4",
        "--kv-group-size",
        "32",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    // A group that does not divide the head width is refused naming both numbers.
    let o = hf2q(&["run", s(&t), "-p", "hi", "-n", "3", "--kv-bits", "8"]);
    fails_with(&o, "head width 32");
    fails_with(&o, "group size 64");
}

/// `inspect --kv` with mlx-lm's affine cache on SmolLM2 (30 layers of 3 kv heads of 64): 8 bits
/// in groups of 64 are 68 bytes per 64 values, 4 bits 36, against f16's 128; per token, keys
/// and values of every layer: 30 * 3 * 2 * (68, 36, 128) bytes. The centred keys add a fixed
/// cost per sequence and head (`KeyCentering::fixed_bytes_per_head`): 16 first positions in
/// f16, the f32 centre and, for each of the 32 rotated pairs, three f32 numbers:
/// 30 * 3 * (2 * 16 * 64 + 4 * (64 + 3 * 32)) bytes.
#[test]
fn inspect_kv_of_the_affine_cache() {
    let Some(m) = smollm2("inspect_kv_of_the_affine_cache") else {
        return;
    };
    for (bits, name, per) in [("8", "affine8g64", 12240), ("4", "affine4g64", 6480)] {
        let args = [
            "inspect",
            s(&m),
            "--json",
            "--kv",
            "--kv-bits",
            bits,
            "--ctx",
            "1000",
        ];
        let o = hf2q(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["kv"]["kv_type"], name);
        assert_eq!(v["kv"]["bytes_per_token"], per);
        assert_eq!(v["kv"]["f16_bytes_per_token"], 23040);
        let fixed = 30 * 3 * (2 * 16 * 64 + 4 * (64 + 3 * 32));
        assert_eq!(v["kv"]["fixed_bytes"], fixed);
        assert_eq!(v["kv"]["bytes"], 1000 * per + fixed);
        let out = stdout(&hf2q(&["inspect", s(&m), "--kv", "--kv-bits", bits]));
        let line = format!("bytes per token  {per}");
        assert!(out.contains(name) && out.contains(&line), "{out}");
    }
    let o = hf2q(&[
        "inspect",
        s(&m),
        "--kv",
        "--kv-bits",
        "8",
        "--kv-group-size",
        "128",
    ]);
    fails_with(&o, "head width 64");
    fails_with(&o, "group size 128");
}

/// `bench` reports the affine cache's bytes per token: tiny Qwen3's heads of 32 in groups of
/// 32 are 36 (8 bits) or 20 (4 bits) bytes per 32 values against f16's 64.
#[test]
fn bench_reports_affine_kv_bytes() {
    let t = fixture("tiny-qwen3");
    let run = |kv: &[&str]| {
        let mut args = vec![
            "bench",
            s(&t),
            "-p",
            "8",
            "-n",
            "2",
            "-r",
            "1",
            "-t",
            "1",
            "--device",
            "cpu",
            "--json",
        ];
        args.extend_from_slice(kv);
        let o = hf2q(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let lines: Vec<Value> = stdout(&o)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        (lines, stderr(&o))
    };
    let (f16, _) = run(&[]);
    for (bits, name, per32) in [("8", "affine8g32", 36), ("4", "affine4g32", 20)] {
        let (a, err) = run(&["--kv-bits", bits, "--kv-group-size", "32"]);
        assert!(err.contains(&format!("KV cache {name}")), "{err}");
        assert!(!a.is_empty());
        for (x, y) in a.iter().zip(&f16) {
            assert_eq!(x["kv_type"], name);
            let per = |v: &Value| v["kv_bytes_per_token"].as_u64().unwrap();
            assert_eq!(per(x) * 64, per(y) * per32);
        }
    }
}

/// A model folder's kv_config.json sets each layer's affine bits when no flag chooses the cache
/// (tiny Qwen3: 2 layers of 2 kv heads of 32, 8 then 4 bits in groups of 32: 2 heads x keys
/// and values x (36 + 20) bytes per token); a flag replaces it; a malformed file is refused
/// naming the field.
#[test]
fn inspect_kv_from_kv_config() {
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixture("tiny-qwen3"), dir.path());
    let cfg = dir.path().join("kv_config.json");
    std::fs::write(&cfg, r#"{"group_size": 32, "bits": [8, 4]}"#).unwrap();
    let d = s(dir.path());
    let o = hf2q(&["inspect", d, "--json", "--kv"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["kv"]["kv_type"], "affine8g32 x1, affine4g32 x1");
    assert_eq!(v["kv"]["bytes_per_token"], 2 * 2 * (36 + 20));
    assert!(stderr(&o).contains("kv_config.json"), "{}", stderr(&o));
    let o = hf2q(&["inspect", d, "--json", "--kv", "--kv-type", "q8_0"]);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["kv"]["kv_type"], "q8_0");
    std::fs::write(&cfg, r#"{"group_size": 32, "bits": [8, 6]}"#).unwrap();
    fails_with(&hf2q(&["inspect", d, "--kv"]), "bits[1] 6 is not 4 or 8");
}
