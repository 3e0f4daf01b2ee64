//! From a host cache's [`KvView`] (keys and values each of its own element type, known at run
//! time) to a kernel generic over both (`K`, `V`: [`KvRead`]): [`visit`] matches the key plane,
//! then the value plane, and calls the visitor with a typed [`LayerCache`]. Every pair of the
//! seven f16, f32 and ggml block types is one instantiation of the visitor, and each of the six
//! affine layouts one more (keys and values of one layout, as `KvTypes::check_head_dim` allows;
//! any other pair with an affine plane is refused); nothing is copied.
//!
//! Not here: the kernels (`attention.rs`, the reference in `lib.rs`), the cache (`hf2q_tensor::kv`).

use hf2q_tensor::kv::{KvView, PlaneView};
use hf2q_tensor::op::{AttentionParams, KeyCentre, LayerCache};
use hf2q_tensor::{Error, Result, Tensor};

use crate::{CpuBackend, KvRead};

/// Something to run over a typed cache.
pub trait KvVisit {
    type Out;
    fn visit<K: KvRead, V: KvRead>(self, cache: &LayerCache<'_, K, V>) -> Self::Out;
}

/// `f` over `view` with its keys' and values' element types; an error for an affine plane
/// paired with a plane of another type.
pub fn visit<F: KvVisit>(view: KvView<'_>, f: F) -> Result<F::Out> {
    let (v, held) = (view.v, (view.capacity, view.centre));
    let mixed = || Error::Msg("an affine KV cache stores keys and values in one layout".into());
    Ok(match (view.k, v) {
        (PlaneView::F16(k), v) => with_values(k, v, held, f).ok_or_else(mixed)?,
        (PlaneView::F32(k), v) => with_values(k, v, held, f).ok_or_else(mixed)?,
        (PlaneView::Q8_0(k), v) => with_values(k, v, held, f).ok_or_else(mixed)?,
        (PlaneView::Q4_0(k), v) => with_values(k, v, held, f).ok_or_else(mixed)?,
        (PlaneView::Q4_1(k), v) => with_values(k, v, held, f).ok_or_else(mixed)?,
        (PlaneView::Q5_0(k), v) => with_values(k, v, held, f).ok_or_else(mixed)?,
        (PlaneView::Q5_1(k), v) => with_values(k, v, held, f).ok_or_else(mixed)?,
        (PlaneView::A8G32(k), PlaneView::A8G32(v)) => go(k, v, held, f),
        (PlaneView::A8G64(k), PlaneView::A8G64(v)) => go(k, v, held, f),
        (PlaneView::A8G128(k), PlaneView::A8G128(v)) => go(k, v, held, f),
        (PlaneView::A4G32(k), PlaneView::A4G32(v)) => go(k, v, held, f),
        (PlaneView::A4G64(k), PlaneView::A4G64(v)) => go(k, v, held, f),
        (PlaneView::A4G128(k), PlaneView::A4G128(v)) => go(k, v, held, f),
        _ => return Err(mixed()),
    })
}

/// `capacity`: the cache's capacity in positions and its centred keys, if any.
fn go<K: KvRead, V: KvRead, F: KvVisit>(
    k: &[K],
    v: &[V],
    (capacity, centre): (usize, Option<KeyCentre<'_>>),
    f: F,
) -> F::Out {
    f.visit(&LayerCache {
        k,
        v,
        capacity,
        centre,
    })
}

/// [`visit`]'s second half for keys of a non-affine type `K`: the values' type matched (`None`
/// for affine values).
fn with_values<K: KvRead, F: KvVisit>(
    k: &[K],
    v: PlaneView<'_>,
    held: (usize, Option<KeyCentre<'_>>),
    f: F,
) -> Option<F::Out> {
    Some(match v {
        PlaneView::F16(v) => go(k, v, held, f),
        PlaneView::F32(v) => go(k, v, held, f),
        PlaneView::Q8_0(v) => go(k, v, held, f),
        PlaneView::Q4_0(v) => go(k, v, held, f),
        PlaneView::Q4_1(v) => go(k, v, held, f),
        PlaneView::Q5_0(v) => go(k, v, held, f),
        PlaneView::Q5_1(v) => go(k, v, held, f),
        PlaneView::A8G32(_)
        | PlaneView::A8G64(_)
        | PlaneView::A8G128(_)
        | PlaneView::A4G32(_)
        | PlaneView::A4G64(_)
        | PlaneView::A4G128(_) => return None,
    })
}

/// `CpuBackend::attention` (the backend's path: tiled or reference) as a visitor.
pub struct Attend<'a> {
    pub be: &'a CpuBackend,
    pub q: &'a Tensor,
    pub pos0: usize,
    pub p: &'a AttentionParams,
}

impl KvVisit for Attend<'_> {
    type Out = Result<Tensor>;
    fn visit<K: KvRead, V: KvRead>(self, cache: &LayerCache<'_, K, V>) -> Result<Tensor> {
        self.be.attention(self.q, cache, self.pos0, self.p)
    }
}
