//! Pushes against the mock Hub on loopback (the write API in huggingface_hub's shapes): a folder
//! to a new repository pulled back byte for byte, LFS by the server's threshold (PUT to the
//! storage host without the token, verify on the hub host with it), objects already stored not
//! sent again, a branch, a dataset repository, the card added only when there is no README.md,
//! and the refusals (no token: 401; a read-only token: 403).

mod common;

use common::bytes;

use std::fs;
use std::path::Path;

use hf2q_hub::mock::{Host, MockHub};
use hf2q_hub::{
    pull, push, HubConfig, HubError, PullRequest, PushRequest, RepoId, RepoKind, RepoRef,
};

fn cfg(hub: &MockHub, cache: &Path, token: Option<&str>) -> HubConfig {
    let mut c = HubConfig::new(cache);
    c.endpoint = hub.endpoint();
    c.token = token.map(String::from);
    c
}

fn req(path: &Path, repo: &str) -> PushRequest {
    PushRequest {
        path: path.to_path_buf(),
        repo: RepoId::parse(repo).unwrap(),
        revision: None,
        private: false,
        message: None,
        card: Some("# card\n".into()),
    }
}

/// A model folder: config, tokenizer, weights (LFS by extension), a nested file.
fn model_folder(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let files = vec![
        (
            "config.json".to_string(),
            br#"{"model_type": "llama"}"#.to_vec(),
        ),
        ("tokenizer.json".to_string(), b"{}".to_vec()),
        ("model.safetensors".to_string(), bytes(200_000, 1)),
        ("extra/notes.txt".to_string(), b"notes".to_vec()),
    ];
    for (p, d) in &files {
        let p = dir.join(p);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, d).unwrap();
    }
    files
}

#[test]
fn folder_to_new_repo_pulls_back_byte_for_byte() {
    let hub = MockHub::start();
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("model");
    let files = model_folder(&src);
    let c = cfg(&hub, &d.path().join("cache"), Some("tok"));

    let p = push(&c, &req(&src, "me/tiny")).unwrap();
    assert!(p.created && p.card_added);
    assert_eq!(p.lfs, vec!["model.safetensors".to_string()]);
    assert_eq!(p.lfs_bytes_sent, 200_000);
    assert_eq!(
        p.commit_url,
        format!("{}/me/tiny/commit/{}", hub.endpoint(), p.commit)
    );
    assert_eq!(p.repo_url, format!("{}/me/tiny", hub.endpoint()));

    // The token went to the hub host (create, preupload, batch, verify, commit), never to the
    // storage host that took the PUT.
    let seen = hub.requests();
    let put: Vec<_> = seen.iter().filter(|r| r.method == "PUT").collect();
    assert_eq!(put.len(), 1);
    assert_eq!(put[0].host, Host::Cdn);
    assert!(!hub.cdn_saw_authorization());
    for path in ["/api/repos/create", "/me/tiny.git/info/lfs/objects/verify"] {
        let r = seen.iter().find(|r| r.path == path).unwrap();
        assert_eq!(r.authorization.as_deref(), Some("Bearer tok"), "{path}");
    }

    // Pull every file back (the model selection would leave out extra/ and README.md).
    let mut pr = PullRequest::new(RepoRef::parse("me/tiny").unwrap());
    pr.include = vec!["*".into()];
    let got = pull(&c, &pr).unwrap();
    assert_eq!(got.commit, p.commit);
    for (path, data) in &files {
        assert_eq!(&fs::read(got.snapshot.join(path)).unwrap(), data, "{path}");
    }
    assert_eq!(
        fs::read(got.snapshot.join("README.md")).unwrap(),
        b"# card\n"
    );

    // The same push again: the repository exists, the LFS object is not sent again, and a
    // README.md of the folder's own wins over the card.
    fs::write(src.join("README.md"), b"# mine").unwrap();
    hub.clear_requests();
    let again = push(&c, &req(&src, "me/tiny")).unwrap();
    assert!(!again.created && !again.card_added);
    assert_eq!(again.lfs_bytes_sent, 0);
    assert!(hub.requests().iter().all(|r| r.method != "PUT"));
    assert_eq!(
        hub.files("me/tiny", "main").unwrap()["README.md"],
        b"# mine".to_vec()
    );
}

