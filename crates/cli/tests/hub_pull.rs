//! `hf2q pull ORG/NAME[:QUANT]`, `pull --list`, `rm` and repository names as MODEL, through the
//! real binary against the mock Hub on loopback (`HF_ENDPOINT`), with the Hugging Face cache
//! in a temporary folder: a tiny GGUF repository (made by `hf2q quantize` from the committed
//! tiny checkpoint) and a tiny safetensors repository (the checkpoint itself), each pulled and
//! then run.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{fails_with, s, stderr, stdout, tiny};
use hf2q_hub::mock::{Host, MockHub};

/// `hf2q args` with its caches under `home` and the Hub at `endpoint`.
fn hf2q_env(home: &Path, endpoint: &str, extra: &[(&str, &str)], args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hf2q"))
        .args(args)
        .env("HF2Q_HOME", home.join("hf2q"))
        .env("HF_HUB_CACHE", home.join("hub"))
        .env("HF_HOME", home.join("hf-home"))
        .env("HF_ENDPOINT", endpoint)
        .env_remove("HF_TOKEN")
        .env_remove("HF_HUB_OFFLINE")
        .envs(extra.iter().copied())
        .output()
        .unwrap()
}

fn ok(o: &Output) -> String {
    assert!(o.status.success(), "failed:\n{}", stderr(o));
    stdout(o)
}

