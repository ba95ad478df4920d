"""The model: Llama-family config and forward, rope, and the GGUF / safetensors loaders."""
