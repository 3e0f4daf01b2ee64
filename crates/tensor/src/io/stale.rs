//! Stale temporary files of the atomic writers: every writer builds its output under a hidden
//! name beside the target (`.NAME.PID.N.partial`, `.NAME.partial-PID[-N]`, `.NAME.old-PID-N`)
//! and renames it into place; a process killed before the rename leaves that name behind. This
//! module finds and removes such leftovers of processes that are no longer running, so that the
//! next run over the same target leaves nothing but the target. It does not write anything.

use std::path::Path;

/// Removes the temporary files and folders that earlier, no longer running processes left
/// beside `target` (see the module header for the names). Best effort: a leftover that cannot
/// be removed stays, and a running writer's temporary is never touched.
pub fn remove_stale_temps(target: &Path) {
    let Some(name) = target.file_name().map(|n| n.to_string_lossy().to_string()) else {
        return;
    };
    let dir = match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let prefix = format!(".{name}.");
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().to_string();
        let Some(rest) = file.strip_prefix(&prefix) else {
            continue;
        };
        let Some(pid) = temp_owner(rest) else {
            continue;
        };
        if pid == std::process::id() || process_alive(pid) {
            continue;
        }
        let p = e.path();
        let _ = if p.is_dir() {
            std::fs::remove_dir_all(&p)
        } else {
            std::fs::remove_file(&p)
        };
    }
}

/// The process id in the tail of a temporary name (what follows `.NAME.`), when the tail is one
/// of the writers' forms: `PID.N.partial`, `partial-PID`, `partial-PID-N`, `old-PID-N`.
fn temp_owner(rest: &str) -> Option<u32> {
    let parts: Vec<&str> = rest.split(['.', '-']).collect();
    let num = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    match parts.as_slice() {
        [pid, n, "partial"] if num(pid) && num(n) => pid.parse().ok(),
        ["partial" | "old", pid] if num(pid) => pid.parse().ok(),
        ["partial" | "old", pid, n] if num(pid) && num(n) => pid.parse().ok(),
        _ => None,
    }
}

/// Whether a process with id `pid` exists (on systems without `/proc`: assumed, so that
/// nothing is removed).
fn process_alive(pid: u32) -> bool {
    if cfg!(target_os = "linux") {
        Path::new("/proc").join(pid.to_string()).exists()
    } else {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_of_the_writers_names() {
        assert_eq!(temp_owner("123.0.partial"), Some(123));
        assert_eq!(temp_owner("partial-77"), Some(77));
        assert_eq!(temp_owner("partial-77-9"), Some(77));
        assert_eq!(temp_owner("old-5-1"), Some(5));
        assert_eq!(temp_owner("tmp"), None);
        assert_eq!(temp_owner("bak"), None);
        assert_eq!(temp_owner("x.partial"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn removes_only_dead_owners_leftovers() {
        let d = std::env::temp_dir().join(format!("hf2q-stale-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let target = d.join("m.gguf");
        // PIDs above the kernel's maximum (4194304) never run.
        let dead = d.join(".m.gguf.4194999.0.partial");
        let dead_dir = d.join(".m.gguf.partial-4194998");
        let mine = d.join(format!(".m.gguf.{}.0.partial", std::process::id()));
        let other = d.join(".n.gguf.4194999.0.partial");
        for f in [&dead, &mine, &other] {
            std::fs::write(f, "x").unwrap();
        }
        std::fs::create_dir_all(dead_dir.join("sub")).unwrap();
        remove_stale_temps(&target);
        assert!(!dead.exists() && !dead_dir.exists());
        assert!(mine.exists() && other.exists());
        std::fs::remove_dir_all(&d).unwrap();
    }
}
