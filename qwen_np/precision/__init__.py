"""The precision lab: every number format against FP32 (`lab`), with llama-perplexity's KL statistics
(`divergence`).

May import: training/, generation/, engine/, files/, core/, numbers/, qwen_np.errors.
"""