#[test]
fn the_lfs_threshold_is_the_servers() {
    let hub = MockHub::start();
    hub.set_lfs_threshold(1000);
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("data");
    fs::create_dir_all(&src).unwrap();
    let big = bytes(3000, 7);
    fs::write(src.join("big.txt"), &big).unwrap();
    fs::write(src.join("small.txt"), b"0123456789").unwrap();
    let c = cfg(&hub, &d.path().join("cache"), Some("tok"));
    let mut r = req(&src, "me/thr");
    r.card = None;
    let p = push(&c, &r).unwrap();
    assert_eq!(p.lfs, vec!["big.txt".to_string()]);
    assert_eq!(p.lfs_bytes_sent, 3000);
    let sha = hf2q_hub::download::sha256_file(&src.join("big.txt")).unwrap();
    assert_eq!(hub.lfs_objects(), vec![sha]);
    let files = hub.files("me/thr", "main").unwrap();
    assert_eq!(files["big.txt"], big);
    assert_eq!(files["small.txt"], b"0123456789".to_vec());
}

#[test]
fn branches_datasets_and_single_files() {
    let hub = MockHub::start();
    let d = tempfile::tempdir().unwrap();
    let c = cfg(&hub, &d.path().join("cache"), Some("tok"));
    let src = d.path().join("model");
    model_folder(&src);
    push(&c, &req(&src, "me/m")).unwrap();

    // One file to a new branch: main keeps its files, the branch has both.
    let gguf = d.path().join("m-Q8_0.gguf");
    fs::write(&gguf, bytes(5000, 3)).unwrap();
    let mut r = req(&gguf, "me/m");
    r.revision = Some("q8".into());
    r.message = Some("Q8_0".into());
    let p = push(&c, &r).unwrap();
    assert_eq!(p.files, vec!["m-Q8_0.gguf".to_string()]);
    assert!(!hub
        .files("me/m", "main")
        .unwrap()
        .contains_key("m-Q8_0.gguf"));
    let q8 = hub.files("me/m", "q8").unwrap();
    assert!(q8.contains_key("m-Q8_0.gguf") && q8.contains_key("config.json"));

    // A dataset repository lives under datasets/.
    let ds = d.path().join("ds");
    fs::create_dir_all(&ds).unwrap();
    fs::write(ds.join("train.jsonl"), b"{\"text\": \"a\"}\n").unwrap();
    let mut r = req(&ds, "me/data");
    r.repo = r.repo.of_kind(RepoKind::Dataset);
    let p = push(&c, &r).unwrap();
    assert_eq!(p.repo_url, format!("{}/datasets/me/data", hub.endpoint()));
    assert!(hub
        .files("datasets/me/data", "main")
        .unwrap()
        .contains_key("train.jsonl"));
    assert!(hub.files("me/data", "main").is_none());
}

#[test]
fn refusals_say_what_to_do() {
    let hub = MockHub::start();
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("model");
    model_folder(&src);

    let e = push(&cfg(&hub, d.path(), None), &req(&src, "me/x")).unwrap_err();
    assert!(matches!(e, HubError::PushNeedsToken { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("401") && msg.contains("HF_TOKEN"), "{msg}");
    assert!(hub.files("me/x", "main").is_none());

    hub.set_read_only_tokens(&["ro"]);
    let e = push(&cfg(&hub, d.path(), Some("ro")), &req(&src, "me/x")).unwrap_err();
    assert!(matches!(e, HubError::NoWriteAccess { .. }), "{e}");
    assert!(e.to_string().contains("403"), "{e}");

    let mut off = cfg(&hub, d.path(), Some("tok"));
    off.offline = true;
    assert!(matches!(
        push(&off, &req(&src, "me/x")).unwrap_err(),
        HubError::Offline { .. }
    ));

    let empty = d.path().join("empty");
    fs::create_dir_all(&empty).unwrap();
    let e = push(&cfg(&hub, d.path(), Some("tok")), &req(&empty, "me/x")).unwrap_err();
    assert!(matches!(e, HubError::NothingToPush { .. }), "{e}");
}
