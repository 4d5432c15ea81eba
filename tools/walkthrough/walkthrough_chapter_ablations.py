"""The walkthrough's chapter "Ablations": chapter 11's model trained again with one piece of Qwen3 taken away
each time (config.ABLATION_CHOICES, and num_key_value_heads for MHA / GQA / MQA), its validation loss measured.

RECORDED like chapter 11 (too slow for every test run): `python tools/walkthrough/walkthrough_chapter_ablations.py` trains
every variant one after another and writes docs/figures/ablations.json; the page is rendered from that record.
tests/core/test_ablations.py repeats the first steps of a few variants (check_first_steps) and fails when they no
longer match the record.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
from threadpoolctl import threadpool_limits

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tools" / "walkthrough"))

from qwen_np.core.config import ABLATION_CHOICES, PRESETS, Qwen3Config, parameter_count  # noqa: E402
from qwen_np.core.ablations import AblatedModel  # noqa: E402
from qwen_np.core.model import Qwen3Model  # noqa: E402
from qwen_np.engine.memory import kv_cache_bytes_per_token  # noqa: E402
from qwen_np.training import step as training, parameters, text_data  # noqa: E402
from walkthrough_chapter_train import CONFIG, load_data, validation_loss  # noqa: E402
from walkthrough_common import code_block, two  # noqa: E402
import walkthrough_common  # noqa: E402

RECORD = REPO_ROOT / "docs" / "figures" / "ablations.json"
# Chapter 11's model and batches, for fewer steps: the runs take about a quarter of an hour on 2 cores.
RUN = {"steps": 350, "batch_size": 16, "context": 64, "lr": 1e-2, "warmup": 40, "weight_decay": 0.1,
       "clip": 1.0, "seed": 0, "shards": 2, "eval_every": 50}
# QK-norm keeps attention logits bounded when the weights move fast: at chapter 11's rate it makes no
# difference, so it is also measured at a rate ten times higher (100-200-step trials at 0.05, 0.1 and 0.3
# chose it: the lowest where the run without it falls clearly behind).
HIGH_LR = 0.1
# Pre-norm is there for depth: at 2 layers post-norm trains well, at 8 without warmup it stalls (a 100-step
# trial each; more steps change neither).
DEEP = {"num_hidden_layers": 8}
DEEP_RUN = {"steps": 100, "warmup": 0}
# Each variant: a key, a name, what it changes in chapter 11's config.json, and in RUN.
VARIANTS: list[dict[str, Any]] = [
    {"key": "qwen3", "name": "Qwen3 (GQA: 4 query heads, 2 KV heads)", "config": {}},
    {"key": "qwen3_seed1", "name": "Qwen3, another seed", "config": {}, "run": {"seed": 1}},
    {"key": "no_rope", "name": "no RoPE", "config": {"use_rope": False}},
    {"key": "no_qk_norm", "name": "no QK-norm", "config": {"use_qk_norm": False}},
    {"key": "post_norm", "name": "post-norm", "config": {"norm_position": "post"}},
    {"key": "no_residual", "name": "no residual", "config": {"use_residual": False}},
    # Equal parameters: SwiGLU has 3 D F weights (gate, up, down), a GELU MLP 2 D F', so F' = 1.5 F.
    {"key": "gelu", "name": "GELU MLP (F' = 1.5 F)",
     "config": {"mlp_type": "gelu", "intermediate_size": CONFIG["intermediate_size"] * 3 // 2}},
    {"key": "mha", "name": "MHA (4 KV heads)", "config": {"num_key_value_heads": CONFIG["num_attention_heads"]}},
    {"key": "mqa", "name": "MQA (1 KV head)", "config": {"num_key_value_heads": 1}},
    {"key": "qwen3_high_lr", "name": f"Qwen3, lr {HIGH_LR:g}", "config": {}, "run": {"lr": HIGH_LR}},
    {"key": "no_qk_norm_high_lr", "name": f"no QK-norm, lr {HIGH_LR:g}", "config": {"use_qk_norm": False},
     "run": {"lr": HIGH_LR}},
    {"key": "deep_pre_norm", "name": "Qwen3, 8 layers, no warmup", "config": DEEP, "run": DEEP_RUN},
    {"key": "deep_post_norm", "name": "post-norm, 8 layers, no warmup", "config": {**DEEP, "norm_position": "post"},
     "run": DEEP_RUN},
]
# The runs each comparison is against (the figure's panels and the table's last columns).
REFERENCE = {"qwen3_high_lr": "qwen3_high_lr", "no_qk_norm_high_lr": "qwen3_high_lr",
             "deep_pre_norm": "deep_pre_norm", "deep_post_norm": "deep_pre_norm"}
CHECKED_STEPS = 5                 # the first steps the drift test repeats
CHECKED_VARIANTS = ("no_rope", "post_norm", "gelu")


def variant_config(variant: dict[str, Any]) -> dict[str, Any]:
    """The config.json a learner writes for this variant: chapter 11's with the variant's fields."""
    return {**CONFIG, **variant["config"]}


def model_config(variant: dict[str, Any]) -> Qwen3Config:
    return Qwen3Config.from_dict(parameters.hf_config(variant_config(variant)), source=variant["key"])


def settings(variant: dict[str, Any]) -> dict[str, Any]:
    """RUN with the variant's changes to it."""
    return {**RUN, **variant.get("run", {})}


