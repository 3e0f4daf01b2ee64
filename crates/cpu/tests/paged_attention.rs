//! The paged KV cache's host twin against the contiguous cache's reference attention: several
//! sequences of different lengths whose blocks are scattered over one pool (tables taken from
//! `hf2q_tensor::paged`'s pool after other sequences came and went), decode rows and prefill
//! chunk rows mixed in one call (through the dense kernels and the plain loop), padding rows,
//! GQA ratios, sliding windows, f16 and f32 pools.

use hf2q_cpu::paged::{attention, paged_attention};
use hf2q_cpu::CpuBackend;
use hf2q_tensor::op::{AttentionParams, LayerCache};
use hf2q_tensor::paged::{
    BlockPool, BlockTable, HostPagedLayer, PagedElem, PagedLayout, PagedRows,
};
use hf2q_tensor::Tensor;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn f(&mut self) -> f32 {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f()).collect()
    }
}

struct Case {
    h: usize,
    hkv: usize,
    dh: usize,
    block: usize,
    /// Tokens in each sequence's cache.
    lens: &'static [usize],
    window: Option<usize>,
    /// Attention sinks (GPT-OSS), one per head.
    sinks: bool,
}

fn run<T: PagedElem + hf2q_cpu::KvRead>(c: &Case, rng: &mut Rng) {
    let width = c.hkv * c.dh;
    let n_blocks = c.lens.iter().map(|l| l.div_ceil(c.block)).sum::<usize>() + 3;
    let layout = PagedLayout {
        n_blocks,
        n_kv_heads: c.hkv,
        block_tokens: c.block,
        head_dim: c.dh,
    };
    let mut pool = BlockPool::new(n_blocks, c.block).unwrap();
    // Sequences grow a block at a time in turn, as decoding ones do, so their blocks interleave.
    let mut tables = vec![BlockTable::new(); c.lens.len()];
    let longest = *c.lens.iter().max().unwrap();
    for t in (c.block..longest + c.block).step_by(c.block) {
        for (tab, &len) in tables.iter_mut().zip(c.lens) {
            tab.reserve(&mut pool, t.min(len)).unwrap();
        }
    }
    let max_blocks = longest.div_ceil(c.block) + 1;
    let mut flat = vec![0i32; tables.len() * max_blocks];
    for (s, tab) in tables.iter().enumerate() {
        tab.write_row(&mut flat[s * max_blocks..][..max_blocks])
            .unwrap();
    }
    // Every sequence's keys and values, written through its slots.
    let mut layer = HostPagedLayer::<T>::new(layout);
    let mut seq_kv = Vec::new();
    for (tab, &len) in tables.iter().zip(c.lens) {
        let (k, v) = (rng.vec(len * width), rng.vec(len * width));
        let slots: Vec<i32> = (0..len)
            .map(|p| layout.slot(tab.blocks(), p).unwrap() as i32)
            .collect();
        layer.write(&k, &v, &slots).unwrap();
        seq_kv.push((k, v));
    }
    // Rows: each sequence's last position (decode), the last five positions of the first
    // (a prefill chunk), a padding row.
    let (mut seq, mut pos) = (Vec::new(), Vec::new());
    for (s, &len) in c.lens.iter().enumerate() {
        seq.push(s as i32);
        pos.push(len as i32 - 1);
    }
    for p in c.lens[0].saturating_sub(5)..c.lens[0] {
        seq.push(0);
        pos.push(p as i32);
    }
    seq.push(0);
    pos.push(-1);
    let rows = PagedRows {
        seq: &seq,
        pos: &pos,
        tables: &flat,
        max_blocks,
    };
    let p = AttentionParams {
        n_heads: c.h,
        n_kv_heads: c.hkv,
        head_dim: c.dh,
        scale: 1.0 / (c.dh as f32).sqrt(),
        window: c.window,
        sinks: c.sinks.then(|| {
            rng.vec(c.h)
                .iter()
                .map(|x| 4.0 * x)
                .collect::<Vec<_>>()
                .into()
        }),
    };
    let q = rng.vec(pos.len() * c.h * c.dh);
    let got = attention(&layer, &q, &rows, &p).unwrap();
    // The plain loop (the fallback for rows in no consecutive run) agrees with the dense kernels:
    // the same f32 arithmetic in another order, with the kernels' polynomial exp (relative error
    // ~1e-7), over values |v| <= 1: a few ulps, well under 1e-5.
    let plain = paged_attention(&q, &layer.k, &layer.v, &layout, &rows, &p).unwrap();
    let gap = got
        .iter()
        .zip(&plain)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        gap <= 1e-5,
        "dense kernels vs the plain loop: max |err| {gap}"
    );

    // Reference: the contiguous `(Hkv, S, Dh)` cache of the row's sequence, its values rounded
    // as the pool stored them, one query at a time.
    let round = |x: f32| T::from_f32(x).to_f32();
    let qw = c.h * c.dh;
    for (r, (&s, &ps)) in seq.iter().zip(&pos).enumerate() {
        let grow = &got[r * qw..][..qw];
        if ps < 0 {
            assert!(grow.iter().all(|&x| x == 0.0), "padding row {r} is zeros");
            continue;
        }
        let (k, v) = &seq_kv[s as usize];
        let cap = c.lens[s as usize];
        let plane = |x: &[f32]| {
            let mut o = vec![0.0f32; c.hkv * cap * c.dh];
            for t in 0..cap {
                for hh in 0..c.hkv {
                    for d in 0..c.dh {
                        o[(hh * cap + t) * c.dh + d] = round(x[t * width + hh * c.dh + d]);
                    }
                }
            }
            o
        };
        let (kc, vc) = (plane(k), plane(v));
        let lc = LayerCache {
            k: &kc,
            v: &vc,
            capacity: cap,
            centre: None,
        };
        let qt = Tensor::new(&[1, qw], q[r * qw..][..qw].to_vec()).unwrap();
        let want = CpuBackend::REFERENCE
            .attention_reference(&qt, &lc, ps as usize, &p)
            .unwrap();
        // Same f32 arithmetic in another summation order: a few ulps of values |v| <= 1.
        let err = grow
            .iter()
            .zip(want.data())
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            err <= 1e-5,
            "row {r} (seq {s} pos {ps}) H={} Hkv={} Dh={} B={} window={:?}: max |err| {err}",
            c.h,
            c.hkv,
            c.dh,
            c.block,
            c.window
        );
    }
}

