//! safetensors reader/writer. STUB: owned by the GGUF work item.
