"""`python -m qwen_np inspect`: every step's shapes, parameters, bytes, FLOPs and the memory plan, as
plain data (the JSON output) and rendered as text."""

from __future__ import annotations

import json
from typing import Any

from ..core.kv_cache import kv_position_bytes
from ..core.config import DIMENSIONS, LAYER_MATRICES, Qwen3Config, dimensions, evaluate, resolve
from ..errors import QwenNPError
from ..numbers.names import HELD_FORMATS
from ..numbers.formats import bits_per_weight
from ..engine.budget import context_for
from ..engine.sizes import GiB
from ..engine.memory import (SAFETY_FRACTION, available_memory, candidate_plans, int8_weight_bytes, kv_cache_bytes_per_token,
                             weight_bytes, working_bytes)
from ..engine.step_memory import (attention_probabilities, lora_parameters, training_memory, training_peak, training_remedies,
                                  training_total)
from ..numbers.numerics import BYTES_PER_VALUE
from .bandwidth import measure_bandwidth
from .counts import forward_flops, modules, parameter_summary, weight_bytes_read_per_token
from .steps import Shape, Step, format_shape, forward_steps

# How real runtimes store the KV cache (BF16; int8 as llama.cpp's -ctk q8_0 does, here with an FP32 scale per
# position and head) and how qwen_np does by default (FP32): shown name -> --kv-dtype (core.kv_cache)
KV_FORMATS = {"BF16": "bf16", "FP32": "fp32", "INT8": "int8"}
# config.json's torch_dtype -> the format name of numerics.BYTES_PER_VALUE
STORED_FORMATS = {"float32": "FP32", "bfloat16": "BF16", "float16": "FP16"}
# Where the config of a report came from (inspect_report's config_source), as the text says it.
CONFIG_SOURCES = {"config.json": "(no weights needed: every shape and count follows from config.json)",
                  "preset": "(no weights needed: every shape and count follows from the preset's config)",
                  "GGUF metadata": "(every shape and count follows from the GGUF's metadata, checked against its tensors)"}


