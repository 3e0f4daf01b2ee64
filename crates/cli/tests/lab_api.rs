//! The Lab's HTTP API as a client drives it: a real `hf2q serve` on loopback (the committed tiny
//! Llama as the served model and as the jobs' model, `$HF2Q_HOME` in a temporary folder) and
//! real child `hf2q` jobs. Proves: every `/api` route refuses a missing or wrong key,
//! cross-origin and non-JSON state changes, and paths leaving the home (`..`, absolute,
//! symbolic links out); a quantize job's output is listed with its inspect data; SSE replays
//! from `Last-Event-ID` without losing an event and follows a live job; a server killed with
//! SIGKILL during a training job comes back with the job `interrupted`, and the resumed job
//! ends with the same adapter bytes as an unbroken run.

mod common;

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use common::lab::{copy_dir, Server, KEY};

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/tiny/tiny-llama")
}

fn chats(path: &Path, n: usize) {
    let mut s = String::new();
    for i in 0..n {
        s.push_str(
            &json!({"messages": [
                {"role": "user", "content": format!("say {i}")},
                {"role": "assistant", "content": format!("OK {i}!")},
            ]})
            .to_string(),
        );
        s.push('\n');
    }
    std::fs::write(path, s).unwrap();
}

fn home() -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let h = d.path().join("home");
    copy_dir(&tiny(), &h.join("models/tiny-llama"));
    std::fs::create_dir_all(h.join("data")).unwrap();
    chats(&h.join("data/chats.jsonl"), 16);
    std::fs::write(
        h.join("data/wiki.txt"),
        "The quick brown fox jumps over the lazy dog. ".repeat(40),
    )
    .unwrap();
    (d, h)
}

