"""The precision lab (qwen_np/precision/lab.py): format models, the FP32 comparison, and the `precision` command."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import qwen_np
from qwen_np import QwenNPError, preset
from qwen_np.precision import divergence, lab as precision
from qwen_np.engine import memory
from qwen_np.cli import main
from qwen_np.commands import error_line
from qwen_np.commands.comparison import format_comparison, render_comparison
from qwen_np.core.config import expected_tensors, load_config, parameter_count
from qwen_np.precision.divergence import Comparison
from qwen_np.training.evaluation import encoded_documents
from qwen_np.numbers.formats import round_trip
from qwen_np.files.tokenizer import Tokenizer
from tests.reference.logit_match import assert_logits_match, max_relative_error

ROOT = Path(__file__).resolve().parents[2]
DOCS = [np.array([1, 5, 17, 3, 88, 42, 9, 61, 0, 95, 33, 7, 70, 12, 64, 31, 2, 8]), np.array([1, 40, 41, 42, 43, 44])]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> qwen_np.Qwen3Model:
    """A tiny FP32 model whose widths are multiples of 32 (so the block formats can hold it)."""
    from tests.conftest import write_random_checkpoint

    folder = write_random_checkpoint(tmp_path_factory.mktemp("lab"), seed=5, intermediate_size=64,
                                     tie_word_embeddings=True)
    return qwen_np.load_model(folder, memory="fp32", max_tokens=64)


def test_format_model_holds_round_tripped_matrices_and_the_same_norms(base) -> None:
    model = precision.formatted_model(base, "q4_0")
    for mine, theirs in zip(model.layers, base.layers):
        np.testing.assert_array_equal(mine.down_proj, round_trip(theirs.down_proj, "q4_0"))
        assert mine.q_norm is theirs.q_norm and mine.input_layernorm is theirs.input_layernorm
    np.testing.assert_array_equal(model.embed_tokens, round_trip(base.embed_tokens, "q4_0"))
    assert model.lm_head is model.embed_tokens and model.fast
    assert model.fused_weights(0)[0] is not None                       # laid out as load_model does


def test_fp32_and_a_bf16_checkpoint_in_bf16_lose_nothing(base) -> None:
    """The checkpoint is stored in BF16, so its weights round-trip through BF16 exactly: KLD 0."""
    results = precision.compare_formats(base, DOCS, ["fp32", "bf16"], context=8)
    for stats in results.values():
        assert stats["kld_mean"] == 0 and stats["kld_max"] == 0 and stats["ppl_ratio"] == 1
        assert stats["same_top_percent"] == 100 and stats["positions"] == sum(len(d) - 1 for d in DOCS)


def test_coarser_formats_move_the_predictions_further(base) -> None:
    results = precision.compare_formats(base, DOCS, ["fp16", "int8", "q4_0"], context=8)
    klds = [results[fmt]["kld_mean"] for fmt in ("fp16", "int8", "q4_0")]
    # FP16 holds these BF16 weights almost exactly, so its KLD is zero up to float64 rounding, of either sign.
    assert -divergence.KLD_ROUNDING <= klds[0] < klds[1] < klds[2] and results["q4_0"]["delta_p_rms_percent"] > 0


def test_the_lab_int8_model_is_the_int8_memory_mode(base, tmp_path) -> None:
    from tests.conftest import write_random_checkpoint

    folder = write_random_checkpoint(tmp_path / "c", seed=5, intermediate_size=64, tie_word_embeddings=True)
    int8 = qwen_np.load_model(folder, memory="int8", max_tokens=64).forward(DOCS[0])
    lab = precision.formatted_model(base, "int8").forward(DOCS[0])
    assert_logits_match(int8, lab, "int8 memory mode vs the lab's int8")


def test_comparison_in_chunks_equals_one_comparison_of_the_whole_window(base, monkeypatch) -> None:
    other = precision.formatted_model(base, "int8")
    whole = Comparison()
    whole.add(base.forward(DOCS[0][:-1]), other.forward(DOCS[0][:-1]), DOCS[0][1:])
    monkeypatch.setattr(precision, "CHUNK_VALUES", 3 * base.config.vocab_size)      # 3 rows per chunk
    chunked = precision.compare(base, other, DOCS[:1], context=64)
    assert chunked.summary() == pytest.approx(whole.summary(), rel=1e-12, abs=1e-15)


def test_an_fp32_kv_cache_loses_nothing_and_an_int8_one_moves_the_predictions_a_little(base) -> None:
    """The FP32 cache reads back the keys as computed: KLD 0 to the bit. int8 (a scale per position and head):
    measured 5e-5 nats mean on the bundled model; more on this random one's flat predictions, still small."""
    results = precision.compare_kv_dtypes(base, DOCS, ["fp32", "int8"], context=8)
    assert results["fp32"]["kld_max"] == 0 and results["fp32"]["ppl_ratio"] == 1
    assert 0 < results["int8"]["kld_mean"] < 1e-3 and results["int8"]["positions"] == sum(len(d) - 1 for d in DOCS)
    with pytest.raises(QwenNPError, match="^kv_dtypes: unknown format 'q4'"):
        precision.compare_kv_dtypes(base, DOCS, ["q4"], context=8)


