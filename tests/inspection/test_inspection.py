"""Seeing inside: `inspect` shapes and counts, the live Tracer, the logit lens and the attention view."""

from __future__ import annotations

from dataclasses import replace

import io
import json
import math
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import HANG_SECONDS, QWEN3_RANDOM, ROOT
from qwen_np import PRESETS, QwenNPError, load_config, load_model, preset
from qwen_np.core.config import expected_tensors
from qwen_np.inspection import (STEPS, Tracer, attention_view, attention_weights, dimensions, forward_flops,
                                inspect_command, inspect_report, lens_probabilities, logit_lens, resolve,
                                weight_tensors)
from qwen_np.inspection.report import render_report
from tests.core.test_config import QWEN3_8B_CONFIG

BANDWIDTH = 10e9   # a fixed bandwidth keeps these tests fast; inspect_command measures the real one

# Model-card figures (total, non-embedding) in billions, to the digits the cards print; exact where known.
PUBLISHED = {
    "qwen3-0.6b": (596_049_920, 0.44), "qwen3-1.7b": (1.7, 1.4), "qwen3-4b": (4.0, 3.6),
    "qwen3-8b": (8_190_735_360, 6.95), "qwen3-14b": (14.8, 13.2), "qwen3-32b": (32.8, 31.2),
}


class StubTokenizer:
    """Enough of Tokenizer for the lens and the attention view: token id -> 'tN'."""

    def decode(self, ids: list[int]) -> str:
        return f"t{ids[0]}"


def _rounds_to(value: int, published: float) -> bool:
    digits = len(str(published).split(".")[1])
    return round(value / 1e9, digits) == published


def expanded_steps(num_layers: int) -> list[tuple[str, tuple[str, ...]]]:
    """(trace name, output symbols) of every step of a forward pass, layers spelled out."""
    before = [(s.name, s.output) for s in STEPS[:1]]
    layer = [(s.name, s.output) for s in STEPS if s.in_layer]
    after = [(s.name, s.output) for s in STEPS[1 + len(layer):]]
    return before + [(name.format(i=i), shape) for i in range(num_layers) for name, shape in layer] + after


# --- inspect: shapes and counts for the published models -----------------------------------------

@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_counts_match_published_figures(name):
    params = inspect_report(preset(name), 7, name, BANDWIDTH)["parameters"]
    total, non_embedding = PUBLISHED[name]
    assert params["total"] == total if isinstance(total, int) else _rounds_to(params["total"], total)
    assert _rounds_to(params["without_embeddings"], non_embedding)


def test_qwen3_8b_exact_counts():
    params = inspect_report(preset("qwen3-8b"), 7, "qwen3-8b", BANDWIDTH)["parameters"]
    assert params == {**params, "total": 8_190_735_360, "per_layer": 192_946_432,
                      "without_embeddings": 6_946_075_648}


def test_qwen3_30b_a3b_counts_its_experts_and_reads_only_the_active_ones_a_token():
    report = inspect_report(preset("qwen3-30b-a3b"), 7, "qwen3-30b-a3b", BANDWIDTH)
    params = report["parameters"]
    assert (params["total"], params["active"]) == (30_532_122_624, 3_353_032_704)      # 30.5 B, 3.3 B active
    assert sum(m["parameters"] * m["instances"] for m in params["per_module"]) == params["total"]
    assert "model.layers.{i}.mlp.gate_proj" not in {m["name"] for m in params["per_module"]}   # every layer sparse
    read = {plan["weight_bytes_read_per_token"] for plan in report["this_machine"]["plans"].values()}
    assert max(read) < 4 * params["active"]               # FP32's: the active weights, not all 30.5 B
    assert "active: those a token computes with" in render_report(report)


