//! NVRTC compilation of the embedded kernel sources, with an on-disk cubin cache.
//!
//! Each program is compiled for the device's own architecture (`--gpu-architecture=sm_XY`), so
//! the cubin uses that chip's instructions and the driver has nothing to JIT at load. The cache
//! entry of a program is named by a 64-bit FNV-1a hash of everything that determines the cubin:
//! the program's and headers' names and text, the options, the driver and NVRTC versions and the
//! architecture. An entry is a small header (magic, length, checksum) and the cubin; one whose
//! header or checksum is wrong, or that the driver refuses to load, is recompiled and rewritten
//! (written to a temporary name, then renamed, so a reader never sees half a file).

use std::collections::HashMap;
use std::ffi::{c_char, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaModule};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys, Ptx};

use super::{cuda_err, CudaOptions, DeviceInfo, Program};

use hf2q_tensor::{Error, Result};

/// Headers every program may `#include "..."` by these names.
const HEADERS: [(&str, &str); 12] = [
    ("common.cuh", include_str!("kernels/common.cuh")),
    ("quant.cuh", include_str!("kernels/quant.cuh")),
    ("linear.cuh", include_str!("kernels/linear.cuh")),
    ("linear_tc.cuh", include_str!("kernels/linear_tc.cuh")),
    ("matvec.cuh", include_str!("kernels/matvec.cuh")),
    ("matvec_id.cuh", include_str!("kernels/matvec_id.cuh")),
    ("moe_route.cuh", include_str!("kernels/moe_route.cuh")),
    ("matvec_q8.cuh", include_str!("kernels/matvec_q8.cuh")),
    ("matvec_p8.cuh", include_str!("kernels/matvec_p8.cuh")),
    ("mmq.cuh", include_str!("kernels/mmq.cuh")),
    ("train.cuh", include_str!("kernels/train.cuh")),
    // Included by the megakernel for its device functions (its kernels come along unused).
    ("attention.cu", include_str!("kernels/attention.cu")),
];

fn source(p: Program) -> (&'static str, &'static str) {
    match p {
        Program::Elementwise => ("elementwise.cu", include_str!("kernels/elementwise.cu")),
        Program::Attention => ("attention.cu", include_str!("kernels/attention.cu")),
        Program::LinearLegacy => ("linear_legacy.cu", include_str!("kernels/linear_legacy.cu")),
        Program::LinearKquant => ("linear_kquant.cu", include_str!("kernels/linear_kquant.cu")),
        Program::LinearMlx => ("linear_mlx.cu", include_str!("kernels/linear_mlx.cu")),
        Program::Train => ("train.cu", include_str!("kernels/train.cu")),
        Program::TrainAttn => ("train_attn.cu", include_str!("kernels/train_attn.cu")),
        Program::Mega => ("mega.cu", include_str!("kernels/mega.cu")),
    }
}

/// Bumped when the cache entry format or the way options are built changes.
const CACHE_FORMAT: &str = "hf2q-cubin-v1";
const MAGIC: &[u8; 8] = b"HF2QCUBN";

pub(crate) fn arch_option(info: &DeviceInfo) -> String {
    let (major, minor) = info.compute_capability;
    format!("--gpu-architecture=sm_{major}{minor}")
}

/// NVRTC options: the architecture, the language, and what `defines` compile in
/// ([`CudaOptions::compile_defines`]).
fn options(arch: &str, defines: &[String]) -> Vec<String> {
    let mut o = vec![arch.to_string(), "-std=c++17".into()];
    o.extend(defines.iter().cloned());
    o
}

struct Fnv(u64);

impl Fnv {
    fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Fnv {
        for &x in b {
            self.0 ^= x as u64;
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
        // A separator, so that ("ab", "c") and ("a", "bc") hash differently.
        self.0 ^= 0xff;
        self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        self
    }
}

fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library names.
    unsafe { nvrtc_sys::is_culib_present() }
}

fn nvrtc_version() -> (i32, i32) {
    if !nvrtc_present() {
        return (0, 0);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two ints.
    match unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }.result() {
        Ok(()) => (major, minor),
        Err(_) => (0, 0),
    }
}

/// Compiles `source` (reported as `name`) to a cubin with the embedded headers available.
pub(crate) fn compile(name: &str, source: &str, arch: &str, defines: &[String]) -> Result<Vec<u8>> {
    compile_with(name, source, arch, defines, &[]).map(|(c, _)| c)
}

/// Whether NVRTC can be loaded (kernels can be compiled even without a GPU).
pub fn nvrtc_available() -> bool {
    nvrtc_present()
}

fn program_log(prog: nvrtc_sys::nvrtcProgram) -> String {
    // SAFETY: `prog` is a live program; the log is NUL-terminated.
    unsafe { nvrtc::get_program_log(prog) }
        .map(|l| {
            // SAFETY: `l` holds the NUL-terminated log.
            unsafe { CStr::from_ptr(l.as_ptr()) }
                .to_string_lossy()
                .into_owned()
        })
        .unwrap_or_default()
}

