"""The walkthrough's chapter "Teach it to reason": the bundled model taught a task whose answer a program
checks. SFT first (`train` on worked examples), then reinforcement learning from that checker (GRPO, `train
--grpo`), here without its KL term (TRL's default; the run with it is left, see BETAS); preference tuning
(DPO, `train --dpo`) on pairs made from the same task; and inference-time scaling (`generate --samples N
--vote`) measured beside what training bought.

The task: the user writes twelve binary digits, "011010010111"; the assistant answers how many of them are 1
("7") and stops. 4,096 strings; the held-out ones (HELD_OUT of them) are never trained on, by any stage. It is
counting on purpose: two-digit addition was tried first and, at these step counts, the model answered every
question with one constant (it had not learned to read the operands); counting it learns in minutes. The
checker is counting_reward.py, shipped beside this file: the reward is 1 when the reply is exactly the count,
else 0 (a reward > 0 counts as correct for pass@k).

The base is the bundled model with a chat template of the chapter's (CHAT_TEMPLATE): the user's text, then
"<|im_start|>assistant\\n" (which training.chats finds as the assistant's turn in the rendered text), the
reply, and the bundled tokenizer's one special token, <|endoftext|>, its end-of-sequence token. A real
Qwen3's turn ends in <|im_end|>, which is one of its end-of-sequence ids; here the reply's end is the
model's end-of-sequence token too, so sampling stops there and the reply's length is the model's choice,
which GRPO's progress reports. Its generation_config.json samples at temperature 1 with no top-k / top-p:
`eval` and `generate` then draw from the policy exactly as GRPO's rollouts do (TRL's defaults).

RECORDED, as sections 11-13: `python tools/walkthrough/walkthrough_chapter_reason.py` runs the chapter's
commands (`python -m qwen_np ...`, exactly as printed on the page, in a scratch folder) one after another
and writes docs/figures/reasoning.json; the page and its figure are made from that record.
tests/product/test_reasoning_chapter.py repeats the first SFT steps and the base's preference margin
(check_first_steps). The page prints shares as counts of the held-out prompts and losses to 2 decimals.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tools" / "walkthrough"))

from qwen_np.training.run_state import load_state  # noqa: E402
import walkthrough_common  # noqa: E402
from walkthrough_common import two  # noqa: E402

RECORD = REPO_ROOT / "docs" / "figures" / "reasoning.json"
REWARD_FILE = Path(__file__).resolve().parent / "counting_reward.py"
BUNDLED = walkthrough_common.BUNDLED_MODEL
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json")
# The user's text on a line, the assistant's header, the reply and the end-of-sequence token (see the docstring).
CHAT_TEMPLATE = ("{%- for message in messages %}{%- if message.role == 'assistant' %}"
                 "{{- '<|im_start|>assistant\\n' + message.content + '<|endoftext|>' }}"
                 "{%- else %}{{- message.content + '\\n' }}{%- endif %}{%- endfor %}"
                 "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# Sampling as GRPO's rollouts sample (TRL's temperature 1, top_p 1, top_k off): eval and generate use it too.
GENERATION = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "do_sample": True, "temperature": 1.0,
              "top_k": 0, "top_p": 1.0}
DIGITS = 12                        # binary digits a question
HELD_OUT = 100                     # problems no stage trains on: every figure of the chapter is measured on them
SFT_CHATS = 3000
SFT_VAL_CHATS = 20                 # the SFT run's --val (its best-keeping; scored one chat a forward)
GRPO_PROMPTS = 400                 # (their last 5% validate the run: best-keeping never sees the held-out ones)
PREF_PAIRS = 400                   # (their last 5% validate the DPO run)
SAMPLES = 8                        # eval --samples K (pass@1..K) and generate --samples N (the vote)
COMPLETION_TOKENS = 4              # a count has at most 2 digits, then the end-of-sequence token
SFT: dict[str, Any] = {"steps": 60, "batch_size": 16, "context": 32, "lr": 3e-4, "warmup": 5, "decay_steps": 60,
                       "eval_every": 60, "seed": 0}
GRPO: dict[str, Any] = {"steps": 20, "batch_size": 4, "group": 8, "context": 32, "lr": 5e-4, "warmup": 0,
                        "decay_steps": 20, "eval_every": 10, "seed": 0}
# GRPO without the KL term (TRL's default now). With it (beta 0.04, TRL's former default) is the comparison the
# chapter wants next: on the shared machine of this recording its run did not finish in time (20 s a step, twice
# beta 0's: the reference's forward); add 0.04 here and record again with the same --work folder.
BETAS = (0.0,)
DPO: dict[str, Any] = {"steps": 30, "batch_size": 8, "context": 32, "lr": 3e-4, "warmup": 0, "decay_steps": 30,
                       "eval_every": 30, "seed": 0, "beta": 0.1}
DONE = "done"                      # where a --work folder keeps each command's result
CHECKED_STEPS = 2                  # the SFT run's steps the drift test repeats
FLAGS = ("steps", "batch_size", "context", "lr", "warmup", "decay_steps", "eval_every", "seed", "group", "beta")


# --- The task -------------------------------------------------------------------------------------------

def problems() -> dict[str, list[str]]:
    """Every string of DIGITS binary digits, shuffled once, cut into disjoint sets: held-out, SFT (and its
    validation), GRPO prompts, preference pairs."""
    every = [format(i, f"0{DIGITS}b") for i in range(2 ** DIGITS)]
    random.Random(0).shuffle(every)
    sizes = {"held_out": HELD_OUT, "sft": SFT_CHATS, "sft_val": SFT_VAL_CHATS, "grpo": GRPO_PROMPTS, "prefs": PREF_PAIRS}
    cut, at = {}, 0
    for name, size in sizes.items():
        cut[name], at = every[at:at + size], at + size
    return cut


def answer(question: str) -> int:
    return question.count("1")


def miscount(question: str) -> int:
    """The mistake counting is about, one off (one more below half the digits, one less from there): the rejected
    reply of a preference pair."""
    right = answer(question)
    return right + 1 if right < DIGITS // 2 else right - 1


def chat_line(question: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": str(answer(question))}]}


def prompt_line(question: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": question}], "answer": answer(question)}


def pair_line(question: str) -> dict[str, Any]:
    """TRL's conversational preference format: the prompt's messages, the chosen and rejected replies."""
    return {"prompt": [{"role": "user", "content": question}],
            "chosen": [{"role": "assistant", "content": str(answer(question))}],
            "rejected": [{"role": "assistant", "content": str(miscount(question))}]}


def write_lines(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def chat_model(folder: Path) -> Path:
    """The bundled weights with CHAT_TEMPLATE and GENERATION: the base the chapter teaches."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in CHECKPOINT_FILES:
        shutil.copyfile(BUNDLED / name, folder / name)
    config = json.loads((BUNDLED / "tokenizer_config.json").read_text(encoding="utf-8"))
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}, indent=1),
                                                  encoding="utf-8")
    (folder / "generation_config.json").write_text(json.dumps(GENERATION, indent=1), encoding="utf-8")
    return folder


