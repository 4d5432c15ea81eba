"""Write docs/walkthrough.md (and its figures and notebook) by running qwen_np on the bundled model.

The code shown is pulled from qwen_np's source with inspect.getsource, every shape and number comes
from running that code on weights/ (or --model), and every command's output on the page is what
that command prints (the generator runs it in-process), so none of them can drift from the library:
tests/product/test_walkthrough.py regenerates everything and fails when the committed files differ. The
output is deterministic: BLAS runs on one thread and numbers are printed to 4 significant digits.

The page is assembled here from its chapters: the shared run and formatting in walkthrough_common.py,
sections 3-4 in walkthrough_chapter_layers.py, 5-6 in walkthrough_chapter_prediction.py, 7-8 in
walkthrough_chapter_numbers.py, 9-10 in walkthrough_training.py, 11 in walkthrough_chapter_train.py,
12 in walkthrough_chapter_ablations.py (its mixture-of-experts part in walkthrough_moe.py), 13 in
walkthrough_chapter_finetune.py, 14 in walkthrough_chapter_serving.py,
15 in walkthrough_chapter_reason.py; the recorded measurements that 8 and 10 show in
walkthrough_chapter_measured.py; the opening, sections 1-2 and the last section are in this file.

Usage: python tools/walkthrough/make_walkthrough.py [--model weights]     (writes the page, figures and notebook)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

# walkthrough_common first: it puts this checkout on sys.path. Some names are imported for the tests.
from walkthrough_common import (BUNDLED_MODEL, DOCS, LAYER, MODEL_CODE,  # noqa: F401
                                REAL, WALKTHROUGH, Run, code_block, generate_command, model_digest, num, qwen3_tokenizer,
                                run_prompt, shape_of, shell_quote, step_code, values)

from qwen_np import preset
from qwen_np.core.config import parameter_count
from qwen_np.inspection import STEPS, STEPS_BY_NAME, SYMBOL_MEANINGS, dimensions, token_text  # noqa: F401
from walkthrough_chapter_layers import decoder_layer_data, layer_section, remaining_layers_section, rope_figure_data
from walkthrough_chapter_numbers import bandwidth_section, formats_section
from walkthrough_chapter_prediction import kv_cache_section, prediction_section
from walkthrough_exercises import with_exercises

# --- Sections ------------------------------------------------------------------------------------

def intro(run: Run) -> str:
    c, real = run.model.config, preset(REAL)
    ours, theirs = dimensions(c, len(run.ids)), dimensions(real, len(run.ids))
    table = "\n".join(f"| `{sym}` | {SYMBOL_MEANINGS[sym]} | {ours[sym]:,} | {theirs[sym]:,} |" for sym in ours)
    return f"""# Walkthrough: from a prompt to the next token, and training one yourself

**The model** on this page is Qwen3's exact architecture at a small size: {parameter_count(c):,} parameters,
trained from scratch on Shakespeare's plays by qwen_np's own NumPy trainer (`python -m qwen_np train`),
with a {c.vocab_size:,}-token byte-level BPE vocabulary learned from the same text. Give it
`{run.prompt!r}` and it answers `{token_text(run.tokenizer, run.answer)}`, the word that follows in the play.

**What you will see**: that prompt going through every step of the forward pass (sections 1 to 6:
tokens, embeddings, attention, the MLP, the prediction, the KV cache), each with the code that does it,
the real shapes and numbers it produces and a short reason for the design; what number formats and
memory bandwidth do to it, with this machine's caches measured (7, 8); one training step on it (9) and
what training holds in memory, with the remedies and mixed precision measured (10); then a model like
it trained by you from random weights in a few minutes (11): the data, the loss falling, words
appearing, validation, early stopping, batch size, checkpoints and the test split; each piece of
Qwen3 taken away in turn and that model trained again, to measure what the piece is for (12); the bundled
model fine-tuned on chats with LoRA (13): the assistant-only loss, base against tuned on held-out
plays, rank against quality and memory, merging; what a serving engine adds to run many
requests at once (14); last, the bundled model taught a task a program checks (15): SFT, then GRPO with
and without its KL term, DPO on preference pairs, and voting over samples beside them.