def test_fp16_residual_overflow_is_counted_and_bf16_holds_it(base) -> None:
    """Scale the embedding so the residual stream exceeds FP16's 65504: FP16 makes inf, BF16 does not."""
    loud = precision.formatted_model(base, "fp32")
    loud.embed_tokens = loud.embed_tokens * np.float32(1e6)
    ranges = precision.ActivationRanges(base.config.num_hidden_layers)
    loud.forward(DOCS[0], trace=ranges)
    assert ranges.residual[0] > precision.FP16_MAX and ranges.any[0] >= ranges.residual[0]
    fp16, bf16 = precision.RoundedResidual(loud, "fp16"), precision.RoundedResidual(loud, "bf16")
    assert not np.isfinite(fp16.forward(DOCS[0])).all() and fp16.nonfinite > 0
    assert np.isfinite(bf16.forward(DOCS[0])).all() and bf16.nonfinite == 0


def test_rounding_the_residual_to_bf16_moves_the_logits_a_little(base) -> None:
    rounded = precision.RoundedResidual(base, "bf16").forward(DOCS[0])
    exact = base.forward(DOCS[0])
    assert 1e-6 < max_relative_error(rounded, exact) < 1e-1


def test_scored_documents_keep_the_first_tokens_and_refuse_a_text_shorter_than_a_window() -> None:
    kept = precision.scored_documents(DOCS, context=8, max_tokens=20)
    assert sum(len(d) - 1 for d in kept) == 20 and np.array_equal(kept[0], DOCS[0])
    with pytest.raises(QwenNPError, match=r"text: the text has 23 tokens, shorter than one window of 30"):
        precision.scored_documents(DOCS, context=30, max_tokens=None)


def test_unknown_format_and_a_shape_the_format_cannot_hold_name_the_parameter(base, make_checkpoint) -> None:
    with pytest.raises(QwenNPError, match="^formats: unknown format 'int3'; expected one of fp32"):
        precision.compare_formats(base, DOCS, ["int3"], context=8)
    narrow = qwen_np.load_model(make_checkpoint(intermediate_size=48), memory="fp32", max_tokens=16)
    with pytest.raises(QwenNPError, match=r"^formats: q4_0 cannot hold model\.layers\.0\.mlp\.down_proj\.weight"):
        precision.compare_formats(narrow, DOCS, ["q4_0"], context=8)


def test_a_model_too_big_to_hold_twice_in_fp32_is_refused_before_loading(make_checkpoint, monkeypatch) -> None:
    monkeypatch.setattr("qwen_np.engine.memory.available_memory", lambda: 1024)
    with pytest.raises(QwenNPError, match=r"^folder: comparing holds the model in FP32 twice"):
        precision.load_reference(make_checkpoint(), context=16)


def test_weight_bytes_count_matrices_in_the_format_and_norms_in_fp32() -> None:
    config = preset("qwen3-8b")
    norms = sum(shape[0] for shape in expected_tensors(config).values() if len(shape) == 1)
    matrices = parameter_count(config) - norms
    assert memory.weight_bytes(config, "bf16") == 2 * matrices + 4 * norms
    assert memory.weight_bytes(config, "q4_0") == matrices * 9 // 16 + 4 * norms
    assert 16.3 < memory.weight_bytes(config, "fp16") / 1e9 < 16.4


@pytest.mark.slow
def test_precision_command_json_has_one_row_per_format(tmp_path, capsys) -> None:
    text = tmp_path / "text.txt"
    text.write_text(precision.PASSAGE)
    png = tmp_path / "kld.png"
    code = main(["precision", "--formats", "fp32,int8,q4_0", "--text", str(text), "--context", "32",
                 "--max-tokens", "40", "--activations", "bf16", "--png", str(png), "--kv-dtypes", "int8", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    report = json.loads(out)
    assert [row["format"] for row in report["rows"]] == ["fp32", "int8", "q4_0"]
    assert all(row["positions"] == 40 and row["continuation"] and row["residual_nonfinite"] == 0 for row in report["rows"])
    assert report["rows"][0]["bits_per_weight"] == 32 and report["rows"][2]["layout"] == "32 x int4 + FP16"
    layers = load_config(ROOT / "weights").num_hidden_layers       # the bundled model's: one row per layer
    assert len(report["layers"]) == layers and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    [kv] = report["kv_rows"]
    assert kv["kv_dtype"] == "int8" and kv["positions"] == 40 and kv["bytes_per_token_qwen3_8b"] == 2 * 36 * 8 * 132


@pytest.mark.parametrize("args, flag", [
    (["--formats", "fp32,int3"], "--formats: unknown format 'int3'"),
    (["--text", "/no/such/file"], "/no/such/file: no such file"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--activations", "int8"], "--activations"),
    (["--kv-dtypes", "q4"], "--kv-dtypes"),
])
def test_precision_bad_input_is_one_line_naming_the_flag(args, flag, capsys) -> None:
    try:
        code = main(["precision", *args])
    except SystemExit as exit:                                   # argparse's own checks (choices)
        code = exit.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and flag in err[0]


def test_precision_refuses_a_text_shorter_than_one_window(tmp_path, capsys) -> None:
    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be.")
    assert main(["precision", "--text", str(short), "--formats", "fp32"]) == 2
    assert "--text: the text has" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_compare_prints_every_format_against_fp32(capsys) -> None:
    docs, _ = encoded_documents(Tokenizer.from_folder(ROOT / "weights"), precision.PASSAGE)
    table = render_comparison(format_comparison(ROOT / "weights", docs[:1], 64, ["fp32", "fp8_e4m3"]))
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["format", "PPL", "PPL/FP32"] and lines[1].startswith("fp32")
    assert lines[2].startswith("fp8_e4m3") and "over" in lines[-1]
    with pytest.raises(QwenNPError) as refused:
        format_comparison(ROOT / "weights", docs, 64, ["fp7"])
    assert error_line(refused.value).startswith("--compare: unknown format")
