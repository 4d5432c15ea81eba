"""Benchmarks of qwen_np against measured machine limits (python -m bench; see bench/README.md)."""

import qwen_np  # noqa: E402,F401  (first, before NumPy: it sets OpenBLAS's thread timeout, as the CLI gets it)
