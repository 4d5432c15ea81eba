"""Tests of qwen_np/serving: `serve` through the official openai client, and its web page."""
