"""The engine: running Qwen3 fast and in budget. `runtime` (threads, BLAS, allocation, RSS and its peak),
`budget` (the context a run gets, the KV pool's blocks, prefill chunks), `memory` (the inference memory plan),
`step_memory` (what a training step holds), `sizes` (512MiB as people write it), `fast` (FastQwen3Model, the
tested fast twin of core.model), `moe` (its mixture-of-experts block), `finite` (non-finite logits stopped and
traced to a layer), `weight_cache` (the FP32 cache of a checkpoint), `paged` (the paged KV pool), `loading`
(load_model: files -> a model, held as the plan says).

May import: files/, core/, numbers/, qwen_np.errors.
"""
