//! Split GGUF models (llama.cpp's `PREFIX-0000i-of-0000N.gguf`): the tiny Llama converted to one
//! GGUF file and that file split into parts load as the same model (same tensors byte for byte,
//! same metadata, the same logits bit for bit); a missing part, a later part given first and a
//! part of another split are refused by name.

use std::path::{Path, PathBuf};

use hf2q_models::convert::source::SourceModel;
use hf2q_models::convert::{convert, ConvertTarget, NoProgress};
use hf2q_models::Model;
use hf2q_tensor::io::gguf::{write_split, GgufFile};

fn tiny_gguf(dir: &Path) -> PathBuf {
    let src = SourceModel::open(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny/tiny-llama"),
    )
    .unwrap();
    let out = dir.join("whole.gguf");
    convert(&src, &out, &ConvertTarget::Gguf(None), &NoProgress).unwrap();
    out
}

fn logits(path: &Path) -> Vec<f32> {
    let mut m = Model::load(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    m.set_matmul_path(hf2q_cpu::MatmulPath::Reference);
    let ids = [1u32, 5, 9, 2, 7, 3];
    m.session(ids.len()).forward_all(&ids).unwrap().into_data()
}

/// Splits the whole file into parts of at most a quarter of its tensor data.
fn split(whole: &Path, dir: &Path) -> Vec<PathBuf> {
    let f = GgufFile::open(whole).unwrap();
    let data: u64 = f.tensors.iter().map(|t| t.nbytes()).sum();
    let parts = write_split(&f, &dir.join("tiny"), data / 4).unwrap();
    assert!(parts.len() >= 4, "{} parts", parts.len());
    parts
}

#[test]
fn split_parts_load_as_the_whole_file() {
    let dir = tempfile::tempdir().unwrap();
    let whole = tiny_gguf(dir.path());
    let parts = split(&whole, dir.path());
    assert_eq!(
        parts[0].file_name().unwrap().to_string_lossy(),
        format!("tiny-00001-of-{:05}.gguf", parts.len())
    );

    let (a, b) = (
        GgufFile::open(&whole).unwrap(),
        GgufFile::open_joined(&parts[0]).unwrap(),
    );
    assert_eq!(b.part_count(), parts.len());
    assert_eq!(a.metadata, b.metadata, "joined metadata without split.*");
    assert_eq!(a.tensors.len(), b.tensors.len());
    for (x, y) in a.tensors.iter().zip(&b.tensors) {
        assert_eq!((&x.name, &x.dims, x.ty), (&y.name, &y.dims, y.ty));
        assert_eq!(
            a.tensor_data(x).unwrap().as_slice(),
            b.tensor_data(y).unwrap().as_slice(),
            "{}",
            x.name
        );
    }
    // The only later part holding a tensor stored in part 1 would pass by accident: make sure the
    // last tensor really lives in the last part.
    let last = GgufFile::open(parts.last().unwrap()).unwrap();
    assert!(last
        .tensors
        .iter()
        .any(|t| t.name == b.tensors.last().unwrap().name));
    assert!(last.get("general.architecture").is_none());

    // Same bytes, same arithmetic: bit-identical logits.
    assert_eq!(logits(&whole), logits(&parts[0]));
    // `SourceModel` (convert, quantize) joins the parts too.
    let s = SourceModel::open(&parts[0]).unwrap();
    assert_eq!(s.tensors.len(), a.tensors.len());
}

#[test]
fn bad_splits_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let whole = tiny_gguf(dir.path());
    let parts = split(&whole, dir.path());
    let n = parts.len();

    let e = Model::load(&parts[1]).err().unwrap().to_string();
    assert!(
        e.contains(&format!("part 2 of {n}")) && e.contains("00001-of-"),
        "{e}"
    );

    // A part of another split model (same name, other count) in place of part 2.
    let other = dir.path().join("other");
    std::fs::create_dir(&other).unwrap();
    let f = GgufFile::open(&whole).unwrap();
    let data: u64 = f.tensors.iter().map(|t| t.nbytes()).sum();
    let others = write_split(&f, &other.join("tiny"), data / 2).unwrap();
    let keep = dir.path().join("part2");
    std::fs::rename(&parts[1], &keep).unwrap();
    std::fs::copy(&others[1], &parts[1]).unwrap();
    let e = Model::load(&parts[0]).err().unwrap().to_string();
    assert!(e.contains(&format!("part 2 of {n} expected")), "{e}");
    std::fs::rename(&keep, &parts[1]).unwrap();

    std::fs::remove_file(&parts[n - 1]).unwrap();
    let e = GgufFile::open_joined(&parts[0]).unwrap_err().to_string();
    assert!(
        e.contains(&format!("part {n}")) && e.contains("missing"),
        "{e}"
    );
}
