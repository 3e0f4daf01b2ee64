//! Mixture-of-experts feed-forward, written once for every family that routes tokens to
//! experts (Qwen3-MoE, Mixtral, Gemma 4's MoE branch):
//!
//! - [`Experts`]: one layer's experts, each a gated MLP, as views of the stored bytes: stacked
//!   as llama.cpp stores them (`ffn_{gate,up}_exps (E·F, D)`, `ffn_down_exps (E·D, F)`), fused
//!   (transformers' `gate_up_proj`), or one tensor per expert; optionally with biases on the
//!   three products (GPT-OSS, [`ExpertBiases`]).
//! - [`route`]: router logits `(T, E)` -> per token the `k` experts and their weights (softmax
//!   over all experts in f32, top-k, optional renormalisation and per-expert scale), as
//!   transformers' routers compute them.
//! - [`moe_ffn_composed`]: the expert products composed from the closed op set (any backend);
//!   a backend overrides [`crate::op::Backend::moe_ffn`] with its own gather and scatter.
//!
//! Not here: the router product and any norm before it (ordinary ops in the family's block),
//! shared experts (an ordinary MLP beside this one), training (the experts have no backward).

use crate::op::{Backend, GateAct, MatmulSpec};
use crate::{Error, QTensor, Result, Tensor};

/// How router logits become expert weights.
#[derive(Clone, Copy, Debug)]
pub struct MoeSpec<'a> {
    /// k: experts per token.
    pub top_k: usize,
    /// Divide the chosen probabilities by their sum (Mixtral, Gemma 4; Qwen3-MoE's
    /// `norm_topk_prob`).
    pub renormalize: bool,
    /// Per expert, a multiplier of its weight after renormalising (Gemma 4's
    /// `per_expert_scale`), `(E)`.
    pub expert_scale: Option<&'a [f32]>,
    pub act: GateAct,
}

/// One layer's experts: `E` gated MLPs of width `F` over hidden size `D`, each held as views
/// of the stored bytes (nothing copied).
#[derive(Clone, Debug)]
pub struct Experts {
    /// Per expert: gate `(F, D)`, up `(F, D)`, down `(D, F)`.
    views: Vec<[QTensor; 3]>,
    /// The stacked tensors the views were cut from, when they came stacked (GGUF's
    /// `ffn_{gate,up}_exps (E·F, D)` and `ffn_down_exps (E·D, F)`): what a device kernel that
    /// indexes experts by id reads.
    stacked: Option<[QTensor; 3]>,
    biases: Option<ExpertBiases>,
}

/// Biases of every expert's products (GPT-OSS): `gate`, `up` `(E·F)` and `down` `(E·D)`,
/// expert `e`'s at `e·F..(e+1)·F` and `e·D..(e+1)·D`.
#[derive(Clone, Debug)]
pub struct ExpertBiases {
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub down: Vec<f32>,
}

impl Experts {
    /// The same experts with biases on their products (lengths checked against `E`, `F`, `D`).
    pub fn with_biases(mut self, b: ExpertBiases) -> Result<Experts> {
        let (e, f, d) = (self.n_experts(), self.width(), self.hidden());
        if b.gate.len() != e * f || b.up.len() != e * f || b.down.len() != e * d {
            return Err(Error::Shape(format!(
                "expert biases of {}, {} and {} values for {e} experts of {f} x {d}",
                b.gate.len(),
                b.up.len(),
                b.down.len()
            )));
        }
        self.biases = Some(b);
        Ok(self)
    }
    /// Whether the products carry biases.
    pub fn has_biases(&self) -> bool {
        self.biases.is_some()
    }
    /// Every expert's biases as stored (a device kernel that indexes experts by id reads them).
    pub fn all_biases(&self) -> Option<&ExpertBiases> {
        self.biases.as_ref()
    }
    /// Expert `e`'s gate `(F)`, up `(F)` and down `(D)` biases, when it has them.
    pub fn biases(&self, e: usize) -> Option<[&[f32]; 3]> {
        let b = self.biases.as_ref()?;
        let (f, d) = (self.width(), self.hidden());
        Some([
            &b.gate[e * f..(e + 1) * f],
            &b.up[e * f..(e + 1) * f],
            &b.down[e * d..(e + 1) * d],
        ])
    }
    /// From stacked tensors, `gate`, `up` `(E·F, D)` and `down` `(E·D, F)`.
    pub fn from_stacked(
        n_experts: usize,
        gate: QTensor,
        up: QTensor,
        down: QTensor,
    ) -> Result<Experts> {
        let bad = |m: String| Error::Shape(format!("experts '{}': {m}", gate.name));
        if n_experts == 0 || !gate.rows.is_multiple_of(n_experts) {
            return Err(bad(format!(
                "{} rows do not split into {n_experts} experts",
                gate.rows
            )));
        }
        let (f, d) = (gate.rows / n_experts, gate.cols);
        if down.rows != n_experts * d {
            return Err(bad(format!(
                "down has {} rows, {} expected for {n_experts} experts",
                down.rows,
                n_experts * d
            )));
        }
        let views = (0..n_experts)
            .map(|e| {
                Ok([
                    gate.row_range(e * f, f, &expert_name(&gate, e))?,
                    up.row_range(e * f, f, &expert_name(&up, e))?,
                    down.row_range(e * d, d, &expert_name(&down, e))?,
                ])
            })
            .collect::<Result<Vec<_>>>()?;
        let mut ex = Experts::from_parts(views)?;
        ex.stacked = Some([gate, up, down]);
        Ok(ex)
    }

