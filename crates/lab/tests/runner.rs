//! The runner's contract on a real SQLite file and real child processes: a shell script stands
//! in for `hf2q` (it is called with the argv the kinds table builds: `quantize MODEL OUT ...`)
//! and behaves as its "model" name says, so lifecycles, crashes, kills, leases and queues are
//! exercised in milliseconds. The real binary's jobs are tested in the CLI's `lab_api` test.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hf2q_lab::{Event, Job, Lab, LabConfig, State};
use serde_json::{json, Value};

const SCRIPT: &str = r#"#!/bin/sh
model="$2"; out="$3"; trace="$(dirname "$out")/../trace.log"
case "$model" in
  fast) echo '{"event":"progress","done":1,"total":1}'; echo "plain line"; printf done > "$out" ;;
  slow) i=0; while [ $i -lt 300 ]; do echo "{\"event\":\"progress\",\"done\":$i}"; printf x >> "$out"; sleep 0.05; i=$((i+1)); done; printf done > "$out" ;;
  crash) echo "loading" >&2; echo "thread 'main' panicked at model.rs" >&2; exit 101 ;;
  lease) echo "$(date +%s%N) start" >> "$trace"; sleep 0.2; echo "$(date +%s%N) end" >> "$trace"; printf done > "$out" ;;
  burst) i=0; while [ $i -lt 400 ]; do echo "{\"event\":\"progress\",\"done\":$i}"; i=$((i+1)); done; printf done > "$out" ;;
esac
"#;

struct Fixture {
    dir: tempfile::TempDir,
    bin: PathBuf,
}

impl Fixture {
    fn new() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("fake-hf2q");
        std::fs::write(&bin, SCRIPT).unwrap();
        let mut perm = std::fs::metadata(&bin).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
        std::fs::set_permissions(&bin, perm).unwrap();
        Fixture { dir, bin }
    }
    fn home(&self) -> PathBuf {
        self.dir.path().join("home")
    }
    fn lab(&self, cpu_jobs: usize) -> Lab {
        Lab::open(LabConfig {
            home: self.home(),
            bin: self.bin.clone(),
            cpu_jobs,
            grace: Duration::from_secs(2),
            builtin_models: ["fast", "slow", "crash", "lease", "burst"]
                .map(String::from)
                .to_vec(),
        })
        .unwrap()
    }
}

fn quantize(model: &str, out: &str) -> Value {
    json!({"model": model, "type": "Q4_0", "output": out})
}

