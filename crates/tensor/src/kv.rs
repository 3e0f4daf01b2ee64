//! Key/value caches: [`KvStore`] is one layer's cache, on the host ([`HostKv`]: keys and values
//! each f16, f32 or one of ggml's block types, [`KvTypes`]; or both of one of mlx-lm's affine
//! layouts, [`AffineKv`]) or on a device. A backend writes and
//! reads it (`Backend::kv_write` / `Backend::attend`); model code only passes it along.
//! A quantized key plane is centred by default ([`KeyCentering`]: f16 first positions, later
//! keys stored less their head's centre, which follows the layer's RoPE on its largest pairs
//! when the cache is given it, [`HostKv::with_key_rope`]).
//!
//! Not here: the block layouts ([`crate::kv_blocks`], [`crate::kv_affine`]), the centring
//! ([`crate::kv_centre`]), the kernels that read a cache (the CPU and CUDA crates), the paged
//! cache of many sequences (`paged`).

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::kv_centre::Centre;
use crate::{Error, Result, Tensor};

pub use crate::kv_affine::{
    AffineKv, BlockA4G128, BlockA4G32, BlockA4G64, BlockA8G128, BlockA8G32, BlockA8G64, BlockAffine,
};
pub use crate::kv_blocks::{
    BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, KvBlock, Q8_0_VALUES,
};
pub use crate::kv_centre::{KeyCentering, KeyRope};

/// What a KV cache stores keys and values as.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvType {
    /// Half precision (the default, as llama.cpp's): half the memory of f32, and less to read per
    /// decoded token; values are rounded to nearest even once, when written.
    #[default]
    F16,
    /// Single precision: what the model computed, bit for bit (for exact comparisons with the
    /// reference).
    F32,
    /// ggml's Q8_0 (llama.cpp's `-ctk/-ctv q8_0`): each row of `Dh` values as `Dh / 32` blocks
    /// of an f16 scale and 32 i8 ([`BlockQ8_0`]), 34 bytes per 32 values (17/32 of f16). The head
    /// width must be a multiple of 32.
    Q8_0,
    /// ggml's Q4_0 (`-ctk/-ctv q4_0`): rows as `Dh / 32` blocks of an f16 scale and 32 4-bit
    /// values ([`BlockQ4_0`]), 18 bytes per 32 values (9/32 of f16). Head widths as Q8_0.
    Q4_0,
    /// ggml's Q4_1 (`-ctk/-ctv q4_1`): an f16 scale and offset and 32 4-bit values
    /// ([`BlockQ4_1`]), 20 bytes per 32 values (10/32 of f16).
    Q4_1,
    /// ggml's Q5_0 (`-ctk/-ctv q5_0`): an f16 scale and 32 5-bit values ([`BlockQ5_0`]), 22
    /// bytes per 32 values (11/32 of f16).
    Q5_0,
    /// ggml's Q5_1 (`-ctk/-ctv q5_1`): an f16 scale and offset and 32 5-bit values
    /// ([`BlockQ5_1`]), 24 bytes per 32 values (12/32 of f16).
    Q5_1,
    /// mlx-lm's affine layout (`--kv-bits`, `--kv-group-size`): each group of 32, 64 or 128
    /// values as an f16 scale and bias and 4- or 8-bit integers ([`BlockAffine`]); 8 bits in
    /// groups of 64 is 68 bytes per 64 values (17/32 of f16), 4 bits 36 (9/32). The head width
    /// must be a multiple of the group; keys and values have the same layout.
    Affine(AffineKv),
}

