//! Helpers shared by the training crate's tests: where the real models and data sets are.
//! Tests read their inputs' paths from the environment (`scripts/test.sh` sets them); a test
//! whose input is not given prints "skipped" and passes.

use std::path::PathBuf;

/// The path in `var`, or `None` (after printing that the test is skipped) when it is unset.
pub fn env_path(var: &str) -> Option<PathBuf> {
    match std::env::var(var) {
        Ok(p) if !p.is_empty() => Some(PathBuf::from(p)),
        _ => {
            eprintln!("skipped: {var} is not set");
            None
        }
    }
}