    /// From the experts' own tensors (checkpoints that store each expert apart).
    pub fn from_parts(views: Vec<[QTensor; 3]>) -> Result<Experts> {
        let Some([g0, _, d0]) = views.first() else {
            return Err(Error::Shape("a layer of experts with no experts".into()));
        };
        let (f, d) = (g0.rows, g0.cols);
        for (e, [g, u, dn]) in views.iter().enumerate() {
            if (g.rows, g.cols) != (f, d)
                || (u.rows, u.cols) != (f, d)
                || (dn.rows, dn.cols) != (d, f)
            {
                return Err(Error::Shape(format!(
                    "expert {e} ('{}'): gate {}x{}, up {}x{}, down {}x{}; expert 0 has gate {f}x{d}, down {}x{}",
                    g.name, g.rows, g.cols, u.rows, u.cols, dn.rows, dn.cols, d0.rows, d0.cols
                )));
            }
        }
        Ok(Experts {
            views,
            stacked: None,
            biases: None,
        })
    }
    /// E
    pub fn n_experts(&self) -> usize {
        self.views.len()
    }
    /// F: the width of one expert.
    pub fn width(&self) -> usize {
        self.views[0][0].rows
    }
    /// D
    pub fn hidden(&self) -> usize {
        self.views[0][0].cols
    }
    /// Expert `e`'s gate `(F, D)`, up `(F, D)` and down `(D, F)`.
    pub fn expert(&self, e: usize) -> &[QTensor; 3] {
        &self.views[e]
    }
    /// The stacked gate, up and down, when the experts came stacked.
    pub fn stacked(&self) -> Option<&[QTensor; 3]> {
        self.stacked.as_ref()
    }
    /// Stored bytes of all experts.
    pub fn stored_bytes(&self) -> usize {
        self.views.iter().flatten().map(QTensor::stored_bytes).sum()
    }
}

/// The name of expert `e`'s part of a stacked tensor, so that messages say which one.
pub fn expert_name(stacked: &QTensor, e: usize) -> String {
    format!("{}[expert {e}]", stacked.name)
}

/// Per token, the chosen experts and their weights: `experts`, `weights` are `(T, k)`.
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    pub top_k: usize,
    pub experts: Vec<u32>,
    pub weights: Vec<f32>,
}

impl Route {
    /// T
    pub fn tokens(&self) -> usize {
        self.experts.len() / self.top_k.max(1)
    }
    /// Per expert `0..n_experts`, the `(token, weight)` pairs routed to it, tokens ascending.
    pub fn by_expert(&self, n_experts: usize) -> Vec<Vec<(usize, f32)>> {
        let mut out = vec![Vec::new(); n_experts];
        for (i, (&e, &w)) in self.experts.iter().zip(&self.weights).enumerate() {
            out[e as usize].push((i / self.top_k, w));
        }
        out
    }
}

