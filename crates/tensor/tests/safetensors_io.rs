//! safetensors reader/writer contracts: agreement with the reference implementation (a file it
//! wrote, and byte-identical output from our writer), round trips, sharded folders, and hostile
//! headers.

use std::collections::BTreeMap;
use std::path::Path;

use hf2q_tensor::io::safetensors::{
    write_safetensors, write_safetensors_to, SafeTensors, ShardedSafeTensors, StDtype,
};
use hf2q_tensor::{Bytes, Error};

/// Written by the `safetensors` package 0.8.0 (its writer is the upstream Rust crate) through
/// scripts/fixtures/gen_safetensors_fixture.py; `expected_tensors` regenerates its contents.
const REFERENCE_HEX: &str = concat!(
    "58040000000000007b225f5f6d657461646174615f5f223a7b22666f726d6174223a227074222c226e6f7465223a22c3",
    "bc6ec3af636f6465227d2c226c2e753634223a7b226474797065223a22553634222c227368617065223a5b315d2c2264",
    "6174615f6f666673657473223a5b302c385d7d2c22652e693634223a7b226474797065223a22493634222c2273686170",
    "65223a5b325d2c22646174615f6f666673657473223a5b382c32345d7d2c22612e663634223a7b226474797065223a22",
    "463634222c227368617065223a5b322c335d2c22646174615f6f666673657473223a5b32342c37325d7d2c22622e6633",
    "32223a7b226474797065223a22463332222c227368617065223a5b322c335d2c22646174615f6f666673657473223a5b",
    "37322c39365d7d2c22702e656d707479223a7b226474797065223a22463332222c227368617065223a5b302c345d2c22",
    "646174615f6f666673657473223a5b39362c39365d7d2c22712e7363616c6172223a7b226474797065223a2246333222",
    "2c227368617065223a5b5d2c22646174615f6f666673657473223a5b39362c3130305d7d2c226a2e753332223a7b2264",
    "74797065223a22553332222c227368617065223a5b315d2c22646174615f6f666673657473223a5b3130302c3130345d",
    "7d2c22662e693332223a7b226474797065223a22493332222c227368617065223a5b312c325d2c22646174615f6f6666",
    "73657473223a5b3130342c3131325d7d2c22642e62663136223a7b226474797065223a2242463136222c227368617065",
    "223a5b332c325d2c22646174615f6f666673657473223a5b3131322c3132345d7d2c22632e663136223a7b2264747970",
    "65223a22463136222c227368617065223a5b365d2c22646174615f6f666673657473223a5b3132342c3133365d7d2c22",
    "6b2e753136223a7b226474797065223a22553136222c227368617065223a5b325d2c22646174615f6f66667365747322",
    "3a5b3133362c3134305d7d2c22672e693136223a7b226474797065223a22493136222c227368617065223a5b335d2c22",
    "646174615f6f666673657473223a5b3134302c3134365d7d2c226e2e663865346d33223a7b226474797065223a224638",
    "5f45344d33222c227368617065223a5b345d2c22646174615f6f666673657473223a5b3134362c3135305d7d2c226f2e",
    "663865356d32223a7b226474797065223a2246385f45354d32222c227368617065223a5b322c315d2c22646174615f6f",
    "666673657473223a5b3135302c3135325d7d2c22682e6938223a7b226474797065223a224938222c227368617065223a",
    "5b355d2c22646174615f6f666673657473223a5b3135322c3135375d7d2c22692e7538223a7b226474797065223a2255",
    "38222c227368617065223a5b322c325d2c22646174615f6f666673657473223a5b3135372c3136315d7d2c226d2e626f",
    "6f6c223a7b226474797065223a22424f4f4c222c227368617065223a5b335d2c22646174615f6f666673657473223a5b",
    "3136312c3136345d7d7d2020202020200b121920272e353c040b121920272e353c434a51585f666d000000000000f83f",
    "00000000000000c0000000000000d03f0000000000fcef40000000000000008000000000000008400000c03f000000c0",
    "0000803e00e07f4700000080000040400000c03f0910171e050c131a21282f36c03f00c0803e7f4700804040003e00c0",
    "0034ff7b008000420a11181f060d141b22290d141b220e15070e151c23080f161d000100",
);

