//! Key centring of a host cache with a quantized key plane ([`KeyCentering`], SageAttention's
//! "smooth K" kept exact): each kv head's first positions are kept whole (f16 "sink" rows), a
//! centre is fixed from them, later keys are stored less the centre at their position, and the
//! attention adds `q · centre` back to each score ([`KeyCentre`]).
//!
//! Keys are cached after RoPE (`k_p = R(p) k`), so a channel pair that is large and steady
//! before the rotation (Gemma 3's normed keys) turns at its rotary frequency after it, and a
//! centre fixed at the first positions drifts off it. Given the layer's rotation ([`KeyRope`]),
//! a head's largest pairs (by their mean before the rotation) are kept in that frame instead and
//! rotated to each key's position: the centre at position `p` is `c` on every other channel and
//! `R(p) c_pre` on those pairs.
//!
//! Not here: the planes the keys are quantized into and the cache itself (`crate::kv`), the
//! kernels that read the centres (the CPU crate's attention and decode).

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::op::{RopeParams, RopeStyle};
use crate::weight::dot;
use crate::{Error, Result};

/// Whether a host cache with a quantized key plane centres its keys, and how (as
/// SageAttention's "smooth K"): a few key channels of some models are many times larger than
/// the rest (Qwen2.5's k projection bias, Gemma 3's normed keys), so one scale per block or
/// group spends most of its codes on them. The first `sinks` positions of a sequence are kept
/// whole (f16, each kv head's rows), and when position `sinks - 1` is written each kv head's
/// centre is set from those f16 keys; every later position `p` is stored as
/// `quantize(k - centre(p))`, and attention adds `q · centre(p)` back to its score
/// ([`KeyCentre`]), so scores stay those of the keys written up to the quantization of
/// `k - centre(p)`. The centre is the mean of the sink keys, except,
/// when the cache knows the layer's RoPE ([`KeyRope`]), on each head's `rotated` rotary pairs
/// of the largest mean before the rotation: those follow the rotation (`R(p)` of the mean of
/// `R(-j) k_j`). The centre depends only on the stored first positions, so any chunking of the
/// same tokens stores the same bytes. Values, and f16 or f32 key planes, are stored as before.
/// `sinks == 0`: off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyCentering {
    pub sinks: usize,
    /// Rotary pairs per kv head whose centre follows the rotation (0: a fixed centre on every
    /// channel; [`KeyCentering::ALL`] or more than the head has: all of them).
    pub rotated: usize,
}

impl KeyCentering {
    /// Keys stored as written (no centre, no sink positions).
    pub const OFF: KeyCentering = KeyCentering {
        sinks: 0,
        rotated: 0,
    };
    /// Every rotary pair follows the rotation ([`KeyCentering::rotated`]).
    pub const ALL: usize = usize::MAX;
    /// The default: 16 first positions, every rotary pair following the rotation
    /// (`kv_quant.rs`'s `key_centring_sweep` and `key_rotation_sweep` say what was measured).
    pub const DEFAULT: KeyCentering = KeyCentering {
        sinks: 16,
        rotated: KeyCentering::ALL,
    };
}

impl KeyCentering {
    /// Bytes a centred key plane holds per kv head of width `dh` however long the sequence is
    /// (what [`Centre`] allocates at its first write): the `sinks` f16 rows, the f32 centre
    /// and, per pair that follows `rope`, its index and its centre before the rotation. 0 when
    /// off.
    pub fn fixed_bytes_per_head(&self, dh: usize, rope: Option<&KeyRope>) -> usize {
        if self.sinks == 0 {
            return 0;
        }
        let rotated = rope.map_or(0, |r| self.rotated.min(r.pairs()));
        2 * self.sinks * dh + 4 * (dh + 3 * rotated)
    }
}

impl Default for KeyCentering {
    fn default() -> KeyCentering {
        KeyCentering::DEFAULT
    }
}

/// A layer's RoPE as its keys were rotated before they were cached (what the model's rope
/// computes: the angle of pair `i` at position `p` is `(p / linear_scale) · inv_freqs[i]` in
/// f32): what a centring cache needs to follow a rotation ([`KeyCentering`]).
#[derive(Clone, Debug, PartialEq)]
pub struct KeyRope {
    /// How the pairs lie in a head ([`RopeStyle`]).
    pub style: RopeStyle,
    /// Each pair's inverse frequency after any scaling (`RopeParams::inv_freqs`), `dims / 2`.
    pub inv_freqs: Vec<f32>,
    /// Positions are divided by this (1.0 = none).
    pub linear_scale: f32,
}