impl KvType {
    /// Every type, in `--kv-type`'s order.
    pub const ALL: [KvType; 7] = [
        KvType::F16,
        KvType::F32,
        KvType::Q8_0,
        KvType::Q4_0,
        KvType::Q4_1,
        KvType::Q5_0,
        KvType::Q5_1,
    ];
    /// The block types.
    pub const BLOCKS: [KvType; 5] = [
        KvType::Q8_0,
        KvType::Q4_0,
        KvType::Q4_1,
        KvType::Q5_0,
        KvType::Q5_1,
    ];
    /// The affine layouts.
    pub const AFFINE: [KvType; 6] = [
        KvType::Affine(AffineKv::B8G32),
        KvType::Affine(AffineKv::B8G64),
        KvType::Affine(AffineKv::B8G128),
        KvType::Affine(AffineKv::B4G32),
        KvType::Affine(AffineKv::B4G64),
        KvType::Affine(AffineKv::B4G128),
    ];
    /// ggml's type of a ggml block type's blocks (`None` for f16, f32 and the affine layouts).
    pub fn ggml(self) -> Option<crate::GgmlType> {
        use crate::GgmlType;
        match self {
            KvType::F16 | KvType::F32 | KvType::Affine(_) => None,
            KvType::Q8_0 => Some(GgmlType::Q8_0),
            KvType::Q4_0 => Some(GgmlType::Q4_0),
            KvType::Q4_1 => Some(GgmlType::Q4_1),
            KvType::Q5_0 => Some(GgmlType::Q5_0),
            KvType::Q5_1 => Some(GgmlType::Q5_1),
        }
    }
    /// Bytes of one cache row (one head's `dh` values at one position); for a block type, `dh`
    /// must be a whole number of blocks ([`KvType::check_head_dim`]).
    pub fn row_bytes(self, dh: usize) -> usize {
        match self {
            KvType::F16 => 2 * dh,
            KvType::F32 => 4 * dh,
            KvType::Q8_0 => dh / Q8_0_VALUES * BlockQ8_0::BYTES,
            KvType::Q4_0 => dh / Q8_0_VALUES * BlockQ4_0::BYTES,
            KvType::Q4_1 => dh / Q8_0_VALUES * BlockQ4_1::BYTES,
            KvType::Q5_0 => dh / Q8_0_VALUES * BlockQ5_0::BYTES,
            KvType::Q5_1 => dh / Q8_0_VALUES * BlockQ5_1::BYTES,
            KvType::Affine(a) => dh / a.group() * a.group_bytes(),
        }
    }
    /// Values per stored element (1, the block size, or the affine group).
    pub fn block_values(self) -> usize {
        match self {
            KvType::F16 | KvType::F32 => 1,
            KvType::Affine(a) => a.group(),
            _ => Q8_0_VALUES,
        }
    }
    /// Whether heads of width `dh` can be stored: a block type needs whole blocks, an affine
    /// layout whole groups.
    pub fn check_head_dim(self, dh: usize) -> Result<()> {
        let b = self.block_values();
        if let KvType::Affine(a) = self {
            if dh == 0 || !dh.is_multiple_of(b) {
                return Err(Error::Msg(format!(
                    "an affine KV cache ({}) quantizes groups of {b} values along the head; this \
                     model's head width {dh} is not a multiple of the group size {b} (a \
                     --kv-group-size that divides {dh}, or --kv-type f16)",
                    a.name()
                )));
            }
        }
        if dh == 0 || !dh.is_multiple_of(b) {
            return Err(Error::Msg(format!(
                "a {} KV cache stores heads in blocks of {b} values; this model's head width \
                 {dh} is not a multiple of {b} (use --kv-type f16)",
                self.name()
            )));
        }
        Ok(())
    }
    pub fn name(self) -> &'static str {
        match self {
            KvType::F16 => "f16",
            KvType::F32 => "f32",
            KvType::Q8_0 => "q8_0",
            KvType::Q4_0 => "q4_0",
            KvType::Q4_1 => "q4_1",
            KvType::Q5_0 => "q5_0",
            KvType::Q5_1 => "q5_1",
            KvType::Affine(a) => a.name(),
        }
    }
    /// The type named `name` (as [`KvType::name`] writes it).
    pub fn from_name(name: &str) -> Option<KvType> {
        (KvType::ALL.into_iter().chain(KvType::AFFINE)).find(|t| t.name() == name)
    }
}

