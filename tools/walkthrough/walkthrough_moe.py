"""The walkthrough's mixture-of-experts part (in chapter 12): Qwen3-MoE's sparse block, its router drawn from a real
forward, and chapter 11's model trained as a MoE at equal active parameters beside the dense one, measured.

RECORDED like chapter 12's ablations: `python tools/walkthrough/walkthrough_moe.py` trains the runs and writes
docs/figures/moe.json (with the routing of the trained MoE on a validation line and each expert's load before and
after training); the page is rendered from that record. tests/training/test_moe_gradients.py repeats the MoE's
first steps and fails when they no longer match the record.
"""

from __future__ import annotations

import json
import os
import resource
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

from qwen_np.core import layers  # noqa: E402
from qwen_np.core.config import PRESETS, active_parameter_count, parameter_count  # noqa: E402
from qwen_np.core.model import Qwen3Model  # noqa: E402
from qwen_np.files.tokenizer import Tokenizer  # noqa: E402
from walkthrough_chapter_ablations import CHECKED_STEPS, RUN, SEEDS, Trial, by_key, finals, variant_config  # noqa: E402
from walkthrough_chapter_ablations import load_record as ablation_record  # noqa: E402
from walkthrough_chapter_train import CONFIG, load_data, validation_loss  # noqa: E402
from walkthrough_common import code_block, two  # noqa: E402
import walkthrough_common  # noqa: E402

RECORD = REPO_ROOT / "docs" / "figures" / "moe.json"
# Chapter 11's MLP (F = 192) as E = 8 experts of Fe = F / K, K = 2 a token: each token computes with as many MLP
# weights as the dense layer's (K * 3 D Fe = 3 D F), plus the router's E x D, while the layer holds E / K = 4 times
# as many. norm_topk_prob and the load-balancing coefficient as Qwen3-30B-A3B's config.json.
EXPERTS, CHOSEN = 8, 2
MOE = {"model_type": "qwen3_moe", "num_experts": EXPERTS, "num_experts_per_tok": CHOSEN,
       "moe_intermediate_size": CONFIG["intermediate_size"] // CHOSEN, "norm_topk_prob": True,
       "router_aux_loss_coef": 0.001}
VARIANTS: list[dict[str, Any]] = [
    {"key": "qwen3", "name": "Qwen3, dense MLP (F = 192)", "config": {}},
    {"key": "moe", "name": f"Qwen3-MoE: {EXPERTS} experts of Fe = 96, {CHOSEN} a token", "config": MOE},
    # The load-balancing loss ten times heavier: the Switch Transformer's coefficient (Fedus et al., 2021).
    {"key": "moe_balanced", "name": "the same MoE, router_aux_loss_coef 0.01",
     "config": {**MOE, "router_aux_loss_coef": 0.01}},
]
ROUTED_TOKENS = 24                 # the validation line whose routing the figure draws


def router_logits(model: Qwen3Model, ids: np.ndarray) -> dict[int, np.ndarray]:
    """Each sparse layer's router logits [T, E] for one sequence, read from a forward's trace."""
    seen: dict[int, np.ndarray] = {}

    def note(name: str, value: np.ndarray) -> None:
        if name.endswith(".mlp.gate"):
            seen[int(name.split(".")[2])] = value
    model.forward(ids, trace=note)
    return seen


def expert_load(model: Qwen3Model, docs: list[np.ndarray]) -> dict[int, list[float]]:
    """Per sparse layer, the share of the validation sample's token choices each expert gets (K per token; sums to 1),
    read in windows of the run's context."""
    counts: dict[int, np.ndarray] = {}
    for doc in docs:
        for start in range(0, len(doc), RUN["context"]):
            for i, logits in router_logits(model, doc[start:start + RUN["context"]]).items():
                chosen = layers.route(logits, model.config.num_experts_per_tok, model.config.norm_topk_prob)[0]
                counts[i] = counts.get(i, 0) + np.bincount(chosen.reshape(-1), minlength=model.config.num_experts)
    return {i: (c / c.sum()).tolist() for i, c in counts.items()}