@dataclass
class Trial:
    """A new random model of a variant and its optimizer; step(tokens, i) takes the i-th optimizer step (from 0)."""

    variant: dict[str, Any]
    model: Qwen3Model = field(init=False)
    params: dict[str, np.ndarray] = field(init=False)
    optimizer: training.AdamW = field(init=False)
    order: text_data.WindowOrder | None = None

    def __post_init__(self) -> None:
        config, run = model_config(self.variant), settings(self.variant)
        self.params = parameters.init_parameters(config, run["seed"])
        self.model = parameters.model_from_parameters(config, self.params)
        self.optimizer = training.adamw_for(self.params, weight_decay=run["weight_decay"])

    def step(self, tokens: np.ndarray, i: int) -> float:
        """Chapter 11's step: batch, loss and gradients, clip, AdamW at the schedule's rate."""
        run = settings(self.variant)
        self.order = self.order or text_data.WindowOrder(len(tokens), run["context"], run["seed"])
        batch = self.order.next_batch(tokens, run["batch_size"])                              # [B, T+1]
        loss, grads = training.loss_and_accumulated_gradients(self.model, batch, 1, threads=2, shards=run["shards"])
        training.clip_gradients(grads, run["clip"])
        self.optimizer.update(self.params, grads, training.learning_rate(i, run["lr"], run["warmup"], run["steps"]))
        return loss


def largest_attention_logit(model: Qwen3Model, tokens: np.ndarray) -> float:
    """The largest score q.k / sqrt(Dh) of any head and layer on one validation window: what QK-norm bounds."""
    scores: list[np.ndarray] = []
    model.forward(tokens, trace=lambda name, value: scores.append(value) if name.endswith("self_attn.scores") else None)
    return max(float(np.max(np.where(np.isfinite(s), s, -np.inf))) for s in scores)


def train_variant(variant: dict[str, Any], tokens: np.ndarray, validation: list[np.ndarray],
                  progress: Callable[[str], None]) -> dict[str, Any]:
    """One run: RUN's steps, validation every eval_every steps, and what the chapter shows of it."""
    started = time.perf_counter()
    trial, run = Trial(variant), settings(variant)
    losses, evals = [], []
    for i in range(run["steps"] + 1):
        if i % run["eval_every"] == 0:
            evals.append({"step": i, "loss": validation_loss(trial.model, validation)})
        if i < run["steps"]:
            losses.append(trial.step(tokens, i))
    model, config = trial.model, trial.model.config
    progress(f"{variant['key']}: validation {evals[-1]['loss']:.3f} ({time.perf_counter() - started:.0f} s)")
    return {"key": variant["key"], "name": variant["name"], "config": variant_config(variant),
            "run": variant.get("run", {}), "lr": run["lr"], "steps": run["steps"],
            "parameters": parameter_count(config), "kv_bytes_per_token": kv_cache_bytes_per_token(config),
            "first_losses": losses[:CHECKED_STEPS], "final_train_loss": float(np.mean(losses[-run["eval_every"]:])),
            "evals": evals, "final_loss": evals[-1]["loss"],
            "largest_attention_logit": largest_attention_logit(model, validation[0][:run["context"]]),
            "seconds": round(time.perf_counter() - started)}


