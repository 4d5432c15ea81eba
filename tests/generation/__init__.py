"""Tests of qwen_np/generation: the decode loop, batching, constrained and speculative decoding, embeddings."""
