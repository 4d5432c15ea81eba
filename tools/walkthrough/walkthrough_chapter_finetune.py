"""The walkthrough's chapter "Fine-tune one yourself": the bundled model taught a task by LoRA, on chats.

The task: the user quotes a speech's first line as the plays write it (the speaker, a colon, the line)
and asks "Who says this?"; the assistant answers with the speaker's name, nothing else. It is a rule
(answer the heading), not a fact about one play, so the chats are split BY PLAY: the tuning reads
questions about the bundled model's training plays, and it is judged on the validation plays, which
neither the bundled model nor the tuning ever read. The rule is easy on purpose: a few minutes of a
shared CPU teach it, and what the chapter shows (the answer's format, its stop, the held-out loss) is
what any SFT run must get right first.

The bundled model has no chat template (weights/README.md), so the chapter builds its instruct-style
base honestly: the bundled weights unchanged, with CHAT_TEMPLATE (a minimal ChatML layout) written into
a copy of its tokenizer_config.json. Its tokenizer has no <|im_start|> / <|im_end|> tokens, so those
markers are plain text to it, a few tokens each; training.chats finds the assistant's tokens by their
characters, so its mask is the same rule as for a real Qwen3.

Like the training chapter, the runs are RECORDED: `python tools/walkthrough/walkthrough_chapter_finetune.py` writes
docs/figures/finetune_run.json and the page is rendered from it. tests/product/test_walkthrough.py repeats the
base's held-out loss and the first steps of the rank-2 run (check_first_steps). The page prints losses
to 2 decimals and answers as counts: their later digits would be the BLAS kernel's.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
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
from qwen_np.training import chats, data, evaluation, lora, trainer, run_spec  # noqa: E402
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
TRAIN_CHATS = 512
HELD_OUT_CHATS = 48
RUN: dict[str, Any] = {"steps": 48, "batch_size": 8, "context": 128, "lr": 1e-2, "warmup": 4, "eval_every": 16, "seed": 0,
       "threads": 2, "shards": 2}
RANKS = (2, 8)                    # the rank sweep at one learning rate
MAIN_RANK = 2                     # the run the chapter compares with the base (the better of the two here)
MERGED_RANK = 8                   # the run whose adapter and merged model are compared
ANSWER_TOKENS = 12                # greedy tokens generated per answer (a name and <|im_end|> take fewer)
CHECKED_STEPS = 2                 # the MAIN_RANK run's steps the drift test repeats


# --- The task -------------------------------------------------------------------------------------------

def speeches(play: str) -> list[tuple[str, str]]:
    """(speaker, first line) of every speech of the play's text whose first line is words (not a stage direction)."""
    found = []
    for block in play.split("\n\n"):
        lines = block.strip().splitlines()
        if len(lines) >= 2 and SPEAKER.match(lines[0]) and not lines[1].startswith("["):
            found.append((lines[0][:-1], lines[1]))
    return found


def questions(plays: tuple[str, ...], count: int, seed: int) -> list[list[dict[str, str]]]:
    """`count` chats, each about one speech of `plays` (drawn at random among those of at most MAX_LINE
    characters): the speech as the play writes it, "Who says this?", and the speaker's name."""
    texts = data.shakespeare_plays()
    found = [speech for play in plays for speech in speeches(texts[play]) if len(speech[1]) <= MAX_LINE]
    return [[{"role": "user", "content": f"{speaker}:\n{line}\n\nWho says this?"},
             {"role": "assistant", "content": speaker}] for speaker, line in random.Random(seed).sample(found, count)]


def task_chats() -> tuple[list[list[dict[str, str]]], list[list[dict[str, str]]]]:
    """(training chats, from the train split's plays; held-out chats, from the validation split's)."""
    return questions(data.SPLITS["train"], TRAIN_CHATS, seed=0), questions(data.SPLITS["validation"], HELD_OUT_CHATS, seed=1)


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

def tune(out: Path, base: Path, train: Path, held_out: Path, rank: int, steps: int = RUN["steps"]) -> trainer.RunResult:
    """`train --model BASE --data train.jsonl --val held_out.jsonl --lora RANK` with RUN's settings, stopped after
    `steps` (the learning-rate schedule stays RUN's)."""
    return trainer.run(run_spec.RunSpec(out=out, model=str(base), data=str(train), val=str(held_out),
                                       lora=lora.LoraSettings(rank),
                                       overrides={**RUN, "steps": steps, "decay_steps": RUN["steps"]}))


