//! GGUF writer/reader round trips: synthetic files holding every value type, and (when
//! `HF2Q_TEST_SMOLLM2_GGUF` names the SmolLM2-135M-Instruct Q4_1 GGUF) a real file written back
//! byte for byte.

use hf2q_tensor::io::gguf::{
    write_gguf_file, GgufArray, GgufFile, GgufValue, GgufValueType, GgufWriter,
};
use hf2q_tensor::{Bytes, GgmlType};

fn arr(t: GgufValueType, v: Vec<GgufValue>) -> GgufValue {
    GgufValue::Array(GgufArray::new(t, v).expect("consistent element types"))
}

fn all_values() -> Vec<(String, GgufValue)> {
    use GgufValue as V;
    use GgufValueType as T;
    vec![
        ("general.architecture".into(), V::from("llama")),
        ("t.u8".into(), V::U8(255)),
        ("t.i8".into(), V::I8(-128)),
        ("t.u16".into(), V::U16(65535)),
        ("t.i16".into(), V::I16(-32768)),
        ("t.u32".into(), V::U32(u32::MAX)),
        ("t.i32".into(), V::I32(i32::MIN)),
        ("t.f32".into(), V::F32(-1.5e-7)),
        ("t.bool_true".into(), V::Bool(true)),
        ("t.bool_false".into(), V::Bool(false)),
        ("t.string".into(), V::from("héllo, wörld ✓")),
        ("t.empty_string".into(), V::from("")),
        ("t.u64".into(), V::U64(u64::MAX)),
        ("t.i64".into(), V::I64(i64::MIN)),
        ("t.f64".into(), V::F64(std::f64::consts::PI)),
        (
            "t.arr_u8".into(),
            arr(T::U8, vec![V::U8(0), V::U8(1), V::U8(2)]),
        ),
        ("t.arr_empty".into(), arr(T::I32, vec![])),
        (
            "t.arr_str".into(),
            arr(T::String, vec![V::from("a"), V::from(""), V::from("ccc")]),
        ),
        (
            "t.arr_f32".into(),
            arr(T::F32, vec![V::F32(0.5), V::F32(-2.0)]),
        ),
        ("t.arr_i32".into(), arr(T::I32, vec![V::I32(-1), V::I32(7)])),
        (
            "t.arr_bool".into(),
            arr(T::Bool, vec![V::Bool(true), V::Bool(false)]),
        ),
        (
            "t.arr_nested".into(),
            arr(
                T::Array,
                vec![
                    arr(T::U64, vec![V::U64(1), V::U64(2)]),
                    arr(T::String, vec![V::from("x")]),
                    arr(T::Array, vec![arr(T::F64, vec![V::F64(1.25)])]),
                ],
            ),
        ),
    ]
}

/// Deterministic bytes for a tensor.
fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn synthetic(version: u32, alignment: Option<u32>) -> GgufWriter {
    let mut w = GgufWriter::with_version(version).unwrap();
    for (k, v) in all_values() {
        w.add_metadata(k, v).unwrap();
    }
    if let Some(a) = alignment {
        w.add_metadata("general.alignment", GgufValue::U32(a))
            .unwrap();
    }
    let tensors: [(&str, Vec<u64>, GgmlType); 5] = [
        ("f32.weight", vec![3, 2], GgmlType::F32),
        ("f16.weight", vec![5], GgmlType::F16),
        ("q4_0.weight", vec![64, 3], GgmlType::Q4_0),
        ("q4_k.weight", vec![256, 1, 2], GgmlType::Q4_K),
        ("scalar", vec![], GgmlType::F32),
    ];
    for (i, (name, dims, ty)) in tensors.into_iter().enumerate() {
        let n = {
            let bs = ty.block_size() as u64;
            let ne0 = dims.first().copied().unwrap_or(1);
            (ne0 / bs * ty.type_size() as u64 * dims.iter().skip(1).product::<u64>()) as usize
        };
        w.add_tensor(name, dims, ty, Bytes::from_vec(pattern(n, i as u8)))
            .unwrap();
    }
    w
}

