//! `hf2q-fuzz-afl TARGET`: one fuzz target under AFL++ (persistent mode). Build with
//! `cargo afl build --release -p hf2q-fuzz --features afl --bin hf2q-fuzz-afl`; run through
//! `scripts/fuzz.sh`. Compute runs on one thread (AFL runs one instance per core).

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