def tuned_run(folder: Path, base: Path, tokenizer: Tokenizer, train: Path, held_out: Path,
              conversations: list[list[dict[str, str]]], rank: int) -> dict[str, Any]:
    """One LoRA run of `rank`: its losses, the tuned model's held-out loss, answers and memory plan."""
    started = time.perf_counter()
    result = tune(folder / f"rank{rank}", base, train, held_out, rank)
    seconds = time.perf_counter() - started
    tuned = load_model(folder / f"rank{rank}" / "model", memory="fp32")
    replies = answers(tuned, tokenizer, conversations)
    plan = step_memory.training_memory(tuned.config, RUN["batch_size"], RUN["context"], lora_rank=rank,
                                  lora_targets=LAYER_MATRICES)
    return {"rank": rank, "trainable": step_memory.lora_parameters(tuned.config, rank, LAYER_MATRICES),
            "loss": [r["loss"] for r in result.state.history],
            "evals": [{"step": e["step"], "loss": e["loss_per_token"]} for e in result.state.evals],
            "held_out": held_out_loss(tuned, tokenizer, held_out), "answers": replies,
            "memory": {k: v for k, v in plan.items() if k != "activations_per_token"}, "seconds": seconds}


def merging(run: Path, base: Path, tokenizer: Tokenizer, conversations: list[list[dict[str, str]]]) -> dict[str, Any]:
    """The adapter applied without merging (generate --lora) against the merged OUT/model: the same answers?"""
    model = load_model(base, memory="fp32")
    adapter: Adapter = read_adapter(run / "adapter", model.config)
    attach_adapter(model, adapter)
    merged = load_model(run / "model", memory="fp32")
    adapted, by_merged = answers(model, tokenizer, conversations), answers(merged, tokenizer, conversations)
    files = {name: (run / "adapter" / name).stat().st_size for name in ("adapter_config.json", "adapter_model.safetensors")}
    return {"same": adapted == by_merged, "answers": adapted, "adapter_bytes": files,
            "model_bytes": (run / "model" / "model.safetensors").stat().st_size}


