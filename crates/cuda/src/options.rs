//! [`CudaOptions`]: every setting a [`super::CudaDev`] takes when it is opened, in one struct the
//! caller fills in: the kernel cache folder, and the tuning switches of the kernels (which
//! prefill product, which one-token kernels, attention's splits, the compile-time bounds).
//!
//! The defaults are what measured fastest (cuda/NOTES.md); the switches exist to compare paths
//! and to reproduce measurements. They are set by name (`key=value`, [`CudaOptions::set`]), as
//! the binary's `--cuda-opt` passes them; [`CudaOptions::KEYS`] lists them with their help.
//!
//! This module does not read the environment: a caller that wants it passes a lookup to
//! [`CudaOptions::from_environment`] (the binary passes `std::env::var_os`, tests the same).

use std::ffi::OsString;
use std::path::PathBuf;

use super::{MvMode, PrefillGemm};
use hf2q_tensor::{Error, Result};

/// How a device is opened ([`super::CudaDev::open`]). `Default`: the measured defaults and no
/// kernel cache (every open compiles).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaOptions {
    /// Where compiled kernels are cached (`None`: compiled on every open).
    pub kernel_cache: Option<PathBuf>,
    /// Which kernel multiplies prefill-sized batches (`gemm`).
    pub gemm: PrefillGemm,
    /// Prefill attention may use the tensor-core kernel (`attn-tc`).
    pub attn_tensor_cores: bool,
    /// Fewest keys per split of the one-token attention (`attn-chunk`, at least 8).
    pub attn_chunk: usize,
    /// Products of 9 to N rows (batched decode steps) run as the small-batch matvec kernels
    /// over chunks of 8 rows, each chunk reading the weight once, instead of the prefill path
    /// (`batch-mv`; 0: never). 16 by measurement (H100, the batched paged decode step): 16 rows
    /// of Llama-3.2-1B Q4_0 in 4.3 ms instead of 6.3, of Llama-3.1-8B Q4_K_M in 24.5 instead
    /// of 30.4; at 64 rows the prefill path is twice as fast (6.5 against 13.6 ms).
    pub batch_mv: usize,
    /// Products of 9 to N rows (N <= 64) run the tensor-core small-batch kernels
    /// (`kernels/linear_tc.cuh`: each weight read once for all rows, on f16 pairs as the prefill
    /// path, f32 sums) where the width is a multiple of 32; before `batch-mv` (`batch-tc`; 0:
    /// never). 32 by measurement (H200, cuda/NOTES.md "Small-batch products"): up to 32 rows
    /// it beats the chunks of `batch-mv` and the prefill path on nearly every matrix of the 1B
    /// and the 8B (16 rows: a third to a half of their time); at 64 rows the prefill path wins
    /// on the long-row down projections (the 8B's step at 64 sequences: 28.5 ms against 31.3).
    pub batch_tc: usize,
    /// Kernels launched with programmatic dependent launch, on Hopper and later (`pdl`).
    pub pdl: bool,
    /// One-token Q4_K products prefetch their weights to L2 (`prefetch`).
    pub prefetch: bool,
    /// Pre-norm one-token products fold their RMSNorm in (`norm-fold`).
    pub norm_fold: bool,
    /// One-token products on 8-bit activations (`act8`).
    pub act8: MvMode,
    /// The persistent 8-bit one-token kernels (`p8`).
    pub persistent: MvMode,
    /// Blocks per multiprocessor of the persistent kernels, 1 or 2 (`p8-blocks`).
    pub persistent_blocks: usize,
    /// Rows per row group of the persistent plain / fused kernels, 1, 2 or 4 (`p8-rows`;
    /// compiled in).
    pub persistent_rows: usize,
    /// Which Q4_K matrices are re-laid for the persistent kernels at upload (`q4k-relayout`).
    pub q4k_relayout: MvMode,
    /// Which Q6_K matrices are re-laid at upload (`q6k-relayout`).
    pub q6k_relayout: MvMode,
    /// One-token kernels load their first weights before waiting for the previous kernel
    /// (`mv-early`; compiled in).
    pub mv_early: bool,
    /// Resident blocks asked of one-token kernel families, `(family, N)` (`mv-min-blocks`;
    /// compiled in as `HF2Q_MV_MINB_<FAMILY>`, `MV_BOUNDS` in matvec.cuh).
    pub mv_min_blocks: Vec<(String, u32)>,
    /// Mixture-of-experts decode in its fused form (`moe-fused`).
    pub moe_fused: bool,
    /// Batched decode steps over a paged KV cache (`serve --kv-paged`) of at most this many
    /// rows replay one CUDA graph per batch-size bucket instead of launching their kernels one
    /// by one (`paged-graphs`; 0: never). Default 64: graphs measured faster than eager steps
    /// at 16 rows (1.30-1.39x) and, once captured products of 33-64 rows ran on the small-batch
    /// tensor-core kernels, at 64 (1.14-1.31x); 96 and 128 rows (two 64-row halves per product)
    /// are not measured yet (BENCHMARKS.md).
    pub paged_graphs: usize,
    /// The prefill chunks of batched steps over a paged KV cache run their attention on tensor
    /// cores, 64 rows of a sequence per block reading keys through its block table, instead of
    /// each row through the one-row kernel (`paged-prefill`; f16 pool, heads of 64 or 128). On
    /// by measurement (H100, 1B Q4_0, BENCHMARKS.md): a 2,048-token prompt prefills at 32,127
    /// tok/s instead of 11,511, and 32 streams' ITL p99 under injected 4k-16k prompts is 44 ms
    /// instead of 655.
    pub paged_prefill_tc: bool,
    /// A batch-1 decode step of a dense Llama-family Q4_0 model runs as one persistent kernel
    /// (`decode=mega`, `kernels/mega.cu`) instead of the per-op graph (`decode=graph`, the
    /// default); steps it cannot run take the graph.
    pub decode_mega: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            kernel_cache: None,
            gemm: PrefillGemm::default(),
            attn_tensor_cores: true,
            attn_chunk: 16,
            batch_mv: 16,
            batch_tc: 32,
            pdl: true,
            prefetch: false,
            norm_fold: true,
            act8: MvMode::Auto,
            persistent: MvMode::Auto,
            persistent_blocks: 2,
            persistent_rows: 2,
            q4k_relayout: MvMode::Auto,
            q6k_relayout: MvMode::Auto,
            mv_early: true,
            mv_min_blocks: Vec::new(),
            moe_fused: false,
            paged_graphs: 64,
            paged_prefill_tc: true,
            decode_mega: false,
        }
    }
}

