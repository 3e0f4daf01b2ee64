//! `DeviceWeight`: a [`QTensor`] resident on the GPU, in its stored form.
//!
//! Most formats are copied unchanged: ggml blocks (packed structs of 18, 20, ..., 292 bytes, so
//! only 2-byte alignment inside a row is assumed by the kernels), dense f32/f16/bf16 rows, or MLX
//! packed words with their f32 scales and biases. Q4_0, Q8_0 and MXFP4 are split at upload (all
//! quants, 16-byte aligned, then all scales: [`split_blocks`]) and Q6_K's 210-byte super-blocks are
//! padded to 224 ([`pad_blocks`]), so that one lane reads its block with aligned wide loads in
//! the decode kernels (`kernels/matvec.cuh`). One kernel set per
//! format dequantizes on the fly (`kernels/quant.cuh`); the format picks the kernel names.

use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, DeviceRepr};
use rayon::prelude::*;

use super::{CudaDev, Program};
use hf2q_tensor::{Error, GgmlType, QTensor, Result, WeightData};

/// The kernel argument describing a weight; mirrors `struct WRef` in `kernels/quant.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct WeightArgs {
    pub data: u64,
    pub scales: u64,
    pub biases: u64,
    pub row_bytes: i64,
    pub cols: i32,
    pub group_size: i32,
}

// SAFETY: a plain #[repr(C)] struct of integers with the layout of the device struct.
unsafe impl DeviceRepr for WeightArgs {}

/// One family of one-token kernels for a format (`kernels/matvec*.cuh`): the plain / fused
/// product, the gated one, and for the persistent family both with the input's RMSNorm folded
/// in (`mpfn`, `mpgn`).
pub(crate) struct MvFns {
    pub(crate) plain: CudaFunction,
    pub(crate) gated: CudaFunction,
    pub(crate) normed: Option<(CudaFunction, CudaFunction)>,
}

impl MvFns {
    /// The gated or plain kernel, with the norm folded in when `norm` (None: this family has no
    /// such kernel).
    pub(crate) fn pick(&self, gated: bool, norm: bool) -> Option<&CudaFunction> {
        match (norm, gated) {
            (false, false) => Some(&self.plain),
            (false, true) => Some(&self.gated),
            (true, false) => self.normed.as_ref().map(|n| &n.0),
            (true, true) => self.normed.as_ref().map(|n| &n.1),
        }
    }
}

/// A weight `(R, C)` on the device. Built by [`CudaDev::upload_weight`].
pub struct DeviceWeight {
    pub name: String,
    /// R: output features.
    pub rows: usize,
    /// C: input features.
    pub cols: usize,
    /// Kernel-name suffix of the format (`q4_k`, `f16`, `mlx4`, ...).
    pub(crate) kind: &'static str,
    data: CudaSlice<u8>,
    /// MLX affine only: (R, C / group) scales and biases.
    affine: Option<(CudaSlice<f32>, CudaSlice<f32>, usize)>,
    row_bytes: usize,
    /// Split formats: byte offset of the scale array in `data` (q6_ks: of the high bits).
    scales_at: Option<usize>,
    /// q4_ks: byte offset of the per-super-block `d` / `dmin` in `data`; q6_ks: of the per-unit
    /// scales and `d` (passed as `biases`).
    supers_at: Option<usize>,
    /// The format's kernels, looked up once: mv1, mv2, mv4, mv8, gemm, embed, deqh, deqt, mt2,
    /// mt4, mt8.
    pub(crate) kernels: Vec<CudaFunction>,
    /// The one-token kernels of `kernels/matvec.cuh` (plain/fused `mvf`, gated `mvg`), for the
    /// formats that have them when the columns are a multiple of 32.
    pub(crate) fast: Option<MvFns>,
    /// The same with 8-bit activations (`kernels/matvec_q8.cuh`: `mqf`, `mqg`), for the
    /// quantized formats among them.
    pub(crate) fast_q8: Option<MvFns>,
    /// The persistent 8-bit kernels (`kernels/matvec_p8.cuh`: `mpf`, `mpg`), for Q4_0, Q8_0 and
    /// Q4_K.
    pub(crate) fast_p8: Option<MvFns>,
    /// The 8-bit integer prefill products (`kernels/mmq.cuh`), for the formats with `codes8`:
    /// the dense one (`mmq`) and the one over expert-ordered pairs of a stacked expert matrix
    /// (`mmqi`).
    pub(crate) mmq: Option<[CudaFunction; 2]>,
    /// The expert products of `kernels/matvec_id.cuh` (gated `mvgi`, down `mvdi`, down summed
    /// per token `mvdc`), for the formats of `fast`: this matrix read as stacked experts.
    pub(crate) fast_id: Option<[CudaFunction; 3]>,
}