def task_files(folder: Path) -> None:
    """The chapter's files, as its commands name them, in `folder`: base/, the data and the checker."""
    cut = problems()
    chat_model(folder / "base")
    write_lines(folder / "sft.jsonl", [chat_line(q) for q in cut["sft"]])
    write_lines(folder / "sft_val.jsonl", [chat_line(q) for q in cut["sft_val"]])
    write_lines(folder / "prompts.jsonl", [prompt_line(q) for q in cut["grpo"]])
    write_lines(folder / "held_out.jsonl", [prompt_line(q) for q in cut["held_out"]])
    (folder / "held_out.txt").write_text("".join(q + "\n" for q in cut["held_out"]), encoding="utf-8")
    write_lines(folder / "prefs.jsonl", [pair_line(q) for q in cut["prefs"]])
    write_lines(folder / "held_out_prefs.jsonl", [pair_line(q) for q in cut["held_out"]])
    shutil.copyfile(REWARD_FILE, folder / REWARD_FILE.name)


# --- The commands ---------------------------------------------------------------------------------------

REWARD = f"{REWARD_FILE.name}:reward"
EXTRACT = f"{REWARD_FILE.name}:extract"


def flags(settings: dict[str, Any]) -> str:
    return " ".join(f"--{k.replace('_', '-')} {settings[k]:g}" for k in FLAGS if k in settings)


def sft_command() -> str:
    return f"python -m qwen_np train --model base --data sft.jsonl --val sft_val.jsonl --out sft {flags(SFT)}"


def grpo_command(beta: float) -> str:
    return (f"python -m qwen_np train --model sft/model --grpo --prompts prompts.jsonl --reward {REWARD} "
            f"--completion-tokens {COMPLETION_TOKENS} --out {grpo_out(beta)} {flags({**GRPO, 'beta': beta})}")


def grpo_out(beta: float) -> str:
    return f"grpo_beta{beta:g}"


def dpo_command() -> str:
    return f"python -m qwen_np train --model sft/model --dpo --data prefs.jsonl --out dpo {flags(DPO)}"