def unigram_loss(tokens: np.ndarray, validation: list[np.ndarray]) -> float:
    """The validation sample's loss under the training tokens' frequencies alone: a model that ignores the context."""
    counts = np.bincount(tokens, minlength=CONFIG["vocab_size"]) + 1.0                   # +1: no token has p = 0
    log_p = np.log(counts / counts.sum())
    targets = np.concatenate([doc[1:] for doc in validation])
    return float(-log_p[targets].mean())


def record(progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Every variant's run, one after another (about ten minutes on 2 cores; the record keeps the seconds)."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as name, threadpool_limits(limits=1):
        corpus, validation, _ = load_data(Path(name))
        runs = [train_variant(variant, corpus.train, validation, progress) for variant in VARIANTS]
    return {"run": RUN, "runs": runs, "unigram_loss": unigram_loss(corpus.train, validation), "cores": os.cpu_count(),
            "seconds": round(time.perf_counter() - started)}


def check_first_steps(recorded: dict[str, Any], keys: tuple[str, ...] = CHECKED_VARIANTS) -> None:
    """Repeat the first CHECKED_STEPS steps of these variants; raise naming the first loss that differs beyond rounding."""
    runs = {run["key"]: run for run in recorded["runs"]}
    with tempfile.TemporaryDirectory() as name, threadpool_limits(limits=1):
        corpus, _, _ = load_data(Path(name))
        for variant in (v for v in VARIANTS if v["key"] in keys):
            trial = Trial(variant)
            for i, want in enumerate(runs[variant["key"]]["first_losses"]):
                got = trial.step(corpus.train, i)
                if not np.isclose(got, want, rtol=1e-3):
                    raise AssertionError(f"{variant['key']}: the loss of step {i + 1} is {got:.6g} now, {want:.6g} in "
                                         f"{RECORD.name}: re-record with "
                                         "`python tools/walkthrough/walkthrough_chapter_ablations.py`")


def notebook_code(keys: tuple[str, ...] = CHECKED_VARIANTS[:2]) -> str:
    """The chapter's notebook cell: two variants' first CHECKED_STEPS steps, as a reader types them over section 11's
    cell (its CONFIG and corpus), each a config.json with a field changed."""
    changes = {v["key"]: v["config"] for v in VARIANTS if v["key"] in keys}
    return f'''ablation_losses = {{}}           # the chapter's runs: python tools/walkthrough/walkthrough_chapter_ablations.py
for name, changes in {changes!r}.items():
    variant = Qwen3Config.from_dict(parameters.hf_config({{**CONFIG, **changes}}))
    variant_params = parameters.init_parameters(variant, seed={RUN['seed']})
    ablated = parameters.model_from_parameters(variant, variant_params)    # the ablated layer (core/ablations.py)
    variant_optimizer = training.adamw_for(variant_params, weight_decay={RUN['weight_decay']})
    variant_order = text_data.WindowOrder(len(corpus.train), {RUN['context']}, seed={RUN['seed']})
    variant_losses = []
    for step in range({CHECKED_STEPS}):
        windows = variant_order.next_batch(corpus.train, {RUN['batch_size']})              # [B, T+1]
        step_loss, step_grads = training.loss_and_accumulated_gradients(ablated, windows, 1, threads=2, shards={RUN['shards']})
        training.clip_gradients(step_grads, {RUN['clip']})
        rate = training.learning_rate(step, {RUN['lr']}, {RUN['warmup']}, {RUN['steps']})
        variant_optimizer.update(variant_params, step_grads, rate)
        variant_losses.append(step_loss)
    ablation_losses[name] = variant_losses
    print(name, "first losses:", [round(loss, 2) for loss in variant_losses])'''


def notebook_checks(keys: tuple[str, ...] = CHECKED_VARIANTS[:2]) -> dict[str, Any]:
    """Expressions over the notebook's variables after that cell, and what the record says they are."""
    runs = {run["key"]: run for run in load_record()["runs"]}
    return {f"bool(np.allclose(ablation_losses[{key!r}], {runs[key]['first_losses']!r}, rtol=1e-3))": True for key in keys}


def main(argv: list[str] | None = None) -> None:
    walkthrough_common.record_main("Train the walkthrough's ablations (about ten minutes on 2 cores) "
                                   "and record what the chapter shows.", RECORD, record, argv)


if __name__ == "__main__":
    main()


# --- The page ---------------------------------------------------------------------------------------

def load_record() -> dict[str, Any]:
    return walkthrough_common.read_record(RECORD, "python tools/walkthrough/walkthrough_chapter_ablations.py",
                                          "about ten minutes")


def claim(holds: bool, what: str) -> None:
    walkthrough_common.claim(holds, what, "ablation chapter")


def figure(data_: dict[str, Any]) -> Any:
    """Every run's validation loss against the step: one piece away at chapter 11's settings, QK-norm at a high
    learning rate, post-norm in depth."""
    import matplotlib.pyplot as plt

    runs = {run["key"]: run for run in data_["runs"]}
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.8), dpi=100, gridspec_kw={"width_ratios": [1.7, 1, 1]})
    # Each panel: its runs, and what tells its first two (the faint pair, at chapter 11's settings) from the rest.
    panels = {"one piece taken away": ([k for k in runs if k not in REFERENCE], ""),
              "QK-norm at a high learning rate": (["qwen3", "no_qk_norm", "qwen3_high_lr", "no_qk_norm_high_lr"],
                                                  f", lr {data_['run']['lr']:g}"),
              "post-norm in depth": (["qwen3", "post_norm", "deep_pre_norm", "deep_post_norm"],
                                     f", {CONFIG['num_hidden_layers']} layers")}
    for axis, (title, (keys, pair)) in zip(axes, panels.items()):
        for index, key in enumerate(keys):
            run = runs[key]
            faint = bool(pair) and index < 2
            bold = key in ("qwen3", *REFERENCE.values()) and not faint
            axis.plot([e["step"] for e in run["evals"]], [e["loss"] for e in run["evals"]], "o--" if faint else "o-",
                      ms=2.5, lw=2.2 if bold else 1.3, alpha=0.45 if faint else 1.0,
                      color="black" if key in ("qwen3", *REFERENCE.values()) else None,
                      label=run["name"] + (pair if faint else ""))
        axis.set(title=title, xlabel="step")
        axis.legend(fontsize=7.5)
    axes[0].set_ylabel("validation loss (nats per token)")
    top = max(e["loss"] for run in data_["runs"] for e in run["evals"][1:])
    for axis in axes:
        axis.axhline(data_["unigram_loss"], color="#999999", lw=0.8, ls=":")
        axis.set_ylim(top=top + 0.1)
    axes[0].annotate("each token's frequency alone", (data_["run"]["steps"], data_["unigram_loss"]), xytext=(-4, -11),
                     ha="right", textcoords="offset points", fontsize=7.5, color="#666666")
    fig.tight_layout()
    return fig


