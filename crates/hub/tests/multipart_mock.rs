//! The LFS multipart transfer against the mock Hub on loopback: a file above the mock's
//! multipart threshold goes up in `chunk_size` parts (PUT to the storage host without the
//! token, completion with every part's ETag, then verify) and pulls back byte for byte; a part
//! answered without an ETag, or with a wrong one, is refused with an error that says which part,
//! and nothing is committed.

mod common;

use common::bytes;

use std::fs;
use std::path::Path;

use hf2q_hub::mock::{Faults, Host, MockHub, PartFault};
use hf2q_hub::{pull, push, HubConfig, HubError, PullRequest, PushRequest, RepoId, RepoRef};

const CHUNK: u64 = 40_000;
const SIZE: usize = 3 * CHUNK as usize + 12_345;

fn setup(hub: &MockHub, dir: &Path) -> (HubConfig, PushRequest, Vec<u8>) {
    hub.set_multipart(Some((100_000, CHUNK)));
    let src = dir.join("model");
    fs::create_dir_all(&src).unwrap();
    let big = bytes(SIZE, 11);
    fs::write(src.join("model-Q8_0.gguf"), &big).unwrap();
    fs::write(src.join("small.gguf"), bytes(5_000, 12)).unwrap();
    fs::write(src.join("config.json"), b"{}").unwrap();
    let mut c = HubConfig::new(&dir.join("cache"));
    c.endpoint = hub.endpoint();
    c.token = Some("tok".into());
    let r = PushRequest {
        path: src,
        repo: RepoId::parse("me/big").unwrap(),
        revision: None,
        private: false,
        message: None,
        card: None,
    };
    (c, r, big)
}

#[test]
fn a_large_file_goes_in_parts_and_pulls_back_byte_for_byte() {
    let hub = MockHub::start();
    let d = tempfile::tempdir().unwrap();
    let (c, r, big) = setup(&hub, d.path());
    let p = push(&c, &r).unwrap();
    assert_eq!(p.lfs_bytes_sent, SIZE as u64 + 5_000);

    let seen = hub.requests();
    let parts: Vec<_> = seen
        .iter()
        .filter(|s| s.method == "PUT" && s.path.starts_with("/lfs-part/"))
        .collect();
    assert_eq!(parts.len(), 4, "ceil({SIZE} / {CHUNK}) parts");
    assert!(parts.iter().all(|s| s.host == Host::Cdn));
    // The small file still went in one PUT.
    assert_eq!(
        seen.iter()
            .filter(|s| s.method == "PUT" && s.path.starts_with("/lfs-upload/"))
            .count(),
        1
    );
    // No token at the storage host, nor at the presigned completion URL; verify has it.
    assert!(!hub.cdn_saw_authorization());
    let done = seen
        .iter()
        .find(|s| s.path.starts_with("/api/complete_multipart/"))
        .unwrap();
    assert_eq!(done.host, Host::Hub);
    assert!(done.authorization.is_none());
    let verify = seen
        .iter()
        .filter(|s| s.path.ends_with("/info/lfs/objects/verify"))
        .collect::<Vec<_>>();
    assert_eq!(verify.len(), 2);
    assert!(verify
        .iter()
        .all(|s| s.authorization.as_deref() == Some("Bearer tok")));

    let mut pr = PullRequest::new(RepoRef::parse("me/big").unwrap());
    pr.include = vec!["*".into()];
    let got = pull(&c, &pr).unwrap();
    assert_eq!(fs::read(got.snapshot.join("model-Q8_0.gguf")).unwrap(), big);

    // Stored now: a second push sends nothing.
    hub.clear_requests();
    assert_eq!(push(&c, &r).unwrap().lfs_bytes_sent, 0);
    assert!(hub.requests().iter().all(|s| s.method != "PUT"));
}

#[test]
fn a_missing_or_wrong_part_etag_is_refused_and_nothing_is_committed() {
    for (fault, says) in [
        (PartFault::Missing(2), "part 2 of 4: the storage host"),
        (PartFault::Wrong(3), "of part 3 is not the part's"),
    ] {
        let hub = MockHub::start();
        let d = tempfile::tempdir().unwrap();
        let (c, r, _) = setup(&hub, d.path());
        hub.set_faults(Faults {
            part_etag: Some(fault),
            ..Faults::default()
        });
        let e = push(&c, &r).unwrap_err();
        assert!(matches!(e, HubError::UploadRefused { .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("model-Q8_0.gguf") && msg.contains(says),
            "{fault:?}: {msg}"
        );
        if let PartFault::Missing(_) = fault {
            assert!(msg.contains("without an ETag"), "{msg}");
        } else {
            assert!(
                msg.contains("completing its 4-part upload answered HTTP 400"),
                "{msg}"
            );
        }
        let files = hub.files("me/big", "main").unwrap();
        assert!(!files.contains_key("model-Q8_0.gguf"), "{fault:?}");
        assert!(!hub.cdn_saw_authorization());
    }
}
