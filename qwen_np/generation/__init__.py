"""Generating: `generate` (the decode loop, one sequence's `Continuation`, the chat session),
`speculative` (drafters and the rejection rule), `batching` (continuous batching over the paged pool).

May import: engine/, files/, core/, numbers/, qwen_np.errors.
"""
