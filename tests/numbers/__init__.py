"""Tests of qwen_np/numbers: number formats, bit for bit."""
