"""Qwen3 itself, what a student reads: `config` (the checkpoint's config.json, the dimension symbols, the
tensor table), `layers` (the math, one small pure function per step), `model` (the network: those functions in
order), `kv_cache` (the contiguous cache a learner reads in one screen), `sampling` (logits -> a token).

May import: numbers/ and qwen_np.errors. Nothing here knows files, threads, servers or training.
"""
