"""What every chapter of the walkthrough shares: the traced run of the prompt, and how numbers, shapes, code
and commands are written on the page (tools/walkthrough/make_walkthrough.py assembles the chapters)."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import io
import json
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))   # run from a checkout without installing the package
sys.path.insert(0, str(REPO_ROOT / "tools" / "walkthrough"))

from qwen_np.core import layers  # noqa: E402
from qwen_np import load_model  # noqa: E402
from qwen_np.errors import QwenNPError  # noqa: E402
from qwen_np.inspection import STEPS, Step, dimensions, format_shape, resolve, token_text  # noqa: E402
from qwen_np.inspection.steps import source_line  # noqa: E402
from qwen_np.core.batch import Batch  # noqa: E402
from qwen_np.core.model import Qwen3Model  # noqa: E402
from qwen_np.files.tokenizer import Tokenizer  # noqa: E402

BUNDLED_MODEL = REPO_ROOT / "weights"
DOCS = REPO_ROOT / "docs"
WALKTHROUGH = DOCS / "walkthrough.md"
# Famous lines in the training text's layout (speaker, newline, verse). The page follows the first
# prompt cut from them whose next token the model predicts right (see choose_prompt).
PASSAGES = (
    "HAMLET:\nTo be, or not to be, that is the question",
    "KING RICHARD III:\nNow is the winter of our discontent",
    "ROMEO:\nBut soft, what light through yonder window breaks?",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
)
MIN_PROMPT_TOKENS = 6             # shorter prompts make a dull attention pattern
# A real Qwen3 tokenizer (with its chat template) for section 1's chat-template example: the first of
# these folders that has one. The bundled Shakespeare model has no chat template.
QWEN3_TOKENIZER_FOLDERS = (REPO_ROOT / "tests" / "fixtures" / "qwen3_tokenizer_random", BUNDLED_MODEL)
REAL = "qwen3-8b"                 # the real model the concept sections put numbers on
SMALL_REAL = "qwen3-0.6b"         # the smallest real Qwen3 (tied embeddings)
EXAMPLE_BANDWIDTH = 50e9          # bytes/s: a round figure for a desktop's DRAM (the doc says so)
EXAMPLE_FLOPS = 1e12              # FLOP/s: a round figure for a desktop CPU's FP32 matmul peak
LAYER = 0                         # the layer shown in full detail
ATTENTION_LAYER = 1               # the layer whose heads the attention figure shows
FIGURE_TEMPERATURES = (0.5, 1.0, 1.5)   # the distributions the sampling figure draws side by side
CACHE_TOLERANCE = 1e-4            # decode-with-cache vs full re-run logits: FP32 rounding stays far below


@dataclass
class Run:
    """One real forward pass over the prompt, with every intermediate array it traced."""

    model_dir: Path
    model: Qwen3Model
    tokenizer: Tokenizer
    prompt: str
    ids: list[int]
    answer: int                       # the true next token of the passage, which the model predicts
    arrays: dict[str, np.ndarray]     # trace name -> array, e.g. "model.layers.0.self_attn.q_proj"
    logits: np.ndarray                # [T, V]
    figures: dict[str, Any] = field(default_factory=dict)   # figure name -> the numbers it is drawn from

    def at(self, step: Step) -> np.ndarray:
        return self.arrays[step.name.format(i=LAYER)]


def choose_prompt(model: Qwen3Model, tokenizer: Tokenizer) -> tuple[str, list[int], int]:
    """The first passage prefix of at least MIN_PROMPT_TOKENS tokens, ending before a word, whose next
    token is the model's top-1 prediction: (prompt, its ids, the true next token).

    Cut at token boundaries, so the prompt's tokens are exactly the passage's first tokens.
    """
    for passage in PASSAGES:
        ids = tokenizer.encode(passage)
        predicted = np.argmax(model.forward(ids), axis=-1)                       # [T]
        for cut in range(MIN_PROMPT_TOKENS, len(ids)):
            following = tokenizer.decode([ids[cut]])
            if predicted[cut - 1] == ids[cut] and following.startswith(" ") and following[1:].isalpha():
                return tokenizer.decode(ids[:cut]), ids[:cut], ids[cut]
    raise QwenNPError("make_walkthrough: the model predicts no word of PASSAGES right (is it trained?)")


def run_prompt(model_dir: Path) -> Run:
    model = load_model(model_dir, memory="fp32", fast=False)   # every call on the readable code shown here
    tokenizer = Tokenizer.from_folder(model_dir)
    prompt, ids, answer = choose_prompt(model, tokenizer)
    if tokenizer.encode(prompt) != ids:
        raise QwenNPError(f"make_walkthrough: {prompt!r} does not encode back to the passage's tokens")
    arrays: dict[str, np.ndarray] = {}
    logits = model.forward(ids, trace=lambda name, value: arrays.__setitem__(name, value.copy()))
    if int(np.argmax(logits[-1])) != answer:
        raise QwenNPError("make_walkthrough: the prompt's top-1 prediction is not the true next token")
    return Run(model_dir, model, tokenizer, prompt, ids, answer, arrays, logits)


def model_digest(model_dir: Path) -> str:
    """The first 12 hex digits of the SHA-256 of the *.safetensors files: names the weights a page was made from."""
    digest = hashlib.sha256()
    for path in sorted(model_dir.glob("*.safetensors")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


# --- Formatting ----------------------------------------------------------------------------------

def num(x: float, digits: int = 4) -> str:
    """4 significant digits: enough to follow along, few enough to be the same on every machine."""
    text = f"{float(x):.{digits}g}"
    return "0" if text in ("-0", "0") else text


def values(v: np.ndarray, count: int = 4) -> str:
    shown = ", ".join(num(x) for x in np.ravel(v)[:count])
    return f"[{shown}, …]" if np.size(v) > count else f"[{shown}]"


def rms(v: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(v, dtype=np.float64))))


def shape_of(run: Run, step: Step, shape: tuple[str, ...] | None = None) -> str:
    dims = dimensions(run.model.config, len(run.ids))
    shape = shape or step.output
    return format_shape(shape, resolve(shape, dims))


def code_block(source: str, language: str = "python") -> str:
    return f"```{language}\n{textwrap.dedent(source).strip()}\n```"


def matrix(run: Run, rows: np.ndarray) -> str:
    """A [T, S] matrix as a markdown table, one row and one column per prompt token."""
    labels = [token_text(run.tokenizer, i) for i in run.ids]
    head = "| query \\ key | " + " | ".join(f"`{label}`" for label in labels) + " |"
    rule = "|---" * (len(labels) + 1) + "|"
    body = [f"| `{label}` | " + " | ".join("−∞" if np.isneginf(x) else num(x) for x in row) + " |"
            for label, row in zip(labels, rows)]
    return "\n".join([head, rule, *body])


def shell_quote(text: str) -> str:
    """text as one bash word: '...' when it can be, else bash's $'...' (which spells a newline \\n)."""
    if re.fullmatch(r"[^'\\\n]*", text):
        return f"'{text}'"
    return "$'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def generate_command(run: Run, *flags: str) -> str:
    """The documented `generate` command on the prompt: plain text (--no-chat), one new token, the top one
    (--temperature 0: the page's text relies on the most likely token, which sampling would not always pick)."""
    return " ".join(["python -m qwen_np generate --no-chat -n 1 --temperature 0", *flags, shell_quote(run.prompt)])