const FLOATS: [f64; 6] = [1.5, -2.0, 0.25, 65504.0, -0.0, 3.0];

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// (name, dtype, shape, data) exactly as the generator script makes them, in its order.
fn expected_tensors() -> Vec<(String, StDtype, Vec<usize>, Vec<u8>)> {
    use StDtype::*;
    let list: [(&str, StDtype, &[usize]); 17] = [
        ("a.f64", F64, &[2, 3]),
        ("b.f32", F32, &[2, 3]),
        ("c.f16", F16, &[6]),
        ("d.bf16", BF16, &[3, 2]),
        ("e.i64", I64, &[2]),
        ("f.i32", I32, &[1, 2]),
        ("g.i16", I16, &[3]),
        ("h.i8", I8, &[5]),
        ("i.u8", U8, &[2, 2]),
        ("j.u32", U32, &[1]),
        ("k.u16", U16, &[2]),
        ("l.u64", U64, &[1]),
        ("m.bool", BOOL, &[3]),
        ("n.f8e4m3", F8_E4M3, &[4]),
        ("o.f8e5m2", F8_E5M2, &[2, 1]),
        ("p.empty", F32, &[0, 4]),
        ("q.scalar", F32, &[]),
    ];
    list.iter()
        .enumerate()
        .map(|(i, &(name, dt, shape))| {
            let n: usize = shape.iter().product();
            let fl = &FLOATS[..n.min(6)];
            let data: Vec<u8> = match dt {
                F64 => fl.iter().flat_map(|x| x.to_le_bytes()).collect(),
                F32 => fl.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect(),
                F16 => fl
                    .iter()
                    .flat_map(|&x| half::f16::from_f64(x).to_le_bytes())
                    .collect(),
                // Truncated, as the script makes it (not rounded: 65504 becomes 65280).
                BF16 => fl
                    .iter()
                    .flat_map(|&x| (((x as f32).to_bits() >> 16) as u16).to_le_bytes())
                    .collect(),
                BOOL => (0..n).map(|j| (j % 2) as u8).collect(),
                _ => (0..n * dt.size())
                    .map(|j| ((j * 7 + i) & 0xff) as u8)
                    .collect(),
            };
            (name.to_string(), dt, shape.to_vec(), data)
        })
        .collect()
}

fn reference() -> SafeTensors {
    SafeTensors::from_bytes(Bytes::from_vec(unhex(REFERENCE_HEX))).unwrap()
}

#[test]
fn reads_the_reference_file() {
    let st = reference();
    let meta: BTreeMap<_, _> = [
        ("format".to_string(), "pt".to_string()),
        ("note".into(), "ünïcode".into()),
    ]
    .into();
    assert_eq!(st.metadata, meta);
    let expected = expected_tensors();
    assert_eq!(st.tensors.len(), expected.len());
    for (name, dt, shape, data) in &expected {
        let t = st.tensor(name).unwrap_or_else(|| panic!("missing {name}"));
        assert_eq!((t.dtype, &t.shape), (*dt, shape), "{name}");
        assert_eq!(t.nbytes(), data.len(), "{name}");
        assert_eq!(
            st.tensor_data(t).unwrap().as_slice(),
            data.as_slice(),
            "{name}"
        );
    }
    for name in ["a.f64", "b.f32", "c.f16", "d.bf16"] {
        let got = st.to_f32(st.tensor(name).unwrap()).unwrap();
        let mut want: Vec<f32> = FLOATS.iter().map(|&x| x as f32).collect();
        if name == "d.bf16" {
            want.iter_mut()
                .for_each(|x| *x = f32::from_bits(x.to_bits() & 0xffff_0000));
        }
        assert_eq!(got, want, "{name}");
    }
    assert_eq!(
        st.to_f32(st.tensor("q.scalar").unwrap()).unwrap(),
        vec![1.5]
    );
    assert!(st.to_f32(st.tensor("p.empty").unwrap()).unwrap().is_empty());
    let e = st.to_f32(st.tensor("i.u8").unwrap()).unwrap_err();
    assert!(
        matches!(e, Error::UnsupportedType { .. }) && e.to_string().contains("i.u8"),
        "{e}"
    );
}

#[test]
fn writer_reproduces_reference_bytes() {
    // The reference writer orders tensors by dtype size (largest first), then name; given that
    // order, our bytes must be the same.
    let st = reference();
    let mut order = st.tensors.clone();
    order.sort_by_key(|t| (t.start, t.end));
    let expected = expected_tensors();
    let tensors: Vec<_> = order
        .iter()
        .map(|t| {
            let e = expected.iter().find(|e| e.0 == t.name).unwrap();
            (e.0.clone(), e.1, e.2.clone(), e.3.as_slice())
        })
        .collect();
    let mut out = Vec::new();
    write_safetensors_to(&mut out, &tensors, &st.metadata).unwrap();
    assert_eq!(out, unhex(REFERENCE_HEX));
}

