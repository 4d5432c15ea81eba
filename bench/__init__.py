"""Benchmarks of qwen_np against measured machine limits (python -m bench; see bench/README.md)."""