def command_stderr(run: Run, *flags: str) -> str:
    """What generate_command(run, *flags) prints on stderr, minus the stats line (it has timings).

    Run in this process on run.model_dir with one thread, as the page's other numbers are."""
    from qwen_np import cli

    err = io.StringIO()
    argv = ["generate", "--no-chat", "-n", "1", "--temperature", "0", "-t", "1", "-m", str(run.model_dir), *flags,
            run.prompt]
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(argv)
    if code != 0:
        raise QwenNPError(f"make_walkthrough: `{' '.join(argv)}` failed: {err.getvalue()}")
    return "\n".join(line for line in err.getvalue().strip("\n").splitlines() if not line.startswith("stats:"))


# --- The code that does each step ----------------------------------------------------------------



def model_code_by_step() -> dict[str, str]:
    """Step name -> the line that computes it, as inspection.steps.source_line finds it by running the
    network (Qwen3Model reports a step on the line that computes it; layers.attention and layers.swiglu
    report theirs right after it)."""
    return {step.name: source_line(step)[2] for step in STEPS}


MODEL_CODE = model_code_by_step()


# Functions a step's line uses through the batch: RoPE's tables come from Qwen3Model.pack, once a pass.
ALSO_SHOWN = {"model.layers.{i}.self_attn.rope_q": " layers.rope_angles("}


