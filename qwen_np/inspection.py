"""See inside the model: every step's shapes, live traces, the logit lens, and attention heatmaps.

Everything here is built on one table, STEPS: the steps of a forward pass in the order
`Qwen3Model.forward` runs them, each with its trace name, the qwen_np function that does the math,
and its input/output/weight shapes written in the dimension vocabulary of config.py (T, S, D, H,
KVH, Dh, F, V, L). `inspect` resolves those symbols against a config (no weights needed), the
Tracer prints them next to the live arrays of a real forward pass, and docs/walkthrough.md is
generated from them, so the three can never disagree about what the model does.
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys
import time
import unicodedata
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TextIO

import numpy as np

from . import layers
from .config import Qwen3Config, parameter_count
from .errors import QwenNPError
from .memory import GiB, SAFETY_FRACTION, available_memory, candidate_plans, kv_cache_bytes_per_token
from .model import DEFAULT_CONTEXT, Qwen3Model
from .numerics import BYTES_PER_VALUE

Shape = tuple[str, ...]   # dimension expressions, e.g. ("T", "H*Dh"); a bare integer string is a constant

SYMBOL_MEANINGS = {
    "T": "tokens in this forward call",
    "S": "positions attended to (cached + new; = T without a cache)",
    "D": "hidden_size: the width of the residual stream",
    "H": "num_attention_heads: query heads",
    "KVH": "num_key_value_heads: key/value heads",
    "Dh": "head_dim: the width of one head (read from config, not D/H)",
    "F": "intermediate_size: the MLP width",
    "V": "vocab_size: one logit per token id",
    "L": "num_hidden_layers: decoder layers",
}


@dataclass(frozen=True)
class Step:
    """One step of the forward pass, as `Qwen3Model.forward` reports it to a trace."""

    name: str                                  # trace name; "{i}" stands for the layer index
    what: str                                  # what the step computes, in one line
    code: Callable[..., Any]                   # the qwen_np function that does the math
    inputs: tuple[tuple[str, Shape], ...]      # (what, shape) of each input
    output: Shape
    weight: Shape | None = None                # shape of the checkpoint tensor `name + ".weight"`
    flops: str = ""                            # matmul FLOPs as a product of symbols; "" if elementwise

    @property
    def in_layer(self) -> bool:
        return "{i}" in self.name

    @property
    def short_name(self) -> str:
        """The name inside a decoder layer ("self_attn.q_proj"), or the full name outside one."""
        return self.name.replace("model.layers.{i}.", "")


def _linear(name: str, what: str, x: tuple[str, Shape], out: Shape, weight: Shape) -> Step:
    """A projection y = x W^T: W is [out, in] as stored, and it costs 2 FLOPs per weight per token."""
    return Step(name, what, layers.linear, (x,), out, weight, "*".join(("2", "T", *weight)))


def _norm(name: str, what: str, x: tuple[str, Shape], weight: Shape) -> Step:
    return Step(name, what, layers.rms_norm, (x,), x[1], weight)


_LAYER = "model.layers.{i}"
_X, _H = ("x", ("T", "D")), ("h", ("T", "D"))
STEPS: tuple[Step, ...] = (
    Step("model.embed_tokens", "one row of the embedding table per token id (no scaling)",
         layers.embed, (("token ids", ("T",)),), ("T", "D"), ("V", "D")),
    _norm(f"{_LAYER}.input_layernorm", "RMSNorm over D, before attention", _X, ("D",)),
    _linear(f"{_LAYER}.self_attn.q_proj", "queries, split into H heads of Dh", _H, ("T", "H", "Dh"), ("H*Dh", "D")),
    _linear(f"{_LAYER}.self_attn.k_proj", "keys: only KVH heads (grouped-query attention)", _H,
            ("T", "KVH", "Dh"), ("KVH*Dh", "D")),
    _linear(f"{_LAYER}.self_attn.v_proj", "values: KVH heads, never normed", _H, ("T", "KVH", "Dh"), ("KVH*Dh", "D")),
    _norm(f"{_LAYER}.self_attn.q_norm", "RMSNorm of each query head over Dh (one weight shared by all heads)",
          ("q", ("T", "H", "Dh")), ("Dh",)),
    _norm(f"{_LAYER}.self_attn.k_norm", "RMSNorm of each key head over Dh", ("k", ("T", "KVH", "Dh")), ("Dh",)),
    Step(f"{_LAYER}.self_attn.rope_q", "rotate query pairs (i, i+Dh/2) by position-dependent angles",
         layers.rope, (("q", ("T", "H", "Dh")),), ("T", "H", "Dh")),
    Step(f"{_LAYER}.self_attn.rope_k", "rotate keys the same way; these go into the KV cache",
         layers.rope, (("k", ("T", "KVH", "Dh")),), ("T", "KVH", "Dh")),
    Step(f"{_LAYER}.self_attn.scores", "q . k / sqrt(Dh) for every query/key pair, future masked to -inf",
         layers.attention_scores, (("q", ("T", "H", "Dh")), ("k cached + new", ("S", "KVH", "Dh"))),
         ("H", "T", "S"), flops="2*H*T*S*Dh"),
    Step(f"{_LAYER}.self_attn.softmax", "each query's scores -> weights that sum to 1",
         layers.softmax, (("scores", ("H", "T", "S")),), ("H", "T", "S")),
    Step(f"{_LAYER}.self_attn.weighted_sum", "mix the values by the weights, heads concatenated",
         layers.weighted_sum, (("weights", ("H", "T", "S")), ("v cached + new", ("S", "KVH", "Dh"))),
         ("T", "H*Dh"), flops="2*H*T*S*Dh"),
    _linear(f"{_LAYER}.self_attn.o_proj", "project the heads back to the model width",
            ("heads", ("T", "H*Dh")), ("T", "D"), ("D", "H*Dh")),
    Step(f"{_LAYER}.residual_attn", "x + attention output: the residual stream",
         Qwen3Model._decoder_layer, (_X, ("attention", ("T", "D"))), ("T", "D")),
    _norm(f"{_LAYER}.post_attention_layernorm", "RMSNorm over D, before the MLP", _X, ("D",)),
    _linear(f"{_LAYER}.mlp.gate_proj", "gate: how much of each MLP feature to let through", _H, ("T", "F"), ("F", "D")),
    _linear(f"{_LAYER}.mlp.up_proj", "up: the MLP features themselves", _H, ("T", "F"), ("F", "D")),
    Step(f"{_LAYER}.mlp.act_fn", "SiLU(gate) x up (SwiGLU)", layers.silu,
         (("gate", ("T", "F")), ("up", ("T", "F"))), ("T", "F")),
    _linear(f"{_LAYER}.mlp.down_proj", "back down to the model width", ("act", ("T", "F")), ("T", "D"), ("D", "F")),
    Step(f"{_LAYER}.residual_mlp", "x + MLP output: this layer's result", Qwen3Model._decoder_layer,
         (_X, ("mlp", ("T", "D"))), ("T", "D")),
    _norm("model.norm", "final RMSNorm over D", _X, ("D",)),
    _linear("lm_head", "one score (logit) per vocabulary entry, at every position", _H, ("T", "V"), ("V", "D")),
)
STEPS_BY_NAME = {step.name: step for step in STEPS}


# --- Shapes and counts from the symbols ----------------------------------------------------------

def dimensions(config: Qwen3Config, tokens: int, positions: int | None = None) -> dict[str, int]:
    """The value of every symbol for `tokens` new tokens attending to `positions` (default: tokens)."""
    return {"T": tokens, "S": tokens if positions is None else positions, "D": config.hidden_size,
            "H": config.num_attention_heads, "KVH": config.num_key_value_heads, "Dh": config.head_dim,
            "F": config.intermediate_size, "V": config.vocab_size, "L": config.num_hidden_layers}


def evaluate(expression: str, dims: dict[str, int]) -> int:
    """The value of a product of symbols and integers, e.g. "2*T*H*Dh" -> 2 * T * H * Dh."""
    return math.prod(int(f) if f.isdigit() else dims[f] for f in expression.split("*"))


def resolve(shape: Shape, dims: dict[str, int]) -> list[int]:
    return [evaluate(axis, dims) for axis in shape]


def format_shape(shape: Shape, numbers: Sequence[int] | None = None) -> str:
    """'[T, H, Dh] = [7, 32, 128]', or the symbols alone when no numbers are given."""
    symbols = f"[{', '.join(shape)}]"
    return symbols if numbers is None else f"{symbols} = [{', '.join(str(n) for n in numbers)}]"


def weight_tensors(config: Qwen3Config) -> list[tuple[Step, int]]:
    """(step, parameters per instance) for every step that reads a tensor of its own.

    A tied lm_head reads the embedding table and so owns no parameters: it is left out.
    """
    dims = dimensions(config, 1)
    return [(step, math.prod(resolve(step.weight, dims))) for step in STEPS
            if step.weight is not None and not (step.name == "lm_head" and config.tie_word_embeddings)]


def parameter_summary(config: Qwen3Config) -> dict[str, int]:
    """Parameters in total, per decoder layer, and without the embedding table and lm_head."""
    owned = weight_tensors(config)
    total = sum(n * (config.num_hidden_layers if step.in_layer else 1) for step, n in owned)
    embedding_like = sum(n for step, n in owned if step.name in ("model.embed_tokens", "lm_head"))
    return {"total": total, "per_layer": sum(n for step, n in owned if step.in_layer),
            "without_embeddings": total - embedding_like}


def forward_flops(config: Qwen3Config, tokens: int, positions: int) -> int:
    """Matmul FLOPs (2 per multiply-add) of one forward call: `tokens` new tokens over `positions`."""
    dims = dimensions(config, tokens, positions)
    return sum(evaluate(step.flops, dims) * (config.num_hidden_layers if step.in_layer else 1)
               for step in STEPS if step.flops)


def weight_bytes_read_per_token(config: Qwen3Config, bytes_per_value: float) -> int:
    """Bytes of weights one decode step streams from memory: all of them, except the embedding table,
    of which only the token's own row is read (unless it doubles as the lm_head)."""
    unread = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    return int((parameter_count(config) - unread) * bytes_per_value)


