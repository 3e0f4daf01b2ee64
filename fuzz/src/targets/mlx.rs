//! The MLX folder loader (input: [`crate::split2`] of `config.json` and `model.safetensors`,
//! beside the tiny model's tokenizer): config parsing (quantization block, RoPE settings, shapes),
//! affine-quantized weights, then a forward pass when it loads.

pub fn run(data: &[u8]) {
    let (config, weights) = crate::split2(data);
    let dir = crate::scratch_dir().join("mlx");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch folder");
    for (name, bytes) in [
        ("config.json", config),
        ("model.safetensors", weights),
        ("tokenizer.json", super::tiny::TOKENIZER_JSON),
        ("tokenizer_config.json", super::tiny::TOKENIZER_CONFIG_JSON),
    ] {
        std::fs::write(dir.join(name), bytes).expect("scratch file");
    }
    super::forward(&dir, weights.get(..8).unwrap_or(weights));
}