impl KeyRope {
    /// The rotation of `p`, or `None` when it rotates nothing (a no-RoPE layer).
    pub fn of(p: &RopeParams) -> Option<KeyRope> {
        (p.dims >= 2).then(|| KeyRope {
            style: p.style,
            inv_freqs: p.inv_freqs(),
            linear_scale: p.linear_scale,
        })
    }
    /// Rotary pairs.
    pub fn pairs(&self) -> usize {
        self.inv_freqs.len()
    }
    /// The two channels of pair `i`.
    #[inline]
    pub fn pair(&self, i: usize) -> (usize, usize) {
        match self.style {
            RopeStyle::Neox => (i, i + self.inv_freqs.len()),
            RopeStyle::Interleaved => (2 * i, 2 * i + 1),
        }
    }
    /// `(cos, sin)` of pair `i`'s angle at position `pos`, as the model's rope computes it.
    #[inline]
    pub fn cos_sin(&self, i: usize, pos: usize) -> (f32, f32) {
        let a = pos as f32 / self.linear_scale * self.inv_freqs[i];
        (a.cos(), a.sin())
    }
    /// Whether heads of width `dh` hold every pair.
    fn check(&self, dh: usize) -> Result<()> {
        if 2 * self.pairs() > dh {
            return Err(Error::Msg(format!(
                "key centring: {} rotary pairs do not fit a head of {dh}",
                self.pairs()
            )));
        }
        Ok(())
    }
}

/// A centring cache's sink keys and centres ([`KeyCentering`]).
pub(crate) struct Centre {
    /// As asked for.
    centering: KeyCentering,
    pub(crate) sinks: usize,
    /// Pairs per head to rotate (at most the rope's pairs; 0 without one).
    rotated: usize,
    rope: Option<KeyRope>,
    /// `(Hkv, sinks, Dh)`, allocated at the first write.
    pub(crate) sink: Vec<f16>,
    /// `(Hkv, Dh)`: the fixed centre, zero on the rotated pairs (all zeros until position
    /// `sinks - 1` is written).
    pub(crate) c: Vec<f32>,
    /// `(Hkv, rotated)`: each head's rotated pairs.
    pairs: Vec<u32>,
    /// `(Hkv, rotated, 2)`: their centre before the rotation.
    pre: Vec<f32>,
}

impl Centre {
    pub(crate) fn new(centering: KeyCentering, rope: Option<KeyRope>) -> Centre {
        let rotated = rope
            .as_ref()
            .map_or(0, |r| centering.rotated.min(r.pairs()));
        Centre {
            centering,
            sinks: centering.sinks,
            rotated,
            rope: rope.filter(|_| rotated > 0),
            sink: Vec::new(),
            c: Vec::new(),
            pairs: Vec::new(),
            pre: Vec::new(),
        }
    }
    /// How it centres (as asked for: `rotated` is at most the pairs a rotation has, and none
    /// without one).
    pub(crate) fn centering(&self) -> KeyCentering {
        self.centering
    }
    pub(crate) fn rope(&self) -> Option<&KeyRope> {
        self.rope.as_ref()
    }

    /// Stores the keys `k (T, Hkv*Dh)` at positions `pos0..pos0+T` below `sinks` as f16, sets
    /// the centres when position `sinks - 1` is among them ([`Centre::set`]), and returns the
    /// keys to quantize: rows at positions `p >= sinks` less their head's centre at `p`, the
    /// others as written (their plane rows are read by nothing).
    pub(crate) fn absorb(
        &mut self,
        k: &[f32],
        pos0: usize,
        t: usize,
        (h, d): (usize, usize),
    ) -> Result<Vec<f32>> {
        if let Some(r) = &self.rope {
            r.check(d)?;
        }
        let ks = self.sinks;
        if self.sink.is_empty() {
            self.sink = vec![f16::ZERO; h * ks * d];
            self.c = vec![0.0; h * d];
            self.pairs = vec![0; h * self.rotated];
            self.pre = vec![0.0; h * self.rotated * 2];
        }
        for ti in 0..t.min(ks.saturating_sub(pos0)) {
            for hi in 0..h {
                let at = (hi * ks + pos0 + ti) * d;
                let from = ti * h * d + hi * d;
                self.sink[at..at + d].convert_from_f32_slice(&k[from..from + d]);
            }
        }
        if pos0 < ks && ks <= pos0 + t {
            for hi in 0..h {
                self.set(hi, d);
            }
        }
        let mut out = k.to_vec();
        let Some(view) = self.view() else {
            return Ok(out);
        };
        let mut c = vec![0f32; d];
        for ti in ks.saturating_sub(pos0)..t {
            for hi in 0..h {
                view.centre_at(hi, pos0 + ti, &mut c);
                let from = ti * h * d + hi * d;
                for (x, c) in out[from..from + d].iter_mut().zip(&c) {
                    *x -= c;
                }
            }
        }
        Ok(out)
    }

