//! Pulls against the mock Hub on loopback (a real HTTP server and a second "CDN" host): the
//! cache layout, GGUF type selection with split files, resume after a cut connection, a server
//! that ignores Range, refusal of a wrong sha256 or size with nothing half-written, the error of
//! each refusal, the token policy, and offline mode.

mod common;

use common::bytes;

use std::fs;
use std::path::Path;

use hf2q_hub::api::Client;
use hf2q_hub::mock::{Faults, Host, MockHub};
use hf2q_hub::{find_cached, pull, HubConfig, HubError, PullRequest, RepoRef};

struct Fixture {
    hub: MockHub,
    dir: tempfile::TempDir,
    weights: Vec<u8>,
    st_commit: String,
}

fn fixture() -> Fixture {
    let hub = MockHub::start();
    let weights = bytes(300_000, 1);
    let st_commit = hub.add_repo(
        "org/tiny-st",
        &[
            ("config.json", br#"{"model_type": "llama"}"#),
            ("tokenizer.json", b"{}"),
            ("model.safetensors", &weights),
            ("README.md", b"# tiny"),
            ("onnx/model.onnx", b"onnx"),
        ],
    );
    hub.add_repo(
        "org/tiny-GGUF",
        &[
            ("m-Q4_K_M.gguf", &bytes(5000, 2)),
            ("m-Q8_0-00001-of-00002.gguf", &bytes(7000, 3)),
            ("m-Q8_0-00002-of-00002.gguf", &bytes(6000, 4)),
            ("README.md", b"# gguf"),
        ],
    );
    Fixture {
        hub,
        dir: tempfile::tempdir().unwrap(),
        weights,
        st_commit,
    }
}

impl Fixture {
    fn cfg(&self) -> HubConfig {
        let mut c = HubConfig::new(self.dir.path().join("hub"));
        c.endpoint = self.hub.endpoint();
        c
    }

    fn req(&self, s: &str) -> PullRequest {
        PullRequest::new(RepoRef::parse(s).unwrap())
    }

    fn repo_dir(&self, folder: &str) -> std::path::PathBuf {
        self.dir.path().join("hub").join(folder)
    }

    /// The blobs folder holds only whole files: no `.incomplete`, no temporaries.
    fn blobs(&self, folder: &str) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(self.repo_dir(folder).join("blobs"))
            .map(|r| {
                r.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }
}

fn sha256_hex(b: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(b)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn pulls_a_safetensors_repo_in_the_shared_layout() {
    let f = fixture();
    let p = pull(&f.cfg(), &f.req("org/tiny-st")).unwrap();
    assert_eq!(p.commit, f.st_commit);
    assert_eq!(
        p.files,
        vec!["config.json", "model.safetensors", "tokenizer.json"]
    );
    assert_eq!(p.model_path, p.snapshot);
    let repo = f.repo_dir("models--org--tiny-st");
    assert_eq!(
        fs::read_to_string(repo.join("refs/main")).unwrap(),
        f.st_commit
    );
    let link = repo
        .join("snapshots")
        .join(&f.st_commit)
        .join("model.safetensors");
    let target = fs::read_link(&link).unwrap();
    assert_eq!(
        target,
        Path::new("../../blobs").join(sha256_hex(&f.weights)),
        "LFS blob named by its sha256"
    );
    assert_eq!(fs::read(&link).unwrap(), f.weights);
    assert_eq!(f.blobs("models--org--tiny-st").len(), 3);
    // A second pull downloads nothing: only the revision is asked.
    f.hub.clear_requests();
    let again = pull(&f.cfg(), &f.req("org/tiny-st")).unwrap();
    assert!(again.downloaded.is_empty());
    let seen = f.hub.requests();
    assert!(seen.iter().all(|r| r.path.starts_with("/api/")), "{seen:?}");
}

#[test]
fn pulls_a_gguf_repo_by_type_with_split_parts() {
    let f = fixture();
    let p = pull(&f.cfg(), &f.req("org/tiny-GGUF:q8_0")).unwrap();
    assert_eq!(
        p.files,
        vec!["m-Q8_0-00001-of-00002.gguf", "m-Q8_0-00002-of-00002.gguf"]
    );
    assert_eq!(p.model_path, p.snapshot.join("m-Q8_0-00001-of-00002.gguf"));
    assert_eq!(
        fs::read(p.snapshot.join("m-Q8_0-00002-of-00002.gguf")).unwrap(),
        bytes(6000, 4)
    );
    let d = pull(&f.cfg(), &f.req("org/tiny-GGUF")).unwrap();
    assert_eq!(d.files, vec!["m-Q4_K_M.gguf"], "Q4_K_M by default");
    let e = pull(&f.cfg(), &f.req("org/tiny-GGUF:Q2_K"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no GGUF file of type Q2_K") && e.contains("Q8_0"),
        "{e}"
    );
    // --include overrides the choice, --exclude removes from it.
    let mut r = f.req("org/tiny-GGUF");
    r.include = vec!["*.md".into(), "*.gguf".into()];
    r.exclude = vec!["*Q8_0*".into()];
    assert_eq!(
        pull(&f.cfg(), &r).unwrap().files,
        vec!["README.md", "m-Q4_K_M.gguf"]
    );
}

#[test]
fn a_cut_connection_resumes_with_range() {
    let f = fixture();
    f.hub.set_faults(Faults {
        cut_once: Some(("model.safetensors".into(), 100_000)),
        ..Default::default()
    });
    let p = pull(&f.cfg(), &f.req("org/tiny-st")).unwrap();
    assert_eq!(
        fs::read(p.snapshot.join("model.safetensors")).unwrap(),
        f.weights
    );
    let ranges: Vec<_> = f
        .hub
        .requests()
        .into_iter()
        .filter(|r| r.host == Host::Cdn)
        .map(|r| r.range)
        .collect();
    assert_eq!(ranges, vec![None, Some("bytes=100000-".to_string())]);
}

#[test]
fn a_server_ignoring_range_restarts_cleanly() {
    let f = fixture();
    f.hub.set_faults(Faults {
        cut_once: Some(("model.safetensors".into(), 120_000)),
        ignore_range: true,
        ..Default::default()
    });
    let p = pull(&f.cfg(), &f.req("org/tiny-st")).unwrap();
    assert_eq!(
        fs::read(p.snapshot.join("model.safetensors")).unwrap(),
        f.weights
    );
    assert!(f
        .hub
        .requests()
        .iter()
        .any(|r| r.range.as_deref() == Some("bytes=120000-")));
    assert!(!f
        .blobs("models--org--tiny-st")
        .iter()
        .any(|b| b.contains("incomplete")));
}

fn refused(f: &Fixture, faults: Faults, want: &str) {
    f.hub.set_faults(faults);
    let e = pull(&f.cfg(), &f.req("org/tiny-st")).unwrap_err();
    assert!(e.to_string().contains(want), "{e}");
    // Nothing half-written: no blob of the refused file, no partial file, and the snapshot
    // has no link to it (the small files before it in the order are whole).
    let blobs = f.blobs("models--org--tiny-st");
    assert!(blobs.len() <= 2, "{blobs:?}");
    assert!(!blobs
        .iter()
        .any(|b| b.contains("incomplete") || b.contains(&sha256_hex(&f.weights))));
    let snap = f
        .repo_dir("models--org--tiny-st")
        .join("snapshots")
        .join(&f.st_commit);
    assert!(fs::symlink_metadata(snap.join("model.safetensors")).is_err());
    // Offline mode names the missing file.
    let mut off = f.cfg();
    off.offline = true;
    assert!(find_cached(&off, &f.req("org/tiny-st")).is_err());
    // Fault gone: the next pull completes.
    f.hub.set_faults(Faults::default());
    let p = pull(&f.cfg(), &f.req("org/tiny-st")).unwrap();
    assert_eq!(
        fs::read(p.snapshot.join("model.safetensors")).unwrap(),
        f.weights
    );
}

#[test]
fn a_wrong_sha256_is_refused_and_nothing_stays() {
    let f = fixture();
    refused(
        &f,
        Faults {
            corrupt: ["model.safetensors".to_string()].into(),
            ..Default::default()
        },
        "sha256",
    );
}

#[test]
fn a_wrong_size_is_refused_and_nothing_stays() {
    let f = fixture();
    refused(
        &f,
        Faults {
            oversize: ["model.safetensors".to_string()].into(),
            ..Default::default()
        },
        "bytes received where the Hub announced 300000",
    );
}

#[test]
fn each_refusal_has_its_own_message() {
    let f = fixture();
    f.hub.gate("org/tiny-st", &["good-token"]);
    let e = pull(&f.cfg(), &f.req("org/tiny-st")).unwrap_err();
    assert!(matches!(e, HubError::GatedNeedsToken { .. }), "{e}");
    assert!(
        e.to_string().contains("accept its licence at http://") && e.to_string().contains("log in"),
        "{e}"
    );
    let mut cfg = f.cfg();
    cfg.token = Some("other-token".into());
    let e = pull(&cfg, &f.req("org/tiny-st")).unwrap_err();
    assert!(matches!(e, HubError::GatedNoAccess { .. }), "{e}");
    assert!(
        e.to_string().contains("no access") && e.to_string().contains("403"),
        "{e}"
    );

    let e = pull(&f.cfg(), &f.req("org/no-such-repo")).unwrap_err();
    assert!(matches!(e, HubError::RepoNotFound { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("repository org/no-such-repo not found")
            && e.to_string().contains("check the name"),
        "{e}"
    );

    let e = pull(&f.cfg(), &f.req("org/tiny-GGUF@no-such-branch")).unwrap_err();
    assert!(matches!(e, HubError::RevisionNotFound { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("revision 'no-such-branch' not found in org/tiny-GGUF"),
        "{e}"
    );

    let client = Client::new(&f.hub.endpoint(), None);
    let e = client
        .file_meta(
            &RepoRef::parse("org/tiny-GGUF").unwrap().id,
            "main",
            "missing.gguf",
        )
        .unwrap_err();
    assert!(matches!(e, HubError::FileNotFound { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("file 'missing.gguf' not found in org/tiny-GGUF at revision main"),
        "{e}"
    );
}

#[test]
fn the_token_goes_to_the_hub_and_never_to_the_cdn() {
    let f = fixture();
    f.hub.gate("org/tiny-st", &["good-token"]);
    let mut cfg = f.cfg();
    cfg.token = Some("good-token".into());
    pull(&cfg, &f.req("org/tiny-st")).unwrap();
    let seen = f.hub.requests();
    assert!(
        seen.iter().any(|r| r.host == Host::Cdn),
        "the LFS file came through the redirect"
    );
    assert!(!f.hub.cdn_saw_authorization(), "{seen:?}");
    assert!(seen
        .iter()
        .filter(|r| r.host == Host::Hub)
        .all(|r| r.authorization.as_deref() == Some("Bearer good-token")));
}

#[test]
fn a_revision_is_recorded_in_refs() {
    let f = fixture();
    f.hub.add_ref("org/tiny-st", "v1.0");
    let p = pull(&f.cfg(), &f.req("org/tiny-st@v1.0")).unwrap();
    let repo = f.repo_dir("models--org--tiny-st");
    assert_eq!(
        fs::read_to_string(repo.join("refs/v1.0")).unwrap(),
        p.commit
    );
    // By commit, offline.
    let mut off = f.cfg();
    off.offline = true;
    let by_commit = find_cached(&off, &f.req(&format!("org/tiny-st@{}", p.commit))).unwrap();
    assert_eq!(by_commit.snapshot, p.snapshot);
}

#[test]
fn offline_uses_the_cache_and_names_what_is_missing() {
    let f = fixture();
    let online = pull(&f.cfg(), &f.req("org/tiny-GGUF:Q8_0")).unwrap();
    let mut off = f.cfg();
    off.offline = true;
    f.hub.clear_requests();
    let p = pull(&off, &f.req("org/tiny-GGUF:Q8_0")).unwrap();
    assert_eq!(p.model_path, online.model_path);
    assert!(f.hub.requests().is_empty(), "offline made requests");
    let e = pull(&off, &f.req("org/tiny-st")).unwrap_err().to_string();
    assert!(
        e.contains("offline") && e.contains("org/tiny-st is not in the cache"),
        "{e}"
    );
    let e = pull(&off, &f.req("org/tiny-GGUF:Q4_K_M"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no GGUF file of type Q4_K_M") && e.contains("m-Q8_0-00001-of-00002.gguf"),
        "{e}"
    );
    let e = pull(&off, &f.req("org/tiny-GGUF@v2"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not its revision 'v2'"), "{e}");
    fs::remove_file(online.snapshot.join("m-Q8_0-00002-of-00002.gguf")).unwrap();
    let e = pull(&off, &f.req("org/tiny-GGUF:Q8_0"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing m-Q8_0-00002-of-00002.gguf"), "{e}");
    assert!(f.hub.requests().is_empty());
}

#[test]
fn concurrent_pulls_of_one_repo_share_the_blobs() {
    let f = fixture();
    let cfg = f.cfg();
    let threads: Vec<_> = (0..3)
        .map(|_| {
            let cfg = cfg.clone();
            let req = f.req("org/tiny-st");
            std::thread::spawn(move || pull(&cfg, &req).map(|p| p.snapshot))
        })
        .collect();
    for t in threads {
        let snap = t.join().unwrap().unwrap();
        assert_eq!(fs::read(snap.join("model.safetensors")).unwrap(), f.weights);
    }
    assert_eq!(f.blobs("models--org--tiny-st").len(), 3);
    // huggingface_hub's lock files, where it puts them.
    let locks = f.dir.path().join("hub/.locks/models--org--tiny-st");
    assert!(locks
        .join(format!("{}.lock", sha256_hex(&f.weights)))
        .is_file());
}
