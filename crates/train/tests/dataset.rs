//! The dataset builder against fixture inputs (`tests/fixtures/dataset/`): every input and
//! output format, column mapping, the bad rows of each file type named by line and skipped or
//! rejected, duplicates, the seeded split, and token lengths with a real tokenizer and template.

use std::path::{Path, PathBuf};

use hf2q_train::dataset::{build, split, BuildConfig, Dedup, Format, Input, OnError};
use serde_json::{json, Value};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/dataset")
        .join(name)
}

fn input(name: &str) -> Input {
    Input::load(&fixture(name), name).unwrap()
}

fn cfg(to: Option<Format>, map: &[(&str, &str)]) -> BuildConfig {
    BuildConfig {
        mapping: map
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect(),
        to,
        on_error: OnError::Skip,
        valid_split: 0.0,
        ..Default::default()
    }
}

/// The output records in input order (the split's shuffle undone by line).
fn records(inputs: &[&str], c: &BuildConfig) -> Vec<Value> {
    let b = build(&inputs.iter().map(|n| input(n)).collect::<Vec<_>>(), c).unwrap();
    let mut all: Vec<_> = b.train.into_iter().chain(b.valid).collect();
    all.sort_by(|a, b| (&a.file, a.line).cmp(&(&b.file, b.line)));
    all.into_iter().map(|k| k.value).collect()
}