/// One settable option: its key, the values it takes and what it does.
pub struct OptionKey {
    pub key: &'static str,
    pub values: &'static str,
    pub help: &'static str,
}

const MODES: &str = "off|auto|all";
const BOOL: &str = "on|off";

impl CudaOptions {
    /// The environment variable [`CudaOptions::from_environment`] reads settings from:
    /// `key=value` pairs separated by commas, as `--cuda-opt` takes them.
    pub const ENV: &'static str = "HF2Q_CUDA_OPT";

    /// Every key [`CudaOptions::set`] takes, with its values and help (defaults first).
    pub const KEYS: &'static [OptionKey] = &[
        OptionKey {
            key: "gemm",
            values: "pairs|f16|int8|tiled",
            help: "prefill products: cuBLAS on f16 pairs (near f32, the default), one f16 \
                   pass (fastest, least exact), the 8-bit integer kernel, or our tiled kernel",
        },
        OptionKey {
            key: "attn-tc",
            values: BOOL,
            help: "prefill attention on tensor cores (f16 queries and probabilities); off: \
                   the f32 kernel",
        },
        OptionKey {
            key: "attn-chunk",
            values: "N>=8",
            help: "fewest keys per split of the one-token attention (default 16)",
        },
        OptionKey {
            key: "batch-mv",
            values: "N>=0",
            help: "products of 9..N rows (batched decode) on the small-batch kernels, 8 rows \
                   per launch (default 16; 0: always the prefill path)",
        },
        OptionKey {
            key: "batch-tc",
            values: "0..=64",
            help: "products of 9..N rows (batched decode) on the tensor-core small-batch \
                   kernels, weights read once for all rows (default 32; 0: off)",
        },
        OptionKey {
            key: "pdl",
            values: BOOL,
            help: "programmatic dependent launch (Hopper and later; on)",
        },
        OptionKey {
            key: "prefetch",
            values: BOOL,
            help: "one-token Q4_K products prefetch their weights to L2 (off)",
        },
        OptionKey {
            key: "norm-fold",
            values: BOOL,
            help: "pre-norm one-token products fold their RMSNorm in (on)",
        },
        OptionKey {
            key: "act8",
            values: MODES,
            help: "one-token products on 8-bit activations (auto: where they measured \
                   faster; all: wherever they can)",
        },
        OptionKey {
            key: "p8",
            values: MODES,
            help: "the persistent 8-bit one-token kernels (auto: large Q4_0/Q4_K/Q8_0 \
                   launches and output layers)",
        },
        OptionKey {
            key: "p8-blocks",
            values: "1|2",
            help: "blocks per multiprocessor of the persistent kernels (2)",
        },
        OptionKey {
            key: "p8-rows",
            values: "1|2|4",
            help: "rows per row group of the persistent kernels (2; compiled in)",
        },
        OptionKey {
            key: "q4k-relayout",
            values: MODES,
            help: "which Q4_K matrices are re-laid for the persistent kernels at upload \
                   (auto: those of 24M weights or more)",
        },
        OptionKey {
            key: "q6k-relayout",
            values: MODES,
            help: "which Q6_K matrices are re-laid at upload (auto: output layers)",
        },
        OptionKey {
            key: "mv-early",
            values: BOOL,
            help: "one-token kernels load weights before waiting for the previous kernel \
                   (on; compiled in)",
        },
        OptionKey {
            key: "mv-min-blocks",
            values: "FAMILY:N",
            help: "resident blocks asked of a one-token kernel family (N 0 or 4-10, e.g. \
                   q4_k:5; repeat for several; compiled in)",
        },
        OptionKey {
            key: "moe-fused",
            values: BOOL,
            help: "mixture-of-experts decode in its fused form (off: measured slower)",
        },
        OptionKey {
            key: "paged-graphs",
            values: "on|off|N",
            help: "batched decode steps over the paged KV cache (serve --kv-paged) of at most N \
                   rows replay one CUDA graph per batch-size bucket (1, 2, 4, 8, 16, 24, 32, 48, \
                   64, 96, 128 rows) instead of launching each kernel; on = 128, off = 0 \
                   (default 64: measured faster than eager steps at 16 and 64 rows)",
        },
        OptionKey {
            key: "paged-prefill",
            values: "tc|rows",
            help: "attention of prefill chunks over the paged KV cache (serve --kv-paged): \
                   tensor-core tiles of 64 rows (tc, the default; f16 cache, heads of 64 or \
                   128) or each row through the one-row kernel (rows)",
        },
        OptionKey {
            key: "decode",
            values: "graph|mega",
            help: "a batch-1 decode step: the per-op CUDA graph (graph, the default) or one \
                   persistent kernel for all layers (mega: dense Llama-family models whose \
                   products are Q4_0; other models take the graph)",
        },
    ];

    /// Options from an environment given as a lookup (`std::env::var_os`, or a map in tests):
    /// the kernel cache under `$HF2Q_HOME/cuda-kernels`, else
    /// `$XDG_CACHE_HOME/hf2q/cuda-kernels`, else `$HOME/.cache/hf2q/cuda-kernels`, and the
    /// settings of [`CudaOptions::ENV`]. Errors name a bad setting.
    pub fn from_environment(get: impl Fn(&str) -> Option<OsString>) -> Result<Self> {
        let nonempty = |k: &str| get(k).filter(|v| !v.is_empty());
        let kernel_cache = if let Some(h) = nonempty("HF2Q_HOME") {
            Some(PathBuf::from(h).join("cuda-kernels"))
        } else if let Some(x) = nonempty("XDG_CACHE_HOME") {
            Some(PathBuf::from(x).join("hf2q").join("cuda-kernels"))
        } else {
            nonempty("HOME").map(|h| PathBuf::from(h).join(".cache/hf2q/cuda-kernels"))
        };
        let mut o = CudaOptions {
            kernel_cache,
            ..CudaOptions::default()
        };
        if let Some(list) = nonempty(Self::ENV) {
            let list = list
                .into_string()
                .map_err(|_| Error::Msg(format!("{}: not valid UTF-8", Self::ENV)))?;
            o.set_list(&list)
                .map_err(|e| Error::Msg(format!("{}: {e}", Self::ENV)))?;
        }
        Ok(o)
    }

    /// Applies `key=value` settings separated by commas (`gemm=f16,p8=off`).
    pub fn set_list(&mut self, list: &str) -> Result<()> {
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) = item.split_once('=').ok_or_else(|| {
                Error::Msg(format!(
                    "CUDA option '{item}' is not key=value (the keys: {})",
                    Self::key_names()
                ))
            })?;
            self.set(key.trim(), value.trim())?;
        }
        Ok(())
    }

    /// Sets one option by its key ([`CudaOptions::KEYS`]). `mv-min-blocks` adds to the list
    /// (a family given twice takes the later count); every other key replaces its value.
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        let values = Self::KEYS
            .iter()
            .find(|k| k.key == key)
            .ok_or_else(|| {
                Error::Msg(format!(
                    "unknown CUDA option '{key}' (the keys: {})",
                    Self::key_names()
                ))
            })?
            .values;
        let bad = || Error::Msg(format!("CUDA option {key}: '{value}' is not {values}"));
        let flag = || match value {
            "on" | "1" | "true" | "yes" => Ok(true),
            "off" | "0" | "false" | "no" => Ok(false),
            _ => Err(bad()),
        };
        let mode = || match value {
            "off" | "0" => Ok(MvMode::Off),
            "auto" => Ok(MvMode::Auto),
            "all" => Ok(MvMode::All),
            _ => Err(bad()),
        };
        match key {
            "gemm" => self.gemm = PrefillGemm::from_name(value).ok_or_else(bad)?,
            "attn-tc" => self.attn_tensor_cores = flag()?,
            "attn-chunk" => {
                self.attn_chunk = value
                    .parse()
                    .ok()
                    .filter(|&n: &usize| (8..=1 << 20).contains(&n))
                    .ok_or_else(bad)?
            }
            "batch-mv" => {
                self.batch_mv = value
                    .parse()
                    .ok()
                    .filter(|&n: &usize| n <= 1 << 16)
                    .ok_or_else(bad)?
            }
            "batch-tc" => {
                self.batch_tc = value
                    .parse()
                    .ok()
                    .filter(|&n: &usize| n <= 64)
                    .ok_or_else(bad)?
            }
            "pdl" => self.pdl = flag()?,
            "prefetch" => self.prefetch = flag()?,
            "norm-fold" => self.norm_fold = flag()?,
            "act8" => self.act8 = mode()?,
            "p8" => self.persistent = mode()?,
            "p8-blocks" => {
                self.persistent_blocks = match value {
                    "1" => 1,
                    "2" => 2,
                    _ => return Err(bad()),
                }
            }
            "p8-rows" => {
                self.persistent_rows = match value {
                    "1" => 1,
                    "2" => 2,
                    "4" => 4,
                    _ => return Err(bad()),
                }
            }
            "q4k-relayout" => self.q4k_relayout = mode()?,
            "q6k-relayout" => self.q6k_relayout = mode()?,
            "mv-early" => self.mv_early = flag()?,
            "mv-min-blocks" => {
                let (family, n) = parse_min_blocks(value).ok_or_else(|| {
                    Error::Msg(format!(
                        "CUDA option mv-min-blocks: '{value}' is not FAMILY:N (a kernel family \
                         of letters, digits and '_', N 0 or 4-10)"
                    ))
                })?;
                self.mv_min_blocks.retain(|(f, _)| *f != family);
                self.mv_min_blocks.push((family, n));
            }
            "moe-fused" => self.moe_fused = flag()?,
            "paged-graphs" => {
                self.paged_graphs = match value {
                    "on" => 128,
                    "off" => 0,
                    _ => value
                        .parse()
                        .ok()
                        .filter(|&n: &usize| n <= 128)
                        .ok_or_else(bad)?,
                }
            }
            "paged-prefill" => {
                self.paged_prefill_tc = match value {
                    "tc" => true,
                    "rows" => false,
                    _ => return Err(bad()),
                }
            }
            "decode" => {
                self.decode_mega = match value {
                    "graph" => false,
                    "mega" => true,
                    _ => return Err(bad()),
                }
            }
            _ => unreachable!("every key of KEYS has an arm"),
        }
        Ok(())
    }

    /// The settings that differ from the defaults, as `key=value` pairs (empty: all default),
    /// for reports.
    pub fn changed(&self) -> Vec<String> {
        let d = CudaOptions::default();
        let on = |b: bool| if b { "on" } else { "off" };
        let mode = |m: MvMode| match m {
            MvMode::Off => "off",
            MvMode::Auto => "auto",
            MvMode::All => "all",
        };
        let mut out = Vec::new();
        let mut push = |changed: bool, key: &str, value: String| {
            if changed {
                out.push(format!("{key}={value}"));
            }
        };
        push(self.gemm != d.gemm, "gemm", self.gemm.name().into());
        push(
            self.attn_tensor_cores != d.attn_tensor_cores,
            "attn-tc",
            on(self.attn_tensor_cores).into(),
        );
        push(
            self.attn_chunk != d.attn_chunk,
            "attn-chunk",
            self.attn_chunk.to_string(),
        );
        push(
            self.batch_mv != d.batch_mv,
            "batch-mv",
            self.batch_mv.to_string(),
        );
        push(
            self.batch_tc != d.batch_tc,
            "batch-tc",
            self.batch_tc.to_string(),
        );
        push(self.pdl != d.pdl, "pdl", on(self.pdl).into());
        push(
            self.prefetch != d.prefetch,
            "prefetch",
            on(self.prefetch).into(),
        );
        push(
            self.norm_fold != d.norm_fold,
            "norm-fold",
            on(self.norm_fold).into(),
        );
        push(self.act8 != d.act8, "act8", mode(self.act8).into());
        push(
            self.persistent != d.persistent,
            "p8",
            mode(self.persistent).into(),
        );
        push(
            self.persistent_blocks != d.persistent_blocks,
            "p8-blocks",
            self.persistent_blocks.to_string(),
        );
        push(
            self.persistent_rows != d.persistent_rows,
            "p8-rows",
            self.persistent_rows.to_string(),
        );
        push(
            self.q4k_relayout != d.q4k_relayout,
            "q4k-relayout",
            mode(self.q4k_relayout).into(),
        );
        push(
            self.q6k_relayout != d.q6k_relayout,
            "q6k-relayout",
            mode(self.q6k_relayout).into(),
        );
        push(
            self.mv_early != d.mv_early,
            "mv-early",
            on(self.mv_early).into(),
        );
        for (family, n) in &self.mv_min_blocks {
            push(true, "mv-min-blocks", format!("{family}:{n}"));
        }
        push(
            self.moe_fused != d.moe_fused,
            "moe-fused",
            on(self.moe_fused).into(),
        );
        push(
            self.paged_graphs != d.paged_graphs,
            "paged-graphs",
            self.paged_graphs.to_string(),
        );
        push(
            self.paged_prefill_tc != d.paged_prefill_tc,
            "paged-prefill",
            if self.paged_prefill_tc { "tc" } else { "rows" }.into(),
        );
        push(
            self.decode_mega != d.decode_mega,
            "decode",
            if self.decode_mega { "mega" } else { "graph" }.into(),
        );
        out
    }

    /// The keys, comma-separated (for error messages).
    fn key_names() -> String {
        Self::KEYS
            .iter()
            .map(|k| k.key)
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The NVRTC `-D` options these settings compile in (nothing for the defaults, so the kernel
    /// cache entries of default options do not change).
    pub(crate) fn compile_defines(&self) -> Vec<String> {
        let mut o = Vec::new();
        if !self.mv_early {
            o.push("-DHF2Q_MV_EARLY=0".into());
        }
        for (family, n) in &self.mv_min_blocks {
            o.push(format!(
                "-DHF2Q_MV_MINB_{}={n}",
                family.to_ascii_uppercase()
            ));
        }
        if self.persistent_rows != 2 {
            o.push(format!("-DHF2Q_MP_RPW={}", self.persistent_rows));
        }
        o
    }
}

/// `FAMILY:N` of `mv-min-blocks`: a family of letters, digits and `_`, N 0 or 4..=10 (the
/// bounds `MV_BOUNDS` defines).
fn parse_min_blocks(spec: &str) -> Option<(String, u32)> {
    let (family, n) = spec.split_once(':')?;
    let (family, n) = (family.trim(), n.trim().parse::<u32>().ok()?);
    let ok = (n == 0 || (4..=10).contains(&n))
        && !family.is_empty()
        && family
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_');
    ok.then(|| (family.to_ascii_lowercase(), n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_compile_nothing_in_and_report_nothing_changed() {
        let d = CudaOptions::default();
        assert!(d.compile_defines().is_empty());
        assert!(d.changed().is_empty());
    }

    #[test]
    fn every_key_round_trips_through_its_report() {
        let mut o = CudaOptions::default();
        o.set_list(
            "gemm=f16, attn-tc=off,attn-chunk=32,batch-mv=24,batch-tc=48,pdl=0,prefetch=on,norm-fold=off,act8=all,\
             p8=off,p8-blocks=1,p8-rows=4,q4k-relayout=all,q6k-relayout=off,mv-early=off,\
             mv-min-blocks=q4_k:5,mv-min-blocks=Q8_0s:0,mv-min-blocks=q4_k:6,moe-fused=yes,\
             paged-graphs=on,paged-prefill=rows,decode=mega",
        )
        .unwrap();
        let report = o.changed();
        // One entry per key set, the repeated family once, with its later count.
        assert_eq!(report.len(), CudaOptions::KEYS.len() + 1);
        let mut again = CudaOptions::default();
        again.set_list(&report.join(",")).unwrap();
        assert_eq!(again, o);
        assert_eq!(
            o.compile_defines(),
            [
                "-DHF2Q_MV_EARLY=0",
                "-DHF2Q_MV_MINB_Q8_0S=0",
                "-DHF2Q_MV_MINB_Q4_K=6",
                "-DHF2Q_MP_RPW=4"
            ]
        );
    }

    #[test]
    fn bad_settings_name_the_key_and_what_it_takes() {
        let err = |s: &str| CudaOptions::default().set_list(s).unwrap_err().to_string();
        assert!(err("gemm=fast").contains("gemm: 'fast' is not pairs|f16|int8|tiled"));
        assert!(err("p8-blocks=3").contains("'3' is not 1|2"));
        assert!(err("attn-chunk=4").contains("attn-chunk"));
        assert!(err("attn-chunk=x").contains("attn-chunk"));
        assert!(err("pdl=maybe").contains("'maybe' is not on|off"));
        assert!(err("decode=fast").contains("decode: 'fast' is not graph|mega"));
        let unknown = err("warp=9");
        assert!(unknown.contains("unknown CUDA option 'warp'") && unknown.contains("gemm, "));
        assert!(err("gemm").contains("not key=value"));
        // Counts without a bound defined, junk and a hostile family name are refused.
        for bad in [
            "q4_k:2", "q4_k:11", "q4_k", ":5", "q4_k:x", "a-b:5", "a b:5", "a\"b:5",
        ] {
            assert!(
                err(&format!("mv-min-blocks={bad}")).contains("mv-min-blocks"),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_environment_gives_the_cache_and_the_settings() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| OsString::from(v))
            }
        };
        let o = CudaOptions::from_environment(env(&[
            ("HOME", "/h"),
            ("XDG_CACHE_HOME", ""),
            ("HF2Q_CUDA_OPT", "gemm=tiled"),
        ]))
        .unwrap();
        assert_eq!(
            o.kernel_cache.as_deref(),
            Some(std::path::Path::new("/h/.cache/hf2q/cuda-kernels"))
        );
        assert_eq!(o.gemm, PrefillGemm::Tiled);
        let o = CudaOptions::from_environment(env(&[("HOME", "/h"), ("HF2Q_HOME", "/q")])).unwrap();
        assert_eq!(
            o.kernel_cache.as_deref(),
            Some(std::path::Path::new("/q/cuda-kernels"))
        );
        assert_eq!(o.gemm, PrefillGemm::default());
        assert!(CudaOptions::from_environment(env(&[]))
            .unwrap()
            .kernel_cache
            .is_none());
        let e = CudaOptions::from_environment(env(&[("HF2Q_CUDA_OPT", "p8=sometimes")]))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("HF2Q_CUDA_OPT: ") && e.contains("p8"), "{e}");
    }
}
