"""Tests of qwen_np/precision: the precision lab and its KL statistics."""
