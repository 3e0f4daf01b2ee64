//! Mixed precision by measured sensitivity (`hf2q quantize --target-bpw B --calib TEXT`).
//!
//! 1. **Groups.** The quantizable weights are grouped: the embeddings (with the output matrix
//!    when it is tied), the output matrix, and per layer its attention matrices (q, k, v, o)
//!    and its MLP matrices (gate, up, down).
//! 2. **Ladder.** Every group can sit at one level of Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_0; a
//!    tensor whose rows do not split into that type's blocks takes llama.cpp's fallback type
//!    (so SmolLM2's 576-wide matrices climb Q4_0, Q5_0, Q5_1, Q8_0).
//! 3. **Measure.** For each group, a model is written with only that group quantized
//!    (everything else as stored in the source), run teacher-forced over the calibration tokens,
//!    and the mean KL(source || variant) per token is recorded. By default one level is measured
//!    per group (its cheapest, where the signal is largest) and the other levels' KL is scaled
//!    from it by the group's weight quantization error (KL of a small perturbation grows with
//!    its square, which the summed squared error tracks); `exhaustive` measures every level.
//! 4. **Spend.** Starting from the floors (embeddings, output, first and last layer at Q3_K or
//!    better: llama.cpp's presets protect them too), the budget `B x parameters / 8` bytes is
//!    spent greedily on the upgrade that removes the most measured KL per byte, until no upgrade
//!    fits. KL is treated as additive over groups (a first-order approximation that holds for
//!    small perturbations).
//!
//! The result is a per-tensor GGUF plan and an allocation table. Measuring costs one forward per
//! (group, level): minutes on a small model, so keep the calibration text short (a few hundred
//! tokens).

use std::path::Path;

use hf2q_tensor::GgmlType;

use super::rules::{allows_quantization, fallback_type};
use super::{gguf_tensor_order, plan_gguf_keep};
use crate::convert::gguf_out::{metadata_from_gguf, quantize_rows, write_gguf, GgufPlanEntry};
use crate::convert::source::{dequantize_rows, Layout, SourceModel};
use crate::convert::{gguf_meta, NoProgress, Progress};
use crate::{Error, Model, Result};

/// The types a group climbs through, cheapest first.
pub const LADDER: [GgmlType; 6] = [
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_0,
];

/// Index of Q3_K in [`LADDER`]: the floor of protected groups (no 2-bit embeddings, output, or
/// first or last layer). A higher floor (Q4_K) costs too much where the embeddings are a large
/// share of the model: on SmolLM2-135M (embeddings 21% of the weights) a Q4_K-level floor at
/// 4.5 bits per weight left only Q2_K for the MLP down projections and measured worse.
const FLOOR_PROTECTED: usize = 1;

#[derive(Clone, Debug)]
pub struct MixedOptions {
    /// Bits per weight over every tensor (what llama.cpp prints as BPW).
    pub target_bpw: f64,
    /// Calibration tokens (one sequence, teacher-forced).
    pub calib: Vec<u32>,
    /// Folder for the temporary measurement models.
    pub scratch: std::path::PathBuf,
    /// Measure every (group, level) instead of one level per group.
    pub exhaustive: bool,
}

/// One group's outcome.
#[derive(Clone, Debug)]
pub struct GroupAllocation {
    pub name: String,
    /// Types of the group's tensors at the chosen level (distinct, in tensor order).
    pub types: Vec<GgmlType>,
    pub level: usize,
    /// Measured KL with only this group quantized at the chosen level.
    pub kl: f64,
    pub bytes: u64,
}

#[derive(Clone, Debug)]
pub struct Allocation {
    pub groups: Vec<GroupAllocation>,
    pub bits_per_weight: f64,
    /// Sum of the groups' measured KL: the first-order estimate of the whole model's KL.
    pub estimated_kl: f64,
}