def step_code(step: Step, shown: set[str]) -> str:
    """The line of a step, then the source of each function of layers.py or method of batch.Batch it
    calls (once per page), and of the layers.py functions those methods call."""
    parts, sources = [code_block(MODEL_CODE[step.name])], [MODEL_CODE[step.name] + ALSO_SHOWN.get(step.name, "")]
    while sources:
        for called in dict.fromkeys(re.findall(r"(?<![\w.])((?:layers\.|batch\.)?\w+)\(", sources.pop(0))):
            owner, _, name = called.rpartition(".")
            where = Batch if owner == "batch" else layers
            function = getattr(where, name, None)
            key = f"{where.__name__}.{name}"
            if key in shown or not inspect.isfunction(function):
                continue
            shown.add(key)
            source = textwrap.dedent(inspect.getsource(function))
            title = f"`Batch.{name}`, from `qwen_np/core/batch.py`" if where is Batch else \
                f"`layers.{name}`, from `qwen_np/core/layers.py`"
            parts.append(f"{title}:\n\n" + code_block(source))
            if where is Batch:                                  # the layers.py functions it calls, in turn
                sources.append(source.split('"""')[-1])
    return "\n\n".join(parts)


def claim(holds: bool, what: str, where: str) -> None:
    """A sentence of the page that the run or record behind `where` (a section) must bear out: else the
    generator stops, so that text cannot drift from what the code or the measurement shows."""
    if not holds:
        raise AssertionError(f"{where}: the run or record no longer shows that {what}; re-run or re-record, then rewrite")


def qwen3_tokenizer() -> Tokenizer:
    """The real Qwen3 tokenizer of QWEN3_TOKENIZER_FOLDERS (one with a <think> chat template)."""
    for folder in QWEN3_TOKENIZER_FOLDERS:
        config = folder / "tokenizer_config.json"
        if config.is_file() and "<think>" in config.read_text(encoding="utf-8"):
            return Tokenizer.from_folder(folder)
    raise QwenNPError(f"walkthrough: no Qwen3 tokenizer with a chat template in {QWEN3_TOKENIZER_FOLDERS}")


# --- The recorded chapters (11-13): a run too slow for every test, recorded once, the page made from it ---

def read_record(path: Path, command: str, takes: str) -> dict[str, Any]:
    """A chapter's recorded run, or an AssertionError naming the command that records it (and how long it takes)."""
    if not path.is_file():
        raise AssertionError(f"{path} is missing: run `{command}` ({takes})")
    return json.loads(path.read_text(encoding="utf-8"))


def rounded(value: Any) -> Any:
    """Floats to 4 significant digits, recursively: the JSON stays small and machine-independent."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v) for v in value]
    return value


def record_main(description: str, default: Path, record: Callable[[], Any], argv: list[str] | None) -> None:
    """A chapter script's command line: run `record` and write what it returns (rounded) to --out."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=default,
                        help=f"where to write the record (default: {default.relative_to(REPO_ROOT)}, the page's source)")
    out = parser.parse_args(argv).out
    out.write_text(json.dumps(rounded(record()), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {out}")


def two(x: float) -> str:
    """Losses to 2 decimals, as the recorded chapters print them: a long run's later digits are the BLAS kernel's."""
    return f"{x:.2f}"
