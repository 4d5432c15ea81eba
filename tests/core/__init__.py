"""Tests of qwen_np/core: config, the forward pass, its caches and sampling, against transformers."""