def chapter_section(number: int) -> str:
    """The chapter's markdown, from the recorded runs."""
    import inspect

    rec = load_record()
    run, runs = rec["run"], {r["key"]: r for r in rec["runs"]}
    base = runs["qwen3"]
    return f"""## {number}. Ablations: why each piece is there, measured

Sections 3 and 4 gave a reason for each piece of a Qwen3 layer. Here each is taken away in turn and
chapter 11's model ({base['parameters']:,} parameters) is trained again, from random weights drawn with the
same seed, on the same batches: {run['steps']} steps of B × T = {run['batch_size']} × {run['context']} tokens, peak learning rate
{run['lr']:g} ({run['warmup']} warmup steps, then cosine decay), its validation loss measured every
{run['eval_every']} steps on chapter 11's validation sample. One change per run, so a difference is that
piece's doing. The {len(rec['runs'])} runs are one recording of `python tools/walkthrough/walkthrough_chapter_ablations.py`
({rec['seconds']:,} s on the {rec['cores']} cores of the machine that recorded them), kept in
`docs/figures/ablations.json`; the page is written from it, and `tests/core/test_ablations.py` repeats the first
{CHECKED_STEPS} steps of {', '.join(f'`{k}`' for k in CHECKED_VARIANTS)} to check the record still comes out of the code.

{options_part()}

{code_block(inspect.getsource(AblatedModel.decoder_layer))}

{results_part(rec)}

{pieces_part(rec)}

{heads_part(rec)}

{run_it_part(rec)}"""