#[test]
fn csv_columns_map_to_every_sft_format() {
    let map = [("instruction", "question"), ("output", "answer")];
    let alpaca = records(&["qa.csv"], &cfg(None, &map));
    assert_eq!(
        alpaca,
        [
            json!({"instruction": "What is 2+2?", "input": "", "output": "4"}),
            json!({"instruction": "Name a colour, any colour.", "input": "", "output": "Blue,\nor green."}),
            json!({"instruction": "What is the capital of France?", "input": "", "output": "Paris"}),
        ]
    );
    let m = records(&["qa.csv"], &cfg(Some(Format::Messages), &map));
    assert_eq!(
        m[0],
        json!({"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]})
    );
    let s = records(&["qa.csv"], &cfg(Some(Format::ShareGpt), &map));
    assert_eq!(
        s[2],
        json!({"conversations": [{"from": "human", "value": "What is the capital of France?"}, {"from": "gpt", "value": "Paris"}]})
    );
    let pc = records(&["qa.csv"], &cfg(Some(Format::PromptCompletion), &map));
    assert_eq!(
        pc[0],
        json!({"prompt": [{"role": "user", "content": "What is 2+2?"}], "completion": [{"role": "assistant", "content": "4"}]})
    );
    // Plain prompt/completion columns instead.
    let t = records(
        &["qa.csv"],
        &cfg(
            Some(Format::Text),
            &[("prompt", "question"), ("completion", "answer")],
        ),
    );
    assert_eq!(t[0], json!({"text": "What is 2+2?4"}));
    // A mapping of a column no row has is a mistake, not a silent no-op.
    let e = build(&[input("qa.csv")], &cfg(None, &[("text", "body")]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--map text=body: no row of the input has a column 'body'"),
        "{e}"
    );
}

#[test]
fn json_jsonl_records_convert_and_those_without_a_form_are_named() {
    let b = build(&[input("chats.jsonl")], &cfg(Some(Format::Alpaca), &[])).unwrap();
    let lines: Vec<(usize, &str)> = b
        .report
        .problems
        .iter()
        .map(|p| (p.line, p.message.as_str()))
        .collect();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0].0, 2);
    assert!(
        lines[0].1.contains("a conversation of 4 turns"),
        "{lines:?}"
    );
    assert_eq!(lines[1].0, 4);
    assert!(lines[1].1.starts_with("not JSON"), "{lines:?}");
    let out = records(&["chats.jsonl"], &cfg(Some(Format::Alpaca), &[]));
    assert_eq!(
        out,
        [
            json!({"instruction": "Hi", "input": "", "output": "Hello!", "system": "Be brief."}),
            json!({"instruction": "Say yes", "input": "", "output": "Yes"}),
        ]
    );
    // Multi-turn keeps its turns in the chat formats; prompt_completion splits off the last.
    let pc = records(&["chats.jsonl"], &cfg(Some(Format::PromptCompletion), &[]));
    assert_eq!(pc[1]["prompt"].as_array().unwrap().len(), 3);
    assert_eq!(
        pc[1]["completion"],
        json!([{"role": "assistant", "content": "4"}])
    );
    // A .json array: element 42 (line 4) is not a record.
    let b = build(&[input("alpaca.json")], &cfg(Some(Format::Messages), &[])).unwrap();
    assert_eq!(b.report.problems[0].line, 4);
    let m = records(&["alpaca.json"], &cfg(Some(Format::Messages), &[]));
    assert_eq!(m[0]["messages"][0]["content"], "Add the numbers\n2 3");
    assert_eq!(
        m[1]["messages"][0],
        json!({"role": "system", "content": "You are kind."})
    );
    // Text records: text keeps both parts; a chat format needs a prompt.
    let t = records(&["pc.jsonl"], &cfg(Some(Format::Text), &[]));
    assert_eq!(
        t,
        [
            json!({"text": "Q: capital of Italy? A: Rome"}),
            json!({"text": "Just some text to learn."})
        ]
    );
    let b = build(&[input("pc.jsonl")], &cfg(Some(Format::Messages), &[])).unwrap();
    assert_eq!((b.report.train, b.report.skipped), (1, 1));
    assert!(b.report.problems[0].message.contains("without a prompt"));
    // The default output format is the first record's.
    let same = records(&["pc.jsonl"], &cfg(None, &[]));
    assert_eq!(
        same[0],
        json!({"prompt": "Q: capital of Italy? A:", "completion": " Rome"})
    );
}

#[test]
fn preference_records_from_csv_and_jsonl() {
    let map = [
        ("prompt", "question"),
        ("chosen", "good"),
        ("rejected", "bad"),
    ];
    let d = records(&["prefs.csv"], &cfg(None, &map));
    assert_eq!(
        d[1],
        json!({"prompt": "Best first step?", "chosen": "Read the manual, then try.", "rejected": "Guess."})
    );
    let c = records(&["prefs.jsonl"], &cfg(Some(Format::Dpo), &[]));
    assert_eq!(
        c[0]["chosen"],
        json!([{"role": "assistant", "content": "Hello, how can I help?"}])
    );
    // Preferences and supervised records do not turn into each other.
    let b = build(&[input("prefs.jsonl")], &cfg(Some(Format::Messages), &[]));
    assert!(b.unwrap_err().to_string().contains("no usable records"));
    let b = build(&[input("pc.jsonl")], &cfg(Some(Format::Dpo), &[])).unwrap_err();
    assert!(b.to_string().contains("no usable records"));
}

#[test]
fn bad_rows_are_rejected_by_default_and_skipped_when_asked() {
    let map = vec![
        ("instruction".to_string(), "question".to_string()),
        ("output".to_string(), "answer".to_string()),
    ];
    let strict = BuildConfig {
        mapping: map,
        to: Some(Format::Messages),
        ..Default::default()
    };
    let e = build(&[input("qa.csv")], &strict).unwrap_err().to_string();
    assert!(
        e.contains("qa.csv:5: 2 cells where the header has 3"),
        "{e}"
    );
    assert!(e.contains("--on-error skip"), "{e}");
    let e = build(&[input("chats.jsonl")], &BuildConfig::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("chats.jsonl:4: not JSON"), "{e}");
    let e = build(&[input("alpaca.json")], &BuildConfig::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("alpaca.json:4: a record must be a JSON object, not a number"),
        "{e}"
    );
    let lenient = BuildConfig {
        on_error: OnError::Skip,
        ..strict
    };
    let b = build(&[input("qa.csv"), input("chats.jsonl")], &lenient).unwrap();
    assert_eq!(
        (b.report.rows, b.report.skipped),
        (4 + 4, 1 + 1),
        "{:?}",
        b.report
    );
    let at: Vec<String> = b
        .report
        .problems
        .iter()
        .map(|p| format!("{}:{}", p.file, p.line))
        .collect();
    assert_eq!(at, ["chats.jsonl:4", "qa.csv:5"]);
    // A broken JSON array cannot be read past its error: the whole file is refused.
    let broken = Input {
        name: "b.json".into(),
        kind: hf2q_train::dataset::FileKind::Json,
        bytes: b"[\n{\"text\": \"a\"},\n{\"text\": \"b\"\n]".to_vec(),
    };
    let e = build(&[broken], &lenient).unwrap_err().to_string();
    assert!(e.starts_with("b.json:4:"), "{e}");
}

#[test]
fn exact_and_near_duplicates_are_removed_and_reported() {
    let base = "Explain why the sky looks blue on a clear day to a curious child who asks";
    let mut text = String::new();
    for t in [
        base.to_string(),
        "Something else entirely: how do bees make honey from nectar".into(),
        base.to_string(),
        base.to_uppercase().replace(' ', "  "),
        format!("{base}!"),
    ] {
        text.push_str(&json!({"text": t}).to_string());
        text.push('\n');
    }
    let inp = || Input {
        name: "d.jsonl".into(),
        kind: hf2q_train::dataset::FileKind::Jsonl,
        bytes: text.clone().into_bytes(),
    };
    let run = |dedup| {
        let b = build(
            &[inp()],
            &BuildConfig {
                dedup,
                valid_split: 0.0,
                ..Default::default()
            },
        )
        .unwrap();
        (
            b.report.exact_duplicates,
            b.report.near_duplicates,
            b.report.train,
        )
    };
    assert_eq!(run(Dedup::None), (0, 0, 5));
    assert_eq!(run(Dedup::Exact), (1, 0, 4));
    assert_eq!(run(Dedup::Near), (1, 2, 2));
    let b = build(
        &[inp()],
        &BuildConfig {
            dedup: Dedup::Near,
            ..Default::default()
        },
    )
    .unwrap();
    let d: Vec<(usize, usize, &str)> = b
        .report
        .duplicates
        .iter()
        .map(|d| (d.line, d.of_line, d.kind))
        .collect();
    assert_eq!(d, [(3, 1, "exact"), (4, 1, "near"), (5, 1, "near")]);
}

#[test]
fn the_split_is_a_function_of_the_seed() {
    let v: Vec<usize> = (0..200).collect();
    let (t1, v1) = split(v.clone(), 0.1, 7);
    let (t2, v2) = split(v.clone(), 0.1, 7);
    assert_eq!((&t1, &v1), (&t2, &v2), "same seed, same split");
    assert_eq!((t1.len(), v1.len()), (180, 20));
    let (_, v3) = split(v.clone(), 0.1, 8);
    assert_ne!(v1, v3, "another seed, another split");
    let mut all: Vec<usize> = t1.iter().chain(&v1).copied().collect();
    all.sort();
    assert_eq!(all, v, "every record once");
    assert_ne!(
        t1,
        (0..200).filter(|i| !v1.contains(i)).collect::<Vec<_>>(),
        "shuffled"
    );
    // Through the builder, from files: the same seed gives the same two files' records.
    let c = BuildConfig {
        valid_split: 0.5,
        seed: 3,
        on_error: OnError::Skip,
        ..Default::default()
    };
    let lines = |b: hf2q_train::dataset::Built| {
        (
            b.train.iter().map(|k| k.line).collect::<Vec<_>>(),
            b.valid.iter().map(|k| k.line).collect::<Vec<_>>(),
        )
    };
    let a = lines(build(&[input("chats.jsonl")], &c).unwrap());
    assert_eq!(a, lines(build(&[input("chats.jsonl")], &c).unwrap()));
    assert_eq!(a.0.len() + a.1.len(), 3);
    assert!(split(vec![1], 0.5, 0).0 == [1], "train keeps a record");
}

#[test]
fn token_lengths_follow_the_model_s_template() {
    let dir =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/tiny/tiny-llama");
    let model = hf2q_models::Model::load(&dir).unwrap();
    let b = build(&[input("chats.jsonl")], &cfg(Some(Format::Messages), &[])).unwrap();
    let items: Vec<&hf2q_train::dataset::Item> = b.train.iter().map(|k| &k.item).collect();
    let lens: Vec<usize> = hf2q_train::dataset::stats::lengths(&model, &items)
        .unwrap()
        .into_iter()
        .map(Result::unwrap)
        .collect();
    // Independently: the template's text ("<s>role: content</s>" a turn), tokenized whole.
    let tok = model.tokenizer();
    for (k, len) in b.train.iter().zip(&lens) {
        let mut text = String::new();
        for m in k.value["messages"].as_array().unwrap() {
            text.push_str(&format!(
                "<s>{}: {}</s>",
                m["role"].as_str().unwrap(),
                m["content"].as_str().unwrap()
            ));
        }
        let want = tok.encode(&text, false, true).unwrap().len();
        assert_eq!(*len, want, "{text}");
    }
    let r = hf2q_train::dataset::stats::summarize(&lens, 12);
    assert_eq!(r.records, 3);
    assert_eq!(r.over_max_len, lens.iter().filter(|&&l| l > 12).count());
    assert_eq!(r.histogram.iter().map(|b| b.count).sum::<usize>(), 3);
}