fn compile_with(
    name: &str,
    source: &str,
    arch: &str,
    defines: &[String],
    extra: &[&str],
) -> Result<(Vec<u8>, String)> {
    if !nvrtc_present() {
        return Err(Error::Msg(format!(
            "cuda: cannot compile {name}: the NVRTC library (libnvrtc) was not found; add the \
             CUDA toolkit's lib64 folder to LD_LIBRARY_PATH"
        )));
    }
    let cstr = |s: &str| {
        CString::new(s).map_err(|_| Error::Msg(format!("cuda: {name}: source holds a NUL byte")))
    };
    let src_c = cstr(source)?;
    let name_c = cstr(name)?;
    let hdr_src: Vec<CString> = HEADERS.iter().map(|h| cstr(h.1)).collect::<Result<_>>()?;
    let hdr_name: Vec<CString> = HEADERS.iter().map(|h| cstr(h.0)).collect::<Result<_>>()?;
    let hdr_src_p: Vec<*const c_char> = hdr_src.iter().map(|c| c.as_ptr()).collect();
    let hdr_name_p: Vec<*const c_char> = hdr_name.iter().map(|c| c.as_ptr()).collect();
    let nerr = |what: &'static str| {
        move |e: nvrtc::NvrtcError| Error::Msg(format!("cuda: nvrtc {what} for {name}: {e}"))
    };
    let mut prog: nvrtc_sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer is a live NUL-terminated string for the duration of the call, and the
    // two header arrays have HEADERS.len() entries.
    unsafe {
        nvrtc_sys::nvrtcCreateProgram(
            &mut prog,
            src_c.as_ptr(),
            name_c.as_ptr(),
            HEADERS.len() as i32,
            hdr_src_p.as_ptr(),
            hdr_name_p.as_ptr(),
        )
    }
    .result()
    .map_err(nerr("create program"))?;
    let out = (|| {
        let mut opts = options(arch, defines);
        opts.extend(extra.iter().map(|o| o.to_string()));
        // SAFETY: `prog` is a live program.
        let compiled = unsafe { nvrtc::compile_program(prog, &opts) };
        if let Err(e) = compiled {
            let log = program_log(prog);
            return Err(Error::Msg(format!(
                "cuda: compiling {name} ({}) failed: {e}\n{}",
                opts.join(" "),
                log.trim_end()
            )));
        }
        let mut size = 0usize;
        // SAFETY: `prog` compiled successfully; writes one size.
        unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size) }
            .result()
            .map_err(nerr("cubin size"))?;
        let mut cubin = vec![0u8; size];
        // SAFETY: `cubin` has the `size` bytes NVRTC asked for.
        unsafe { nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char) }
            .result()
            .map_err(nerr("cubin"))?;
        Ok((cubin, program_log(prog)))
    })();
    // SAFETY: `prog` is destroyed exactly once.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    out
}

fn cache_key(p: Program, arch: &str, defines: &[String], info: &DeviceInfo) -> u64 {
    let (name, text) = source(p);
    let mut h = Fnv::new();
    h.bytes(CACHE_FORMAT.as_bytes())
        .bytes(name.as_bytes())
        .bytes(text.as_bytes());
    for (n, t) in HEADERS {
        h.bytes(n.as_bytes()).bytes(t.as_bytes());
    }
    for o in options(arch, defines) {
        h.bytes(o.as_bytes());
    }
    let (nv_major, nv_minor) = nvrtc_version();
    h.bytes(&info.driver_version.to_le_bytes())
        .bytes(&nv_major.to_le_bytes())
        .bytes(&nv_minor.to_le_bytes());
    h.0
}

fn checksum(b: &[u8]) -> u64 {
    Fnv::new().bytes(b).0
}

fn read_entry(path: &Path) -> Option<Vec<u8>> {
    let data = std::fs::read(path).ok()?;
    if data.len() < 24 || &data[..8] != MAGIC {
        return None;
    }
    let len = u64::from_le_bytes(data[8..16].try_into().ok()?) as usize;
    let sum = u64::from_le_bytes(data[16..24].try_into().ok()?);
    let body = &data[24..];
    (body.len() == len && checksum(body) == sum).then(|| body.to_vec())
}

