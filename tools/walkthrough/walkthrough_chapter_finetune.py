"""The walkthrough's chapter "Fine-tune one yourself": the bundled model taught a task on chats, by LoRA at two
ranks and by full fine-tuning, side by side.

The task: the user quotes a speech's first line as the plays write it (the speaker, a colon, the line)
and asks "Who says this?"; the assistant answers with the speaker's name, nothing else. The base cannot
do it (it has never seen a chat turn: it goes on writing a play), yet the answer is in the question, so
what the tuning must teach is a format and one rule (copy the heading): minutes of a shared CPU do.
The chats are distinct speeches of the bundled model's training plays; the held-out questions are other
speeches of those plays, never trained on, and a harder test beside them asks about the validation
plays, which neither the bundled model nor the tuning ever read (most of their speakers are names it
never saw: there the tuned model often completes a name's first piece as a name it knows).

The bundled model has no chat template (weights/README.md), so the chapter builds its instruct-style
base honestly: the bundled weights unchanged, with CHAT_TEMPLATE (a minimal ChatML layout) written into
a copy of its tokenizer_config.json. Its tokenizer has no <|im_start|> / <|im_end|> tokens, so those
markers are plain text to it, a few tokens each; training.chats finds the assistant's tokens by their
characters, so its mask is the same rule as for a real Qwen3.

Like the training chapter, the runs are RECORDED: `python tools/walkthrough/walkthrough_chapter_finetune.py` runs
each TUNINGS command (`python -m qwen_np train ...`, as its own process, its CPU time and peak RSS measured),
writes docs/figures/finetune_run.json with the exact commands, and the page and its figure are rendered from
it. tests/product/test_walkthrough.py repeats the base's held-out loss and the first steps of CHECKED_RUNS by
their commands (check_first_steps). The page prints losses to 2 decimals and answers as counts: their
later digits would be the BLAS kernel's.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from pprint import pformat
from typing import Any, Callable

import numpy as np
from threadpoolctl import threadpool_limits

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tools" / "walkthrough"))

from qwen_np.core.adapters import Adapter  # noqa: E402
from qwen_np.core.config import LAYER_MATRICES, parameter_count  # noqa: E402
from qwen_np.core.model import Qwen3Model  # noqa: E402
from qwen_np.core.sampling import SamplingParams  # noqa: E402
from qwen_np.engine import step_memory  # noqa: E402
from qwen_np.engine.loading import attach_adapter, load_model  # noqa: E402
from qwen_np.files.adapter import read_adapter  # noqa: E402
from qwen_np.files.tokenizer import Tokenizer  # noqa: E402
from qwen_np.generation.generate import generate  # noqa: E402
from qwen_np.training import chats, data, evaluation, run_state  # noqa: E402
from walkthrough_training import mib  # noqa: E402
import walkthrough_common  # noqa: E402
from walkthrough_common import two  # noqa: E402

RECORD = REPO_ROOT / "docs" / "figures" / "finetune_run.json"
BUNDLED = walkthrough_common.BUNDLED_MODEL
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")
# ChatML, as Qwen3 writes its turns, without tools or <think> blocks (the bundled model never reasons).
CHAT_TEMPLATE = ("{%- for message in messages %}"
                 "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
                 "{%- endfor %}"
                 "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
SPEAKER = re.compile(r"^([A-Z][A-Za-z' ]*[A-Za-z]):$")    # a speech's heading, e.g. "KING CLAUDIUS:"
MAX_LINE = 40                     # characters of a quoted line: the chats stay short
TRAIN_CHATS = 1280
HELD_OUT_CHATS = 48
BASE_NAME = "chat_base"           # the base's folder, beside the chat files, in the commands
# Every run's settings but the learning rate (each run's own): the same batches in the same order for all.
RUN: dict[str, Any] = {"steps": 160, "batch_size": 8, "context": 128, "warmup": 8, "eval_every": 80, "seed": 0,
                       "threads": 2, "shards": 2}
# The runs side by side: LoRA at two ranks, alpha chosen by rsLoRA's rule, and every weight. rsLoRA's rule: the
# factor alpha / r that the adapter is scaled by (LoRA's, peft's default) set to RS_ALPHA / sqrt(r), i.e.
# --lora-alpha RS_ALPHA sqrt(r): 4 at rank 2, 8 at rank 8.
RS_ALPHA = 2 * 2 ** 0.5           # rank 2's factor alpha / r = 2, the default alpha = 2r's
TUNINGS: tuple[dict[str, Any], ...] = (
    {"key": "lora2", "name": "LoRA rank 2", "rank": 2, "alpha": 4.0, "lr": 1e-2},
    {"key": "lora8", "name": "LoRA rank 8", "rank": 8, "alpha": 8.0, "lr": 1e-2},
    {"key": "full", "name": "full fine-tune", "rank": None, "alpha": None, "lr": 1e-3},
)
MAIN = "lora2"                    # the run whose adapter and merged model are compared
ANSWER_TOKENS = 12                # greedy tokens generated per answer (a name and <|im_end|> take fewer)
CHECKED_RUNS = ("lora2", "full")  # the runs whose first steps the drift test repeats
CHECKED_STEPS = 2


# --- The task -------------------------------------------------------------------------------------------

def speeches(play: str) -> list[tuple[str, str]]:
    """(speaker, first line) of every speech of the play's text whose first line is words (not a stage direction)."""
    found = []
    for block in play.split("\n\n"):
        lines = block.strip().splitlines()
        if len(lines) >= 2 and SPEAKER.match(lines[0]) and not lines[1].startswith("["):
            found.append((lines[0][:-1], lines[1]))
    return found


