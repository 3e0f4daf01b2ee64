//! Append-only event logs: one NDJSON file per job (`lab/events/<id>.ndjson`), one object a line
//! `{"seq", "time", "type", "data"}` with `seq` counting from 1 without gaps. Types: `state`
//! (the job's state changed), `progress` (a JSON line of the child's stdout), `log` (any other
//! line of its stdout or stderr). Readers follow a file by byte offset ([`EventLog::read_from`])
//! and wait on a tick that moves with every append ([`EventLog::subscribe`]), so a reader that
//! falls behind re-reads the file and never loses an event. Not here: what the events mean.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{now, Error, Result};

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Event {
    pub seq: u64,
    pub time: f64,
    #[serde(rename = "type")]
    pub kind: String,
    pub data: Value,
}

pub struct EventLog {
    dir: PathBuf,
    /// Open writers: the file and the next sequence number.
    open: Mutex<HashMap<i64, (File, u64)>>,
    tick: tokio::sync::watch::Sender<u64>,
}

impl EventLog {
    pub fn new(dir: PathBuf) -> Result<EventLog> {
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        Ok(EventLog {
            dir,
            open: Mutex::new(HashMap::new()),
            tick: tokio::sync::watch::channel(0).0,
        })
    }

    pub fn path(&self, job: i64) -> PathBuf {
        self.dir.join(format!("{job}.ndjson"))
    }

    /// Appends an event and returns its sequence number. A log left by an earlier server
    /// continues where it ended (the lines are counted once, when it is first opened).
    pub fn append(&self, job: i64, kind: &str, data: Value) -> Result<u64> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let path = self.path(job);
        let (f, next) = match open.entry(job) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let (last, torn) = last_seq(&path)?;
                let mut f = OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                    .map_err(|e| Error::io(&path, e))?;
                // A line torn by a killed or full-disk writer is ended here, so that the next
                // event starts a line of its own (readers skip the torn one).
                if torn {
                    f.write_all(b"\n").map_err(|e| Error::io(&path, e))?;
                }
                v.insert((f, last + 1))
            }
        };
        let seq = *next;
        let ev = Event {
            seq,
            time: now(),
            kind: kind.to_string(),
            data,
        };
        let mut line = serde_json::to_string(&ev).unwrap_or_default();
        line.push('\n');
        // One write per line on an O_APPEND file: a reader sees whole lines or nothing of one.
        f.write_all(line.as_bytes())
            .map_err(|e| Error::io(&path, e))?;
        *next += 1;
        drop(open);
        self.tick.send_modify(|t| *t += 1);
        Ok(seq)
    }

    /// Closes a job's writer (its run ended); the file stays.
    pub fn close(&self, job: i64) {
        self.open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&job);
    }

    /// Removes a job's log.
    pub fn remove(&self, job: i64) -> Result<()> {
        self.close(job);
        let p = self.path(job);
        match std::fs::remove_file(&p) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io(&p, e)),
            _ => Ok(()),
        }
    }

    /// The whole events after byte `offset` and the offset after the last whole line read.
    pub fn read_from(&self, job: i64, offset: u64) -> Result<(Vec<Event>, u64)> {
        let path = self.path(job);
        let mut f = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), offset)),
            Err(e) => return Err(Error::io(&path, e)),
        };
        f.seek(SeekFrom::Start(offset))
            .map_err(|e| Error::io(&path, e))?;
        let mut buf = Vec::new();
        f.read_to_end(&mut buf).map_err(|e| Error::io(&path, e))?;
        let whole = buf.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        let events = buf[..whole]
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .filter_map(|l| serde_json::from_slice(l).ok())
            .collect();
        Ok((events, offset + whole as u64))
    }

    /// A receiver whose value changes on every append to any log.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.tick.subscribe()
    }
}

/// The last sequence number in a log file (0 when absent or empty), and whether its last line
/// is torn (no final newline).
fn last_seq(path: &Path) -> Result<(u64, bool)> {
    let f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((0, false)),
        Err(e) => return Err(Error::io(path, e)),
    };
    let (mut last, mut torn) = (0, false);
    let mut r = BufReader::new(f);
    let mut line = Vec::new();
    loop {
        line.clear();
        if r.read_until(b'\n', &mut line)
            .map_err(|e| Error::io(path, e))?
            == 0
        {
            break;
        }
        torn = line.last() != Some(&b'\n');
        if let Ok(ev) = serde_json::from_slice::<Event>(&line) {
            last = ev.seq;
        }
    }
    Ok((last, torn))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_numbers_continue_across_reopen_and_reads_follow_offsets() {
        let d = tempfile::tempdir().unwrap();
        let log = EventLog::new(d.path().to_path_buf()).unwrap();
        assert_eq!(log.append(7, "log", Value::from("a")).unwrap(), 1);
        assert_eq!(log.append(7, "log", Value::from("b")).unwrap(), 2);
        let (evs, off) = log.read_from(7, 0).unwrap();
        assert_eq!(evs.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2]);
        let again = EventLog::new(d.path().to_path_buf()).unwrap();
        assert_eq!(again.append(7, "log", Value::from("c")).unwrap(), 3);
        let (rest, _) = again.read_from(7, off).unwrap();
        assert_eq!(rest.len(), 1);
        assert_eq!(rest[0].data, Value::from("c"));
    }

    #[test]
    fn a_torn_last_line_is_skipped_and_ended_before_the_next_event() {
        let d = tempfile::tempdir().unwrap();
        let log = EventLog::new(d.path().to_path_buf()).unwrap();
        log.append(3, "log", Value::from("a")).unwrap();
        log.close(3);
        let mut f = OpenOptions::new().append(true).open(log.path(3)).unwrap();
        f.write_all(br#"{"seq":2,"time":1.0,"ty"#).unwrap();
        let (evs, off) = log.read_from(3, 0).unwrap();
        assert_eq!(evs.len(), 1);
        assert_eq!(log.read_from(3, off).unwrap().0.len(), 0);
        let again = EventLog::new(d.path().to_path_buf()).unwrap();
        assert_eq!(again.append(3, "log", Value::from("b")).unwrap(), 2);
        let (evs, _) = again.read_from(3, 0).unwrap();
        assert_eq!(evs.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2]);
    }
}