/// Copies blocks of `block` bytes into slots of `stride` bytes (zero-padded), so that every
/// block starts 8-byte aligned: Q6_K's 210-byte super-blocks in 224-byte slots (`q6_kp`).
pub(crate) fn pad_blocks(data: &[u8], block: usize, stride: usize) -> Vec<u8> {
    let n = data.len() / block;
    let mut out = vec![0u8; n * stride];
    for (src, dst) in data.chunks_exact(block).zip(out.chunks_exact_mut(stride)) {
        dst[..block].copy_from_slice(src);
    }
    out
}

/// Rearranges ggml blocks of `block` bytes (a scale of `head` bytes: Q4_0's and Q8_0's f16, or
/// MXFP4's E8M0 byte, then `block - head` quant bytes) into all quants (block after block)
/// followed by all scales, so that every block's quants are aligned for 16-byte loads: the
/// device layout of the `q4_0s` / `q8_0s` / `mxfp4s` kernels.
pub(crate) fn split_blocks(data: &[u8], block: usize, head: usize) -> Vec<u8> {
    let n = data.len() / block;
    let q = block - head;
    let mut out = vec![0u8; n * block];
    let (qs, ds) = out.split_at_mut(n * q);
    for (i, b) in data.chunks_exact(block).enumerate() {
        ds[head * i..head * (i + 1)].copy_from_slice(&b[..head]);
        qs[q * i..q * (i + 1)].copy_from_slice(&b[head..]);
    }
    out
}

/// Q4_K re-laid for the GPU kernels ("q4_ks"; `FQ4_KS` in kernels/quant.cuh): each 32-element
/// sub-block's quants as 16 bytes in split Q4_0's order (element i in the low nibble of byte i,
/// element i + 16 in the high one), all of the matrix's in row order; then each sub-block's 6-bit
/// scale and min as two bytes (`sc | m << 8`); then each super-block's f16 `d` and `dmin`. The
/// kernels then read a sub-block with one aligned load and no 6-bit unpacking. `data` holds
/// whole 144-byte super-blocks; returns the bytes and where the two scale ranges start (148
/// bytes per 256 weights instead of 144).
pub(crate) fn q4k_split(data: &[u8]) -> (Vec<u8>, usize, usize) {
    let nsb = data.len() / 144;
    let (scales_at, supers_at) = (nsb * 128, nsb * 144);
    let mut out = vec![0u8; supers_at + nsb * 4];
    let (qs, rest) = out.split_at_mut(scales_at);
    let (sms, ds) = rest.split_at_mut(nsb * 16);
    // Super-block k fills bytes 128 k, 16 k and 4 k of the three ranges.
    qs.par_chunks_mut(128)
        .zip(sms.par_chunks_mut(16))
        .zip(ds.par_chunks_mut(4))
        .zip(data.par_chunks_exact(144))
        .for_each(|(((qs, sms), ds), sb)| {
            ds.copy_from_slice(&sb[..4]);
            for j in 0..8 {
                let (sc, m) = hf2q_tensor::quant::kquants::scale_min_k4(j, &sb[4..16]);
                sms[2 * j] = sc;
                sms[2 * j + 1] = m;
                // Sub-block j = 2c + h: nibble h of stored bytes 16 + 32c ..
                let src = &sb[16 + 32 * (j / 2)..16 + 32 * (j / 2) + 32];
                let q: [u8; 32] = std::array::from_fn(|l| (src[l] >> (4 * (j % 2))) & 15);
                pack_split_nibbles(&q, &mut qs[16 * j..16 * j + 16]);
            }
        });
    (out, scales_at, supers_at)
}

/// The low four bits of 32 values as 16 bytes in split Q4_0's order: value i in the low nibble
/// of byte i, value i + 16 in the high one.
fn pack_split_nibbles(q: &[u8; 32], out: &mut [u8]) {
    for (i, o) in out[..16].iter_mut().enumerate() {
        *o = (q[i] & 15) | (q[i + 16] & 15) << 4;
    }
}