def speech_pool(plays: tuple[str, ...]) -> list[tuple[str, str]]:
    """Every distinct (speaker, first line) of `plays` whose line has at most MAX_LINE characters, in the plays'
    order (distinct: "My lord." said twice by one speaker is one question, so no question is both trained and
    held out)."""
    texts = data.shakespeare_plays()
    found = [speech for play in plays for speech in speeches(texts[play]) if len(speech[1]) <= MAX_LINE]
    return list(dict.fromkeys(found))


def question(speaker: str, line: str) -> list[dict[str, str]]:
    """One chat: the speech as the play writes it, "Who says this?", and the speaker's name."""
    return [{"role": "user", "content": f"{speaker}:\n{line}\n\nWho says this?"}, {"role": "assistant", "content": speaker}]


def task_chats() -> tuple[list[list[dict[str, str]]], list[list[dict[str, str]]], list[list[dict[str, str]]]]:
    """(training chats; held-out chats, other speeches of the same plays; chats of the validation split's plays,
    which neither the bundled model nor the tuning ever read), drawn at random."""
    drawn = random.Random(0).sample(speech_pool(data.SPLITS["train"]), TRAIN_CHATS + HELD_OUT_CHATS)
    unread = random.Random(1).sample(speech_pool(data.SPLITS["validation"]), HELD_OUT_CHATS)
    return ([question(*speech) for speech in drawn[:TRAIN_CHATS]], [question(*speech) for speech in drawn[TRAIN_CHATS:]],
            [question(*speech) for speech in unread])


def write_chats(path: Path, conversations: list[list[dict[str, str]]]) -> Path:
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations), encoding="utf-8")
    return path