def routing(model: Qwen3Model, ids: np.ndarray, tokenizer: Tokenizer) -> dict[str, Any]:
    """What the figure draws of one line: each token's K experts and their weights, per sparse layer."""
    per_layer = {}
    for i, logits in router_logits(model, ids).items():
        chosen, weights = layers.route(logits, model.config.num_experts_per_tok, model.config.norm_topk_prob)
        per_layer[str(i)] = {"experts": chosen.tolist(), "weights": weights.tolist()}
    return {"tokens": [tokenizer.decode([int(t)]) for t in ids], "layers": per_layer}


def train(variant: dict[str, Any], tokens: np.ndarray, validation: list[np.ndarray], tokenizer: Tokenizer,
          progress: Callable[[str], None]) -> dict[str, Any]:
    """One run of chapter 12's settings, its validation loss every eval_every steps; a MoE's routing too."""
    wall, cpu = time.perf_counter(), time.process_time()
    trial = Trial(variant, SEEDS[0])
    run = trial.run
    config, moe = trial.model.config, trial.model.config.is_moe
    load_before = expert_load(trial.model, validation) if moe else None
    losses, evals = [], []
    for i in range(run["steps"] + 1):
        if i % run["eval_every"] == 0:
            evals.append({"step": i, "loss": validation_loss(trial.model, validation)})
        if i < run["steps"]:
            losses.append(trial.step(tokens, i))
    progress(f"{variant['key']}: validation {evals[-1]['loss']:.3f} ({time.perf_counter() - wall:.0f} s)")
    result = {"key": variant["key"], "name": variant["name"], "config": variant_config(variant),
              "parameters": parameter_count(config), "active_parameters": active_parameter_count(config),
              "first_losses": losses[:CHECKED_STEPS], "evals": evals, "final_loss": evals[-1]["loss"],
              "seconds": round(time.perf_counter() - wall), "cpu_seconds": round(time.process_time() - cpu)}
    if moe:
        result["load"] = {"start": load_before, "end": expert_load(trial.model, validation)}
        result["routing"] = routing(trial.model, validation[0][:ROUTED_TOKENS], tokenizer)
    return result


def record(progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Every run, one after another, each step's shards on one BLAS thread each (the ablations' way)."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as name, threadpool_limits(limits=1):
        corpus, validation, tokenizer = load_data(Path(name))
        runs = [train(variant, corpus.train, validation, tokenizer, progress) for variant in VARIANTS]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"run": RUN, "runs": runs, "cores": os.cpu_count(), "seconds": round(time.perf_counter() - started),
            "cpu_seconds": round(usage.ru_utime + usage.ru_stime), "load_average": os.getloadavg()[0]}


def check_first_steps(recorded: dict[str, Any]) -> None:
    """Repeat the MoE's first CHECKED_STEPS steps; raise naming the first loss that differs beyond rounding."""
    run = next(r for r in recorded["runs"] if r["key"] == "moe")
    with tempfile.TemporaryDirectory() as name, threadpool_limits(limits=1):
        corpus, _, _ = load_data(Path(name))
        trial = Trial(VARIANTS[1], SEEDS[0])
        for i, want in enumerate(run["first_losses"]):
            got = trial.step(corpus.train, i)
            if not np.isclose(got, want, rtol=1e-3):
                raise AssertionError(f"moe: the loss of step {i + 1} is {got:.6g} now, {want:.6g} in {RECORD.name}: "
                                     "re-record with `python tools/walkthrough/walkthrough_moe.py`")


def main(argv: list[str] | None = None) -> None:
    walkthrough_common.record_main("Train chapter 11's model as the dense one and as two MoEs (about ten minutes on 2 "
                                   "cores) and record what the MoE part of chapter 12 shows.", RECORD, record, argv)