def test_a_moe_s_steps_show_its_router_and_experts_and_its_flops_are_twice_its_active_matmul_weights():
    """Qwen3-30B-A3B: the step table shows the sparse MLP (router, routing, the chosen experts over T*K rows) where
    a dense model's MLP is, and a decode token's matmul FLOPs are 2 per active weight it multiplies (not the norms',
    nor the embedding table's, read, not multiplied) plus attention's 4 H S Dh a layer."""
    config = preset("qwen3-30b-a3b")
    report = inspect_report(config, 7, "qwen3-30b-a3b", BANDWIDTH)
    names = [step["name"].replace("model.layers.{i}.", "") for step in report["steps"]]
    assert names[names.index("post_attention_layernorm") + 1:names.index("residual_mlp")] == [
        "mlp.gate", "mlp.route", "mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.act_fn",
        "mlp.experts.{e}.down_proj", "mlp.moe"]
    shapes = _step_shapes(report)
    assert shapes["model.layers.{i}.mlp.experts.{e}.down_proj"] == ([[7 * 8, 768]], [7 * 8, 2048])
    S = 8
    norms = sum(m["parameters"] * m["instances"] for m in report["parameters"]["per_module"] if len(m["weight"]["symbols"]) == 1)
    matmul_active = (report["parameters"]["active"] - norms
                     - config.vocab_size * config.hidden_size * (not config.tie_word_embeddings))
    attention = config.num_hidden_layers * 4 * config.num_attention_heads * S * config.head_dim
    assert forward_flops(config, 1, S) == 2 * matmul_active + attention
    mixed = replace(config, mlp_only_layers=(0, 5))
    D, F, Fe = config.hidden_size, config.intermediate_size, config.moe_intermediate_size
    sparse_weights = config.num_experts_per_tok * 3 * D * Fe + config.num_experts * D          # K experts and the router
    assert forward_flops(mixed, 1, S) == forward_flops(config, 1, S) + 2 * 2 * (3 * D * F - sparse_weights)
    assert "2 dense layers (mlp_only_layers, decoder_sparse_step) run the dense MLP" in render_report(
        inspect_report(mixed, 7, "mixed", BANDWIDTH))


@pytest.mark.parametrize("name", PUBLISHED)
def test_step_weights_are_exactly_the_checkpoint_tensors(name):
    config = preset(name)
    dims = dimensions(config, 1)
    ours = {step.name.format(i=i) + ".weight": tuple(resolve(step.weight, dims))
            for step, _ in weight_tensors(config)
            for i in (range(config.num_hidden_layers) if step.in_layer else [None])}
    assert ours == expected_tensors(config)


def _step_shapes(report):
    return {s["name"]: ([x["numbers"] for x in s["inputs"]], s["output"]["numbers"]) for s in report["steps"]}


def test_qwen3_8b_step_shapes():
    shapes = _step_shapes(inspect_report(preset("qwen3-8b"), 7, "qwen3-8b", BANDWIDTH))
    assert shapes["model.embed_tokens"] == ([[7]], [7, 4096])
    assert shapes["model.layers.{i}.self_attn.q_proj"] == ([[7, 4096]], [7, 32, 128])
    assert shapes["model.layers.{i}.self_attn.k_proj"] == ([[7, 4096]], [7, 8, 128])
    assert shapes["model.layers.{i}.self_attn.scores"] == ([[7, 32, 128], [7, 8, 128]], [32, 7, 7])
    assert shapes["model.layers.{i}.self_attn.weighted_sum"] == ([[32, 7, 7], [7, 8, 128]], [7, 4096])
    assert shapes["model.layers.{i}.mlp.act_fn"] == ([[7, 12288], [7, 12288]], [7, 12288])
    assert shapes["lm_head"] == ([[7, 4096]], [7, 151936])


def test_qwen3_0_6b_heads_are_wider_than_the_model():
    # head_dim 128 with 16 heads: attention works at 2048 wide inside a 1024-wide model.
    shapes = _step_shapes(inspect_report(preset("qwen3-0.6b"), 5, "qwen3-0.6b", BANDWIDTH))
    assert shapes["model.layers.{i}.self_attn.q_proj"][1] == [5, 16, 128]
    assert shapes["model.layers.{i}.self_attn.o_proj"] == ([[5, 2048]], [5, 1024])


def test_qwen3_8b_kv_cache_and_bytes():
    report = inspect_report(preset("qwen3-8b"), 7, "qwen3-8b", BANDWIDTH)
    kv = report["kv_cache"]
    assert kv["bytes_per_token"] == {"BF16": 147_456, "FP32": 294_912, "INT8": 2 * 36 * 8 * (128 + 4)}   # codes, scales
    assert kv["bytes_at_context_limit"]["BF16"] == 147_456 * 40_960
    assert report["weight_bytes"]["BF16"] == 16_381_470_720          # the index.json total_size
    assert report["weight_bytes"]["INT4"] == 8_190_735_360 // 2