/// Routes each row of `logits (T, E)`: softmax over the `E` experts (f32, max subtracted), the
/// `k` largest probabilities (ties to the lower index), optionally
/// renormalised to sum to 1, then times `expert_scale[e]`.
pub fn route(logits: &[f32], n_experts: usize, spec: &MoeSpec<'_>) -> Result<Route> {
    let k = spec.top_k;
    if n_experts == 0 || k == 0 || k > n_experts || !logits.len().is_multiple_of(n_experts) {
        return Err(Error::Shape(format!(
            "routing {} logits over {n_experts} experts, top {k}",
            logits.len()
        )));
    }
    if let Some(s) = spec.expert_scale {
        if s.len() != n_experts {
            return Err(Error::Shape(format!(
                "{} expert scales for {n_experts} experts",
                s.len()
            )));
        }
    }
    let t = logits.len() / n_experts;
    let mut experts = Vec::with_capacity(t * k);
    let mut weights = Vec::with_capacity(t * k);
    let mut order: Vec<u32> = Vec::with_capacity(n_experts);
    for row in logits.chunks(n_experts) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let exps: Vec<f32> = row.iter().map(|&l| (l - max).exp()).collect();
        let sum: f32 = exps.iter().sum();
        order.clear();
        order.extend(0..n_experts as u32);
        // NaN logits sort last, so a poisoned row still picks k valid-looking experts.
        order.sort_by(|&a, &b| {
            let (pa, pb) = (exps[a as usize], exps[b as usize]);
            pb.partial_cmp(&pa)
                .unwrap_or_else(|| pa.is_nan().cmp(&pb.is_nan()))
                .then(a.cmp(&b))
        });
        let chosen = &order[..k];
        let mut p: Vec<f32> = chosen.iter().map(|&e| exps[e as usize] / sum).collect();
        if spec.renormalize {
            let s: f32 = p.iter().sum();
            if s > 0.0 {
                p.iter_mut().for_each(|v| *v /= s);
            }
        }
        if let Some(scale) = spec.expert_scale {
            for (v, &e) in p.iter_mut().zip(chosen) {
                *v *= scale[e as usize];
            }
        }
        experts.extend_from_slice(chosen);
        weights.extend(p);
    }
    Ok(Route {
        top_k: k,
        experts,
        weights,
    })
}

/// Checks the shapes a [`crate::op::Backend::moe_ffn`] gets: `x (T, D)`, `logits (T, E)`.
pub fn check_moe(x: &Tensor, logits: &Tensor, ex: &Experts) -> Result<usize> {
    let (t, d) = x.dims2();
    let (tl, e) = logits.dims2();
    if d != ex.hidden() || tl != t || e != ex.n_experts() {
        return Err(Error::Shape(format!(
            "moe_ffn: x is {t}x{d}, router logits {tl}x{e}, experts {}x{} of width {}",
            ex.n_experts(),
            ex.hidden(),
            ex.width()
        )));
    }
    Ok(t)
}

/// `Σ_k w_k · down_k(act(gate_k(x)) · up_k(x))` per token, from the op set alone: the routing
/// on the host (the logits are `T·E` values), then per expert hit its tokens gathered by a
/// selection product `S (n, T) · x`, its gated MLP, and the weighted results added back by
/// `Wᵀ (T, n) · y`. Every backend runs this; the CPU overrides it with a direct gather.
pub fn moe_ffn_composed<B: Backend + ?Sized>(
    be: &B,
    x: &Tensor,
    logits: &Tensor,
    ex: &Experts,
    spec: &MoeSpec<'_>,
) -> Result<Tensor> {
    let t = check_moe(x, logits, ex)?;
    let route = route(be.to_host(logits)?.data(), ex.n_experts(), spec)?;
    let d = ex.hidden();
    let mut out = be.upload(&Tensor::zeros(&[t, d]))?;
    for (e, hits) in route.by_expert(ex.n_experts()).iter().enumerate() {
        if hits.is_empty() {
            continue;
        }
        let n = hits.len();
        // S (n, T): row i selects token hits[i].0; Wt (T, n): column i carries its weight.
        let mut sel = vec![0f32; n * t];
        let mut wt = vec![0f32; t * n];
        for (i, &(tok, w)) in hits.iter().enumerate() {
            sel[i * t + tok] = 1.0;
            wt[tok * n + i] = w;
        }
        let sel = be.upload(&Tensor::new(&[n, t], sel)?)?;
        let wt = be.upload(&Tensor::new(&[t, n], wt)?)?;
        let xe = be.matmul(&sel, x, MatmulSpec::NN)?;
        let y = expert_mlp(be, &xe, ex, e, spec.act)?;
        be.matmul_acc(&mut out, &wt, &y, MatmulSpec::NN)?;
    }
    Ok(out)
}

