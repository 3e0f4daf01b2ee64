//! The job runner: a queue in the `jobs` table, a scheduler thread that starts queued jobs when
//! their lease is free (one GPU job at a time; at most `cpu_jobs` CPU jobs), one thread per
//! running job that spawns the child `hf2q` in a process group of its own, turns its stdout and
//! stderr into events and records how it ended. Cancel is SIGTERM to the group, SIGKILL after
//! the grace period (a training child saves a checkpoint on SIGTERM). Outputs are written at a
//! temporary name and renamed when the child exits 0, so only complete outputs are listed.
//!
//! On open, jobs a dead server left `running` become `interrupted` (their children, which get
//! SIGTERM when the server dies, are waited for); `resume` queues an interrupted or cancelled
//! job again, a training job continuing from its last checkpoint. Not here: HTTP, the params'
//! meaning ([`crate::kinds`]).

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::db::{Db, Finish};
use crate::events::EventLog;
use crate::kinds::{self, Context, Kind, Lease, Plan};
use crate::paths::Home;
use crate::{Error, Job, Result, State};

/// How many of a child's last stderr lines a failed job keeps.
const TAIL_LINES: usize = 20;

#[derive(Clone, Debug)]
pub struct LabConfig {
    /// `$HF2Q_HOME`: every path of every job lies inside it; the database is `lab/lab.db`.
    pub home: PathBuf,
    /// The `hf2q` binary the jobs run.
    pub bin: PathBuf,
    /// CPU jobs running at once (GPU jobs: one).
    pub cpu_jobs: usize,
    /// Between SIGTERM and SIGKILL on cancel.
    pub grace: Duration,
    /// Names `model` params may give instead of a path (pulled by the child on first use).
    pub builtin_models: Vec<String>,
}

/// The server the Lab runs in, as its jobs reach it (`dataset_generate` asks its model).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerApi {
    /// The `/v1` base URL, e.g. `http://127.0.0.1:8080/v1`.
    pub base_url: String,
    /// The server's API key: given to the children as `$HF2Q_API_KEY` (never in an argv).
    pub key: Option<String>,
}

/// The environment variable a child reads the server's key from.
pub const API_KEY_ENV: &str = "HF2Q_API_KEY";

/// The environment variable a child reads the stored Hub token from (the Hub client's own).
pub const HUB_TOKEN_ENV: &str = "HF_TOKEN";

#[derive(Clone)]
pub struct Lab {
    inner: Arc<Inner>,
}

struct Inner {
    cfg: LabConfig,
    home: Home,
    db: Db,
    events: EventLog,
    sched: Mutex<Sched>,
    wake: Condvar,
    scheduler: Mutex<Option<JoinHandle<()>>>,
    /// Set by the server once it listens.
    api: RwLock<Option<ServerApi>>,
    /// An exclusive flock on `lab/lock`: one server runs a home's jobs.
    _lock: std::fs::File,
}

#[derive(Default)]
struct Sched {
    gpu: bool,
    cpu: usize,
    running: HashMap<i64, Running>,
    stop: bool,
}

struct Running {
    pid: Option<u32>,
    lease: Lease,
    cancel: bool,
}

fn signal_group(pid: u32, sig: i32) {
    // SAFETY: kill(2) with a negative pid signals the process group the child leads.
    unsafe {
        libc::kill(-(pid as i32), sig);
    }
}

fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid as i32, 0) == 0 }
}