def test_flops_are_two_per_weight_read_plus_attention():
    config = preset("qwen3-8b")
    D, V, L, H, Dh = 4096, 151936, 36, 32, 128
    norms = L * (2 * D + 2 * Dh) + D                        # RMSNorm weights scale, they do not multiply-add
    matmul_weights = 8_190_735_360 - V * D - norms          # and the embedding is a gather
    for positions in (1, 8, 40960):
        assert forward_flops(config, 1, positions) == 2 * matmul_weights + 2 * 2 * L * H * positions * Dh


@pytest.mark.slow
def test_inspect_text_shows_symbols_and_numbers():
    text = inspect_command(preset("qwen3-8b"), 7, False, "qwen3-8b")
    for expected in ("[T, H, Dh] = [7, 32, 128]", "[H, T, S] = [32, 7, 7]", "8,190,735,360", "(6.95B)",
                     "BF16 144 KiB/token", "measured here", "tokens/s", "model.layers.{i} for i = 0 .. 35"):
        assert expected in text, expected
    # Every step is listed, in the order the model runs them.
    positions = [text.index(f"  {step.short_name}  ") for step in STEPS]
    assert positions == sorted(positions)


@pytest.mark.slow
def test_inspect_json_parses_and_holds_the_same_data():
    report = json.loads(inspect_command(preset("qwen3-0.6b"), 3, True, "qwen3-0.6b"))
    assert report["parameters"]["total"] == 596_049_920
    assert [s["name"] for s in report["steps"]] == [step.name for step in STEPS]
    assert report["steps"][0]["code"] == "qwen_np.core.layers.embed"
    assert report["this_machine"]["bandwidth_bytes_per_s"] > 0
    assert set(report["this_machine"]["plans"]) == {"fp32", "bf16", "int8", "q8_0", "q4_0"}


