//! `run_command`: a shell command (`sh -c`) run in the workspace root, in a process group of
//! its own, with a time limit after which the whole group is killed, and its output capped.
//!
//! Blocking (the server calls it from a blocking task, the CLI directly). Standard input is
//! closed; stdout and stderr are read concurrently (a full pipe would block the command) and
//! kept up to [`OUTPUT_CAP`] bytes each, the rest counted and dropped.
//!
//! What it is not: a sandbox. The command runs with the rights of the server's user; the gate
//! is the person's approval, not this module.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{ToolError, ToolResult};

/// Bytes kept of each of stdout and stderr.
pub const OUTPUT_CAP: usize = 16 << 10;

/// Reads `r` to its end, keeping the first `cap` bytes; returns them and the total count.
fn drain(mut r: impl Read, cap: usize) -> (Vec<u8>, usize) {
    let mut kept = Vec::new();
    let mut buf = [0u8; 8192];
    let mut total = 0;
    while let Ok(n) = r.read(&mut buf) {
        if n == 0 {
            break;
        }
        total += n;
        let room = cap.saturating_sub(kept.len());
        kept.extend_from_slice(&buf[..n.min(room)]);
    }
    (kept, total)
}

fn show(name: &str, (kept, total): (Vec<u8>, usize)) -> String {
    let mut s = String::from_utf8_lossy(&kept).to_string();
    if total > kept.len() {
        s.push_str(&format!(
            "\n... ({} more bytes of {name} dropped)",
            total - kept.len()
        ));
    }
    s
}

/// Runs `command` in `root`; the result text has the exit status, stdout and stderr. A command
/// still running after `timeout` is killed (its whole process group) and reported as such.
pub fn run_command(root: &Path, command: &str, timeout: Duration) -> ToolResult {
    use std::os::unix::process::CommandExt;
    if command.trim().is_empty() {
        return Err(ToolError::Failed("the command is empty".into()));
    }
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(command)
        .current_dir(root)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .map_err(|e| ToolError::Failed(format!("cannot start sh: {e}")))?;
    let pgid = child.id() as i32;
    let out = child
        .stdout
        .take()
        .map(|o| std::thread::spawn(move || drain(o, OUTPUT_CAP)));
    let err = child
        .stderr
        .take()
        .map(|e| std::thread::spawn(move || drain(e, OUTPUT_CAP)));
    let t0 = Instant::now();
    let mut timed_out = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if t0.elapsed() >= timeout => {
                timed_out = true;
                // SAFETY: plain syscall on the group this function created (the child leads it).
                unsafe {
                    libc::kill(-pgid, libc::SIGKILL);
                }
                break child.wait().ok();
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => return Err(ToolError::Failed(format!("waiting for the command: {e}"))),
        }
    };
    // The readers end when every holder of the pipes has exited (the whole group is gone
    // after a kill; a process that left the group with setsid would keep them open).
    let join = |h: Option<std::thread::JoinHandle<(Vec<u8>, usize)>>| {
        h.and_then(|h| h.join().ok()).unwrap_or_default()
    };
    let (stdout, stderr) = (join(out), join(err));
    let head = if timed_out {
        format!("killed after {} s (time limit)", timeout.as_secs_f32())
    } else {
        match status.and_then(|s| s.code()) {
            Some(c) => format!("exit status {c}"),
            None => "killed by a signal".into(),
        }
    };
    Ok(format!(
        "{head}\n--- stdout\n{}\n--- stderr\n{}",
        show("stdout", stdout),
        show("stderr", stderr)
    ))
}