def chat_model(folder: Path) -> Path:
    """The bundled model's files with CHAT_TEMPLATE added to its tokenizer_config.json: the base the chapter tunes."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in CHECKPOINT_FILES:
        shutil.copyfile(BUNDLED / name, folder / name)
    config = json.loads((BUNDLED / "tokenizer_config.json").read_text(encoding="utf-8"))
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}, indent=1),
                                                  encoding="utf-8")
    return folder


# --- Scoring a model ------------------------------------------------------------------------------------

def held_out_loss(model: Qwen3Model, tokenizer: Tokenizer, path: Path) -> dict[str, Any]:
    """`eval --text held_out.jsonl`'s figures: the mean loss over the assistant's tokens, and their count."""
    conversations = chats.encoded_chats(tokenizer, path)
    summary = evaluation.score_text(model.forward, [c.ids for c in conversations], 1, RUN["context"],
                                    learned=[c.learned for c in conversations]).summary()
    return {"loss": summary["loss_per_token"], "tokens": summary["tokens"]}


def answer(model: Qwen3Model, tokenizer: Tokenizer, question: str) -> str:
    """The greedy reply to `question`: ANSWER_TOKENS tokens, or fewer ending in <|im_end|> (which the bundled
    tokenizer writes as text) when it wrote one."""
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                            add_generation_prompt=True))
    events = generate(model, tokenizer, prompt, SamplingParams(temperature=0), ANSWER_TOKENS,
                      stop=(chats.TURN_END,))
    replied = list(events)
    ended = replied[-1].finish_reason == "stop"      # it wrote <|im_end|>, which the text leaves out
    return "".join(event.text for event in replied) + (chats.TURN_END if ended else "")


def answers(model: Qwen3Model, tokenizer: Tokenizer, conversations: list[list[dict[str, str]]]) -> list[str]:
    return [answer(model, tokenizer, messages[0]["content"]) for messages in conversations]


def name_in(reply: str) -> str:
    """The name a reply gives: its text up to the first "<" (where its <|im_end|> begins, however well spelt)."""
    return reply.split("<")[0].strip()


# --- The runs -------------------------------------------------------------------------------------------

def command(tuning: dict[str, Any], steps: int = RUN["steps"]) -> list[str]:
    """The `python -m qwen_np` arguments of one run, in the folder that holds chat_base/, train.jsonl and
    held_out.jsonl; stopped after `steps` (--decay-steps keeps the learning-rate schedule RUN's)."""
    settings = {**RUN, "steps": steps, "decay_steps": RUN["steps"], "lr": tuning["lr"]}
    flags = [word for key, value in settings.items() for word in (f"--{key.replace('_', '-')}", f"{value:g}")]
    adapters = [] if tuning["rank"] is None else ["--lora", str(tuning["rank"]), "--lora-alpha", f"{tuning['alpha']:g}"]
    return ["train", "--model", BASE_NAME, "--data", "train.jsonl", "--val", "held_out.jsonl", *adapters,
            "--out", tuning["key"], *flags]


def shown(arguments: list[str]) -> str:
    """A command as a reader types it."""
    return "python -m qwen_np " + shlex.join(arguments)


Chats = list[list[dict[str, str]]]


def prepare(folder: Path) -> tuple[Path, Tokenizer, Chats, Chats]:
    """Write what the commands read into `folder`: chat_base/, train.jsonl and held_out.jsonl; returns
    (the base's folder, its tokenizer, the held-out chats, the unread plays' chats)."""
    base = chat_model(folder / BASE_NAME)
    train_chats, held_chats, unread_chats = task_chats()
    write_chats(folder / "train.jsonl", train_chats)
    write_chats(folder / "held_out.jsonl", held_chats)
    return base, Tokenizer.from_folder(base), held_chats, unread_chats


def measured_command(folder: Path, arguments: list[str]) -> dict[str, Any]:
    """Run `python -m qwen_np ARGUMENTS` in `folder` as its own process (this checkout's qwen_np): its wall and
    CPU seconds and its peak RSS (os.wait4's, this process alone), with the load average before and after (the
    machine is shared: wall time is the load's as much as the run's)."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "qwen_np", *arguments], cwd=folder, env=environment,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert process.stderr is not None
    errors = process.stderr.read()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise RuntimeError(f"{shown(arguments)} failed ({process.returncode}): {errors.decode()[-2000:]}")
    return {"wall_s": time.perf_counter() - started, "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_rss": usage.ru_maxrss * 1024, "load_average": [load_before, os.getloadavg()[0]]}


def run_history(out: Path) -> dict[str, Any]:
    """A finished run's training losses (one a step) and held-out losses (one each --eval-every), from OUT's
    last checkpoint."""
    meta = run_state.load_state(out / "last.safetensors")[3]
    return {"loss": [r["loss"] for r in meta["history"]],
            "evals": [{"step": e["step"], "loss": e["loss_per_token"]} for e in meta["evals"]]}


def tuned_run(folder: Path, tokenizer: Tokenizer, conversations: Chats, unread: Chats,
              tuning: dict[str, Any]) -> dict[str, Any]:
    """One run of `tuning` by its command: its losses, time and memory, and the tuned model's (OUT/model's)
    held-out loss and answers (to the held-out questions and to the unread plays')."""
    arguments = command(tuning)
    measured = measured_command(folder, arguments)
    out = folder / tuning["key"]
    tuned = load_model(out / "model", memory="fp32")
    rank = tuning["rank"]
    plan = step_memory.training_memory(tuned.config, RUN["batch_size"], RUN["context"], lora_rank=rank or 0,
                                       lora_targets=LAYER_MATRICES if rank else ())
    files = {} if rank is None else {name: (out / "adapter" / name).stat().st_size
                                     for name in ("adapter_config.json", "adapter_model.safetensors")}
    return {**tuning, "command": shown(arguments), **run_history(out),
            "trainable": parameter_count(tuned.config) if rank is None else
            step_memory.lora_parameters(tuned.config, rank, LAYER_MATRICES),
            "held_out": held_out_loss(tuned, tokenizer, folder / "held_out.jsonl"),
            "answers": answers(tuned, tokenizer, conversations), "unread_answers": answers(tuned, tokenizer, unread),
            "adapter_bytes": files,
            "memory": {k: v for k, v in plan.items() if k != "activations_per_token"},
            "planned_peak": step_memory.training_total(plan), **measured}


def merging(run: Path, base: Path, tokenizer: Tokenizer, conversations: list[list[dict[str, str]]]) -> dict[str, Any]:
    """The adapter applied without merging (generate --lora) against the merged OUT/model: the same answers?"""
    model = load_model(base, memory="fp32")
    adapter: Adapter = read_adapter(run / "adapter", model.config)
    attach_adapter(model, adapter)
    merged = load_model(run / "model", memory="fp32")
    adapted, by_merged = answers(model, tokenizer, conversations), answers(merged, tokenizer, conversations)
    return {"same": adapted == by_merged, "answers": adapted,
            "model_bytes": (run / "model" / "model.safetensors").stat().st_size}


def record(progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Everything the chapter shows, by running its commands (tens of minutes on 2 shared cores; the record keeps
    each run's seconds)."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as name, threadpool_limits(limits=1):
        folder = Path(name)
        base, tokenizer, held_chats, unread_chats = prepare(folder)
        model = load_model(base, memory="fp32")
        before = {"held_out": held_out_loss(model, tokenizer, folder / "held_out.jsonl"),
                  "answers": answers(model, tokenizer, held_chats), "unread_answers": answers(model, tokenizer, unread_chats)}
        progress(f"base scored: {right(before['answers'], held_chats)} right ({time.perf_counter() - started:.0f} s)")
        runs = []
        for tuning in TUNINGS:
            runs.append(tuned_run(folder, tokenizer, held_chats, unread_chats, tuning))
            progress(f"{tuning['key']}: held-out loss {runs[-1]['held_out']['loss']:.3f}, "
                     f"{right(runs[-1]['answers'], held_chats)} right, {right(runs[-1]['unread_answers'], unread_chats)} "
                     f"of the unread plays', {runs[-1]['cpu_s']:.0f} s CPU "
                     f"({time.perf_counter() - started:.0f} s)")
        merged = merging(folder / MAIN, base, tokenizer, held_chats)
    train_chats = task_chats()[0]
    return {"run": RUN, "train_chats": TRAIN_CHATS, "held_out_chats": held_chats, "unread_chats": unread_chats,
            "train_example": train_chats[0],
            "plays": {"train": len(data.SPLITS["train"]), "held_out": list(data.SPLITS["validation"])},
            "base": before, "runs": runs, "merging": merged,
            "seconds": round(time.perf_counter() - started), "cores": os.cpu_count()}


def main(argv: list[str] | None = None) -> None:
    walkthrough_common.record_main("Run the walkthrough's fine-tuning chapter (tens of minutes on 2 cores) "
                                   "and record what it shows.", RECORD, record, argv)


def check_first_steps(recorded: dict[str, Any], keys: tuple[str, ...] = CHECKED_RUNS,
                      steps: int = CHECKED_STEPS) -> None:
    """Repeat the base's held-out loss and the first steps of the runs `keys`, each by its recorded command
    (through qwen_np's command line, in this process) stopped after `steps`; raise naming the first figure that
    differs from the record beyond rounding (rtol 1e-3: the record keeps 4 digits)."""
    from qwen_np.cli import main as qwen_np_main

    runs = {run["key"]: run for run in recorded["runs"]}
    with tempfile.TemporaryDirectory() as name, threadpool_limits(limits=1), contextlib.chdir(name):
        folder = Path(name)
        base, tokenizer, _, _ = prepare(folder)
        fresh = {"the base's held-out loss": [held_out_loss(load_model(base, memory="fp32"), tokenizer,
                                                            folder / "held_out.jsonl")["loss"]]}
        wanted = {"the base's held-out loss": [recorded["base"]["held_out"]["loss"]]}
        for key in keys:
            tuning = next(t for t in TUNINGS if t["key"] == key)
            if shown(command(tuning)) != runs[key]["command"]:
                raise AssertionError(f"{key}'s command is `{shown(command(tuning))}` now, `{runs[key]['command']}` "
                                     f"in {RECORD.name}: re-record")
            with contextlib.redirect_stderr(io.StringIO()):
                if qwen_np_main(command(tuning, steps)):
                    raise AssertionError(f"{shown(command(tuning, steps))} failed")
            fresh[f"{key}'s training losses"] = run_history(folder / key)["loss"]
            wanted[f"{key}'s training losses"] = runs[key]["loss"][:steps]
    for what, values in wanted.items():
        if len(fresh[what]) != len(values) or not np.allclose(fresh[what], values, rtol=1e-3):
            raise AssertionError(f"{what}: {fresh[what]} now, {values} in {RECORD.name}: the code changed; "
                                 "re-record with `python tools/walkthrough/walkthrough_chapter_finetune.py`")


# --- The figure and the notebook -------------------------------------------------------------------------

def figure(data_: dict[str, Any]) -> Any:
    """Each run's training loss a step, and its held-out loss at each validation (the base's at step 0), on a log
    scale: the first steps fall from the base's ~14 nats, the last are a hundred times lower."""
    import matplotlib.pyplot as plt

    held = data_["held_out_chats"]
    fig, (train_axis, held_axis) = plt.subplots(1, 2, figsize=(12, 4.4), dpi=100)
    for run in data_["runs"]:
        settings = f"lr {run['lr']:g}" + ("" if run["rank"] is None else f", alpha {run['alpha']:g}")
        line, = train_axis.plot(range(1, len(run["loss"]) + 1), run["loss"], lw=1.1, label=f"{run['name']} ({settings})")
        steps = [0] + [e["step"] for e in run["evals"]]
        losses = [data_["base"]["held_out"]["loss"]] + [e["loss"] for e in run["evals"]]
        held_axis.plot(steps, losses, "o-", ms=3.5, lw=1.3, color=line.get_color(),
                       label=f"{run['name']}: {right(run['answers'], held)} of {len(held)} right")
    train_axis.set(yscale="log", xlabel="step", ylabel="training loss (nats per assistant token)",
                   title=f"Training: {data_['run']['batch_size']} chats a step")
    held_axis.set(yscale="log", xlabel="step", ylabel="held-out loss (nats per assistant token)",
                  title=f"Held out: {len(held)} other speeches of the training plays")
    train_axis.legend(fontsize=8)
    held_axis.legend(fontsize=8, title=f"the base: {right(data_['base']['answers'], held)} right", title_fontsize=8)
    for axis in (train_axis, held_axis):
        axis.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig


# What the notebook's cell defines from this file, by source: the task's chats and the chat base.
NOTEBOOK_FUNCTIONS = ("speeches", "speech_pool", "question", "task_chats", "write_chats", "chat_model")


def notebook_code() -> str:
    """The chapter's notebook cell: the task's files written as the chapter writes them, then the main LoRA run's
    first CHECKED_STEPS steps by its own command line (qwen_np.cli.main, what `python -m qwen_np` runs)."""
    import inspect

    tuning = next(t for t in TUNINGS if t["key"] == MAIN)
    functions = "\n\n".join(inspect.getsource(globals()[name]) for name in NOTEBOOK_FUNCTIONS)
    return f'''import contextlib
import io
import json
import random
import re
import shutil
import tempfile

from qwen_np.cli import main as qwen_np_main
from qwen_np.training import data, run_state

BUNDLED, CHECKPOINT_FILES = Path(MODEL), {CHECKPOINT_FILES!r}
CHAT_TEMPLATE = {pformat(CHAT_TEMPLATE, width=110)}
SPEAKER = re.compile({SPEAKER.pattern!r})
MAX_LINE, TRAIN_CHATS, HELD_OUT_CHATS = {MAX_LINE}, {TRAIN_CHATS}, {HELD_OUT_CHATS}

{functions}

finetune_folder = Path(tempfile.mkdtemp())
chat_model(finetune_folder / {BASE_NAME!r})
train_chats, held_chats, _ = task_chats()
write_chats(finetune_folder / "train.jsonl", train_chats)
write_chats(finetune_folder / "held_out.jsonl", held_chats)
print(train_chats[0])
# The chapter's run {MAIN!r} (tools/walkthrough/walkthrough_chapter_finetune.py): here its first {CHECKED_STEPS} steps
with contextlib.chdir(finetune_folder), contextlib.redirect_stderr(io.StringIO()):
    qwen_np_main({textwrap.indent(pformat(command(tuning, CHECKED_STEPS), width=100, compact=True), " " * 17).lstrip()})
finetune_losses = [r["loss"] for r in run_state.load_state(finetune_folder / {MAIN!r} / "last.safetensors")[3]["history"]]
print("first losses:", [round(loss, 2) for loss in finetune_losses])'''


def notebook_checks() -> dict[str, Any]:
    """Expressions over the notebook's variables after that cell, and what the record says they are."""
    main_run = next(r for r in load_record()["runs"] if r["key"] == MAIN)
    return {f"bool(np.allclose(finetune_losses, {main_run['loss'][:CHECKED_STEPS]!r}, rtol=1e-3))": True}


# --- The page ---------------------------------------------------------------------------------------

def load_record() -> dict[str, Any]:
    return walkthrough_common.read_record(RECORD, "python tools/walkthrough/walkthrough_chapter_finetune.py", "minutes")


def claim(holds: bool, what: str) -> None:
    walkthrough_common.claim(holds, what, "fine-tuning chapter")


def marked(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> str:
    """The conversation as the template renders it, each learned token in ⟨ ⟩ (its line breaks shown as ↵)."""
    chat = chats.chat_tokens(tokenizer, messages)
    pieces = [tokenizer.decode([int(i)]) for i in chat.ids]
    return "".join(f"⟨{piece.replace(chr(10), '↵')}⟩" + "\n" * piece.count("\n") if learned else piece
                   for piece, learned in zip(pieces, chat.learned))


def learned_text(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> list[str]:
    """What each assistant turn is taught: the text of its run of learned tokens, in order."""
    chat = chats.chat_tokens(tokenizer, messages)
    runs, current = [], []
    for token, learned in zip(chat.ids.tolist(), chat.learned):
        if learned:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs + ([tokenizer.decode(current)] if current else [])


def two_turns() -> list[dict[str, str]]:
    """The first two training chats as one conversation: two assistant turns, the first with a reasoning text."""
    (asked, reply), (second, last) = task_chats()[0][:2]
    return [asked, {**reply, "reasoning_content": "The name above the line says who speaks it."}, second, last]


def task_part(rec: dict[str, Any]) -> str:
    example = json.dumps({"messages": rec["train_example"]}, ensure_ascii=False)
    held, unread = rec["held_out_chats"], rec["unread_chats"]
    base_says = name_in(rec["base"]["answers"][0]).splitlines()[0]
    claim(right(rec["base"]["answers"], held) == 0 and right(rec["base"]["unread_answers"], unread) == 0,
          "the base answers no question right")
    commands = "\n".join(run["command"] for run in rec["runs"])
    asked = held[0][0]["content"]
    return f"""**The task.** The user quotes the first line of a speech as the plays write it (the speaker's name,
a colon, the line) and asks who says it; the assistant answers with the name and nothing else. One
line of the chat file (`training.chats` reads OpenAI's format, one conversation a line):

```json
{example}
```

**Why this task.** The base cannot do it at all: it has never seen a chat turn, and asked, it goes on
writing a play (its first reply below begins `{base_says}`): 0 of the {len(held)} held-out questions right.
Yet everything the answer needs is in the question, the name written above the line, and the base
knows these names well (it was trained on these plays). So what the tuning must teach is a format
(answer inside the assistant's turn, the name alone, then `<|im_end|>`) and one rule (copy the
heading): a few hundred steps on two cores can, and whether they did is plain to count. The chats are
{rec['train_chats']:,} distinct speeches drawn at random from the {rec['plays']['train']} plays of the training split; the
**held-out** questions are {len(held)} other speeches of those plays, never trained on. A harder test
beside it: {len(unread)} speeches of the validation split's plays ({', '.join(rec['plays']['held_out'])}), which neither the
bundled model nor the tuning ever read, so that most of their speakers are names it has never seen.

**The base.** The bundled model has no chat template: it continues text. So the chapter builds its
instruct-style base honestly: the bundled weights unchanged, with a minimal ChatML template (Qwen3's
turn layout, without tools or `<think>`: `CHAT_TEMPLATE` in `tools/walkthrough/walkthrough_chapter_finetune.py`)
written into a copy of its `tokenizer_config.json`. The bundled tokenizer has no `<|im_start|>` or
`<|im_end|>` token, so to it those markers are plain text, a few tokens each; the loss mask below is
found from the rendered text's characters, so it is the same rule as for a real Qwen3.

The runs, as commands, in a folder holding that base as `{BASE_NAME}/`, `train.jsonl` and `held_out.jsonl`
(`python tools/walkthrough/walkthrough_chapter_finetune.py` writes them, runs these one after another, each as
its own process, and records them): LoRA at rank 2 and rank 8, and every weight. Each run's best
model (by held-out loss) is exported to `OUT/model`, a LoRA run's
adapter to `OUT/adapter`; `eval` and `generate` score them:

```bash
{commands}
python -m qwen_np eval --model {BASE_NAME} --text held_out.jsonl --json     # the base's held-out loss
python -m qwen_np eval --model {MAIN}/model --text held_out.jsonl --json
python -m qwen_np generate --model {BASE_NAME} --lora {MAIN}/adapter -n {ANSWER_TOKENS} --temperature 0 \\
    --stop '{chats.TURN_END}' {shlex.quote(asked)}
```"""


def mask_part(rec: dict[str, Any], qwen3: Tokenizer) -> str:
    with tempfile.TemporaryDirectory() as name:
        bundled = Tokenizer.from_folder(chat_model(Path(name)))
    conversation = two_turns()
    claim(conversation[0] == rec["train_example"][0], "the recorded chats are the ones the code writes")
    ours, theirs = learned_text(bundled, conversation), learned_text(qwen3, conversation)
    prompt = bundled.apply_chat_template(conversation[:1], add_generation_prompt=True)
    claim(bundled.apply_chat_template(conversation, add_generation_prompt=False).startswith(prompt),
          "the generation prompt is the rendered chat up to where the first learned token starts")
    claim(ours == [m["content"] + chats.TURN_END for m in conversation[1::2]],
          "the bundled template teaches each turn its answer and <|im_end|>")
    claim("<think>" not in theirs[0] and theirs[1].startswith("<think>\n\n</think>\n\n"),
          "Qwen3's template drops the first turn's reasoning and gives the last turn an empty think block")
    no_think = qwen3.apply_chat_template(conversation[:3], add_generation_prompt=True, enable_thinking=False)
    return f"""**What is learned: the assistant's tokens only.** `training.chats.chat_tokens` renders a whole
conversation with the template (no generation prompt) and marks every assistant turn's tokens after
its `<|im_start|>assistant\\n` header through its `<|im_end|>`; the loss is the mean over those tokens
alone (the user's turns and the headers are read, never taught). A two-turn conversation, the
learned tokens in ⟨ ⟩:

```text
{marked(bundled, conversation)}```

Each turn is taught its answer and the `<|im_end|>` after it, the model's way of saying it is done
(here {len(bundled.encode(chats.TURN_END))} text tokens: `<`, `|`, `im`, ...). That is what it sees when it generates: the prompt
of the first question is the rendering above up to the first ⟨, `<|im_start|>assistant\\n` included,
and the model must write the rest.

A real Qwen3 (the same conversation through Qwen3's own template, the real tokenizer; the first
answer given a reasoning text) is taught something subtler:

```text
{marked(qwen3, conversation)}```

The first turn's `<think>` block is gone: Qwen3's template drops an earlier turn's reasoning, so
the first turn is taught as `{theirs[0]!r}`, exactly how it reads back as history when the model
writes a later turn. The last turn gets an empty block, `{theirs[1]!r}`: the model is taught to
answer at once after it. With thinking on, the prompt ends at `<|im_start|>assistant\\n` and the tuned
model writes that empty block itself, then the answer; with thinking off (`--no-think`), the prompt
itself ends in the block, and the model goes on from where it was taught to:

```text
{no_think}```"""


def right(replies: list[str], conversations: list[list[dict[str, str]]]) -> int:
    """How many replies name the speaker (name_in)."""
    return sum(name_in(reply) == messages[1]["content"] for reply, messages in zip(replies, conversations, strict=True))


def ended(replies: list[str]) -> int:
    """How many replies stop with a well-spelt <|im_end|>."""
    return sum(reply.endswith(chats.TURN_END) for reply in replies)


def results_part(rec: dict[str, Any]) -> str:
    base, held, unread = rec["base"], rec["held_out_chats"], rec["unread_chats"]
    n, runs = len(held), {run["key"]: run for run in rec["runs"]}
    for run in rec["runs"]:
        claim(right(run["answers"], held) > n / 2, f"{run['name']} answers most held-out questions right")
    texts = data.shakespeare_plays()
    trained_speakers = {speaker for play in data.SPLITS["train"] for speaker, _ in speeches(texts[play])}
    main_run = runs[MAIN]
    wrong = [name_in(reply) for reply, m in zip(main_run["unread_answers"], unread) if name_in(reply) != m[1]["content"]]
    claim(sum(name in trained_speakers for name in wrong) > len(wrong) / 2,
          "most of the main run's wrong names on the unread plays are training speakers")
    scores = "\n".join(
        f"| {who} | {two(x['held_out']['loss'])} | {right(x['answers'], held)} of {n} | "
        f"{right(x['unread_answers'], unread)} of {len(unread)} | {ended(x['answers'])} of {n} |"
        for who, x in (("the base (bundled weights, chat template)", base),
                       *((f"{run['name']} (`{run['key']}`)", run) for run in rec["runs"])))
    costs = "\n".join(f"| {run['name']} | {run['trainable']:,} | {run['cpu_s']:,.0f} s | {run['wall_s']:,.0f} s | "
                      f"{mib(run['peak_rss'])} | {mib(run['planned_peak'])} |" for run in rec["runs"])
    misses = [(m[1]["content"], name_in(reply)) for reply, m in zip(main_run["unread_answers"], unread)
              if name_in(reply) != m[1]["content"] and name_in(reply) in trained_speakers][:2]
    loads = [load for run in rec["runs"] for load in run["load_average"]]
    rows = "\n".join(f"| `{m[0]['content'].splitlines()[1]}` | {m[1]['content']} | `{b!r}` | `{t!r}` |"
                     for m, b, t in list(zip(held, base["answers"], main_run["answers"]))[:6])
    return f"""**Base against tuned.** The loss is `eval --text held_out.jsonl`'s: the mean over the
{base['held_out']['tokens']:,} assistant tokens of the {n} held-out chats. Each question is answered greedily, up to
{ANSWER_TOKENS} tokens: the answer is right when the reply's text before its first `<` (where `<|im_end|>` starts) is
exactly the speaker's name, and it stops well when the reply ends with `<|im_end|>` spelt right.

| model | held-out loss (nats per assistant token) | right, held out | right, unread plays | well-spelt stops |
|---|---:|---:|---:|---:|
{scores}

![each run's training and held-out loss](figures/finetune_run.png)

Every tuned model answers most held-out questions right, where the base answered none: it writes a
name, the name above the line, then `<|im_end|>`. The unread plays are harder, and the table shows
how: asked about a name it has never seen, the tuned model often answers with a name it knows from
the training plays instead (`{misses[0][0]}` → `{misses[0][1]}`, `{misses[1][0]}` → `{misses[1][1]}`): most of its wrong
names there are speakers of the training plays. What it learned is partly the rule and partly this model's knowledge of its own
plays, which is what a few hundred steps on a small model give. The first held-out questions
(their quoted line; the reply as generated, `<|im_end|>` included when it wrote one):

| line | speaker | the base replies | `{MAIN}` replies |
|---|---|---|---|
{rows}

**What each run costs.** Time and memory of each command, measured as its own process (`os.wait4`: CPU
seconds and peak RSS; wall seconds on {rec['cores']} cores shared with other work, the load average between
{min(loads):.0f} and {max(loads):.0f}, so read the CPU column), beside
the step's planned peak (`engine.step_memory.training_memory`, what `python -m qwen_np inspect --lora R
--batch-size {rec['run']['batch_size']} -c {rec['run']['context']}` prints):

| run | trained values | CPU time | wall time | peak RSS, measured | a step's peak, planned |
|---|---:|---:|---:|---:|---:|
{costs}"""


def trained_state(plan: dict[str, int]) -> int:
    """Bytes of the trained values' FP32 weights, gradients and AdamW moments in a memory plan."""
    return plan["weights"] + plan["gradients"] + plan["adamw"]


def spike(run: dict[str, Any]) -> float:
    """A run's highest training loss after warmup: how far its steps threw it back."""
    return max(run["loss"][RUN["warmup"]:])


def rank_part(rec: dict[str, Any]) -> str:
    held, n = rec["held_out_chats"], len(rec["held_out_chats"])
    runs = {run["key"]: run for run in rec["runs"]}
    full, rs = runs["full"], runs["lora8"]
    lora_runs = [run for run in rec["runs"] if run["rank"] is not None]
    for run in lora_runs[:2]:
        claim(np.isclose(run["alpha"] / run["rank"], RS_ALPHA / run["rank"] ** 0.5),
              f"{run['name']}'s alpha is rsLoRA's rule: alpha / r = {RS_ALPHA:.3f} / sqrt(r)")
    rows = "\n".join(f"| {x['name']} | {x['alpha']:g} | {x['alpha'] / x['rank']:g} | {x['trainable']:,} | "
                     f"{mib(trained_state(x['memory']))} | {mib(x['planned_peak'])} | {two(spike(x))} | "
                     f"{two(x['held_out']['loss'])} | {right(x['answers'], held)} of {n} |" for x in lora_runs)
    header = ("| run | alpha | alpha / r | trained values | their weights, gradients, moments | a step (+ FP32 base, "
              "activations) | highest training loss after warmup | held-out loss | right |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    full_row = (f"| {full['name']} | | | {full['trainable']:,} | {mib(trained_state(full['memory']))} | "
                f"{mib(full['planned_peak'])} | {two(spike(full))} | {two(full['held_out']['loss'])} | "
                f"{right(full['answers'], held)} of {n} |")
    low = runs["lora2"]
    steadier = spike(rs) <= spike(low)
    outcome = (f"rank 8's training loss was thrown back no further than rank 2's after warmup (at most {two(spike(rs))}, "
               f"against {two(spike(low))})" if steadier else
               f"rank 8's training loss was still thrown back further than rank 2's after warmup ({two(spike(rs))} against "
               f"{two(spike(low))}): its steps are larger yet")
    outcome += (f", and it ended with {'the better' if rs['held_out']['loss'] < low['held_out']['loss'] else 'a worse'} "
                f"held-out loss ({two(rs['held_out']['loss'])} against {two(low['held_out']['loss'])})")
    return f"""**LoRA against every weight.** A rank-r adapter on a projection W [out, in] is two matrices, A [r, in]
and B [out, r] (A random, B zero: the tuned model starts as the base), added as W + (alpha / r) B A:
r (in + out) trained values a projection, on all seven of each layer. Full fine-tuning (no `--lora`)
trains all {full['trainable']:,} weights, at a tenth of LoRA's learning rate (lr {full['lr']:g}: every weight moves, where
LoRA moves a few directions of each). The memory is the plan's for
B × T = {rec['run']['batch_size']} × {rec['run']['context']}:

{header}
{rows}
{full_row}

The adapters' own state is small at every rank; the tape of activations is the same as full
fine-tuning's (the backward still goes through every layer), and here it is most of a step. What LoRA
saves is the 16 bytes a weight of full fine-tuning (FP32 weights, gradients, two moments): on this
{full['trainable'] / 1e6:.1f}M-parameter model that is little, for a real Qwen3-0.6B it is gigabytes against megabytes.

**alpha, and what rsLoRA changes.** `--lora-alpha` defaults to 2r, so the factor alpha / r is 2 at
every rank. Under AdamW each trained value moves by about the learning rate a step, whatever its
gradient's size, and B A sums r such products: at one factor, a larger rank moves W further a step.
LoRA's paper keeps alpha the same for every rank instead, so that the factor falls as 1 / r;
rsLoRA (Kalajdzievski, 2023; peft's `use_rslora`) showed that 1 / r falls too fast (larger ranks then
learn hardly more than small ones) and scales by alpha / sqrt(r). With the default alpha = 2r neither
happens: rsLoRA's factor would be 2r / sqrt(r) = 2 sqrt(r), growing with the rank. So the runs above
choose alpha by rsLoRA's rule, keeping rank 2's factor: alpha / sqrt(r) with alpha = 2 sqrt(2) gives 2 at
rank 2 and 1 at rank 8, that is `--lora-alpha {low['alpha']:g}` and `--lora-alpha {rs['alpha']:g}` here (this
trainer, like peft without `use_rslora`, divides by r). Measured at one learning rate: {outcome}.
More rank is more capacity, not a better run by itself: a larger rank wants a smaller factor (or
learning rate), which rsLoRA's rule gives it."""


def merging_part(rec: dict[str, Any]) -> str:
    m = rec["merging"]
    claim(m["same"], "the merged model answers every held-out question as the adapter applied unmerged")
    sizes = "; ".join(f"{sum(run['adapter_bytes'].values()):,} bytes at rank {run['rank']} (`{run['key']}/adapter`)"
                      for run in rec["runs"] if run["rank"] is not None)
    return f"""**What merging does.** A LoRA run writes its adapters twice. `OUT/adapter` is PEFT's format
(`adapter_config.json` + `adapter_model.safetensors`: {sizes}), which `generate --lora`
applies without merging: each adapted projection computes W x + (alpha / r) B (A x), so one base
can serve many adapters (`serve --lora NAME=DIR`). `OUT/model` is the base with every W replaced by
W + (alpha / r) B A: an ordinary checkpoint ({m['model_bytes']:,} bytes of weights), as fast as the base and
loadable by anything that loads Qwen3, but one model per adapter. The two compute the same function
up to FP32 rounding (the product B A is added once instead of at every token): on the
{len(rec['held_out_chats'])} held-out questions the `{MAIN}` run's adapter (unmerged) and its merged model give
**the same greedy answers**, every one."""


def chapter_section(number: int, qwen3: Tokenizer, trained_in: int) -> str:
    """The chapter's markdown, from the recorded run; `qwen3` (a real Qwen3 tokenizer) shows its template's mask;
    trained_in: the number of the section that trains a model from random weights."""
    rec = load_record()
    parts = [task_part(rec), mask_part(rec, qwen3), results_part(rec), rank_part(rec), merging_part(rec)]
    checked = " and ".join(f"`{key}`" for key in CHECKED_RUNS)
    return f"""## {number}. Fine-tune one yourself

Section {trained_in} trained a model from random weights. More often you start from a trained model and
teach it one thing, from about a thousand conversations: **supervised fine-tuning** (SFT) on chats, here
with **LoRA** (low-rank adapters: the weights stay frozen, small matrices beside them are trained) at
two ranks and, beside them, with every weight trained. The model taught is the bundled one. Everything
below is one run of `python tools/walkthrough/walkthrough_chapter_finetune.py` ({rec['seconds']:,.0f} s on {rec['cores']} shared
cores when it was recorded), which recorded it, each run's exact command with it, in
`docs/figures/finetune_run.json`; the page is written from that record, and the test suite repeats the
base's held-out loss and the first {CHECKED_STEPS} steps of {checked} by their commands to check
the record still matches the code. Losses are printed to 2 decimals and answers counted: their later
digits are the BLAS kernel's, and a different kernel may flip a close answer or two.

""" + "\n\n".join(parts)


if __name__ == "__main__":
    main()
