"""Tests of qwen_np/inspection: `inspect`, traces, the logit lens, attention views, `hardware`."""
