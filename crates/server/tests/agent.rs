//! `/api/agent/...` over HTTP on loopback: off without a workspace, read-only tools at once,
//! changes only after an approval, denials that do nothing, escapes refused even when sent
//! straight to the route, the API key and same-origin rules, the approval timeout.

mod common;

use std::time::Duration;

use common::*;
use hf2q_server::agent::AgentConfig;
use serde_json::{json, Value};

fn agent_cfg(ws: &std::path::Path) -> hf2q_server::ServerConfig {
    let mut c = cfg();
    let mut a = AgentConfig::new(ws).unwrap();
    a.approval_timeout = Duration::from_millis(400);
    a.command_timeout = Duration::from_millis(500);
    c.agent = Some(a);
    c
}

async fn call(addr: std::net::SocketAddr, headers: &[(&str, &str)], body: Value) -> Resp {
    http(
        addr,
        "POST",
        "/api/agent/tool",
        headers,
        Some(&body.to_string()),
    )
    .await
}

async fn decide(addr: std::net::SocketAddr, id: &str, d: &str) -> Resp {
    let b = json!({"decision": d}).to_string();
    http(
        addr,
        "POST",
        &format!("/api/agent/approvals/{id}"),
        &[],
        Some(&b),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn off_without_a_workspace() {
    let h = start(tiny(), cfg()).await;
    let r = http(h.addr, "GET", "/api/agent", &[], None).await;
    assert_eq!(r.json()["enabled"], false);
    let r = call(
        h.addr,
        &[],
        json!({"chat_id": "c", "name": "list_dir", "arguments": {}}),
    )
    .await;
    assert_eq!(r.status, 403, "{}", r.text());
    assert!(r.text().contains("--workspace"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tools_approvals_and_escapes() {
    let ws = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(ws.path().join("hello.txt"), "hello\n").unwrap();
    std::os::unix::fs::symlink(outside.path(), ws.path().join("out")).unwrap();
    let h = start(tiny(), agent_cfg(ws.path())).await;
    let a = h.addr;

    let info = http(a, "GET", "/api/agent", &[], None).await.json();
    assert_eq!(info["enabled"], true);
    let names: Vec<&str> = info["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "list_dir",
            "read_file",
            "search",
            "write_file",
            "edit_file",
            "run_command"
        ]
    );

    // Read-only: at once. Arguments as the model wrote them (a JSON string) work too.
    let r = call(
        a,
        &[],
        json!({"chat_id": "c", "name": "list_dir", "arguments": "{\"path\": \".\"}"}),
    )
    .await
    .json();
    assert_eq!(r, json!({"status": "done", "result": "hello.txt\nout@"}));

    // A write waits; the file appears only after the approval.
    let r = call(a, &[], json!({"chat_id": "c", "name": "write_file", "arguments": {"path": "notes.txt", "content": "hi"}})).await.json();
    assert_eq!(r["status"], "pending", "{r}");
    assert!(!ws.path().join("notes.txt").exists());
    let id = r["approval"]["id"].as_str().unwrap().to_string();
    assert!(
        r["approval"]["preview"].as_str().unwrap().contains("+hi"),
        "{r}"
    );
    let listed = http(a, "GET", "/api/agent/approvals", &[], None)
        .await
        .json();
    assert_eq!(listed["data"][0]["id"], id.as_str());
    let d = decide(a, &id, "approve").await.json();
    assert_eq!(d["status"], "done", "{d}");
    assert_eq!(
        std::fs::read_to_string(ws.path().join("notes.txt")).unwrap(),
        "hi"
    );
    assert_eq!(
        decide(a, &id, "approve").await.status,
        404,
        "an approval is used once"
    );

    // A denied command does not run.
    let r = call(
        a,
        &[],
        json!({"chat_id": "c", "name": "run_command", "arguments": {"command": "touch ran.txt"}}),
    )
    .await
    .json();
    let id = r["approval"]["id"].as_str().unwrap().to_string();
    assert_eq!(r["approval"]["preview"], "$ touch ran.txt");
    assert_eq!(decide(a, &id, "deny").await.json()["status"], "denied");
    assert!(!ws.path().join("ran.txt").exists());

    // Escapes are refused by the route itself, before any approval.
    for args in [
        json!({"path": "../x.txt", "content": "x"}),
        json!({"path": "out/x.txt", "content": "x"}),
    ] {
        let r = call(
            a,
            &[],
            json!({"chat_id": "c", "name": "write_file", "arguments": args}),
        )
        .await
        .json();
        assert_eq!(r["status"], "refused", "{r}");
    }
    let r = call(
        a,
        &[],
        json!({"chat_id": "c", "name": "read_file", "arguments": {"path": "out/../../etc/passwd"}}),
    )
    .await
    .json();
    assert_eq!(r["status"], "refused", "{r}");
    assert!(std::fs::read_dir(outside.path()).unwrap().next().is_none());

    // A command past its time limit is killed.
    let r = call(
        a,
        &[],
        json!({"chat_id": "c", "name": "run_command", "arguments": {"command": "sleep 20"}}),
    )
    .await
    .json();
    let id = r["approval"]["id"].as_str().unwrap().to_string();
    let t0 = std::time::Instant::now();
    let d = decide(a, &id, "approve").await.json();
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert!(
        d["result"]
            .as_str()
            .unwrap()
            .starts_with("killed after 0.5 s"),
        "{d}"
    );

    // No decision within the approval timeout: denied, nothing written.
    let r = call(a, &[], json!({"chat_id": "c", "name": "write_file", "arguments": {"path": "late.txt", "content": "x"}})).await.json();
    let id = r["approval"]["id"].as_str().unwrap().to_string();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        http(a, "GET", &format!("/api/agent/approvals/{id}"), &[], None)
            .await
            .status,
        404
    );
    let d = decide(a, &id, "approve").await;
    assert!(
        d.status == 404 || d.json()["status"] == "denied",
        "{}",
        d.text()
    );
    assert!(!ws.path().join("late.txt").exists());

    // Cross-origin browser requests are refused; the page's own origin is fine.
    let own = format!("http://{a}");
    let body = json!({"chat_id": "c", "name": "list_dir", "arguments": {}});
    assert_eq!(
        call(a, &[("Origin", "http://evil.example")], body.clone())
            .await
            .status,
        403
    );
    assert_eq!(
        call(a, &[("Sec-Fetch-Site", "cross-site")], body.clone())
            .await
            .status,
        403
    );
    assert_eq!(call(a, &[("Origin", own.as_str())], body).await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_routes_need_the_api_key() {
    let ws = tempfile::tempdir().unwrap();
    let mut c = agent_cfg(ws.path());
    c.api_key = Some("k".into());
    let h = start(tiny(), c).await;
    let body = json!({"chat_id": "c", "name": "list_dir", "arguments": {}});
    assert_eq!(call(h.addr, &[], body.clone()).await.status, 401);
    assert_eq!(
        http(h.addr, "GET", "/api/agent", &[], None).await.status,
        401
    );
    assert_eq!(
        call(h.addr, &[("Authorization", "Bearer k")], body)
            .await
            .status,
        200
    );
}
