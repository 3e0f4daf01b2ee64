//! `hf2q dataset generate` against a real `hf2q serve` on loopback (SmolLM2-135M-Instruct,
//! `HF2Q_TEST_SMOLLM2_GGUF`; skipped when unset): every template makes 2 records with short
//! replies into a dataset folder as `dataset build` writes one (shapes, report counts, the
//! NDJSON events), the same seed gives the same files, a wrong key and a signal are handled,
//! and a Lab `dataset_generate` job builds a dataset the Lab lists. Bad arguments (no model
//! needed) are clear errors.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{fails_with, s, serve, smollm2, stderr, Served};
use serde_json::{json, Value};

const KEY: &str = "gen-test-key";

/// Records per template: enough for a split, few enough for CI's 2 cores.
const COUNT: &str = "2";
/// Reply length: short replies keep each call well under a second on the CPU.
const MAX_TOKENS: &str = "24";

fn generate(home: &Path, key: Option<&str>, args: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_hf2q"));
    c.env("HF2Q_HOME", home).env_remove("HF2Q_API_KEY");
    if let Some(k) = key {
        c.env("HF2Q_API_KEY", k);
    }
    c.args(["dataset", "generate"]).args(args).output().unwrap()
}

fn lines(text: &str) -> Vec<Value> {
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

fn records(dir: &Path) -> Vec<Value> {
    ["train.jsonl", "valid.jsonl"]
        .iter()
        .flat_map(|f| lines(&std::fs::read_to_string(dir.join(f)).unwrap()))
        .collect()
}

fn roles(msgs: &Value) -> Vec<String> {
    msgs.as_array()
        .unwrap()
        .iter()
        .map(|m| {
            assert!(
                m["content"].as_str().is_some_and(|c| !c.trim().is_empty()),
                "{m}"
            );
            m["role"].as_str().unwrap().to_string()
        })
        .collect()
}

/// The data files the templates read.
fn inputs(dir: &Path) -> PathBuf {
    let data = dir.join("data");
    std::fs::create_dir_all(data.join("docs")).unwrap();
    std::fs::write(
        data.join("seeds.txt"),
        "Write a haiku about the sea.\nName three animals that live in the desert.\nExplain what a verb is.\nGive a synonym for happy.\n",
    )
    .unwrap();
    std::fs::write(
        data.join("docs/bees.md"),
        "# Bees\n\nHoney bees live in hives of up to sixty thousand workers. They make honey from the nectar of flowers.\n",
    )
    .unwrap();
    std::fs::write(
        data.join("docs/moon.txt"),
        "The Moon orbits the Earth once every 27 days. Its light is sunlight reflected from its surface.\n",
    )
    .unwrap();
    // The "answer in uppercase" set's shape: Alpaca records whose answers get rewritten.
    std::fs::write(
        data.join("answers.jsonl"),
        "{\"instruction\": \"What colour is the sky?\", \"input\": \"\", \"output\": \"The sky is blue.\"}\n{\"instruction\": \"Name a fruit.\", \"input\": \"\", \"output\": \"An apple.\"}\n",
    )
    .unwrap();
    std::fs::write(data.join("topics.txt"), "baking bread\nlearning to swim\n").unwrap();
    std::fs::write(
        data.join("prompts.txt"),
        "Say hello.\nWhat is two plus two?\n",
    )
    .unwrap();
    data
}

#[test]
fn bad_arguments_are_clear_errors() {
    let d = tempfile::tempdir().unwrap();
    let data = inputs(d.path());
    let out = d.path().join("out");
    let o = s(&out);
    let seeds = data.join("seeds.txt");
    let dead = "http://127.0.0.1:1/v1";
    fails_with(
        &generate(d.path(), None, &["poems", "-o", o, "--api", dead]),
        "invalid value 'poems'",
    );
    fails_with(
        &generate(d.path(), None, &["self-instruct", "-o", o, "--api", dead]),
        "the self-instruct template needs --seeds FILE",
    );
    fails_with(
        &generate(
            d.path(),
            None,
            &[
                "qa",
                "-o",
                o,
                "--api",
                dead,
                "--source",
                s(&data),
                "--seeds",
                s(&seeds),
            ],
        ),
        "--seeds is for the self-instruct template, not qa",
    );
    fails_with(
        &generate(
            d.path(),
            None,
            &[
                "rephrase",
                "-o",
                o,
                "--api",
                dead,
                "--inputs",
                s(&data.join("answers.jsonl")),
            ],
        ),
        "needs --style",
    );
    fails_with(
        &generate(
            d.path(),
            None,
            &[
                "self-instruct",
                "-o",
                o,
                "--api",
                dead,
                "--seeds",
                s(&data.join("none.txt")),
            ],
        ),
        "none.txt",
    );
    fails_with(
        &generate(
            d.path(),
            None,
            &[
                "classify",
                "-o",
                o,
                "--api",
                "https://127.0.0.1:1/v1",
                "--labels",
                "a,b",
            ],
        ),
        "no TLS",
    );
    fails_with(
        &generate(
            d.path(),
            None,
            &[
                "dpo-pairs",
                "-o",
                o,
                "--api",
                dead,
                "--prompts",
                s(&data.join("prompts.txt")),
            ],
        ),
        "two different settings",
    );
    // Nothing listens on port 1: the first call fails the run, naming the address.
    fails_with(
        &generate(
            d.path(),
            None,
            &["classify", "-o", o, "--api", dead, "--labels", "a,b"],
        ),
        "cannot reach the API at http://127.0.0.1:1/v1/chat/completions",
    );
    assert!(!out.exists());
}

/// One template's run: succeeds, prints start/progress, one `record` event per generated
/// record and the report last; the folder holds the records and the same report.
fn run_template(
    home: &Path,
    url: &str,
    out: &Path,
    template: &str,
    args: &[&str],
    seed: &str,
) -> Value {
    let mut a = vec![
        template,
        "-o",
        s(out),
        "--api",
        url,
        "--count",
        COUNT,
        "--max-tokens",
        MAX_TOKENS,
        "--valid-split",
        "0.5",
        "--seed",
        seed,
        "--json",
    ];
    a.extend_from_slice(args);
    let o = generate(home, Some(KEY), &a);
    assert!(o.status.success(), "{template}: {}", stderr(&o));
    let ev = lines(&String::from_utf8_lossy(&o.stdout));
    let result = ev.last().unwrap().clone();
    assert_eq!(result["event"], "result", "{template}: {result}");
    assert_eq!(ev[0]["event"], "start");
    assert!(ev.iter().any(|e| e["event"] == "finish"));
    let recs: Vec<&Value> = ev.iter().filter(|e| e["event"] == "record").collect();
    let generated = result["generated"].as_u64().unwrap() as usize;
    assert_eq!(recs.len(), generated, "{template}");
    for (i, r) in recs.iter().enumerate() {
        assert_eq!(r["index"], i);
    }
    // Each attempt is a record or a skip; each record is kept or a duplicate.
    assert_eq!(result["template"], template);
    assert_eq!(result["attempts"], 2);
    assert!(generated >= 1, "{template}: nothing generated: {result}");
    assert_eq!(
        generated as u64 + result["skipped"].as_u64().unwrap(),
        2,
        "{template}: {result}"
    );
    let kept = result["train"].as_u64().unwrap() + result["valid"].as_u64().unwrap();
    assert_eq!(
        kept + result["exact_duplicates"].as_u64().unwrap(),
        generated as u64
    );
    let on_disk: Value =
        serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
    let mut r = result.clone();
    r.as_object_mut().unwrap().remove("event");
    r.as_object_mut().unwrap().remove("output");
    assert_eq!(on_disk, r);
    let recs = records(out);
    assert_eq!(recs.len() as u64, kept);
    // The previewed records are the written ones (a split is a shuffle of them).
    for rec in &recs {
        assert!(ev
            .iter()
            .any(|e| e["event"] == "record" && &e["record"] == rec));
    }
    result
}

#[test]
fn every_template_writes_a_dataset_through_a_served_model() {
    let Some(gguf) = smollm2("every_template_writes_a_dataset_through_a_served_model") else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let data = inputs(d.path());
    let srv = serve(
        d.path(),
        &[
            s(&gguf),
            "--api-key",
            KEY,
            "-c",
            "1024",
            "--kv-mem",
            "256M",
            "--no-lab",
        ],
    );
    let url = format!("http://{}/v1", srv.addr);
    let home = d.path();
    let out = |n: &str| d.path().join("out").join(n);
    let f = |n: &str| data.join(n).to_string_lossy().to_string();

    let r = run_template(
        home,
        &url,
        &out("si"),
        "self-instruct",
        &["--seeds", &f("seeds.txt")],
        "1",
    );
    assert_eq!(r["format"], "messages");
    for rec in records(&out("si")) {
        assert_eq!(roles(&rec["messages"]), ["user", "assistant"]);
    }

    run_template(home, &url, &out("qa"), "qa", &["--source", &f("docs")], "1");
    for rec in records(&out("qa")) {
        assert_eq!(roles(&rec["messages"]), ["user", "assistant"]);
    }

    let r = run_template(
        home,
        &url,
        &out("upper"),
        "rephrase",
        &[
            "--inputs",
            &f("answers.jsonl"),
            "--style",
            "answer in uppercase",
        ],
        "1",
    );
    assert_eq!(r["format"], "alpaca", "the inputs' own format");
    let questions = ["What colour is the sky?", "Name a fruit."];
    for rec in records(&out("upper")) {
        assert!(
            questions.contains(&rec["instruction"].as_str().unwrap()),
            "{rec}"
        );
        assert!(!rec["output"].as_str().unwrap().trim().is_empty());
    }

    let labels = ["positive", "negative"];
    run_template(
        home,
        &url,
        &out("cls"),
        "classify",
        &[
            "--labels",
            "positive,negative",
            "--about",
            "product reviews",
        ],
        "1",
    );
    for rec in records(&out("cls")) {
        assert_eq!(roles(&rec["messages"]), ["user", "assistant"]);
        assert!(labels.contains(&rec["messages"][1]["content"].as_str().unwrap()));
        assert!(rec["messages"][0]["content"]
            .as_str()
            .unwrap()
            .starts_with("Classify the text into one of these categories: positive, negative."));
    }

    run_template(
        home,
        &url,
        &out("chats"),
        "chats",
        &["--topics", &f("topics.txt"), "--turns", "2"],
        "1",
    );
    for rec in records(&out("chats")) {
        assert_eq!(
            roles(&rec["messages"]),
            ["user", "assistant", "user", "assistant"]
        );
    }

    let r = run_template(
        home,
        &url,
        &out("dpo"),
        "dpo-pairs",
        &[
            "--prompts",
            &f("prompts.txt"),
            "--chosen-temperature",
            "0",
            "--rejected-temperature",
            "1.2",
        ],
        "1",
    );
    assert_eq!(r["format"], "dpo");
    for rec in records(&out("dpo")) {
        assert_eq!(roles(&rec["prompt"]), ["user"]);
        assert_eq!(roles(&rec["chosen"]), ["assistant"]);
        assert_eq!(roles(&rec["rejected"]), ["assistant"]);
        assert_ne!(rec["chosen"], rec["rejected"]);
    }

    // The same seed, the same dataset: the calls carry seeds the server honours and the
    // split is seeded.
    run_template(
        home,
        &url,
        &out("cls2"),
        "classify",
        &[
            "--labels",
            "positive,negative",
            "--about",
            "product reviews",
        ],
        "1",
    );
    for file in ["train.jsonl", "valid.jsonl", "report.json"] {
        assert_eq!(
            std::fs::read_to_string(out("cls").join(file)).unwrap(),
            std::fs::read_to_string(out("cls2").join(file)).unwrap(),
            "{file}"
        );
    }
    // Never over an existing dataset.
    fails_with(
        &generate(
            home,
            Some(KEY),
            &[
                "classify",
                "-o",
                s(&out("cls")),
                "--api",
                &url,
                "--labels",
                "a,b",
            ],
        ),
        "not empty",
    );

    // A wrong key is the server's 401, named.
    fails_with(
        &generate(
            home,
            Some("wrong"),
            &[
                "classify",
                "-o",
                s(&out("nokey")),
                "--api",
                &url,
                "--labels",
                "a,b",
            ],
        ),
        "HTTP 401",
    );
    assert!(!out("nokey").exists());

    stopped_by_sigterm(home, &url, &out("stopped"), &data);
    drop(srv);
}

/// SIGTERM after the first record: the run ends, saying so, and writes nothing (not at the
/// output name, not at a temporary one).
fn stopped_by_sigterm(home: &Path, url: &str, out: &Path, data: &Path) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_hf2q"))
        .env("HF2Q_HOME", home)
        .env("HF2Q_API_KEY", KEY)
        .args(["dataset", "generate", "chats", "-o", s(out), "--api", url])
        .args(["--topics", s(&data.join("topics.txt")), "--count", "50"])
        .args(["--max-tokens", "64", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    for l in BufReader::new(child.stdout.take().unwrap()).lines() {
        let l = l.unwrap();
        if l.contains("\"event\":\"record\"") {
            first = l;
            break;
        }
    }
    assert!(!first.is_empty(), "no record before the end of stdout");
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let o = child.wait_with_output().unwrap();
    fails_with(&o, "nothing was written");
    assert!(!out.exists());
    let parent = out.parent().unwrap();
    let left: Vec<String> = std::fs::read_dir(parent)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.contains("stopped"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

fn call(srv: &Served, method: &str, path: &str, body: Option<Value>) -> (u16, String) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .build()
        .into();
    let url = format!("http://{}{path}", srv.addr);
    let auth = format!("Bearer {KEY}");
    let mut resp = match body {
        Some(b) => agent
            .post(&url)
            .header("Authorization", &auth)
            .header("Content-Type", "application/json")
            .send(b.to_string().as_str()),
        None => {
            assert_eq!(method, "GET");
            agent.get(&url).header("Authorization", &auth).call()
        }
    }
    .unwrap();
    let st = resp.status().as_u16();
    (st, resp.body_mut().read_to_string().unwrap())
}

#[test]
fn a_lab_job_generates_a_dataset_that_the_lab_lists() {
    let Some(gguf) = smollm2("a_lab_job_generates_a_dataset_that_the_lab_lists") else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let home = d.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    let srv = serve(
        &home,
        &[s(&gguf), "--api-key", KEY, "-c", "1024", "--kv-mem", "256M"],
    );
    let params = json!({"template": "classify", "labels": "positive,negative",
        "about": "product reviews", "count": 2, "max_tokens": 16, "valid_split": 0.5,
        "output": "reviews"});
    let (st, body) = call(
        &srv,
        "POST",
        "/api/jobs",
        Some(json!({"kind": "dataset_generate", "params": params})),
    );
    assert_eq!(st, 201, "{body}");
    let id = serde_json::from_str::<Value>(&body).unwrap()["id"]
        .as_i64()
        .unwrap();
    let t0 = Instant::now();
    let job = loop {
        let (_, b) = call(&srv, "GET", &format!("/api/jobs/{id}"), None);
        let j: Value = serde_json::from_str(&b).unwrap();
        if !matches!(j["state"].as_str(), Some("queued" | "running")) {
            break j;
        }
        assert!(t0.elapsed() < Duration::from_secs(300), "job stuck: {j}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(job["state"], "succeeded", "{job}");
    assert_eq!(job["outputs"], json!(["datasets/reviews"]));
    let (_, b) = call(&srv, "GET", "/api/datasets", None);
    let list: Value = serde_json::from_str(&b).unwrap();
    let ds = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["name"] == "reviews")
        .unwrap_or_else(|| panic!("not listed: {list}"));
    assert_eq!(ds["format"], "messages");
    let report: Value =
        serde_json::from_slice(&std::fs::read(home.join("datasets/reviews/report.json")).unwrap())
            .unwrap();
    assert_eq!(report["template"], "classify");
    assert_eq!(
        ds["train"].as_u64().unwrap() + ds["valid"].as_u64().unwrap(),
        report["train"].as_u64().unwrap() + report["valid"].as_u64().unwrap()
    );
    // The child reached the server with its key from the environment, not the argv; its
    // record events are in the job's log for a live preview.
    let (st, sse) = call(&srv, "GET", &format!("/api/jobs/{id}/events"), None);
    assert_eq!(st, 200);
    assert!(!sse.contains(KEY), "the key leaked into the job's log");
    assert!(sse.contains("\"--api\""), "{sse}");
    assert!(
        sse.contains("\"event\":\"record\""),
        "no record events in the log: {sse}"
    );
}