struct Group {
    name: String,
    /// Indices into `src.tensors`.
    members: Vec<usize>,
    floor: usize,
    /// Per level: resolved types per member, bytes, measured KL.
    types: Vec<Vec<GgmlType>>,
    bytes: Vec<u64>,
    kl: Vec<f64>,
    /// Summed squared quantization error of the group's weights, per level.
    sse: Vec<f64>,
}

fn group_of(name: &str, n_layers: usize, tied: bool) -> Option<(String, bool)> {
    if name == "token_embd.weight" {
        return Some(("token_embd".into(), true));
    }
    if name == "output.weight" {
        return Some(("output".into(), !tied));
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let l: usize = layer.parse().ok()?;
    let kind = if part.starts_with("attn") {
        "attn"
    } else if part.starts_with("ffn") {
        "ffn"
    } else {
        return None;
    };
    Some((format!("blk.{l}.{kind}"), l == 0 || l + 1 == n_layers))
}

/// Mean KL(p || q) per row of two (T, V) logit matrices.
fn mean_kl(p: &[f32], q: &[f32], v: usize) -> f64 {
    let lsm = |r: &[f32]| -> Vec<f64> {
        let m = r.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let z = r.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m;
        r.iter().map(|&x| x as f64 - z).collect()
    };
    let n = p.len() / v;
    let mut s = 0.0;
    for (a, b) in p.chunks(v).zip(q.chunks(v)) {
        let (la, lb) = (lsm(a), lsm(b));
        s += la
            .iter()
            .zip(&lb)
            .map(|(x, y)| x.exp() * (x - y))
            .sum::<f64>()
            .max(0.0);
    }
    s / n as f64
}

fn logits(path: &Path, ids: &[u32]) -> Result<Vec<f32>> {
    let m = Model::load(path)?;
    Ok(m.session(ids.len()).forward_all(ids)?.into_data())
}

/// Measures every group's sensitivity and chooses a level per group within the budget.
pub fn plan_mixed(
    src: &SourceModel,
    opts: &MixedOptions,
    progress: &dyn Progress,
) -> Result<(Vec<GgufPlanEntry>, Allocation)> {
    if opts.calib.len() < 2 {
        return Err(Error::Msg(
            "mixed precision needs at least 2 calibration tokens".into(),
        ));
    }
    let base_plan = plan_gguf_keep(src);
    let tied = src.tensor_by_gguf("output.weight").is_none();
    let mut groups: Vec<Group> = Vec::new();
    for &i in &gguf_tensor_order(src) {
        let t = &src.tensors[i];
        if !allows_quantization(&t.gguf, t.shape.len()) {
            continue;
        }
        let Some((name, protected)) = group_of(&t.gguf, src.config.n_layers, tied) else {
            continue;
        };
        let floor = if protected { FLOOR_PROTECTED } else { 0 };
        match groups.iter_mut().find(|g| g.name == name) {
            Some(g) => g.members.push(i),
            None => groups.push(Group {
                name,
                members: vec![i],
                floor,
                types: Vec::new(),
                bytes: Vec::new(),
                kl: Vec::new(),
                sse: Vec::new(),
            }),
        }
    }
    for g in &mut groups {
        for ty in LADDER {
            let mut types = Vec::new();
            let mut bytes = 0u64;
            for &i in &g.members {
                let t = &src.tensors[i];
                let r = fallback_type(&t.gguf, t.cols(), ty)?;
                bytes += (r.row_bytes(t.cols()).unwrap_or(0) * t.rows()) as u64;
                types.push(r);
            }
            g.types.push(types);
            g.bytes.push(bytes);
        }
    }
    // Bytes that no choice changes (norms, biases, unquantizable tensors).
    let in_group = |i: usize| groups.iter().any(|g| g.members.contains(&i));
    let fixed: u64 = base_plan
        .iter()
        .filter(|e| !in_group(e.src))
        .map(|e| {
            let t = &src.tensors[e.src];
            (e.to.row_bytes(t.cols()).unwrap_or(0) * t.rows()) as u64
        })
        .sum();
    let n_params: u64 = src.tensors.iter().map(|t| t.numel() as u64).sum();
    let budget = (opts.target_bpw * n_params as f64 / 8.0) as u64;
    let floor_bytes: u64 = fixed + groups.iter().map(|g| g.bytes[g.floor]).sum::<u64>();
    if floor_bytes > budget {
        return Err(Error::Msg(format!(
            "--target-bpw {} is below what this model can reach with its floors (embeddings, output, first and last layer at Q3_K or its fallback): {:.3} bits per weight",
            opts.target_bpw,
            floor_bytes as f64 * 8.0 / n_params as f64
        )));
    }

    // Weight-space error of every group at every level (cheap: no forward pass).
    if !opts.exhaustive {
        for g in &mut groups {
            let xs: Vec<Vec<f32>> = g
                .members
                .iter()
                .map(|&i| src.read_f32(&src.tensors[i], Layout::Gguf))
                .collect::<Result<_>>()?;
            for l in 0..LADDER.len() {
                if l > 0 && g.types[l] == g.types[l - 1] {
                    let e = g.sse[l - 1];
                    g.sse.push(e);
                    continue;
                }
                let mut sse = 0f64;
                for ((x, &i), &ty) in xs.iter().zip(&g.members).zip(&g.types[l]) {
                    let cols = src.tensors[i].cols();
                    let q = quantize_rows(ty, x, cols, None, &src.tensors[i].gguf)?;
                    let y = dequantize_rows(ty, &q, x.len() / cols, cols, &src.tensors[i].gguf)?;
                    sse += x
                        .iter()
                        .zip(&y)
                        .map(|(a, b)| ((a - b) as f64).powi(2))
                        .sum::<f64>();
                }
                g.sse.push(sse);
            }
        }
    }

    // Measure.
    let metadata = match src.gguf_file() {
        Some(f) => metadata_from_gguf(f, 15),
        None => gguf_meta::metadata_from_hf(src, 15)?,
    };
    std::fs::create_dir_all(&opts.scratch).map_err(|e| Error::Io {
        path: opts.scratch.clone(),
        source: e,
    })?;
    let base = logits(&src.path, &opts.calib)?;
    let v = base.len() / opts.calib.len();
    let distinct = |g: &Group, l: usize| l == 0 || g.types[l] != g.types[l - 1];
    let total: usize = if opts.exhaustive {
        groups
            .iter()
            .map(|g| (0..LADDER.len()).filter(|&l| distinct(g, l)).count())
            .sum()
    } else {
        groups.len()
    };
    progress.start(total);
    let variant = opts.scratch.join("measure.gguf");
    let mut done = 0;
    for g in &mut groups {
        #[allow(clippy::needless_range_loop)] // l indexes several per-level vectors
        for l in 0..LADDER.len() {
            if !distinct(g, l) {
                let k = g.kl[l - 1];
                g.kl.push(k);
                continue;
            }
            if !opts.exhaustive && l > 0 {
                // Scaled from the measured cheapest level by the squared weight error.
                let k = if g.sse[0] > 0.0 {
                    g.kl[0] * g.sse[l] / g.sse[0]
                } else {
                    0.0
                };
                g.kl.push(k);
                continue;
            }
            let mut plan = base_plan.clone();
            for (&m, &ty) in g.members.iter().zip(&g.types[l]) {
                if let Some(e) = plan.iter_mut().find(|e| e.src == m) {
                    e.to = ty;
                }
            }
            write_gguf(src, &variant, metadata.clone(), &plan, None, &NoProgress)?;
            let q = logits(&variant, &opts.calib)?;
            g.kl.push(mean_kl(&base, &q, v));
            done += 1;
            progress.tensor(
                done,
                &g.name,
                &src.tensors[g.members[0]].stored.name(),
                &format!("{} (KL {:.5})", LADDER[l], g.kl[l]),
            );
        }
    }
    let _ = std::fs::remove_file(&variant);
    progress.finish();

    // Spend the budget.
    let mut level: Vec<usize> = groups.iter().map(|g| g.floor).collect();
    let mut used = floor_bytes;
    loop {
        let mut best: Option<(usize, usize, f64)> = None;
        for (gi, g) in groups.iter().enumerate() {
            let cur = level[gi];
            // The next level that costs more bytes (equal-byte levels are the same types).
            let Some(next) = (cur + 1..LADDER.len()).find(|&l| g.bytes[l] > g.bytes[cur]) else {
                continue;
            };
            let cost = g.bytes[next] - g.bytes[cur];
            if used + cost > budget {
                continue;
            }
            let gain = g.kl[cur] - g.kl[next];
            let ratio = gain / cost as f64;
            if gain > 0.0 && best.is_none_or(|b| ratio > b.2) {
                best = Some((gi, next, ratio));
            }
        }
        let Some((gi, next, _)) = best else { break };
        used += groups[gi].bytes[next] - groups[gi].bytes[level[gi]];
        level[gi] = next;
    }

    let mut plan = base_plan;
    let mut out = Vec::new();
    for (g, &l) in groups.iter().zip(&level) {
        for (&m, &ty) in g.members.iter().zip(&g.types[l]) {
            if let Some(e) = plan.iter_mut().find(|e| e.src == m) {
                e.to = ty;
            }
        }
        let mut types = g.types[l].clone();
        types.dedup();
        out.push(GroupAllocation {
            name: g.name.clone(),
            types,
            level: l,
            kl: g.kl[l],
            bytes: g.bytes[l],
        });
    }
    let estimated_kl = out.iter().map(|g| g.kl).sum();
    Ok((
        plan,
        Allocation {
            groups: out,
            bits_per_weight: used as f64 * 8.0 / n_params as f64,
            estimated_kl,
        },
    ))
}

/// Writes a mixed-precision GGUF: [`plan_mixed`], then the file (its `general.file_type` is the
/// llama.cpp preset whose base type most weights got).
pub fn quantize_mixed(
    src: &SourceModel,
    out: &Path,
    opts: &MixedOptions,
    progress: &dyn Progress,
) -> Result<(crate::convert::gguf_out::WriteReport, Allocation)> {
    let (plan, alloc) = plan_mixed(src, opts, progress)?;
    let file_type = super::file_type_of_plan(src, &plan);
    let metadata = match src.gguf_file() {
        Some(f) => metadata_from_gguf(f, file_type),
        None => gguf_meta::metadata_from_hf(src, file_type)?,
    };
    let report = write_gguf(src, out, metadata, &plan, None, progress)?;
    Ok((report, alloc))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_and_floors() {
        assert_eq!(
            group_of("token_embd.weight", 30, true),
            Some(("token_embd".into(), true))
        );
        assert_eq!(
            group_of("blk.0.attn_q.weight", 30, true),
            Some(("blk.0.attn".into(), true))
        );
        assert_eq!(
            group_of("blk.7.ffn_down.weight", 30, true),
            Some(("blk.7.ffn".into(), false))
        );
        assert_eq!(
            group_of("blk.29.ffn_up.weight", 30, true),
            Some(("blk.29.ffn".into(), true))
        );
        assert_eq!(
            group_of("blk.3.attn_norm.weight", 30, true).map(|g| g.0),
            Some("blk.3.attn".into())
        );
        assert_eq!(group_of("rope_freqs.weight", 30, true), None);
    }

    #[test]
    fn kl_is_zero_for_equal_logits_and_positive_otherwise() {
        let p = [1.0f32, 2.0, 3.0, 0.5, 0.5, 0.5];
        assert!(mean_kl(&p, &p, 3).abs() < 1e-12);
        let q = [3.0f32, 2.0, 1.0, 0.5, 0.5, 0.5];
        assert!(mean_kl(&p, &q, 3) > 0.1);
    }
}
