//! The `jobs` table in SQLite (`$HF2Q_HOME/lab/lab.db`): one row per job with its kind, params
//! (JSON), state, times, exit status, error, output paths and its event log's file. WAL mode so
//! that readers never wait for the runner's writes. Not here: the event lines themselves
//! ([`crate::events`]) or what a state change sets off ([`crate::runner`]).

use std::path::Path;
use std::sync::Mutex;

use rusqlite::{params, Connection, OptionalExtension, Row};
use serde::Serialize;
use serde_json::Value;

use crate::{now, Error, Result};

/// A job's life: queued -> running -> succeeded | failed | cancelled; running jobs found by a
/// server that starts are `interrupted`; `resume` queues an interrupted or cancelled job again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    Queued,
    Running,
    Succeeded,
    Failed,
    Cancelled,
    Interrupted,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Queued => "queued",
            State::Running => "running",
            State::Succeeded => "succeeded",
            State::Failed => "failed",
            State::Cancelled => "cancelled",
            State::Interrupted => "interrupted",
        }
    }
    pub fn parse(s: &str) -> Option<State> {
        Some(match s {
            "queued" => State::Queued,
            "running" => State::Running,
            "succeeded" => State::Succeeded,
            "failed" => State::Failed,
            "cancelled" => State::Cancelled,
            "interrupted" => State::Interrupted,
            _ => return None,
        })
    }
    /// No process runs or will run for the job (until a resume).
    pub fn is_final(self) -> bool {
        !matches!(self, State::Queued | State::Running)
    }
}

/// One row of the table, as the API shows it.
#[derive(Clone, Debug, Serialize)]
pub struct Job {
    pub id: i64,
    pub kind: String,
    pub params: Value,
    pub state: State,
    /// Unix seconds.
    pub created: f64,
    pub started: Option<f64>,
    pub ended: Option<f64>,
    /// The child's exit code (absent when it was killed by a signal or never ran).
    pub exit_status: Option<i32>,
    /// Why it failed: the reason and the tail of the child's stderr.
    pub error: Option<String>,
    /// Complete outputs, as paths relative to `$HF2Q_HOME`.
    pub outputs: Vec<String>,
    /// The event log's file, relative to the lab folder.
    pub events: String,
    /// Process id (= process group id) of the running child.
    pub pid: Option<i64>,
    /// How many times the job was started (resumes count).
    pub attempts: i64,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS jobs (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    kind        TEXT NOT NULL,
    params      TEXT NOT NULL,
    state       TEXT NOT NULL,
    created     REAL NOT NULL,
    started     REAL,
    ended       REAL,
    exit_status INTEGER,
    error       TEXT,
    outputs     TEXT NOT NULL DEFAULT '[]',
    events      TEXT NOT NULL DEFAULT '',
    pid         INTEGER,
    attempts    INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state);
";

const COLUMNS: &str =
    "id, kind, params, state, created, started, ended, exit_status, error, outputs, events, pid, attempts";

pub struct Db {
    conn: Mutex<Connection>,
}

fn row(r: &Row) -> rusqlite::Result<Job> {
    let params: String = r.get(2)?;
    let state: String = r.get(3)?;
    let outputs: String = r.get(9)?;
    Ok(Job {
        id: r.get(0)?,
        kind: r.get(1)?,
        params: serde_json::from_str(&params).unwrap_or(Value::Null),
        state: State::parse(&state).unwrap_or(State::Failed),
        created: r.get(4)?,
        started: r.get(5)?,
        ended: r.get(6)?,
        exit_status: r.get(7)?,
        error: r.get(8)?,
        outputs: serde_json::from_str(&outputs).unwrap_or_default(),
        events: r.get(10)?,
        pid: r.get(11)?,
        attempts: r.get(12)?,
    })
}

/// How a run ended, for [`Db::finish`].
pub struct Finish<'a> {
    pub state: State,
    pub exit_status: Option<i32>,
    pub error: Option<&'a str>,
    pub outputs: &'a [String],
}

impl Db {
    /// Opens (creating) the database file.
    pub fn open(path: &Path) -> Result<Db> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        }
        let conn = Connection::open(path)?;
        conn.busy_timeout(std::time::Duration::from_secs(10))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.execute_batch(SCHEMA)?;
        Ok(Db {
            conn: Mutex::new(conn),
        })
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new queued job; its event log is `events/<id>.ndjson`.
    pub fn insert(&self, kind: &str, params: &Value) -> Result<Job> {
        let id = {
            let c = self.conn();
            c.execute(
                "INSERT INTO jobs (kind, params, state, created) VALUES (?1, ?2, 'queued', ?3)",
                params![kind, params.to_string(), now()],
            )?;
            let id = c.last_insert_rowid();
            c.execute(
                "UPDATE jobs SET events = ?1 WHERE id = ?2",
                params![format!("events/{id}.ndjson"), id],
            )?;
            id
        };
        self.get(id)
    }

    pub fn get(&self, id: i64) -> Result<Job> {
        self.conn()
            .query_row(
                &format!("SELECT {COLUMNS} FROM jobs WHERE id = ?1"),
                [id],
                row,
            )
            .optional()?
            .ok_or_else(|| Error::NotFound(format!("there is no job {id}")))
    }

    /// Every job, newest first.
    pub fn list(&self) -> Result<Vec<Job>> {
        let c = self.conn();
        let mut st = c.prepare(&format!("SELECT {COLUMNS} FROM jobs ORDER BY id DESC"))?;
        let jobs = st
            .query_map([], row)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(jobs)
    }

    /// Jobs in one state, oldest first.
    pub fn in_state(&self, state: State) -> Result<Vec<Job>> {
        let c = self.conn();
        let mut st = c.prepare(&format!(
            "SELECT {COLUMNS} FROM jobs WHERE state = ?1 ORDER BY id"
        ))?;
        let jobs = st
            .query_map([state.as_str()], row)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(jobs)
    }

    pub fn set_running(&self, id: i64, pid: u32) -> Result<()> {
        self.conn().execute(
            "UPDATE jobs SET state = 'running', started = ?1, ended = NULL, exit_status = NULL, \
             error = NULL, pid = ?2, attempts = attempts + 1 WHERE id = ?3",
            params![now(), pid, id],
        )?;
        Ok(())
    }

    pub fn finish(&self, id: i64, f: &Finish) -> Result<()> {
        self.conn().execute(
            "UPDATE jobs SET state = ?1, ended = ?2, exit_status = ?3, error = ?4, outputs = ?5, \
             pid = NULL WHERE id = ?6",
            params![
                f.state.as_str(),
                now(),
                f.exit_status,
                f.error,
                serde_json::to_string(f.outputs).unwrap_or_else(|_| "[]".into()),
                id
            ],
        )?;
        Ok(())
    }

    /// Back to the queue (a resume).
    pub fn requeue(&self, id: i64) -> Result<()> {
        self.conn().execute(
            "UPDATE jobs SET state = 'queued', ended = NULL, error = NULL, pid = NULL WHERE id = ?1",
            [id],
        )?;
        Ok(())
    }

    pub fn delete(&self, id: i64) -> Result<()> {
        self.conn()
            .execute("DELETE FROM jobs WHERE id = ?1", [id])?;
        Ok(())
    }
}
