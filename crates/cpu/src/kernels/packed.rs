//! Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K weights re-laid out once for the AVX-512 VNNI
//! kernels: 16 rows side by side, so that one-token products (decode) read one sequential
//! stream and multiply 16 rows per `vpdpbusd`.
//!
//! Why: in ggml's row-major layout a Q4_0 row is 18-byte blocks, and the fused one-token kernel
//! (`fused_x86.rs`) spends more on its per-row work (gathering eight f16 scales one by one,
//! spreading them over lanes, a horizontal sum per row) than on the products; measured, it
//! runs at ~14 GB/s with the weights in L2, the same as from memory, so it is bound by its
//! instructions, not by memory. With 16 rows interleaved, a block's 16 scales are one 32-byte
//! load, lane `i` of every integer product is row `i` (no permute, no horizontal sum), and
//! each activation word is broadcast once for 16 rows. llama.cpp repacks Q4_0 the same way
//! for the same reason (8 rows).
//!
//! Layout of one 16-row group (`group_bytes`, a multiple of 64; rows past R are zeros, which
//! give zero products), Q4_0:
//! ```text
//! [nb][16] f16 d            block b's scales, row i at 32 b + 2 i; then padding to 64 bytes
//! [nb][4][16][4] u8         block b, word q: row i's packed bytes 4q..4q+4 (elements
//!                           4q..4q+4 in the low nibbles, 16+4q..16+4q+4 in the high ones)
//! ```
//! so that `v & 0xf` and `(v >> 4) & 0xf` of the 64-byte vector of word q are the codes of
//! elements 4q.. and 16+4q.. of all 16 rows, in `vpdpbusd`'s lane order. Q4_1: the same codes,
//! and per block 64 bytes of header, the 16 scales `d` then the 16 minimums `m`. Q5_0: the same
//! codes, and per block 96 bytes of header, the 16 scales then the 16 rows' 32 fifth bits
//! (added to the nibbles as they are read, 16 where a bit is set). Q8_0: 8 words
//! of whole bytes per block, stored as `q + 128` (unsigned, as `vpdpbusd` takes them; the
//! offset `-128 d` is applied with the activations' block sums). Q4_K: per 256-element
//! super-block the 16 rows' `d` and `dmin`, their eight 6-bit scales and minimums as bytes, and
//! the eight 32-element sub-blocks' codes laid out as Q4_0 blocks' (`Q4K_SUPER`); a sub-block's
//! scale and offset are `d * sc` and `-dmin * m`, as the reference decodes them; Q5_K the
//! same with each sub-block's fifth bits (`Q5K_SUPER`), added as Q5_0's are. Q6_K
//! (`Q6K_SUPER`): the 16-element scales and `d` per super-block, then per 32 elements the low
//! 4 bits as Q4_0's codes and the high 2 bits arranged for `vpmultishiftqb` (AVX-512 VBMI,
//! which Q6_K's packing therefore also needs). The prefill GEMM (`gemm_x86.rs`) reads the same
//! layouts into its panels with a mask and a shift per vector instead of a transpose. The
//! bytes are about the original's: the same for the 32-element formats (18, 20, 22 or 34 per
//! block and row) plus padding for odd block counts and partial groups, 2.8 % more for Q4_K
//! and 2.3 % for Q5_K (their scales as whole bytes), 1 % more for Q6_K (line alignment).

use hf2q_tensor::{GgmlType, QTensor, WeightData};

/// Rows per group.
pub(crate) const GROUP: usize = 16;

/// The packed formats, as the kernels' template parameter.
pub(crate) const Q4_0: u8 = 0;
pub(crate) const Q4_1: u8 = 1;
pub(crate) const Q8_0: u8 = 2;
pub(crate) const Q5_0: u8 = 3;
pub(crate) const Q4_K: u8 = 4;
pub(crate) const Q6_K: u8 = 5;
pub(crate) const Q5_K: u8 = 6;

/// Q4_K: bytes of one 256-element super-block for 16 rows: `d` and `dmin` (16 f16 each), the
/// eight sub-blocks' 6-bit scales and minimums as bytes (`[8][16]` each), then the codes of the
/// eight 32-element sub-blocks, each laid out as a Q4_0 block's (element t in the low nibble of
/// byte t, t + 16 in the high one; 4 words of 16 rows).
pub(crate) const Q4K_SUPER: usize = 320 + 8 * 256;

/// Q5_K: as Q4_K, with the eight sub-blocks' fifth bits (`[8][16]` u32, bit t: element t)
/// between the minimums and the codes.
pub(crate) const Q5K_SUPER: usize = 832 + 8 * 256;

/// Q4_K / Q5_K: a super-block's bytes and where its codes start.
pub(crate) const fn k_super(f: u8) -> (usize, usize) {
    if f == Q5_K {
        (Q5K_SUPER, 832)
    } else {
        (Q4K_SUPER, 320)
    }
}

/// Q6_K: bytes of one 256-element super-block for 16 rows: the sixteen 16-element scales (i8,
/// `[16][16]`), the 16 `d` (f16), 32 bytes of padding (so that the codes start on a line), then
/// eight 32-element units of 384 bytes: the low 4 bits as a Q4_0 block's codes (256 bytes) and
/// the high 2 bits (128 bytes: for each pair of rows and each group of four elements, the pair's
/// two bytes of four 2-bit fields; see `q6k_put`).
pub(crate) const Q6K_SUPER: usize = 320 + 8 * 384;

/// Bytes of one block's header for 16 rows: the scales (and Q4_1's minimums, Q5_0's fifth
/// bits).
pub(crate) const fn head_bytes(f: u8) -> usize {
    match f {
        Q4_1 => 64,
        Q5_0 => 96,
        _ => 32,
    }
}