/// Expert `e`'s gated MLP of its tokens `xe (n, D)` -> `(n, D)`: `down(act(gate(x), up(x)))`,
/// each product with its bias where the experts have them.
pub fn expert_mlp<B: Backend + ?Sized>(
    be: &B,
    xe: &Tensor,
    ex: &Experts,
    e: usize,
    act: GateAct,
) -> Result<Tensor> {
    let [g, u, dn] = ex.expert(e);
    match ex.biases(e) {
        None => {
            let h = be.linear_gated(xe, g, u, act)?;
            be.linear(&h, dn, None)
        }
        Some([bg, bu, bd]) => {
            let gx = be.linear(xe, g, Some(bg))?;
            let ux = be.linear(xe, u, Some(bu))?;
            let h = be.gated_act(&gx, &ux, act)?;
            be.linear(&h, dn, Some(bd))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(k: usize, renormalize: bool) -> MoeSpec<'static> {
        MoeSpec {
            top_k: k,
            renormalize,
            expert_scale: None,
            act: GateAct::Silu,
        }
    }

    #[test]
    fn route_picks_the_largest_and_renormalises() {
        let logits = [0.0, 2.0, 1.0, -1.0, /* token 1 */ 3.0, 3.0, 0.0, 0.0];
        let r = route(&logits, 4, &spec(2, false)).unwrap();
        assert_eq!(r.experts, vec![1, 2, 0, 1], "ties go to the lower index");
        let z: f32 = [0.0f32, 2.0, 1.0, -1.0]
            .iter()
            .map(|l| (l - 2.0).exp())
            .sum();
        assert!((r.weights[0] - 1.0 / z).abs() < 1e-6);
        let r = route(&logits, 4, &spec(2, true)).unwrap();
        assert!((r.weights[0] + r.weights[1] - 1.0).abs() < 1e-6);
        assert!((r.weights[2] - 0.5).abs() < 1e-6 && (r.weights[3] - 0.5).abs() < 1e-6);
        let scale = [1.0, 2.0, 3.0, 4.0];
        let s = MoeSpec {
            expert_scale: Some(&scale),
            ..spec(2, true)
        };
        let r2 = route(&logits, 4, &s).unwrap();
        assert!((r2.weights[0] - 2.0 * r.weights[0]).abs() < 1e-6);
        assert_eq!(
            r.by_expert(4)[1],
            vec![(0, r.weights[0]), (1, r.weights[3])]
        );
    }

    #[test]
    fn route_edge_cases() {
        // k = E: every expert, weights summing to 1 before any renormalisation.
        let r = route(&[0.1, 0.2, 0.3], 3, &spec(3, false)).unwrap();
        assert_eq!(r.experts, vec![2, 1, 0]);
        assert!((r.weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        // k = 1
        let r = route(&[5.0, -5.0], 2, &spec(1, true)).unwrap();
        assert_eq!((r.experts[0], r.weights[0]), (0, 1.0));
        // A NaN logit is never preferred to a number.
        let r = route(&[f32::NAN, 1.0, 0.0], 3, &spec(1, false)).unwrap();
        assert_ne!(r.experts[0], 0);
        for (l, e, k) in [(3, 3, 0), (3, 3, 4), (4, 3, 1), (0, 0, 1)] {
            assert!(route(&vec![0.0; l], e, &spec(k, false)).is_err());
        }
    }

    #[test]
    fn experts_check_their_shapes_and_view_rows() {
        let (e, f, d) = (3, 2, 4);
        let vals = |n: usize, off: f32| (0..n).map(|i| i as f32 + off).collect::<Vec<_>>();
        let g = QTensor::from_f32("g", e * f, d, &vals(e * f * d, 0.0)).unwrap();
        let u = QTensor::from_f32("u", e * f, d, &vals(e * f * d, 100.0)).unwrap();
        let dn = QTensor::from_f32("dn", e * d, f, &vals(e * d * f, 200.0)).unwrap();
        let ex = Experts::from_stacked(e, g.clone(), u.clone(), dn.clone()).unwrap();
        assert_eq!((ex.n_experts(), ex.width(), ex.hidden()), (3, 2, 4));
        let mut row = vec![0f32; d];
        ex.expert(2)[0].dequantize_row(1, &mut row).unwrap();
        assert_eq!(row, vals(e * f * d, 0.0)[(2 * f + 1) * d..(2 * f + 2) * d]);
        ex.expert(1)[2].dequantize_row(0, &mut row[..f]).unwrap();
        assert_eq!(row[..f], vals(e * d * f, 200.0)[d * f..d * f + f]);
        assert!(Experts::from_stacked(4, g.clone(), u.clone(), dn.clone()).is_err());
        assert!(Experts::from_stacked(e, g.clone(), u, g).is_err());
        assert!(Experts::from_parts(vec![]).is_err());
    }
}
