"""Generating: `generate` (the decode loop, one sequence's `Continuation`, the chat session),
`speculative` (drafters and the rejection rule), `batching` (continuous batching over the paged pool),
`constraints` (grammars that mask what may come next), `logprobs` (each chosen token's log-probabilities),
`tool_calls` (Qwen3's calls read out of a reply), `embedding` (Qwen3-Embedding's vectors).

May import: engine/, files/, core/, numbers/, qwen_np.errors.
"""
