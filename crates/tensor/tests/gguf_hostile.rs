//! Hostile GGUF input: every malformed file gives an error that names the problem, quickly and
//! without a panic or a large allocation.

use hf2q_tensor::io::gguf::{GgufFile, GgufValue, GgufWriter};
use hf2q_tensor::{Bytes, GgmlType};

/// Little-endian byte builder for hand-made headers.
#[derive(Default, Clone)]
struct B(Vec<u8>);

impl B {
    fn u32(mut self, x: u32) -> Self {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }
    fn u64(mut self, x: u64) -> Self {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }
    fn raw(mut self, x: &[u8]) -> Self {
        self.0.extend_from_slice(x);
        self
    }
    fn str(self, s: &str) -> Self {
        self.u64(s.len() as u64).raw(s.as_bytes())
    }
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> Self {
        B::default()
            .raw(b"GGUF")
            .u32(version)
            .u64(n_tensors)
            .u64(n_kv)
    }
    /// A tensor info.
    fn tensor(self, name: &str, dims: &[u64], ty: u32, offset: u64) -> Self {
        let mut b = self.str(name).u32(dims.len() as u32);
        for &d in dims {
            b = b.u64(d);
        }
        b.u32(ty).u64(offset)
    }
    /// Pads to `align` and appends `data`.
    fn data(mut self, align: usize, data: &[u8]) -> Vec<u8> {
        let padded = self.0.len().div_ceil(align) * align;
        self.0.resize(padded, 0);
        self.0.extend_from_slice(data);
        self.0
    }
}

fn parse(bytes: Vec<u8>) -> Result<GgufFile, String> {
    GgufFile::from_bytes(Bytes::from_vec(bytes)).map_err(|e| e.to_string())
}

#[track_caller]
fn assert_err(bytes: Vec<u8>, needle: &str) {
    match parse(bytes) {
        Ok(_) => panic!("parsed a malformed file; expected an error containing '{needle}'"),
        Err(e) => assert!(
            e.contains(needle),
            "error '{e}' does not contain '{needle}'"
        ),
    }
}

/// A small valid file whose last tensor ends exactly at the end of the file, so that every
/// proper prefix is missing something.
fn small_valid() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "llama").unwrap();
    w.add_metadata("general.alignment", GgufValue::U32(16))
        .unwrap();
    w.add_metadata("a.u8", 7u8).unwrap();
    w.add_metadata("a.bool", true).unwrap();
    w.add_metadata("a.f64", 2.5f64).unwrap();
    let nested = GgufValue::Array(
        hf2q_tensor::io::gguf::GgufArray::new(
            hf2q_tensor::io::gguf::GgufValueType::Array,
            vec![GgufValue::Array(
                hf2q_tensor::io::gguf::GgufArray::new(
                    hf2q_tensor::io::gguf::GgufValueType::String,
                    vec![GgufValue::from("tok")],
                )
                .unwrap(),
            )],
        )
        .unwrap(),
    );
    w.add_metadata("a.nested", nested).unwrap();
    w.add_tensor("w.f16", vec![3], GgmlType::F16, Bytes::from_vec(vec![1; 6]))
        .unwrap();
    // 2 Q8_0 blocks = 68 bytes; 16 F32 = 64 bytes = a multiple of the alignment: ends the file.
    w.add_tensor(
        "w.q8",
        vec![32, 2],
        GgmlType::Q8_0,
        Bytes::from_vec(vec![2; 68]),
    )
    .unwrap();
    w.add_tensor(
        "w.last",
        vec![4, 4],
        GgmlType::F32,
        Bytes::from_vec(vec![3; 64]),
    )
    .unwrap();
    let mut buf = Vec::new();
    w.write(&mut buf).unwrap();
    buf
}

#[test]
fn small_valid_file_parses() {
    let f = parse(small_valid()).unwrap();
    assert_eq!(f.tensors.len(), 3);
    assert_eq!(f.alignment, 16);
}

#[test]
fn every_truncation_is_an_error() {
    let full = small_valid();
    for len in 0..full.len() {
        let r = parse(full[..len].to_vec());
        assert!(r.is_err(), "prefix of {len} of {} bytes parsed", full.len());
    }
    assert!(parse(full).is_ok());
}

#[test]
fn random_corruption_never_panics() {
    // Flip bytes at pseudo-random positions (fixed seed): any outcome but a panic is acceptable.
    let full = small_valid();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..20_000 {
        let mut b = full.clone();
        for _ in 0..(next() % 4 + 1) {
            let i = (next() % b.len() as u64) as usize;
            b[i] = next() as u8;
        }
        if let Ok(f) = parse(b) {
            for t in &f.tensors {
                let d = f.tensor_data(t).unwrap();
                assert_eq!(d.len() as u64, t.nbytes());
            }
        }
    }
}

#[test]
fn magic_and_version() {
    assert_err(b"GGML\x03\0\0\0".to_vec(), "not a GGUF file");
    assert_err(B::header(1, 0, 0).0, "version 1 is not supported");
    assert_err(B::header(4, 0, 0).0, "unsupported GGUF version 4");
    assert_err(B::header(3u32.swap_bytes(), 0, 0).0, "big-endian");
    assert_err(B::header(2u32.swap_bytes(), 0, 0).0, "big-endian");
    assert!(parse(B::header(2, 0, 0).0).is_ok());
    assert!(parse(B::header(3, 0, 0).0).is_ok());
}