def measure_bandwidth(seconds: float = 0.5, nbytes: int = 256 * 1024 ** 2) -> float:
    """Memory bandwidth in bytes/s, measured here: repeated NumPy copies of a 256 MiB array.

    Each copy reads and writes every byte, so it moves 2 x nbytes. One thread, far bigger than any
    CPU cache: a rough stand-in for how fast decode can stream weights, not a benchmark.
    """
    source = np.ones(nbytes // 8)
    target = np.empty_like(source)
    np.copyto(target, source)          # first touch: make the OS actually allocate the pages
    copies, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or copies == 0:
        np.copyto(target, source)
        copies += 1
    return 2 * nbytes * copies / elapsed


# --- inspect -------------------------------------------------------------------------------------

KV_FORMATS = (("BF16", 2), ("FP32", 4))   # how real runtimes store the KV cache, and how qwen_np does
# config.json's torch_dtype -> the format name of numerics.BYTES_PER_VALUE
STORED_FORMATS = {"float32": "FP32", "bfloat16": "BF16", "float16": "FP16"}


def inspect_report(config: Qwen3Config, tokens: int, model_name: str, bandwidth: float) -> dict[str, Any]:
    """Everything `inspect` shows, as plain data (the JSON output, and what the text is rendered from)."""
    if tokens <= 0:
        raise QwenNPError(f"--tokens: must be at least 1, got {tokens}")
    dims = dimensions(config, tokens)
    params = parameter_summary(config)
    kv_values = kv_cache_bytes_per_token(config, bytes_per_value=1)
    context = config.max_position_embeddings
    return {
        "model": model_name,
        "dimensions": dims,
        "steps": [_step_record(step, dims) for step in STEPS],
        "parameters": {
            **params,
            "per_module": [{"name": step.name, "weight": _shape_record(step.weight, dims), "parameters": n,
                            "instances": config.num_hidden_layers if step.in_layer else 1}
                           for step, n in weight_tensors(config)],
            "lm_head_tied_to_embeddings": config.tie_word_embeddings,
        },
        "weight_bytes": {fmt: int(params["total"] * width) for fmt, width in BYTES_PER_VALUE.items()},
        "kv_cache": {"values_per_token": kv_values, "context_limit": context,
                     "bytes_per_token": {fmt: width * kv_values for fmt, width in KV_FORMATS},
                     "bytes_at_context_limit": {fmt: width * kv_values * context for fmt, width in KV_FORMATS}},
        "flops_per_token": {
            "prefill": {"tokens": tokens, "positions": tokens,
                        "flops": forward_flops(config, tokens, tokens) // tokens},
            "decode": {"tokens": 1, "positions": tokens + 1, "flops": forward_flops(config, 1, tokens + 1)},
            "decode_at_context_limit": {"tokens": 1, "positions": context,
                                        "flops": forward_flops(config, 1, context)},
        },
        "this_machine": _machine_report(config, bandwidth),
    }


def _shape_record(shape: Shape, dims: dict[str, int]) -> dict[str, Any]:
    return {"symbols": list(shape), "numbers": resolve(shape, dims)}


def _step_record(step: Step, dims: dict[str, int]) -> dict[str, Any]:
    return {
        "name": step.name, "what": step.what, "code": f"{step.code.__module__}.{step.code.__qualname__}",
        "per_layer": step.in_layer,
        "inputs": [{"what": what, **_shape_record(s, dims)} for what, s in step.inputs],
        "output": _shape_record(step.output, dims),
        "weight": _shape_record(step.weight, dims) if step.weight else None,
        "flops": {"formula": step.flops, "value": evaluate(step.flops, dims)} if step.flops else None,
    }


def _machine_report(config: Qwen3Config, bandwidth: float) -> dict[str, Any]:
    """Would the weights fit here in FP32, or kept as stored, and how fast could decode then go."""
    available = available_memory()
    context = min(config.max_position_embeddings, DEFAULT_CONTEXT)
    stored_format = STORED_FORMATS.get(config.torch_dtype, "BF16")
    stored_width = int(BYTES_PER_VALUE[stored_format])
    candidates = candidate_plans(config, context, stored_width, available)
    plans = {}
    for mode, width in (("fp32", 4), ("bf16", stored_width)):
        read = weight_bytes_read_per_token(config, width)
        plans[mode] = {"needs_bytes": candidates[mode].total_bytes, "fits": candidates[mode].fits,
                       "weight_bytes_read_per_token": read, "max_decode_tokens_per_s": bandwidth / read}
    return {"available_bytes": available, "usable_fraction": SAFETY_FRACTION, "context_tokens": context,
            "stored_format": stored_format,
            "bandwidth_bytes_per_s": bandwidth, "bandwidth_note": "measured here: NumPy copy of a 256 MiB "
            "array, read + write, one thread; approximate", "plans": plans}


def inspect_command(config: Qwen3Config, tokens: int, as_json: bool, model_name: str) -> str:
    """The output of `python -m qwen_np inspect`: text for people, or JSON when as_json."""
    report = inspect_report(config, tokens, model_name, measure_bandwidth())
    return json.dumps(report, indent=2) if as_json else render_report(report)


def render_report(report: dict[str, Any]) -> str:
    return "\n\n".join([_render_dimensions(report), _render_steps(report), _render_parameters(report),
                        _render_bytes(report), _render_flops(report), _render_machine(report)]) + "\n"


def _render_dimensions(report: dict[str, Any]) -> str:
    dims = report["dimensions"]
    group = dims["H"] // dims["KVH"]
    notes = {"KVH": f" (each serves H/KVH = {group} query heads)",
             "Dh": f" (D/H = {dims['D'] / dims['H']:g})" if dims["D"] != dims["H"] * dims["Dh"] else ""}
    lines = [f"{report['model']}: one forward pass over T = {dims['T']} tokens, step by step",
             "(no weights needed: every shape and count follows from config.json)", "", "Dimensions"]
    lines += [f"  {sym:<4}{value:>8}  {SYMBOL_MEANINGS[sym]}{notes.get(sym, '')}" for sym, value in dims.items()]
    return "\n".join(lines)


def _render_steps(report: dict[str, Any]) -> str:
    def shape(record: dict[str, Any]) -> str:
        return format_shape(record["symbols"], record["numbers"])

    steps, L = report["steps"], report["dimensions"]["L"]
    inputs = [[f"{x['what']} {shape(x)}" for x in step["inputs"]] for step in steps]
    in_width = max(len(text) for texts in inputs for text in texts) + 2
    name_width = max(len(STEPS_BY_NAME[step["name"]].short_name) for step in steps) + 2
    lines = ["Forward pass (names as `generate --trace` prints them; S = T here: no KV cache yet)",
             f"   #  {'step':<{name_width}}{'input':<{in_width}}output"]
    for number, (step, texts) in enumerate(zip(steps, inputs), start=1):
        previous = steps[number - 2]["per_layer"] if number > 1 else False
        if step["per_layer"] and not previous:
            lines.append(f"      model.layers.{{i}} for i = 0 .. {L - 1}: the same "
                         f"{sum(s['per_layer'] for s in steps)} steps in each of the L = {L} layers")
        elif previous and not step["per_layer"]:
            lines.append("      after the last layer:")
        indent = " " * (6 + name_width)
        lines.append(f"{number:>4}  {STEPS_BY_NAME[step['name']].short_name:<{name_width}}"
                     f"{texts[0]:<{in_width}}{shape(step['output'])}")
        lines += [indent + text for text in texts[1:]]
        lines.append(f"{indent}{step['what']}  [{step['code'].removeprefix('qwen_np.')}]")
    return "\n".join(lines)


def _render_parameters(report: dict[str, Any]) -> str:
    params = report["parameters"]
    lines = ["Parameters", f"  {'tensor (+ .weight)':<44}{'shape':<28}{'each':>14}{'x':>4}{'total':>16}"]
    for m in params["per_module"]:
        shape = format_shape(m["weight"]["symbols"], m["weight"]["numbers"])
        lines.append(f"  {m['name']:<44}{shape:<28}{m['parameters']:>14,}{m['instances']:>4}"
                     f"{m['parameters'] * m['instances']:>16,}")
    if params["lm_head_tied_to_embeddings"]:
        lines.append(f"  {'lm_head':<44}{'tied: reuses model.embed_tokens':<28}{0:>14,}{1:>4}{0:>16,}")
    lines.append(f"  {'one decoder layer':<90}{params['per_layer']:>16,}")
    lines.append(f"  {'total':<90}{params['total']:>16,}  ({_billions(params['total'])})")
    lines.append(f"  {'without embeddings (embed_tokens and lm_head)':<90}{params['without_embeddings']:>16,}  "
                 f"({_billions(params['without_embeddings'])})")
    return "\n".join(lines)


def _render_bytes(report: dict[str, Any]) -> str:
    kv, L = report["kv_cache"], report["dimensions"]["L"]
    dims = report["dimensions"]
    lines = ["Weight bytes by number format (parameters x bytes per value)"]
    for fmt, n in report["weight_bytes"].items():
        note = {"BF16": "  <- as released", "FP32": "  <- what qwen_np computes in",
                "INT4": "  (INT8/INT4 also store scales, a few % more)"}.get(fmt, "")
        lines.append(f"  {fmt:<6}{BYTES_PER_VALUE[fmt]:>4g} B/value  {_gib(n):>12}{note}")
    per_token, at_limit = kv["bytes_per_token"], kv["bytes_at_context_limit"]
    lines += ["", "KV cache: the keys and values of every layer, kept for every position so far",
              f"  per token: 2 (k and v) x L x KVH x Dh = 2 x {L} x {dims['KVH']} x {dims['Dh']} = "
              f"{kv['values_per_token']:,} values",
              f"    BF16 {_kib(per_token['BF16'])}/token, FP32 {_kib(per_token['FP32'])}/token "
              "(qwen_np keeps its cache in FP32)",
              f"  at the context limit ({kv['context_limit']:,} tokens): BF16 {_gib(at_limit['BF16'])}, "
              f"FP32 {_gib(at_limit['FP32'])}"]
    return "\n".join(lines)


def _render_flops(report: dict[str, Any]) -> str:
    flops = report["flops_per_token"]
    decode_S, limit_S = flops["decode"]["positions"], flops["decode_at_context_limit"]["positions"]
    labels = {"prefill": f"prefill, T = {flops['prefill']['tokens']} tokens in one pass",
              "decode": f"decode, 1 token after {decode_S - 1} (S = {decode_S})",
              "decode_at_context_limit": f"decode at the context limit (S = {limit_S:,})"}
    lines = ["FLOPs per token (matmuls, 2 per multiply-add; norms, RoPE, softmax and SiLU add far less)"]
    lines += [f"  {labels[key]:<48}{value['flops'] / 1e9:>10.2f} GFLOP" for key, value in flops.items()]
    lines.append("  rule of thumb: about 2 x the parameters a token passes through, plus attention, which grows with S")
    return "\n".join(lines)


def _render_machine(report: dict[str, Any]) -> str:
    machine = report["this_machine"]
    bandwidth = machine["bandwidth_bytes_per_s"]
    plans = machine["plans"].items()
    labels = {"fp32": "FP32 weights (upcast once, at load)",
              "bf16": f"weights kept as stored ({machine['stored_format']})"}
    lines = ["This machine (measured here, approximate)",
             f"  available memory  {_gib(machine['available_bytes'])} "
             f"(a plan may use {machine['usable_fraction']:.0%} of it)",
             f"  memory bandwidth  {bandwidth / 1e9:.1f} GB/s "
             f"({machine['bandwidth_note'].removeprefix('measured here: ')})",
             f"  memory plan, with a {machine['context_tokens']:,}-token KV cache:"]
    lines += [f"    {labels[mode]:<40}needs {_gib(plan['needs_bytes']):>10}   "
              f"{'fits' if plan['fits'] else 'does NOT fit'}" for mode, plan in plans]
    lines.append("  decode speed the bandwidth allows (each new token streams every weight from memory once):")
    lines += [f"    {labels[mode]:<40}{plan['weight_bytes_read_per_token'] / 1e9:.2f} GB/token / "
              f"{bandwidth / 1e9:.1f} GB/s  ->  at most {plan['max_decode_tokens_per_s']:.2f} tokens/s"
              for mode, plan in plans]
    return "\n".join(lines)


def _billions(n: int) -> str:
    return f"{n / 1e9:.2f}B"


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _kib(n: float) -> str:
    return f"{n / 1024:g} KiB"


# --- Live trace ----------------------------------------------------------------------------------

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


class Tracer:
    """A trace for `Qwen3Model.forward`: one aligned row per step with shape, dtype and statistics.

        model.forward(ids, trace=Tracer())                  # every step of every layer, to stderr
        model.forward(ids, trace=Tracer(layers={0, 35}))    # only layers 0 and 35 (plus embed/norm/head)

    Shapes print as symbols = numbers ("[T, H, Dh] = [7, 32, 128]"). Statistics skip the -inf that
    the causal mask writes into the attention scores.
    """

    def __init__(self, stream: TextIO = sys.stderr, layers: set[int] | None = None) -> None:
        self.stream = stream
        self.layers = layers
        self.passes = 0

    def __call__(self, name: str, value: np.ndarray) -> None:
        match = _LAYER_INDEX.match(name)
        if name == "model.embed_tokens":
            self._start_pass(value.shape[0])
        if match and self.layers is not None and int(match.group(1)) not in self.layers:
            return
        print(trace_row(name, value), file=self.stream)

    def _start_pass(self, tokens: int) -> None:
        self.passes += 1
        print(f"\nforward pass {self.passes}: T = {tokens} token{'s' if tokens != 1 else ''}", file=self.stream)
        print(f"  {'step':<{_NAME_WIDTH}}{'shape':<{_SHAPE_WIDTH}}{'dtype':<9}"
              f"{'mean':>11}{'std':>11}{'max|x|':>11}", file=self.stream)


_NAME_WIDTH, _SHAPE_WIDTH = 44, 32


def trace_row(name: str, value: np.ndarray) -> str:
    """One Tracer row: name, shape as symbols = numbers, dtype, mean, std, max|x| (finite values)."""
    step = STEPS_BY_NAME.get(_LAYER_INDEX.sub("model.layers.{i}.", name))
    symbols = step.output if step is not None and len(step.output) == value.ndim else None
    shape = format_shape(symbols, value.shape) if symbols else str(list(value.shape))
    finite = value[np.isfinite(value)].astype(np.float64)
    masked = value.size - finite.size
    stats = (finite.mean(), finite.std(), np.abs(finite).max()) if finite.size else (math.nan,) * 3
    note = f"  ({masked:,} masked)" if masked else ""
    return (f"  {name:<{_NAME_WIDTH}}{shape:<{_SHAPE_WIDTH}}{str(value.dtype):<9}"
            + "".join(f"{s:>11.4g}" for s in stats) + note)


# --- Logit lens ----------------------------------------------------------------------------------

def lens_probabilities(model: Qwen3Model, token_ids: Sequence[int]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(row labels, lens probabilities [L+1, V], the model's own probabilities [V]) at the last position.

    Row 0 reads the embedding, row l+1 the residual stream after layer l: each goes through the
    final norm and lm_head as if the model stopped there. The last row is the model's own output.
    """
    residuals: dict[str, np.ndarray] = {}

    def capture(name: str, value: np.ndarray) -> None:
        if name == "model.embed_tokens" or name.endswith(".residual_mlp"):
            residuals[name] = value[-1].copy()                                   # [D]

    logits = model.forward(token_ids, trace=capture)                             # [T, V]
    stream = np.stack(list(residuals.values()))                                  # [L+1, D]
    normed = layers.rms_norm(stream, model.norm, model.config.rms_norm_eps)      # [L+1, D]
    lens_logits = layers.linear(normed, model.lm_head)                           # [L+1, V]
    labels = ["embedding"] + [f"layer {i}" for i in range(model.config.num_hidden_layers)]
    return labels, layers.softmax(lens_logits), layers.softmax(logits[-1])


def logit_lens(model: Qwen3Model, token_ids: list[int], tokenizer: Any, top_k: int = 5) -> str:
    """After each layer, the top-k next tokens the final norm + lm_head would predict at the last position."""
    labels, probs, final = lens_probabilities(model, token_ids)
    last = len(token_ids) - 1
    lines = [f"Logit lens at the last position ({last}, {token_text(tokenizer, token_ids[-1])}): the final norm + "
             "lm_head applied to the residual stream after each layer",
             f"  {'after':<12}top {top_k} next tokens (probability)"]
    lines += [f"  {label:<12}{_top_tokens(row, tokenizer, top_k)}" for label, row in zip(labels, probs)]
    lines.append(f"  {'model':<12}{_top_tokens(final, tokenizer, top_k)}")
    lines.append(f"  (the model's own output equals the row after layer {len(labels) - 2}: "
                 "there the lens IS the model)")
    return "\n".join(lines)


def _top_tokens(probs: np.ndarray, tokenizer: Any, top_k: int) -> str:
    top = np.argsort(-probs, kind="stable")[:top_k]
    return "  ".join(f"{pad(token_text(tokenizer, int(i)), 15)}{probs[i]:<9.3g}" for i in top).rstrip()


def token_text(tokenizer: Any, token_id: int, width: int = 14) -> str:
    """One token as quoted text, with whitespace made visible ('\\n') and long tokens shortened."""
    text = repr(tokenizer.decode([token_id]))
    return text if len(text) <= width else text[:width - 2] + "…" + text[-1]


def pad(text: str, width: int) -> str:
    """Left-align text in `width` terminal columns; CJK and other wide characters take two."""
    columns = sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)
    return text + " " * max(0, width - columns)


# --- Attention view ------------------------------------------------------------------------------

def attention_weights(model: Qwen3Model, token_ids: Sequence[int], layer: int) -> np.ndarray:
    """The softmax weights [H, T, T] of one layer, from a forward pass over `token_ids`."""
    L, target = model.config.num_hidden_layers, f"model.layers.{layer}.self_attn.softmax"
    if not 0 <= layer < L:
        raise QwenNPError(f"--attention: layer {layer} out of range [0, {L})")
    captured: dict[str, np.ndarray] = {}

    def capture(name: str, value: np.ndarray) -> None:
        if name == target:
            captured[name] = value.copy()

    model.forward(token_ids, trace=capture)
    return captured[target]


def attention_view(model: Qwen3Model, token_ids: list[int], tokenizer: Any, layer: int, head: int,
                   png_path: str | None = None) -> str:
    """The last token's attention over the prompt for one layer and head, as a text heatmap (and a PNG)."""
    H = model.config.num_attention_heads
    if not 0 <= head < H:
        raise QwenNPError(f"--attention: head {head} out of range [0, {H})")
    weights = attention_weights(model, token_ids, layer)[head]                   # [T, T]
    texts = [token_text(tokenizer, int(t)) for t in token_ids]
    last = weights[-1]                                                           # [T]
    lines = [f"Attention of the last token {texts[-1]} (position {len(texts) - 1}) over the prompt: layer {layer}, "
             f"head {head} (reads KV head {head // model.config.group_size})",
             "  the weights sum to 1; bars are scaled to the largest weight",
             f"  {'pos':>4}  {'token':<15}{'weight':>7}"]
    for position, (text, w) in enumerate(zip(texts, last)):
        lines.append(f"  {position:>4}  {pad(text, 15)}{w:>7.3f}  {_bar(w / last.max())}")
    if len(texts) <= GRID_MAX_TOKENS:
        lines += ["", "  every query position (row) over every key position (column): "
                  f"{' '.join(f'{s}<={t:g}' for s, t in zip(SHADES, SHADE_LIMITS))}, · = future (masked)"]
        lines += [f"  {pad(text, 15)}{_shade_row(row, position)}".rstrip()
                  for position, (text, row) in enumerate(zip(texts, weights))]
    if png_path is not None:
        write_png(png_path, heatmap_pixels(weights))
        lines.append(f"\n  wrote {png_path}: the full {len(texts)} x {len(texts)} grid, darker = more weight")
    return "\n".join(lines)


BAR_WIDTH = 40
EIGHTHS = " ▏▎▍▌▋▊▉"
SHADES, SHADE_LIMITS = "░▒▓█", (0.25, 0.5, 0.75, 1.0)
GRID_MAX_TOKENS = 48


def _bar(fraction: float) -> str:
    """A horizontal bar of BAR_WIDTH characters at 1.0, drawn in eighths of a character."""
    eighths = int(round(fraction * BAR_WIDTH * 8))
    return "█" * (eighths // 8) + EIGHTHS[eighths % 8].strip()


def _shade_row(weights: np.ndarray, position: int) -> str:
    cells = [SHADES[min(int(np.searchsorted(SHADE_LIMITS, w)), len(SHADES) - 1)] * 2 for w in weights[:position + 1]]
    return "".join(cells) + "· " * (len(weights) - position - 1)


def heatmap_pixels(weights: np.ndarray, cell: int | None = None) -> np.ndarray:
    """RGB image [T*cell, T*cell, 3] of a [T, T] attention grid: white 0 -> dark blue 1, masked cells grey."""
    T = weights.shape[0]
    cell = cell or max(4, min(32, 512 // T))
    white, blue, grey = np.array([255, 255, 255.0]), np.array([8, 48, 107.0]), np.array([225, 225, 225.0])
    colors = white + weights[..., None].astype(np.float64) * (blue - white)       # [T, T, 3]
    colors[np.triu(np.ones((T, T), dtype=bool), 1)] = grey
    return np.repeat(np.repeat(colors.round().astype(np.uint8), cell, axis=0), cell, axis=1)


def write_png(path: str, rgb: np.ndarray) -> None:
    """Write an 8-bit RGB image [height, width, 3] as a PNG using only zlib and struct."""
    height, width, _ = rgb.shape
    scanlines = b"".join(b"\x00" + row.tobytes() for row in np.ascontiguousarray(rgb, dtype=np.uint8))  # filter 0

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)   # 8-bit depth, colour type 2 (RGB)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(scanlines, 9))
                + chunk(b"IEND", b""))
