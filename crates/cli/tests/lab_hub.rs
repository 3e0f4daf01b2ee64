//! The Lab and the Hub through a real `hf2q serve` and the mock Hub on loopback (its
//! `HF_ENDPOINT`): the Hub token setting (set, never echoed, stored 0600, bad ones refused,
//! cleared), `push` jobs with the stored token (a dataset folder and a model folder, served
//! back by the mock with the same bytes; no token: failed with the Hub's answer; a read-only
//! token: refused), the token absent from jobs' params and logs, and a `dataset` job that reads
//! a Hub dataset.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use common::lab::{copy_dir, Server};
use hf2q_hub::mock::MockHub;
use serde_json::{json, Value};

const TOKEN: &str = "hf_lab_write_token";

fn state(j: &Value) -> &str {
    j["state"].as_str().unwrap_or("")
}

/// Every file under `dir`, relative paths to bytes.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

#[test]
fn the_hub_token_setting_and_push_jobs() {
    let d = tempfile::tempdir().unwrap();
    let home = d.path().join("home");
    copy_dir(&common::tiny(), &home.join("models/tiny-llama"));
    std::fs::create_dir_all(home.join("datasets/chat")).unwrap();
    std::fs::write(
        home.join("datasets/chat/train.jsonl"),
        "{\"text\": \"one\"}\n{\"text\": \"two\"}\n",
    )
    .unwrap();
    let hub = MockHub::start();
    hub.set_read_only_tokens(&["hf_read_only"]);
    hub.add_repo(
        "datasets/org/notes",
        &[(
            "data/train.jsonl",
            b"{\"text\": \"from the hub\"}\n{\"text\": \"two\"}\n",
        )],
    );
    let ep = hub.endpoint();
    let hf_home = d.path().join("hf-home");
    let cache = d.path().join("hub-cache");
    let srv = Server::start_env(
        &home,
        &[
            ("HF_ENDPOINT", ep.as_str()),
            ("HF_HOME", hf_home.to_str().unwrap()),
            ("HF_HUB_CACHE", cache.to_str().unwrap()),
            ("HF_TOKEN", ""),
        ],
    );

    let (st, v) = srv.call("GET", "/api/settings", None);
    assert_eq!((st, v["hub_token_set"].clone()), (200, json!(false)), "{v}");

    // Without a token the push fails with the Hub's answer.
    let push = |path: &str, repo: &str, kind: &str| {
        let id = srv.submit(
            "push",
            json!({"path": path, "repo": repo, "repo_type": kind}),
        );
        srv.wait_final(id)
    };
    let j = push("datasets/chat", "me/chat", "dataset");
    assert_eq!(state(&j), "failed", "{j}");
    assert!(j["error"].as_str().unwrap_or("").contains("token"), "{j}");

    // Bad tokens and bad repository names are refused before anything runs.
    let (st, v) = srv.call(
        "POST",
        "/api/settings/hub-token",
        Some(json!({"token": "a b"})),
    );
    assert_eq!(st, 400, "{v}");
    let (st, v) = srv.call("POST", "/api/settings/hub-token", Some(json!({"token": 5})));
    assert_eq!(st, 422, "{v}");
    let (st, v) = srv.call(
        "POST",
        "/api/jobs",
        Some(json!({"kind": "push", "params": {"path": "datasets/chat", "repo": "me/../x"}})),
    );
    assert_eq!(st, 400, "{v}");

    // Set: answered with whether one is set, never the token; stored 0600.
    let (st, v) = srv.call(
        "POST",
        "/api/settings/hub-token",
        Some(json!({"token": TOKEN})),
    );
    assert_eq!((st, v["hub_token_set"].clone()), (200, json!(true)), "{v}");
    assert!(!v.to_string().contains(TOKEN));
    let (_, v) = srv.call("GET", "/api/settings", None);
    assert_eq!(v["hub_token_set"], true);
    assert!(!v.to_string().contains(TOKEN));
    let file = home.join("hub_token");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), TOKEN);
    assert_eq!(
        std::fs::metadata(&file).unwrap().permissions().mode() & 0o777,
        0o600
    );

    // Push a dataset and a model: the mock serves the same files.
    let j = push("datasets/chat", "me/chat", "dataset");
    assert_eq!(state(&j), "succeeded", "{j}");
    let served = hub.files("datasets/me/chat", "main").unwrap();
    assert_eq!(
        served["train.jsonl"],
        std::fs::read(home.join("datasets/chat/train.jsonl")).unwrap()
    );
    assert!(served.contains_key("README.md"), "a card is written");
    let j = push("models/tiny-llama", "me/tiny", "model");
    assert_eq!(state(&j), "succeeded", "{j}");
    let served = hub.files("me/tiny", "main").unwrap();
    for (name, bytes) in files(&home.join("models/tiny-llama")) {
        assert_eq!(served.get(&name), Some(&bytes), "{name}");
    }
    // The token reached the hub host, and is in no job's params or log.
    assert!(hub
        .requests()
        .iter()
        .any(|r| r.authorization.as_deref() == Some(&format!("Bearer {TOKEN}"))));
    assert!(!hub.cdn_saw_authorization());
    let (_, jobs) = srv.call("GET", "/api/jobs", None);
    assert!(!jobs.to_string().contains(TOKEN));
    for job in jobs["data"].as_array().unwrap() {
        let id = job["id"].as_i64().unwrap();
        let log: Vec<_> = srv.events(id, None);
        assert!(!format!("{log:?}").contains(TOKEN), "job {id}");
    }

    // A Hub dataset built by a `dataset` job (the child gets the token too).
    let (st, v) = srv.call(
        "POST",
        "/api/datasets",
        Some(json!({"hub": ["org/notes:train"], "output": "notes", "valid_split": 0.0})),
    );
    assert_eq!(st, 201, "{v}");
    let j = srv.wait_final(v["id"].as_i64().unwrap());
    assert_eq!(state(&j), "succeeded", "{j}");
    let built = std::fs::read_to_string(home.join("datasets/notes/train.jsonl")).unwrap();
    assert!(built.contains("from the hub"), "{built}");

    // A read-only token is refused by the Hub; clearing removes the file.
    let (st, _) = srv.call(
        "POST",
        "/api/settings/hub-token",
        Some(json!({"token": "hf_read_only"})),
    );
    assert_eq!(st, 200);
    let j = push("datasets/chat", "me/chat2", "dataset");
    assert_eq!(state(&j), "failed", "{j}");
    let (st, v) = srv.call("DELETE", "/api/settings/hub-token", None);
    assert_eq!((st, v["hub_token_set"].clone()), (200, json!(false)), "{v}");
    assert!(!file.exists());
}