impl Lab {
    /// Opens the Lab of `cfg.home`: the database, the event logs, the recovery of jobs a dead
    /// server left running, and the scheduler thread.
    pub fn open(cfg: LabConfig) -> Result<Lab> {
        let home = Home::new(&cfg.home)?;
        let dir = home.root().join("lab");
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        let lock_path = dir.join("lock");
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| Error::io(&lock_path, e))?;
        // SAFETY: flock on a file descriptor we own.
        if unsafe {
            libc::flock(
                std::os::fd::AsRawFd::as_raw_fd(&lock),
                libc::LOCK_EX | libc::LOCK_NB,
            )
        } != 0
        {
            return Err(Error::Conflict(format!(
                "another hf2q server runs the Lab of {}",
                home.root().display()
            )));
        }
        let db = Db::open(&dir.join("lab.db"))?;
        let events = EventLog::new(dir.join("events"))?;
        let inner = Arc::new(Inner {
            cfg,
            home,
            db,
            events,
            sched: Mutex::new(Sched::default()),
            wake: Condvar::new(),
            scheduler: Mutex::new(None),
            api: RwLock::new(None),
            _lock: lock,
        });
        inner.recover()?;
        let me = inner.clone();
        let h = std::thread::Builder::new()
            .name("lab-scheduler".into())
            .spawn(move || me.schedule())
            .map_err(|e| Error::io(Path::new("lab-scheduler"), e))?;
        *inner.scheduler.lock().unwrap_or_else(|e| e.into_inner()) = Some(h);
        Ok(Lab { inner })
    }

    pub fn home(&self) -> &Home {
        &self.inner.home
    }
    pub fn events(&self) -> &EventLog {
        &self.inner.events
    }
    pub fn config(&self) -> &LabConfig {
        &self.inner.cfg
    }

    /// How jobs reach the server the Lab runs in; the server sets it when it listens (jobs
    /// that need it are refused until then).
    pub fn set_api(&self, api: ServerApi) {
        *self.inner.api.write().unwrap_or_else(|e| e.into_inner()) = Some(api);
    }

    pub fn api(&self) -> Option<ServerApi> {
        self.inner.api()
    }

    /// Stores the Hub token the jobs get (`Some`), or removes it (`None`):
    /// [`crate::hub_token`].
    pub fn set_hub_token(&self, token: Option<&str>) -> Result<()> {
        let root = self.inner.home.root();
        match token {
            Some(t) => crate::hub_token::store(root, t),
            None => crate::hub_token::clear(root),
        }
    }

    /// Whether a Hub token is stored (the token itself is never handed out).
    pub fn hub_token_set(&self) -> bool {
        crate::hub_token::read(self.inner.home.root()).is_some()
    }

    /// Checks and queues a job.
    pub fn submit(&self, kind: &str, params: Value) -> Result<Job> {
        let k = Kind::parse(kind)?;
        let api = self.inner.api();
        let base = api.as_ref().map(|a| a.base_url.as_str());
        kinds::plan(&self.inner.ctx(base), k, &params, 0)?;
        let job = self.inner.db.insert(k.name(), &params)?;
        self.inner
            .event(job.id, "state", json!({"state": "queued"}));
        self.inner.wake.notify_all();
        Ok(job)
    }

    pub fn get(&self, id: i64) -> Result<Job> {
        self.inner.db.get(id)
    }

    pub fn list(&self) -> Result<Vec<Job>> {
        self.inner.db.list()
    }

    /// A queued job is cancelled at once; a running one gets SIGTERM (SIGKILL after the grace
    /// period) and is `cancelled` when its child has exited.
    pub fn cancel(&self, id: i64) -> Result<Job> {
        let inner = &self.inner;
        let mut s = inner.lock();
        if let Some(r) = s.running.get_mut(&id) {
            if !r.cancel {
                r.cancel = true;
                if let Some(pid) = r.pid {
                    drop(s);
                    inner.terminate(id, pid);
                }
            }
            return inner.db.get(id);
        }
        let job = inner.db.get(id)?;
        match job.state {
            State::Queued | State::Interrupted => {
                inner.finish(id, State::Cancelled, None, None, &[]);
                inner.db.get(id)
            }
            st => Err(Error::Conflict(format!(
                "job {id} is {}: there is nothing to cancel",
                st.as_str()
            ))),
        }
    }

    /// Queues an interrupted or cancelled job again (training continues from its checkpoint).
    pub fn resume(&self, id: i64) -> Result<Job> {
        let inner = &self.inner;
        let _s = inner.lock();
        let job = inner.db.get(id)?;
        if !matches!(job.state, State::Interrupted | State::Cancelled) {
            return Err(Error::Conflict(format!(
                "job {id} is {}: only interrupted or cancelled jobs can be resumed",
                job.state.as_str()
            )));
        }
        inner.db.requeue(id)?;
        inner.event(id, "state", json!({"state": "queued", "resume": true}));
        inner.wake.notify_all();
        inner.db.get(id)
    }

    /// Removes a job that is not queued or running: its row, its event log and any temporary
    /// output (its complete outputs stay: they are models).
    pub fn delete(&self, id: i64) -> Result<()> {
        let inner = &self.inner;
        let s = inner.lock();
        let job = inner.db.get(id)?;
        if s.running.contains_key(&id) || !job.state.is_final() {
            return Err(Error::Conflict(format!(
                "job {id} is {}: cancel it before deleting it",
                job.state.as_str()
            )));
        }
        inner.remove_partials(&job, true);
        inner.events.remove(id)?;
        inner.db.delete(id)
    }

    /// Stops the scheduler (running children go on until they exit; nothing new starts).
    pub fn shutdown(&self) {
        self.inner.lock().stop = true;
        self.inner.wake.notify_all();
        let h = self
            .inner
            .scheduler
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(h) = h {
            let _ = h.join();
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Sched> {
        self.sched.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn api(&self) -> Option<ServerApi> {
        self.api.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The planning context; `base_url` is the server's address, when known.
    fn ctx<'a>(&'a self, base_url: Option<&'a str>) -> Context<'a> {
        Context {
            home: &self.home,
            builtin_models: &self.cfg.builtin_models,
            api: base_url,
        }
    }

    /// Appends an event; a log that cannot be written is reported once on stderr (the job's
    /// row still records how it ended).
    fn event(&self, id: i64, kind: &str, data: Value) {
        if let Err(e) = self.events.append(id, kind, data) {
            eprintln!("lab: job {id}: cannot append to its event log: {e}");
        }
    }

    fn finish(
        &self,
        id: i64,
        state: State,
        exit: Option<i32>,
        error: Option<&str>,
        outputs: &[String],
    ) {
        let f = Finish {
            state,
            exit_status: exit,
            error,
            outputs,
        };
        if let Err(e) = self.db.finish(id, &f) {
            eprintln!("lab: job {id}: cannot record its end: {e}");
        }
        self.event(
            id,
            "state",
            json!({"state": state.as_str(), "exit_status": exit, "error": error, "outputs": outputs}),
        );
        self.events.close(id);
    }

    /// The temporary outputs of a job (from its params and id; the `.gguf` a GGUF output's
    /// name gets is tried too).
    fn partials(&self, job: &Job) -> Vec<PathBuf> {
        let Ok(kind) = Kind::parse(&job.kind) else {
            return Vec::new();
        };
        let base = match kind {
            Kind::Quantize | Kind::Convert => "models",
            Kind::Imatrix => "imatrix",
            Kind::Dataset | Kind::DatasetGenerate => "datasets",
            _ => "adapters",
        };
        let Some(name) = job.params.get("output").and_then(Value::as_str) else {
            return Vec::new();
        };
        if name.contains("..") || Path::new(name).is_absolute() {
            return Vec::new();
        }
        let dir = self.home.root().join(base);
        [name.to_string(), format!("{name}.gguf")]
            .iter()
            .map(|n| crate::paths::partial(&dir.join(n), job.id))
            .collect()
    }

    /// Removes a job's temporary outputs: always when `all`, else all but a training job's
    /// (its checkpoints are what a resume continues from).
    fn remove_partials(&self, job: &Job, all: bool) {
        if !all && Kind::parse(&job.kind).is_ok_and(|k| k.is_train()) {
            return;
        }
        for p in self.partials(job) {
            match std::fs::symlink_metadata(&p) {
                Ok(m) if m.is_dir() => {
                    let _ = std::fs::remove_dir_all(&p);
                }
                Ok(_) => {
                    let _ = std::fs::remove_file(&p);
                }
                Err(_) => {}
            }
        }
    }

    /// Jobs left running by a server that died: their children are given the grace period to
    /// exit (they got SIGTERM when the server died), then killed; the jobs become interrupted.
    fn recover(&self) -> Result<()> {
        for job in self.db.in_state(State::Running)? {
            if let Some(pid) = job.pid.and_then(|p| u32::try_from(p).ok()) {
                if is_our_child(pid, &self.cfg.bin) {
                    signal_group(pid, libc::SIGTERM);
                    let t0 = Instant::now();
                    while alive(pid) && t0.elapsed() < self.cfg.grace {
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    signal_group(pid, libc::SIGKILL);
                }
            }
            self.remove_partials(&job, false);
            self.finish(
                job.id,
                State::Interrupted,
                None,
                Some("the server stopped while the job ran"),
                &[],
            );
        }
        Ok(())
    }

    fn terminate(self: &Arc<Self>, id: i64, pid: u32) {
        signal_group(pid, libc::SIGTERM);
        let me = self.clone();
        std::thread::spawn(move || {
            std::thread::sleep(me.cfg.grace);
            if me
                .lock()
                .running
                .get(&id)
                .is_some_and(|r| r.pid == Some(pid))
            {
                signal_group(pid, libc::SIGKILL);
            }
        });
    }

    fn schedule(self: Arc<Self>) {
        let mut s = self.lock();
        while !s.stop {
            match self.db.in_state(State::Queued) {
                Ok(queued) => {
                    for job in queued {
                        if s.running.contains_key(&job.id) {
                            continue;
                        }
                        let api = self.api();
                        let base = api.as_ref().map(|a| a.base_url.as_str());
                        let plan = Kind::parse(&job.kind).and_then(|k| {
                            let mut p = kinds::plan(&self.ctx(base), k, &job.params, job.id)?;
                            if k.is_train() {
                                kinds::add_resume(&mut p);
                            }
                            Ok(p)
                        });
                        let plan = match plan {
                            Ok(p) => p,
                            Err(e) => {
                                self.finish(job.id, State::Failed, None, Some(&e.to_string()), &[]);
                                continue;
                            }
                        };
                        let free = match plan.lease {
                            Lease::Gpu => !s.gpu,
                            Lease::Cpu => s.cpu < self.cfg.cpu_jobs.max(1),
                        };
                        if !free {
                            continue;
                        }
                        match plan.lease {
                            Lease::Gpu => s.gpu = true,
                            Lease::Cpu => s.cpu += 1,
                        }
                        s.running.insert(
                            job.id,
                            Running {
                                pid: None,
                                lease: plan.lease,
                                cancel: false,
                            },
                        );
                        let me = self.clone();
                        let spawned = std::thread::Builder::new()
                            .name(format!("lab-job-{}", job.id))
                            .spawn(move || me.run_job(job, plan));
                        if let Err(e) = spawned {
                            eprintln!("lab: cannot start a job thread: {e}");
                        }
                    }
                }
                Err(e) => eprintln!("lab: cannot read the queue: {e}"),
            }
            s = self
                .wake
                .wait_timeout(s, Duration::from_millis(500))
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    fn release(&self, id: i64) {
        let mut s = self.lock();
        if let Some(r) = s.running.remove(&id) {
            match r.lease {
                Lease::Gpu => s.gpu = false,
                Lease::Cpu => s.cpu = s.cpu.saturating_sub(1),
            }
        }
        drop(s);
        self.wake.notify_all();
    }

    fn run_job(self: Arc<Self>, job: Job, plan: Plan) {
        let id = job.id;
        self.run_child(&job, &plan);
        self.release(id);
    }

    fn run_child(self: &Arc<Self>, job: &Job, plan: &Plan) {
        let id = job.id;
        let mut cmd = Command::new(&self.cfg.bin);
        cmd.args(&plan.argv)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env("HF2Q_HOME", self.home.root())
            .process_group(0);
        // The server's key, for the jobs that call its API; no key of the server's own
        // environment leaks into a child either way.
        match self.api().and_then(|a| a.key) {
            Some(k) => cmd.env(API_KEY_ENV, k),
            None => cmd.env_remove(API_KEY_ENV),
        };
        // The stored Hub token (push, Hub datasets), in the environment, never in the argv;
        // without one the child keeps the server's own Hub settings.
        if let Some(t) = crate::hub_token::read(self.home.root()) {
            cmd.env(HUB_TOKEN_ENV, t);
        }
        #[cfg(target_os = "linux")]
        // SAFETY: prctl is async-signal-safe; the child gets SIGTERM when the thread that
        // spawned it (this job's thread, alive until the child exits) dies with the server.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                let msg = format!("could not start {}: {e}", self.cfg.bin.display());
                self.finish(id, State::Failed, None, Some(&msg), &[]);
                return;
            }
        };
        let pid = child.id();
        if let Err(e) = self.db.set_running(id, pid) {
            eprintln!("lab: job {id}: cannot record its start: {e}");
        }
        let argv: Vec<String> = plan
            .argv
            .iter()
            .map(|a| a.to_string_lossy().into())
            .collect();
        self.event(
            id,
            "state",
            json!({"state": "running", "pid": pid, "argv": argv}),
        );
        let cancel_now = {
            let mut s = self.lock();
            match s.running.get_mut(&id) {
                Some(r) => {
                    r.pid = Some(pid);
                    r.cancel
                }
                None => false,
            }
        };
        if cancel_now {
            self.terminate(id, pid);
        }
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let out = child.stdout.take().map(|o| {
            let me = self.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(o).lines() {
                    let Ok(line) = line else { break };
                    match serde_json::from_str::<Value>(&line) {
                        Ok(v @ Value::Object(_)) => me.event(id, "progress", v),
                        _ => me.event(id, "log", json!({"stream": "stdout", "line": line})),
                    }
                }
            })
        });
        let err = child.stderr.take().map(|e| {
            let me = self.clone();
            let tail = tail.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(e).lines() {
                    let Ok(line) = line else { break };
                    {
                        let mut t = tail.lock().unwrap_or_else(|e| e.into_inner());
                        if t.len() == TAIL_LINES {
                            t.pop_front();
                        }
                        t.push_back(line.clone());
                    }
                    me.event(id, "log", json!({"stream": "stderr", "line": line}));
                }
            })
        });
        let status = child.wait();
        for h in [out, err].into_iter().flatten() {
            let _ = h.join();
        }
        let cancelled = self.lock().running.get(&id).is_some_and(|r| r.cancel);
        let tail: Vec<String> = tail
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect();
        let status = match status {
            Ok(s) => s,
            Err(e) => {
                self.remove_partials(job, false);
                self.finish(
                    id,
                    State::Failed,
                    None,
                    Some(&format!("waiting for the child: {e}")),
                    &[],
                );
                return;
            }
        };
        if cancelled {
            self.remove_partials(job, false);
            self.finish(id, State::Cancelled, status.code(), None, &[]);
            return;
        }
        if status.success() {
            match self.publish(plan) {
                Ok(outputs) => self.finish(id, State::Succeeded, Some(0), None, &outputs),
                Err(e) => self.finish(id, State::Failed, Some(0), Some(&e), &[]),
            }
            return;
        }
        let reason = match (status.code(), status.signal()) {
            (Some(c), _) => format!("the child exited with status {c}"),
            (None, Some(s)) => format!("the child was killed by signal {s}{}", signal_name(s)),
            _ => "the child ended abnormally".to_string(),
        };
        let msg = if tail.is_empty() {
            reason
        } else {
            format!("{reason}; the end of its stderr:\n{}", tail.join("\n"))
        };
        self.remove_partials(job, false);
        self.finish(id, State::Failed, status.code(), Some(&msg), &[]);
    }

    /// Renames the temporary outputs to their names; returns the complete ones (relative to
    /// the home). An output the child did not write is not listed.
    fn publish(&self, plan: &Plan) -> std::result::Result<Vec<String>, String> {
        let mut done = Vec::new();
        for (fin, tmp) in &plan.outputs {
            if std::fs::symlink_metadata(tmp).is_err() {
                continue;
            }
            if std::fs::symlink_metadata(fin).is_ok() {
                return Err(format!(
                    "{} appeared while the job ran; the result stays at {}",
                    self.home.relative(fin),
                    self.home.relative(tmp)
                ));
            }
            std::fs::rename(tmp, fin)
                .map_err(|e| format!("renaming {} into place: {e}", tmp.display()))?;
            done.push(self.home.relative(fin));
        }
        Ok(done)
    }
}

fn signal_name(s: i32) -> &'static str {
    match s {
        libc::SIGKILL => " (SIGKILL: killed, e.g. out of memory)",
        libc::SIGSEGV => " (SIGSEGV)",
        libc::SIGABRT => " (SIGABRT)",
        libc::SIGTERM => " (SIGTERM)",
        _ => "",
    }
}

/// The process is alive and runs `bin` (a pid left in the table may have been reused).
fn is_our_child(pid: u32, bin: &Path) -> bool {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe"));
    match (exe, bin.canonicalize()) {
        (Ok(e), Ok(b)) => e == b,
        _ => false,
    }
}

impl std::fmt::Debug for Lab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lab")
            .field("home", &self.inner.home.root())
            .finish_non_exhaustive()
    }
}