def eval_command(model: str) -> str:
    return (f"python -m qwen_np eval --model {model} --prompts held_out.jsonl --reward {REWARD} --samples {SAMPLES} "
            f"--completion-tokens {COMPLETION_TOKENS} --json")


def prefs_command(model: str) -> str:
    return f"python -m qwen_np eval --model {model} --prefs held_out_prefs.jsonl -c {DPO['context']} --json"


def vote_command(model: str) -> str:
    return (f"python -m qwen_np generate --model {model} -f held_out.txt --samples {SAMPLES} --vote --extract {EXTRACT} "
            f"-n {COMPLETION_TOKENS} --seed 0 --json -q")


def run_command(folder: Path, command: str) -> dict[str, Any]:
    """`command` (a `python -m qwen_np ...` line) run in `folder` with this checkout's qwen_np, one BLAS thread;
    its stdout, wall and CPU seconds (the child's user + system time). Kept in folder/DONE: a recording that
    stopped (or a changed page) goes on from the commands it has not run yet when given the same --work folder."""
    done_file = folder / DONE / (hashlib.sha256(command.encode()).hexdigest()[:16] + ".json")
    if done_file.is_file():
        return json.loads(done_file.read_text(encoding="utf-8"))
    argv = shlex.split(command)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OPENBLAS_NUM_THREADS": "1"}
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run([sys.executable, *argv[1:]], cwd=folder, env=env, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"`{command}` failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = {"command": command, "stdout": done.stdout, "wall_s": time.perf_counter() - started,
              "cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
              "load_average": os.getloadavg()[0]}
    done_file.parent.mkdir(exist_ok=True)
    done_file.write_text(json.dumps(result), encoding="utf-8")
    return result


def measured(folder: Path, command: str) -> dict[str, Any]:
    """A JSON-printing command's result, with the command and its time."""
    done = run_command(folder, command)
    return {"command": command, **json.loads(done["stdout"]), "wall_s": done["wall_s"], "cpu_s": done["cpu_s"],
            "load_average": done["load_average"]}


def trained(folder: Path, command: str, out: str) -> dict[str, Any]:
    """A train command's run: its history and evaluations as its last checkpoint keeps them, and its time."""
    if not (folder / DONE / (hashlib.sha256(command.encode()).hexdigest()[:16] + ".json")).is_file():
        shutil.rmtree(folder / out, ignore_errors=True)           # a run that stopped half-way starts again
    done = run_command(folder, command)
    meta = load_state(folder / out / "last.safetensors")[3]
    return {"command": command, "history": meta["history"], "evals": meta["evals"], "wall_s": done["wall_s"],
            "cpu_s": done["cpu_s"], "load_average": done["load_average"]}


def voted(folder: Path, model: str) -> dict[str, Any]:
    """generate --vote over the held-out questions: how many majorities are the count."""
    done = run_command(folder, vote_command(model))
    replies = [json.loads(line) for line in done["stdout"].splitlines() if line.strip()]
    sums = [answer(q) for q in problems()["held_out"]]
    right = sum(reply["answer"] is not None and int(reply["answer"]) == total for reply, total in zip(replies, sums,
                                                                                                      strict=True))
    # How spread each prompt's samples are: a policy that collapsed gives one answer SAMPLES times.
    distinct = float(np.mean([len(reply["votes"]) for reply in replies]))
    unanswered = sum(SAMPLES - sum(reply["votes"].values()) for reply in replies)
    return {"command": done["command"], "right": right, "prompts": len(sums), "distinct_answers": distinct,
            "unanswered_samples": unanswered, "wall_s": done["wall_s"], "cpu_s": done["cpu_s"],
            "load_average": done["load_average"]}


