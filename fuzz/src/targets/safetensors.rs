//! The safetensors reader, alone on a shard in memory and through a folder with
//! `model.safetensors.index.json` (input: [`crate::split2`] of the index text and the shard).
//! Every tensor the reader accepts must have a data range of its declared size inside the file
//! and convert to f32.

use hf2q_tensor::io::safetensors::{SafeTensors, ShardedSafeTensors};
use hf2q_tensor::Bytes;

/// The shard's name when an index is given (the name the seeds' index uses).
pub const SHARD: &str = "model-00001-of-00001.safetensors";

pub fn run(data: &[u8]) {
    let (index, shard) = crate::split2(data);
    if let Ok(st) = SafeTensors::from_bytes(Bytes::from_vec(shard.to_vec())) {
        for t in &st.tensors {
            if let Ok(b) = st.tensor_data(t) {
                assert_eq!(
                    b.len(),
                    t.nbytes(),
                    "tensor '{}': data of the wrong size",
                    t.name
                );
                if let Ok(v) = st.to_f32(t) {
                    assert_eq!(
                        v.len(),
                        t.numel(),
                        "tensor '{}': f32 of the wrong length",
                        t.name
                    );
                }
            }
        }
    }
    let dir = crate::scratch_dir().join("st");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch folder");
    if index.is_empty() {
        std::fs::write(dir.join("model.safetensors"), shard).expect("scratch file");
    } else {
        std::fs::write(dir.join("model.safetensors.index.json"), index).expect("scratch file");
        std::fs::write(dir.join(SHARD), shard).expect("scratch file");
    }
    if let Ok(sharded) = ShardedSafeTensors::open_dir(&dir) {
        let names: Vec<String> = sharded.names().cloned().collect();
        for name in names {
            let (st, info) = sharded.get(&name).expect("a listed name resolves");
            if let Ok(b) = sharded.tensor_data(&name) {
                assert_eq!(b.len(), info.nbytes());
                let _ = st.to_f32(info);
            }
        }
    }
}