def record(progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Everything the chapter shows, by running it (minutes on 2 cores; the record keeps the seconds)."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as name, threadpool_limits(limits=1):
        folder = Path(name)
        base = chat_model(folder / "base")
        tokenizer = Tokenizer.from_folder(base)
        train_chats, held_chats = task_chats()
        train, held_out = write_chats(folder / "train.jsonl", train_chats), write_chats(folder / "held_out.jsonl", held_chats)
        model = load_model(base, memory="fp32")
        base_replies = answers(model, tokenizer, held_chats)
        before = {"held_out": held_out_loss(model, tokenizer, held_out), "answers": base_replies}
        progress(f"base scored ({time.perf_counter() - started:.0f} s)")
        runs = []
        for rank in RANKS:
            runs.append(tuned_run(folder, base, tokenizer, train, held_out, held_chats, rank))
            progress(f"rank {rank}: held-out loss {runs[-1]['held_out']['loss']:.3f}, answers {runs[-1]['answers'][:4]} "
                     f"({time.perf_counter() - started:.0f} s)")
        merged = merging(folder / f"rank{MERGED_RANK}", base, tokenizer, held_chats)
        plan = step_memory.training_memory(model.config, RUN["batch_size"], RUN["context"])
    return {"run": RUN, "train_chats": TRAIN_CHATS, "held_out_chats": held_chats, "train_example": train_chats[0],
            "plays": {"train": len(data.SPLITS["train"]), "held_out": list(data.SPLITS["validation"])},
            "base": before, "ranks": runs, "merging": merged,
            "full_memory": {"parameters": parameter_count(model.config), "weights": plan["weights"],
                            "gradients": plan["gradients"], "adamw": plan["adamw"],
                            "total": step_memory.training_total(plan)},
            "seconds": round(time.perf_counter() - started), "cores": os.cpu_count()}


def main(argv: list[str] | None = None) -> None:
    walkthrough_common.record_main("Run the walkthrough's fine-tuning chapter (minutes on 2 cores) "
                                   "and record what it shows.", RECORD, record, argv)


if __name__ == "__main__":
    main()


def check_first_steps(recorded: dict[str, Any], steps: int = CHECKED_STEPS) -> None:
    """Repeat the base's held-out loss and the rank-MAIN_RANK run's first steps; raise naming the first figure that
    differs from the record beyond rounding (rtol 1e-3: the record keeps 4 digits)."""
    main_run = next(r for r in recorded["ranks"] if r["rank"] == MAIN_RANK)
    with tempfile.TemporaryDirectory() as name, threadpool_limits(limits=1):
        folder = Path(name)
        base = chat_model(folder / "base")
        tokenizer = Tokenizer.from_folder(base)
        train, held_out = (write_chats(folder / f"{name}.jsonl", conversations)
                           for name, conversations in zip(("train", "held_out"), task_chats()))
        fresh = [held_out_loss(load_model(base, memory="fp32"), tokenizer, held_out)["loss"]]
        fresh += [r["loss"] for r in tune(folder / "run", base, train, held_out, MAIN_RANK, steps).state.history]
    wanted = [recorded["base"]["held_out"]["loss"]] + main_run["loss"][:steps]
    for index, (got, want) in enumerate(zip(fresh, wanted, strict=True)):
        if not np.isclose(got, want, rtol=1e-3):
            what = "the base's held-out loss" if index == 0 else f"the loss of the rank-{MAIN_RANK} run's step {index}"
            raise AssertionError(f"{what} is {got:.6g} now, {want:.6g} in {RECORD.name}: the code changed; "
                                 "re-record with `python tools/walkthrough/walkthrough_chapter_finetune.py`")


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
    (question, reply), (second, last) = task_chats()[0][:2]
    return [question, {**reply, "reasoning_content": "The name above the line says who speaks it."}, second, last]


def task_part(rec: dict[str, Any]) -> str:
    example = json.dumps({"messages": rec["train_example"]}, ensure_ascii=False)
    r = rec["run"]
    flags = " ".join(f"--{k.replace('_', '-')} {r[k]:g}" for k in ("steps", "batch_size", "context", "lr", "warmup",
                                                                   "eval_every", "seed"))
    return f"""**The task.** The user quotes the first line of a speech as the plays write it (the speaker's name,
a colon, the line) and asks who says it; the assistant answers with the name and nothing else. One
line of the chat file (`training.chats` reads OpenAI's format, one conversation a line):

```json
{example}
```

It is a rule to learn (answer the name above the line), not a fact about one play, so the chats are
**split by play**: {rec['train_chats']} questions about the {rec['plays']['train']} plays of the
training split (the plays the bundled model was trained on) train, and {len(rec['held_out_chats'])} about the
validation split's ({', '.join(rec['plays']['held_out'])}) are held out: neither the bundled model nor the tuning
ever read those plays, and most of their speakers are names the tuning never answered. The rule is
easy on purpose, so that minutes of a shared CPU teach it: what the chapter shows (the answer's
format, its stop, the held-out loss) is what any SFT run must get right first.

**The base.** The bundled model has no chat template: it continues text. So the chapter builds its
instruct-style base honestly: the bundled weights unchanged, with a minimal ChatML template (Qwen3's
turn layout, without tools or `<think>`: `CHAT_TEMPLATE` in `tools/walkthrough/walkthrough_chapter_finetune.py`)
written into a copy of its `tokenizer_config.json`. The bundled tokenizer has no `<|im_start|>` or
`<|im_end|>` token, so to it those markers are plain text, a few tokens each; the loss mask below is
found from the rendered text's characters, so it is the same rule as for a real Qwen3.

The run, as commands (`chat_base/` is that folder; `python tools/walkthrough/walkthrough_chapter_finetune.py` does
it all and records it):

```bash
python -m qwen_np train --model chat_base --data train.jsonl --val held_out.jsonl --lora {MAIN_RANK} \\
    --out /tmp/tuned {flags}
python -m qwen_np eval --model chat_base --text held_out.jsonl --json     # the base's held-out loss
python -m qwen_np eval --model /tmp/tuned/model --text held_out.jsonl --json
python -m qwen_np generate --model chat_base --lora /tmp/tuned/adapter -n {ANSWER_TOKENS} --temperature 0 "Who says: ..."
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


def main_rank(rec: dict[str, Any]) -> dict[str, Any]:
    return next(r for r in rec["ranks"] if r["rank"] == MAIN_RANK)


def right(replies: list[str], conversations: list[list[dict[str, str]]]) -> int:
    """How many replies name the speaker (name_in)."""
    return sum(name_in(reply) == messages[1]["content"] for reply, messages in zip(replies, conversations, strict=True))


def ended(replies: list[str]) -> int:
    """How many replies stop with a well-spelt <|im_end|>."""
    return sum(reply.endswith(chats.TURN_END) for reply in replies)


def results_part(rec: dict[str, Any]) -> str:
    base, tuned, held = rec["base"], main_rank(rec), rec["held_out_chats"]
    n = len(held)
    claim(tuned["held_out"]["loss"] <= 0.5 * base["held_out"]["loss"], "the tuning at least halves the held-out loss")
    claim(right(tuned["answers"], held) > right(base["answers"], held),
          "the tuned model answers more held-out questions right than the base")
    evals = ", ".join(f"{two(e['loss'])} at step {e['step']}" for e in tuned["evals"])
    claim(ended(tuned["answers"]) < n / 2, "most tuned replies misspell the stop marker")
    texts = data.shakespeare_plays()
    trained_speakers = {speaker for play in data.SPLITS["train"] for speaker, _ in speeches(texts[play])}
    wrong = [name_in(reply) for reply, m in zip(tuned["answers"], held) if name_in(reply) != m[1]["content"]]
    claim(sum(name in trained_speakers for name in wrong) > len(wrong) / 2, "most wrong names are training speakers")
    with tempfile.TemporaryDirectory() as name:
        stop_tokens = len(Tokenizer.from_folder(chat_model(Path(name))).encode(chats.TURN_END))
    scores = "\n".join(f"| {who} | {two(x['held_out']['loss'])} | {right(x['answers'], held)} of {n} | "
                       f"{ended(x['answers'])} of {n} |"
                       for who, x in (("the base (bundled weights, chat template)", base),
                                      (f"tuned: LoRA rank {MAIN_RANK}, {rec['run']['steps']} steps", tuned)))
    rows = "\n".join(f"| `{m[0]['content'].splitlines()[1]}` | {m[1]['content']} | `{b!r}` | `{t!r}` |"
                     for m, b, t in list(zip(held, base["answers"], tuned["answers"]))[:6])
    return f"""**Base against tuned, on the held-out plays.** The loss is `eval --text held_out.jsonl`'s: the mean
over the {base['held_out']['tokens']:,} assistant tokens of the {n} held-out chats. Each question is answered greedily, up to
{ANSWER_TOKENS} tokens: the answer is right when the reply's text before its first `<` (where `<|im_end|>` starts) is
exactly the speaker's name, and it stops well when the reply ends with `<|im_end|>` spelt right.

| model | held-out loss (nats per assistant token) | right names | well-spelt stops |
|---|---:|---:|---:|
{scores}

The base has never seen the markers: its loss is that of text it finds absurd, and, greedy, it goes
on writing a play. During the run the held-out loss fell to {evals}. {rec['run']['steps']} steps teach
the layout (a name, then the start of `<|im_end|>`) and, for {right(tuned['answers'], held)} of the {n} held-out speeches, the
right name; most wrong names are speakers of the training plays. The stop marker, {stop_tokens} text tokens here,
is mostly not yet spelt right: a longer run learns it, and a real Qwen3's `<|im_end|>` is one token. The first
held-out questions
(their quoted line; the reply as generated, `<|im_end|>` included when it wrote one):

| line | speaker | the base replies | the tuned model replies |
|---|---|---|---|
{rows}"""


def trained_state(plan: dict[str, int]) -> int:
    """Bytes of the trained values' FP32 weights, gradients and AdamW moments in a memory plan."""
    return plan["weights"] + plan["gradients"] + plan["adamw"]


def rank_part(rec: dict[str, Any]) -> str:
    n, r = len(rec["held_out_chats"]), rec["run"]
    full = rec["full_memory"]
    held = rec["held_out_chats"]
    low, high = min(rec["ranks"], key=lambda x: x["rank"]), max(rec["ranks"], key=lambda x: x["rank"])
    claim(right(low["answers"], held) > right(high["answers"], held) and spike(high) > spike(low),
          "the larger rank learns worse at the same learning rate, its training loss jumping back up")
    rows = "\n".join(f"| {x['rank']} | {x['trainable']:,} | {mib(trained_state(x['memory']))} | "
                     f"{mib(step_memory.training_total(x['memory']))} | {two(x['held_out']['loss'])} | "
                     f"{right(x['answers'], held)} of {n} |"
                     for x in rec["ranks"])
    return f"""**Rank against quality and memory.** The same run at {len(rec['ranks'])} ranks. A rank-r adapter on a
projection W [out, in] is two matrices, A [r, in] and B [out, r] (A random, B zero: the tuned model
starts as the base), added as W + (alpha / r) B A with alpha = 2r, so r (in + out) trained values a
projection, on all seven of each layer. The memory is the plan's (`engine.step_memory.training_memory`,
what `python -m qwen_np inspect --lora R --batch-size {r['batch_size']} -c {r['context']}` prints) for
B × T = {r['batch_size']} × {r['context']}:

| rank | trained values | their weights, gradients, moments | a step (+ FP32 base, activations) | held-out loss | right |
|---:|---:|---:|---:|---:|---:|
{rows}
| every weight (no `--lora`) | {full['parameters']:,} | {mib(trained_state(full))} | {mib(full['total'])} | | |

Here the smaller rank did better, at the same learning rate: rank {low['rank']}'s training loss fell
steadily, rank {high['rank']}'s jumped back up on the way (to {two(spike(high))} after warmup, against at most
{two(spike(low))} for rank {low['rank']}). With alpha = 2r the factor alpha / r is 2 at every rank, but AdamW moves each
trained value by about the learning rate a step, and the change of W, (alpha / r) B A, sums r such
products: a larger rank takes larger steps, so it wants a smaller learning rate, or a factor that falls
with the rank: a fixed alpha (alpha / r falls as 1 / r), or rsLoRA's alpha / sqrt(r) with a fixed alpha.
(rsLoRA's factor with this chapter's alpha = 2r would be 2 sqrt(r), which grows with the rank: it would
make rank {high['rank']}'s steps larger still.) More rank is more capacity, not a better run by itself.

The adapters' own state is small at every rank; the tape of activations is the same as full
fine-tuning's (the backward still goes through every layer), and here it is most of a step. What LoRA
saves is the 16 bytes a weight of full fine-tuning (FP32 weights, gradients, two moments): for a real
Qwen3-0.6B that is gigabytes against megabytes."""


def spike(run: dict[str, Any]) -> float:
    """A run's highest training loss after warmup: how far its steps threw it back."""
    return max(run["loss"][RUN["warmup"]:])


def merging_part(rec: dict[str, Any]) -> str:
    m = rec["merging"]
    claim(m["same"], "the merged model answers every held-out question as the adapter applied unmerged")
    adapter = sum(m["adapter_bytes"].values())
    return f"""**What merging does.** The run writes its adapters twice. `OUT/adapter` is PEFT's format
(`adapter_config.json` + `adapter_model.safetensors`, {adapter:,} bytes in all at rank {MERGED_RANK}), which `generate --lora`
applies without merging: each adapted projection computes W x + (alpha / r) B (A x), so one base
can serve many adapters (`serve --lora NAME=DIR`). `OUT/model` is the base with every W replaced by
W + (alpha / r) B A: an ordinary checkpoint ({m['model_bytes']:,} bytes of weights), as fast as the base and
loadable by anything that loads Qwen3, but one model per adapter. The two compute the same function
up to FP32 rounding (the product B A is added once instead of at every token): on the
{len(rec['held_out_chats'])} held-out questions the rank-{MERGED_RANK} run's adapter (unmerged) and its merged model give
**the same greedy answers**, every one."""


def chapter_section(number: int, qwen3: Tokenizer, trained_in: int) -> str:
    """The chapter's markdown, from the recorded run; `qwen3` (a real Qwen3 tokenizer) shows its template's mask;
    trained_in: the number of the section that trains a model from random weights."""
    rec = load_record()
    parts = [task_part(rec), mask_part(rec, qwen3), results_part(rec), rank_part(rec), merging_part(rec)]
    return f"""## {number}. Fine-tune one yourself

Section {trained_in} trained a model from random weights. More often you start from a trained model and
teach it one thing, from a few hundred conversations: **supervised fine-tuning** (SFT) on chats, here
with **LoRA** (low-rank adapters: the weights stay frozen, small matrices beside them are trained).
The model taught is the bundled one. Everything below is one run of
`python tools/walkthrough/walkthrough_chapter_finetune.py` ({rec['seconds']:,.0f} s on {rec['cores']} shared cores
when it was recorded),
which recorded it in `docs/figures/finetune_run.json`; the page is written from that record, and the
test suite repeats the base's held-out loss and the rank-{MAIN_RANK} run's first {CHECKED_STEPS} steps to check the
record still matches the code. Losses are printed to 2 decimals and answers counted: their later
digits are the BLAS kernel's, and a different kernel may flip a close answer or two.

""" + "\n\n".join(parts)