#[test]
fn absurd_counts_fail_fast() {
    assert_err(B::header(3, 0, u64::MAX).0, "metadata count");
    assert_err(B::header(3, 1 << 62, 0).0, "tensor count");
    assert_err(B::header(3, u64::MAX, 0).0, "tensor count");
    // A plausible-looking count just above what the remaining bytes could hold.
    assert_err(
        B::header(3, 0, 2).u64(1).raw(b"k").u32(0).raw(&[0; 12]).0,
        "metadata count 2",
    );
}

#[test]
fn absurd_string_lengths_fail_fast() {
    // Key length 2^60: must fail on the length check, not try to allocate.
    assert_err(
        B::header(3, 0, 1).u64(1 << 60).raw(&[0; 16]).0,
        "has length 1152921504606846976",
    );
    assert_err(
        B::header(3, 0, 1).u64(u64::MAX).raw(&[0; 16]).0,
        "has length",
    );
    // String value length 2^60.
    let b = B::header(3, 0, 1).str("k").u32(8).u64(1 << 60).raw(&[0; 8]);
    assert_err(b.0, "metadata 'k' has length");
    // Tensor name length past the end.
    let b = B::header(3, 1, 0).u64(1000).raw(&[0; 24]);
    assert_err(b.0, "name of tensor 0 has length 1000");
}

#[test]
fn absurd_array_counts_fail_fast() {
    let b = B::header(3, 0, 1)
        .str("k")
        .u32(9)
        .u32(0)
        .u64(1 << 60)
        .raw(&[0; 8]);
    assert_err(b.0, "claims 1152921504606846976 uint8 elements");
    // u64 elements: count * 8 overflows.
    let b = B::header(3, 0, 1)
        .str("k")
        .u32(9)
        .u32(10)
        .u64(u64::MAX / 4)
        .raw(&[0; 8]);
    assert_err(b.0, "uint64 elements");
    // Array of arrays with a huge count: bounded by 12 bytes per inner array.
    let b = B::header(3, 0, 1)
        .str("k")
        .u32(9)
        .u32(9)
        .u64(3)
        .raw(&[0; 30]);
    assert_err(b.0, "claims 3 array elements");
    // Array of strings whose inner string lengths are absurd.
    let b = B::header(3, 0, 1)
        .str("k")
        .u32(9)
        .u32(8)
        .u64(1)
        .u64(1 << 62);
    assert_err(b.0, "metadata 'k'[0] has length");
}

#[test]
fn bad_value_types() {
    assert_err(
        B::header(3, 0, 1).str("k").u32(13).raw(&[0; 8]).0,
        "metadata 'k' at offset 33 has unknown value type 13",
    );
    let b = B::header(3, 0, 1).str("k").u32(9).u32(99).u64(0);
    assert_err(b.0, "unknown array element type 99");
    assert_err(
        B::header(3, 0, 1).str("k").u32(7).raw(&[2]).0,
        "bool with byte value 2",
    );
    let b = B::header(3, 0, 1).str("k").u32(8).u64(2).raw(&[0xff, 0xfe]);
    assert_err(b.0, "not valid UTF-8");
    let b = B::header(3, 0, 1).u64(1).raw(&[0x80]).u32(4).u32(0);
    assert_err(b.0, "not valid UTF-8");
}

#[test]
fn deep_nesting_is_rejected() {
    // 100 levels of one-element arrays of arrays.
    let mut b = B::header(3, 0, 1).str("k").u32(9);
    for _ in 0..100 {
        b = b.u32(9).u64(1);
    }
    b = b.u32(0).u64(0);
    assert_err(b.0, "nests arrays deeper than");
}

#[test]
fn duplicate_metadata_key() {
    let b = B::header(3, 0, 2)
        .str("k")
        .u32(4)
        .u32(1)
        .str("k")
        .u32(4)
        .u32(2);
    assert_err(b.0, "duplicate metadata key 'k'");
}

#[test]
fn bad_alignment() {
    let kv = |v: u32| B::header(3, 0, 1).str("general.alignment").u32(4).u32(v).0;
    assert_err(
        kv(0),
        "general.alignment is 0; it must be a non-zero power of two",
    );
    assert_err(kv(48), "general.alignment is 48");
    let b = B::header(3, 0, 1).str("general.alignment").u32(8).str("32");
    assert_err(
        b.0,
        "general.alignment must be an unsigned integer, found a string",
    );
    let b = B::header(3, 0, 1)
        .str("general.alignment")
        .u32(5)
        .u32(-8i32 as u32);
    assert_err(b.0, "general.alignment must be an unsigned integer");
    // A valid custom alignment moves the data section.
    let b = B::header(3, 1, 1)
        .str("general.alignment")
        .u32(4)
        .u32(64)
        .tensor("t", &[1], 0, 0);
    let f = parse(b.data(64, &[0; 4])).unwrap();
    assert_eq!((f.alignment, f.data_offset), (64, 128));
}