def inspect_report(config: Qwen3Config, tokens: int, model_name: str, bandwidth: float,
                   context: int | None = None, batch_size: int = 16, lora_rank: int | None = None,
                   config_source: str = "config.json", weights_file: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything `inspect` shows, as plain data (the JSON output, and what the text is rendered from).

    context: the KV cache / training sequence length of the memory breakdown (default: the model's
    context, at most core.defaults.DEFAULT_CONTEXT); batch_size: the training batch of that breakdown; lora_rank:
    also LoRA training's at that rank (adapters on all seven projections, the frozen base held each way).
    config_source: where the config came from (CONFIG_SOURCES); weights_file: a file's own weights
    (gguf_file.GGUFCheckpoint.file_summary), whose bytes then stand for the weights kept as stored.
    """
    if tokens <= 0:
        raise QwenNPError(f"must be at least 1, got {tokens}", "tokens")
    memory_context = context or context_for(config)       # asked for: as asked, even past the model's
    for name, value in (("context", memory_context), ("batch_size", batch_size), ("lora_rank", lora_rank or 1)):
        if value < 1:
            raise QwenNPError(f"must be at least 1, got {value}", name)
    dims = dimensions(config, tokens)
    params = parameter_summary(config)
    kv_values = kv_cache_bytes_per_token(config, bytes_per_value=1)
    context = context_for(config, default=None)
    return {
        "model": model_name,
        "config_source": config_source,
        "weights_file": weights_file,
        "dimensions": dims,
        "steps": [_step_record(step, dims) for step in forward_steps(config)],
        "dense_layers": sum(not config.sparse_layer(i) for i in range(config.num_hidden_layers)),
        "parameters": {
            **params,
            "per_module": [{"name": m.name, "weight": _shape_record(m.shape, dims), "parameters": m.parameters,
                            "instances": m.instances} for m in modules(config)],
            "lm_head_tied_to_embeddings": config.tie_word_embeddings,
        },
        "weight_bytes": {fmt: int(params["total"] * width) for fmt, width in BYTES_PER_VALUE.items()},
        "kv_cache": {"values_per_token": kv_values, "context_limit": context,
                     "bytes_per_token": {fmt: kv_position_bytes(config, dtype) for fmt, dtype in KV_FORMATS.items()},
                     "bytes_at_context_limit": {fmt: kv_position_bytes(config, dtype) * context
                                                for fmt, dtype in KV_FORMATS.items()}},
        "flops_per_token": {
            "prefill": {"tokens": tokens, "positions": tokens,
                        "flops": forward_flops(config, tokens, tokens) // tokens},
            "decode": {"tokens": 1, "positions": tokens + 1, "flops": forward_flops(config, 1, tokens + 1)},
            "decode_at_context_limit": {"tokens": 1, "positions": context,
                                        "flops": forward_flops(config, 1, context)},
        },
        "memory": memory_breakdown(config, memory_context, batch_size, lora_rank,
                                   None if weights_file is None else weights_file["held_bytes"]),
        "this_machine": _machine_report(config, bandwidth, memory_context, weights_file),
    }


def memory_breakdown(config: Qwen3Config, context: int, batch_size: int, lora_rank: int | None = None,
                     stored_bytes: int | None = None) -> dict[str, Any]:
    """Bytes to run the model (weights, KV cache, working buffers) and to train it (step_memory.training_memory):
    every weight, and with lora_rank its LoRA adapters on all seven projections, the base frozen as each
    memory mode holds it. stored_bytes: the weights kept as stored (the bf16 mode) where a file says what
    they take (a GGUF's blocks), else BF16's 2 bytes a weight."""

    params = parameter_summary(config)["total"]
    stored = {"fp32": 4 * params, "bf16": 2 * params if stored_bytes is None else stored_bytes,
              "int8": int8_weight_bytes(config),
              **{fmt: weight_bytes(config, fmt) for fmt in HELD_FORMATS}}
    remedies = training_remedies(config, batch_size, context)
    baseline = remedies.pop("baseline")
    lora = {}
    if lora_rank is not None:
        plans = {mode: training_memory(config, batch_size, context, lora_rank=lora_rank, lora_targets=LAYER_MATRICES,
                                       frozen=mode) for mode in stored}
        lora = {"lora": {"rank": lora_rank, "trainable": lora_parameters(config, lora_rank, LAYER_MATRICES),
                         **{key: value for key, value in plans["fp32"].items() if key != "frozen_base"},
                         "peak": training_peak(plans["fp32"]), "frozen_upcast": plans["bf16"].get("frozen_upcast", 0),
                         "by_frozen_base": {mode: {"frozen_base": plan["frozen_base"], "total": training_total(plan)}
                                            for mode, plan in plans.items()}}}
    return {
        "context": context,
        "inference": {"weights": stored, "kv_cache_fp32": context * kv_cache_bytes_per_token(config, 4),
                      "working_buffers": working_bytes(config, context)},
        "training": {"batch_size": batch_size, **baseline, "peak": training_peak(baseline),
                     "attention_probabilities": attention_probabilities(config, batch_size, context),
                     "remedies": {name: {"total": r["total"], "saves": baseline["total"] - r["total"]}
                                  for name, r in remedies.items()}},
        **lora,
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


def _machine_report(config: Qwen3Config, bandwidth: float, context: int,
                    weights_file: dict[str, Any] | None = None) -> dict[str, Any]:
    """Would the weights fit here in each way to hold them, with a KV cache of `context` positions (the
    breakdown's, --ctx-size), and how fast could decode then go. Kept as stored: config.json's torch_dtype,
    or a file's own kinds at the bytes they are held in (weights_file)."""
    available = available_memory()
    if weights_file is None:
        stored_format = STORED_FORMATS.get(config.torch_dtype, "BF16")
        stored_width: float = int(BYTES_PER_VALUE[stored_format])
    else:
        stored_format = "/".join(weights_file["kinds"])
        stored_width = weights_file["held_bytes"] / parameter_summary(config)["total"]
    candidates = candidate_plans(config, context, stored_width, available)
    plans = {}
    # int8: one byte per weight; its FP32 row scales add 4 bytes per row of D >= 1024 values (< 0.4%).
    # q8_0, q4_0: their bits per weight, the FP16 block scales included.
    widths = {"fp32": 4, "bf16": stored_width, "int8": 1, **{fmt: bits_per_weight(fmt) / 8 for fmt in HELD_FORMATS}}
    for mode, width in widths.items():
        read = weight_bytes_read_per_token(config, width)
        plans[mode] = {"needs_bytes": candidates[mode].total_bytes, "fits": candidates[mode].fits,
                       "weight_bytes_read_per_token": read, "max_decode_tokens_per_s": bandwidth / read}
    # The room the plan leaves beside the weights kept as stored and the working buffers, in whole positions.
    room = max(0, candidates["bf16"].room_for_kv_cache)
    longest = {fmt: room // kv_position_bytes(config, dtype) for fmt, dtype in KV_FORMATS.items()}
    return {"available_bytes": available, "usable_fraction": SAFETY_FRACTION, "context_tokens": context,
            "stored_format": stored_format, "longest_kv_cache_tokens": longest,
            "bandwidth_bytes_per_s": bandwidth, "bandwidth_note": "measured here: NumPy copy of a 256 MiB "
            "array, read + write, one thread per core; approximate", "plans": plans}


def inspect_command(config: Qwen3Config, tokens: int, as_json: bool, model_name: str,
                    context: int | None = None, batch_size: int = 16, lora_rank: int | None = None,
                    config_source: str = "config.json", weights_file: dict[str, Any] | None = None) -> str:
    """The output of `python -m qwen_np inspect`: text for people, or JSON when as_json."""
    report = inspect_report(config, tokens, model_name, measure_bandwidth(), context, batch_size, lora_rank,
                            config_source, weights_file)
    return json.dumps(report, indent=2) if as_json else render_report(report)


def render_report(report: dict[str, Any]) -> str:
    return "\n\n".join([_render_dimensions(report), _render_steps(report), _render_parameters(report),
                        _render_bytes(report), _render_flops(report), _render_memory(report),
                        _render_machine(report)]) + "\n"


def _render_memory(report: dict[str, Any]) -> str:
    memory = report["memory"]
    inference, training = memory["inference"], memory["training"]
    context, batch = memory["context"], training["batch_size"]
    lines = [f"Memory to run it, with a {context:,}-token KV cache (--ctx-size)"]
    notes, names = {"int8": " (+ FP32 row scales)"}, {}
    if report["weights_file"] is not None:              # a GGUF's bf16 mode keeps the file's blocks
        notes["bf16"], names["bf16"] = " (the file's kinds)", "STORED"
    lines += [f"  weights {names.get(fmt, fmt.upper()):<6}{notes.get(fmt, ''):<24}{_size(n):>12}"
              for fmt, n in inference["weights"].items()]
    lines += [f"  {'KV cache (FP32, as qwen_np keeps it)':<38}{_size(inference['kv_cache_fp32']):>12}",
              f"  {'working buffers (a prefill chunk)':<38}{_size(inference['working_buffers']):>12}",
              "", f"Memory to train it (qwen_np train: FP32 weights, gradients, AdamW and tape), a batch of {batch} x "
              f"{context:,} tokens (--batch-size)"]
    lines += _training_parts(training, batch, context)
    quarter = max(1, batch // 4)
    labels = {"quarter_batch": f"--batch-size {quarter} (another, noisier update)",
              "bf16_activations": "activations in BF16 (a GPU run; qwen_np keeps FP32)",
              "grad_accum_4": f"--grad-accum 4 (the same update, 4 x {quarter} rows)",
              "recompute": "--recompute (each layer rerun in the backward)",
              "all_three": "--recompute, --grad-accum 4 and BF16 activations"}
    lines += ["", f"  {'with a remedy (each alone, then the last three)':<56}{'total':>12}{'saves':>12}"]
    lines += [f"  {labels[name]:<56}{_size(r['total']):>12}{_size(r['saves']):>12}"
              for name, r in training["remedies"].items()]
    if "lora" in memory:
        lines += ["", *_lora_lines(memory["lora"], batch, context)]
    return "\n".join(lines)


# training_memory's parts as `inspect` names them (the rest of step_memory.training_memory's docstring).
TRAINING_PARTS = {
    "weights": "weights", "gradients": "gradients", "adamw": "AdamW moments m and v",
    "activations": "activations ({per_token:,.1f} KiB/token x {batch} x {context:,})",
    "attention_probabilities": "  of which attention probabilities (H x {context:,} x {context:,})",
    "logits": "logits [T, V] (FP32)", "logit_gradient": "their gradient",
    "scaled_logit_gradient": "their gradient scaled up (FP16's loss scaling)",
    "stacked_probabilities": "the forward's probabilities, stacked into the tape",
    "recomputed_probabilities": "a recomputed layer's probabilities, stacked",
    "head_gradient": "the LM head's gradient, the backward's first",
    "rounded_head": "the LM head and its input gradient rounded",
    "frozen_upcast": "a base not in FP32: its LM head widened to FP32",
    "tied_embedding_gradients": "the tied table's two gradients, before they are added",
    "piece_gradients": "gradients of another piece, to add into",
    "adamw_temporaries": "AdamW's temporaries (twice the largest weight)",
    "total": "total, at the step's peak ({peak})",
}


def _training_parts(training: dict[str, Any], batch: int, context: int, totals: bool = True) -> list[str]:
    """One line a part of a training_memory estimate that has it, and (totals) its peak's total: the parts
    are alive at different moments of the step (step_memory.TRAINING_MOMENTS), so the total is not their sum."""
    values = {"per_token": training["activations_per_token"] / 1024, "batch": batch, "context": context,
              "peak": training["peak"].replace("_", " ")}
    return [f"  {label.format(**values):<56}{_size(training[key]):>12}" for key, label in TRAINING_PARTS.items()
            if key in training and (totals or key != "total")]


def _lora_lines(lora: dict[str, Any], batch: int, context: int) -> list[str]:
    """inspect --lora R: LoRA training's memory (train --model M --lora R), the frozen base held each way."""
    lines = [f"Memory to train LoRA adapters of rank {lora['rank']} on all seven projections (train --lora "
             f"{lora['rank']}), a batch of {batch} x {context:,} tokens",
             f"  {'trainable weights (' + format(lora['trainable'], ',') + ', FP32)':<56}{_size(lora['weights']):>12}",
             *_training_parts({key: value for key, value in lora.items() if key != "weights"}, batch, context,
                              totals=False),
             f"  {'the frozen base (--memory), no gradient nor moments':<56}{'base':>12}{'total':>12}"]
    lines += [f"  {'  held as ' + mode:<56}{_size(plan['frozen_base']):>12}{_size(plan['total']):>12}"
              for mode, plan in lora["by_frozen_base"].items()]
    return lines


def _render_dimensions(report: dict[str, Any]) -> str:
    dims = report["dimensions"]
    group = dims["H"] // dims["KVH"]
    notes = {"KVH": f" (each serves H/KVH = {group} query heads)",
             "Dh": f" (D/H = {dims['D'] / dims['H']:g})" if dims["D"] != dims["H"] * dims["Dh"] else ""}
    lines = [f"{report['model']}: one forward pass over T = {dims['T']} tokens, step by step",
             CONFIG_SOURCES[report["config_source"]],
             "", "Dimensions"]
    lines += [f"  {sym:<4}{value:>8}  {DIMENSIONS[sym]}{notes.get(sym, '')}" for sym, value in dims.items()]
    return "\n".join(lines)


def _render_steps(report: dict[str, Any]) -> str:
    def shape(record: dict[str, Any]) -> str:
        return format_shape(record["symbols"], record["numbers"])

    steps, L = report["steps"], report["dimensions"]["L"]
    inputs = [[f"{x['what']} {shape(x)}" for x in step["inputs"]] for step in steps]
    in_width = max(len(text) for texts in inputs for text in texts) + 2
    names = [step["name"].replace("model.layers.{i}.", "") for step in steps]           # Step.short_name's
    name_width = max(map(len, names)) + 2
    lines = ["Forward pass (names as `generate --trace` prints them; S = T here: no KV cache yet)",
             f"   #  {'step':<{name_width}}{'input':<{in_width}}output"]
    for number, (step, texts) in enumerate(zip(steps, inputs), start=1):
        previous = steps[number - 2]["per_layer"] if number > 1 else False
        if step["per_layer"] and not previous:
            lines.append(f"      model.layers.{{i}} for i = 0 .. {L - 1}: the same "
                         f"{sum(s['per_layer'] for s in steps)} steps in each of the L = {L} layers")
            if any(".mlp.experts." in s["name"] for s in steps) and report["dense_layers"]:
                lines.append(f"      ({report['dense_layers']} dense layers (mlp_only_layers, decoder_sparse_step) run "
                             "the dense MLP, gate_proj / up_proj / act_fn / down_proj over F, in mlp.gate .. mlp.moe's place)")
        elif previous and not step["per_layer"]:
            lines.append("      after the last layer:")
        indent = " " * (6 + name_width)
        lines.append(f"{number:>4}  {names[number - 1]:<{name_width}}"
                     f"{texts[0]:<{in_width}}{shape(step['output'])}")
        lines += [indent + text for text in texts[1:]]
        lines.append(f"{indent}{step['what']}  [{step['code'].removeprefix('qwen_np.')}]")
    return "\n".join(lines)


def _render_parameters(report: dict[str, Any]) -> str:
    params = report["parameters"]
    x = max(4, 1 + max(len(str(m["instances"])) for m in params["per_module"]))     # a MoE's experts: 6144
    lines = ["Parameters", f"  {'tensor (+ .weight)':<44}{'shape':<28}{'each':>14}{'x':>{x}}{'total':>16}"]
    for m in params["per_module"]:
        shape = format_shape(m["weight"]["symbols"], m["weight"]["numbers"])
        lines.append(f"  {m['name']:<44}{shape:<28}{m['parameters']:>14,}{m['instances']:>{x}}"
                     f"{m['parameters'] * m['instances']:>16,}")
    if params["lm_head_tied_to_embeddings"]:
        lines.append(f"  {'lm_head':<44}{'tied: reuses model.embed_tokens':<28}{0:>14,}{1:>4}{0:>16,}")
    moe = params["active"] != params["total"]
    lines.append(f"  {'one sparse decoder layer' if moe else 'one decoder layer':<90}{params['per_layer']:>16,}")
    lines.append(f"  {'total':<90}{params['total']:>16,}  ({_billions(params['total'])})")
    if moe:
        lines.append(f"  {'active: those a token computes with (its routed experts only)':<90}{params['active']:>16,}  "
                     f"({_billions(params['active'])})")
    lines.append(f"  {'without embeddings (embed_tokens and lm_head)':<90}{params['without_embeddings']:>16,}  "
                 f"({_billions(params['without_embeddings'])})")
    return "\n".join(lines)


def _render_bytes(report: dict[str, Any]) -> str:
    kv, L = report["kv_cache"], report["dimensions"]["L"]
    dims = report["dimensions"]
    lines = _file_bytes(report) if report["weights_file"] is not None else _format_bytes(report)
    per_token, at_limit = kv["bytes_per_token"], kv["bytes_at_context_limit"]
    lines += ["", "KV cache: the keys and values of every layer, kept for every position so far",
              f"  per token: 2 (k and v) x L x KVH x Dh = 2 x {L} x {dims['KVH']} x {dims['Dh']} = "
              f"{kv['values_per_token']:,} values",
              f"    BF16 {_kib(per_token['BF16'])}/token, FP32 {_kib(per_token['FP32'])}/token "
              f"(qwen_np's default), INT8 {_kib(per_token['INT8'])}/token (a 4-byte scale per {dims['Dh']} values; "
              "--kv-dtype)",
              f"  at the context limit ({kv['context_limit']:,} tokens): BF16 {_gib(at_limit['BF16'])}, "
              f"FP32 {_gib(at_limit['FP32'])}, INT8 {_gib(at_limit['INT8'])}"]
    return "\n".join(lines)


def _format_bytes(report: dict[str, Any]) -> list[str]:
    """What the weights would take in each number format: parameters x bytes per value."""
    lines = ["Weight bytes by number format (parameters x bytes per value)"]
    for fmt, n in report["weight_bytes"].items():
        note = {"BF16": "  <- as released", "FP32": "  <- what qwen_np computes in",
                "INT4": "  (INT8/INT4 also store scales, a few % more)"}.get(fmt, "")
        lines.append(f"  {fmt:<6}{BYTES_PER_VALUE[fmt]:>4g} B/value  {_gib(n):>12}{note}")
    return lines


def _file_bytes(report: dict[str, Any]) -> list[str]:
    """A file's own weight bytes, kind by kind, and what they take held as stored."""
    weights, total = report["weights_file"], report["parameters"]["total"]
    kinds = weights["kinds"]
    held = ("the file's bytes" if weights["held_bytes"] == weights["tensor_bytes"]
            else "kinds repacked at load or dequantized to FP32 take more")
    lines = [f"Weight bytes in this file ({weights['path']}, {_size(weights['file_bytes'])}), by ggml kind",
             f"  {'kind':<8}{'tensors':>8}{'bytes':>14}"]
    lines += [f"  {kind:<8}{n['tensors']:>8}{_size(n['bytes']):>14}" for kind, n in kinds.items()]
    lines += [f"  {'all':<8}{sum(n['tensors'] for n in kinds.values()):>8}{_size(weights['tensor_bytes']):>14}  "
              f"({8 * weights['tensor_bytes'] / total:.2f} bits a weight)",
              f"  {'held':<8}{'':>8}{_size(weights['held_bytes']):>14}  (kept as stored, --memory bf16: {held})"]
    return lines


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
              "bf16": f"weights kept as stored ({machine['stored_format']})",
              "int8": "int8 weights (--memory int8, at load)",
              **{fmt: f"llama.cpp {fmt} blocks (--memory {fmt}, at load)" for fmt in HELD_FORMATS}}
    lines = ["This machine (measured here, approximate)",
             f"  available memory  {_gib(machine['available_bytes'])} "
             f"(a plan may use {machine['usable_fraction']:.0%} of it)",
             f"  memory bandwidth  {bandwidth / 1e9:.1f} GB/s "
             f"({machine['bandwidth_note'].removeprefix('measured here: ')})",
             f"  memory plan, with a {machine['context_tokens']:,}-token KV cache:"]
    lines += [f"    {labels[mode]:<48}needs {_gib(plan['needs_bytes']):>10}   "
              f"{'fits' if plan['fits'] else 'does NOT fit'}" for mode, plan in plans]
    longest = machine["longest_kv_cache_tokens"]
    lines.append("  longest KV cache beside the weights kept as stored: "
                 + ", ".join(f"{fmt} {tokens:,}" for fmt, tokens in longest.items())
                 + f" tokens (--kv-dtype; the model's context: {report['kv_cache']['context_limit']:,})")
    lines.append("  decode speed the bandwidth allows (each new token streams every weight from memory once):")
    lines += [f"    {labels[mode]:<48}{plan['weight_bytes_read_per_token'] / 1e9:.2f} GB/token / "
              f"{bandwidth / 1e9:.1f} GB/s  ->  at most {plan['max_decode_tokens_per_s']:.2f} tokens/s"
              for mode, plan in plans]
    return "\n".join(lines)


def _billions(n: int) -> str:
    return f"{n / 1e9:.2f}B"


def _size(n: float) -> str:
    """GiB, or MiB below one GiB (a small model's figures would all read 0.00 GiB)."""
    return _gib(n) if abs(n) >= GiB else f"{n / 2 ** 20:.2f} MiB"


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _kib(n: float) -> str:
    return f"{n / 1024:g} KiB"