/// Bytes of the headers of a group of `nb` blocks, rounded up to a whole 64-byte line.
pub(crate) const fn scales_bytes(nb: usize, f: u8) -> usize {
    (head_bytes(f) * nb).div_ceil(64) * 64
}

/// Bytes of one block's codes for 16 rows: 4-bit or 8-bit (Q8_0).
pub(crate) const fn codes_bytes(f: u8) -> usize {
    if f == Q8_0 {
        512
    } else {
        256
    }
}

/// Bytes of a group of `nb` blocks (of 32 elements).
pub(crate) const fn group_bytes(nb: usize, f: u8) -> usize {
    if f == Q4_K || f == Q5_K {
        return nb / 8 * k_super(f).0;
    }
    if f == Q6_K {
        return nb / 8 * Q6K_SUPER;
    }
    scales_bytes(nb, f) + codes_bytes(f) * nb
}

/// The ggml block of format `f`: bytes, offset of the quants, 4-byte words of quants, the XOR
/// that makes them unsigned codes.
const fn block_shape(f: u8) -> (usize, usize, usize, u32) {
    match f {
        Q4_0 => (18, 2, 4, 0),
        Q4_1 => (20, 4, 4, 0),
        Q5_0 => (22, 6, 4, 0),
        Q8_0 => (34, 2, 8, 0x8080_8080),
        // The k-quants' rows are handled by `q4k_put` / `q6k_put` and their inverses.
        _ => (0, 0, 0, 0),
    }
}

/// Zeroed memory the packed weights are written into: an anonymous mapping (page-aligned, its
/// pages zero and not resident until written), shared by the weights packed into it.
struct Chunk {
    map: memmap2::MmapMut,
    /// `map`'s start, taken once: regions not yet handed out are written through it while
    /// handed-out ones are read.
    ptr: *mut u8,
}

// SAFETY: a region of a chunk is written once, before any `Packed` refers to it (under the
// arena's `&mut`), and only read afterwards.
unsafe impl Send for Chunk {}
unsafe impl Sync for Chunk {}

impl Chunk {
    fn new(bytes: usize) -> Option<std::sync::Arc<Chunk>> {
        let mut map = memmap2::MmapMut::map_anon(bytes.max(1)).ok()?;
        let ptr = map.as_mut_ptr();
        Some(std::sync::Arc::new(Chunk { map, ptr }))
    }
}

/// Where packed weights go: chunks filled one after another, so that weights packed in the order
/// a forward pass first uses them lie in that order in memory, and the one-token kernel's
/// prefetches, running past the end of one weight, already fetch the start of the next.
/// (Measured: from memory the kernel streams ~21 GB/s on a large matrix but ~15 on a model's
/// few-hundred-KB ones when each starts cold.)
#[derive(Default)]
pub struct PackArena {
    cur: Option<(std::sync::Arc<Chunk>, usize)>,
}

/// Bytes per arena chunk (a larger weight gets a chunk of its own size). Untouched pages of a
/// chunk are never resident.
const CHUNK: usize = 64 << 20;

impl PackArena {
    pub const fn new() -> PackArena {
        PackArena { cur: None }
    }

    /// A fresh, zeroed region of `bytes` (a multiple of 64).
    fn take(&mut self, bytes: usize) -> Option<(std::sync::Arc<Chunk>, usize)> {
        match &mut self.cur {
            Some((c, used)) if c.map.len() - *used >= bytes => {
                let at = *used;
                *used += bytes;
                Some((c.clone(), at))
            }
            _ => {
                let c = Chunk::new(bytes.max(CHUNK))?;
                self.cur = Some((c.clone(), bytes));
                Some((c, 0))
            }
        }
    }

    /// The packed copy of `w` in this arena (None where [`Packed::fits`] says no).
    pub(crate) fn pack(&mut self, w: &QTensor) -> Option<Packed> {
        if !Packed::fits(w) {
            return None;
        }
        let ty = Packed::format(w)?;
        let bytes = w.rows.div_ceil(GROUP) * group_bytes(w.cols / 32, fmt_of(ty));
        let (chunk, at) = self.take(bytes)?;
        // SAFETY: `take` hands out each region once; nothing refers to it yet; it lies inside
        // the chunk's mapping.
        let dst = unsafe { std::slice::from_raw_parts_mut(chunk.ptr.add(at), bytes) };
        if !Packed::write(w, dst) {
            return None;
        }
        Some(Packed {
            ty,
            rows: w.rows,
            cols: w.cols,
            chunk,
            at,
            len: bytes,
        })
    }
}

/// A weight in the 16-row layout (see the module header), made by [`super::pack`] or
/// [`PackArena::pack`].
pub struct Packed {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    chunk: std::sync::Arc<Chunk>,
    at: usize,
    len: usize,
}

impl std::fmt::Debug for Packed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Packed({} {}x{}, {} bytes)",
            self.ty,
            self.rows,
            self.cols,
            self.bytes()
        )
    }
}

impl Packed {
    /// Whether `w` has a packed layout (its format and shape; the kernels that read it are
    /// AVX-512 VNNI's).
    pub(crate) fn fits(w: &QTensor) -> bool {
        Self::format(w).is_some()
    }

