//! The tree listing against the mock Hub on loopback: the documented entry shape (files,
//! folders, `lfs` for LFS files), `recursive`, a folder path, pages followed through the `Link`
//! header, a missing folder's error, a pull from a Hub whose repo info has no `siblings`, a
//! gated dataset's licence page, and LFS files pulled from one folder listing without a HEAD each.

use hf2q_hub::api::Client;
use hf2q_hub::mock::{Host, MockHub};
use hf2q_hub::tree::EntryType;
use hf2q_hub::{pull, HubConfig, HubError, PullRequest, RepoId, RepoKind, RepoRef};

fn repo(hub: &MockHub) -> Vec<u8> {
    let weights = vec![7u8; 4096];
    hub.add_repo(
        "org/nested",
        &[
            ("config.json", b"{}"),
            ("model.safetensors", &weights),
            ("tokenizer.json", b"{}"),
            ("sub/a.txt", b"a"),
            ("sub/deeper/b.txt", b"bb"),
        ],
    );
    weights
}

fn id(s: &str) -> RepoId {
    RepoRef::parse(s).unwrap().id
}

#[test]
fn lists_recursively_over_pages() {
    let hub = MockHub::start();
    let weights = repo(&hub);
    hub.set_tree_page_size(2);
    let c = Client::new(&hub.endpoint(), None);
    let all = c.tree(&id("org/nested"), "main", "", true).unwrap();
    let paths: Vec<(&str, EntryType)> = all.iter().map(|e| (e.path.as_str(), e.kind)).collect();
    assert_eq!(
        paths,
        vec![
            ("config.json", EntryType::File),
            ("model.safetensors", EntryType::File),
            ("sub", EntryType::Directory),
            ("sub/a.txt", EntryType::File),
            ("sub/deeper", EntryType::Directory),
            ("sub/deeper/b.txt", EntryType::File),
            ("tokenizer.json", EntryType::File),
        ]
    );
    // Seven entries, two a page: four requests, each page named by the previous one's Link.
    let pages = hub
        .requests()
        .iter()
        .filter(|r| r.host == Host::Hub && r.path.contains("/tree/"))
        .count();
    assert_eq!(pages, 4);
    let st = all.iter().find(|e| e.path == "model.safetensors").unwrap();
    let lfs = st.lfs.as_ref().expect("a safetensors file is an LFS file");
    assert_eq!(lfs.size, weights.len() as u64);
    assert_eq!(lfs.oid.len(), 64);
    assert!(lfs.pointer_size > 100);
    let small = all.iter().find(|e| e.path == "sub/deeper/b.txt").unwrap();
    assert_eq!((small.size, small.lfs.is_none()), (2, true));

    // Direct children only, and a folder's.
    let top = c.tree(&id("org/nested"), "main", "", false).unwrap();
    assert_eq!(top.len(), 4, "{top:?}");
    let sub = c.tree(&id("org/nested"), "main", "sub", false).unwrap();
    let names: Vec<&str> = sub.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(names, vec!["sub/a.txt", "sub/deeper"]);

    // A missing folder or revision says which.
    let e = c.tree(&id("org/nested"), "main", "nope", true).unwrap_err();
    assert!(matches!(e, HubError::FileNotFound { .. }), "{e}");
    let e = c.tree(&id("org/nested"), "v9", "", true).unwrap_err();
    assert!(matches!(e, HubError::RevisionNotFound { .. }), "{e}");
}