    /// Head `hi`'s centre from its f16 sink rows (summed in position order): the mean of the
    /// rows, and with a rotation the mean of each pair turned back to position 0 (`R(-j) k_j`);
    /// the `rotated` pairs of the largest such mean (the lower pair on a tie) keep it, zero in
    /// the fixed centre.
    fn set(&mut self, hi: usize, d: usize) {
        let ks = self.sinks;
        let rows = &self.sink[hi * ks * d..(hi + 1) * ks * d];
        let count = ks as f32;
        let c = &mut self.c[hi * d..(hi + 1) * d];
        c.fill(0.0);
        for row in rows.chunks_exact(d) {
            for (x, y) in c.iter_mut().zip(row) {
                *x += y.to_f32();
            }
        }
        c.iter_mut().for_each(|x| *x /= count);
        let Some(rope) = &self.rope else {
            return;
        };
        let n = rope.pairs();
        let mut pre = vec![[0f32; 2]; n];
        for (j, row) in rows.chunks_exact(d).enumerate() {
            for (i, m) in pre.iter_mut().enumerate() {
                let (a, b) = rope.pair(i);
                let (cos, sin) = rope.cos_sin(i, j);
                let (x, y) = (row[a].to_f32(), row[b].to_f32());
                m[0] += x * cos + y * sin;
                m[1] += y * cos - x * sin;
            }
        }
        pre.iter_mut().flatten().for_each(|x| *x /= count);
        let mut order: Vec<usize> = (0..n).collect();
        let norm = |i: usize| pre[i][0] * pre[i][0] + pre[i][1] * pre[i][1];
        order.sort_by(|&x, &y| norm(y).total_cmp(&norm(x)).then(x.cmp(&y)));
        let r = self.rotated;
        for (slot, &i) in order[..r].iter().enumerate() {
            let (a, b) = rope.pair(i);
            (c[a], c[b]) = (0.0, 0.0);
            self.pairs[hi * r + slot] = i as u32;
            self.pre[(hi * r + slot) * 2..][..2].copy_from_slice(&pre[i]);
        }
    }

    pub(crate) fn bytes(&self) -> usize {
        2 * self.sink.len() + 4 * (self.c.len() + self.pairs.len() + self.pre.len())
    }

    /// A copy holding the same sink rows and centres.
    pub(crate) fn copied(&self) -> Centre {
        Centre {
            centering: self.centering,
            sinks: self.sinks,
            rotated: self.rotated,
            rope: self.rope.clone(),
            sink: self.sink.clone(),
            c: self.c.clone(),
            pairs: self.pairs.clone(),
            pre: self.pre.clone(),
        }
    }

    pub(crate) fn view(&self) -> Option<KeyCentre<'_>> {
        (!self.sink.is_empty()).then_some(KeyCentre {
            sinks: self.sinks,
            sink: &self.sink,
            c: &self.c,
            rot: self.rope.as_ref().map(|rope| Rotated {
                rope,
                n: self.rotated,
                pairs: &self.pairs,
                pre: &self.pre,
            }),
        })
    }
}

/// How the keys of a centring cache are read ([`KeyCentering`]): positions `0..sinks` are f16
/// rows of their own (`sink`), not the plane's; a position `p >= sinks` is its plane row plus
/// the head's centre at `p` ([`KeyCentre::centre_at`]), so that its score is
/// `q · dq(row_p) + q · centre(p)`, the score of the key as written up to the quantization of
/// `k - centre(p)`.
#[derive(Clone, Copy)]
pub struct KeyCentre<'a> {
    /// Positions kept whole (f16) at the start of the sequence.
    pub sinks: usize,
    /// `(Hkv, sinks, Dh)`: their keys.
    pub sink: &'a [f16],
    /// `(Hkv, Dh)`: each kv head's fixed centre (zero on its rotated pairs; zeros until
    /// position `sinks - 1` is written).
    pub c: &'a [f32],
    /// The pairs that follow the rotation, if any.
    pub rot: Option<Rotated<'a>>,
}

