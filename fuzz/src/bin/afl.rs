//! `hf2q-fuzz-afl TARGET`: one fuzz target under AFL++ (persistent mode). Build with
//! `cargo afl build --release -p hf2q-fuzz --features afl --bin hf2q-fuzz-afl`; run through
//! `scripts/fuzz.sh`. Run it with `RAYON_NUM_THREADS=1` (AFL runs one instance per core); no
//! thread may be started before `fuzz!`: AFL's fork server forks there, and threads do not
//! survive a fork (a rayon pool built earlier leaves every parallel call waiting forever).

fn main() {
    let name = std::env::args().nth(1).unwrap_or_default();
    let Some(target) = hf2q_fuzz::Target::from_name(&name) else {
        eprintln!(
            "usage: hf2q-fuzz-afl TARGET (targets: {})",
            hf2q_fuzz::Target::names().join(", ")
        );
        std::process::exit(2);
    };
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build_global();
    afl::fuzz!(|data: &[u8]| {
        target.run(data);
    });
}