#[test]
fn every_api_route_refuses_bad_keys_cross_origin_and_paths_out_of_home() {
    let (d, h) = home();
    let outside = d.path().join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("secret.txt"), "secret").unwrap();
    std::os::unix::fs::symlink(&outside, h.join("data/out")).unwrap();
    std::os::unix::fs::symlink(&outside, h.join("models/out")).unwrap();
    std::fs::create_dir_all(h.join("datasets")).unwrap();
    std::os::unix::fs::symlink(&outside, h.join("datasets/out")).unwrap();
    let s = Server::start(&h);
    let job = s.submit(
        "perplexity",
        json!({"model": "models/tiny-llama", "file": "data/wiki.txt", "ctx": 32, "chunks": 1}),
    );
    let routes: &[(&str, String)] = &[
        ("GET", "/api/jobs".into()),
        ("POST", "/api/jobs".into()),
        ("GET", format!("/api/jobs/{job}")),
        ("DELETE", format!("/api/jobs/{job}")),
        ("POST", format!("/api/jobs/{job}/cancel")),
        ("POST", format!("/api/jobs/{job}/resume")),
        ("GET", format!("/api/jobs/{job}/events")),
        ("GET", "/api/models".into()),
        ("POST", "/api/models/pull".into()),
        ("DELETE", "/api/models/tiny-llama".into()),
        ("GET", "/api/datasets".into()),
        ("POST", "/api/datasets".into()),
        ("GET", "/api/datasets/qa/preview".into()),
        ("GET", "/api/datasets/qa/stats".into()),
        ("DELETE", "/api/datasets/qa".into()),
        ("GET", "/api/files".into()),
        ("POST", "/api/files".into()),
        ("DELETE", "/api/files/data/wiki.txt".into()),
    ];
    let body = r#"{"kind":"perplexity","params":{}}"#;
    for (m, p) in routes {
        for auth in [None, Some("Bearer wrong")] {
            let mut hs = vec![("Content-Type", "application/json")];
            if let Some(a) = auth {
                hs.push(("Authorization", a));
            }
            let (st, _, text) = s.raw(m, p, &hs, Some(body));
            assert_eq!(st, 401, "{m} {p} with {auth:?}: {text}");
            assert_eq!(
                serde_json::from_str::<Value>(&text).unwrap()["error"]["code"],
                "invalid_api_key"
            );
        }
        if *m != "GET" {
            let auth = format!("Bearer {KEY}");
            let (st, _, text) = s.raw(
                m,
                p,
                &[
                    ("Authorization", &auth),
                    ("Content-Type", "application/json"),
                    ("Origin", "http://evil.example"),
                ],
                Some(body),
            );
            assert_eq!(st, 403, "cross-origin {m} {p}: {text}");
            let (st, _, text) = s.raw(
                m,
                p,
                &[("Authorization", &auth), ("Content-Type", "text/plain")],
                Some(body),
            );
            assert_eq!(st, 415, "text/plain {m} {p}: {text}");
        }
    }
    // The same origin (as the web Lab sends it) is let through.
    let auth = format!("Bearer {KEY}");
    let origin = format!("http://{}", s.addr);
    let (st, _, text) = s.raw(
        "POST",
        "/api/jobs",
        &[
            ("Authorization", &auth),
            ("Content-Type", "application/json"),
            ("Origin", &origin),
        ],
        Some(r#"{"kind":"pull","params":{"name":"no-such-model"}}"#),
    );
    assert_eq!(st, 400, "{text}");
    assert!(text.contains("not a built-in model"), "{text}");

    let bad = |params: Value, param: &str, says: &str| {
        let (st, v) = s.call(
            "POST",
            "/api/jobs",
            Some(json!({"kind": "perplexity", "params": params})),
        );
        assert_eq!(st, 400, "{v}");
        assert_eq!(v["error"]["param"], param, "{v}");
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.contains(says), "{m}");
    };
    let m = "models/tiny-llama";
    bad(
        json!({"model": m, "file": "../outside/secret.txt"}),
        "file",
        "leaves $HF2Q_HOME",
    );
    bad(
        json!({"model": m, "file": outside.join("secret.txt").to_str().unwrap()}),
        "file",
        "absolute",
    );
    bad(
        json!({"model": m, "file": "data/out/secret.txt"}),
        "file",
        "outside $HF2Q_HOME",
    );
    bad(
        json!({"model": "models/out", "file": "data/wiki.txt"}),
        "model",
        "outside $HF2Q_HOME",
    );
    bad(
        json!({"model": m, "file": "data/wiki.txt", "ctxx": 3}),
        "ctxx",
        "unknown parameter",
    );
    bad(
        json!({"model": m, "file": "data/wiki.txt", "ctx": "big"}),
        "ctx",
        "whole number",
    );
    let (st, v) = s.call("POST", "/api/jobs", Some(json!({"kind": "quantize", "params": {"model": m, "type": "Q8_0", "output": "../../escape"}})));
    assert_eq!(
        (st, v["error"]["param"].as_str()),
        (400, Some("output")),
        "{v}"
    );
    let (st, v) = s.call(
        "POST",
        "/api/datasets",
        Some(json!({"inputs": ["data/out/secret.txt"], "output": "x"})),
    );
    assert_eq!(
        (st, v["error"]["param"].as_str()),
        (400, Some("inputs")),
        "{v}"
    );
    for p in [
        "/api/datasets/..%2Fmodels/stats",
        "/api/datasets/out/preview",
        "/api/datasets/out",
    ] {
        let m = if p.ends_with("/out") { "DELETE" } else { "GET" };
        let (st, v) = s.call(m, p, None);
        assert!(st == 400 || st == 404, "{p}: {st} {v}");
    }
    for p in [
        "/api/models/models/out/secret.txt",
        "/api/models/models/out",
        "/api/models/models/..%2F..%2Foutside",
        "/api/models/data/wiki.txt",
    ] {
        let (st, v) = s.call("DELETE", p, None);
        assert!(st == 400 || st == 404, "{p}: {st} {v}");
    }
    for (name, says) in [
        ("../outside/x.txt", "leaves $HF2Q_HOME"),
        ("/tmp/x.txt", "absolute"),
        ("out/x.txt", "outside $HF2Q_HOME"),
        ("wiki.txt", "already exists"),
        ("run.sh", "must end in one of"),
        (".hidden.txt", "may not start with '.'"),
    ] {
        let (st, v) = s.call(
            "POST",
            "/api/files",
            Some(json!({"name": name, "content": "x"})),
        );
        assert_eq!(st, 400, "upload {name}: {v}");
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.contains(says), "upload {name}: {m}");
    }
    for p in [
        "/api/files/data/out/secret.txt",
        "/api/files/data/out",
        "/api/files/models/tiny-llama/config.json",
    ] {
        let (st, v) = s.call("DELETE", p, None);
        assert!(st == 400 || st == 404, "{p}: {st} {v}");
    }
    assert!(!outside.join("x.txt").exists());
    assert!(outside.join("secret.txt").exists() && h.join("data/wiki.txt").exists());
    assert!(
        h.join("datasets/out").exists(),
        "a link is refused, not removed"
    );
    // Nothing refused reached the job table.
    let (_, list) = s.call("GET", "/api/jobs", None);
    assert_eq!(list["data"].as_array().unwrap().len(), 1, "{list}");
}