/// The rotated pairs of a [`KeyCentre`]: pair `pairs[g * n + s]` of head `g` is
/// `R(p) pre[g * n + s]` at position `p`.
#[derive(Clone, Copy)]
pub struct Rotated<'a> {
    pub rope: &'a KeyRope,
    /// Pairs per head.
    pub n: usize,
    /// `(Hkv, n)`.
    pub pairs: &'a [u32],
    /// `(Hkv, n, 2)`: their centre before the rotation.
    pub pre: &'a [f32],
}

/// Positions between exact angles when a [`Walk`] steps its rotations by complex products:
/// each step rounds (relative 6e-8, adding up to at most ~4e-6 of the centre over 64 steps,
/// far below a quantized key's step), and an exact angle costs a sine and a cosine.
const ANCHOR: usize = 64;

/// The `(cos, sin)` of a head's rotated pairs at consecutive positions: exact every
/// [`ANCHOR`] positions, and in between the last ones times one step's (the pairs side by
/// side, so that a step is a few vector operations, not a chain per pair).
struct Walk<'a> {
    rot: Option<&'a Rotated<'a>>,
    /// The pair indices.
    idx: Vec<usize>,
    pos: usize,
    since: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
    step: Vec<(f32, f32)>,
}

impl<'a> Walk<'a> {
    fn new(c: &'a KeyCentre<'a>, g: usize, pos: usize) -> Walk<'a> {
        let idx: Vec<usize> = c
            .rot
            .as_ref()
            .map_or(Vec::new(), |r| (0..r.n).map(|s| r.get(g, s).0).collect());
        let step = match &c.rot {
            Some(r) => idx.iter().map(|&i| r.rope.cos_sin(i, 1)).collect(),
            None => Vec::new(),
        };
        let mut w = Walk {
            rot: c.rot.as_ref(),
            cos: vec![0.0; idx.len()],
            sin: vec![0.0; idx.len()],
            idx,
            pos,
            since: 0,
            step,
        };
        w.exact();
        w
    }
    fn exact(&mut self) {
        if let Some(r) = self.rot {
            for (s, &i) in self.idx.iter().enumerate() {
                (self.cos[s], self.sin[s]) = r.rope.cos_sin(i, self.pos);
            }
        }
        self.since = 0;
    }
    fn advance(&mut self) {
        self.pos += 1;
        self.since += 1;
        if self.since == ANCHOR {
            return self.exact();
        }
        for ((c, s), &(sc, ss)) in self.cos.iter_mut().zip(&mut self.sin).zip(&self.step) {
            (*c, *s) = (*c * sc - *s * ss, *c * ss + *s * sc);
        }
    }
}

