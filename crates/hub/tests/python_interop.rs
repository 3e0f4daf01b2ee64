//! Cache compatibility with Python's `huggingface_hub`: when `HF2Q_TEST_HUB_PYTHON` names a python
//! with `huggingface_hub` installed, (1) `hf_hub_download(..., local_files_only=True)` with
//! `HF_HUB_OFFLINE=1` returns the bytes hf2q pulled, and (2) a file that `huggingface_hub`
//! downloaded from the same mock Hub (through `HF_ENDPOINT`) is found by hf2q offline.
//! Without it the test prints "skipped" and passes.

use std::fs;
use std::process::Command;

use hf2q_hub::mock::MockHub;
use hf2q_hub::{find_cached, pull, HubConfig, PullRequest, RepoRef};

fn python() -> Option<String> {
    match std::env::var("HF2Q_TEST_HUB_PYTHON") {
        Ok(p) if !p.is_empty() => Some(p),
        _ => {
            eprintln!("python_interop: skipped (HF2Q_TEST_HUB_PYTHON is not set)");
            None
        }
    }
}

const DOWNLOAD: &str = "import sys\n\
from huggingface_hub import hf_hub_download\n\
p = hf_hub_download(sys.argv[1], sys.argv[2], revision=sys.argv[3], cache_dir=sys.argv[4], \
local_files_only=sys.argv[5] == '1')\n\
print(p)\n";

