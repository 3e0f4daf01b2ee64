//! The GGUF reader: header, metadata, tensor table and data ranges; then what a reader promises
//! (every tensor's bytes lie inside the file, dequantization works on them), a write/read round
//! trip that must give back the same metadata and tensor table, and a forward pass on the model
//! the file describes when it describes one.

use hf2q_tensor::io::gguf::{GgufFile, GgufWriter};
use hf2q_tensor::Bytes;

pub fn run(data: &[u8]) {
    let Ok(file) = GgufFile::from_bytes(Bytes::from_vec(data.to_vec())) else {
        return;
    };
    for t in &file.tensors {
        let bytes = file.tensor_data(t);
        if let Ok(b) = &bytes {
            assert_eq!(
                b.len() as u64,
                t.nbytes(),
                "tensor '{}': data range of the wrong size",
                t.name
            );
            // Dequantize the first row (bounded work per tensor).
            let ne0 = t.dims.first().copied().unwrap_or(1) as usize;
            let bs = t.ty.block_size();
            if ne0 > 0 && ne0 <= 1 << 16 && ne0 % bs == 0 {
                let row_bytes = ne0 / bs * t.ty.type_size();
                if row_bytes <= b.len() {
                    let mut dst = vec![0f32; ne0];
                    let _ =
                        hf2q_tensor::quant::dequantize(t.ty, &b.as_slice()[..row_bytes], &mut dst);
                }
            }
        }
    }
    round_trip(&file);
    if file.tensors.is_empty() {
        return;
    }
    let path = super::scratch_file("model.gguf", data);
    super::forward(&path, data);
}

/// Writing what was read and reading it again gives the same metadata and tensor table.
fn round_trip(file: &GgufFile) {
    let Ok(w) = GgufWriter::from_file(file) else {
        return;
    };
    let mut out = Vec::new();
    w.write(&mut out)
        .expect("writing back a GGUF file that was just read");
    let again = GgufFile::from_bytes(Bytes::from_vec(out)).expect("reading back what was written");
    // Debug strings: NaN metadata values compare equal this way.
    assert_eq!(
        format!("{:?}", file.metadata),
        format!("{:?}", again.metadata),
        "metadata changed in a write/read round trip"
    );
    assert_eq!(file.tensors.len(), again.tensors.len());
    for (a, b) in file.tensors.iter().zip(&again.tensors) {
        assert_eq!((&a.name, &a.dims, a.ty), (&b.name, &b.dims, b.ty));
        assert_eq!(
            file.tensor_data(a).map(|d| d.as_slice().to_vec()).ok(),
            again.tensor_data(b).map(|d| d.as_slice().to_vec()).ok(),
            "tensor '{}' data changed in a round trip",
            a.name
        );
    }
}