def options_part() -> str:
    rows = "\n".join(f"| `{name}` | `{json.dumps(choices[0])}` | `{json.dumps(choices[1])}` | {ABLATION_MEANING[name]} |"
                     for name, choices in ABLATION_CHOICES.items())
    return f"""**The options.** Each is a field of `config.json` (`Qwen3Config`, `qwen_np/core/config.py`), Qwen3's
value by default, so a released checkpoint is unchanged; MHA, GQA and MQA need no field of their own:
they are `num_key_value_heads`.

| field | Qwen3 | ablation | what the ablation does |
|---|---|---|---|
{rows}

The hand-written backward (`training/gradients.py`) reverses each: a skipped RoPE or QK-norm passes its
gradient through, `residual_block_backward` is one block in each placement (with or without the residual),
`gelu_mlp_backward` the GELU MLP; `tests/training/test_gradients.py` checks every weight's gradient of each against
central differences. The fast path (`engine/fast.py`) is Qwen3's alone and refuses an ablation; `load_model`
gives an ablated checkpoint the readable path, so `generate` runs it. The decoder layer reads the fields as
one-line choices beside the Qwen3 steps they change (`if pre`, `if c.use_rope`, `if c.use_residual`, and
the weights an ablated layer lacks):"""


ABLATION_MEANING = {
    "use_rope": "no rotary position embedding: q and k are not rotated, only the causal mask tells positions apart",
    "use_qk_norm": "no RMSNorm of each query and key head (and no `q_norm` / `k_norm` weights)",
    "norm_position": "each block's norm after its residual sum, `x = norm(x + f(x))`, as the 2017 Transformer, "
                     "instead of before its branch, `x = x + f(norm(x))`",
    "use_residual": "no `x +`: each block's output replaces the stream instead of adding to it",
    "mlp_type": "`down(gelu(up(x)))`, GPT-2's MLP, no `gate_proj`; give it `intermediate_size` 1.5 F for "
                "SwiGLU's parameters (3 D F = 2 D F')",
}


def results_part(rec: dict[str, Any]) -> str:
    runs = {r["key"]: r for r in rec["runs"]}

    def delta(r: dict[str, Any]) -> str:
        reference = runs[REFERENCE.get(r["key"], "qwen3")]
        return "—" if r is reference else f"{r['final_loss'] - reference['final_loss']:+.2f}"

    def changed(r: dict[str, Any]) -> str:
        fields = {**{k: v for k, v in r["config"].items() if CONFIG.get(k) != v}, **r["run"]}
        return ", ".join(f"`{k}: {json.dumps(v)}`" for k, v in fields.items()) or "—"

    rows = "\n".join(f"| {r['name']} | {changed(r)} | {r['parameters']:,} | {r['kv_bytes_per_token']:,} | "
                     f"{two(r['final_train_loss'])} | **{two(r['final_loss'])}** | {delta(r)} | "
                     f"{r['largest_attention_logit']:.1f} |" for r in rec["runs"])
    last = rec["run"]["eval_every"]
    return f"""**The results.** Validation loss every {rec['run']['eval_every']} steps, each run against Qwen3's (black):

![validation loss of each ablation](figures/ablations.png)

| run | changed | parameters | KV cache, bytes per token (FP32) | training loss (last {last} steps) | \
final validation loss | vs its Qwen3 | largest attention logit |
|---|---|---:|---:|---:|---:|---:|---:|
{rows}

"vs its Qwen3" is the difference from the Qwen3 run with the same settings (its rate, its depth). How much
of a difference is noise: the same run from another random start (`seed: 1`) ends {two(seed_noise(runs))}
apart, so a gap of that size says nothing. The last column is the largest score q·k/√Dh of any head
after training, on one validation window: the number QK-norm bounds. For scale: a model that ignores
the context and predicts each token by its frequency in the training text scores {two(rec['unigram_loss'])}
on the same sample."""


def seed_noise(runs: dict[str, dict[str, Any]]) -> float:
    return abs(runs["qwen3_seed1"]["final_loss"] - runs["qwen3"]["final_loss"])