fn wait(lab: &Lab, id: i64, what: impl Fn(&Job) -> bool) -> Job {
    let t0 = Instant::now();
    loop {
        let j = lab.get(id).unwrap();
        if what(&j) {
            return j;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "job {id} stuck: {j:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn final_state(lab: &Lab, id: i64) -> Job {
    wait(lab, id, |j| j.state.is_final())
}

fn events(lab: &Lab, id: i64) -> Vec<Event> {
    lab.events().read_from(id, 0).unwrap().0
}

fn states(evs: &[Event]) -> Vec<String> {
    evs.iter()
        .filter(|e| e.kind == "state")
        .map(|e| e.data["state"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn a_job_runs_publishes_its_output_and_survives_a_reopen() {
    let f = Fixture::new();
    let lab = f.lab(2);
    let j = lab.submit("quantize", quantize("fast", "small")).unwrap();
    assert_eq!(j.state, State::Queued);
    let j = final_state(&lab, j.id);
    assert_eq!(j.state, State::Succeeded, "{j:?}");
    assert_eq!(j.exit_status, Some(0));
    assert_eq!(j.outputs, ["models/small.gguf"]);
    assert_eq!(
        std::fs::read_to_string(f.home().join("models/small.gguf")).unwrap(),
        "done"
    );
    assert!(j.started.unwrap() >= j.created && j.ended.unwrap() >= j.started.unwrap());
    let evs = events(&lab, j.id);
    assert_eq!(
        evs.iter().map(|e| e.seq).collect::<Vec<_>>(),
        (1..=evs.len() as u64).collect::<Vec<_>>()
    );
    assert_eq!(states(&evs), ["queued", "running", "succeeded"]);
    assert!(evs
        .iter()
        .any(|e| e.kind == "progress" && e.data["done"] == 1));
    assert!(evs
        .iter()
        .any(|e| e.kind == "log" && e.data["line"] == "plain line"));
    // The same name again is refused before it is queued: outputs are never overwritten.
    let e = lab
        .submit("quantize", quantize("fast", "small"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("already exists"), "{e}");
    lab.shutdown();
    drop(lab);
    let again = f.lab(2);
    let j2 = again.get(j.id).unwrap();
    assert_eq!(
        (j2.state, j2.outputs.clone()),
        (State::Succeeded, j.outputs.clone())
    );
    again.delete(j.id).unwrap();
    assert!(again.get(j.id).is_err());
    assert!(
        f.home().join("models/small.gguf").exists(),
        "deleting a job keeps its outputs"
    );
}

#[test]
fn crashed_and_killed_children_fail_and_leave_no_output() {
    let f = Fixture::new();
    let lab = f.lab(2);
    let c = lab.submit("quantize", quantize("crash", "c")).unwrap();
    let c = final_state(&lab, c.id);
    assert_eq!((c.state, c.exit_status), (State::Failed, Some(101)));
    let err = c.error.unwrap();
    assert!(
        err.contains("status 101") && err.contains("panicked at model.rs"),
        "{err}"
    );

    let k = lab.submit("quantize", quantize("slow", "k")).unwrap();
    // Running and already writing its (temporary) output.
    let k = wait(&lab, k.id, |_| {
        events(&lab, k.id)
            .iter()
            .filter(|e| e.kind == "progress")
            .count()
            > 3
    });
    let pid = k.pid.unwrap() as i32;
    let partial = f.home().join(format!("models/.k.gguf.partial-{}", k.id));
    assert!(partial.exists());
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let k = final_state(&lab, k.id);
    assert_eq!(k.state, State::Failed);
    assert!(
        k.error.as_deref().unwrap().contains("signal 9"),
        "{:?}",
        k.error
    );
    assert!(k.outputs.is_empty());
    assert!(!partial.exists() && !f.home().join("models/k.gguf").exists());
    // The Lab lives on.
    let ok = lab.submit("quantize", quantize("fast", "after")).unwrap();
    assert_eq!(final_state(&lab, ok.id).state, State::Succeeded);
}

#[test]
fn cancel_stops_a_running_job_and_a_queued_one() {
    let f = Fixture::new();
    let lab = f.lab(1);
    let a = lab.submit("quantize", quantize("slow", "a")).unwrap();
    let b = lab.submit("quantize", quantize("slow", "b")).unwrap();
    wait(&lab, a.id, |j| j.state == State::Running);
    assert_eq!(lab.get(b.id).unwrap().state, State::Queued, "one CPU slot");
    assert_eq!(lab.cancel(b.id).unwrap().state, State::Cancelled);
    let t0 = Instant::now();
    lab.cancel(a.id).unwrap();
    let a = final_state(&lab, a.id);
    assert_eq!(a.state, State::Cancelled);
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "SIGTERM ends the script at once"
    );
    assert!(a.outputs.is_empty() && !f.home().join("models/a.gguf").exists());
    assert!(lab.cancel(a.id).is_err(), "nothing to cancel");
    assert!(lab.delete(a.id).is_ok());
    // A cancelled job can be resumed: it runs again from the start.
    let r = lab.resume(b.id).unwrap();
    assert_eq!(r.state, State::Queued);
    assert!(lab.delete(b.id).is_err(), "a queued job is not deleted");
    lab.cancel(b.id).unwrap();
    let b = final_state(&lab, b.id);
    assert_eq!(
        states(&events(&lab, b.id))[..3],
        ["queued", "cancelled", "queued"]
    );
}

#[test]
fn two_gpu_jobs_never_run_at_once_and_cpu_jobs_keep_their_limit() {
    let f = Fixture::new();
    let lab = f.lab(8);
    let mut ids = Vec::new();
    for i in 0..4 {
        let mut p = quantize("lease", &format!("g{i}"));
        p["lease"] = json!("gpu");
        ids.push(lab.submit("quantize", p).unwrap().id);
    }
    for id in &ids {
        assert_eq!(final_state(&lab, *id).state, State::Succeeded);
    }
    let trace = std::fs::read_to_string(f.home().join("trace.log")).unwrap();
    let marks: Vec<&str> = trace
        .lines()
        .map(|l| l.split(' ').nth(1).unwrap())
        .collect();
    assert_eq!(marks.len(), 8);
    for pair in marks.chunks(2) {
        assert_eq!(pair, ["start", "end"], "GPU jobs overlapped:\n{trace}");
    }
    // CPU jobs run side by side up to the limit (here 2 of 8 submitted).
    std::fs::remove_file(f.home().join("trace.log")).unwrap();
    lab.shutdown();
    drop(lab);
    let lab = f.lab(2);
    let ids: Vec<i64> = (0..6)
        .map(|i| {
            lab.submit("quantize", quantize("lease", &format!("c{i}")))
                .unwrap()
                .id
        })
        .collect();
    for id in &ids {
        assert_eq!(final_state(&lab, *id).state, State::Succeeded);
    }
    let trace = std::fs::read_to_string(f.home().join("trace.log")).unwrap();
    let (mut now, mut most) = (0i32, 0);
    for l in trace.lines() {
        now += if l.ends_with("start") { 1 } else { -1 };
        most = most.max(now);
    }
    assert_eq!(most, 2, "{trace}");
}

#[test]
fn twenty_jobs_at_once_all_end_and_no_event_is_lost() {
    let f = Fixture::new();
    let lab = f.lab(2);
    let ids: Vec<i64> = (0..20)
        .map(|i| {
            let model = if i % 5 == 4 { "crash" } else { "burst" };
            lab.submit("quantize", quantize(model, &format!("j{i}")))
                .unwrap()
                .id
        })
        .collect();
    for (i, id) in ids.iter().enumerate() {
        let j = final_state(&lab, *id);
        let want = if i % 5 == 4 {
            State::Failed
        } else {
            State::Succeeded
        };
        assert_eq!(j.state, want, "{j:?}");
        if want == State::Succeeded {
            let evs = events(&lab, *id);
            let done: Vec<u64> = evs
                .iter()
                .filter(|e| e.kind == "progress")
                .map(|e| e.data["done"].as_u64().unwrap())
                .collect();
            assert_eq!(
                done,
                (0..400).collect::<Vec<_>>(),
                "job {id} lost progress lines"
            );
        }
    }
}

#[test]
fn a_job_left_running_by_a_dead_server_is_interrupted() {
    let f = Fixture::new();
    {
        let db = hf2q_lab::db::Db::open(&f.home().join("lab/lab.db")).unwrap();
        let j = db.insert("quantize", &quantize("slow", "x")).unwrap();
        // A pid that is not ours (this test's own process runs another binary).
        db.set_running(j.id, std::process::id()).unwrap();
    }
    let lab = f.lab(1);
    let j = lab.get(1).unwrap();
    assert_eq!(j.state, State::Interrupted);
    assert!(j.error.unwrap().contains("server stopped"));
    assert!(Path::new(&f.home().join("lab/events/1.ndjson")).exists());
    let e = Lab::open(LabConfig {
        home: f.home(),
        ..lab.config().clone()
    })
    .err()
    .unwrap();
    assert!(e.to_string().contains("another hf2q server"), "{e}");
}