#[test]
fn pull_run_list_and_rm_hub_repositories() {
    let d = tempfile::tempdir().unwrap();
    let home = d.path();
    let hub = MockHub::start();
    let ep = hub.endpoint();
    let run = |extra: &[(&str, &str)], args: &[&str]| hf2q_env(home, &ep, extra, args);

    // The repositories: the tiny checkpoint as safetensors, and its Q8_0 GGUF.
    let q8 = home.join("tiny-Q8_0.gguf");
    ok(&run(
        &[],
        &["quantize", s(&tiny()), s(&q8), "--type", "Q8_0"],
    ));
    let gguf = std::fs::read(&q8).unwrap();
    hub.add_repo(
        "org/tiny-llama-GGUF",
        &[("tiny-llama-Q8_0.gguf", &gguf), ("README.md", b"# tiny")],
    );
    let mut files = Vec::new();
    for e in std::fs::read_dir(tiny()).unwrap().flatten() {
        files.push((
            e.file_name().to_string_lossy().into_owned(),
            std::fs::read(e.path()).unwrap(),
        ));
    }
    let refs: Vec<(&str, &[u8])> = files
        .iter()
        .map(|(n, b)| (n.as_str(), b.as_slice()))
        .collect();
    hub.add_repo("org/tiny-llama", &refs);

    // pull ORG/NAME:QUANT prints the GGUF file in the shared cache's snapshot.
    let out = ok(&run(&[], &["pull", "org/tiny-llama-GGUF:q8_0"]));
    let path = out.trim();
    assert!(
        path.contains("models--org--tiny-llama-GGUF/snapshots/")
            && path.ends_with("tiny-llama-Q8_0.gguf"),
        "{out}"
    );
    assert_eq!(std::fs::read(path).unwrap(), gguf);
    // --json
    let v: serde_json::Value = serde_json::from_str(&ok(&run(
        &[],
        &["pull", "org/tiny-llama-GGUF:Q8_0", "--json"],
    )))
    .unwrap();
    assert_eq!(v["files"], serde_json::json!(["tiny-llama-Q8_0.gguf"]));
    assert_eq!(v["downloaded"], serde_json::json!([]));

    // run the pulled GGUF, offline (from the cache only).
    let o = run(
        &[("HF_HUB_OFFLINE", "1")],
        &[
            "run",
            "org/tiny-llama-GGUF:Q8_0",
            "-p",
            "hi",
            "-n",
            "4",
            "--device",
            "cpu",
        ],
    );
    ok(&o);

    // run a safetensors repository never pulled: pulled on use, then run.
    hub.clear_requests();
    let o = run(
        &[],
        &[
            "run",
            "org/tiny-llama",
            "-p",
            "hi",
            "-n",
            "4",
            "--device",
            "cpu",
        ],
    );
    ok(&o);
    assert!(
        stderr(&o).contains("not in the cache yet: pulling it"),
        "{}",
        stderr(&o)
    );
    assert!(
        hub.requests().iter().any(|r| r.host == Host::Cdn),
        "the weights came from the CDN host"
    );
    assert!(home.join("hub/models--org--tiny-llama/refs/main").is_file());
    // Used again: from the cache, no request.
    hub.clear_requests();
    ok(&run(&[], &["inspect", "org/tiny-llama"]));
    assert!(hub.requests().is_empty(), "{:?}", hub.requests());

    // pull --list shows both with sizes and revisions; --json too.
    let list = ok(&run(&[], &["pull", "--list"]));
    assert!(
        list.contains("org/tiny-llama-GGUF")
            && list.contains("org/tiny-llama ")
            && list.contains("main ("),
        "{list}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&ok(&run(&[], &["pull", "--list", "--json"]))).unwrap();
    let repos = v["repos"].as_array().unwrap();
    assert_eq!(repos.len(), 2, "{v}");
    assert_eq!(repos[1]["repo"], "org/tiny-llama-GGUF");
    assert_eq!(repos[1]["size"].as_u64().unwrap(), gguf.len() as u64);
    assert_eq!(
        repos[1]["revisions"][0]["refs"],
        serde_json::json!(["main"])
    );

    // rm: the entry goes, the other stays; a second rm says it is not there.
    let o = run(&[], &["rm", "org/tiny-llama-GGUF"]);
    ok(&o);
    assert!(
        stderr(&o).contains("removed org/tiny-llama-GGUF"),
        "{}",
        stderr(&o)
    );
    assert!(!home.join("hub/models--org--tiny-llama-GGUF").exists());
    assert!(home.join("hub/models--org--tiny-llama").exists());
    fails_with(
        &run(&[], &["rm", "org/tiny-llama-GGUF"]),
        "is not in the cache",
    );
    let v: serde_json::Value =
        serde_json::from_str(&ok(&run(&[], &["rm", "org/tiny-llama@main", "--json"]))).unwrap();
    assert_eq!(v["removed"], true);
    assert!(v["bytes"].as_u64().unwrap() > 0);

    // Offline, a repository not in the cache is named; refusals say what to do.
    fails_with(
        &run(&[], &["pull", "org/tiny-llama-GGUF", "--offline"]),
        "org/tiny-llama-GGUF is not in the cache",
    );
    fails_with(
        &run(
            &[("HF_HUB_OFFLINE", "1")],
            &["run", "org/tiny-llama", "-p", "hi"],
        ),
        "offline",
    );
    fails_with(&run(&[], &["pull", "org/missing"]), "check the name");
    fails_with(
        &run(&[], &["pull", "org/tiny-llama", "--revision", "nope"]),
        "revision 'nope' not found",
    );
    hub.gate("org/tiny-llama", &["tok"]);
    fails_with(&run(&[], &["pull", "org/tiny-llama"]), "accept its licence");
    ok(&run(&[], &["pull", "org/tiny-llama", "--hf-token", "tok"]));
    assert!(!hub.cdn_saw_authorization());
    // The token file (HF_HOME/token) is used when nothing else is given; HF_TOKEN comes
    // before it, --hf-token before both.
    std::fs::create_dir_all(home.join("hf-home")).unwrap();
    std::fs::write(home.join("hf-home/token"), "tok\n").unwrap();
    ok(&run(&[], &["pull", "org/tiny-llama", "--json"]));
    fails_with(
        &run(
            &[("HF_TOKEN", "bad")],
            &[
                "pull",
                "org/tiny-llama@main",
                "--include",
                "*.md",
                "--include",
                "config.json",
            ],
        ),
        "no access",
    );
    ok(&run(
        &[("HF_TOKEN", "bad")],
        &["pull", "org/tiny-llama", "--hf-token", "tok"],
    ));
    assert!(!hub.cdn_saw_authorization());
    fails_with(
        &run(&[], &["pull", "org/bad name"]),
        "is not a repository name",
    );
}

#[test]
fn help_explains_the_hub_forms() {
    let o = common::hf2q(&["pull", "--help"]);
    let h = stdout(&o);
    for want in [
        "ORG/NAME[:QUANT]",
        "--revision",
        "--include",
        "--exclude",
        "--offline",
        "--hf-token",
        "HF_ENDPOINT",
        "HF_HUB_CACHE",
        "--list",
    ] {
        assert!(h.contains(want), "pull --help lacks {want}:\n{h}");
    }
    let h = stdout(&common::hf2q(&["rm", "--help"]));
    assert!(h.contains("ORG/NAME@REV") && h.contains("blobs"), "{h}");
    let h = stdout(&common::hf2q(&["run", "--help"]));
    assert!(h.contains("ORG/NAME[:QUANT][@REVISION]"), "{h}");
}

/// A model that Python's `huggingface_hub` downloaded from the mock (into the same cache) runs
/// offline by its repository name; when `HF2Q_TEST_HUB_PYTHON` names a python with
/// `huggingface_hub`, else "skipped".
#[test]
fn a_model_huggingface_hub_downloaded_runs_offline() {
    let py = match std::env::var("HF2Q_TEST_HUB_PYTHON") {
        Ok(p) if !p.is_empty() => p,
        _ => {
            eprintln!("a_model_huggingface_hub_downloaded_runs_offline: skipped (HF2Q_TEST_HUB_PYTHON is not set)");
            return;
        }
    };
    let d = tempfile::tempdir().unwrap();
    let home = d.path();
    let hub = MockHub::start();
    let ep = hub.endpoint();
    let q8 = home.join("tiny-Q8_0.gguf");
    ok(&hf2q_env(
        home,
        &ep,
        &[],
        &["quantize", s(&tiny()), s(&q8), "--type", "Q8_0"],
    ));
    hub.add_repo(
        "org/py-GGUF",
        &[("tiny-Q8_0.gguf", &std::fs::read(&q8).unwrap())],
    );
    let o = Command::new(&py)
        .args([
            "-c",
            "import sys\nfrom huggingface_hub import hf_hub_download\n\
             print(hf_hub_download('org/py-GGUF', 'tiny-Q8_0.gguf', cache_dir=sys.argv[1]))",
            s(&home.join("hub")),
        ])
        .env("HF_ENDPOINT", &ep)
        .env("HF_HOME", home.join("hf-home"))
        .env("HF_HUB_DISABLE_TELEMETRY", "1")
        .env("HF_HUB_DISABLE_XET", "1")
        .env_remove("HF_TOKEN")
        .env_remove("HF_HUB_OFFLINE")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let o = hf2q_env(
        home,
        "http://127.0.0.1:9",
        &[("HF_HUB_OFFLINE", "1")],
        &[
            "run",
            "org/py-GGUF:Q8_0",
            "-p",
            "hi",
            "-n",
            "4",
            "--device",
            "cpu",
        ],
    );
    ok(&o);
}

/// pull -> push -> pull of a quantized model round-trips byte for byte through the binary, the
/// card states the base model and the type, the pushed copy runs by its name, and a push
/// without a token is refused saying how to give one.
#[test]
fn pull_push_pull_round_trips_a_quantized_model() {
    let d = tempfile::tempdir().unwrap();
    let home = d.path();
    let hub = MockHub::start();
    let ep = hub.endpoint();
    let run = |extra: &[(&str, &str)], args: &[&str]| hf2q_env(home, &ep, extra, args);

    let q8 = home.join("tiny-Q8_0.gguf");
    ok(&run(
        &[],
        &["quantize", s(&tiny()), s(&q8), "--type", "Q8_0"],
    ));
    let gguf = std::fs::read(&q8).unwrap();
    hub.add_repo("org/tiny-llama-GGUF", &[("tiny-llama-Q8_0.gguf", &gguf)]);
    let pulled = ok(&run(&[], &["pull", "org/tiny-llama-GGUF:Q8_0"]));

    // No token: refused (401) with what to do; nothing created.
    fails_with(
        &run(&[], &["push", pulled.trim(), "me/tiny-q8"]),
        "needs a token with write access",
    );
    assert!(hub.files("me/tiny-q8", "main").is_none());

    let out = ok(&run(
        &[("HF_TOKEN", "tok")],
        &["push", pulled.trim(), "me/tiny-q8", "-m", "Q8_0 of tiny"],
    ));
    let url = out.trim();
    assert!(
        url.starts_with(&format!("{ep}/me/tiny-q8/commit/")),
        "{out}"
    );
    let files = hub.files("me/tiny-q8", "main").unwrap();
    assert_eq!(files["tiny-llama-Q8_0.gguf"], gguf);
    let card = String::from_utf8(files["README.md"].clone()).unwrap();
    assert!(
        card.contains("**Q8_0**") && card.contains("- gguf"),
        "{card}"
    );
    assert!(!hub.cdn_saw_authorization());

    // Pulled back under the new name: the same bytes; it runs.
    let back = ok(&run(&[], &["pull", "me/tiny-q8:Q8_0"]));
    assert_eq!(std::fs::read(back.trim()).unwrap(), gguf);
    ok(&run(
        &[],
        &[
            "run",
            "me/tiny-q8",
            "-p",
            "hi",
            "-n",
            "3",
            "--device",
            "cpu",
        ],
    ));

    // A dataset folder to a dataset repository, --json.
    let ds = home.join("ds");
    std::fs::create_dir_all(&ds).unwrap();
    std::fs::write(ds.join("train.jsonl"), "{\"text\": \"a\"}\n").unwrap();
    let v: serde_json::Value = serde_json::from_str(&ok(&run(
        &[("HF_TOKEN", "tok")],
        &["push", s(&ds), "me/ds", "--repo-type", "dataset", "--json"],
    )))
    .unwrap();
    assert_eq!(v["repo_url"], format!("{ep}/datasets/me/ds"));
    assert_eq!(v["card_added"], true);
    assert!(hub
        .files("datasets/me/ds", "main")
        .unwrap()
        .contains_key("train.jsonl"));
}

/// A GGUF file larger than `--max-file-size` goes up as llama.cpp's gguf-split parts in one
/// commit; pulled back by `ORG/NAME:QUANT` (every part), they join to the original's metadata and
/// tensors, and the model runs by its name.
#[test]
fn push_splits_a_gguf_past_the_max_file_size() {
    use hf2q_tensor::io::gguf::GgufFile;
    let d = tempfile::tempdir().unwrap();
    let home = d.path();
    let hub = MockHub::start();
    let ep = hub.endpoint();
    let run = |extra: &[(&str, &str)], args: &[&str]| hf2q_env(home, &ep, extra, args);

    let q8 = home.join("tiny-Q8_0.gguf");
    ok(&run(
        &[],
        &["quantize", s(&tiny()), s(&q8), "--type", "Q8_0"],
    ));
    let size = std::fs::metadata(&q8).unwrap().len();
    let max = size / 3;
    let tmp = home.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let max_arg = max.to_string();
    let o = run(
        &[("HF_TOKEN", "tok"), ("TMPDIR", s(&tmp))],
        &["push", s(&q8), "me/tiny-split", "--max-file-size", &max_arg],
    );
    ok(&o);
    assert!(stderr(&o).contains("split into"), "{}", stderr(&o));
    // The temporary parts are gone.
    assert_eq!(std::fs::read_dir(&tmp).unwrap().count(), 0);

    let files = hub.files("me/tiny-split", "main").unwrap();
    let parts: Vec<&String> = files.keys().filter(|k| k.ends_with(".gguf")).collect();
    let n = parts.len();
    assert!(n >= 3, "{parts:?}");
    for (i, p) in parts.iter().enumerate() {
        assert_eq!(**p, format!("tiny-Q8_0-{:05}-of-{n:05}.gguf", i + 1));
        assert!(files[*p].len() as u64 <= max, "{p}: {}", files[*p].len());
    }
    let card = String::from_utf8(files["README.md"].clone()).unwrap();
    assert!(card.contains("**Q8_0**"), "{card}");

    let first = ok(&run(&[], &["pull", "me/tiny-split:Q8_0"]));
    let first = Path::new(first.trim());
    assert!(first
        .to_string_lossy()
        .ends_with(&format!("-00001-of-{n:05}.gguf")));
    let joined = GgufFile::open_joined(first).unwrap();
    let orig = GgufFile::open(&q8).unwrap();
    assert_eq!(joined.metadata, orig.metadata);
    assert_eq!(joined.tensors.len(), orig.tensors.len());
    for (a, b) in joined.tensors.iter().zip(&orig.tensors) {
        assert_eq!((&a.name, &a.dims, a.ty), (&b.name, &b.dims, b.ty));
        assert_eq!(
            joined.tensor_data(a).unwrap().as_slice(),
            orig.tensor_data(b).unwrap().as_slice(),
            "{}",
            a.name
        );
    }
    ok(&run(
        &[],
        &[
            "run",
            "me/tiny-split",
            "-p",
            "hi",
            "-n",
            "3",
            "--device",
            "cpu",
        ],
    ));

    // A bad size is refused naming it.
    fails_with(
        &run(&[], &["push", s(&q8), "me/x", "--max-file-size", "20X"]),
        "unknown unit 'X'",
    );
}

/// `dataset build ORG/NAME[:SPLIT]` reads a Hub dataset's split (its JSONL and CSV files) through
/// the shared cache (`datasets--ORG--NAME`); an unknown split names the files there are, and a
/// `.parquet` file that is not Parquet is refused by name.
#[test]
fn dataset_build_reads_a_hub_dataset_split() {
    let d = tempfile::tempdir().unwrap();
    let home = d.path();
    let hub = MockHub::start();
    let ep = hub.endpoint();
    let run = |args: &[&str]| hf2q_env(home, &ep, &[], args);
    let train: String = (0..20)
        .map(|i| format!("{{\"text\": \"train record {i}\"}}\n"))
        .collect();
    let csv = "text\ncsv one\ncsv two\ncsv three\n";
    hub.add_repo(
        "datasets/org/notes",
        &[
            ("README.md", b"# notes"),
            ("data/train-00000-of-00001.jsonl", train.as_bytes()),
            ("data/test.csv", csv.as_bytes()),
        ],
    );
    hub.add_repo(
        "datasets/org/pq",
        &[("data/train-00000-of-00001.parquet", b"PAR1")],
    );

    let out = home.join("out");
    let v: serde_json::Value = serde_json::from_str(&ok(&run(&[
        "dataset",
        "build",
        "org/notes",
        "-o",
        s(&out),
        "--json",
    ])))
    .unwrap();
    assert_eq!(v["rows"], 20, "{v}");
    assert_eq!(
        v["train"].as_u64().unwrap() + v["valid"].as_u64().unwrap(),
        20
    );
    assert!(home.join("hub/datasets--org--notes/refs/main").is_file());

    let v: serde_json::Value = serde_json::from_str(&ok(&run(&[
        "dataset",
        "build",
        "org/notes:test",
        "-o",
        s(&home.join("out2")),
        "--json",
    ])))
    .unwrap();
    assert_eq!(v["rows"], 3, "{v}");

    fails_with(
        &run(&[
            "dataset",
            "build",
            "org/notes:extra",
            "-o",
            s(&home.join("o3")),
        ]),
        "data/test.csv",
    );
    fails_with(
        &run(&["dataset", "build", "org/pq", "-o", s(&home.join("o4"))]),
        "not a readable Parquet file",
    );
}

/// Chat records as Parquet, the way the Hub's datasets hold them: a `messages` column of
/// `list<struct<role, content>>` (three-level LIST, as pyarrow writes it), an `id` INT64 column
/// and an optional string column, Snappy-compressed; and the same records as JSONL.
fn chat_records(n: usize) -> (Vec<u8>, String) {
    use parquet::basic::Compression;
    use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use std::sync::Arc;

    let schema = parquet::schema::parser::parse_message_type(
        "message schema {
          OPTIONAL group messages (LIST) {
            REPEATED group list {
              OPTIONAL group element {
                OPTIONAL BYTE_ARRAY role (UTF8);
                OPTIONAL BYTE_ARRAY content (UTF8);
              }
            }
          }
          REQUIRED INT64 id;
          OPTIONAL BYTE_ARRAY source (UTF8);
        }",
    )
    .unwrap();
    let turns = |i: usize| {
        [
            ("user", format!("question {i}: what is {i} + {i}?")),
            ("assistant", format!("{i} + {i} = {}", 2 * i)),
        ]
    };
    let props = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .build();
    let mut buf = Vec::new();
    let mut w = SerializedFileWriter::new(&mut buf, Arc::new(schema), Arc::new(props)).unwrap();
    let mut rg = w.next_row_group().unwrap();
    // The two leaves of the list: every row has two turns (repetition 0 then 1; definition 4 =
    // list, element and value all present).
    for leaf in 0..2 {
        let mut col = rg.next_column().unwrap().unwrap();
        let values: Vec<ByteArray> = (0..n)
            .flat_map(|i| turns(i).map(|t| if leaf == 0 { t.0.to_string() } else { t.1 }))
            .map(|s| ByteArray::from(s.as_str()))
            .collect();
        let defs = vec![4i16; 2 * n];
        let reps: Vec<i16> = (0..2 * n).map(|k| (k % 2) as i16).collect();
        col.typed::<ByteArrayType>()
            .write_batch(&values, Some(&defs), Some(&reps))
            .unwrap();
        col.close().unwrap();
    }
    let mut col = rg.next_column().unwrap().unwrap();
    let ids: Vec<i64> = (0..n as i64).collect();
    col.typed::<Int64Type>()
        .write_batch(&ids, None, None)
        .unwrap();
    col.close().unwrap();
    // `source`: null in odd rows.
    let mut col = rg.next_column().unwrap().unwrap();
    let present: Vec<ByteArray> = (0..n).step_by(2).map(|_| ByteArray::from("web")).collect();
    let defs: Vec<i16> = (0..n).map(|i| (i % 2 == 0) as i16).collect();
    col.typed::<ByteArrayType>()
        .write_batch(&present, Some(&defs), None)
        .unwrap();
    col.close().unwrap();
    rg.close().unwrap();
    w.close().unwrap();

    let jsonl = (0..n)
        .map(|i| {
            let msgs: Vec<serde_json::Value> = turns(i)
                .iter()
                .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
                .collect();
            let source = if i % 2 == 0 {
                "web".into()
            } else {
                serde_json::Value::Null
            };
            serde_json::json!({"messages": msgs, "id": i, "source": source}).to_string() + "\n"
        })
        .collect();
    (buf, jsonl)
}