def pieces_part(rec: dict[str, Any]) -> str:
    runs = {r["key"]: r for r in rec["runs"]}

    def gap(key: str) -> float:
        return runs[key]["final_loss"] - runs[REFERENCE.get(key, "qwen3")]["final_loss"]

    noise, unigram = seed_noise(runs), rec["unigram_loss"]
    high, deep = runs["qwen3_high_lr"], runs["deep_pre_norm"]
    claim(noise < 0.1, "another seed moves Qwen3's final loss by less than a tenth")
    claim(gap("no_residual") > 0.5 and abs(runs["no_residual"]["final_loss"] - unigram) < 0.1,
          "without residuals the model ends near the unigram loss")
    claim(abs(gap("no_rope")) < 2 * noise, "no RoPE is within twice the seed noise")
    claim(abs(gap("no_qk_norm")) < 2 * noise, "QK-norm makes no difference at chapter 11's rate")
    claim(gap("no_qk_norm_high_lr") > 0.2, "without QK-norm the high-rate run falls behind")
    claim(runs["no_qk_norm_high_lr"]["largest_attention_logit"] > 2 * high["largest_attention_logit"],
          "without QK-norm the attention logits grow larger")
    claim(gap("post_norm") < -2 * noise, "post-norm trains better than pre-norm at 2 layers")
    claim(gap("deep_post_norm") > 0.5 and abs(runs["deep_post_norm"]["final_loss"] - unigram) < 0.1,
          "post-norm at 8 layers without warmup stalls near the unigram loss")
    claim(gap("gelu") < -2 * noise, "the GELU MLP ends ahead of SwiGLU by more than twice the seed noise")
    return f"""**What each piece is for, piece by piece.**

- **The residual connection** matters most. Without it the model ends at {two(runs['no_residual']['final_loss'])}
  ({gap('no_residual'):+.2f}), the context-free frequency model's loss ({two(unigram)}): it learned which tokens
  are common and nothing else. Each block's output *replaces* the stream, so a token's own identity has to
  survive two attention blocks that average it with other tokens, and the gradient reaches the embedding
  only through every block's Jacobian. With `x + f(x)` the identity is a path around every block, forwards
  and backwards (`residual_block_backward` passes `d_out` straight through): each block adds to what the
  stream holds instead of overwriting it.
- **RoPE**, taken away, moves the loss by {gap('no_rope'):+.2f}: about the seed noise. At this scale it hardly
  matters, and not because position does not: a causal model finds position without any position embedding.
  The mask lets a query at position p average over p + 1 keys, so how spread its attention is depends on p,
  and the next layer can read that (`tests/core/test_ablations.py` shows the other half: one layer without RoPE
  cannot tell the order of the tokens before the last). What RoPE adds is *relative* position inside every
  score, q·k depending on how far apart two tokens are; that matters more at Qwen3's 40,960-token context
  than at these {rec['run']['context']} tokens, where "a few tokens back" is most of what a 2-layer model uses.
- **QK-norm** makes no difference at chapter 11's rate ({gap('no_qk_norm'):+.2f}). It is there for stability: at
  lr {high['lr']:g} the run without it ends {gap('no_qk_norm_high_lr'):+.2f} behind, and its largest attention
  logit is {runs['no_qk_norm_high_lr']['largest_attention_logit']:.0f} against {high['largest_attention_logit']:.0f}
  with it. Without the norm, fast-moving q and k weights grow the scores q·k/√Dh without bound; softmax then
  puts all weight on one key, its gradient vanishes, and those heads stop learning. RMSNorm of each head
  (with its learned gain) bounds |q| and |k|, so the scores stay where softmax still learns: what lets a
  large model take a higher learning rate.
- **Pre-norm** is the surprise: at 2 layers post-norm *wins*, by {-gap('post_norm'):.2f}. With a norm after every
  block the stream stays at unit scale and every block's output counts fully; post-norm models that train
  are known to end a little better (Liu et al., 2020). What pre-norm buys is trainability in depth: at
  {deep['config']['num_hidden_layers']} layers and no warmup, post-norm ends at {two(runs['deep_post_norm']['final_loss'])}
  after {deep['steps']} steps, against pre-norm's {two(deep['final_loss'])}: stuck at the frequency model. Every
  post-norm sits on the residual path itself, so the gradient to the early layers passes through all of
  them, and at the start the updates near the output are large (Xiong et al., 2020): the 2017 Transformer
  needed its warmup for this. Pre-norm leaves the residual path a plain sum, which is why large models since
  GPT-2 use it.
- **SwiGLU**, against a plain GELU MLP with the same parameters, ends *behind* by {-gap('gelu'):.2f}: more than
  the seed spread, from one run each. A likely reason it starts slower: SwiGLU's output `silu(gate(x)) * up(x)`
  is a product of two projections, each starting at about 0.02·√D = {0.02 * CONFIG['hidden_size'] ** 0.5:.2f}
  per feature, so at initialisation it is roughly that factor times GELU's `gelu(up(x))` (about half of one
  such projection), and its gradient is second order in the weights: the gated MLP switches on late. Its
  published gain (Shazeer, 2020) is a few percent of perplexity after long training at scale; a
  {rec['run']['steps']}-step run of a 2-layer model measures the start, not that."""


