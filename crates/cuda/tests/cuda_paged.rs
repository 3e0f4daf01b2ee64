//! The device's paged KV cache (`hf2q_cuda::paged`) against its host twin (`hf2q_cpu::paged`):
//! writes at slots land exactly where the twin puts them (f16 rounding included), and one
//! attention launch over a batch of rows (decode rows of many sequences, a prefill chunk's rows,
//! padding rows; blocks scattered over the pool by interleaved growth) equals the twin's
//! attention over the same pool values. Without a GPU each test prints "skipped: no CUDA device"
//! and passes.
//!
//! `bench_paged_decode` (`--ignored`) times one paged launch for a batch of decode rows against
//! one contiguous-cache launch per sequence (the eager batched step today).

use std::sync::Arc;

use hf2q_cpu::paged::paged_attention;
use hf2q_cuda::{CudaDev, DevicePagedLayer, DevicePagedRows, KvDtype};
use hf2q_tensor::op::{AttentionParams, RopeParams, RopeStyle};
use hf2q_tensor::paged::{BlockPool, BlockTable, HostPagedLayer, PagedLayout, PagedRows};

/// The device with the default options (these kernels have no switches; kernels compiled on
/// open, no cache).
fn device() -> Option<Arc<CudaDev>> {
    match CudaDev::open(0, &hf2q_cuda::CudaOptions::default()) {
        Ok(Some(d)) => Some(d),
        Ok(None) => {
            println!("skipped: no CUDA device");
            None
        }
        Err(e) => panic!("a CUDA device is present but could not be opened: {e}"),
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| ((self.next() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32 * scale)
            .collect()
    }
}

/// A batch over one pool: tables of sequences of `lens` tokens grown a block at a time in turn.
struct Batch {
    layout: PagedLayout,
    tables: Vec<BlockTable>,
    flat: Vec<i32>,
    max_blocks: usize,
}

fn batch(lens: &[usize], hkv: usize, dh: usize, block: usize) -> Batch {
    let n_blocks = lens.iter().map(|l| l.div_ceil(block)).sum::<usize>() + 2;
    let mut pool = BlockPool::new(n_blocks, block).unwrap();
    let mut tables = vec![BlockTable::new(); lens.len()];
    let longest = *lens.iter().max().unwrap();
    for t in (block..longest + block).step_by(block) {
        for (tab, &len) in tables.iter_mut().zip(lens) {
            tab.reserve(&mut pool, t.min(len)).unwrap();
        }
    }
    let max_blocks = longest.div_ceil(block) + 1;
    let mut flat = vec![0i32; tables.len() * max_blocks];
    for (s, tab) in tables.iter().enumerate() {
        tab.write_row(&mut flat[s * max_blocks..][..max_blocks])
            .unwrap();
    }
    Batch {
        layout: PagedLayout {
            n_blocks,
            n_kv_heads: hkv,
            block_tokens: block,
            head_dim: dh,
        },
        tables,
        flat,
        max_blocks,
    }
}

struct Case {
    h: usize,
    hkv: usize,
    dh: usize,
    block: usize,
    lens: &'static [usize],
    /// Rows of a prefill chunk at the end of the first sequence.
    chunk: usize,
    window: Option<usize>,
    dtype: KvDtype,
}

/// A layer of `dtype` over `b`'s pool holding random keys and values for every position of each
/// sequence of `lens`, written by one launch (all rows at once, and one padding row whose slot
/// -1 writes nothing); with the rows written: `(layer, keys, values, slots)`.
fn fill(
    dev: &CudaDev,
    rng: &mut Rng,
    b: &Batch,
    lens: &[usize],
    dtype: KvDtype,
) -> (DevicePagedLayer, Vec<f32>, Vec<f32>, Vec<i32>) {
    let width = b.layout.n_kv_heads * b.layout.head_dim;
    let (mut k, mut v, mut slots) = (Vec::new(), Vec::new(), Vec::new());
    for (tab, &len) in b.tables.iter().zip(lens) {
        k.extend(rng.vec(len * width, 1.0));
        v.extend(rng.vec(len * width, 1.0));
        slots.extend((0..len).map(|p| b.layout.slot(tab.blocks(), p).unwrap() as i32));
    }
    k.extend(rng.vec(width, 1.0));
    v.extend(rng.vec(width, 1.0));
    slots.push(-1);
    let mut layer = dev.alloc_paged_layer(b.layout, dtype).unwrap();
    let (kd, vd, sd) = (
        dev.upload(&k).unwrap(),
        dev.upload(&v).unwrap(),
        dev.upload(&slots).unwrap(),
    );
    dev.paged_kv_write(&mut layer, &kd, &vd, slots.len(), &sd)
        .unwrap();
    (layer, k, v, slots)
}

fn run(dev: &CudaDev, rng: &mut Rng, c: &Case) {
    let b = batch(c.lens, c.hkv, c.dh, c.block);
    let (layer, k, v, slots) = fill(dev, rng, &b, c.lens, c.dtype);
    let (kc, vc) = layer.to_host(dev).unwrap();
    // The host twin given the same rows holds the same values, bit for bit.
    let (tk, tv) = match c.dtype {
        KvDtype::F16 => {
            let mut t = HostPagedLayer::<half::f16>::new(b.layout);
            t.write(&k, &v, &slots).unwrap();
            let f = |x: &[half::f16]| x.iter().map(|h| h.to_f32()).collect::<Vec<_>>();
            (f(&t.k), f(&t.v))
        }
        KvDtype::F32 => {
            let mut t = HostPagedLayer::<f32>::new(b.layout);
            t.write(&k, &v, &slots).unwrap();
            (t.k, t.v)
        }
    };
    assert!(
        kc == tk && vc == tv,
        "paged writes differ from the host twin"
    );

    // Rows: each sequence's last position, a prefill chunk of the first, two padding rows.
    let (mut seq, mut pos) = (Vec::new(), Vec::new());
    for (s, &len) in c.lens.iter().enumerate() {
        seq.push(s as i32);
        pos.push(len as i32 - 1);
        if s == 0 {
            seq.push(0);
            pos.push(-1);
        }
    }
    for p in c.lens[0].saturating_sub(c.chunk)..c.lens[0] {
        seq.push(0);
        pos.push(p as i32);
    }
    seq.push(1 % c.lens.len() as i32);
    pos.push(-1);
    let r = pos.len();
    let p = AttentionParams {
        n_heads: c.h,
        n_kv_heads: c.hkv,
        head_dim: c.dh,
        scale: 1.0 / (c.dh as f32).sqrt(),
        window: c.window,
        sinks: None,
    };
    let q = rng.vec(r * c.h * c.dh, 2.0);
    let rows = PagedRows {
        seq: &seq,
        pos: &pos,
        tables: &b.flat,
        max_blocks: b.max_blocks,
    };
    let want = paged_attention(&q, &kc, &vc, &b.layout, &rows, &p).unwrap();

    let (seq_d, pos_d, tab_d) = (
        dev.upload(&seq).unwrap(),
        dev.upload(&pos).unwrap(),
        dev.upload(&b.flat).unwrap(),
    );
    let max_len = b.max_blocks * c.block;
    let drows = DevicePagedRows {
        seq: &seq_d,
        pos: &pos_d,
        tables: &tab_d,
        rows: r,
        max_blocks: b.max_blocks,
        max_len,
    };
    let n = dev.paged_attention_scratch_len(&p, r, max_len).unwrap();
    let mut scratch = dev.upload(&vec![f32::NAN; n.max(1)]).unwrap();
    let mut out = dev.upload(&vec![f32::NAN; r * c.h * c.dh]).unwrap();
    let qd = dev.upload(&q).unwrap();
    dev.paged_attention(&qd, &layer, &drows, &p, &mut scratch, &mut out, None)
        .unwrap();
    let got = dev.download(&out).unwrap();
    // Outputs are convex combinations of |v| <= 1: f32 softmax and sums in another order (split
    // partials, online rescaling) stay within a few 1e-6; 2e-5 leaves room for long rows (the
    // same bound as the contiguous cache's attention test).
    let err = max_diff(&got, &want);
    println!(
        "paged attention H={} Hkv={} Dh={} B={} lens={:?} rows={r} window={:?} {:?}: max |err| {err:.2e}",
        c.h, c.hkv, c.dh, c.block, c.lens, c.window, c.dtype
    );
    assert!(err <= 2e-5, "max |err| {err}");
}

#[test]
fn paged_write_and_attention_equal_the_host_twin() {
    let Some(dev) = device() else { return };
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let f16 = KvDtype::F16;
    let f32 = KvDtype::F32;
    let cases = [
        // Llama-3.2-1B's heads; decode rows of many lengths.
        (
            32,
            8,
            64,
            16,
            &[1usize, 17, 300, 64, 65, 1000][..],
            0,
            None,
            f16,
        ),
        // Qwen2.5's ratio, a prefill chunk among the decode rows.
        (14, 2, 64, 16, &[200, 5, 48][..], 37, None, f16),
        (8, 8, 128, 32, &[129, 700][..], 20, Some(100), f32),
        (16, 4, 256, 16, &[90, 3000][..], 8, Some(512), f16),
        // Gemma 4's widest heads (16 dims per lane, four heads per block).
        (8, 2, 512, 16, &[33, 260][..], 4, None, f16),
        (4, 1, 80, 8, &[7, 9, 11][..], 7, Some(3), f32),
    ];
    for (h, hkv, dh, block, lens, chunk, window, dtype) in cases {
        run(
            &dev,
            &mut rng,
            &Case {
                h,
                hkv,
                dh,
                block,
                lens,
                chunk,
                window,
                dtype,
            },
        );
    }
}

/// A step's prefill runs on tensor cores (`prefill_tiles` + `paged_prefill_tc`) with the other
/// rows through the row kernel, as `backend_paged` runs them, against the host twin over the
/// same pool: runs longer than one 64-row tile, a run from position 0, a two-row run, decode
/// rows and a padding row in one batch; windows; both head widths the kernel has.
#[test]
fn paged_prefill_on_tensor_cores_equals_the_host_twin() {
    let Some(dev) = device() else { return };
    let mut rng = Rng(0x0bad_cafe_1234_5678);
    // (H, Hkv, Dh, B, lengths, rows as (sequence, first position, rows), window)
    type Rows = &'static [(usize, usize, usize)];
    let cases: [(usize, usize, usize, usize, &[usize], Rows, Option<usize>); 3] = [
        // Llama-3.2-1B's heads: a 150-row chunk deep in a long prompt (three tiles), a decode
        // row, a first chunk of 5, and a chunk of 2 beside them.
        (
            32,
            8,
            64,
            16,
            &[1000, 70, 5, 40],
            &[(1, 69, 1), (0, 850, 150), (2, 0, 5), (3, 38, 2)],
            None,
        ),
        // Qwen2.5's ratio with a window narrower than the chunk.
        (
            14,
            2,
            64,
            16,
            &[300, 90],
            &[(0, 200, 100), (1, 89, 1)],
            Some(40),
        ),
        // Dh 128, blocks of 32, a chunk from position 0 and one under a window.
        (
            16,
            4,
            128,
            32,
            &[129, 300],
            &[(0, 0, 129), (1, 290, 10)],
            Some(100),
        ),
    ];
    // Every other case with GPT-OSS's attention sinks (random per-head logits from -3 to 5),
    // through both the row kernel's merge and the tensor-core tiles.
    for (ci, (h, hkv, dh, block, lens, runs, window)) in cases.into_iter().enumerate() {
        let b = batch(lens, hkv, dh, block);
        let (layer, ..) = fill(&dev, &mut rng, &b, lens, KvDtype::F16);
        let (kc, vc) = layer.to_host(&dev).unwrap();
        let (mut seq, mut pos) = (Vec::new(), Vec::new());
        for &(s, p0, n) in runs {
            seq.extend(std::iter::repeat_n(s as i32, n));
            pos.extend((p0..p0 + n).map(|p| p as i32));
        }
        seq.push(0);
        pos.push(-1);
        let r = pos.len();
        let p = AttentionParams {
            n_heads: h,
            n_kv_heads: hkv,
            head_dim: dh,
            scale: 1.0 / (dh as f32).sqrt(),
            window,
            sinks: (ci % 2 == 1).then(|| rng.vec(h, 4.0).iter().map(|s| s + 1.0).collect()),
        };
        let sinks_d = p.sinks.as_ref().map(|s| dev.upload(s).unwrap());
        let q = rng.vec(r * h * dh, 2.0);
        let rows = PagedRows {
            seq: &seq,
            pos: &pos,
            tables: &b.flat,
            max_blocks: b.max_blocks,
        };
        let want = paged_attention(&q, &kc, &vc, &b.layout, &rows, &p).unwrap();
        let tiles = hf2q_cuda::prefill_tiles(&rows).expect("runs of two rows or more");
        assert!(dev.paged_prefill_tc_fits(&layer, &p));
        let (seq_d, rest_d, tab_d, tiles_d) = (
            dev.upload(&seq).unwrap(),
            dev.upload(&tiles.rest_pos).unwrap(),
            dev.upload(&b.flat).unwrap(),
            dev.upload(&tiles.tiles).unwrap(),
        );
        let qd = dev.upload(&q).unwrap();
        let mut out = dev.upload(&vec![f32::NAN; r * h * dh]).unwrap();
        let max_len = tiles.rest_max_len.expect("decode and padding rows remain");
        let drows = DevicePagedRows {
            seq: &seq_d,
            pos: &rest_d,
            tables: &tab_d,
            rows: r,
            max_blocks: b.max_blocks,
            max_len,
        };
        let n = dev.paged_attention_scratch_len(&p, r, max_len).unwrap();
        let mut scratch = dev.upload(&vec![f32::NAN; n.max(1)]).unwrap();
        dev.paged_attention(
            &qd,
            &layer,
            &drows,
            &p,
            &mut scratch,
            &mut out,
            sinks_d.as_ref(),
        )
        .unwrap();
        let n_tiles = tiles.tiles.len() / 4;
        dev.paged_prefill_tc(
            &qd,
            &layer,
            &tiles_d,
            n_tiles,
            &tab_d,
            b.max_blocks,
            &p,
            &mut out,
            sinks_d.as_ref(),
        )
        .unwrap();
        let got = dev.download(&out).unwrap();
        // Rows the row kernel ran: its bound above (2e-5). Tiled rows: the tensor-core prefill
        // rounds q·scale and the probabilities to f16 (2^-11 relative each), the contiguous
        // cache's tensor-core bound (4e-3, cuda_ops). Padding: zeros.
        let (mut worst_row, mut worst_tc) = (0f32, 0f32);
        let w = h * dh;
        for i in 0..r {
            let d = max_diff(&got[i * w..][..w], &want[i * w..][..w]);
            if tiles.rest_pos[i] >= 0 || pos[i] < 0 {
                worst_row = worst_row.max(d);
            } else {
                worst_tc = worst_tc.max(d);
            }
        }
        println!(
            "paged prefill H={h} Hkv={hkv} Dh={dh} B={block} rows={r} tiles={n_tiles} \
             window={window:?} sinks={}: row kernel max |err| {worst_row:.2e}, tensor cores {worst_tc:.2e}",
            p.sinks.is_some()
        );
        assert!(worst_row <= 2e-5, "row kernel rows: max |err| {worst_row}");
        assert!(worst_tc <= 4e-3, "tensor-core rows: max |err| {worst_tc}");
    }
}

/// The fused batched RoPE + paged store against its parts run row by row: the contiguous
/// `rope` at each row's position on q and k, then `paged_kv_write` at each row's slot. Rows of
/// three sequences at scattered positions (decode rows and a chunk), one padding row.
#[test]
fn paged_rope_store_equals_rope_then_write() {
    let Some(dev) = device() else { return };
    let mut rng = Rng(0xdead_beef_cafe_f00d);
    for (style, dh, dims, nh, hkv, dtype) in [
        (RopeStyle::Neox, 64, 64, 8, 2, KvDtype::F16),
        // Partial rotary, interleaved pairs, an f32 pool.
        (RopeStyle::Interleaved, 128, 64, 6, 3, KvDtype::F32),
        // No RoPE on this layer (SmolLM3's every fourth): q unchanged, k and v only stored.
        (RopeStyle::Neox, 64, 0, 4, 4, KvDtype::F16),
    ] {
        let b = batch(&[40, 3, 70], hkv, dh, 16);
        let rows: Vec<(usize, i32)> = vec![(0, 39), (1, 2), (2, 60), (2, 61), (2, 62), (0, -1)];
        let r = rows.len();
        let pos: Vec<i32> = rows.iter().map(|&(_, p)| p).collect();
        let slots: Vec<i32> = rows
            .iter()
            .map(|&(s, p)| match usize::try_from(p) {
                Ok(p) => b.layout.slot(b.tables[s].blocks(), p).unwrap() as i32,
                Err(_) => -1,
            })
            .collect();
        let rp = RopeParams {
            style,
            theta: 10000.0,
            dims,
            freq_factors: None,
            linear_scale: 1.0,
        };
        let table = dev.rope_table(&rp).unwrap();
        let (q, k, v) = (
            rng.vec(r * nh * dh, 2.0),
            rng.vec(r * hkv * dh, 2.0),
            rng.vec(r * hkv * dh, 2.0),
        );
        let (kd, vd) = (dev.upload(&k).unwrap(), dev.upload(&v).unwrap());
        let (pos_d, slots_d) = (dev.upload(&pos).unwrap(), dev.upload(&slots).unwrap());
        // Fused.
        let mut q1 = dev.upload(&q).unwrap();
        let mut l1 = dev.alloc_paged_layer(b.layout, dtype).unwrap();
        dev.paged_rope_store(&mut q1, &kd, &vd, r, nh, &mut l1, &pos_d, &slots_d, &table)
            .unwrap();
        // Row by row.
        let (mut qw, mut kw) = (Vec::new(), Vec::new());
        for (i, &p) in pos.iter().enumerate() {
            let p1 = dev.upload(&[p]).unwrap();
            let mut qr = dev.upload(&q[i * nh * dh..][..nh * dh]).unwrap();
            let mut kr = dev.upload(&k[i * hkv * dh..][..hkv * dh]).unwrap();
            dev.rope(&mut qr, 1, nh, dh, &p1, &table).unwrap();
            dev.rope(&mut kr, 1, hkv, dh, &p1, &table).unwrap();
            qw.extend(dev.download(&qr).unwrap());
            kw.extend(dev.download(&kr).unwrap());
        }
        let mut l2 = dev.alloc_paged_layer(b.layout, dtype).unwrap();
        let kwd = dev.upload(&kw).unwrap();
        dev.paged_kv_write(&mut l2, &kwd, &vd, r, &slots_d).unwrap();
        let what = format!("paged_rope_store {style:?} dh {dh} dims {dims} {dtype:?}");
        // Same expressions as the separate kernels; allow for the compiler fusing a product
        // differently: a few ulps of f32 on rotated values |x| <= 2 * sqrt(2) < 4 (8e-6), and
        // for an f16 cache that ulp may move the rounding to the next f16 value, whose spacing
        // at 2..4 is 2^-9 (4e-3 allows two). The padding row's q is not compared.
        let got = dev.download(&q1).unwrap();
        let live = (r - 1) * nh * dh;
        let err = max_diff(&got[..live], &qw[..live]);
        assert!(err <= 8e-6, "{what}: q max |err| {err}");
        let ((gk, gv), (wk, wv)) = (l1.to_host(&dev).unwrap(), l2.to_host(&dev).unwrap());
        let ktol = if dtype == KvDtype::F16 { 4e-3 } else { 8e-6 };
        assert!(
            max_diff(&gk, &wk) <= ktol,
            "{what}: cached k {}",
            max_diff(&gk, &wk)
        );
        assert_eq!(gv, wv, "{what}: cached v");
        assert_eq!(dev.download(&kd).unwrap(), k, "{what}: k is left as it was");
    }
}

/// Largest |a - b|; infinite where either is NaN (an unwritten output).
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0f32, |m, (x, y)| {
        if x.is_nan() || y.is_nan() {
            f32::INFINITY
        } else {
            m.max((x - y).abs())
        }
    })
}

