"""Tests of qwen_np/engine: the fast path, the memory plan and its modes, budgets, the paged cache, threads."""