The dimensions (symbols used everywhere in qwen_np's shape comments):

| symbol | meaning | bundled model | Qwen3-8B |
|---|---|---:|---:|
{table}

{c.vocab_size * c.hidden_size:,} of the bundled model's parameters are the embedding table; Qwen3-8B has
{parameter_count(real):,}. Every step below is exactly what Qwen3-8B computes, only wider and deeper. To
see every shape at Qwen3-8B's size, run `python -m qwen_np inspect --preset qwen3-8b`.

This page is **generated**: `python tools/walkthrough/make_walkthrough.py` runs qwen_np on the bundled model in
`weights/` (weights digest `{model_digest(run.model_dir)}`) and writes this file, its figures in `docs/figures/`,
the notebook `docs/walkthrough.ipynb` (the same steps as code cells) and the glossary, and
`tests/product/test_walkthrough.py` fails if a committed file differs from a fresh run, so the code, numbers
and command outputs here are always the ones the library has now."""


def tokens_section(run: Run) -> str:
    rows = "\n".join(f"| {p} | {i} | `{token_text(run.tokenizer, i, width=40)}` |" for p, i in enumerate(run.ids))
    return f"""## 1. Prompt → token ids

The tokenizer (byte-level BPE, `qwen_np/files/tokenizer.py`) cuts the text into pieces from a fixed
vocabulary of {run.model.config.vocab_size:,} entries and replaces each piece by its id. A leading
space belongs to the word after it. No start-of-text token is added: Qwen3 never adds one.

{code_block(f"ids = tokenizer.encode({run.prompt!r})   # -> {run.ids}")}

| position | id | piece |
|---:|---:|---|
{rows}

From here on the model sees only these T = {len(run.ids)} integers.

{bpe_note(run)}

{chat_template_note()}"""


FIRST_MERGES = 12          # how many of the bundled tokenizer's merges the page lists


def bpe_note(run: Run) -> str:
    """How BPE's merges are learned, with the bundled tokenizer's first ones (its tokenizer.json, in order)."""
    import json

    model = json.loads((run.model_dir / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    shown = ", ".join(f"`{a}` + `{b}`" for a, b in merges[:FIRST_MERGES])
    return f"""**How the vocabulary was learned: byte-pair encoding.** BPE starts from the 256 byte values,
each one token, and learns merges one at a time: over the whole training text (first cut into words, a
leading space kept with its word) it counts every pair of neighbouring symbols, makes the most frequent
pair one new symbol, rewrites the text with it, and counts again. Each merge adds one entry to the
vocabulary; the bundled tokenizer learned {len(merges):,} of them from the plays (`training.data.train_tokenizer`,
the `tokenizers` library's BpeTrainer), in this order, first: {shown}. (`Ġ` is how a byte-level
vocabulary writes the space byte: `Ġt` is " t".) The first merges are the most frequent pairs of English
letters and a space with the letter after it; later ones build on earlier ones (`Ġt` + `he` makes " the").
Encoding a new text replays the merges in the order they were learned, so a common word becomes one token
and a rare one several. Exercise 2 has you write the learning loop, graded against the BpeTrainer."""


CHAT_QUESTION = "Who wrote Hamlet?"


def chat_template_note() -> str:
    tokenizer = qwen3_tokenizer()
    messages = [{"role": "user", "content": CHAT_QUESTION}]
    thinking = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    direct = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
    plain = len(tokenizer.encode(CHAT_QUESTION))
    return f"""**What a chat model adds to the prompt.** The bundled model continues raw text, so every command
on this page passes `--no-chat`. A chat model such as Qwen3-8B was fine-tuned on conversations
written in a fixed layout, its **chat template** (a Jinja program in `tokenizer_config.json`), and
answers well only when the prompt is written the same way. `generate` applies it unless `--no-chat`
is given. With the real Qwen3 tokenizer, the question `{CHAT_QUESTION!r}` ({plain} tokens as plain text)
becomes:

{code_block(thinking, "text")}

{len(tokenizer.encode(thinking))} tokens: `<|im_start|>` and `<|im_end|>` are single special tokens that
frame each turn, and the prompt ends where the assistant's turn begins. Qwen3 then *thinks* first:
it writes its reasoning between `<think>` and `</think>`, then the answer. With `--no-think`
(`enable_thinking=False`) the template writes an empty thinking block itself, so the model answers
at once ({len(tokenizer.encode(direct))} tokens):

{code_block(direct, "text")}"""


def embedding_section(run: Run, shown: set[str]) -> str:
    step = STEPS_BY_NAME["model.embed_tokens"]
    x = run.at(step)
    norms = ", ".join(num(np.linalg.norm(row)) for row in x)
    return f"""## 2. Token ids → vectors: the embedding

Each id selects one row of the embedding table `model.embed_tokens.weight`
({shape_of(run, step, step.weight)}). The rows are the model's learned starting point for each
token; from here on every token is a vector of D = {run.model.config.hidden_size} numbers, and the
sequence is a matrix {shape_of(run, step)}. This matrix is the **residual stream**: every layer reads
it and adds its own contribution to it.

The lines of `Qwen3Model.forward_batch` (which `forward` calls with one sequence; a batch packs
several sequences' tokens one after another) up to this point check the ids and find their
positions, build the RoPE angle tables once for all layers (step 3.7 uses them), and look up the
embeddings. (This is the readable path, which every traced pass like this one runs; untraced calls
go to `qwen_np/engine/fast.py`'s `FastQwen3Model.forward_batch`, the same math arranged for speed, unless
the model was loaded with `fast=False`.)

{step_code(step, shown)}

Real values: the vector of `{token_text(run.tokenizer, run.ids[0])}` starts {values(x[0])}; the
lengths (L2 norms) of the {len(run.ids)} vectors are {norms}."""


def next_steps_section(run: Run, number: int) -> str:
    from qwen_np.training.settings import PRESET_CONFIGS, PRESET_SETTINGS

    prompt = shell_quote(run.prompt)
    tiny_layers = PRESET_CONFIGS["tiny"]["num_hidden_layers"]
    tiny_steps = PRESET_SETTINGS["tiny"]["steps"]
    return f"""## {number}. Try it yourself

```bash
python -m qwen_np inspect --preset qwen3-8b          # every shape and count above at full size, and its memory
{generate_command(run, "--trace-layers", str(LAYER))}
{generate_command(run, "--lens")}
python -m qwen_np generate --no-chat -n 40 {prompt}   # let it go on
python -m qwen_np train --preset tiny --out /tmp/tiny  # a whole run: {tiny_layers} layers, {tiny_steps} steps, no words yet
```

The same steps as runnable code: [`docs/walkthrough.ipynb`](walkthrough.ipynb). In Python, any
forward pass can be traced:

```python
from qwen_np import load_model
from qwen_np.inspection import Tracer
from qwen_np.files.model_files import read_tokenizer
model, tokenizer = load_model("bundled"), read_tokenizer("bundled")   # the bundled model, from any folder
model.forward(tokenizer.encode({run.prompt!r}), trace=Tracer())
```

The words this page uses, with the function, flag and section for each: [`docs/glossary.md`](glossary.md)."""


@dataclass
class Page:
    """The generated files' contents: the walkthrough, its figures' data, and the notebook's sections."""

    markdown: str
    sections: list[str]                  # the markdown split into the page's sections, in order
    figures: dict[str, Any]              # figure name -> the numbers it is drawn from
    model_dir: Path
    run: Run
    facts: dict[str, Any]                # numbers on the page that the notebook's code must reproduce
    executed: Any = None                 # the notebook's code run here: its variables and outputs (walkthrough_files)


def render_page(model_dir: Path | None = None) -> Page:
    """The whole walkthrough, from a real run on the model in `model_dir` (default: BUNDLED_MODEL)."""
    model_dir = model_dir or BUNDLED_MODEL
    from walkthrough_chapter_ablations import chapter_section as ablation_section, load_record as ablation_record
    from walkthrough_chapter_serving import serving_section
    from walkthrough_chapter_finetune import chapter_section as finetune_section, load_record as finetune_record
    from walkthrough_chapter_reason import chapter_section as reason_section, load_record as reason_record
    from walkthrough_chapter_train import chapter_section, load_record
    from walkthrough_moe import load_record as moe_record, moe_section
    from walkthrough_training import memory_section, training_step_section

    with threadpool_limits(limits=1):        # one BLAS thread: the same sums in the same order every run
        run = run_prompt(model_dir)
        run.figures["rope"] = rope_figure_data(run.model.config)
        run.figures["decoder_layer"] = decoder_layer_data(run)
        run.figures["training_run"] = load_record()
        run.figures["ablations"] = ablation_record()
        run.figures["moe"] = moe_record()
        run.figures["finetune_run"] = finetune_record()
        run.figures["reasoning"] = reason_record()
        shown: set[str] = set()              # layers.* functions whose source is already on the page
        facts: dict[str, Any] = {}
        sections = [intro(run), tokens_section(run), embedding_section(run, shown), layer_section(run, shown),
                    remaining_layers_section(run), prediction_section(run, shown), kv_cache_section(run),
                    formats_section(run), bandwidth_section(run),
                    training_step_section(model_dir, num, code_block, facts, run.figures),
                    memory_section(model_dir, num, run.figures), chapter_section(11),
                    ablation_section(12) + "\n\n" + moe_section(),
                    finetune_section(13, qwen3_tokenizer(), trained_in=11), serving_section(run, 14, facts),
                    reason_section(15), next_steps_section(run, 16)]
        sections = with_exercises(sections, run)
    return Page("\n\n".join(sections) + "\n", sections, run.figures, model_dir, run, facts)


def render(model_dir: Path | None = None) -> str:
    """The walkthrough's markdown."""
    return render_page(model_dir).markdown


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=BUNDLED_MODEL, help="checkpoint folder (default: weights)")
    parser.add_argument("--docs", type=Path, default=DOCS,
                        help="folder for walkthrough.md, walkthrough.ipynb and figures/ (default: docs)")
    args = parser.parse_args(argv)
    from walkthrough_files import write_all

    for path in write_all(render_page(args.model), args.docs):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