const CASES: &[Case] = &[
    Case {
        h: 4,
        hkv: 4,
        dh: 64,
        block: 16,
        lens: &[1, 17, 40],
        window: None,
        sinks: false,
    },
    Case {
        h: 8,
        hkv: 2,
        dh: 128,
        block: 16,
        lens: &[100, 3, 64, 65],
        window: None,
        sinks: true,
    },
    Case {
        h: 6,
        hkv: 1,
        dh: 32,
        block: 8,
        lens: &[50, 9],
        window: Some(12),
        sinks: true,
    },
    Case {
        h: 16,
        hkv: 8,
        dh: 80,
        block: 32,
        lens: &[33, 200],
        window: Some(40),
        sinks: false,
    },
];

#[test]
fn paged_attention_equals_contiguous_attention_f32() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for c in CASES {
        run::<f32>(c, &mut rng);
    }
}

#[test]
fn paged_attention_equals_contiguous_attention_f16() {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    for c in CASES {
        run::<half::f16>(c, &mut rng);
    }
}

#[test]
fn bad_rows_are_refused_not_read() {
    let layout = PagedLayout {
        n_blocks: 2,
        n_kv_heads: 1,
        block_tokens: 4,
        head_dim: 8,
    };
    let layer = HostPagedLayer::<f32>::new(layout);
    let p = AttentionParams {
        n_heads: 1,
        n_kv_heads: 1,
        head_dim: 8,
        scale: 1.0,
        window: None,
        sinks: None,
    };
    let q = vec![0.5f32; 8];
    let rows = |pos: &'static [i32], tables: &'static [i32]| PagedRows {
        seq: &[0],
        pos,
        tables,
        max_blocks: 2,
    };
    // Position 8 needs a third block; block 7 is outside the pool of 2.
    for (pos, tables, says) in [
        (&[8][..], &[0, 1][..], "needs 3 blocks"),
        (&[5][..], &[0, 7][..], "outside the pool"),
    ] {
        let err = attention(&layer, &q, &rows(pos, tables), &p).unwrap_err();
        assert!(err.to_string().contains(says), "{err}");
    }
    let mut w = HostPagedLayer::<f32>::new(layout);
    let err = w.write(&q, &q, &[8]).unwrap_err();
    assert!(err.to_string().contains("past the pool"), "{err}");
}