if __name__ == "__main__":
    main()


# --- The page ---------------------------------------------------------------------------------------

def load_record() -> dict[str, Any]:
    return walkthrough_common.read_record(RECORD, "python tools/walkthrough/walkthrough_moe.py", "about ten minutes")


def claim(holds: bool, what: str) -> None:
    walkthrough_common.claim(holds, what, "MoE part of chapter 12")


def figure(data_: dict[str, Any]) -> Any:
    """Left: which experts each token of a validation line chose in each sparse layer, shaded by its weight.
    Right: each expert's share of the token choices over the validation sample, at initialisation and trained."""
    import matplotlib.pyplot as plt

    moe = next(run for run in data_["runs"] if run["key"] == "moe")
    routed, load = moe["routing"], moe["load"]
    sparse = sorted(routed["layers"], key=int)
    E = moe["config"]["num_experts"]
    fig = plt.figure(figsize=(14, 2.1 + 1.9 * len(sparse)), dpi=100)
    grid = fig.add_gridspec(len(sparse), 2, width_ratios=[2.4, 1])
    for row, layer in enumerate(sparse):
        axis = fig.add_subplot(grid[row, 0])
        chosen, weights = np.array(routed["layers"][layer]["experts"]), np.array(routed["layers"][layer]["weights"])
        picture = np.full((E, len(chosen)), np.nan)                              # [E, T]: unchosen left blank
        np.put_along_axis(picture.T, chosen, weights, axis=-1)                    # a chosen expert's weight
        shades = plt.get_cmap("Blues").copy()
        shades.set_bad("#e8e8e8")                                                 # grey: not chosen
        axis.imshow(np.ma.masked_invalid(picture), cmap=shades, vmin=0, vmax=1, aspect="auto")
        axis.set(yticks=range(E), ylabel=f"layer {layer}\nexpert")
        axis.set_xticks(range(len(routed["tokens"])),
                        [repr(t)[1:-1].replace(" ", "␣") for t in routed["tokens"]] if row == len(sparse) - 1 else [],
                        rotation=90, fontsize=8)
        if row == 0:
            axis.set_title(f"the {moe['config']['num_experts_per_tok']} experts each token chose (shade: its weight; "
                           "grey: not chosen)")
    bars = fig.add_subplot(grid[:, 1])
    width = 0.8 / (2 * len(sparse))
    for index, (when, layer) in enumerate((when, layer) for layer in sparse for when in ("start", "end")):
        bars.bar(np.arange(E) + (index - len(sparse) + 0.5) * width, load[when][layer], width,
                 label=f"layer {layer}, {'at initialisation' if when == 'start' else 'trained'}",
                 alpha=0.45 if when == "start" else 1.0, color=f"C{sparse.index(layer)}")
    bars.axhline(1 / E, color="#999999", lw=0.8, ls=":")
    bars.set(title="each expert's share of the choices (validation)", xlabel="expert", xticks=range(E))
    bars.legend(fontsize=7.5)
    fig.tight_layout()
    return fig


def spread(load: dict[str, list[float]]) -> dict[str, tuple[float, float]]:
    """Per sparse layer, the smallest and the largest expert's share of the choices."""
    return {layer: (min(shares), max(shares)) for layer, shares in load.items()}


