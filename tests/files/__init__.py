"""Tests of qwen_np/files: checkpoints, GGUF files, the tokenizer and chat template, adapters' folders."""