#[test]
fn a_quantize_job_is_listed_and_its_events_replay_without_loss() {
    let (_d, h) = home();
    let s = Server::start(&h);
    let id = s.submit(
        "quantize",
        json!({"model": "models/tiny-llama", "type": "Q8_0", "output": "tiny-q8"}),
    );
    let j = s.wait_final(id);
    assert_eq!(j["state"], "succeeded", "{j}");
    assert_eq!(j["outputs"], json!(["models/tiny-q8.gguf"]));
    let (_, models) = s.call("GET", "/api/models", None);
    let listed: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["path"].as_str().unwrap())
        .collect();
    assert_eq!(
        listed,
        ["models/tiny-llama", "models/tiny-q8.gguf"],
        "{models}"
    );
    let q = &models["data"][1];
    assert_eq!(q["info"]["format"], "gguf", "{q}");
    assert_eq!(q["info"]["architecture"], "llama");
    assert!(models["builtin"]
        .as_array()
        .unwrap()
        .iter()
        .any(|b| b["name"] == "smollm2-135m"));

    let all = s.events(id, None);
    let ids: Vec<u64> = all.iter().map(|e| e.0).collect();
    assert_eq!(ids, (1..=ids.len() as u64).collect::<Vec<_>>());
    assert!(all.iter().all(|(i, e)| e["seq"] == *i));
    assert!(
        all.iter().any(|(_, e)| e["type"] == "progress"),
        "quantize --json prints progress"
    );
    assert_eq!(all.last().unwrap().1["data"]["state"], "succeeded");
    for k in [1, ids.len() as u64 / 2, ids.len() as u64 - 1] {
        let rest = s.events(id, Some(k));
        assert_eq!(rest, all[k as usize..].to_vec(), "replay after {k}");
    }
    let (st, _) = s.call("DELETE", "/api/models/models/tiny-q8.gguf", None);
    assert_eq!(st, 200);
    assert!(!h.join("models/tiny-q8.gguf").exists());
    let (st, _) = s.call("DELETE", &format!("/api/jobs/{id}"), None);
    assert_eq!(st, 200);
    assert_eq!(s.call("GET", &format!("/api/jobs/{id}"), None).0, 404);
}

