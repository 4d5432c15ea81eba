"""Exercise 16 (section 10): which remedy fits Qwen3-0.6B in 24 GiB.

Training Qwen3-0.6B on batches of 8 x 1,024 tokens needs more than 24 GiB. Which single remedy of section 10
brings the step under 24 GiB and keeps the same update? Set ANSWER to the name of one in
qwen_np.engine.step_memory.training_remedies(qwen_np.preset("qwen3-0.6b"), 8, 1024): "quarter_batch",
"bf16_activations", "grad_accum_4" or "recompute".
"""

ANSWER = "grad_accum_4"