#[test]
fn file_round_trip_is_atomic() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.safetensors");
    let expected = expected_tensors();
    let tensors: Vec<_> = expected
        .iter()
        .map(|e| (e.0.clone(), e.1, e.2.clone(), e.3.as_slice()))
        .collect();
    write_safetensors(&path, &tensors, &BTreeMap::new()).unwrap();
    let st = SafeTensors::open(&path).unwrap();
    assert!(st.metadata.is_empty());
    assert_eq!(st.data_offset() % 8, 0);
    let names: Vec<_> = st.tensors.iter().map(|t| t.name.as_str()).collect();
    let want: Vec<_> = expected.iter().map(|e| e.0.as_str()).collect();
    assert_eq!(names, want, "header order is the order given");
    for (name, _, _, data) in &expected {
        assert_eq!(
            st.tensor_data(st.tensor(name).unwrap()).unwrap().as_slice(),
            data.as_slice()
        );
    }
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "no temporary left behind"
    );
}

#[test]
fn writer_rejects_bad_input() {
    let d = [0u8; 8];
    let e = |t: &[(String, StDtype, Vec<usize>, &[u8])]| {
        write_safetensors_to(&mut Vec::new(), t, &BTreeMap::new())
            .unwrap_err()
            .to_string()
    };
    assert!(e(&[("a".into(), StDtype::F32, vec![3], &d)]).contains("8 bytes given"));
    let two = [
        ("a".into(), StDtype::F32, vec![2], &d[..]),
        ("a".into(), StDtype::U8, vec![8], &d[..]),
    ];
    assert!(e(&two).contains("duplicate"));
    assert!(e(&[("__metadata__".into(), StDtype::U8, vec![8], &d)]).contains("cannot be named"));
    assert!(e(&[("a".into(), StDtype::U8, vec![usize::MAX, 2], &d)]).contains("bytes given"));
    // Nothing is left at the path after a failed write.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.safetensors");
    assert!(write_safetensors(
        &p,
        &[("a".into(), StDtype::F32, vec![3], &d)],
        &BTreeMap::new()
    )
    .is_err());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

// ---- hostile input ----

/// A file with `header` (padded with spaces to 8 bytes) and `data_len` zero bytes of data.
fn file(header: &str, data_len: usize) -> Vec<u8> {
    let mut h = header.as_bytes().to_vec();
    h.resize(h.len().div_ceil(8) * 8, b' ');
    let mut v = (h.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(&h);
    v.extend(std::iter::repeat_n(0u8, data_len));
    v
}

#[track_caller]
fn assert_err(bytes: Vec<u8>, needle: &str) {
    match SafeTensors::from_bytes(Bytes::from_vec(bytes)) {
        Ok(_) => panic!("parsed a malformed file; expected an error containing '{needle}'"),
        Err(e) => assert!(
            e.to_string().contains(needle),
            "error '{e}' does not contain '{needle}'"
        ),
    }
}

#[test]
fn every_truncation_is_an_error() {
    let full = unhex(REFERENCE_HEX);
    for len in 0..full.len() {
        assert!(
            SafeTensors::from_bytes(Bytes::from_vec(full[..len].to_vec())).is_err(),
            "prefix {len}"
        );
    }
}

#[test]
fn random_corruption_never_panics() {
    let full = unhex(REFERENCE_HEX);
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..5_000 {
        let mut b = full.clone();
        for _ in 0..(next() % 3 + 1) {
            let i = (next() % b.len() as u64) as usize;
            b[i] = next() as u8;
        }
        if let Ok(st) = SafeTensors::from_bytes(Bytes::from_vec(b)) {
            for t in &st.tensors {
                assert_eq!(st.tensor_data(t).unwrap().len(), t.numel() * t.dtype.size());
                let _ = st.to_f32(t);
            }
        }
    }
}

#[test]
fn bad_header_lengths() {
    assert_err(vec![1, 2, 3], "too short for the 8-byte header length");
    assert_err(
        u64::MAX.to_le_bytes().to_vec(),
        "exceeds the 100000000-byte limit",
    );
    assert_err((100_000_001u64).to_le_bytes().to_vec(), "exceeds");
    let mut v = 16u64.to_le_bytes().to_vec();
    v.extend_from_slice(b"{}");
    assert_err(v, "header length 16 runs past the end of the file (2 bytes");
}

#[test]
fn bad_json() {
    assert_err(file("{\"a\": ", 0), "not a valid JSON object");
    assert_err(file("[1, 2]", 0), "not a valid JSON object");
    assert_err(file("\"x\"", 0), "not a valid JSON object");
    let mut v = file("{}", 0);
    v[8] = 0xff; // not UTF-8
    assert_err(v, "not a valid JSON object");
    // Deep nesting is refused by the JSON parser's recursion limit, not a stack overflow.
    let deep = format!(
        "{{\"__metadata__\": {}{}}}",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    assert_err(file(&deep, 0), "not a valid JSON object");
    // An empty header object is a valid, empty file.
    assert!(SafeTensors::from_bytes(Bytes::from_vec(file("{}", 0)))
        .unwrap()
        .tensors
        .is_empty());
}

#[test]
fn bad_entries() {
    let t = |body: &str, n| file(&format!("{{\"w\": {body}}}"), n);
    assert_err(
        t(
            r#"{"dtype":"F32","shape":[2],"data_offsets":[0,8]}"#
                .replace("F32", "F128")
                .as_str(),
            8,
        ),
        "tensor 'w' has unknown dtype 'F128'",
    );
    assert_err(
        t(r#"{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}"#, 8),
        "tensor 'w': bad header entry",
    );
    assert_err(
        t(r#"{"dtype":"F32","shape":[2]}"#, 8),
        "missing field `data_offsets`",
    );
    assert_err(
        t(r#"{"dtype":"F32","shape":[2],"data_offsets":[0]}"#, 8),
        "tensor 'w': bad header entry",
    );
    assert_err(
        t(r#"{"dtype":"F32","shape":[2],"data_offsets":[8,0]}"#, 8),
        "outside the 8-byte data buffer",
    );
    assert_err(
        t(r#"{"dtype":"F32","shape":[2],"data_offsets":[0,16]}"#, 8),
        "data offsets [0, 16] outside",
    );
    assert_err(
        t(
            r#"{"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551615]}"#,
            8,
        ),
        "outside",
    );
    assert_err(
        t(r#"{"dtype":"F32","shape":[3],"data_offsets":[0,8]}"#, 8),
        "(12 bytes) but its data offsets [0, 8] span 8 bytes",
    );
    assert_err(
        t(
            r#"{"dtype":"F32","shape":[1099511627776,1099511627776,1099511627776],"data_offsets":[0,8]}"#,
            8,
        ),
        "overflows",
    );
    assert_err(
        t(
            r#"{"dtype":"F32","shape":[99999999999999999999],"data_offsets":[0,8]}"#,
            8,
        ),
        "bad header entry",
    );
    assert_err(t("17", 0), "tensor 'w': bad header entry");
}

#[test]
fn duplicates_and_overlaps() {
    let e = r#"{"dtype":"U8","shape":[4],"data_offsets":[0,4]}"#;
    assert_err(
        file(&format!("{{\"w\": {e}, \"w\": {e}}}"), 4),
        "duplicate header entry 'w'",
    );
    let f = r#"{"dtype":"U8","shape":[4],"data_offsets":[2,6]}"#;
    assert_err(
        file(&format!("{{\"a\": {e}, \"b\": {f}}}"), 8),
        "tensor data of 'a' and 'b' overlap",
    );
    // Sharing exact ranges is an overlap too; empty tensors overlap nothing.
    assert_err(file(&format!("{{\"a\": {e}, \"b\": {e}}}"), 4), "overlap");
    let z = r#"{"dtype":"U8","shape":[0],"data_offsets":[2,2]}"#;
    assert!(SafeTensors::from_bytes(Bytes::from_vec(file(
        &format!("{{\"a\": {e}, \"z\": {z}}}"),
        4
    )))
    .is_ok());
}

#[test]
fn bad_metadata() {
    assert_err(
        file(r#"{"__metadata__": {"a": 1}}"#, 0),
        "__metadata__ entry 'a' must be a string, found 1",
    );
    assert_err(
        file(r#"{"__metadata__": [1]}"#, 0),
        "__metadata__ must be an object",
    );
    let st = SafeTensors::from_bytes(Bytes::from_vec(file(
        r#"{"__metadata__": {"b": "2", "a": "1"}}"#,
        0,
    )))
    .unwrap();
    assert_eq!(st.metadata.get("a").map(String::as_str), Some("1"));
}

#[test]
fn tensor_data_checks_user_made_infos() {
    let st = reference();
    let mut t = st.tensors[0].clone();
    t.end = usize::MAX;
    assert!(st
        .tensor_data(&t)
        .unwrap_err()
        .to_string()
        .contains("outside the data buffer"));
    t.start = usize::MAX;
    assert!(st.tensor_data(&t).is_err());
}

// ---- sharded checkpoints ----

fn write(dir: &Path, file: &str, tensors: &[(&str, &[u8])]) {
    let t: Vec<_> = tensors
        .iter()
        .map(|(n, d)| (n.to_string(), StDtype::U8, vec![d.len()], *d))
        .collect();
    write_safetensors(&dir.join(file), &t, &BTreeMap::new()).unwrap();
}

#[test]
fn sharded_with_index() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "model-00001-of-00002.safetensors",
        &[("a", b"aa"), ("b", b"bbb")],
    );
    write(
        dir.path(),
        "model-00002-of-00002.safetensors",
        &[("c", b"c"), ("unlisted", b"u")],
    );
    let index = r#"{"metadata": {"total_size": 6}, "weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors"}}"#;
    std::fs::write(dir.path().join("model.safetensors.index.json"), index).unwrap();
    let s = ShardedSafeTensors::open_dir(dir.path()).unwrap();
    assert_eq!(s.names().collect::<Vec<_>>(), ["a", "b", "c"]);
    assert_eq!(s.len(), 3);
    assert_eq!(s.shards().count(), 2);
    let (st, info) = s.get("c").unwrap();
    assert_eq!(st.tensor_data(info).unwrap().as_slice(), b"c");
    assert_eq!(s.tensor_data("b").unwrap().as_slice(), b"bbb");
    assert!(
        s.get("unlisted").is_none(),
        "the weight map is authoritative"
    );
    assert!(s.tensor_data("zzz").is_err());
    assert!(ShardedSafeTensors::open(dir.path()).is_ok());
}

#[test]
fn sharded_index_errors() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "s1.safetensors", &[("a", b"aa")]);
    let idx = |body: &str| {
        std::fs::write(dir.path().join("model.safetensors.index.json"), body).unwrap();
        ShardedSafeTensors::open_dir(dir.path())
            .unwrap_err()
            .to_string()
    };
    let e = idx(r#"{"weight_map": {"b": "s1.safetensors"}}"#);
    assert!(
        e.contains(
            "tensor 'b' is listed in model.safetensors.index.json but missing from s1.safetensors"
        ),
        "{e}"
    );
    let e = idx(r#"{"weight_map": {"a": "../s1.safetensors"}}"#);
    assert!(e.contains("not a plain file name"), "{e}");
    let e = idx(r#"{"weight_map": {"a": "/etc/passwd"}}"#);
    assert!(e.contains("not a plain file name"), "{e}");
    let e = idx(r#"{"weight_map": {"a": "missing.safetensors"}}"#);
    assert!(e.contains("missing.safetensors"), "{e}");
    let e = idx(r#"{"weight_map": 3}"#);
    assert!(e.contains("model.safetensors.index.json"), "{e}");
}

#[test]
fn sharded_without_index() {
    let dir = tempfile::tempdir().unwrap();
    let e = ShardedSafeTensors::open_dir(dir.path())
        .unwrap_err()
        .to_string();
    assert!(e.contains("no *.safetensors files"), "{e}");
    write(dir.path(), "b.safetensors", &[("y", b"y")]);
    write(dir.path(), "a.safetensors", &[("x", b"x")]);
    std::fs::write(dir.path().join("._a.safetensors"), b"junk").unwrap();
    std::fs::write(dir.path().join("notes.txt"), b"junk").unwrap();
    let s = ShardedSafeTensors::open_dir(dir.path()).unwrap();
    assert_eq!(s.names().collect::<Vec<_>>(), ["x", "y"]);
    let single = ShardedSafeTensors::open(&dir.path().join("b.safetensors")).unwrap();
    assert_eq!(single.names().collect::<Vec<_>>(), ["y"]);
    write(dir.path(), "c.safetensors", &[("x", b"x")]);
    let e = ShardedSafeTensors::open_dir(dir.path())
        .unwrap_err()
        .to_string();
    assert!(e.contains("tensor 'x' is in both"), "{e}");
}

#[test]
fn open_names_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("broken.safetensors");
    std::fs::write(&p, [1u8, 2]).unwrap();
    let e = SafeTensors::open(&p).unwrap_err().to_string();
    assert!(
        e.contains("broken.safetensors") && e.contains("too short"),
        "{e}"
    );
}