#[test]
fn synthetic_round_trip_every_value_type() {
    for (version, alignment) in [
        (3, None),
        (2, None),
        (3, Some(64)),
        (3, Some(1)),
        (2, Some(256)),
    ] {
        let w = synthetic(version, alignment);
        let mut buf = Vec::new();
        let n = w.write(&mut buf).unwrap();
        assert_eq!(n as usize, buf.len());
        let f = GgufFile::from_bytes(Bytes::from_vec(buf.clone())).unwrap();
        assert_eq!(f.version, version);
        assert_eq!(f.alignment, alignment.map_or(32, u64::from));
        assert_eq!(f.data_offset % f.alignment, 0);

        let mut expected = all_values();
        if let Some(a) = alignment {
            expected.push(("general.alignment".into(), GgufValue::U32(a)));
        }
        assert_eq!(f.metadata.len(), expected.len());
        for ((k, v), (ek, ev)) in f.metadata.iter().zip(&expected) {
            assert_eq!(k, ek);
            // F64 PI and F32 values compare bit-exactly through PartialEq.
            assert_eq!(v, ev, "value of {k}");
        }
        for (t, wt) in f.tensors.iter().zip(w.tensor_infos()) {
            assert_eq!(t, wt);
            assert_eq!(t.offset % f.alignment, 0);
            let i = f.tensors.iter().position(|x| x.name == t.name).unwrap();
            assert_eq!(
                f.tensor_data(t).unwrap().as_slice(),
                pattern(t.nbytes() as usize, i as u8)
            );
        }
        assert_eq!(f.tensor("scalar").unwrap().numel(), 1);
        assert_eq!(f.tensor("q4_k.weight").unwrap().nbytes(), 2 * 144);

        // Read back and written again: identical bytes.
        let mut again = Vec::new();
        GgufWriter::from_file(&f)
            .unwrap()
            .write(&mut again)
            .unwrap();
        assert_eq!(again, buf, "v{version} alignment {alignment:?}");
    }
}

#[test]
fn typed_getters() {
    let mut buf = Vec::new();
    synthetic(3, None).write(&mut buf).unwrap();
    let f = GgufFile::from_bytes(Bytes::from_vec(buf)).unwrap();
    assert_eq!(f.architecture(), Some("llama"));
    assert_eq!(f.get_u64("t.u32"), Some(u32::MAX as u64));
    assert_eq!(f.get_u64("t.i8"), None);
    assert_eq!(f.get_f32("t.u8"), Some(255.0));
    assert_eq!(f.get_bool("t.bool_true"), Some(true));
    assert_eq!(f.get_str("t.u8"), None);
    assert_eq!(f.get_str_array("t.arr_str"), Some(vec!["a", "", "ccc"]));
    assert_eq!(f.get_f32_array("t.arr_f32"), Some(vec![0.5, -2.0]));
    assert_eq!(f.get_f32_array("t.arr_str"), None);
    assert_eq!(f.get_i32_array("t.arr_i32"), Some(vec![-1, 7]));
    assert_eq!(f.get_i32_array("t.arr_u8"), Some(vec![0, 1, 2]));
    assert_eq!(f.get_i32_array("t.arr_empty"), Some(vec![]));
    assert_eq!(f.get("missing"), None);
    let nested = f.get("t.arr_nested").and_then(|v| v.as_array()).unwrap();
    assert_eq!(nested.elem_type, GgufValueType::Array);
    assert_eq!(
        nested.values[2].as_array().unwrap().values[0]
            .as_array()
            .unwrap()
            .values[0],
        GgufValue::F64(1.25)
    );
}

#[test]
fn writer_rejects_bad_input() {
    let mut w = GgufWriter::new();
    w.add_metadata("a", 1u32).unwrap();
    assert!(w
        .add_metadata("a", 2u32)
        .unwrap_err()
        .to_string()
        .contains("duplicate"));
    let bad = GgufValue::Array(GgufArray {
        elem_type: GgufValueType::U8,
        values: vec![GgufValue::I8(1)],
    });
    assert!(w
        .add_metadata("b", bad)
        .unwrap_err()
        .to_string()
        .contains("index 0"));
    for a in [GgufValue::U32(0), GgufValue::U32(48), GgufValue::U64(64)] {
        assert!(w.add_metadata("general.alignment", a).is_err());
    }
    let e = w
        .add_tensor("t", vec![33], GgmlType::Q8_0, Bytes::from_vec(vec![0; 34]))
        .unwrap_err();
    assert!(e.to_string().contains("block size"), "{e}");
    let e = w
        .add_tensor("t", vec![32], GgmlType::Q8_0, Bytes::from_vec(vec![0; 33]))
        .unwrap_err();
    assert!(e.to_string().contains("needs 34"), "{e}");
    let e = w
        .add_tensor("t", vec![1; 5], GgmlType::F32, Bytes::from_vec(vec![0; 4]))
        .unwrap_err();
    assert!(e.to_string().contains("5 dimensions"), "{e}");
    let long = "x".repeat(64);
    assert!(w
        .add_tensor_info(long, vec![1], GgmlType::F32)
        .unwrap_err()
        .to_string()
        .contains("at most 63"));
    w.add_tensor_info("t", vec![4], GgmlType::F32).unwrap();
    assert!(w
        .add_tensor_info("t", vec![4], GgmlType::F32)
        .unwrap_err()
        .to_string()
        .contains("duplicate"));
    // Alignment cannot change once a tensor is placed.
    assert!(w
        .add_metadata("general.alignment", GgufValue::U32(64))
        .is_err());
    // No data attached and none supplied.
    assert!(w
        .write(&mut Vec::new())
        .unwrap_err()
        .to_string()
        .contains("no data"));
    // Streamed data of the wrong size.
    let e = w
        .write_with(&mut Vec::new(), |_| Ok(vec![0u8; 3]))
        .unwrap_err();
    assert!(e.to_string().contains("3 bytes supplied"), "{e}");
    assert!(GgufWriter::with_version(1).is_err());
}