fn write_entry(path: &Path, cubin: &[u8]) {
    // Caching is an optimisation: any failure here only means compiling again next time.
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let mut data = Vec::with_capacity(cubin.len() + 24);
    data.extend_from_slice(MAGIC);
    data.extend_from_slice(&(cubin.len() as u64).to_le_bytes());
    data.extend_from_slice(&checksum(cubin).to_le_bytes());
    data.extend_from_slice(cubin);
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, &data).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// A program's cubin: from the cache when a valid entry exists, else compiled (and cached).
fn cubin_for(
    p: Program,
    info: &DeviceInfo,
    options: &CudaOptions,
    fresh: bool,
) -> Result<(Vec<u8>, Option<PathBuf>)> {
    let arch = arch_option(info);
    let defines = options.compile_defines();
    let (name, text) = source(p);
    let entry = options.kernel_cache.as_deref().map(|d| {
        let stem = name.trim_end_matches(".cu");
        d.join(format!(
            "{stem}-{:016x}.cubin",
            cache_key(p, &arch, &defines, info)
        ))
    });
    if !fresh {
        if let Some(c) = entry.as_deref().and_then(read_entry) {
            return Ok((c, entry));
        }
    }
    let cubin = compile(name, text, &arch, &defines)?;
    if let Some(e) = &entry {
        write_entry(e, &cubin);
    }
    Ok((cubin, entry))
}

/// Compiles every embedded program for compute capability `cc` with NVRTC (no device and no
/// cache involved) and returns each program's file name and cubin; `extra` options are appended
/// (e.g. `--ptxas-options=-v`, whose report is then returned as the third element).
pub fn compile_all_for(
    cc: (i32, i32),
    extra: &[&str],
) -> Result<Vec<(&'static str, Vec<u8>, String)>> {
    let arch = format!("--gpu-architecture=sm_{}{}", cc.0, cc.1);
    Program::ALL
        .iter()
        .map(|&p| {
            let (name, text) = source(p);
            let (cubin, log) = compile_with(name, text, &arch, &[], extra)?;
            Ok((name, cubin, log))
        })
        .collect()
}

/// Compiles every embedded program for compute capability `cc` into the cache folder `dir`, as
/// [`super::CudaDev::open`] with default options would look them up on a device whose driver
/// reports `driver_version` (e.g. 13000): warming the cache of another machine, whose first open then
/// loads instead of compiling (an entry that does not match is simply compiled there). Valid
/// entries already in `dir` are kept.
#[doc(hidden)]
pub fn fill_cache_for(dir: &Path, cc: (i32, i32), driver_version: i32) -> Result<()> {
    let info = DeviceInfo {
        ordinal: 0,
        name: String::new(),
        compute_capability: cc,
        total_memory: 0,
        multiprocessors: 0,
        driver_version,
    };
    let options = CudaOptions {
        kernel_cache: Some(dir.to_path_buf()),
        ..CudaOptions::default()
    };
    for &p in Program::ALL.iter() {
        cubin_for(p, &info, &options, false)?;
    }
    Ok(())
}

/// [`compile_all_for`] of the one embedded program named `file` (e.g. `train_attn.cu`).
#[doc(hidden)]
pub fn compile_program_for(
    file: &str,
    cc: (i32, i32),
    extra: &[&str],
) -> Result<(Vec<u8>, String)> {
    let arch = format!("--gpu-architecture=sm_{}{}", cc.0, cc.1);
    let p = Program::ALL
        .iter()
        .copied()
        .find(|&p| source(p).0 == file)
        .ok_or_else(|| Error::Msg(format!("cuda: no embedded program {file}")))?;
    let (name, text) = source(p);
    compile_with(name, text, &arch, &[], extra)
}

/// Compiles one source for compute capability `cc` (see [`super::CudaDev::compile`]).
pub fn compile_for(name: &str, source: &str, cc: (i32, i32)) -> Result<Vec<u8>> {
    compile(
        name,
        source,
        &format!("--gpu-architecture=sm_{}{}", cc.0, cc.1),
        &[],
    )
}

/// Compiles (in parallel, one thread per program) or loads every program and loads the modules.
pub(crate) fn load_all(
    ctx: &Arc<CudaContext>,
    info: &DeviceInfo,
    options: &CudaOptions,
) -> Result<HashMap<Program, Arc<CudaModule>>> {
    // The megakernel is compiled only for the option that runs it.
    let wanted: Vec<Program> = Program::ALL
        .iter()
        .copied()
        .filter(|&p| p != Program::Mega || options.decode_mega)
        .collect();
    let cubins: Vec<Result<(Vec<u8>, Option<PathBuf>)>> = std::thread::scope(|s| {
        let handles: Vec<_> = wanted
            .iter()
            .map(|&p| s.spawn(move || cubin_for(p, info, options, false)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Msg("cuda: a kernel compile panicked".into())))
            })
            .collect()
    });
    let mut modules = HashMap::new();
    for (&p, c) in wanted.iter().zip(cubins) {
        let (cubin, _) = c?;
        let module = match ctx.load_module(Ptx::from_binary(cubin)) {
            Ok(m) => m,
            // A cached cubin the driver refuses (corrupt beyond the checksum, or stale): build it
            // again from source, once.
            Err(_) => {
                let (cubin, _) = cubin_for(p, info, options, true)?;
                ctx.load_module(Ptx::from_binary(cubin))
                    .map_err(cuda_err(format_args!("loading {}", source(p).0)))?
            }
        };
        modules.insert(p, module);
    }
    Ok(modules)
}
