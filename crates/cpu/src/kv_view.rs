//! From a host cache's [`KvView`] (keys and values each of its own element type, known at run
//! time) to a kernel generic over both (`K`, `V`: [`KvRead`]): [`visit`] matches the key plane,
//! then the value plane, and calls the visitor with a typed [`LayerCache`]. Every pair of the
//! seven types is one instantiation of the visitor; nothing is copied.
//!
//! Not here: the kernels (`attention.rs`, the reference in `lib.rs`), the cache (`hf2q_tensor::kv`).

use hf2q_tensor::kv::{KvView, PlaneView};
use hf2q_tensor::op::{AttentionParams, LayerCache};
use hf2q_tensor::{Result, Tensor};

use crate::{CpuBackend, KvRead};

/// Something to run over a typed cache.
pub trait KvVisit {
    type Out;
    fn visit<K: KvRead, V: KvRead>(self, cache: &LayerCache<'_, K, V>) -> Self::Out;
}

/// `f` over `view` with its keys' and values' element types.
pub fn visit<F: KvVisit>(view: KvView<'_>, f: F) -> F::Out {
    let (v, capacity) = (view.v, view.capacity);
    match view.k {
        PlaneView::F16(k) => with_values(k, v, capacity, f),
        PlaneView::F32(k) => with_values(k, v, capacity, f),
        PlaneView::Q8_0(k) => with_values(k, v, capacity, f),
        PlaneView::Q4_0(k) => with_values(k, v, capacity, f),
        PlaneView::Q4_1(k) => with_values(k, v, capacity, f),
        PlaneView::Q5_0(k) => with_values(k, v, capacity, f),
        PlaneView::Q5_1(k) => with_values(k, v, capacity, f),
    }
}

/// [`visit`]'s second half: keys of type `K` known, the values' type matched.
fn with_values<K: KvRead, F: KvVisit>(k: &[K], v: PlaneView<'_>, capacity: usize, f: F) -> F::Out {
    fn go<K: KvRead, V: KvRead, F: KvVisit>(k: &[K], v: &[V], capacity: usize, f: F) -> F::Out {
        f.visit(&LayerCache { k, v, capacity })
    }
    match v {
        PlaneView::F16(v) => go(k, v, capacity, f),
        PlaneView::F32(v) => go(k, v, capacity, f),
        PlaneView::Q8_0(v) => go(k, v, capacity, f),
        PlaneView::Q4_0(v) => go(k, v, capacity, f),
        PlaneView::Q4_1(v) => go(k, v, capacity, f),
        PlaneView::Q5_0(v) => go(k, v, capacity, f),
        PlaneView::Q5_1(v) => go(k, v, capacity, f),
    }
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
