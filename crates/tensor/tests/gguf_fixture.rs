//! Cross-check against an independent GGUF implementation: `fixtures/gguf/gguf_py.gguf` was
//! written by gguf-py's GGUFWriter (scripts/fixtures/gen_gguf_fixtures.py, pinned version), and
//! `gguf_py.json` lists what it holds. Our reader must agree with it, and our writer must
//! reproduce gguf-py's bytes exactly (so gguf-py reads what we write as it reads its own).

use std::path::PathBuf;

use hf2q_tensor::io::gguf::{GgufArray, GgufFile, GgufValue, GgufValueType, GgufWriter};
use hf2q_tensor::GgmlType;
use serde_json::Value as J;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gguf")
        .join(name)
}

fn value_type(name: &str) -> GgufValueType {
    (0..13)
        .filter_map(GgufValueType::from_u32)
        .find(|t| t.name() == name)
        .unwrap_or_else(|| panic!("unknown type name {name}"))
}

/// The JSON form written by the generator, as a `GgufValue`.
fn expected(j: &J) -> GgufValue {
    let ty = value_type(j["type"].as_str().unwrap());
    let v = &j["value"];
    let int = || v.as_i64().unwrap();
    match ty {
        GgufValueType::U8 => GgufValue::U8(int() as u8),
        GgufValueType::I8 => GgufValue::I8(int() as i8),
        GgufValueType::U16 => GgufValue::U16(int() as u16),
        GgufValueType::I16 => GgufValue::I16(int() as i16),
        GgufValueType::U32 => GgufValue::U32(int() as u32),
        GgufValueType::I32 => GgufValue::I32(int() as i32),
        GgufValueType::U64 => GgufValue::U64(v.as_u64().unwrap()),
        GgufValueType::I64 => GgufValue::I64(int()),
        GgufValueType::F32 => GgufValue::F32(f32::from_bits(j["bits"].as_u64().unwrap() as u32)),
        GgufValueType::F64 => GgufValue::F64(f64::from_bits(j["bits"].as_u64().unwrap())),
        GgufValueType::Bool => GgufValue::Bool(v.as_bool().unwrap()),
        GgufValueType::String => GgufValue::String(v.as_str().unwrap().to_owned()),
        GgufValueType::Array => {
            let elem_type = value_type(j["elem_type"].as_str().unwrap());
            let values = v.as_array().unwrap().iter().map(expected).collect();
            GgufValue::Array(GgufArray::new(elem_type, values).unwrap())
        }
    }
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn reader_agrees_with_gguf_py() {
    let doc: J =
        serde_json::from_str(&std::fs::read_to_string(fixture("gguf_py.json")).unwrap()).unwrap();
    let f = GgufFile::open(&fixture("gguf_py.gguf")).unwrap();
    assert_eq!(f.version as u64, doc["version"].as_u64().unwrap());
    assert_eq!(f.alignment, doc["alignment"].as_u64().unwrap());
    assert_eq!(f.data_offset, doc["data_offset"].as_u64().unwrap());
    assert_eq!(
        f.file_bytes().len() as u64,
        doc["file_size"].as_u64().unwrap()
    );

    let meta = doc["metadata"].as_array().unwrap();
    assert_eq!(f.metadata.len(), meta.len());
    for ((k, v), m) in f.metadata.iter().zip(meta) {
        assert_eq!(k, m["key"].as_str().unwrap());
        assert_eq!(v, &expected(m), "metadata '{k}'");
    }
    assert_eq!(f.get_f32("test.float32"), Some(0.1));
    assert_eq!(
        f.get_str_array("test.arr.string"),
        Some(vec!["<s>", "", "▁hello"])
    );

    let tensors = doc["tensors"].as_array().unwrap();
    assert_eq!(f.tensors.len(), tensors.len());
    for (t, jt) in f.tensors.iter().zip(tensors) {
        assert_eq!(t.name, jt["name"].as_str().unwrap());
        assert_eq!(
            t.ty,
            GgmlType::from_name(jt["type"].as_str().unwrap()).unwrap(),
            "{}",
            t.name
        );
        let dims: Vec<u64> = jt["dims"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(t.dims, dims, "{}", t.name);
        assert_eq!(t.offset, jt["offset"].as_u64().unwrap(), "{}", t.name);
        assert_eq!(
            f.tensor_data(t).unwrap().as_slice(),
            hex(jt["data"].as_str().unwrap()),
            "{}",
            t.name
        );
    }
}

#[test]
fn writer_reproduces_gguf_py_bytes() {
    let f = GgufFile::open(&fixture("gguf_py.gguf")).unwrap();
    let mut out = Vec::new();
    GgufWriter::from_file(&f).unwrap().write(&mut out).unwrap();
    assert!(
        out == f.file_bytes().as_slice(),
        "our writer's bytes differ from gguf-py's"
    );
}
