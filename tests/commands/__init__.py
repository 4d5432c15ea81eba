"""Tests of qwen_np/commands and cli.py: `python -m qwen_np` as a user meets it."""