    /// `w`'s format if it has a packed layout.
    fn format(w: &QTensor) -> Option<GgmlType> {
        match w.data {
            WeightData::Ggml {
                ty: ty @ (GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q8_0),
                ..
            } if w.cols.is_multiple_of(32) && w.rows > 0 => Some(ty),
            WeightData::Ggml {
                ty: ty @ (GgmlType::Q4_K | GgmlType::Q5_K),
                ..
            } if w.cols.is_multiple_of(256) && w.rows > 0 => Some(ty),
            // Its kernel spreads the 2-bit fields with AVX-512 VBMI's `vpmultishiftqb`.
            WeightData::Ggml {
                ty: GgmlType::Q6_K, ..
            } if w.cols.is_multiple_of(256) && w.rows > 0 && has_vbmi() => Some(GgmlType::Q6_K),
            _ => None,
        }
    }

    /// Writes `w` in the packed layout into the zeroed `dst` (all its groups), handing `w`'s
    /// mapped pages back as they are copied (`Bytes::release_pages`: read again from the file
    /// if `w` itself is used later). Groups in parallel. False if `w`'s bytes do not match its
    /// shape.
    fn write(w: &QTensor, dst: &mut [u8]) -> bool {
        use rayon::prelude::*;
        let WeightData::Ggml { ty, data } = &w.data else {
            return false;
        };
        let f = fmt_of(*ty);
        let (bs, qs, words, flip) = block_shape(f);
        let (rows, nb) = (w.rows, w.cols / 32);
        let Some(row_bytes) = ty.row_bytes(w.cols) else {
            return false;
        };
        let src = data.as_slice();
        let (gb, sb, cb, hb) = (
            group_bytes(nb, f),
            scales_bytes(nb, f),
            codes_bytes(f),
            head_bytes(f),
        );
        if src.len() != rows * row_bytes || dst.len() != rows.div_ceil(GROUP) * gb {
            return false;
        }
        // A few MB of source at a time, its mapped pages handed back once copied: the copy
        // and the original are never both resident (a tied embedding alone is 30 MB in
        // SmolLM2 Q8_0).
        let per = (4 << 20) / (GROUP * row_bytes) + 1;
        for (c, dst) in dst.chunks_mut(per * gb).enumerate() {
            let g0 = c * per;
            dst.par_chunks_mut(gb).enumerate().for_each(|(g, dst)| {
                let g = g0 + g;
                for i in 0..GROUP.min(rows - g * GROUP) {
                    let row = &src[(g * GROUP + i) * row_bytes..][..row_bytes];
                    if f == Q4_K || f == Q5_K {
                        q4k_put(row, dst, i, f);
                        continue;
                    }
                    if f == Q6_K {
                        q6k_put(row, dst, i);
                        continue;
                    }
                    for (b, blk) in row.chunks_exact(bs).enumerate() {
                        dst[hb * b + 2 * i..][..2].copy_from_slice(&blk[..2]);
                        if f == Q4_1 {
                            dst[hb * b + 32 + 2 * i..][..2].copy_from_slice(&blk[2..4]);
                        }
                        if f == Q5_0 {
                            dst[hb * b + 32 + 4 * i..][..4].copy_from_slice(&blk[2..6]);
                        }
                        for q in 0..words {
                            let v = u32::from_le_bytes(blk[qs + 4 * q..][..4].try_into().unwrap());
                            dst[sb + cb * b + 64 * q + 4 * i..][..4]
                                .copy_from_slice(&(v ^ flip).to_le_bytes());
                        }
                    }
                }
            });
            let r0 = g0 * GROUP * row_bytes;
            let r1 = ((g0 + per) * GROUP).min(rows) * row_bytes;
            if let Ok(done) = data.slice(r0..r1) {
                done.release_pages();
            }
        }
        true
    }

    /// Whether this is the packed form of a weight of `w`'s type and shape.
    pub(crate) fn matches(&self, w: &QTensor) -> bool {
        self.rows == w.rows
            && self.cols == w.cols
            && matches!(w.data, WeightData::Ggml { ty, .. } if ty == self.ty)
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.len
    }

    /// The packed bytes (64-byte aligned).
    pub(crate) fn data(&self) -> &[u8] {
        // SAFETY: the region lies inside the chunk's mapping (checked when it was taken) and
        // is no longer written. Made from the raw pointer, not the map, so that no reference
        // covers the regions other weights are still being written into.
        unsafe { std::slice::from_raw_parts(self.chunk.ptr.add(self.at), self.len) }
    }

    pub(crate) fn blocks(&self) -> usize {
        self.cols / 32
    }

    /// The packed format (`Q4_0`, `Q4_1`, `Q5_0`, `Q8_0`, `Q4_K`, `Q5_K` or `Q6_K` of this module).
    pub(crate) fn fmt(&self) -> u8 {
        fmt_of(self.ty)
    }

    /// Row `r` as f32, the values `QTensor::dequantize_row` gives for the original (its blocks
    /// are put back together and decoded by the same function): for a tied embedding table,
    /// whose original pages were handed back when it was packed as the output layer.
    pub fn dequantize_row(&self, r: usize, dst: &mut [f32]) -> hf2q_tensor::Result<()> {
        if r >= self.rows || dst.len() != self.cols {
            return Err(hf2q_tensor::Error::Shape(format!(
                "packed weight: row {r} / {} columns requested of {}x{}",
                dst.len(),
                self.rows,
                self.cols
            )));
        }
        let f = self.fmt();
        let (bs, qs, words, flip) = block_shape(f);
        let nb = self.blocks();
        let (sb, cb, hb) = (scales_bytes(nb, f), codes_bytes(f), head_bytes(f));
        let g = &self.data()[r / GROUP * group_bytes(nb, f)..][..group_bytes(nb, f)];
        let i = r % GROUP;
        let mut row = vec![0u8; self.ty.row_bytes(self.cols).unwrap_or(0)];
        if f == Q4_K || f == Q5_K {
            q4k_get(g, i, &mut row, f);
            return hf2q_tensor::quant::dequantize(self.ty, &row, dst);
        }
        if f == Q6_K {
            q6k_get(g, i, &mut row);
            return hf2q_tensor::quant::dequantize(self.ty, &row, dst);
        }
        for (b, blk) in row.chunks_exact_mut(bs).enumerate() {
            blk[..2].copy_from_slice(&g[hb * b + 2 * i..][..2]);
            if f == Q4_1 {
                blk[2..4].copy_from_slice(&g[hb * b + 32 + 2 * i..][..2]);
            }
            if f == Q5_0 {
                blk[2..6].copy_from_slice(&g[hb * b + 32 + 4 * i..][..4]);
            }
            for q in 0..words {
                let v =
                    u32::from_le_bytes(g[sb + cb * b + 64 * q + 4 * i..][..4].try_into().unwrap());
                blk[qs + 4 * q..][..4].copy_from_slice(&(v ^ flip).to_le_bytes());
            }
        }
        hf2q_tensor::quant::dequantize(self.ty, &row, dst)
    }
}