#[test]
fn a_dataset_job_builds_a_split_that_the_api_previews_reports_and_deletes() {
    let (_d, h) = home();
    let mut csv = String::from("question,answer\n");
    for i in 0..20 {
        csv.push_str(&format!(
            "What is {i} plus {i}?,\"It is {}, of course.\"\n",
            2 * i
        ));
    }
    csv.push_str("a row,with,three cells\n");
    std::fs::write(h.join("data/qa.csv"), csv).unwrap();
    let s = Server::start(&h);
    let params = json!({"inputs": ["data/qa.csv"], "output": "qa", "to": "messages",
        "map": {"instruction": "question", "output": "answer"}, "on_error": "skip",
        "seed": 5, "model": "models/tiny-llama", "max_len": 16});
    let (st, v) = s.call("POST", "/api/datasets", Some(params.clone()));
    assert_eq!(st, 201, "{v}");
    let id = v["id"].as_i64().unwrap();
    let j = s.wait_final(id);
    assert_eq!(j["state"], "succeeded", "{j}");
    assert_eq!(j["outputs"], json!(["datasets/qa"]));
    let result = s
        .events(id, None)
        .into_iter()
        .find(|(_, e)| e["type"] == "progress")
        .expect("the report as an event")
        .1;
    assert_eq!(
        (
            result["data"]["train"].as_u64(),
            result["data"]["valid"].as_u64()
        ),
        (Some(18), Some(2)),
        "{result}"
    );

    let (_, list) = s.call("GET", "/api/datasets", None);
    assert_eq!(
        list["data"],
        json!([{"name": "qa", "path": "datasets/qa", "format": "messages", "train": 18, "valid": 2}]),
        "{list}"
    );
    let files: Vec<&str> = list["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap())
        .collect();
    assert_eq!(files, ["data/chats.jsonl", "data/qa.csv"]);
    let (st, p) = s.call("GET", "/api/datasets/qa/preview?split=valid", None);
    assert_eq!(st, 200, "{p}");
    assert_eq!(p["total"], 2);
    let q = p["data"][0]["messages"][0]["content"].as_str().unwrap();
    assert!(q.starts_with("What is ") && q.ends_with('?'), "{p}");
    let (_, p) = s.call("GET", "/api/datasets/qa/preview?offset=16&limit=5", None);
    assert_eq!(
        (p["total"].as_u64(), p["data"].as_array().unwrap().len()),
        (Some(18), 2)
    );
    assert_eq!(
        s.call("GET", "/api/datasets/qa/preview?limit=0", None).0,
        400
    );
    assert_eq!(
        s.call("GET", "/api/datasets/qa/preview?split=test", None).0,
        400
    );
    let (st, r) = s.call("GET", "/api/datasets/qa/stats", None);
    assert_eq!(st, 200, "{r}");
    assert_eq!(
        (r["rows"].as_u64(), r["skipped"].as_u64()),
        (Some(21), Some(1)),
        "{r}"
    );
    assert_eq!(r["problems"][0]["line"], 22);
    assert_eq!(r["tokens"]["records"], 20);
    assert_eq!(r["tokens"]["max_len"], 16);
    assert!(r["tokens"]["over_max_len"].as_u64().unwrap() > 0, "{r}");
    // The same job again: the output exists, so it is refused before it is queued.
    let (st, v) = s.call("POST", "/api/datasets", Some(params));
    assert_eq!(
        (st, v["error"]["param"].as_str()),
        (400, Some("output")),
        "{v}"
    );
    let (st, _) = s.call("DELETE", "/api/datasets/qa", None);
    assert_eq!(st, 200);
    assert!(!h.join("datasets/qa").exists() && h.join("data/qa.csv").exists());
    assert_eq!(s.call("GET", "/api/datasets/qa/stats", None).0, 400);
}

#[test]
fn uploaded_files_are_listed_built_from_and_deleted() {
    let (_d, h) = home();
    let s = Server::start(&h);
    let csv = "q,a\nWhat is one plus one?,Two.\nName a colour.,Blue.\n";
    let (st, v) = s.call(
        "POST",
        "/api/files",
        Some(json!({"name": "up/qa.csv", "content": csv})),
    );
    assert_eq!(st, 201, "{v}");
    assert_eq!(v, json!({"path": "data/up/qa.csv", "bytes": csv.len()}));
    assert_eq!(
        std::fs::read_to_string(h.join("data/up/qa.csv")).unwrap(),
        csv
    );
    // No temporary file is left beside it.
    let names: Vec<String> = std::fs::read_dir(h.join("data/up"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    assert_eq!(names, ["qa.csv"]);
    let (_, list) = s.call("GET", "/api/files", None);
    let paths: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap())
        .collect();
    assert!(
        paths.contains(&"data/up/qa.csv") && paths.contains(&"data/wiki.txt"),
        "{list}"
    );
    // A second upload under the same name is refused and keeps the first.
    let (st, _) = s.call(
        "POST",
        "/api/files",
        Some(json!({"name": "up/qa.csv", "content": "other"})),
    );
    assert_eq!(st, 400);
    assert_eq!(
        std::fs::read_to_string(h.join("data/up/qa.csv")).unwrap(),
        csv
    );
    let id = s.submit(
        "dataset",
        json!({"inputs": ["data/up/qa.csv"], "output": "up", "map": {"prompt": "q", "completion": "a"}, "valid_split": 0.0}),
    );
    assert_eq!(s.wait_final(id)["state"], "succeeded");
    let (st, v) = s.call("DELETE", "/api/files/data/up/qa.csv", None);
    assert_eq!((st, &v["deleted"]), (200, &json!(true)), "{v}");
    assert!(!h.join("data/up/qa.csv").exists());
    let (st, _) = s.call("DELETE", "/api/files/data/up/qa.csv", None);
    assert_eq!(st, 400);
}

fn train_params(output: &str) -> Value {
    json!({"model": "models/tiny-llama", "data": "data/chats.jsonl", "output": output,
           "steps": STEPS, "save_every": 50, "batch": 8, "lora_r": 4, "lr": 0.01, "device": "cpu"})
}

/// Long enough (a few seconds) for the server to be killed mid-run.
const STEPS: u64 = 400;

#[test]
fn a_server_killed_during_training_comes_back_interrupted_and_the_resumed_adapter_is_exact() {
    let (_d, h) = home();
    let s = Server::start(&h);
    let whole = s.submit("train_sft", train_params("whole"));
    // Follow the unbroken run live over SSE: every step arrives, in order.
    let live = s.events(whole, None);
    let j = s.wait_final(whole);
    assert_eq!(j["state"], "succeeded", "{j}");
    let steps: Vec<u64> = live
        .iter()
        .filter(|(_, e)| e["type"] == "progress" && e["data"]["event"] == "step")
        .map(|(_, e)| e["data"]["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (1..=STEPS).collect::<Vec<_>>());
    let span =
        live.last().unwrap().1["time"].as_f64().unwrap() - live[0].1["time"].as_f64().unwrap();
    eprintln!(
        "SSE followed {} events ({} steps) in {span:.2} s: {:.0} events/s",
        live.len(),
        steps.len(),
        live.len() as f64 / span
    );

    let broken = s.submit("train_sft", train_params("broken"));
    let partial = h.join(format!("adapters/.broken.partial-{broken}"));
    let j = s.wait(broken, |j| {
        j["state"] != "queued" && j["state"] != "running"
            || partial.join("checkpoint-000050").exists()
    });
    assert_eq!(j["state"], "running", "killed mid-run: {j}");
    // Its temporary folder (with a checkpoint in it) is not listed among the adapters.
    let (_, models) = s.call("GET", "/api/models", None);
    let listed: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["path"].as_str().unwrap())
        .collect();
    assert!(
        listed.contains(&"adapters/whole") && !listed.iter().any(|p| p.contains("broken")),
        "{listed:?}"
    );
    s.kill9();
    let s = Server::start(&h);
    let j = s.wait_final(broken);
    assert_eq!(j["state"], "interrupted", "{j}");
    assert!(!h.join("adapters/broken").exists());
    let (st, v) = s.call(
        "POST",
        &format!("/api/jobs/{broken}/resume"),
        Some(json!({})),
    );
    assert_eq!(st, 200, "{v}");
    let j = s.wait_final(broken);
    assert_eq!(j["state"], "succeeded", "{j}");
    assert_eq!(j["attempts"], 2);
    let argv = s
        .events(broken, None)
        .into_iter()
        .rev()
        .find(|(_, e)| e["data"]["state"] == "running")
        .unwrap()
        .1;
    assert!(
        argv["data"]["argv"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a == "--resume"),
        "{argv}"
    );
    let a = std::fs::read(h.join("adapters/whole/adapter_model.safetensors")).unwrap();
    let b = std::fs::read(h.join("adapters/broken/adapter_model.safetensors")).unwrap();
    assert!(
        a == b,
        "the resumed adapter differs from the unbroken run's"
    );
    // Cancel of a running training job: SIGTERM, a checkpoint, `cancelled`, no adapter.
    let c = s.submit("train_sft", train_params("cancelled"));
    let partial = h.join(format!("adapters/.cancelled.partial-{c}"));
    // Its stop handler is in place once its log exists.
    s.wait(c, |j| {
        j["state"] != "queued" && j["state"] != "running"
            || partial.join("train_log.jsonl").exists()
    });
    let (st, v) = s.call("POST", &format!("/api/jobs/{c}/cancel"), Some(json!({})));
    assert_eq!(st, 200, "{v}");
    let j = s.wait_final(c);
    assert_eq!(j["state"], "cancelled", "{j}");
    assert!(!h.join("adapters/cancelled").exists());
    let saved: Vec<String> = std::fs::read_dir(&partial)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("checkpoint-"))
        .collect();
    assert!(!saved.is_empty(), "SIGTERM saved no checkpoint");
}