fn hf_hub_download(py: &str, env: &[(&str, &str)], args: &[&str]) -> String {
    let out = Command::new(py)
        .arg("-c")
        .arg(DOWNLOAD)
        .args(args)
        .env_remove("HF_TOKEN")
        .env_remove("HF_HUB_CACHE")
        .env("HF_HUB_DISABLE_TELEMETRY", "1")
        .env("HF_HUB_DISABLE_XET", "1")
        .envs(env.iter().copied())
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "python failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

#[test]
fn huggingface_hub_and_hf2q_share_the_cache() {
    let Some(py) = python() else { return };
    let hub = MockHub::start();
    let weights: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let gguf: Vec<u8> = (0..9_000u32).map(|i| (i * 13 % 241) as u8).collect();
    hub.add_repo(
        "org/tiny-st",
        &[
            ("config.json", b"{\"a\": 1}"),
            ("tokenizer.json", b"{}"),
            ("model.safetensors", &weights),
        ],
    );
    hub.add_repo(
        "org/py-GGUF",
        &[("m-Q4_K_M.gguf", &gguf), ("README.md", b"# r")],
    );
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("hub");
    let hf_home = dir.path().join("home");
    let mut cfg = HubConfig::new(&cache);
    cfg.endpoint = hub.endpoint();
    let hf_home_s = hf_home.to_str().unwrap();
    let cache_s = cache.to_str().unwrap();

    // (1) hf2q pulls; huggingface_hub, offline, finds the same bytes.
    pull(
        &cfg,
        &PullRequest::new(RepoRef::parse("org/tiny-st").unwrap()),
    )
    .unwrap();
    for (file, want) in [
        ("model.safetensors", &weights[..]),
        ("config.json", b"{\"a\": 1}"),
    ] {
        let p = hf_hub_download(
            &py,
            &[
                ("HF_HUB_OFFLINE", "1"),
                ("HF_HOME", hf_home_s),
                ("HF_ENDPOINT", "http://127.0.0.1:9"),
            ],
            &["org/tiny-st", file, "main", cache_s, "1"],
        );
        assert_eq!(fs::read(&p).unwrap(), want, "{p}");
    }

    // (2) huggingface_hub downloads from the mock; hf2q, offline, finds it.
    let endpoint = hub.endpoint();
    let p = hf_hub_download(
        &py,
        &[("HF_ENDPOINT", endpoint.as_str()), ("HF_HOME", hf_home_s)],
        &["org/py-GGUF", "m-Q4_K_M.gguf", "main", cache_s, "0"],
    );
    assert_eq!(fs::read(&p).unwrap(), gguf);
    hub.clear_requests();
    cfg.offline = true;
    let found = find_cached(
        &cfg,
        &PullRequest::new(RepoRef::parse("org/py-GGUF:Q4_K_M").unwrap()),
    )
    .unwrap();
    assert_eq!(fs::read(&found.model_path).unwrap(), gguf);
    assert!(hub.requests().is_empty());
    eprintln!("python_interop: passed with {py}");
}

const UPLOAD: &str = "import sys\n\
from huggingface_hub import HfApi\n\
api = HfApi(endpoint=sys.argv[1], token='tok')\n\
api.create_repo(sys.argv[2], repo_type=sys.argv[4], exist_ok=True)\n\
info = api.upload_folder(folder_path=sys.argv[3], repo_id=sys.argv[2], repo_type=sys.argv[4], \
commit_message='from python')\n\
print(info.oid)\n";

const FETCH: &str = "import sys\n\
from huggingface_hub import hf_hub_download\n\
print('\\n'.join(hf_hub_download(sys.argv[1], f, repo_type=sys.argv[2], cache_dir=sys.argv[3]) \
for f in sys.argv[4:]))\n";

fn python_run(py: &str, endpoint: &str, home: &str, script: &str, args: &[&str]) -> String {
    let out = Command::new(py)
        .arg("-c")
        .arg(script)
        .args(args)
        .env_remove("HF_TOKEN")
        .env_remove("HF_HUB_CACHE")
        .env("HF_HUB_DISABLE_TELEMETRY", "1")
        .env("HF_HUB_DISABLE_XET", "1")
        .env("HF_ENDPOINT", endpoint)
        .env("HF_HOME", home)
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "python failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// The mock's write side in huggingface_hub's own shapes: `upload_folder` (preupload, LFS batch,
/// PUT or the parts of a multipart upload, verify, NDJSON commit) pushes to the mock and hf2q
/// pulls it back; hf2q pushes and
/// `hf_hub_download` fetches each file back; byte for byte both ways.
#[test]
fn huggingface_hub_and_hf2q_push_to_each_other() {
    use hf2q_hub::{push, PushRequest, RepoId, RepoKind};
    let Some(py) = python() else { return };
    let hub = MockHub::start();
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    fs::create_dir_all(&src).unwrap();
    let weights: Vec<u8> = (0..150_000u32).map(|i| (i * 11 % 253) as u8).collect();
    let files: Vec<(&str, &[u8])> = vec![
        ("config.json", b"{\"b\": 2}"),
        ("tokenizer.json", b"{}"),
        ("model.safetensors", &weights),
    ];
    for (p, d) in &files {
        fs::write(src.join(p), d).unwrap();
    }
    let home = dir.path().join("home");
    let home_s = home.to_str().unwrap();
    let endpoint = hub.endpoint();
    let mut cfg = HubConfig::new(dir.path().join("hub"));
    cfg.endpoint = endpoint.clone();
    cfg.token = Some("tok".into());

    // huggingface_hub pushes, hf2q pulls.
    let oid = python_run(
        &py,
        &endpoint,
        home_s,
        UPLOAD,
        &[&endpoint, "py/up", src.to_str().unwrap(), "model"],
    );
    // model.safetensors went through the LFS batch API, the PUT and the verify step.
    assert_eq!(hub.lfs_objects().len(), 1);
    assert!(!hub.cdn_saw_authorization());
    let mut pr = PullRequest::new(RepoRef::parse("py/up").unwrap());
    pr.include = vec!["*".into()];
    let got = pull(&cfg, &pr).unwrap();
    assert_eq!(got.commit, oid);
    for (p, d) in &files {
        assert_eq!(&fs::read(got.snapshot.join(p)).unwrap()[..], *d, "{p}");
    }

    // The multipart transfer in huggingface_hub's own shapes: parts PUT with their ETags
    // collected, the completion, then verify; hf2q pulls the object back.
    hub.set_multipart(Some((100_000, 40_000)));
    let big: Vec<u8> = (0..150_001u32).map(|i| (i * 7 % 251) as u8).collect();
    fs::write(src.join("model.safetensors"), &big).unwrap();
    python_run(
        &py,
        &endpoint,
        home_s,
        UPLOAD,
        &[&endpoint, "py/parts", src.to_str().unwrap(), "model"],
    );
    let parts = hub
        .requests()
        .iter()
        .filter(|r| r.path.starts_with("/lfs-part/"))
        .count();
    assert_eq!(parts, 4);
    assert!(!hub.cdn_saw_authorization());
    let got = pull(&cfg, &PullRequest::new(RepoRef::parse("py/parts").unwrap())).unwrap();
    assert_eq!(
        fs::read(got.snapshot.join("model.safetensors")).unwrap(),
        big
    );
    fs::write(src.join("model.safetensors"), &weights).unwrap();
    hub.set_multipart(None);

    // hf2q pushes a dataset, huggingface_hub downloads it.
    let pushed = push(
        &cfg,
        &PushRequest {
            path: src.clone(),
            repo: RepoId::parse("rs/ds").unwrap().of_kind(RepoKind::Dataset),
            revision: None,
            private: false,
            message: None,
            card: None,
        },
    )
    .unwrap();
    assert!(pushed.lfs.contains(&"model.safetensors".to_string()));
    let cache2 = dir.path().join("py-cache");
    let mut args = vec!["rs/ds", "dataset", cache2.to_str().unwrap()];
    args.extend(files.iter().map(|(p, _)| *p));
    let paths = python_run(&py, &endpoint, home_s, FETCH, &args);
    let paths: Vec<&str> = paths.lines().collect();
    assert_eq!(paths.len(), files.len());
    for ((p, d), got) in files.iter().zip(paths) {
        assert!(got.contains("datasets--rs--ds"), "{got}");
        assert_eq!(&fs::read(got).unwrap()[..], *d, "{p}");
    }
    eprintln!("python_interop: push both ways passed with {py}");
}