/// The packed format of a ggml type that has one.
const fn fmt_of(ty: GgmlType) -> u8 {
    match ty {
        GgmlType::Q4_0 => Q4_0,
        GgmlType::Q4_1 => Q4_1,
        GgmlType::Q5_0 => Q5_0,
        GgmlType::Q4_K => Q4_K,
        GgmlType::Q5_K => Q5_K,
        GgmlType::Q6_K => Q6_K,
        _ => Q8_0,
    }
}

/// Whether the CPU has AVX-512 VBMI (the packed Q6_K kernel's `vpmultishiftqb`).
fn has_vbmi() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::arch::is_x86_feature_detected!("avx512vbmi");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Q6_K element `e` of the 210-byte block `blk` as its 6-bit code (ggml's order: in each half
/// of 128, element 32 g + l takes the low or high nibble of `ql[l]` or `ql[l + 32]` and bits
/// 2g..2g+2 of `qh[l]`).
fn q6k_code(blk: &[u8], e: usize) -> u8 {
    let (n, g, l) = (e / 128, (e % 128) / 32, e % 32);
    let ql = blk[64 * n + l + 32 * (g % 2)];
    let lo = if g < 2 { ql & 0x0f } else { ql >> 4 };
    lo | (((blk[128 + 32 * n + l] >> (2 * g)) & 3) << 4)
}

/// Where row `i`'s high bits of elements 4j..4j+4 of a unit go: 128 bytes, vector `j / 4`, the
/// qword of the row pair `i / 2`, byte `2 (j % 4) + i % 2` (element 4j + t at bits 2t..2t+2).
fn q6k_high_at(i: usize, j: usize) -> usize {
    64 * (j / 4) + 8 * (i / 2) + 2 * (j % 4) + i % 2
}

/// Writes one Q6_K row (`row`: its 210-byte super-blocks) as row `i` of the group `dst`.
fn q6k_put(row: &[u8], dst: &mut [u8], i: usize) {
    for (s, blk) in row.chunks_exact(210).enumerate() {
        let d = &mut dst[s * Q6K_SUPER..][..Q6K_SUPER];
        for k in 0..16 {
            d[16 * k + i] = blk[192 + k];
        }
        d[256 + 2 * i..][..2].copy_from_slice(&blk[208..210]);
        for k in 0..8 {
            let u = &mut d[320 + 384 * k..][..384];
            let c = |t: usize| q6k_code(blk, 32 * k + t);
            for t in 0..16 {
                let (q, b) = (t / 4, t % 4);
                u[64 * q + 4 * i + b] = (c(t) & 0x0f) | ((c(t + 16) & 0x0f) << 4);
            }
            for j in 0..8 {
                let h = (0..4).fold(0u8, |h, t| h | ((c(4 * j + t) >> 4) << (2 * t)));
                u[256 + q6k_high_at(i, j)] = h;
            }
        }
    }
}

/// Reads row `i` of the Q6_K group `g` back into its 210-byte super-blocks (`q6k_put`'s
/// inverse).
fn q6k_get(g: &[u8], i: usize, row: &mut [u8]) {
    for (s, blk) in row.chunks_exact_mut(210).enumerate() {
        let d = &g[s * Q6K_SUPER..][..Q6K_SUPER];
        for k in 0..16 {
            blk[192 + k] = d[16 * k + i];
        }
        blk[208..210].copy_from_slice(&d[256 + 2 * i..][..2]);
        for k in 0..8 {
            let u = &d[320 + 384 * k..][..384];
            for e in 0..32 {
                let (t, hi) = (e % 16, e / 16);
                let byte = u[64 * (t / 4) + 4 * i + t % 4];
                let lo = if hi == 0 { byte & 0x0f } else { byte >> 4 };
                let h = (u[256 + q6k_high_at(i, e / 4)] >> (2 * (e % 4))) & 3;
                let code = lo | (h << 4);
                // Back into ggml's places (`q6k_code`'s inverse).
                let e = 32 * k + e;
                let (n, gg, l) = (e / 128, (e % 128) / 32, e % 32);
                let at = 64 * n + l + 32 * (gg % 2);
                blk[at] |= if gg < 2 {
                    code & 0x0f
                } else {
                    (code & 0x0f) << 4
                };
                blk[128 + 32 * n + l] |= (code >> 4) << (2 * gg);
            }
        }
    }
}

/// The ggml block of Q4_K (`f`, 144 bytes) or Q5_K (176): bytes, and where `qs` starts (Q5_K's
/// `qh`, 32 bytes, is at 16).
const fn k_block(f: u8) -> (usize, usize) {
    if f == Q5_K {
        (176, 48)
    } else {
        (144, 16)
    }
}

/// Writes one Q4_K or Q5_K (`f`) row (`row`: its super-blocks) as row `i` of the group `dst`.
fn q4k_put(row: &[u8], dst: &mut [u8], i: usize, f: u8) {
    let ((sup, co), (bs, qs)) = (k_super(f), k_block(f));
    for (s, blk) in row.chunks_exact(bs).enumerate() {
        let d = &mut dst[s * sup..][..sup];
        d[2 * i..][..2].copy_from_slice(&blk[..2]);
        d[32 + 2 * i..][..2].copy_from_slice(&blk[2..4]);
        for j in 0..8 {
            let (sc, m) = hf2q_tensor::quant::kquants::scale_min_k4(j, &blk[4..16]);
            d[64 + 16 * j + i] = sc;
            d[192 + 16 * j + i] = m;
            // Sub-block j: nibble j % 2 of chunk j / 2's 32 bytes, as a Q4_0 block's bytes.
            let (c, h) = (j / 2, 4 * (j % 2));
            let e = |l: usize| (blk[qs + 32 * c + l] >> h) & 0x0f;
            for t in 0..16 {
                let (q, k) = (t / 4, t % 4);
                d[co + 256 * j + 64 * q + 4 * i + k] = e(t) | (e(t + 16) << 4);
            }
            if f == Q5_K {
                // Element t's fifth bit is bit j of qh[t].
                let bits = (0..32).fold(0u32, |v, t| v | ((((blk[16 + t] >> j) & 1) as u32) << t));
                d[320 + 64 * j + 4 * i..][..4].copy_from_slice(&bits.to_le_bytes());
            }
        }
    }
}

/// Reads row `i` of the Q4_K or Q5_K (`f`) group `g` back into its super-blocks (`q4k_put`'s
/// inverse; the 6-bit scales and minimums are packed as ggml packs them).
fn q4k_get(g: &[u8], i: usize, row: &mut [u8], f: u8) {
    let ((sup, co), (bs, qs)) = (k_super(f), k_block(f));
    for (s, blk) in row.chunks_exact_mut(bs).enumerate() {
        let d = &g[s * sup..][..sup];
        blk[..2].copy_from_slice(&d[2 * i..][..2]);
        blk[2..4].copy_from_slice(&d[32 + 2 * i..][..2]);
        let sc: [u8; 8] = std::array::from_fn(|j| d[64 + 16 * j + i]);
        let m: [u8; 8] = std::array::from_fn(|j| d[192 + 16 * j + i]);
        for j in 0..4 {
            blk[4 + j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            blk[8 + j] = m[j] | ((m[j + 4] >> 4) << 6);
            blk[12 + j] = (sc[j + 4] & 0x0f) | ((m[j + 4] & 0x0f) << 4);
        }
        for j in 0..8 {
            let (c, h) = (j / 2, 4 * (j % 2));
            for t in 0..16 {
                let (q, k) = (t / 4, t % 4);
                let byte = d[co + 256 * j + 64 * q + 4 * i + k];
                blk[qs + 32 * c + t] |= (byte & 0x0f) << h;
                blk[qs + 32 * c + t + 16] |= (byte >> 4) << h;
            }
            if f == Q5_K {
                let bits = u32::from_le_bytes(d[320 + 64 * j + 4 * i..][..4].try_into().unwrap());
                for t in 0..32 {
                    blk[16 + t] |= (((bits >> t) & 1) as u8) << j;
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    use super::{
        codes_bytes, group_bytes, head_bytes, k_super, scales_bytes, GROUP, Q4_1, Q4_K, Q5_0, Q5_K,
        Q6K_SUPER, Q6_K, Q8_0,
    };
    use crate::kernels::q8act::ActQ8;

    /// The 4 activation bytes at `p` in every lane.
    #[inline(always)]
    unsafe fn bcast4(p: *const i8) -> __m512i {
        _mm512_set1_epi32((p as *const i32).read_unaligned())
    }

    /// The integer dot of a block's 8 code vectors `u` (codes of elements 4q.. in `u[q]`) with
    /// the 32 activations at `x`, per row (lane). Two chains, so that the eight multiply-adds
    /// do not wait on each other one by one.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn dot32(u: &[__m512i; 8], x: *const i8) -> __m512i {
        let (i0, i1) = dot16x2(u, x);
        _mm512_add_epi32(i0, i1)
    }

    /// [`dot32`]'s two halves: elements 0..16 and 16..32 (Q6_K's scales are per 16).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn dot16x2(u: &[__m512i; 8], x: *const i8) -> (__m512i, __m512i) {
        let (mut i0, mut i1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
        for q in 0..4 {
            i0 = _mm512_dpbusd_epi32(i0, u[q], bcast4(x.add(4 * q)));
            i1 = _mm512_dpbusd_epi32(i1, u[q + 4], bcast4(x.add(16 + 4 * q)));
        }
        (i0, i1)
    }

    /// A Q6_K unit's 8 code vectors (`u[j]`: elements 4j..4j+4, 6-bit) from its 384 bytes at
    /// `p`: the low 4 bits as Q4_0's, the high 2 bits moved into place by `vpmultishiftqb`,
    /// which takes each output byte from a bit offset of the same qword (a row pair's): for
    /// row `2m + s` and element `4j + t` the field is at bit `16 (j % 4) + 8 s + 2 t` of qword
    /// m of vector `j / 4`; starting 4 bits lower puts it at bits 4..6.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
    unsafe fn codes_q6k(p: *const u8) -> [__m512i; 8] {
        let lo4 = _mm512_set1_epi8(0x0f);
        let mut u = [_mm512_setzero_si512(); 8];
        for q in 0..4 {
            let v = _mm512_load_si512(p.add(64 * q) as *const __m512i);
            u[q] = _mm512_and_si512(v, lo4);
            u[q + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), lo4);
        }
        let h = [
            _mm512_load_si512(p.add(256) as *const __m512i),
            _mm512_load_si512(p.add(320) as *const __m512i),
        ];
        let two = _mm512_set1_epi8(0x30);
        for (j, uj) in u.iter_mut().enumerate() {
            let ctrl: [u8; 8] = std::array::from_fn(|b| {
                ((16 * (j % 4) + 8 * (b / 4) + 2 * (b % 4) + 60) % 64) as u8
            });
            let ctrl = _mm512_set1_epi64(i64::from_le_bytes(ctrl));
            let hi = _mm512_and_si512(_mm512_multishift_epi64_epi8(ctrl, h[j / 4]), two);
            *uj = _mm512_or_si512(*uj, hi);
        }
        u
    }

    /// A Q6_K super-block's two 16-element scales `a = d * sc` of unit `k` (sc: i8).
    #[inline(always)]
    unsafe fn scales_q6k(s: *const u8, d: __m512, k: usize) -> (__m512, __m512) {
        let sc = |j: usize| {
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(
                s.add(16 * j) as *const __m128i
            )))
        };
        (_mm512_mul_ps(d, sc(2 * k)), _mm512_mul_ps(d, sc(2 * k + 1)))
    }

    /// One group's 16 results for packed Q6_K (as [`group`], with a scale per 16 elements;
    /// the offset `-32 a` applied once at the end).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
    unsafe fn group_q6k<const SPLIT: bool>(g: *const u8, nb: usize, act: &ActQ8) -> __m512 {
        let k = act.k;
        let qx = act.qx.as_ptr();
        // Per 16 elements: the scale the integer sum is in and the activations' sums (as
        // `group`'s per 32).
        let (dxs, sxs) = if SPLIT {
            (act.dx.as_ptr().add(k / 16), act.sxp.as_ptr())
        } else {
            (act.dx.as_ptr(), act.sx.as_ptr())
        };
        let mut acc = _mm512_setzero_ps();
        let mut off = _mm512_setzero_ps();
        let step = Q6K_SUPER / 8;
        for s in 0..nb / 8 {
            let sb = g.add(s * Q6K_SUPER);
            let d = _mm512_cvtph_ps(_mm256_load_si256(sb.add(256) as *const __m256i));
            for kk in 0..8 {
                let b = 8 * s + kk;
                prefetch_l2(g.wrapping_add(PREFETCH + b * step), step);
                let u = codes_q6k(sb.add(320 + 384 * kk));
                let (mut i0, mut i1) = dot16x2(&u, qx.add(32 * b));
                if SPLIT {
                    let (l0, l1) = dot16x2(&u, qx.add(k + 32 * b));
                    i0 = _mm512_add_epi32(_mm512_slli_epi32::<8>(i0), l0);
                    i1 = _mm512_add_epi32(_mm512_slli_epi32::<8>(i1), l1);
                }
                let (a0, a1) = scales_q6k(sb, d, kk);
                let j = 2 * b;
                acc = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(i0),
                    _mm512_mul_ps(a0, _mm512_set1_ps(*dxs.add(j))),
                    acc,
                );
                acc = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(i1),
                    _mm512_mul_ps(a1, _mm512_set1_ps(*dxs.add(j + 1))),
                    acc,
                );
                off = _mm512_fmadd_ps(a0, _mm512_set1_ps(*sxs.add(j)), off);
                off = _mm512_fmadd_ps(a1, _mm512_set1_ps(*sxs.add(j + 1)), off);
            }
        }
        _mm512_fmadd_ps(off, _mm512_set1_ps(-32.0), acc)
    }

    /// [`panel`] for packed Q6_K: scales and offsets per 16 elements.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
    unsafe fn panel_q6k(g: *const u8, nb: usize, w: *mut __m512i, ia: *mut f32, ic: *mut f32) {
        let next = g.add(group_bytes(nb, Q6_K));
        let step = Q6K_SUPER / 8;
        for s in 0..nb / 8 {
            let sb = g.add(s * Q6K_SUPER);
            let d = _mm512_cvtph_ps(_mm256_load_si256(sb.add(256) as *const __m256i));
            for kk in 0..8 {
                let b = 8 * s + kk;
                prefetch_l2(next.wrapping_add(step * b), step);
                let (a0, a1) = scales_q6k(sb, d, kk);
                let m32 = _mm512_set1_ps(-32.0);
                _mm512_storeu_ps(ia.add(2 * b * GROUP), a0);
                _mm512_storeu_ps(ia.add((2 * b + 1) * GROUP), a1);
                _mm512_storeu_ps(ic.add(2 * b * GROUP), _mm512_mul_ps(a0, m32));
                _mm512_storeu_ps(ic.add((2 * b + 1) * GROUP), _mm512_mul_ps(a1, m32));
                let u = codes_q6k(sb.add(320 + 384 * kk));
                for (q, uq) in u.iter().enumerate() {
                    _mm512_storeu_si512(w.add(8 * b + q), *uq);
                }
            }
        }
    }

    /// How far ahead (bytes) the one-token kernel asks for the weight's lines, into L2 (L1 has
    /// too few misses in flight to stream from memory). Measured on a model's worth of
    /// 576x576 weights back to back, one thread (GiB/s): 4 KB 17.2, 8 KB 21.9, 12 KB 21.0.
    const PREFETCH: usize = 8192;

    /// Block `b`'s 8 code vectors, `u[j]` the codes of elements 4j..4j+4: 4-bit formats, word
    /// q's low nibbles (elements 4q..) and high nibbles (elements 16 + 4q..); Q8_0, the words.
    #[inline(always)]
    pub(crate) unsafe fn codes<const F: u8>(g: *const u8, nb: usize, b: usize) -> [__m512i; 8] {
        let p = if F == Q4_K || F == Q5_K {
            let (sup, co) = k_super(F);
            g.add(b / 8 * sup + co + 256 * (b % 8))
        } else {
            g.add(scales_bytes(nb, F) + codes_bytes(F) * b)
        };
        let mut u = [_mm512_setzero_si512(); 8];
        if F == Q8_0 {
            for (q, uq) in u.iter_mut().enumerate() {
                *uq = _mm512_load_si512(p.add(64 * q) as *const __m512i);
            }
            return u;
        }
        let lo4 = _mm512_set1_epi8(0x0f);
        for q in 0..4 {
            let v = _mm512_load_si512(p.add(64 * q) as *const __m512i);
            u[q] = _mm512_and_si512(v, lo4);
            u[q + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), lo4);
        }
        if F == Q5_0 {
            // Lane i's 32 fifth bits, from the block header.
            let qh = _mm512_loadu_si512(g.add(head_bytes(F) * b + 32) as *const __m512i);
            add_fifth_bits(&mut u, qh);
        }
        if F == Q5_K {
            let qh = g.add(b / 8 * k_super(F).0 + 320 + 64 * (b % 8));
            add_fifth_bits(&mut u, _mm512_load_si512(qh as *const __m512i));
        }
        u
    }

    /// Adds 16 to the codes whose fifth bit is set: `qh` holds each lane's 32 fifth bits (bit
    /// e: element e), `u[j]` the codes of elements 4j..4j+4 (as [`codes`] gives them), whose
    /// bits are in byte j / 2 of the lane: spread that byte over the lane's four bytes, test one
    /// bit per byte, add 16 where it is set.
    #[inline(always)]
    pub(crate) unsafe fn add_fifth_bits(u: &mut [__m512i; 8], qh: __m512i) {
        let dw = _mm512_broadcast_i32x4(_mm_set_epi32(0x0c0c_0c0c, 0x0808_0808, 0x0404_0404, 0));
        let sixteen = _mm512_set1_epi8(16);
        for (j, uj) in u.iter_mut().enumerate() {
            let bytes =
                _mm512_shuffle_epi8(qh, _mm512_add_epi8(dw, _mm512_set1_epi8((j / 2) as i8)));
            let sh = 4 * (j % 2) as u32;
            let bits = _mm512_set1_epi32(i32::from_le_bytes([
                1 << sh,
                1 << (sh + 1),
                1 << (sh + 2),
                1 << (sh + 3),
            ]));
            let m = _mm512_test_epi8_mask(bytes, bits);
            *uj = _mm512_mask_add_epi8(*uj, m, *uj, sixteen);
        }
    }

    /// Asks for the lines covering `bytes` from `p` in L2 (a prefetch past the weight's end
    /// asks for nothing useful, harmlessly: prefetches do not fault).
    #[inline(always)]
    unsafe fn prefetch_l2(p: *const u8, bytes: usize) {
        for l in 0..bytes.div_ceil(64) {
            _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(64 * l) as *const i8);
        }
    }

    /// A code's offset as a multiple of the block scale (`c = K d`; Q4_1 stores `c = m`).
    const fn offset_k(f: u8) -> f32 {
        match f {
            Q8_0 => -128.0,
            Q5_0 => -16.0,
            _ => -8.0,
        }
    }

    /// Block `b`'s 16 scales `d` and offsets `c` (per element: `d * u + c`) as f32.
    #[inline(always)]
    pub(crate) unsafe fn scales<const F: u8>(g: *const u8, b: usize) -> (__m512, __m512) {
        if F == Q4_K || F == Q5_K {
            // a = d * sc, c = -(dmin * m), as the reference decodes them.
            let (s, j) = (g.add(b / 8 * k_super(F).0), b % 8);
            let d = _mm512_cvtph_ps(_mm256_load_si256(s as *const __m256i));
            let dm = _mm512_cvtph_ps(_mm256_load_si256(s.add(32) as *const __m256i));
            let byte = |at: usize| {
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(
                    s.add(at) as *const __m128i
                )))
            };
            let (sc, m) = (byte(64 + 16 * j), byte(192 + 16 * j));
            let c = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dm, m));
            return (_mm512_mul_ps(d, sc), c);
        }
        let h = g.add(head_bytes(F) * b);
        let d = _mm512_cvtph_ps(_mm256_load_si256(h as *const __m256i));
        let c = if F == Q4_1 {
            _mm512_cvtph_ps(_mm256_load_si256(h.add(32) as *const __m256i))
        } else {
            _mm512_mul_ps(d, _mm512_set1_ps(offset_k(F)))
        };
        (d, c)
    }

    /// Rows `r0..r1` (`r0` a multiple of 16) of the packed weight `data` (format `fmt`, `nb`
    /// blocks per row) against the one activation row of `act` (`split`: a two-part row, as
    /// `fused_x86::matvec_avx512` takes it), into `out[r]`.
    ///
    /// Per block and group: `acc += f32(Σ u q) * (d * dx) + c * sx` (`c` the per-element
    /// offset): 16 rows' results per vector, stored as they are (lanes past `r1` are not
    /// written).
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL/VNNI; `data` must hold the groups of rows `r0..r1`
    /// in the layout of `packed.rs`, 64-byte aligned; `act` one row of `32 nb` values (two
    /// with `split`); `out` must cover index `r1 - 1`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn matvec(
        data: *const u8,
        nb: usize,
        fmt: u8,
        r0: usize,
        r1: usize,
        act: &ActQ8,
        split: bool,
        out: *mut f32,
    ) {
        debug_assert!(r0.is_multiple_of(GROUP) && act.k == 32 * nb);
        let gb = group_bytes(nb, fmt);
        let mut r = r0;
        while r < r1 {
            let g = data.add(r / GROUP * gb);
            let v = if split {
                group_of::<true>(fmt, g, nb, act)
            } else {
                group_of::<false>(fmt, g, nb, act)
            };
            let n = (r1 - r).min(GROUP);
            _mm512_mask_storeu_ps(out.add(r), ((1u32 << n) - 1) as __mmask16, v);
            r += GROUP;
        }
    }

    /// [`group`] (or [`group_q6k`]) for the format `fmt`.
    #[inline(always)]
    unsafe fn group_of<const SPLIT: bool>(fmt: u8, g: *const u8, nb: usize, act: &ActQ8) -> __m512 {
        match fmt {
            Q8_0 => group::<SPLIT, Q8_0>(g, nb, act),
            Q4_1 => group::<SPLIT, Q4_1>(g, nb, act),
            Q5_0 => group::<SPLIT, Q5_0>(g, nb, act),
            Q4_K => group::<SPLIT, Q4_K>(g, nb, act),
            Q5_K => group::<SPLIT, Q5_K>(g, nb, act),
            Q6_K => group_q6k::<SPLIT>(g, nb, act),
            _ => group::<SPLIT, { super::Q4_0 }>(g, nb, act),
        }
    }

    /// One group's 16 results (see [`matvec`]).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn group<const SPLIT: bool, const F: u8>(
        g: *const u8,
        nb: usize,
        act: &ActQ8,
    ) -> __m512 {
        let k = act.k;
        let qx = act.qx.as_ptr();
        // The scale the integer sum is in (with `SPLIT`, the second part's: the sum is
        // `256 * hi + lo`, at most 257 * 32 * 255 * 127 < 2^31) and the block sums of the
        // activations (both parts').
        let (dxs, sxs) = if SPLIT {
            (act.dx32.as_ptr().add(nb), act.sxp32.as_ptr())
        } else {
            (act.dx32.as_ptr(), act.sx32.as_ptr())
        };
        let mut acc = _mm512_setzero_ps();
        let mut off = _mm512_setzero_ps();
        // Prefetches run `PREFETCH` bytes ahead of a pointer that crosses the group evenly (its
        // bytes over its blocks), so that the weight, scales and all, is asked for as one
        // sequential run across groups and weights (`PackArena`), as many lines per block as
        // cover the bytes it advances.
        let step = group_bytes(nb, F) / nb;
        for b in 0..nb {
            prefetch_l2(g.wrapping_add(PREFETCH + b * step), step);
            let u = codes::<F>(g, nb, b);
            let (d, c) = scales::<F>(g, b);
            let mut i = dot32(&u, qx.add(32 * b));
            if SPLIT {
                i = _mm512_add_epi32(_mm512_slli_epi32::<8>(i), dot32(&u, qx.add(k + 32 * b)));
            }
            acc = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(i),
                _mm512_mul_ps(d, _mm512_set1_ps(*dxs.add(b))),
                acc,
            );
            off = _mm512_fmadd_ps(c, _mm512_set1_ps(*sxs.add(b)), off);
        }
        _mm512_add_ps(acc, off)
    }

    /// The panel of the prefill GEMM (`gemm_x86.rs`: codes `[C/4][16][4]`, scales and offsets
    /// per 16 elements `[C/16][16]`, of which the 32-element formats fill the even entries) for
    /// the group at `g`.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW; `g` a whole group of `nb` blocks, 64-byte aligned;
    /// `w` room for `8 nb` vectors, `ia` and `ic` for `32 nb` values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(crate) unsafe fn panel(
        g: *const u8,
        nb: usize,
        fmt: u8,
        w: *mut __m512i,
        ia: *mut f32,
        ic: *mut f32,
    ) {
        match fmt {
            Q8_0 => panel_of::<Q8_0>(g, nb, w, ia, ic),
            Q4_1 => panel_of::<Q4_1>(g, nb, w, ia, ic),
            Q5_0 => panel_of::<Q5_0>(g, nb, w, ia, ic),
            Q4_K => panel_of::<Q4_K>(g, nb, w, ia, ic),
            Q5_K => panel_of::<Q5_K>(g, nb, w, ia, ic),
            Q6_K => panel_q6k(g, nb, w, ia, ic),
            _ => panel_of::<{ super::Q4_0 }>(g, nb, w, ia, ic),
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn panel_of<const F: u8>(
        g: *const u8,
        nb: usize,
        w: *mut __m512i,
        ia: *mut f32,
        ic: *mut f32,
    ) {
        let next = g.add(group_bytes(nb, F));
        // The next group's lines, as many per block as the group has per block, so that the
        // next group is in L2 by the time its panel is laid out.
        let step = group_bytes(nb, F) / nb;
        for b in 0..nb {
            prefetch_l2(next.wrapping_add(step * b), step);
            let (d, c) = scales::<F>(g, b);
            _mm512_storeu_ps(ia.add(2 * b * GROUP), d);
            _mm512_storeu_ps(ic.add(2 * b * GROUP), c);
            let u = codes::<F>(g, nb, b);
            for (q, uq) in u.iter().enumerate() {
                _mm512_storeu_si512(w.add(8 * b + q), *uq);
            }
        }
    }
}