#[test]
fn bad_shapes_are_refused() {
    let Some(dev) = device() else { return };
    let layout = PagedLayout {
        n_blocks: 4,
        n_kv_heads: 2,
        block_tokens: 12,
        head_dim: 64,
    };
    let err = dev
        .alloc_paged_layer(layout, KvDtype::F16)
        .err()
        .expect("blocks of 12 are refused");
    assert!(err.to_string().contains("power of two"), "{err}");
}

/// Times one paged launch over `B` decode rows (each its own sequence of `ctx` tokens) against
/// `B` launches of the contiguous-cache decode attention (what the eager batched step does).
#[test]
#[ignore = "a benchmark: run with --ignored on a GPU machine"]
fn bench_paged_decode() {
    let Some(dev) = device() else { return };
    let (h, hkv, dh, block) = (32, 8, 64, 16);
    let p = AttentionParams {
        n_heads: h,
        n_kv_heads: hkv,
        head_dim: dh,
        scale: 0.125,
        window: None,
        sinks: None,
    };
    let mut rng = Rng(7);
    for &(bsz, ctx) in &[(1usize, 1024usize), (16, 1024), (64, 1024), (64, 4096)] {
        let lens = vec![ctx; bsz];
        let b = batch(&lens, hkv, dh, block);
        let layer = dev.alloc_paged_layer(b.layout, KvDtype::F16).unwrap();
        let seq: Vec<i32> = (0..bsz as i32).collect();
        let pos = vec![ctx as i32 - 1; bsz];
        let (seq_d, pos_d, tab_d) = (
            dev.upload(&seq).unwrap(),
            dev.upload(&pos).unwrap(),
            dev.upload(&b.flat).unwrap(),
        );
        let max_len = b.max_blocks * block;
        let rows = DevicePagedRows {
            seq: &seq_d,
            pos: &pos_d,
            tables: &tab_d,
            rows: bsz,
            max_blocks: b.max_blocks,
            max_len,
        };
        let qd = dev.upload(&rng.vec(bsz * h * dh, 1.0)).unwrap();
        let n = dev.paged_attention_scratch_len(&p, bsz, max_len).unwrap();
        let mut scratch = dev.upload(&vec![0f32; n]).unwrap();
        let mut out = dev.upload(&vec![0f32; bsz * h * dh]).unwrap();
        let reps = 50;
        let paged = time_ms(&dev, reps, || {
            dev.paged_attention(&qd, &layer, &rows, &p, &mut scratch, &mut out, None)
                .unwrap()
        });
        // The same keys in one contiguous cache per sequence, one launch each.
        let caches: Vec<_> = (0..bsz)
            .map(|_| dev.alloc_kv_cache(hkv, ctx, dh, KvDtype::F16).unwrap())
            .collect();
        let pos1 = dev.upload(&[ctx as i32 - 1]).unwrap();
        let sn = dev.attention_scratch_len(&p, ctx);
        let mut s1 = dev.upload(&vec![0f32; sn]).unwrap();
        let q1 = dev.upload(&rng.vec(h * dh, 1.0)).unwrap();
        let mut o1 = dev.upload(&vec![0f32; h * dh]).unwrap();
        let per_seq = time_ms(&dev, reps, || {
            for c in &caches {
                dev.attention(&q1, 1, c, &pos1, &p, &mut s1, &mut o1, None)
                    .unwrap();
            }
        });
        let bytes = (2 * bsz * ctx * hkv * dh * 2) as f64;
        println!(
            "attention decode, {bsz} rows x {ctx} keys (H={h} Hkv={hkv} Dh={dh}, f16): paged one launch {paged:.3} ms ({:.0} GB/s), per-sequence launches {per_seq:.3} ms ({:.0} GB/s)",
            bytes / paged as f64 / 1e6,
            bytes / per_seq as f64 / 1e6
        );
    }
}

/// Mean milliseconds of `f` over `reps` runs after a warm-up, stream synchronised around.
fn time_ms(dev: &CudaDev, reps: usize, mut f: impl FnMut()) -> f32 {
    f();
    dev.synchronize().unwrap();
    let t = std::time::Instant::now();
    for _ in 0..reps {
        f();
    }
    dev.synchronize().unwrap();
    t.elapsed().as_secs_f32() * 1e3 / reps as f32
}
