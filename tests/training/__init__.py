"""Tests of qwen_np/training: the backward pass, a training step, runs, LoRA, data."""
