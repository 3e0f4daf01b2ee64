//! Every file the CLI writes is complete or absent whatever happens to the process or the disk:
//! each writer runs as a child under a file-size limit (RLIMIT_FSIZE) below its output's size,
//! and is SIGKILLed at seeded points; afterwards the target is absent (or its earlier content is
//! unchanged) or complete and valid, the error names the path and the cause, and the next run
//! leaves no temporary file beside the target. Also the Lab's SQLite database and NDJSON logs
//! after a killed writer. Not here: what the outputs compute (the writers' own tests).

mod common;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::{fixture, s};

/// `hf2q ARGS` with `$HF2Q_HOME` = `home`, under a file-size limit of `limit` bytes if given.
fn cmd(home: &Path, args: &[&str], limit: Option<u64>) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_hf2q"));
    c.env("HF2Q_HOME", home)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(n) = limit {
        // SAFETY: only setrlimit (async-signal-safe) between fork and exec.
        unsafe {
            c.pre_exec(move || {
                let r = libc::rlimit {
                    rlim_cur: n as libc::rlim_t,
                    rlim_max: n as libc::rlim_t,
                };
                if libc::setrlimit(libc::RLIMIT_FSIZE, &r) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    c
}

fn run(home: &Path, args: &[&str], limit: Option<u64>) -> Output {
    cmd(home, args, limit).output().unwrap()
}

fn ok(home: &Path, args: &[&str]) {
    let o = run(home, args, None);
    assert!(o.status.success(), "{args:?}: {}", err(&o));
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs under `limit` and expects a clean failure naming `target` (its file name: folders are
/// built under a temporary name that contains it) and the cause.
fn fails_full(home: &Path, args: &[&str], limit: u64, target: &Path) -> String {
    let o = run(home, args, Some(limit));
    let e = err(&o);
    let name = target.file_name().unwrap().to_string_lossy().to_string();
    assert!(!o.status.success(), "{args:?} under {limit} B succeeded");
    assert!(e.contains(&name), "{args:?}: '{name}' not in: {e}");
    assert!(e.contains("File too large"), "{args:?}: no cause in: {e}");
    assert!(!e.contains("panicked"), "{args:?}: {e}");
    e.lines().last().unwrap_or_default().to_string()
}

/// [`fails_full`] with no target (a new one) and no temporary left beside it.
fn fails_leaving_nothing(home: &Path, args: &[&str], limit: u64, target: &Path) {
    fails_full(home, args, limit, target);
    assert!(
        !target.exists(),
        "{} left after a failure",
        target.display()
    );
    no_temps(target.parent().unwrap());
}

/// Spawns `hf2q ARGS` and kills it (SIGKILL) `us` microseconds after a temporary name first
/// appears under `dir` (or after `us` if none appears before it exits), then reaps it.
fn killed(home: &Path, args: &[&str], dir: &Path, us: u64) {
    let mut c = cmd(home, args, None).stderr(Stdio::null()).spawn().unwrap();
    let start = std::time::Instant::now();
    while temps(dir).is_empty() && start.elapsed() < Duration::from_secs(20) {
        if c.try_wait().unwrap().is_some() {
            return;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    std::thread::sleep(Duration::from_micros(us));
    let _ = c.kill();
    let _ = c.wait();
}

/// Seeded delays (the trainer's SplitMix64 stream), the same on every run.
fn delays(seed: u64, n: usize, max: u64) -> Vec<u64> {
    let mut rng = hf2q_train::batch::SplitMix(seed);
    (0..n).map(|_| rng.next_u64() % max).collect()
}

/// The temporary names of the writers anywhere under `dir` (the target's folder).
fn temps(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in rd.flatten() {
        let n = e.file_name().to_string_lossy().to_string();
        if n.starts_with('.')
            && (n.contains("partial") || n.ends_with(".tmp") || n.contains(".old-"))
        {
            out.push(e.path());
        }
        if e.path().is_dir() {
            out.extend(temps(&e.path()));
        }
    }
    out
}

fn no_temps(dir: &Path) {
    let t = temps(dir);
    assert!(t.is_empty(), "temporary files left: {t:?}");
}

/// A model file or folder is valid when `hf2q inspect` loads it.
fn inspect_ok(home: &Path, p: &Path) {
    let o = run(home, &["inspect", s(p)], None);
    assert!(o.status.success(), "inspect {}: {}", p.display(), err(&o));
}

fn gguf_ok(p: &Path) {
    hf2q_tensor::io::gguf::GgufFile::open(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
}

fn chats(dir: &Path) -> PathBuf {
    let p = dir.join("chats.jsonl");
    let mut t = String::new();
    for i in 0..8 {
        t += &serde_json::json!({"messages": [
            {"role": "user", "content": format!("say {i}")},
            {"role": "assistant", "content": format!("OK {i}!")},
        ]})
        .to_string();
        t.push('\n');
    }
    std::fs::write(&p, t).unwrap();
    p
}

/// The common course of one file writer: a failure under the limit leaves nothing, kills leave
/// nothing or a valid file, a full run leaves a valid file and no temporary, and a failure over
/// an existing target leaves it as it was.
fn file_writer(
    home: &Path,
    args: &[&str],
    target: &Path,
    limit: u64,
    seed: u64,
    valid: &dyn Fn(&Path),
) {
    let dir = target.parent().unwrap();
    fails_leaving_nothing(home, args, limit, target);
    for us in delays(seed, 4, 3000) {
        killed(home, args, dir, us);
        if target.exists() {
            valid(target);
        }
    }
    ok(home, args);
    valid(target);
    no_temps(dir);
    let before = std::fs::read(target).unwrap();
    fails_full(home, args, limit, target);
    assert_eq!(std::fs::read(target).unwrap(), before, "target changed");
    no_temps(dir);
}

#[test]
fn quantize_and_imatrix_files() {
    let d = tempfile::tempdir().unwrap();
    let (h, t) = (d.path().join("home"), fixture("tiny-llama"));
    let q8 = d.path().join("q8.gguf");
    file_writer(
        &h,
        &["quantize", s(&t), s(&q8), "--type", "Q8_0"],
        &q8,
        50_000,
        1,
        &|p| inspect_ok(&h, p),
    );
    let text = d.path().join("text.txt");
    std::fs::write(&text, "word ".repeat(400)).unwrap();
    let imx = d.path().join("imx.gguf");
    let args = [
        "imatrix",
        s(&t),
        "--file",
        s(&text),
        "-o",
        s(&imx),
        "--ctx",
        "16",
        "--chunks",
        "3",
    ];
    file_writer(&h, &args, &imx, 1024, 2, &gguf_ok);
}

/// A folder writer (`convert --to hf|mlx`, `fuse`): refuses an existing folder, so a complete
/// one left by a kill is checked and removed before the next run.
fn dir_writer(home: &Path, args: &[&str], target: &Path, limit: u64, seed: u64) {
    let dir = target.parent().unwrap();
    fails_leaving_nothing(home, args, limit, target);
    for us in delays(seed, 3, 3000) {
        killed(home, args, dir, us);
        if target.exists() {
            inspect_ok(home, target);
            std::fs::remove_dir_all(target).unwrap();
        }
    }
    ok(home, args);
    inspect_ok(home, target);
    no_temps(dir);
}

#[test]
fn convert_and_fuse_folders() {
    let d = tempfile::tempdir().unwrap();
    let (h, t) = (d.path().join("home"), fixture("tiny-llama"));
    let q8 = d.path().join("q8.gguf");
    ok(&h, &["quantize", s(&t), s(&q8), "--type", "Q8_0"]);
    let hf = d.path().join("hf");
    dir_writer(
        &h,
        &["convert", s(&q8), s(&hf), "--to", "hf"],
        &hf,
        50_000,
        3,
    );
    let mlx = d.path().join("mlx");
    let args = ["quantize", s(&t), s(&mlx), "--type", "mlx4g32"];
    dir_writer(&h, &args, &mlx, 20_000, 4);
    let gguf = d.path().join("f16.gguf");
    let args = ["convert", s(&t), s(&gguf), "--to", "gguf"];
    file_writer(&h, &args, &gguf, 50_000, 5, &|p| inspect_ok(&h, p));
}

/// The files of a PEFT adapter folder: complete when its config is there.
fn adapter_ok(dir: &Path) {
    let cfg = dir.join("adapter_config.json");
    if cfg.exists() {
        let text = std::fs::read_to_string(&cfg).unwrap();
        serde_json::from_str::<serde_json::Value>(&text).unwrap();
        hf2q_tensor::io::safetensors::SafeTensors::open(&dir.join("adapter_model.safetensors"))
            .unwrap();
    }
}

#[test]
fn train_checkpoints_adapters_exports_and_fuse() {
    let d = tempfile::tempdir().unwrap();
    let (h, t) = (d.path().join("home"), fixture("tiny-llama"));
    let data = chats(d.path());
    let out = d.path().join("ad");
    let sft = |extra: &[&str]| {
        let mut v: Vec<String> = [
            "train",
            "sft",
            s(&t),
            "--data",
            s(&data),
            "-o",
            s(&out),
            "--device",
            "cpu",
            "--batch",
            "2",
            "--lora-r",
            "4",
            "--steps",
            "4",
            "--save-every",
            "2",
        ]
        .iter()
        .map(|x| x.to_string())
        .collect();
        v.extend(extra.iter().map(|x| x.to_string()));
        v
    };
    let a = sft(&[]);
    let a: Vec<&str> = a.iter().map(|x| x.as_str()).collect();
    let o = run(&h, &a, Some(8_000));
    let e = err(&o);
    assert!(!o.status.success() && e.contains("File too large"), "{e}");
    assert!(
        e.contains("checkpoint-000002") || e.contains("adapter_model"),
        "{e}"
    );
    assert!(!out.join("adapter_config.json").exists() && !out.join("checkpoint-000002").exists());
    let a = sft(&["--overwrite"]);
    let a: Vec<&str> = a.iter().map(|x| x.as_str()).collect();
    for us in delays(6, 4, 20_000) {
        killed(&h, &a, &out, us);
        adapter_ok(&out);
        for e in std::fs::read_dir(&out).into_iter().flatten().flatten() {
            if e.file_name().to_string_lossy().starts_with("checkpoint-") {
                adapter_ok(&e.path());
                assert!(
                    e.path().join("trainer_state.json").is_file(),
                    "{:?}",
                    e.path()
                );
            }
        }
    }
    ok(&h, &a);
    adapter_ok(&out);
    assert!(out.join("adapter_config.json").is_file());
    no_temps(&out);
    no_temps(d.path());
    // The adapter's exports, and the fused model.
    let lora = d.path().join("ad.gguf");
    let args = [
        "convert",
        s(&out),
        s(&lora),
        "--to",
        "gguf-lora",
        "--base",
        s(&t),
    ];
    file_writer(&h, &args, &lora, 4_000, 7, &gguf_ok);
    let amlx = d.path().join("ad-mlx");
    let args = ["convert", s(&out), s(&amlx), "--to", "mlx", "--base", s(&t)];
    fails_leaving_nothing(&h, &args, 4_000, &amlx);
    ok(&h, &args);
    no_temps(d.path());
    let fused = d.path().join("fused");
    dir_writer(&h, &["fuse", s(&t), s(&out), s(&fused)], &fused, 50_000, 8);
}

#[test]
fn dataset_build_files() {
    let d = tempfile::tempdir().unwrap();
    let h = d.path().join("home");
    let data = chats(d.path());
    let out = d.path().join("ds");
    let args = [
        "dataset",
        "build",
        s(&data),
        "-o",
        s(&out),
        "--valid-split",
        "0.25",
    ];
    let o = run(&h, &args, Some(300));
    let e = err(&o);
    assert!(
        !o.status.success() && e.contains("File too large") && e.contains("ds"),
        "{e}"
    );
    no_temps(d.path());
    // Whatever is there is whole: every line parses.
    for f in std::fs::read_dir(&out).into_iter().flatten().flatten() {
        let text = std::fs::read_to_string(f.path()).unwrap();
        for l in text.lines() {
            serde_json::from_str::<serde_json::Value>(l).unwrap();
        }
    }
    let _ = std::fs::remove_dir_all(&out);
    ok(&h, &args);
    no_temps(d.path());
    assert!(out.join("train.jsonl").is_file());
}

/// Marks the folder a [`lab_writer_child`] may write in.
const LAB_WRITER_MARK: &str = "lab-writer-root";

/// The child of [`lab_db_and_logs_after_kill`]: writes jobs and events into its working folder
/// until it is killed. Ignored, and a no-op anywhere but in a folder that test marked.
#[test]
#[ignore = "the child process of lab_db_and_logs_after_kill"]
fn lab_writer_child() {
    let root = std::env::current_dir().unwrap();
    if !root.join(LAB_WRITER_MARK).is_file() {
        return;
    }
    let db = hf2q_lab::db::Db::open(&root.join("lab.db")).unwrap();
    let log = hf2q_lab::events::EventLog::new(root.join("events")).unwrap();
    loop {
        let job = db
            .insert("train", &serde_json::json!({"x": "y".repeat(200)}))
            .unwrap();
        for i in 0..20 {
            log.append(job.id, "log", serde_json::json!(format!("line {i}")))
                .unwrap();
        }
    }
}

/// The Lab's writers, in a child ([`lab_writer_child`], this test binary run again) killed at
/// seeded points: the database opens, every job's log is gap-free, a torn line is skipped.
#[test]
fn lab_db_and_logs_after_kill() {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join(LAB_WRITER_MARK), b"").unwrap();
    for ms in delays(9, 3, 300) {
        let mut c = Command::new(std::env::current_exe().unwrap())
            .args(["lab_writer_child", "--exact", "--ignored", "--nocapture"])
            .current_dir(d.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(100 + ms));
        c.kill().unwrap();
        c.wait().unwrap();
        let db = hf2q_lab::db::Db::open(&d.path().join("lab.db")).unwrap();
        let jobs = db.list().unwrap();
        assert!(
            !jobs.is_empty(),
            "the child wrote no job before it was killed"
        );
        let log = hf2q_lab::events::EventLog::new(d.path().join("events")).unwrap();
        for j in &jobs {
            let (evs, _) = log.read_from(j.id, 0).unwrap();
            for (k, e) in evs.iter().enumerate() {
                assert_eq!(e.seq, k as u64 + 1, "job {}", j.id);
            }
        }
        // A torn last line (as a full disk leaves) is skipped and ended by the next append.
        if let Some(j) = jobs.last() {
            use std::io::Write;
            let p = log.path(j.id);
            let n = log.read_from(j.id, 0).unwrap().0.len() as u64;
            let mut f = std::fs::OpenOptions::new().append(true).open(&p).unwrap();
            f.write_all(br#"{"seq":99,"ti"#).unwrap();
            assert_eq!(log.read_from(j.id, 0).unwrap().0.len() as u64, n);
            assert_eq!(
                log.append(j.id, "log", serde_json::json!("after")).unwrap(),
                n + 1
            );
            assert_eq!(log.read_from(j.id, 0).unwrap().0.len() as u64, n + 1);
        }
    }
}
