//! Agent tools and approvals on a temporary workspace.

use std::time::{Duration, Instant};

use serde_json::json;

use super::*;

fn setup() -> (tempfile::TempDir, tempfile::TempDir, Agent) {
    let ws = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(ws.path().join("a.txt"), "one\ntwo\nthree\n").unwrap();
    std::fs::create_dir(ws.path().join("sub")).unwrap();
    std::fs::write(ws.path().join("sub/b.rs"), "fn main() {}\n// two\n").unwrap();
    std::fs::write(outside.path().join("secret.txt"), "secret").unwrap();
    std::os::unix::fs::symlink(outside.path(), ws.path().join("escape")).unwrap();
    std::os::unix::fs::symlink(
        outside.path().join("secret.txt"),
        ws.path().join("link.txt"),
    )
    .unwrap();
    let mut cfg = AgentConfig::new(ws.path()).unwrap();
    cfg.command_timeout = Duration::from_millis(500);
    cfg.approval_timeout = Duration::from_millis(300);
    (ws, outside, Agent::new(cfg))
}

fn done(o: Outcome) -> Result<String, ToolError> {
    match o {
        Outcome::Done(r) => r,
        other => panic!("expected a result, got {other:?}"),
    }
}

#[test]
fn read_only_tools_run_at_once() {
    let (_ws, _o, a) = setup();
    let l = done(a.call("c", "list_dir", &json!({"path": "."}))).unwrap();
    assert_eq!(l, "a.txt\nescape@\nlink.txt@\nsub/");
    let r = done(a.call(
        "c",
        "read_file",
        &json!({"path": "a.txt", "start_line": 2, "end_line": 3}),
    ))
    .unwrap();
    assert_eq!(r, "2: two\n3: three");
    let s = done(a.call("c", "search", &json!({"pattern": "tw[o]"}))).unwrap();
    assert_eq!(s, "a.txt:2: two\nsub/b.rs:2: // two");
    assert!(done(a.call("c", "search", &json!({"pattern": "("}))).is_err());
}

#[test]
fn escapes_are_refused() {
    let (_ws, o, a) = setup();
    for (tool, args) in [
        ("read_file", json!({"path": "../secret.txt"})),
        ("read_file", json!({"path": "sub/../../x"})),
        ("read_file", json!({"path": "escape/secret.txt"})),
        ("read_file", json!({"path": "link.txt"})),
        ("list_dir", json!({"path": "escape"})),
        (
            "write_file",
            json!({"path": "escape/new.txt", "content": "x"}),
        ),
        ("write_file", json!({"path": "../new.txt", "content": "x"})),
        (
            "edit_file",
            json!({"path": "link.txt", "old_text": "secret", "new_text": "x"}),
        ),
    ] {
        match a.call("c", tool, &args) {
            Outcome::Done(Err(ToolError::Refused(m))) => assert!(m.contains("path"), "{m}"),
            other => panic!("{tool} {args}: {other:?}"),
        }
    }
    // An absolute path means the workspace root, never the machine's.
    let r = done(a.call("c", "read_file", &json!({"path": "/a.txt"}))).unwrap();
    assert!(r.starts_with("1: one"));
    assert!(done(a.call("c", "read_file", &json!({"path": "/etc/passwd"}))).is_err());
    assert!(!o.path().join("new.txt").exists());
    assert_eq!(
        std::fs::read_to_string(o.path().join("secret.txt")).unwrap(),
        "secret"
    );
}

