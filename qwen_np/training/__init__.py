"""Training and evaluation: `gradients` (the backward pass by hand, op by op), `step` (loss_and_gradients,
clipping, the schedule, AdamW), `mixed` (mixed precision), `trainer` (a run: its loop, validation, export),
`run_spec` (what to run, its settings resolved), `run_state` (a run's state and its checkpoints), `resume`
(going on from them), `text_data` (a text run's windows), `parameters` (the trained arrays and their model),
`settings` (a run's presets and hyper-parameters: what `train --help` shows, without NumPy),
`run_folder` (the --out folder's lock: one trainer at a time),
`data` (corpora and the tokenizer trainer), `evaluation` (loss per token of a text), `objectives` (DPO's and GRPO's
losses and their gradients by hand, as TRL defines them), `preferences` (DPO's preference pairs: read, tokenised,
scored), `rollouts` (GRPO's prompts, the user's reward function, sampled rollouts, pass@k).

May import: engine/, files/, core/, numbers/, qwen_np.errors.
"""
from typing import Any


def __getattr__(name: str) -> Any:
    """`qwen_np.training.loss_and_gradients`, the public name, found in step.py when first asked for."""
    if name == "loss_and_gradients":
        from .step import loss_and_gradients
        return loss_and_gradients
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
