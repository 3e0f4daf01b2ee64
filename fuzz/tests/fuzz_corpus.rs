//! The fuzz targets in CI: the committed seeds reach the deep code paths (a seed that stopped
//! parsing would leave a target fuzzing nothing but error paths), every corpus input and every
//! minimised crash under `regressions/` runs clean, and each target gets a short mutation budget
//! ([`BUDGET_PER_TARGET`], about a minute in all) from a fixed seed, so a failure reproduces.

use std::time::Duration;

use hf2q_fuzz::mutate::{self, RunOptions};
use hf2q_fuzz::{corpus_dir, join2, regressions_dir, split2, Target};

/// 9 targets x 7 s: the issue's "a minute in all" on the committed corpus.
const BUDGET_PER_TARGET: Duration = Duration::from_secs(7);

fn seeds(t: Target) -> Vec<Vec<u8>> {
    let v: Vec<Vec<u8>> = mutate::read_corpus(&corpus_dir(t))
        .into_iter()
        .map(|(_, b)| b)
        .collect();
    assert!(
        !v.is_empty(),
        "{}: no seeds under {}",
        t.name(),
        corpus_dir(t).display()
    );
    v
}

#[test]
fn seeds_reach_the_deep_paths() {
    use hf2q_models::chat_template::ChatTemplate;
    use hf2q_models::tokenizer::Tokenizer;
    use hf2q_tensor::io::gguf::GgufFile;
    use hf2q_tensor::Bytes;

    let dir = tempfile::tempdir().unwrap();
    // GGUF seeds that describe a model load and decode.
    let mut models = 0;
    for s in seeds(Target::Gguf) {
        let f = GgufFile::from_bytes(Bytes::from_vec(s.clone())).expect("a GGUF seed parses");
        if f.get_str("tokenizer.ggml.model").is_none() {
            continue; // the reader's fixture: tensors, no model
        }
        let p = dir.path().join("m.gguf");
        std::fs::write(&p, &s).unwrap();
        let m = hf2q_models::Model::load(&p).expect("a model seed loads");
        let mut sess = m.session(8);
        sess.prefill(&[1, 2]).expect("prefill");
        sess.decode_greedy(3).expect("decode");
        models += 1;
    }
    assert!(models >= 3);
    // The MLX seed loads as a model beside the tiny tokenizer.
    for s in seeds(Target::Mlx) {
        let (cfg, st) = split2(&s);
        let d = dir.path().join("mlx");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("config.json"), cfg).unwrap();
        std::fs::write(d.join("model.safetensors"), st).unwrap();
        std::fs::write(
            d.join("tokenizer.json"),
            hf2q_fuzz::targets::tiny::TOKENIZER_JSON,
        )
        .unwrap();
        let m = hf2q_models::Model::load(&d).expect("the MLX seed loads");
        assert_eq!(m.info().format, "mlx");
    }
    for s in seeds(Target::TokenizerJson) {
        let (j, text) = split2(&s);
        let t = Tokenizer::from_hf_bytes(j, None).expect("a tokenizer.json seed loads");
        assert!(!t
            .encode(&String::from_utf8_lossy(text), false, false)
            .unwrap()
            .is_empty());
    }
    for s in seeds(Target::GgufTokenizer) {
        let (g, _) = split2(&s);
        let f = GgufFile::from_bytes(Bytes::from_vec(g.to_vec())).unwrap();
        Tokenizer::from_gguf(&f).expect("a GGUF tokenizer seed loads");
    }
    for s in seeds(Target::ChatTemplate) {
        let (src, msgs) = split2(&s);
        let t = ChatTemplate::new(std::str::from_utf8(src).unwrap(), Some("<s>"), Some("</s>"))
            .expect("a template seed compiles");
        let v: serde_json::Value = serde_json::from_slice(msgs).unwrap();
        let m = v
            .get("messages")
            .and_then(|m| m.as_array())
            .or(v.as_array())
            .unwrap();
        let out = t
            .render_json(m, &Default::default())
            .expect("a template seed renders");
        assert!(!out.is_empty());
    }
    for s in seeds(Target::Imatrix) {
        let p = dir.path().join("i.gguf");
        std::fs::write(&p, &s).unwrap();
        let im = hf2q_models::quantize::imatrix::Imatrix::load(&p).expect("the imatrix seed loads");
        assert!(!im.entries.is_empty());
    }
    // Every request seed gets through parsing, rendering and tokenizing: answered 200, or (the
    // tools seed, whose tool prompt is longer than the tiny model's 256 positions) refused for
    // its rendered length.
    let mut ok = 0;
    for s in seeds(Target::OpenaiRequest) {
        let (status, body) = hf2q_fuzz::targets::openai::answer(&s).unwrap();
        let rendered = status == 400 && body.contains("context_length_exceeded");
        assert!(
            status == 200 || rendered,
            "{}: {status} {body}",
            String::from_utf8_lossy(&s[1..])
        );
        ok += (status == 200) as usize;
    }
    assert!(ok >= 8);
}