/// Q6_K re-laid for the GPU kernels ("q6_ks"; `FQ6_KS` in kernels/quant.cuh), per 32-element
/// unit (the values q = 0..63 of `d sc (q - 32)`): the low four bits as 16 bytes in split Q4_0's
/// order, all of the matrix's in row order; then the high two bits as 8 bytes (element 4k + j of
/// each half at bits 2k of byte j of that half's word); then the two sub-block scales and the
/// super-block's f16 `d` as 4 bytes. The kernels read a unit with one 16-byte and two small
/// aligned loads. `data` holds whole 210-byte super-blocks; returns the bytes and where the two
/// later ranges start (224 bytes per 256 weights).
pub(crate) fn q6k_split(data: &[u8]) -> (Vec<u8>, usize, usize) {
    let nsb = data.len() / 210;
    let (hi_at, sc_at) = (nsb * 128, nsb * 192);
    let mut out = vec![0u8; nsb * 224];
    let (qs, rest) = out.split_at_mut(hi_at);
    let (hs, ss) = rest.split_at_mut(nsb * 64);
    // Super-block k fills bytes 128 k, 64 k and 32 k of the three ranges (in parallel, as
    // q4k_split: an 8B's output layer is 2M super-blocks).
    qs.par_chunks_mut(128)
        .zip(hs.par_chunks_mut(64))
        .zip(ss.par_chunks_mut(32))
        .zip(data.par_chunks_exact(210))
        .for_each(|(((qs, hs), ss), sb)| {
            let (ql, qh, sc) = (&sb[..128], &sb[128..192], &sb[192..208]);
            for t in 0..8 {
                let (n, j) = (t / 4, t % 4);
                let q: [u8; 32] = std::array::from_fn(|l| {
                    let low = (ql[64 * n + 32 * (j & 1) + l] >> (4 * (j >> 1))) & 15;
                    let high = (qh[32 * n + l] >> (2 * j)) & 3;
                    low | high << 4
                });
                pack_split_nibbles(&q, &mut qs[16 * t..16 * t + 16]);
                for half in 0..2 {
                    let word = (0..16).fold(0u32, |acc, e| {
                        let high = u32::from(q[16 * half + e] >> 4);
                        acc | high << (8 * (e % 4) + 2 * (e / 4))
                    });
                    hs[8 * t + 4 * half..8 * t + 4 * half + 4].copy_from_slice(&word.to_le_bytes());
                }
                ss[4 * t..4 * t + 4].copy_from_slice(&[sc[2 * t], sc[2 * t + 1], sb[208], sb[209]]);
            }
        });
    (out, hi_at, sc_at)
}

/// Index into [`DeviceWeight::kernels`] of the matrix-vector kernel for up to `nt` tokens
/// (1, 2, 4 or 8), the tiled kernel and the embedding gather.
pub(crate) fn mv_kernel(nt: usize) -> usize {
    match nt {
        1 => 0,
        2 => 1,
        4 => 2,
        _ => 3,
    }
}
pub(crate) const GEMM_KERNEL: usize = 4;
pub(crate) const EMBED_KERNEL: usize = 5;
pub(crate) const DEQH_KERNEL: usize = 6;
/// Rows to bf16 or f32 (`deqt_KIND`: the training products through a frozen weight).
pub(crate) const DEQT_KERNEL: usize = 7;
/// The tensor-core kernel for up to `8 * nt` tokens (nt = 2, 4 or 8: `mt{nt}_KIND`,
/// `kernels/linear_tc.cuh`).
pub(crate) fn mt_kernel(nt: usize) -> usize {
    match nt {
        2 => 8,
        4 => 9,
        _ => 10,
    }
}

impl std::fmt::Debug for DeviceWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceWeight({} {}x{} {})",
            self.name, self.rows, self.cols, self.kind
        )
    }
}

fn ggml_kind(ty: GgmlType) -> Option<(&'static str, Program)> {
    use GgmlType::*;
    Some(match ty {
        Q4_0 => ("q4_0", Program::LinearLegacy),
        Q4_1 => ("q4_1", Program::LinearLegacy),
        Q5_0 => ("q5_0", Program::LinearLegacy),
        Q5_1 => ("q5_1", Program::LinearLegacy),
        Q8_0 => ("q8_0", Program::LinearLegacy),
        MXFP4 => ("mxfp4", Program::LinearLegacy),
        F32 => ("f32", Program::LinearLegacy),
        F16 => ("f16", Program::LinearLegacy),
        BF16 => ("bf16", Program::LinearLegacy),
        Q2_K => ("q2_k", Program::LinearKquant),
        Q3_K => ("q3_k", Program::LinearKquant),
        Q4_K => ("q4_k", Program::LinearKquant),
        Q5_K => ("q5_k", Program::LinearKquant),
        Q6_K => ("q6_k", Program::LinearKquant),
        Q8_K => ("q8_k", Program::LinearKquant),
        _ => return None,
    })
}