#[test]
fn bad_dimensions() {
    let t = |dims: &[u64]| {
        B::header(3, 1, 0)
            .tensor("w", dims, 0, 0)
            .data(32, &[0; 64])
    };
    assert_err(t(&[1, 1, 1, 1, 1]), "tensor 'w' has 5 dimensions");
    let b = B::header(3, 1, 0).str("w").u32(u32::MAX).raw(&[0; 64]);
    assert_err(b.0, "tensor 'w' has 4294967295 dimensions");
    assert_err(
        t(&[1 << 63]),
        "tensor 'w' has dimension 9223372036854775808",
    );
    assert_err(
        t(&[1 << 32, 1 << 32]),
        "tensor 'w' has dimensions [4294967296, 4294967296] whose product overflows",
    );
    assert_err(t(&[1 << 31, 1 << 31, 4]), "product overflows");
    // Within int64, but far larger than the file.
    assert_err(t(&[1 << 40]), "tensor 'w' data");
    // Zero-sized tensors are fine.
    assert!(parse(t(&[0, 5])).is_ok());
}

#[test]
fn bad_tensor_types() {
    for id in [4u32, 5, 31, 32, 33, 1000, u32::MAX] {
        let b = B::header(3, 1, 0)
            .tensor("blk.0.w", &[32], id, 0)
            .data(32, &[0; 128]);
        assert_err(
            b,
            &format!("tensor 'blk.0.w' has unknown ggml type id {id}"),
        );
    }
    // ne0 not a whole number of blocks.
    let b = B::header(3, 1, 0)
        .tensor("blk.1.w", &[48, 2], 8, 0)
        .data(32, &[0; 256]);
    assert_err(
        b,
        "tensor 'blk.1.w' has ne0 = 48, not a multiple of the Q8_0 block size 32",
    );
    let b = B::header(3, 1, 0)
        .tensor("s", &[], 12, 0)
        .data(32, &[0; 256]);
    assert_err(
        b,
        "tensor 's' has ne0 = 1, not a multiple of the Q4_K block size 256",
    );
}

#[test]
fn bad_offsets() {
    // Data past the end of the file.
    let b = B::header(3, 1, 0)
        .tensor("w", &[16], 0, 0)
        .data(32, &[0; 63]);
    assert_err(b, "tensor 'w' data");
    let b = B::header(3, 1, 0)
        .tensor("w", &[16], 0, 1 << 40)
        .data(32, &[0; 64]);
    assert_err(b, "extends past the end of the file");
    let b = B::header(3, 1, 0)
        .tensor("w", &[16], 0, u64::MAX - 31)
        .data(32, &[0; 64]);
    assert_err(b, "tensor 'w' data");
    // Unaligned offset.
    let b = B::header(3, 1, 0)
        .tensor("w", &[1], 0, 4)
        .data(32, &[0; 64]);
    assert_err(
        b,
        "tensor 'w' has data offset 4, not a multiple of the alignment 32",
    );
    // Overlapping data.
    let b = B::header(3, 2, 0)
        .tensor("a", &[16], 0, 0)
        .tensor("b", &[16], 0, 32);
    assert_err(b.data(32, &[0; 128]), "tensor data of 'a' and 'b' overlap");
    // Same offset for two tensors.
    let b = B::header(3, 2, 0)
        .tensor("a", &[1], 0, 0)
        .tensor("b", &[1], 0, 0);
    assert_err(b.data(32, &[0; 64]), "overlap");
    // Gaps and out-of-order offsets are allowed by the spec.
    let b = B::header(3, 2, 0)
        .tensor("a", &[1], 0, 64)
        .tensor("b", &[1], 0, 0);
    assert!(parse(b.data(32, &[0; 96])).is_ok());
    // Tensors present but the data section starts past the end of the file.
    let b = B::header(3, 1, 0).tensor("a", &[0], 0, 0);
    assert_err(b.0, "past the end of the file");
}

#[test]
fn duplicate_tensor_names() {
    let b = B::header(3, 2, 0)
        .tensor("w", &[1], 0, 0)
        .tensor("w", &[1], 0, 32);
    assert_err(b.data(32, &[0; 64]), "duplicate tensor name 'w'");
}

#[test]
fn tensor_data_checks_user_made_infos() {
    let f = parse(small_valid()).unwrap();
    let mut t = f.tensors[0].clone();
    t.offset = u64::MAX;
    assert!(f
        .tensor_data(&t)
        .unwrap_err()
        .to_string()
        .contains("overflows"));
    t.offset = 1 << 20;
    assert!(f
        .tensor_data(&t)
        .unwrap_err()
        .to_string()
        .contains("past the end"));
}

#[test]
fn open_names_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("broken.gguf");
    std::fs::write(&p, b"GGUF\x01\0\0\0").unwrap();
    let e = GgufFile::open(&p).unwrap_err().to_string();
    assert!(e.contains("broken.gguf") && e.contains("version 1"), "{e}");
    let e = GgufFile::open(&dir.path().join("missing.gguf"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing.gguf"), "{e}");
}