#[test]
fn corpus_and_regressions_replay_clean() {
    let mut n = 0;
    for t in Target::ALL {
        for dir in [corpus_dir(t), regressions_dir(t)] {
            for (path, bytes) in mutate::read_corpus(&dir) {
                let r = std::panic::catch_unwind(|| t.run(&bytes));
                assert!(r.is_ok(), "{}: {} panics", t.name(), path.display());
                n += 1;
            }
        }
    }
    assert!(n >= Target::ALL.len());
}

/// The first crash the fuzzer found: `tokenizers` panicked on a syntax error inside `decoder`.
#[test]
fn tokenizer_json_with_a_broken_decoder_is_an_error() {
    let json = br#"{"version":"1.0","model":{"type":"BPE","vocab":{"a":0},"merges":[]},"decoder":{"type":"ByteLevel",1:2}}"#;
    let e = hf2q_models::tokenizer::Tokenizer::from_hf_bytes(json, None)
        .err()
        .expect("an error, not a tokenizer");
    assert!(e.to_string().contains("tokenizer.json"), "{e}");
    Target::TokenizerJson.run(&join2(json, b"a"));
}

/// The second: a GGUF file with `general.alignment` = 2^28 was accepted, and writing it back
/// padded its header to 328 MB (a larger power of two would pad forever).
#[test]
fn gguf_with_a_huge_alignment_is_refused() {
    let bytes = std::fs::read(regressions_dir(Target::Gguf).join("huge-alignment.bin")).unwrap();
    let e = hf2q_tensor::io::gguf::GgufFile::from_bytes(hf2q_tensor::Bytes::from_vec(bytes))
        .err()
        .expect("refused");
    assert!(e.to_string().contains("general.alignment"), "{e}");
}

#[test]
fn committed_seeds_are_what_the_generator_writes() {
    let dir = tempfile::tempdir().unwrap();
    hf2q_fuzz::seeds::write_all(dir.path()).unwrap();
    for t in Target::ALL {
        let made = mutate::read_corpus(&dir.path().join(t.name()));
        let committed = mutate::read_corpus(&corpus_dir(t));
        let names = |v: &[(std::path::PathBuf, Vec<u8>)]| -> Vec<(String, Vec<u8>)> {
            v.iter()
                .map(|(p, b)| (p.file_name().unwrap().to_string_lossy().into(), b.clone()))
                .collect()
        };
        assert!(
            names(&made) == names(&committed),
            "{}: fuzz/corpus differs from `hf2q-fuzz seeds`; rerun it and commit",
            t.name()
        );
    }
}

#[test]
fn short_mutation_budget_finds_nothing() {
    let findings = tempfile::tempdir().unwrap();
    std::panic::set_hook(Box::new(|_| {}));
    let mut report = Vec::new();
    let mut failed = Vec::new();
    for t in Target::ALL {
        let opts = RunOptions {
            budget: BUDGET_PER_TARGET,
            seed: 26,
            findings_dir: findings.path().join(t.name()),
            hang_limit: Duration::from_secs(60),
            stop_at_first: true,
        };
        let s = mutate::run(t, &seeds(t), &opts);
        report.push(format!("{}: {} executions", t.name(), s.executions));
        for f in s.findings {
            // Keep the input where a developer can find it, then fail below.
            let keep = std::env::temp_dir().join(format!(
                "hf2q-fuzz-finding-{}",
                f.file_name().unwrap().to_string_lossy()
            ));
            let _ = std::fs::copy(&f, &keep);
            failed.push(format!(
                "{} (`hf2q-fuzz replay {} {}`)",
                t.name(),
                t.name(),
                keep.display()
            ));
        }
    }
    let _ = std::panic::take_hook();
    eprintln!("{}", report.join("\n"));
    assert!(failed.is_empty(), "findings: {failed:?}");
}