def moe_section() -> str:
    """The MoE part of chapter 12 (after the ablations, before the chapter's exercise), from the record."""
    import inspect

    from qwen_np.training import gradients

    rec = load_record()
    runs = {r["key"]: r for r in rec["runs"]}
    dense, moe, balanced = runs["qwen3"], runs["moe"], runs["moe_balanced"]
    big = PRESETS["qwen3-30b-a3b"]
    E, K, Fe = (moe["config"][key] for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"))
    D, F = CONFIG["hidden_size"], CONFIG["intermediate_size"]
    claim(K * 3 * D * Fe == 3 * D * F, "the MoE's experts a token computes with hold the dense MLP's parameters")
    start, end, even = (spread(r["load"][when]) for r, when in ((moe, "start"), (moe, "end"), (balanced, "end")))
    claim(all(low < 0.25 / E for low, _ in end.values()), "each layer of the MoE at Qwen3's coefficient has a nearly idle expert")
    claim(even["0"][0] > 4 * end["0"][0] and even["1"][0] < 0.25 / E,
          "the heavier load-balancing loss lifts layer 0's least-loaded expert but leaves one of layer 1 nearly idle")
    seeds = finals(by_key(ablation_record()["runs"])["qwen3"])               # the dense run at each of SEEDS
    verdict = ("lower than every seed of the dense run" if moe["final_loss"] < min(seeds) else
               "higher than every seed of the dense run" if moe["final_loss"] > max(seeds) else
               "within the dense run's seeds")

    def shares(loads: dict[str, tuple[float, float]]) -> str:
        return ", ".join(f"{100 * low:.1f}% to {100 * high:.0f}% (layer {layer})" for layer, (low, high) in sorted(loads.items()))

    def row(r: dict[str, Any]) -> str:
        return (f"| {r['name']} | {r['parameters']:,} | {r['active_parameters']:,} | {two(r['final_loss'])} | "
                f"{r['seconds']} s ({r['cpu_seconds']} s CPU) |")

    run = rec["run"]
    flags = (f"--steps {run['steps']} --batch-size {run['batch_size']} --context {run['context']} --lr {run['lr']:g} "
             f"--warmup {run['warmup']} --eval-every {run['eval_every']} --shards {run['shards']}")
    commands = "\n".join([f"echo '{json.dumps(moe['config'])}' > moe.json",
                          f"python -m qwen_np train --config moe.json {flags} --out /tmp/moe"])

    return f"""### A mixture of experts in the MLP's place (Qwen3-MoE)

Qwen3-30B-A3B and Qwen3-235B-A22B (`model_type: qwen3_moe`) keep everything of sections 3 and 4's layer but its
MLP: in a **sparse** layer the MLP is E small SwiGLUs (experts) of width Fe and a router, a [E, D] matrix
(`mlp.gate`) whose softmax picks K of them for each token. Qwen3-30B-A3B has E = {big.num_experts}, K =
{big.num_experts_per_tok} and Fe = {big.moe_intermediate_size} at D = {big.hidden_size}, in all {big.num_hidden_layers}
layers: {parameter_count(big) / 1e9:.2f} B parameters, of which a token computes with {active_parameter_count(big) / 1e9:.2f} B.
A layer is sparse unless `mlp_only_layers` lists it or `(i + 1) % decoder_sparse_step` is not 0 (then it has the dense
MLP of `intermediate_size`). The router, as `layers.route` and `layers.moe` compute it (the fast path,
`engine/moe.py`, groups the rows the same way and multiplies each expert's once):

{code_block(inspect.getsource(layers.route))}

{code_block(inspect.getsource(layers.moe))}

| what | shape | |
|---|---|---|
| `router` (`mlp.gate.weight`) | [E, D] | one row per expert |
| `logits`, their softmax | [T, E] | FP32 whatever the activations, as transformers |
| `chosen`, `weights` | [T, K] | the K likeliest experts, their probabilities (divided by their sum when `norm_topk_prob`) |
| an expert's `gate_proj`, `up_proj` / `down_proj` | [Fe, D] / [D, Fe] | a SwiGLU of width Fe |
| the rows routed to expert e | [n_e, D] -> [n_e, Fe] -> [n_e, D] | n_e tokens of T; the n_e sum to T K |

**Its backward** (`gradients.moe_backward`, beside the dense MLP's in `training/gradients.py`) runs each chosen
expert's SwiGLU backward on its rows, scaled by their weights; each weight's own gradient is the dot of the
output's gradient with that expert's output. The choice itself is piecewise constant (a small change of the
logits moves no token to another expert) and passes nothing; the weights pass theirs through the renormalisation
and the softmax to the logits, and from there to the router and to x:

{code_block(inspect.getsource(gradients.route_backward))}

Training adds transformers' load-balancing loss (`load_balancing_loss_func`, the Switch Transformer's), times
`router_aux_loss_coef` ({moe['config']['router_aux_loss_coef']:g} in Qwen3-MoE's configs): over the rows of every sparse
layer together, E Σ_e f_e P_e, with f_e the share of top-K choices that went to expert e and P_e its mean router
probability. It is K when both are uniform and E when the router always picks the same K experts, sure of them;
only P carries a gradient (`gradients.load_balancing_loss`). transformers adds it when `output_router_logits` is
set; `train` always does, with the config's coefficient (0 leaves it out). `tests/training/test_moe_gradients.py`
checks every weight's gradient of two small MoEs (each `norm_topk_prob`, a dense layer among the sparse ones)
against central differences in float64, and the loss and every gradient against torch autograd of transformers'
`Qwen3MoeForCausalLM`.

**Measured: the MoE against the dense model at equal active parameters.** Chapter 11's model with each MLP as
E = {E} experts of Fe = F / K = {Fe}, K = {K} a token (`norm_topk_prob` true), trained as the ablations above
({rec['run']['steps']} steps, the same seed and batches): a token computes with K × 3 D Fe = 3 D F = {3 * D * F:,} MLP
weights a layer, as the dense one, plus the router's {E * D}; the layer holds {E // K} times as many.

| run | parameters | active a token | validation loss | time ({rec['cores']} cores, shared machine) |
|---|---|---|---|---|
{row(dense)}
{row(moe)}
{row(balanced)}

The MoE ends {verdict} ({two(moe['final_loss'])} against {two(dense['final_loss'])} at the same seed {SEEDS[0]}; the
ablations above trained the dense run at seeds {', '.join(map(str, SEEDS))}, ending from {two(min(seeds))} to
{two(max(seeds))} in their own recording; the MoE's one seed is one draw). Its extra
{moe['parameters'] - dense['parameters']:,} weights cost memory, not arithmetic a token; on this machine they cost
time all the same, as the experts' small gathered products and the router's bookkeeping run in NumPy, one expert
after another. The router, drawn from a forward of the trained MoE on
the start of a validation play, and each expert's load over the validation sample:

![the experts each token chose, and each expert's load](figures/moe.png)

At initialisation the experts' shares of the choices run from {shares(start)}; trained, from {shares(end)} (an
even load is {100 / E:.1f}% each): at Qwen3's coefficient the balancing term is a small pull beside the
cross-entropy, and each layer's router ends with favourites and an expert it almost never picks. Ten times heavier
(the Switch Transformer's 0.01), {shares(even)}: layer 0's least-loaded expert is lifted, but layer 1 still leaves
one nearly idle, so over {rec['run']['steps']} steps the term does not undo every early preference. Both MoEs end
at about the same validation loss ({two(moe['final_loss'])} and {two(balanced['final_loss'])}); at scale a starved
expert is capacity paid for and unused, and across devices an overloaded one is every step's straggler: what the
term is there for. The record is `docs/figures/moe.json`, one run of
`python tools/walkthrough/walkthrough_moe.py` ({rec['seconds']:,} s, {rec['cpu_seconds']:,} s of CPU, load average
{rec['load_average']:.0f} on a shared machine);
`tests/training/test_moe_gradients.py` repeats the MoE's first {CHECKED_STEPS} steps. To train it yourself,
chapter 11's `config.json` with the MoE's fields (`train` scores all of the validation plays, so its
numbers differ a little from these):

{code_block(commands, "bash")}"""