def test_the_longest_kv_cache_that_fits_is_per_kv_dtype_and_int8_holds_qwen3_0_6b_at_131072_tokens_in_24_gib(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's figure: Qwen3-0.6B's KV cache at 131,072 tokens is 30 GB in FP32, 7.5 GB in int8."""
    monkeypatch.setattr("qwen_np.inspection.report.available_memory", lambda: 24 * 2 ** 30)
    report = inspect_report(preset("qwen3-0.6b"), 1, "qwen3-0.6b", BANDWIDTH)
    longest = report["this_machine"]["longest_kv_cache_tokens"]
    assert longest["FP32"] < 131_072 <= longest["INT8"]
    assert longest["INT8"] == pytest.approx(longest["FP32"] * 4 * 128 / 132, abs=4)   # bytes per token (each floored)
    assert "longest KV cache beside the weights kept as stored: BF16 " in render_report(report)


def test_inspect_rejects_zero_tokens():
    with pytest.raises(QwenNPError, match="^tokens: must be at least 1"):
        inspect_report(preset("qwen3-8b"), 0, "qwen3-8b", BANDWIDTH)


@pytest.fixture
def bare_config_dir(tmp_path: Path) -> Path:
    """A folder with the real Qwen3-8B config.json and no weights at all."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B_CONFIG))
    return tmp_path


@pytest.mark.slow
def test_inspect_a_bare_config_json(bare_config_dir):
    text = inspect_command(load_config(bare_config_dir), 7, False, str(bare_config_dir))
    assert "8,190,735,360" in text and "[T, V] = [7, 151936]" in text


@pytest.mark.slow
def test_cli_inspect_runs_on_a_bare_config_json_with_no_weights(bare_config_dir):
    run = subprocess.run([sys.executable, "-m", "qwen_np", "inspect", "--model", str(bare_config_dir), "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=HANG_SECONDS)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["parameters"]["total"] == 8_190_735_360


@pytest.mark.slow
def test_cli_inspect_on_a_gguf_reports_its_metadata_and_its_own_tensor_kinds_and_bytes(tmp_path: Path) -> None:
    """A Q4_K / Q6_K / Q8_0 GGUF (norms F32): the config comes from the file's metadata, and the weight bytes are
    the file's own, kind by kind (as gguf's reader counts them), not parameters x a generic width."""
    from gguf import GGUFReader

    from qwen_np.files.gguf_file import GGUFCheckpoint
    from tests.files.test_gguf import block_gguf, tiny_checkpoint

    source = tiny_checkpoint(tmp_path / "ckpt", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=64)
    path = block_gguf(source, tmp_path / "mix.gguf", kinds=["Q4_K", "Q6_K", "Q8_0"])
    tensors = GGUFReader(path).tensors
    kinds: dict[str, dict[str, int]] = {}
    for tensor in tensors:
        kind = kinds.setdefault(tensor.tensor_type.name, {"tensors": 0, "bytes": 0})
        kind["tensors"] += 1
        kind["bytes"] += int(tensor.n_bytes)
    assert set(kinds) == {"Q4_K", "Q6_K", "Q8_0", "F32"}

    def inspect(*flags: str) -> str:
        run = subprocess.run([sys.executable, "-m", "qwen_np", "inspect", "--model", str(path), *flags],
                             cwd=ROOT, capture_output=True, text=True, timeout=HANG_SECONDS)
        assert run.returncode == 0, run.stderr
        return run.stdout

    report = json.loads(inspect("--json"))
    assert report["config_source"] == "GGUF metadata"
    held = GGUFCheckpoint(path)
    weights = report["weights_file"]
    assert weights["path"] == str(path) and weights["kinds"] == kinds
    assert weights["tensor_bytes"] == sum(int(t.n_bytes) for t in tensors) < path.stat().st_size
    assert weights["held_bytes"] == round(held.held_bytes_per_value() * report["parameters"]["total"])
    assert report["memory"]["inference"]["weights"]["bf16"] == weights["held_bytes"]       # kept as stored
    assert report["this_machine"]["stored_format"] == "/".join(sorted(kinds, key=lambda k: -kinds[k]["bytes"]))
    text = inspect()
    assert "follows from config.json" not in text and "the GGUF's metadata" in text
    for kind, counted in kinds.items():
        assert re.search(rf"\n  {kind}\s+{counted['tensors']}\s+{counted['bytes'] / 2 ** 20:.2f} MiB", text), text
    assert "parameters x bytes per value" not in text


# --- The live trace ------------------------------------------------------------------------------

@pytest.fixture
def tiny_model(make_checkpoint):
    return load_model(make_checkpoint(seed=3, num_hidden_layers=3))


def test_model_trace_names_and_shapes_follow_steps(tiny_model):
    """STEPS describes what model.forward really does: same steps, same order, same shapes."""
    seen = []
    tiny_model.forward([5, 6, 7, 8], trace=lambda name, value: seen.append((name, list(value.shape))))
    dims = dimensions(tiny_model.config, 4)
    assert seen == [(name, resolve(shape, dims)) for name, shape in expanded_steps(3)]


def _rows(text: str) -> list[tuple[str, str]]:
    """(name, shape text) of every row a Tracer printed."""
    return re.findall(r"^  (\S+)\s+(\[.*?\](?: = \[.*?\])?)\s+float32", text, flags=re.MULTILINE)


def test_tracer_prints_every_step_of_every_layer_for_prompt_and_decode(tiny_model):
    out = io.StringIO()
    cache = tiny_model.new_cache(8)
    tiny_model.forward([5, 6, 7, 8], cache=cache, trace=Tracer(stream=out))
    tiny_model.forward([9], cache=cache, trace=Tracer(stream=out))
    prompt, decode = out.getvalue().split("forward pass 1: T = 1 token")
    for text, dims in ((prompt, dimensions(tiny_model.config, 4)), (decode, dimensions(tiny_model.config, 1, 5))):
        expected = [(name, f"[{', '.join(shape)}] = {resolve(shape, dims)}") for name, shape in expanded_steps(3)]
        assert _rows(text) == expected
    assert "(24 masked)" in prompt          # 4 heads x 6 (query, future key) pairs of a 4-token prompt


def test_tracer_layer_filter_keeps_only_those_layers(tiny_model):
    out = io.StringIO()
    tiny_model.forward([5, 6, 7], trace=Tracer(stream=out, layers={0, 2}))
    names = [name for name, _ in _rows(out.getvalue())]
    assert {re.match(r"model\.layers\.(\d+)", n).group(1) for n in names if n.startswith("model.layers.")} == {"0", "2"}
    assert names[0] == "model.embed_tokens" and names[-2:] == ["model.norm", "lm_head"]


def test_tracer_statistics_are_of_the_finite_values():
    out = io.StringIO()
    Tracer(stream=out)("model.layers.0.self_attn.scores", np.array([[[1.0, -np.inf], [1.0, 3.0]]], np.float32))
    row = out.getvalue().splitlines()[-1]
    assert row.split()[-5:] == ["1.667", "0.9428", "3", "(1", "masked)"]      # mean, std, max|x| of 1, 1, 3
    assert "[H, T, S] = [1, 2, 2]" in row


# --- Logit lens and attention view ---------------------------------------------------------------

def test_logit_lens_last_layer_is_the_models_own_prediction(tiny_model):
    ids = [5, 6, 7, 8, 9]
    labels, probs, final = lens_probabilities(tiny_model, ids)
    assert labels == ["embedding", "layer 0", "layer 1", "layer 2"]
    assert np.allclose(probs.sum(axis=1), 1.0, atol=1e-5)
    assert np.allclose(probs[-1], final, atol=1e-6)
    assert int(np.argmax(probs[-1])) == int(np.argmax(tiny_model.forward(ids)[-1]))
    text = logit_lens(tiny_model, ids, StubTokenizer(), top_k=3)
    rows = {line[:14].strip(): line[14:].split() for line in text.splitlines()[2:]}
    assert list(rows)[:5] == ["embedding", "layer 0", "layer 1", "layer 2", "model"]
    assert rows["layer 2"] == rows["model"]
    assert rows["model"][0] == f"'t{int(np.argmax(final))}'"


@pytest.mark.slow
def test_attention_view_shows_weights_that_sum_to_one_and_writes_a_png(tiny_model, tmp_path):
    ids = [5, 6, 7, 8, 9, 10]
    weights = attention_weights(tiny_model, ids, layer=1)                       # [H, T, T]
    assert weights.shape == (4, 6, 6)
    assert np.allclose(weights.sum(axis=-1), 1.0, atol=1e-6)
    assert np.all(np.triu(weights, 1) == 0)                                     # causal: no weight on the future
    png = tmp_path / "attention.png"
    text = attention_view(tiny_model, ids, StubTokenizer(), layer=1, head=3, png_path=str(png))
    shown = [float(v) for v in re.findall(r"^\s+\d+\s+'t\d+'\s+([0-9.]+)", text, flags=re.MULTILINE)]
    assert len(shown) == 6 and math.isclose(sum(shown), 1.0, abs_tol=0.01)
    assert np.allclose(shown, weights[3, -1], atol=5e-4)
    width, height, pixels = _read_png(png.read_bytes())
    assert width == height and width % 6 == 0 and pixels.shape == (height, width, 3)


def _read_png(data: bytes) -> tuple[int, int, np.ndarray]:
    """Decode an 8-bit RGB PNG, checking the signature and every chunk's CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, at = [], 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at:at + 4])
        kind, body = data[at + 4:at + 8], data[at + 8:at + 8 + length]
        (crc,) = struct.unpack(">I", data[at + 8 + length:at + 12 + length])
        assert crc == zlib.crc32(kind + body), kind
        chunks.append((kind, body))
        at += 12 + length
    assert [kind for kind, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    width, height, depth, colour, *_ = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, colour) == (8, 2)
    raw = np.frombuffer(zlib.decompress(chunks[1][1]), np.uint8).reshape(height, 1 + 3 * width)
    assert np.all(raw[:, 0] == 0)                                               # filter type "none"
    return width, height, raw[:, 1:].reshape(height, width, 3)


@pytest.mark.parametrize("layer, head, message", [
    (3, 0, r"^layer: 3 out of range \[0, 3\)"),
    (-1, 0, r"^layer: -1 out of range \[0, 3\)"),
    (0, 4, r"^head: 4 out of range \[0, 4\)"),
])
def test_attention_view_names_the_parameter_for_bad_layer_or_head(tiny_model, layer, head, message):
    with pytest.raises(QwenNPError, match=message):
        attention_view(tiny_model, [1, 2], StubTokenizer(), layer=layer, head=head)


def test_presets_all_inspect_in_text_and_json():
    for name, config in PRESETS.items():
        report = inspect_report(config, 2, name, BANDWIDTH)
        assert json.loads(json.dumps(report)) == report


def test_token_text_shows_the_bytes_of_a_token_that_is_part_of_a_character():
    from qwen_np.inspection import token_text
    from qwen_np.inspection.text import token_bytes
    from qwen_np.files.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(QWEN3_RANDOM)
    ids = tokenizer.encode("𓀀")                        # one character (4 UTF-8 bytes), 3 byte-level tokens
    partial = [i for i in ids if "\ufffd" in tokenizer.decode([i])]
    assert partial, "the emoji no longer splits into partial tokens"
    assert b"".join(token_bytes(tokenizer, i) for i in ids) == "𓀀".encode()
    assert all(token_text(tokenizer, i, width=40).startswith("b'\\x") for i in partial)
    assert token_text(tokenizer, tokenizer.encode(" be")[0]) == "' be'"