impl<'a> KeyCentre<'a> {
    /// Sink row of kv head `g` at position `j < sinks` (`dh` values).
    #[inline]
    pub fn sink_row(&self, g: usize, j: usize, dh: usize) -> &'a [f16] {
        let at = (g * self.sinks + j) * dh;
        &self.sink[at..at + dh]
    }
    /// Kv head `g`'s fixed centre (`dh` values; zero on the rotated pairs).
    #[inline]
    pub fn centre(&self, g: usize, dh: usize) -> &'a [f32] {
        &self.c[g * dh..(g + 1) * dh]
    }
    /// Whether the centre differs from position to position (some pairs rotate).
    pub fn rotates(&self) -> bool {
        self.rot.is_some_and(|r| r.n > 0)
    }
    /// `out (Dh)` = kv head `g`'s centre at position `pos`: the fixed centre, and each rotated
    /// pair's centre turned to `pos` (exact angles: the model's rope's).
    pub fn centre_at(&self, g: usize, pos: usize, out: &mut [f32]) {
        out.copy_from_slice(self.centre(g, out.len()));
        if let Some(r) = &self.rot {
            for s in 0..r.n {
                let (i, x, y) = r.get(g, s);
                let (a, b) = r.rope.pair(i);
                let (cos, sin) = r.rope.cos_sin(i, pos);
                out[a] = x * cos - y * sin;
                out[b] = x * sin + y * cos;
            }
        }
    }
    /// What a query row `q (Dh)` of kv head `g` needs for `q · centre(p)` at any `p`
    /// ([`QCentre`]).
    pub fn q_centre(&self, g: usize, q: &[f32]) -> QCentre {
        let base = dot(q, self.centre(g, q.len()));
        let (mut qa, mut qb) = (Vec::new(), Vec::new());
        if let Some(r) = &self.rot {
            for s in 0..r.n {
                let (i, x, y) = r.get(g, s);
                let (a, b) = r.rope.pair(i);
                qa.push(q[a] * x + q[b] * y);
                qb.push(q[b] * x - q[a] * y);
            }
        }
        QCentre { base, a: qa, b: qb }
    }
    /// `q · centre(pos)` for the row `qc` was made of, exact angles.
    pub fn q_dot_at(&self, g: usize, qc: &QCentre, pos: usize) -> f32 {
        let mut s = qc.base;
        if let Some(r) = &self.rot {
            for (slot, (&a, &b)) in qc.a.iter().zip(&qc.b).enumerate() {
                let (cos, sin) = r.rope.cos_sin(r.get(g, slot).0, pos);
                s += a * cos + b * sin;
            }
        }
        s
    }
    /// `out (G, n) += q_r · centre(a + j)` for each row's [`QCentre`] `qcs` and `j < n`, the
    /// angles walked from key to key ([`Walk`]) and shared by the rows.
    pub fn add_scores(&self, g: usize, qcs: &[QCentre], a: usize, out: &mut [f32]) {
        let n = out.len() / qcs.len().max(1);
        let mut walk = Walk::new(self, g, a);
        for j in 0..n {
            for (r, qc) in qcs.iter().enumerate() {
                out[r * n + j] += qc.base + dot(&qc.a, &walk.cos) + dot(&qc.b, &walk.sin);
            }
            walk.advance();
        }
    }
    /// `out (n, Dh)` = kv head `g`'s centres at positions `a..a + n`, the angles walked from
    /// key to key ([`Walk`]): [`KeyCentre::centre_at`] within f32 rounding.
    pub fn centres(&self, g: usize, a: usize, out: &mut [f32], dh: usize) {
        let fixed = self.centre(g, dh);
        let mut walk = Walk::new(self, g, a);
        for row in out.chunks_exact_mut(dh) {
            row.copy_from_slice(fixed);
            if let Some(r) = &self.rot {
                for (s, (&c, &sn)) in walk.cos.iter().zip(&walk.sin).enumerate() {
                    let (i, x, y) = r.get(g, s);
                    let (pa, pb) = r.rope.pair(i);
                    row[pa] = x * c - y * sn;
                    row[pb] = x * sn + y * c;
                }
            }
            walk.advance();
        }
    }
    /// Whether the slices hold `hkv` heads of `dh` (what attention checks before reading).
    pub fn check(&self, hkv: usize, dh: usize) -> Result<()> {
        let rot_ok = self.rot.is_none_or(|r| {
            r.pairs.len() >= hkv * r.n
                && r.pre.len() >= hkv * r.n * 2
                && 2 * r.rope.pairs() <= dh
                && r.pairs.iter().all(|&i| (i as usize) < r.rope.pairs())
        });
        if self.sink.len() < hkv * self.sinks * dh || self.c.len() < hkv * dh || !rot_ok {
            return Err(Error::Shape(format!(
                "attention: centred keys of {} f16 and {} f32 values for {hkv} kv heads of {dh} \
                 with {} sink positions",
                self.sink.len(),
                self.c.len(),
                self.sinks
            )));
        }
        Ok(())
    }
}

impl Rotated<'_> {
    /// Head `g`'s rotated pair `s`: its index and centre before the rotation.
    #[inline]
    fn get(&self, g: usize, s: usize) -> (usize, f32, f32) {
        let at = g * self.n + s;
        (
            self.pairs[at] as usize,
            self.pre[2 * at],
            self.pre[2 * at + 1],
        )
    }
}

/// A query row's part of `q · centre(p)` ([`KeyCentre::q_centre`]): `base = q · c` over the
/// fixed centre, and per rotated pair `a`, `b` with `q · R(p) pre = a cos(pθ) + b sin(pθ)`.
pub struct QCentre {
    pub base: f32,
    pub a: Vec<f32>,
    pub b: Vec<f32>,
}