fn mlx_kind(bits: u32) -> Option<&'static str> {
    Some(match bits {
        2 => "mlx2",
        3 => "mlx3",
        4 => "mlx4",
        5 => "mlx5",
        6 => "mlx6",
        8 => "mlx8",
        _ => return None,
    })
}

impl DeviceWeight {
    /// Bytes resident on the device.
    pub fn device_bytes(&self) -> usize {
        self.data.len()
            + self
                .affine
                .as_ref()
                .map_or(0, |(s, b, _)| 4 * (s.len() + b.len()))
    }

    /// Kernel-name suffix of the stored format, e.g. `q4_k` or `mlx4`.
    pub fn kind(&self) -> &'static str {
        self.kind
    }

    pub(crate) fn args(&self, dev: &CudaDev) -> WeightArgs {
        let s = dev.stream();
        let ptr = |b: &CudaSlice<f32>| b.device_ptr(s).0;
        let data = self.data.device_ptr(s).0;
        let (scales, biases, group) = match (&self.affine, self.scales_at) {
            (Some((sc, bi, g)), _) => (ptr(sc), ptr(bi), *g),
            (None, Some(at)) => (
                data + at as u64,
                self.supers_at.map_or(0, |s| data + s as u64),
                0,
            ),
            (None, None) => (0, 0, 0),
        };
        WeightArgs {
            data,
            scales,
            biases,
            row_bytes: self.row_bytes as i64,
            cols: self.cols as i32,
            group_size: group as i32,
        }
    }
}