/// `dataset build ORG/NAME` of a Parquet dataset gives the same records as its JSONL twin, and
/// a dataset with only a loading script is read from its Parquet conversion
/// (`refs/convert/parquet`, `CONFIG/SPLIT/NNNN.parquet`).
#[test]
fn dataset_build_reads_parquet_and_the_parquet_conversion() {
    let d = tempfile::tempdir().unwrap();
    let home = d.path();
    let hub = MockHub::start();
    let ep = hub.endpoint();
    let run = |args: &[&str]| hf2q_env(home, &ep, &[], args);
    let (pq, jsonl) = chat_records(40);
    assert!(pq.len() < 100_000 && pq.starts_with(b"PAR1"));
    hub.add_repo(
        "datasets/org/chat-pq",
        &[("data/train-00000-of-00001.parquet", &pq)],
    );
    hub.add_repo(
        "datasets/org/chat-jsonl",
        &[("train.jsonl", jsonl.as_bytes())],
    );
    hub.add_repo(
        "datasets/org/scripted",
        &[
            ("scripted.py", b"# a loading script"),
            ("README.md", b"# s"),
        ],
    );
    hub.add_snapshot(
        "datasets/org/scripted",
        "refs/convert/parquet",
        &[("default/train/0000.parquet", &pq)],
    );
    let build = |name: &str| -> (serde_json::Value, String, String) {
        let out = home.join(format!("out-{}", name.replace('/', "-")));
        let v = serde_json::from_str(&ok(&run(&[
            "dataset",
            "build",
            name,
            "-o",
            s(&out),
            "--seed",
            "7",
            "--json",
        ])))
        .unwrap();
        let read = |f: &str| std::fs::read_to_string(out.join(f)).unwrap();
        (v, read("train.jsonl"), read("valid.jsonl"))
    };
    let (vp, train_p, valid_p) = build("org/chat-pq");
    let (vj, train_j, valid_j) = build("org/chat-jsonl");
    assert_eq!(vp["rows"], 40, "{vp}");
    assert_eq!(vp["inputs"][0]["format"], "parquet", "{vp}");
    assert_eq!(
        (vp["train"].clone(), vp["valid"].clone()),
        (vj["train"].clone(), vj["valid"].clone())
    );
    assert_eq!(train_p, train_j);
    assert_eq!(valid_p, valid_j);
    assert!(train_p.contains("\"assistant\""), "{train_p}");

    let (vs, train_s, _) = build("org/scripted");
    assert_eq!(vs["rows"], 40, "{vs}");
    assert_eq!(train_s, train_p);
    assert!(home
        .join("hub/datasets--org--scripted/refs/refs/convert/parquet")
        .is_file());
}