/// What a cache stores keys and values as, each its own [`KvType`] (llama.cpp's `-ctk` and
/// `-ctv`); one type for both is `KvTypes::from(ty)`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvTypes {
    pub k: KvType,
    pub v: KvType,
}

impl From<KvType> for KvTypes {
    fn from(t: KvType) -> KvTypes {
        KvTypes { k: t, v: t }
    }
}

impl KvTypes {
    /// The one type of keys and values, when they have one.
    pub fn same(self) -> Option<KvType> {
        (self.k == self.v).then_some(self.k)
    }
    /// Bytes of a key row and a value row of width `dh` together.
    pub fn row_bytes(self, dh: usize) -> usize {
        self.k.row_bytes(dh) + self.v.row_bytes(dh)
    }
    /// Whether both types can store heads of width `dh` ([`KvType::check_head_dim`]), and
    /// are a pair a cache stores: an affine layout for keys and values alike (as mlx-lm's
    /// cache), or any two of the other types.
    pub fn check_head_dim(self, dh: usize) -> Result<()> {
        let affine = |t: KvType| matches!(t, KvType::Affine(_));
        if (affine(self.k) || affine(self.v)) && self.k != self.v {
            return Err(Error::Msg(format!(
                "an affine KV cache stores keys and values in one layout, not {}",
                self.name()
            )));
        }
        self.k.check_head_dim(dh)?;
        self.v.check_head_dim(dh)
    }
    /// `q8_0` for one type, `k q8_0 / v q4_0` for two.
    pub fn name(self) -> String {
        match self.same() {
            Some(t) => t.name().to_string(),
            None => format!("k {} / v {}", self.k.name(), self.v.name()),
        }
    }
}

/// One layer's keys and values.
pub enum KvStore {
    Host(HostKv),
    /// A device backend's cache (allocated at its full capacity on the first write).
    Device(Box<dyn DeviceKv>),
}

/// A device backend's layer cache; the backend that made it downcasts it back.
pub trait DeviceKv: Send + Sync {
    /// Bytes of device memory held.
    fn bytes(&self) -> usize;
    fn as_any(&self) -> &dyn std::any::Any;
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
}

impl KvStore {
    /// An empty host cache of `ty` keys and values; a device backend replaces it with its own
    /// (of the backend's type) on first write.
    pub fn new(n_kv_heads: usize, head_dim: usize, ty: impl Into<KvTypes>) -> KvStore {
        KvStore::Host(HostKv::new(n_kv_heads, head_dim, ty))
    }
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            KvStore::Host(h) => h.bytes(),
            KvStore::Device(d) => d.bytes(),
        }
    }
}

/// The keys or the values of a host cache, `(Hkv, S_cap, row)` elements of one [`KvType`] (a
/// row is `Dh` values: `Dh` f16 or f32, or `Dh / 32` blocks).
enum Plane {
    F16(Vec<f16>),
    F32(Vec<f32>),
    Q8_0(Vec<BlockQ8_0>),
    Q4_0(Vec<BlockQ4_0>),
    Q4_1(Vec<BlockQ4_1>),
    Q5_0(Vec<BlockQ5_0>),
    Q5_1(Vec<BlockQ5_1>),
    A8G32(Vec<BlockA8G32>),
    A8G64(Vec<BlockA8G64>),
    A8G128(Vec<BlockA8G128>),
    A4G32(Vec<BlockA4G32>),
    A4G64(Vec<BlockA4G64>),
    A4G128(Vec<BlockA4G128>),
}