impl CudaDev {
    /// Copies a weight to the device in its stored form (any ggml type hf2q computes with, or
    /// MLX affine at 2, 3, 4, 5, 6 or 8 bits).
    pub fn upload_weight(&self, w: &QTensor) -> Result<DeviceWeight> {
        if w.rows == 0 || w.cols == 0 {
            return Err(Error::Shape(format!(
                "cuda: weight '{}' is empty ({}x{})",
                w.name, w.rows, w.cols
            )));
        }
        if w.rows > i32::MAX as usize || w.cols > i32::MAX as usize {
            return Err(Error::Shape(format!(
                "cuda: weight '{}' ({}x{}) is too large for 32-bit indices",
                w.name, w.rows, w.cols
            )));
        }
        self.bind()?;
        let unsupported = || Error::UnsupportedType {
            ty: w.type_name(),
            tensor: w.name.clone(),
        };
        let mut scales_at = None;
        let mut supers_at = None;
        let (kind, program, data, affine, row_bytes) = match &w.data {
            WeightData::Ggml { ty, data } => {
                let (kind, program) = ggml_kind(*ty).ok_or_else(unsupported)?;
                let rb = ty
                    .row_bytes(w.cols)
                    .ok_or_else(|| Error::Shape(format!("cuda: weight '{}' rows", w.name)))?;
                // (kind, block bytes, scale bytes at the block's start)
                let split = match ty {
                    GgmlType::Q4_0 => Some(("q4_0s", 18, 2)),
                    GgmlType::Q8_0 => Some(("q8_0s", 34, 2)),
                    GgmlType::MXFP4 => Some(("mxfp4s", 17, 1)),
                    _ => None,
                };
                // The k-quants re-laid in three ranges (quants at 16 bytes per 32 weights first).
                type Relay = fn(&[u8]) -> (Vec<u8>, usize, usize);
                let relay: Option<(&'static str, Relay, usize)> = match ty {
                    GgmlType::Q4_K if self.q4k_relaid(w.rows * w.cols) => {
                        Some(("q4_ks", q4k_split, 144))
                    }
                    GgmlType::Q6_K if self.q6k_relaid(w.rows) => Some(("q6_ks", q6k_split, 210)),
                    _ => None,
                };
                let whole = data.len() == w.rows * rb;
                match (relay, split) {
                    (Some((rkind, relay, block)), _) if whole => {
                        let (bytes, sa, da) = relay(data.as_slice());
                        scales_at = Some(sa);
                        supers_at = Some(da);
                        (rkind, program, self.upload(&bytes)?, None, rb / block * 128)
                    }
                    (_, Some((skind, block, head))) if whole => {
                        let q = block - head;
                        let blocks = data.len() / block;
                        scales_at = Some(blocks * q);
                        let bytes = split_blocks(data.as_slice(), block, head);
                        (skind, program, self.upload(&bytes)?, None, rb / block * q)
                    }
                    _ if *ty == GgmlType::Q6_K && whole => {
                        let bytes = pad_blocks(data.as_slice(), 210, 224);
                        ("q6_kp", program, self.upload(&bytes)?, None, rb / 210 * 224)
                    }
                    _ => (kind, program, self.upload(data.as_slice())?, None, rb),
                }
            }
            WeightData::Affine {
                params,
                packed,
                scales,
                biases,
            } => {
                let kind = mlx_kind(params.bits).ok_or_else(unsupported)?;
                let rb = w.cols * params.bits as usize / 8;
                let affine = (
                    self.upload(scales)?,
                    self.upload(biases)?,
                    params.group_size,
                );
                (
                    kind,
                    Program::LinearMlx,
                    self.upload(packed.as_slice())?,
                    Some(affine),
                    rb,
                )
            }
        };
        let kernels = [
            "mv1", "mv2", "mv4", "mv8", "gemm", "embed", "deqh", "deqt", "mt2", "mt4", "mt8",
        ]
        .iter()
        .map(|k| self.function(program, &format!("{k}_{kind}")))
        .collect::<Result<Vec<_>>>()?;
        let fns = |family: char| -> Result<MvFns> {
            let f = |form: &str| self.function(program, &format!("m{family}{form}_{kind}"));
            Ok(MvFns {
                plain: f("f")?,
                gated: f("g")?,
                normed: if family == 'p' {
                    Some((f("fn")?, f("gn")?))
                } else {
                    None
                },
            })
        };
        let fast = if w.cols % 32 == 0
            && matches!(
                kind,
                "q4_0s"
                    | "q8_0s"
                    | "mxfp4s"
                    | "q4_k"
                    | "q4_ks"
                    | "q6_kp"
                    | "q6_ks"
                    | "f16"
                    | "bf16"
                    | "f32"
            ) {
            Some(fns('v')?)
        } else {
            None
        };
        let fast_q8 = if fast.is_some() && matches!(kind, "q4_0s" | "q8_0s" | "q4_k" | "q6_kp") {
            Some(fns('q')?)
        } else {
            None
        };
        let fast_p8 =
            if fast.is_some() && matches!(kind, "q4_0s" | "q8_0s" | "q4_k" | "q4_ks" | "q6_ks") {
                Some(fns('p')?)
            } else {
                None
            };
        let fast_id = if fast.is_some() {
            let f = |form: &str| {
                let name = match form {
                    "c" => format!("mvdc_{kind}"),
                    _ => format!("mv{form}i_{kind}"),
                };
                self.function(program, &name)
            };
            Some([f("g")?, f("d")?, f("c")?])
        } else {
            None
        };
        let mmq = if w.cols.is_multiple_of(32)
            && matches!(
                kind,
                "q4_0s" | "q8_0s" | "q4_k" | "q4_ks" | "q6_kp" | "q6_ks"
            ) {
            Some([
                self.function(program, &format!("mmq_{kind}"))?,
                self.function(program, &format!("mmqi_{kind}"))?,
            ])
        } else {
            None
        };
        Ok(DeviceWeight {
            kernels,
            fast,
            fast_q8,
            fast_p8,
            mmq,
            fast_id,
            scales_at,
            supers_at,
            name: w.name.clone(),
            rows: w.rows,
            cols: w.cols,
            kind,
            data,
            affine,
            row_bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_and_padded_layouts_keep_every_byte() {
        let data: Vec<u8> = (0..18 * 5).map(|i| (i * 7 % 251) as u8).collect();
        let s = split_blocks(&data, 18, 2);
        for (i, b) in data.chunks_exact(18).enumerate() {
            assert_eq!(&s[16 * i..16 * (i + 1)], &b[2..], "quants of block {i}");
            assert_eq!(
                &s[80 + 2 * i..80 + 2 * i + 2],
                &b[..2],
                "scale of block {i}"
            );
        }
        let data: Vec<u8> = (0..210 * 3).map(|i| (i % 253) as u8 + 1).collect();
        let p = pad_blocks(&data, 210, 224);
        assert_eq!(p.len(), 224 * 3);
        for (i, b) in data.chunks_exact(210).enumerate() {
            assert_eq!(&p[224 * i..224 * i + 210], b);
            assert!(p[224 * i + 210..224 * (i + 1)].iter().all(|&v| v == 0));
        }
        let data: Vec<u8> = (0..17 * 3).map(|i| (i * 11 % 251) as u8).collect();
        let s = split_blocks(&data, 17, 1);
        for (i, b) in data.chunks_exact(17).enumerate() {
            assert_eq!(
                &s[16 * i..16 * (i + 1)],
                &b[1..],
                "MXFP4 quants of block {i}"
            );
            assert_eq!(s[48 + i], b[0], "MXFP4 scale of block {i}");
        }
    }

    /// `n` bytes of xorshift noise from `seed` (test blocks of every bit pattern).
    fn noise(n: usize, mut seed: u64) -> Vec<u8> {
        (0..n)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed as u8
            })
            .collect()
    }

    /// The little-endian f16 at byte `o` of `b`, as f32.
    fn f16_at(b: &[u8], o: usize) -> f32 {
        hf2q_tensor::quant::float::f16_bits_to_f32(u16::from_le_bytes([b[o], b[o + 1]]))
    }

    /// The re-laid Q4_K dequantizes to what the stored blocks do (the CPU reference's
    /// dequantization, rebuilt from the three ranges with the kernels' arithmetic).
    #[test]
    fn q4k_split_keeps_every_value() {
        let mut data = noise(144 * 6, 0x2545_f491_4f6c_dd1d);
        // Finite, modest d / dmin so that every value is a number.
        for sb in data.chunks_exact_mut(144) {
            sb[..4].copy_from_slice(&[0x00, 0x1c, 0x66, 0x1a]);
        }
        let mut want = vec![0f32; 6 * 256];
        hf2q_tensor::quant::dequantize(GgmlType::Q4_K, &data, &mut want).unwrap();
        let (out, sa, da) = q4k_split(&data);
        assert_eq!((sa, da, out.len()), (6 * 128, 6 * 144, 6 * 148));
        for (e, &w) in want.iter().enumerate() {
            let (b, i) = (e / 32, e % 32);
            let q = (out[16 * b + i % 16] >> (4 * (i / 16))) & 15;
            let (sc, m) = (out[sa + 2 * b], out[sa + 2 * b + 1]);
            let (d, dmin) = (
                f16_at(&out, da + 4 * (b / 8)),
                f16_at(&out, da + 4 * (b / 8) + 2),
            );
            let got = (d * sc as f32) * q as f32 - dmin * m as f32;
            assert_eq!(got.to_bits(), w.to_bits(), "element {e}");
        }
    }

    /// The re-laid Q6_K dequantizes to what the stored blocks do (as above, with `FQ6_KS`'s
    /// reading of the three ranges).
    #[test]
    fn q6k_split_keeps_every_value() {
        let mut data = noise(210 * 5, 0x9e37_79b9_7f4a_7c15);
        for (k, sb) in data.chunks_exact_mut(210).enumerate() {
            sb[208..].copy_from_slice(&[0x00, 0x1c + k as u8]);
        }
        let mut want = vec![0f32; 5 * 256];
        hf2q_tensor::quant::dequantize(GgmlType::Q6_K, &data, &mut want).unwrap();
        let (out, ha, sa) = q6k_split(&data);
        assert_eq!((ha, sa, out.len()), (5 * 128, 5 * 192, 5 * 224));
        for (e, &w) in want.iter().enumerate() {
            let (b, i) = (e / 32, e % 32);
            let (half, k, j) = (i / 16, (i % 16) / 4, i % 4);
            let low = (out[16 * b + i % 16] >> (4 * half)) & 15;
            let o = ha + 8 * b + 4 * half;
            let word = u32::from_le_bytes([out[o], out[o + 1], out[o + 2], out[o + 3]]);
            let high = (word >> (8 * j + 2 * k)) & 3;
            let q = i32::from(low) | (high as i32) << 4;
            let sc = out[sa + 4 * b + half] as i8;
            let d = f16_at(&out, sa + 4 * b + 2);
            let got = (d * sc as f32) * (q - 32) as f32;
            assert_eq!(got.to_bits(), w.to_bits(), "element {e}");
        }
    }
}
