"""Every exercise: its number, the walkthrough section it follows, its one line, its solution module, and
the stub `exercises start N` writes, made from that solution.

Why the stub is made from the solution and not written beside it: one file then states the task (the
module's docstring), the names and signatures the check calls, and the answer; blanking every function's body
and every ANSWER cannot leave a stub whose names disagree with its check.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import QwenNPError

SOLUTIONS = "qwen_np.exercises.solutions"
BLANK_BODY = 'raise NotImplementedError("write this")'
BLANK_ANSWER = "ANSWER = None   # your answer"


@dataclass(frozen=True)
class Exercise:
    number: int
    section: str            # the walkthrough's section it follows, as its heading numbers it ("3.7")
    module: str             # the solution's module in solutions/, also the learner's file name (+ ".py")
    line: str               # what it asks, in one line

    @property
    def file_name(self) -> str:
        return f"{self.module}.py"

    def solution_path(self) -> Path:
        return Path(str(resources.files(SOLUTIONS).joinpath(self.file_name)))

    def solution_source(self) -> str:
        return self.solution_path().read_text(encoding="utf-8")

    def task(self) -> str:
        """The solution module's docstring: the exercise's text, as the walkthrough and the stub show it."""
        return ast.get_docstring(ast.parse(self.solution_source())) or ""


EXERCISES = tuple(Exercise(number, section, module, line) for number, (section, module, line) in enumerate([
    ("1", "e01_chat_tokens", "the token ids of a chat prompt, thinking off"),
    ("1", "e02_bpe_merges", "build it: learn BPE merges (graded against tokenizers' BpeTrainer)"),
    ("2", "e03_embedding_backward", "the embedding table's gradient, repeated tokens included"),
    ("3.1", "e04_rms_norm", "build it: rms_norm"),
    ("3.3", "e05_gqa_heads", "which key head each query head reads (np.repeat, not np.tile)"),
    ("3.7", "e06_rope", "build it: rope, half-split pairs, at any positions"),
    ("3.9", "e07_attention", "build it: causal grouped-query attention"),
    ("3.17", "e08_swiglu", "build it: the SwiGLU MLP"),
    ("4", "e09_logit_lens", "the logit lens: the final norm and LM head on any layer's stream"),
    ("5", "e10_minus_log_p", "the loss of one prediction, by hand, without overflow"),
    ("5", "e11_cross_entropy", "build it: softmax cross-entropy and its gradient"),
    ("6", "e12_kv_cache_bytes", "the KV cache's bytes per token"),
    ("7", "e13_bf16_rounding", "round FP32 to BF16, ties to even"),
    ("8", "e14_decode_bound", "the fastest decode a memory bus allows"),
    ("9", "e15_rms_norm_backward", "build it: RMSNorm's backward (finite differences)"),
    ("10", "e16_memory_remedy", "which remedy fits Qwen3-0.6B's training step in 24 GiB"),
    ("10", "e17_flash_attention", "FlashAttention's online softmax, one block of keys at a time"),
    ("11", "e18_divergence", "the learning rate at which training diverges"),
    ("12", "e19_layer_parameters", "one layer's parameters, and what each ablation removes"),
    ("13", "e20_lora", "a LoRA adapter's product and its merged weight"),
    ("14", "e21_speculative", "speculative decoding's acceptance rule keeps the target's distribution"),
    ("15", "e22_pass_at_k", "pass@k without bias, as a product (the binomials overflow a float)"),
    ("16", "e23_decoder_layer", "build it: your pieces assembled into a decoder layer, logits equal to Qwen3Model's"),
], start=1))


def exercise(number: int) -> Exercise:
    """Exercise `number`; a QwenNPError naming the range otherwise."""
    if not 1 <= number <= len(EXERCISES):
        raise QwenNPError(f"no exercise {number}: they are numbered 1 to {len(EXERCISES)} "
                          "(`python -m qwen_np exercises` lists them)", param="number")
    return EXERCISES[number - 1]


def stub_text(source: str) -> str:
    """A solution's source with every top-level function's body (after its docstring) replaced by
    BLANK_BODY, every `ANSWER = ...` by BLANK_ANSWER, and its imports of other solutions made imports of
    the learner's files beside it."""
    lines = source.splitlines()
    replaced: list[tuple[int, int, str]] = []            # (first line, last line, text), 0-based, inclusive
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef):
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            indent = " " * body[0].col_offset
            replaced.append((body[0].lineno - 1, node.end_lineno - 1 if node.end_lineno else body[-1].lineno - 1,
                             indent + BLANK_BODY))
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "ANSWER" for t in node.targets):
            replaced.append((node.lineno - 1, (node.end_lineno or node.lineno) - 1, BLANK_ANSWER))
    for first, last, text in reversed(replaced):
        lines[first:last + 1] = [text]
    return "\n".join(lines).replace(f"from {SOLUTIONS}.", "from ") + "\n"


def stub(number: int) -> str:
    return stub_text(exercise(number).solution_source())


def grade(number: int, path: Path | None, setting: Any = None) -> Any:
    """The Report of exercise `number`'s check on the file at `path` (None: the reference solution)."""
    from .checks import CHECKS, Setting
    from .grading import Report, load

    import numpy as np

    entry = exercise(number)
    report = Report()
    path = path or entry.solution_path()
    with np.errstate(all="ignore"):          # a wrong answer's NaN and overflow are graded, not warned about
        try:
            module = load(path, f"{entry.module}_graded")
        except QwenNPError:
            raise
        except Exception as problem:         # a syntax error, an import of a piece not written yet: wrong, not bad input
            report.wrong.append(f"loading {path.name}: {type(problem).__name__}: {problem}{load_hint(problem)}")
            return report
        CHECKS[entry.module](module, report, setting or Setting())
    return report


def load_hint(problem: Exception) -> str:
    """What to do about a file that did not load: the exercise that writes a missing piece, or where it failed."""
    if isinstance(problem, SyntaxError):
        return ""                                          # its message names the file and line already
    piece = next((e for e in EXERCISES if isinstance(problem, ModuleNotFoundError) and problem.name == e.module), None)
    if piece is not None:
        return f" (`python -m qwen_np exercises start {piece.number}` writes it beside this file)"
    from .grading import where

    return f" ({where(problem)})"