#[test]
fn pull_lists_the_tree_when_siblings_are_missing() {
    let hub = MockHub::start();
    let weights = repo(&hub);
    hub.omit_siblings(true);
    hub.set_tree_page_size(3);
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = HubConfig::new(dir.path());
    cfg.endpoint = hub.endpoint();
    let p = pull(
        &cfg,
        &PullRequest::new(RepoRef::parse("org/nested").unwrap()),
    )
    .unwrap();
    assert_eq!(
        p.files,
        vec!["config.json", "model.safetensors", "tokenizer.json"]
    );
    assert_eq!(
        std::fs::read(p.snapshot.join("model.safetensors")).unwrap(),
        weights
    );
    assert!(hub.requests().iter().any(|r| r.path.contains("/tree/")));

    // Datasets list the same way.
    hub.add_repo(
        "datasets/org/d",
        &[("data/train.jsonl", b"{\"text\": \"x\"}\n")],
    );
    let d = id("org/d").of_kind(RepoKind::Dataset);
    let c = Client::new(&hub.endpoint(), None);
    let info = c.repo_info(&d, "main").unwrap();
    assert!(info.siblings.is_none());
    assert_eq!(c.repo_files(&d, &info).unwrap(), vec!["data/train.jsonl"]);

    // A gated dataset's licence page is under /datasets/.
    hub.gate("datasets/org/d", &["ok"]);
    let e = c.repo_info(&d, "main").unwrap_err().to_string();
    assert!(
        e.contains(&format!("{}/datasets/org/d", hub.endpoint())),
        "{e}"
    );
}

/// Shards of one folder need no HEAD each: one listing of the folder gives their sha256 and size,
/// the blobs get the names a HEAD would give (`X-Linked-Etag`, the sha256), and a corrupt shard
/// is still refused by its sha256. Regular files keep their HEAD (their blob name is the git
/// blob id, which the download does not check).
#[test]
fn lfs_files_of_a_listed_folder_are_pulled_without_a_head_each() {
    let hub = MockHub::start();
    let shards: Vec<Vec<u8>> = (0..3u8).map(|i| vec![i + 1; 3000 + i as usize]).collect();
    let names = [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ];
    let index = serde_json::json!({"weight_map": {"a": names[0], "b": names[1], "c": names[2]}})
        .to_string();
    let mut files: Vec<(&str, &[u8])> = vec![
        ("config.json", b"{}"),
        ("tokenizer.json", b"{}"),
        ("model.safetensors.index.json", index.as_bytes()),
    ];
    for (n, d) in names.iter().zip(&shards) {
        files.push((n, d));
    }
    hub.add_repo("org/sharded", &files);
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = HubConfig::new(dir.path());
    cfg.endpoint = hub.endpoint();
    let req = PullRequest::new(RepoRef::parse("org/sharded").unwrap());
    let p = pull(&cfg, &req).unwrap();
    for (n, d) in names.iter().zip(&shards) {
        assert_eq!(&std::fs::read(p.snapshot.join(n)).unwrap(), d, "{n}");
        // The blob is named by the sha256, as the HEAD's X-Linked-Etag names it.
        let meta = Client::new(&hub.endpoint(), None)
            .file_meta(&id("org/sharded"), &p.commit, n)
            .unwrap();
        let target = std::fs::read_link(p.snapshot.join(n)).unwrap();
        assert!(target.ends_with(&meta.etag), "{target:?} vs {}", meta.etag);
    }
    let seen = hub.requests();
    let heads: Vec<&str> = seen
        .iter()
        .filter(|r| r.method == "HEAD")
        .map(|r| r.path.as_str())
        .collect();
    // The three from the checks above, and one per regular file of the pull.
    assert_eq!(heads.len(), 3 + 3, "{heads:?}");
    assert_eq!(
        heads.iter().filter(|h| h.ends_with(".safetensors")).count(),
        3,
        "{heads:?}"
    );
    assert_eq!(seen.iter().filter(|r| r.path.contains("/tree/")).count(), 1);

    // A corrupt shard fetched this way is refused, and nothing of it stays in the cache.
    let dir2 = tempfile::tempdir().unwrap();
    let mut cfg2 = HubConfig::new(dir2.path());
    cfg2.endpoint = hub.endpoint();
    hub.set_faults(hf2q_hub::mock::Faults {
        corrupt: [names[1].to_string()].into(),
        ..Default::default()
    });
    let e = pull(&cfg2, &req).unwrap_err();
    assert!(matches!(e, HubError::HashMismatch { .. }), "{e}");
    let blobs = dir2.path().join("models--org--sharded/blobs");
    for b in std::fs::read_dir(&blobs).unwrap().flatten() {
        let data = std::fs::read(b.path()).unwrap();
        assert_ne!(data.len(), shards[1].len(), "{:?}", b.path());
    }
}