#[test]
fn streamed_data_matches_attached_data() {
    let attached = synthetic(3, Some(64));
    let mut a = Vec::new();
    attached.write(&mut a).unwrap();
    let f = GgufFile::from_bytes(Bytes::from_vec(a.clone())).unwrap();

    let mut streamed = GgufWriter::new();
    for (k, v) in &f.metadata {
        streamed.add_metadata(k.clone(), v.clone()).unwrap();
    }
    for t in &f.tensors {
        streamed
            .add_tensor_info(t.name.clone(), t.dims.clone(), t.ty)
            .unwrap();
    }
    let mut b = Vec::new();
    streamed
        .write_with(&mut b, |info| f.tensor_data(f.tensor(&info.name).unwrap()))
        .unwrap();
    assert_eq!(a, b);
}

#[test]
fn write_file_is_atomic_and_leaves_no_temporary() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let w = synthetic(3, None);
    write_gguf_file(&path, &w).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.tensors.len(), 5);
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("m.gguf")]);

    // A failing write leaves neither a file at the path nor a temporary.
    let mut bad = GgufWriter::new();
    bad.add_tensor_info("t", vec![4], GgmlType::F32).unwrap();
    let p2 = dir.path().join("bad.gguf");
    assert!(bad.write_file(&p2).is_err());
    assert!(!p2.exists());
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 1);
}

#[test]
fn set_and_remove_metadata() {
    let mut w = GgufWriter::new();
    w.add_metadata("a", 1u32).unwrap();
    w.add_metadata("b", "x").unwrap();
    w.set_metadata("a", 2u64).unwrap();
    w.set_metadata("c", true).unwrap();
    assert_eq!(w.remove_metadata("b").unwrap(), Some(GgufValue::from("x")));
    assert_eq!(w.remove_metadata("b").unwrap(), None);
    let keys: Vec<_> = w
        .metadata()
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    assert_eq!(
        keys,
        vec![("a", GgufValue::U64(2)), ("c", GgufValue::Bool(true))]
    );
}

/// The real SmolLM2 GGUF (written by llama.cpp's converter) read and written back byte for byte.
#[test]
fn real_smollm2_round_trips_byte_for_byte() {
    let Ok(path) = std::env::var("HF2Q_TEST_SMOLLM2_GGUF") else {
        println!("skipped: set HF2Q_TEST_SMOLLM2_GGUF to the SmolLM2-135M-Instruct.Q4_1.gguf path");
        return;
    };
    let f = GgufFile::open(std::path::Path::new(&path)).unwrap();
    assert_eq!(f.architecture(), Some("llama"));
    assert_eq!(f.get_u64("llama.block_count"), Some(30));
    assert_eq!(f.get_u64("llama.embedding_length"), Some(576));
    let tokens = f.get_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), 49152);
    assert_eq!(f.tensors.len(), 272);
    assert!(f.tensors.iter().any(|t| t.ty == GgmlType::Q4_1));
    let q = f.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!(q.dims, vec![576, 576]);

    let mut out = Vec::with_capacity(f.file_bytes().len());
    GgufWriter::from_file(&f).unwrap().write(&mut out).unwrap();
    assert_eq!(out.len(), f.file_bytes().len());
    assert!(
        out == f.file_bytes().as_slice(),
        "written bytes differ from the original"
    );
}