#[test]
fn changes_wait_for_approval() {
    let (ws, _o, a) = setup();
    let Outcome::Pending(id) = a.call(
        "c",
        "write_file",
        &json!({"path": "notes.txt", "content": "hi\n"}),
    ) else {
        panic!()
    };
    assert!(
        !ws.path().join("notes.txt").exists(),
        "nothing runs before the decision"
    );
    let p = a.get(&id).unwrap();
    assert_eq!(
        p.preview,
        "--- /dev/null\n+++ b/notes.txt\n@@ -0,0 +1,1 @@\n+hi\n"
    );
    let r = done(a.decide(&id, Decision::Approve).unwrap()).unwrap();
    assert!(r.contains("wrote 3 bytes"), "{r}");
    assert_eq!(
        std::fs::read_to_string(ws.path().join("notes.txt")).unwrap(),
        "hi\n"
    );
    assert!(
        a.decide(&id, Decision::Approve).is_none(),
        "a decision is used once"
    );

    let Outcome::Pending(id) = a.call(
        "c",
        "edit_file",
        &json!({"path": "a.txt", "old_text": "two", "new_text": "2"}),
    ) else {
        panic!()
    };
    assert!(a.get(&id).unwrap().preview.contains("-two\n+2\n"));
    assert_eq!(
        a.decide(&id, Decision::Deny),
        Some(Outcome::Denied("the person denied this action".into()))
    );
    assert!(std::fs::read_to_string(ws.path().join("a.txt"))
        .unwrap()
        .contains("two"));
    // An edit that cannot apply fails before anyone is asked.
    assert!(done(a.call(
        "c",
        "edit_file",
        &json!({"path": "a.txt", "old_text": "nine", "new_text": "9"})
    ))
    .is_err());
}

#[test]
fn denied_commands_do_not_run_and_always_is_per_chat() {
    let (ws, _o, a) = setup();
    let cmd = json!({"command": "touch ran.txt"});
    let Outcome::Pending(id) = a.call("c", "run_command", &cmd) else {
        panic!()
    };
    assert_eq!(a.get(&id).unwrap().preview, "$ touch ran.txt");
    assert!(matches!(
        a.decide(&id, Decision::Deny),
        Some(Outcome::Denied(_))
    ));
    assert!(!ws.path().join("ran.txt").exists());
    let Outcome::Pending(id) = a.call("c", "run_command", &cmd) else {
        panic!()
    };
    let r = done(a.decide(&id, Decision::Always).unwrap()).unwrap();
    assert!(r.starts_with("exit status 0"), "{r}");
    assert!(ws.path().join("ran.txt").exists());
    // Always allowed in chat "c" now, not in another chat, and not for other tools.
    assert!(matches!(
        a.call("c", "run_command", &json!({"command": "true"})),
        Outcome::Done(Ok(_))
    ));
    assert!(matches!(
        a.call("d", "run_command", &cmd),
        Outcome::Pending(_)
    ));
    assert!(matches!(
        a.call("c", "write_file", &json!({"path": "x", "content": ""})),
        Outcome::Pending(_)
    ));
}

#[test]
fn pending_approvals_expire_as_denied() {
    let (ws, _o, a) = setup();
    let Outcome::Pending(id) = a.call(
        "c",
        "write_file",
        &json!({"path": "late.txt", "content": "x"}),
    ) else {
        panic!()
    };
    assert_eq!(a.pending().len(), 1);
    std::thread::sleep(Duration::from_millis(350));
    assert!(a.pending().is_empty());
    assert!(matches!(
        a.decide(&id, Decision::Approve),
        None | Some(Outcome::Denied(_))
    ));
    assert!(!ws.path().join("late.txt").exists());
}

#[test]
fn commands_are_killed_at_the_time_limit_and_output_is_capped() {
    let (ws, _o, a) = setup();
    let t0 = Instant::now();
    let r = exec::run_command(
        ws.path(),
        "sleep 30; echo never",
        Duration::from_millis(300),
    )
    .unwrap();
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert!(r.starts_with("killed after 0.3 s"), "{r}");
    assert!(!r.contains("never"));
    // A background child in the same group dies with it.
    let r = exec::run_command(
        ws.path(),
        "(sleep 30; touch child.txt) & sleep 30",
        Duration::from_millis(300),
    )
    .unwrap();
    assert!(r.starts_with("killed"), "{r}");
    let r = exec::run_command(
        ws.path(),
        "yes x | head -c 100000; echo err >&2; exit 3",
        Duration::from_secs(10),
    )
    .unwrap();
    assert!(r.starts_with("exit status 3"), "{r}");
    assert!(
        r.contains(&format!(
            "({} more bytes of stdout dropped)",
            100_000 - exec::OUTPUT_CAP
        )),
        "{}",
        &r[r.len() - 200..]
    );
    assert!(r.ends_with("--- stderr\nerr\n"), "{}", &r[r.len() - 100..]);
    assert!(!ws.path().join("child.txt").exists());
    let _ = a;
}