def heads_part(rec: dict[str, Any]) -> str:
    runs = {r["key"]: r for r in rec["runs"]}
    mha, gqa, mqa = runs["mha"], runs["qwen3"], runs["mqa"]
    real = PRESETS["qwen3-8b"]
    kv_heads = {"MHA": real.num_attention_heads, "GQA": real.num_key_value_heads, "MQA": 1}
    per_token = {name: kv_cache_bytes_per_token(replace(real, num_key_value_heads=n), 2) for name, n in kv_heads.items()}
    context = real.max_position_embeddings
    noise = seed_noise(runs)
    claim(mqa["final_loss"] < min(gqa["final_loss"], mha["final_loss"]), "MQA ends lowest of the three")
    return f"""**MHA, GQA, MQA** trade the KV cache against quality. Here 4 query heads read 4, 2 (Qwen3's
grouping) or 1 KV head and end at {two(mha['final_loss'])}, {two(gqa['final_loss'])} and {two(mqa['final_loss'])},
while the cache per token halves each time ({mha['kv_bytes_per_token']:,}, {gqa['kv_bytes_per_token']:,} and
{mqa['kv_bytes_per_token']:,} bytes; k_proj and v_proj shrink with the KV heads, so the parameters fall too).
That is not the order found at scale (MHA a little better than GQA, GQA than MQA: Ainslie et al., 2023), and
should not be read as one: the spread between two seeds here is {two(noise)}, a change of shape draws other
random weights (each variant is also another start), and a 2-layer model with {CONFIG['head_dim']}-wide heads
trained {rec['run']['steps']} steps is nowhere near what one KV head can hold. What the KV heads decide for
certain is the cache. At Qwen3-8B's size, in BF16, the same choice is {per_token['MHA']:,} bytes per token (MHA,
{kv_heads['MHA']} KV heads), {per_token['GQA']:,} (GQA, its {kv_heads['GQA']}) or {per_token['MQA']:,} (MQA): at its
{context:,}-token context, {per_token['MHA'] * context / 2 ** 30:.1f}, {per_token['GQA'] * context / 2 ** 30:.1f} or
{per_token['MQA'] * context / 2 ** 30:.2f} GiB for one sequence (section 6). GQA keeps nearly all of MHA's
quality for a quarter of its cache, which is why Qwen3 uses it."""


def run_it_part(rec: dict[str, Any]) -> str:
    example = next(r for r in rec["runs"] if r["key"] == "no_rope")
    run = rec["run"]
    flags = (f"--steps {run['steps']} --batch-size {run['batch_size']} --context {run['context']} --lr {run['lr']:g} "
             f"--warmup {run['warmup']} --eval-every {run['eval_every']} --shards {run['shards']}")
    commands = "\n".join([f"echo '{json.dumps(example['config'])}' > no_rope.json",
                          f"python -m qwen_np train --config no_rope.json {flags} --out /tmp/no_rope",
                          "python -m qwen_np generate --model /tmp/no_rope/model --no-chat --temperature 0 -n 30 'ROMEO:'"])
    return f"""**Run any of them yourself.** Write chapter 11's `config.json` with the fields of the table's "changed"
column, and train it with the `train` command (the same model, steps and settings; `train` scores all of
the validation plays, not the first tokens of each, so its numbers differ a little from these):

{code_block(commands, "bash")}

The exported `config.json` keeps the fields, and qwen_np loads and runs the checkpoint (on the readable
path). transformers knows none of them: it would ignore `use_rope: false` and fill in missing weights at
random, so an ablated checkpoint is for qwen_np only. To repeat this chapter's runs, all of them:
`python tools/walkthrough/walkthrough_chapter_ablations.py --out my_ablations.json` (`--out` keeps the committed record)."""