def record(work: Path | None = None, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Every command of the chapter, run in order in `work` (default: a scratch folder); the record keeps each
    command's wall and CPU seconds and the load average. Commands `work` has run already are not run again."""
    if work is None:
        with tempfile.TemporaryDirectory() as name:
            return record(Path(name), progress)
    started = time.perf_counter()          # (the progress notes' clock)
    rec: dict[str, Any] = {"settings": {"sft": SFT, "grpo": GRPO, "betas": list(BETAS), "dpo": DPO, "samples": SAMPLES,
                                        "completion_tokens": COMPLETION_TOKENS, "held_out": HELD_OUT,
                                        "sft_chats": SFT_CHATS, "grpo_prompts": GRPO_PROMPTS,
                                        "pref_pairs": PREF_PAIRS}}

    def note(what: str) -> None:
        progress(f"{what} ({time.perf_counter() - started:.0f} s)")

    folder = work
    task_files(folder)
    rec["base"] = {"eval": measured(folder, eval_command("base")), "prefs": measured(folder, prefs_command("base"))}
    note(f"base: {rec['base']['eval']['pass@1']:.3f} pass@1")
    rec["sft"] = trained(folder, sft_command(), "sft")
    rec["sft"].update(eval=measured(folder, eval_command("sft/model")), prefs=measured(folder, prefs_command("sft/model")),
                      vote=voted(folder, "sft/model"))
    note(f"sft: {rec['sft']['eval']['pass@1']:.3f} pass@1, vote {rec['sft']['vote']['right']}")
    rec["grpo"] = []
    for beta in BETAS:
        run = trained(folder, grpo_command(beta), grpo_out(beta))
        model = f"{grpo_out(beta)}/model"
        run.update(beta=beta, eval=measured(folder, eval_command(model)), vote=voted(folder, model))
        rec["grpo"].append(run)
        note(f"grpo beta {beta:g}: {run['eval']['pass@1']:.3f} pass@1, vote {run['vote']['right']}")
    rec["dpo"] = trained(folder, dpo_command(), "dpo")
    rec["dpo"].update(eval=measured(folder, eval_command("dpo/model")), prefs=measured(folder, prefs_command("dpo/model")))
    note(f"dpo: {rec['dpo']['prefs']['preference_accuracy']:.3f} preference accuracy, "
         f"{rec['dpo']['eval']['pass@1']:.3f} pass@1")
    commands = walk_commands(rec)          # (their wall time summed: a folder that ran them before still counts it)
    rec.update(seconds=sum(r["wall_s"] for r in commands), cpu_seconds=sum(r["cpu_s"] for r in commands),
               load_average=float(np.mean([r["load_average"] for r in commands])), cores=os.cpu_count())
    return rec


def walk_commands(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """Every command's entry of a record (each has its command, wall_s and cpu_s), in the order run."""
    found: list[dict[str, Any]] = []

    def visit(value: Any) -> None:
        if isinstance(value, dict):
            if "command" in value:
                found.append(value)
            for inner in value.values():
                visit(inner)
        elif isinstance(value, list):
            for inner in value:
                visit(inner)
    visit({k: v for k, v in rec.items() if k != "settings"})
    return found


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Run the walkthrough's reasoning chapter's commands (tens of minutes "
                                                 "on 2 shared cores) and record what they show.")
    parser.add_argument("--work", type=Path, help="the folder the commands run in, kept: run again with the same "
                                                  "folder, the commands it has run are not run again (default: a "
                                                  "scratch folder)")
    parser.add_argument("--out", type=Path, default=RECORD, help="where to write the record (default: "
                                                                 f"{RECORD.relative_to(REPO_ROOT)}, the page's source)")
    args = parser.parse_args(argv)
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(walkthrough_common.rounded(record(args.work)), indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()


def check_first_steps(recorded: dict[str, Any], steps: int = CHECKED_STEPS) -> None:
    """Repeat the chapter's first commands: the base's preference margin on the held-out pairs (eval --prefs) and
    the SFT run's first `steps` steps (its command with --steps cut, the schedule kept by --decay-steps); raise
    naming the first figure that differs from the record beyond rounding (rtol 1e-3: the record keeps 4 digits)."""
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        task_files(folder)
        fresh = [measured(folder, prefs_command("base"))["margin"]]
        first = sft_command().replace(f"--steps {SFT['steps']}", f"--steps {steps}")
        fresh += [r["loss"] for r in trained(folder, first, "sft")["history"]]
    wanted = [recorded["base"]["prefs"]["margin"]] + [r["loss"] for r in recorded["sft"]["history"][:steps]]
    for index, (got, want) in enumerate(zip(fresh, wanted, strict=True)):
        if not np.isclose(got, want, rtol=1e-3):
            what = "the base's preference margin" if index == 0 else f"the loss of the SFT run's step {index}"
            raise AssertionError(f"{what} is {got:.6g} now, {want:.6g} in {RECORD.name}: the code changed; "
                                 "re-record with `python tools/walkthrough/walkthrough_chapter_reason.py`")


# --- The page ---------------------------------------------------------------------------------------

def load_record() -> dict[str, Any]:
    return walkthrough_common.read_record(RECORD, "python tools/walkthrough/walkthrough_chapter_reason.py",
                                          "a quarter of an hour or more")


def claim(holds: bool, what: str) -> None:
    walkthrough_common.claim(holds, what, "reasoning chapter")


def running_mean(values: list[float], width: int = 8) -> list[float]:
    """The mean of each value and the width - 1 before it (fewer at the start): a noisy curve's trend."""
    return [float(np.mean(values[max(0, i - width + 1):i + 1])) for i in range(len(values))]


def figure(rec: dict[str, Any]) -> Any:
    """GRPO's runs step by step: the rollouts' mean reward (its running mean bold), the replies' mean length and
    the KL to the starting weights where the run has the term; the held-out validations marked."""
    import matplotlib.pyplot as plt

    panels = 3 if any(run["beta"] for run in rec["grpo"]) else 2
    fig, axes = plt.subplots(1, panels, figsize=(4.7 * panels, 4.2), dpi=100)
    for run, colour in zip(rec["grpo"], ("tab:blue", "tab:red")):
        steps = [r["step"] for r in run["history"]]
        label = f"beta {run['beta']:g}"
        rewards = [r["reward_mean"] for r in run["history"]]
        axes[0].plot(steps, rewards, color=colour, lw=0.8, alpha=0.35)
        axes[0].plot(steps, running_mean(rewards), color=colour, lw=2, label=f"{label}: rollouts (running mean)")
        axes[0].plot([e["step"] for e in run["evals"]], [e["reward_mean"] for e in run["evals"]], "o--", color=colour,
                     ms=4, lw=1, label=f"{label}: validation prompts")
        axes[1].plot(steps, running_mean([r["completion_length"] for r in run["history"]]), color=colour, lw=2,
                     label=label)
        if run["beta"]:                                # without the term the trainer computes no KL
            axes[2].plot(steps, running_mean([r["kl"] for r in run["history"]]), color=colour, lw=2, label=label)
    axes[0].set(title="reward (share of replies that are the count)", xlabel="GRPO step", ylim=(0, 1))
    axes[1].set(title="reply length (tokens, end-of-sequence included)", xlabel="GRPO step")
    if panels == 3:
        axes[2].set(title="KL to the SFT model (k3, per token)", xlabel="GRPO step")
    for axis in axes:
        axis.legend(fontsize=7.5)
    fig.tight_layout()
    return fig


def stages(rec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, its entry) of every model the chapter scores, in the order trained."""
    return ([("the base (bundled weights, the chapter's template)", rec["base"]), ("SFT", rec["sft"])] +
            [(f"SFT, then GRPO with beta {run['beta']:g}", run) for run in rec["grpo"]] + [("SFT, then DPO", rec["dpo"])])


def count(share: float, of: int) -> str:
    """A share of the held-out prompts as the count it is (pass@k is a mean over prompts of fractions: one decimal)."""
    return f"{share * of:.1f}" if abs(share * of - round(share * of)) > 0.05 else f"{round(share * of)}"


def results_table(rec: dict[str, Any]) -> str:
    n, k = rec["settings"]["held_out"], rec["settings"]["samples"]
    ks = [key for key in rec["base"]["eval"] if key.startswith("pass@")]
    head = " | ".join(ks)
    rows = []
    for name, entry in stages(rec):
        vote = entry.get("vote")
        rows.append(f"| {name} | " + " | ".join(count(entry["eval"][key], n) for key in ks) +
                    f" | {vote['right'] if vote else ''} |")
    return (f"| model | {head} (of {n}) | the majority of {k} right (`--vote`) |\n|---|" + "---:|" * (len(ks) + 1) +
            "\n" + "\n".join(rows))


def commands_block(rec: dict[str, Any]) -> str:
    lines = [rec["base"]["eval"]["command"], rec["base"]["prefs"]["command"], rec["sft"]["command"],
             rec["sft"]["eval"]["command"], rec["sft"]["vote"]["command"]]
    for run in rec["grpo"]:
        lines += [run["command"], run["eval"]["command"]]
    lines += [rec["dpo"]["command"], rec["dpo"]["prefs"]["command"]]
    return "```bash\n" + "\n".join(line for line in lines) + "\n```"


def rounded_share(share: float) -> str:
    return f"{share:.2f}"


def task_part(rec: dict[str, Any]) -> str:
    s = rec["settings"]
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        task_files(folder)
        lines = {file: (folder / file).read_text(encoding="utf-8").splitlines()[0]
                 for file in ("sft.jsonl", "prompts.jsonl", "prefs.jsonl")}
    source = REWARD_FILE.read_text(encoding="utf-8")
    checker = source[source.index("ANSWER = "):]
    return f"""**The task.** The user writes {DIGITS} binary digits; the assistant answers how many of them are 1, and
stops. A program checks the answer, so the reward needs no judge: that is what "verifiable" means, and it is the
setting in which 2025's reasoning models were trained by reinforcement learning (DeepSeek-R1's math and code,
rasbt's *Build a Reasoning Model* on MATH-500). The {2 ** DIGITS:,} strings are shuffled once and cut into
disjoint sets: {s['held_out']} held out (every figure below is measured on them, and no stage trains on them),
{s['sft_chats']:,} worked examples for SFT, {s['grpo_prompts']} prompts for GRPO and {s['pref_pairs']} preference pairs
for DPO. It is counting on purpose: two-digit addition was tried first, and at these step counts the model
answered every question with one number (it had not yet learned to read the operands); counting, it learns in
minutes of a shared CPU.

One line of each file (`sft.jsonl`: chats, as section 13's; `prompts.jsonl`: GRPO's and `eval`'s prompts, the
line's other fields passed to the reward function; `prefs.jsonl`: TRL's conversational preference format):

```json
{lines['sft.jsonl']}
{lines['prompts.jsonl']}
{lines['prefs.jsonl']}
```

The checker, `tools/walkthrough/{REWARD_FILE.name}` (the reward `train --grpo` and `eval --prompts` call with the
line's `answer`; the extractor `generate --vote` calls):

```python
{checker.rstrip()}
```

**The base.** The bundled model again, with a template of this chapter's: the user's text on a line, then
`<|im_start|>assistant\\n` (the header `training.chats` finds the assistant's turn by) and the reply, ended by
`<|endoftext|>`, the bundled tokenizer's end-of-sequence token. A real Qwen3's turn ends in `<|im_end|>`, which
is one of its end-of-sequence ids: here too the reply ends where the model writes its end-of-sequence token, so
the reply's length is the model's choice. Its `generation_config.json` samples at temperature 1 with no top-k or
top-p, so `eval` and `generate` draw replies exactly as GRPO's rollouts do (TRL's defaults)."""


def sft_part(rec: dict[str, Any]) -> str:
    base, sft, n = rec["base"], rec["sft"], rec["settings"]["held_out"]
    claim(sft["eval"]["pass@1"] > base["eval"]["pass@1"], "SFT raises held-out pass@1 over the base")
    losses = [r["loss"] for r in sft["history"]]
    return f"""**SFT first.** {rec['settings']['sft']['steps']} steps of {rec['settings']['sft']['batch_size']} worked
examples, every weight trained, the loss on the reply's tokens only (its end-of-sequence token included): the
loss per reply token fell from {two(losses[0])} to {two(losses[-1])}. Sampled at temperature 1, the base
answers {count(base['eval']['pass@1'], n)} of the {n} held-out questions right on average (pass@1); after SFT,
{count(sft['eval']['pass@1'], n)}. SFT taught the format and most of the rule; what is left is what
reinforcement learning can work on: the model is sometimes right, so among several samples of one question
some are rewarded and some are not."""


def grpo_part(rec: dict[str, Any]) -> str:
    g, n, k = rec["settings"]["grpo"], rec["settings"]["held_out"], rec["settings"]["samples"]
    sft = rec["sft"]
    runs = {run["beta"]: run for run in rec["grpo"]}
    free, kl = runs[0.0], next((run for beta, run in runs.items() if beta), None)
    rows = "\n".join(
        f"| {run['beta']:g} | " + ", ".join(f"{rounded_share(e['reward_mean'])} (step {e['step']})" for e in run["evals"]) +
        " | "
        f"{run['history'][0]['completion_length']:.1f} → {run['history'][-1]['completion_length']:.1f} | "
        f"{count(run['eval']['pass@1'], n)} | {count(run['eval'][f'pass@{k}'], n)} | "
        f"{run['vote']['distinct_answers']:.1f} |" for run in rec["grpo"])
    raised = [run for run in rec["grpo"] if run["eval"]["pass@1"] > sft["eval"]["pass@1"]]
    return f"""**Then GRPO.** Each step takes {g['batch_size']} prompts and samples {g['group']} replies to each (the
model as it stands; at most {rec['settings']['completion_tokens']} tokens), rewards each with the checker, and gives
each reply an *advantage*: its reward less its group's mean, over the group's standard deviation. A reply better
than its siblings is pushed up, a worse one down, and a group whose replies are all right (or all wrong) teaches
nothing: there is no critic network, the group is the baseline. The loss is TRL's clipped ratio
(`training.objectives.grpo_loss`, TRL's default `dapo` averaging over the batch's tokens; one update per
rollout, so the ratio is 1 and only its gradient matters), plus, with `--beta` > 0, beta times the k3 estimate
of the KL divergence to the starting (SFT) weights, a second copy of which the run keeps as the reference.
The gradient of the loss with respect to each token's log-probability goes into the same hand-written
backward as SFT's (`training.step.grpo_loss_and_gradients`).

| beta | validation reward | reply length (tokens) | pass@1 (of {n}) | pass@{k} | different answers in {k} samples |
|---:|---:|---:|---:|---:|---:|
{rows}

![GRPO: reward, reply length and KL per step](figures/reasoning.png)

(The validation reward is the mean over the run's own validation prompts, the last 5% of `prompts.jsonl`, {g['group']}
samples each; a step's rollouts are {g['batch_size']} prompts, so their mean reward in the figure moves by a quarter
when one prompt's group changes.)

After SFT the held-out pass@1 was {count(sft['eval']['pass@1'], n)} and pass@{k} {count(sft['eval'][f'pass@{k}'], n)}, with
{sft['vote']['distinct_answers']:.1f} different answers among a question's {k} samples. {grpo_reading(rec, free, kl, raised)}"""


COLLAPSED = 1.05                   # different answers a question's samples give, at most, in a collapsed policy


def collapsed(run: dict[str, Any], k: int) -> bool:
    """Each held-out question's k samples give (nearly) one answer, so pass@k is pass@1: the policy is a point."""
    return run["vote"]["distinct_answers"] <= COLLAPSED and run["eval"][f"pass@{k}"] - run["eval"]["pass@1"] < 0.02


def grpo_reading(rec: dict[str, Any], free: dict[str, Any], kl: dict[str, Any] | None,
                 raised: list[dict[str, Any]]) -> str:
    """What the two GRPO runs show, in words the record bears out."""
    n, k, sft = rec["settings"]["held_out"], rec["settings"]["samples"], rec["sft"]
    sentences = []
    if raised:
        sentences.append("GRPO raised held-out pass@1 " + " and ".join(
            f"to {count(run['eval']['pass@1'], n)} with beta {run['beta']:g}" for run in raised) +
            f", in {rec['settings']['grpo']['steps']} steps of {rec['settings']['grpo']['batch_size']} prompts.")
    else:
        sentences.append("Neither run raised held-out pass@1 in these few steps.")
    for run in (free, kl) if kl is not None else (free,):
        what = "Without the KL term" if run is free else f"With it (beta {run['beta']:g})"
        if collapsed(run, k):
            sentences.append(
                f"{what} the policy **collapsed**: each held-out question's {k} samples give one answer "
                f"({run['vote']['distinct_answers']:.2f} different answers a question, against "
                f"{sft['vote']['distinct_answers']:.1f} after SFT), so pass@{k} fell to pass@1 "
                f"({count(run['eval'][f'pass@{k}'], n)}, from {count(sft['eval'][f'pass@{k}'], n)}) and a vote "
                f"over samples adds nothing ({run['vote']['right']} right). The reward asked for right answers "
                "more often; the cheapest way up the reward was to stop sampling anything but the answer the "
                "model found likeliest, right or wrong. And a group whose replies are all alike has advantage 0 "
                "everywhere: it teaches nothing, so the run stalls where it collapsed.")
        else:
            sentences.append(
                f"{what} the samples stay spread: {run['vote']['distinct_answers']:.1f} different answers a "
                f"question ({sft['vote']['distinct_answers']:.1f} after SFT), pass@{k} "
                f"{count(run['eval'][f'pass@{k}'], n)} (after SFT {count(sft['eval'][f'pass@{k}'], n)}).")
    sentences.append("rasbt reports the same direction on MATH-500 with Qwen3-0.6B (pass@1 up while pass@8 stays "
                     "flat): reinforcement learning from a verifiable "
                     "reward mostly makes the model give, more often, an answer it could already sample; it "
                     "narrows the distribution more than it widens what the model can do.")
    return " ".join(sentences)


def dpo_part(rec: dict[str, Any]) -> str:
    d, sft = rec["dpo"], rec["sft"]
    before, after = sft["prefs"], d["prefs"]
    claim(after["preference_accuracy"] > before["preference_accuracy"],
          "DPO raises the held-out preference accuracy")
    return f"""**DPO on pairs from the same task.** Each pair is a question, its right count (chosen) and a count
one off (rejected): the mistake counting is about. DPO needs no sampling and no reward function: its loss,
-log sigmoid(beta ((log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected)))), pushes the
policy's log-probability of the chosen reply up against the rejected one's, relative to the reference (the SFT
weights, whose log-probabilities are computed once). `eval --prefs` reports the share of held-out pairs whose
chosen reply the model finds likelier than the rejected (`preference_accuracy`, over the reply's tokens) and
the mean margin: {before['preference_accuracy']:.0%} and {before['margin']:.2f} nats after SFT,
{after['preference_accuracy']:.0%} and {after['margin']:.2f} nats after {rec['settings']['dpo']['steps']} DPO steps
(beta {rec['settings']['dpo']['beta']:g}). {dpo_generation(rec)} DPO learns from fixed pairs, scored by the
log-probabilities of replies someone wrote; GRPO from the model's own replies, scored as they come."""


def dpo_generation(rec: dict[str, Any]) -> str:
    """What DPO did to the replies the model writes (held-out pass@1, sampled), in words the record bears out."""
    d, sft, n = rec["dpo"], rec["sft"], rec["settings"]["held_out"]
    if d["eval"]["pass@1"] >= sft["eval"]["pass@1"]:
        return (f"Its held-out pass@1, sampled, is {count(d['eval']['pass@1'], n)} of {n} (SFT's: "
                f"{count(sft['eval']['pass@1'], n)}).")
    return (f"But what it writes got worse: sampled, its held-out pass@1 is {count(d['eval']['pass@1'], n)} of {n} "
            f"(SFT's: {count(sft['eval']['pass@1'], n)}). The loss only asks the chosen reply to beat the rejected "
            "one by more than under the reference; nothing in it keeps the chosen reply likely, and "
            "lowering both, the rejected faster, satisfies it (the \"likelihood displacement\" reported of DPO). "
            "Its ranking of two given replies improved while the replies it samples left the task: "
            "preference accuracy is not the task's reward.")


def scaling_part(rec: dict[str, Any]) -> str:
    sft, n, k = rec["sft"], rec["settings"]["held_out"], rec["settings"]["samples"]
    best = max(rec["grpo"], key=lambda run: run["eval"]["pass@1"])
    return f"""**Inference-time scaling beside training.** Instead of training further, sample {k} replies a question
and answer with their majority (self-consistency: `generate --samples {k} --vote`, each reply's answer taken by the
checker's `extract`). From the SFT model, the majority of {k} is right for {sft['vote']['right']} of the {n}
held-out questions, against its pass@1 of {count(sft['eval']['pass@1'], n)}: {k} times the compute of one reply at
every question. GRPO's best run (beta {best['beta']:g}) answers {count(best['eval']['pass@1'], n)} with one sample
(and its majority of {k}: {best['vote']['right']}), for {best['cpu_s']:,.0f} s of CPU time spent once. The vote
helps only where the right answer is the most common one among the samples; pass@{k}
({count(sft['eval'][f'pass@{k}'], n)} after SFT) is the ceiling of any choice among {k} samples, which only a checker
at inference (best-of-N by the reward, `generate --best-of`) could reach."""


def chapter_section(number: int) -> str:
    """The chapter's markdown, from the recorded runs."""
    rec = load_record()
    parts = [task_part(rec), sft_part(rec), grpo_part(rec), dpo_part(rec), scaling_part(rec)]
    return f"""## {number}. Teach it to reason

Section 13 taught the bundled model a task by example (SFT). The step that made 2025's reasoning models is
another: let the model try, check its answers with a program, and reinforce what was right (**reinforcement
learning from verifiable rewards**, here GRPO, the algorithm of DeepSeek-R1 and TRL's `GRPOTrainer`). Beside it,
**preference tuning** (DPO) and **inference-time scaling** (sampling several answers and voting). Everything below
is one run of `python tools/walkthrough/walkthrough_chapter_reason.py`, which ran the chapter's commands exactly
as printed here, one after another in a scratch folder, and recorded what they printed in
`docs/figures/reasoning.json`: {rec['seconds'] / 60:,.0f} minutes of wall time and {rec['cpu_seconds'] / 60:,.0f} of CPU
time on {rec['cores']} cores shared with other work (a load average of {rec['load_average']:.1f} as its commands
ended, so wall time is several times CPU time; the record keeps each command's). The test suite repeats its
first commands (the base's preference margin and SFT's first {CHECKED_STEPS} steps) to check the record still
comes out of the code. Counts of the {rec['settings']['held_out']} held-out questions are printed as measured;
they come from sampling, and a different BLAS kernel may change a sample or two.

""" + "\n\n".join(parts[:1]) + "\n\nThe commands, in the order run:\n\n" + commands_block(rec) + "\n\n" + \
        results_table(rec) + "\n\n" + "\n\n".join(parts[1:])