/// A plane as the attention reads it: `(Hkv, S_cap, row)` elements.
#[derive(Clone, Copy)]
pub enum PlaneView<'a> {
    F16(&'a [f16]),
    F32(&'a [f32]),
    Q8_0(&'a [BlockQ8_0]),
    Q4_0(&'a [BlockQ4_0]),
    Q4_1(&'a [BlockQ4_1]),
    Q5_0(&'a [BlockQ5_0]),
    Q5_1(&'a [BlockQ5_1]),
    A8G32(&'a [BlockA8G32]),
    A8G64(&'a [BlockA8G64]),
    A8G128(&'a [BlockA8G128]),
    A4G32(&'a [BlockA4G32]),
    A4G64(&'a [BlockA4G64]),
    A4G128(&'a [BlockA4G128]),
}

/// `$body` with `$x` bound to the vector of whatever variant `$p` (a [`Plane`]) is: one
/// generic body for every element type.
macro_rules! each_plane {
    ($p:expr, $x:ident => $body:expr) => {
        match $p {
            Plane::F16($x) => $body,
            Plane::F32($x) => $body,
            Plane::Q8_0($x) => $body,
            Plane::Q4_0($x) => $body,
            Plane::Q4_1($x) => $body,
            Plane::Q5_0($x) => $body,
            Plane::Q5_1($x) => $body,
            Plane::A8G32($x) => $body,
            Plane::A8G64($x) => $body,
            Plane::A8G128($x) => $body,
            Plane::A4G32($x) => $body,
            Plane::A4G64($x) => $body,
            Plane::A4G128($x) => $body,
        }
    };
}

/// [`each_plane!`] whose body makes the same variant of `$to` (a [`Plane`] or a [`PlaneView`]).
macro_rules! map_plane {
    ($p:expr, $to:ident, $x:ident => $body:expr) => {
        match $p {
            Plane::F16($x) => $to::F16($body),
            Plane::F32($x) => $to::F32($body),
            Plane::Q8_0($x) => $to::Q8_0($body),
            Plane::Q4_0($x) => $to::Q4_0($body),
            Plane::Q4_1($x) => $to::Q4_1($body),
            Plane::Q5_0($x) => $to::Q5_0($body),
            Plane::Q5_1($x) => $to::Q5_1($body),
            Plane::A8G32($x) => $to::A8G32($body),
            Plane::A8G64($x) => $to::A8G64($body),
            Plane::A8G128($x) => $to::A8G128($body),
            Plane::A4G32($x) => $to::A4G32($body),
            Plane::A4G64($x) => $to::A4G64($body),
            Plane::A4G128($x) => $to::A4G128($body),
        }
    };
}

/// How a cache element is written from f32 values: f16 rounds to nearest even (hardware
/// conversion where the CPU has it, the same rounding), f32 copies, a block type quantizes by
/// its reference quantizer ([`KvBlock::quantize`]: ggml's `quantize_row_*_ref`, mlx's
/// `quantize` for an affine group) into its bytes.
trait StoreElem: Copy + Default {
    /// `out` (one row's elements) from `src` (its `Dh` values).
    fn store(out: &mut [Self], src: &[f32]) -> Result<()>;
}

impl StoreElem for f16 {
    fn store(out: &mut [f16], src: &[f32]) -> Result<()> {
        out.convert_from_f32_slice(src);
        Ok(())
    }
}

impl StoreElem for f32 {
    fn store(out: &mut [f32], src: &[f32]) -> Result<()> {
        out.copy_from_slice(src);
        Ok(())
    }
}

impl<B: KvBlock> StoreElem for B {
    fn store(out: &mut [B], src: &[f32]) -> Result<()> {
        B::quantize(src, out)
    }
}

/// The first `len` positions of `src` (`(h, old_cap, r)`) in a new plane of `cap` positions.
fn copy_plane<T: Copy + Default>(
    src: &[T],
    old_cap: usize,
    cap: usize,
    len: usize,
    (h, r): (usize, usize),
) -> Vec<T> {
    let mut n = vec![T::default(); h * cap * r];
    for hi in 0..h {
        n[hi * cap * r..hi * cap * r + len * r]
            .copy_from_slice(&src[hi * old_cap * r..hi * old_cap * r + len * r]);
    }
    n
}

/// Stores rows `(T, Hkv*Dh)` of `src` at positions `pos0..pos0+t` of `dst` (`(h, cap, r)`),
/// each head's `d` values into its row of `r` elements.
fn put_rows<T: StoreElem>(
    dst: &mut [T],
    src: &[f32],
    (pos0, t, cap): (usize, usize, usize),
    (h, d, r): (usize, usize, usize),
) -> Result<()> {
    for ti in 0..t {
        for hi in 0..h {
            let at = hi * cap * r + (pos0 + ti) * r;
            let from = ti * h * d + hi * d;
            T::store(&mut dst[at..at + r], &src[from..from + d])?;
        }
    }
    Ok(())
}

impl Plane {
    fn new(ty: KvType) -> Plane {
        match ty {
            KvType::F16 => Plane::F16(Vec::new()),
            KvType::F32 => Plane::F32(Vec::new()),
            KvType::Q8_0 => Plane::Q8_0(Vec::new()),
            KvType::Q4_0 => Plane::Q4_0(Vec::new()),
            KvType::Q4_1 => Plane::Q4_1(Vec::new()),
            KvType::Q5_0 => Plane::Q5_0(Vec::new()),
            KvType::Q5_1 => Plane::Q5_1(Vec::new()),
            KvType::Affine(a) => match a {
                AffineKv::B8G32 => Plane::A8G32(Vec::new()),
                AffineKv::B8G64 => Plane::A8G64(Vec::new()),
                AffineKv::B8G128 => Plane::A8G128(Vec::new()),
                AffineKv::B4G32 => Plane::A4G32(Vec::new()),
                AffineKv::B4G64 => Plane::A4G64(Vec::new()),
                AffineKv::B4G128 => Plane::A4G128(Vec::new()),
            },
        }
    }
    fn kv_type(&self) -> KvType {
        match self {
            Plane::F16(_) => KvType::F16,
            Plane::F32(_) => KvType::F32,
            Plane::Q8_0(_) => KvType::Q8_0,
            Plane::Q4_0(_) => KvType::Q4_0,
            Plane::Q4_1(_) => KvType::Q4_1,
            Plane::Q5_0(_) => KvType::Q5_0,
            Plane::Q5_1(_) => KvType::Q5_1,
            Plane::A8G32(_) => KvType::Affine(AffineKv::B8G32),
            Plane::A8G64(_) => KvType::Affine(AffineKv::B8G64),
            Plane::A8G128(_) => KvType::Affine(AffineKv::B8G128),
            Plane::A4G32(_) => KvType::Affine(AffineKv::B4G32),
            Plane::A4G64(_) => KvType::Affine(AffineKv::B4G64),
            Plane::A4G128(_) => KvType::Affine(AffineKv::B4G128),
        }
    }
    /// Elements of a row of `d` values.
    fn row(&self, d: usize) -> usize {
        d / self.kv_type().block_values()
    }
    fn bytes(&self) -> usize {
        each_plane!(self, x => std::mem::size_of_val(x.as_slice()))
    }
    fn copied(&self, old_cap: usize, cap: usize, len: usize, (h, d): (usize, usize)) -> Plane {
        let hr = (h, self.row(d));
        map_plane!(self, Plane, x => copy_plane(x, old_cap, cap, len, hr))
    }
    fn put(
        &mut self,
        src: &[f32],
        at: (usize, usize, usize),
        (h, d): (usize, usize),
    ) -> Result<()> {
        let r = self.row(d);
        each_plane!(self, x => put_rows(x, src, at, (h, d, r)))
    }
    fn view(&self) -> PlaneView<'_> {
        map_plane!(self, PlaneView, x => x)
    }
}

/// A host cache's keys and values as the attention reads them (each plane of its own type).
#[derive(Clone, Copy)]
pub struct KvView<'a> {
    pub k: PlaneView<'a>,
    pub v: PlaneView<'a>,
    /// S_cap: capacity in positions (stride between heads).
    pub capacity: usize,
    /// The sink keys and centres of a centring cache ([`KeyCentering`]) once written.
    pub centre: Option<crate::kv_centre::KeyCentre<'a>>,
}

/// Keys and values (each f16, f32 or a ggml block type, or both one affine layout: [`KvTypes`])
/// laid out `(Hkv, S_cap, row)` (a head's positions contiguous; a block row is its `Dh / 32`
/// blocks, an affine row its `Dh / group` groups). Capacity grows
/// by doubling up to the session's limit, so short sessions of long-context models stay small.
pub struct HostKv {
    k: Plane,
    v: Plane,
    capacity: usize,
    n_kv_heads: usize,
    head_dim: usize,
    /// Centred keys ([`KeyCentering`]): a quantized key plane with sink positions only.
    centre: Option<Centre>,
}

impl HostKv {
    /// A cache of `ty` that centres quantized keys as [`KeyCentering::DEFAULT`].
    pub fn new(n_kv_heads: usize, head_dim: usize, ty: impl Into<KvTypes>) -> HostKv {
        HostKv::with_centering(n_kv_heads, head_dim, ty, KeyCentering::DEFAULT)
    }
    /// A cache of `ty` whose keys, if of a quantized type, are centred as `centering` says
    /// (f16 and f32 keys never are).
    pub fn with_centering(
        n_kv_heads: usize,
        head_dim: usize,
        ty: impl Into<KvTypes>,
        centering: KeyCentering,
    ) -> HostKv {
        let ty = ty.into();
        let quantized = !matches!(ty.k, KvType::F16 | KvType::F32);
        HostKv {
            k: Plane::new(ty.k),
            v: Plane::new(ty.v),
            capacity: 0,
            n_kv_heads,
            head_dim,
            centre: (quantized && centering.sinks > 0).then(|| Centre::new(centering, None)),
        }
    }
    /// This cache, whose keys are rotated by `rope` before they are written (the layer's
    /// RoPE), so that a centring cache's centre follows the rotation on each head's largest
    /// pairs ([`KeyCentering::rotated`]); `None`, or a cache that does not centre: as it was.
    /// Given before the first write.
    pub fn with_key_rope(mut self, rope: Option<KeyRope>) -> HostKv {
        if let Some(c) = &mut self.centre {
            *c = Centre::new(c.centering(), rope);
        }
        self
    }
    /// How this cache centres its keys ([`KeyCentering::OFF`] for f16 and f32 keys; as asked
    /// for otherwise, whether or not it was given a rotation to follow).
    pub fn centering(&self) -> KeyCentering {
        self.centre
            .as_ref()
            .map_or(KeyCentering::OFF, Centre::centering)
    }
    /// The rotation a centring cache follows ([`HostKv::with_key_rope`]).
    pub fn key_rope(&self) -> Option<&KeyRope> {
        self.centre.as_ref().and_then(Centre::rope)
    }

    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// Positions the cache holds now.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// The key and value types.
    pub fn kv_types(&self) -> KvTypes {
        KvTypes {
            k: self.k.kv_type(),
            v: self.v.kv_type(),
        }
    }

    /// The capacity a cache that must hold `need` positions grows to under `limit`: the next
    /// power of two, at least 256, at most the limit (or `need` if that is larger).
    fn grown_capacity(need: usize, limit: usize) -> usize {
        need.next_power_of_two().max(256).min(limit.max(need))
    }

    /// Planes of `cap` positions holding this cache's first `len`.
    fn copied(&self, cap: usize, len: usize) -> (Plane, Plane) {
        let (old, hd) = (self.capacity, (self.n_kv_heads, self.head_dim));
        (
            self.k.copied(old, cap, len, hd),
            self.v.copied(old, cap, len, hd),
        )
    }

    fn grow(&mut self, need: usize, limit: usize) {
        if need <= self.capacity {
            return;
        }
        let cap = Self::grown_capacity(need, limit);
        (self.k, self.v) = self.copied(cap, self.capacity);
        self.capacity = cap;
    }

    /// Writes host tensors `k`, `v` `(T, Hkv*Dh)` at positions `pos0..pos0+T`, each in its
    /// plane's type (f16 rounds to nearest even, as `half::f16::from_f32`; a block type
    /// quantizes each head's row as ggml's `quantize_row_*_ref`, an affine layout as mlx's
    /// `quantize`, so a prefill and a decode of the same keys store the same blocks).
    pub fn write(&mut self, k: &Tensor, v: &Tensor, pos0: usize, limit: usize) -> Result<()> {
        let (t, w) = k.dims2();
        let hd = (self.n_kv_heads, self.head_dim);
        if w != hd.0 * hd.1 || v.dims2() != (t, w) {
            return Err(Error::Shape(format!(
                "kv write: k {:?} / v {:?} for {} heads of {}",
                k.shape(),
                v.shape(),
                hd.0,
                hd.1
            )));
        }
        self.kv_types().check_head_dim(hd.1)?;
        check_fits(pos0, t, limit)?;
        self.grow(pos0 + t, limit);
        let at = (pos0, t, self.capacity);
        match &mut self.centre {
            Some(c) => self.k.put(&c.absorb(k.data(), pos0, t, hd)?, at, hd)?,
            None => self.k.put(k.data(), at, hd)?,
        }
        self.v.put(v.data(), at, hd)
    }

    /// A new cache holding a copy of this cache's first `len` positions, with the capacity that
    /// writing `len` positions under `limit` would have grown it to (so `limit == len` gives a
    /// compact copy of exactly `len` positions), of the same element types (the stored values
    /// are copied as they are). Prefix caching uses it to start a sequence from another one's
    /// keys and values without recomputing them, and to shrink a finished sequence's cache to
    /// what it holds.
    pub fn prefix(&self, len: usize, limit: usize) -> Result<HostKv> {
        if len > self.capacity || len > limit {
            return Err(Error::Msg(format!(
                "kv prefix: {len} positions from a cache of {} (limit {limit})",
                self.capacity
            )));
        }
        let mut out = HostKv::with_centering(
            self.n_kv_heads,
            self.head_dim,
            self.kv_types(),
            KeyCentering::OFF,
        );
        // The sink keys, centres and rotation as they are: positions below `len` are final,
        // and a later write of position `sinks - 1` (when `len < sinks`) sets the centres
        // again from them.
        out.centre = self.centre.as_ref().map(Centre::copied);
        if len == 0 {
            if let Some(c) = &self.centre {
                out.centre = Some(Centre::new(c.centering(), c.rope().cloned()));
            }
            return Ok(out);
        }
        let cap = Self::grown_capacity(len, limit);
        (out.k, out.v) = self.copied(cap, len);
        out.capacity = cap;
        Ok(out)
    }

    pub fn view(&self) -> KvView<'_> {
        KvView {
            k: self.k.view(),
            v: self.v.view(),
            capacity: self.capacity,
            centre: self.centre.as_ref().and_then(Centre::view),
        }
    }

    /// Bytes held (keys and values at the current capacity, and a centring cache's sink keys
    /// and centres).
    pub fn bytes(&self) -> usize {
        self.k.bytes() + self.v.bytes() + self.centre.as_ref().map_or(0, Centre::bytes)
    }
}

/// The context-limit check every cache write makes.
pub fn check_fits(pos0: usize, t: usize, limit: usize) -> Result<()> {
    if pos0 + t > limit {
        return Err(Error::Msg(format!(
            "context full: {} tokens exceed the limit of {limit}",
            pos0 + t
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
