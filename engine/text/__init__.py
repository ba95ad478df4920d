"""Text in and out: tokenizers (GGUF and Hugging Face), chat templates, incremental detokenizer."""
