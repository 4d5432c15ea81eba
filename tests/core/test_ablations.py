"""The ablations (config.ABLATION_CHOICES): each takes away the piece it names and nothing else, a Qwen3 config
is unchanged by them, an ablated run trains, saves and loads, and the walkthrough's recorded ablation runs
still come out of the code. Their backward is checked by finite differences in tests/training/test_gradients.py."""

from __future__ import annotations

import ast
import inspect
import json
import math
import textwrap
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT, TINY_CONFIG
from qwen_np import QwenNPError, load_model
from qwen_np.core import layers
from qwen_np.core.ablations import AblatedModel, model_class
from qwen_np.core.config import ABLATION_CHOICES, Qwen3Config, expected_tensors, parameter_count
from qwen_np.core.model import Qwen3Model
from qwen_np.engine.fast import FastQwen3Model
from qwen_np.training import data, trainer, parameters, run_spec, run_state
from qwen_np.training.settings import PRESET_CONFIGS

sys.path.insert(0, str(ROOT / "tools" / "walkthrough"))

SMALL = dict(vocab_size=31, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=32)
IDS = [3, 17, 5, 29, 11, 2, 23, 8]


def model_of(rope_theta: float = 1e4, seed: int = 0, **ablation):
    """A small model with random weights of unit-ish size (norm weights away from 1), so every piece matters."""
    config = Qwen3Config(**{**SMALL, **ablation}, rope_theta=rope_theta)
    rng = np.random.default_rng(seed)
    params = {name: (p + (0.2 if p.ndim == 1 else 0.3) * rng.standard_normal(p.shape)).astype(np.float32)
              for name, p in parameters.init_parameters(config, seed).items()}
    return parameters.model_from_parameters(config, params)


def traced(model, ids=IDS) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    notes: dict[str, np.ndarray] = {}
    logits = model.forward(ids, trace=lambda name, value: notes.__setitem__(name, value))
    return logits, notes


def test_qwen3_is_unchanged_by_the_ablation_fields():
    """Absent, every field is Qwen3's; a Qwen3 config writes none of them (config.json stays transformers')."""
    config = Qwen3Config.from_dict(TINY_CONFIG)
    assert config.ablations == {} and not set(config.to_dict()) & set(ABLATION_CHOICES)
    ablated = Qwen3Config.from_dict({**TINY_CONFIG, "use_rope": False, "mlp_type": "gelu"})
    assert ablated.ablations == {"use_rope": False, "mlp_type": "gelu"}
    assert Qwen3Config.from_dict({**ablated.to_dict(), "model_type": "qwen3"}) == ablated


def test_an_ablated_model_with_every_choice_at_qwen3s_value_is_qwen3():
    """AblatedModel's layer is Qwen3's where they coincide: same logits and the same notes, bit for bit, as the
    pure Qwen3Model on the same weights; a config picks Qwen3Model unless it asks for an ablation."""
    qwen3 = model_of()
    assert type(qwen3) is model_class(qwen3.config) is not AblatedModel
    ablated = AblatedModel(qwen3.config, qwen3.embed_tokens, qwen3.layers, qwen3.norm, qwen3.lm_head)
    (logits, notes), (ablated_logits, ablated_notes) = traced(qwen3), traced(ablated)
    assert np.array_equal(logits, ablated_logits) and list(notes) == list(ablated_notes)
    assert all(np.array_equal(notes[name], ablated_notes[name]) for name in notes)
    assert type(model_of(use_rope=False)) is AblatedModel


def test_qwen3s_layer_is_short_and_makes_no_ablation_choice():
    """A student holds Qwen3's layer in view: at most 16 lines of code, each under 100 characters, and not one
    of them an ablation's choice (no branch, no ablation field: those are AblatedModel's)."""
    source = textwrap.dedent(inspect.getsource(Qwen3Model.decoder_layer))
    body = ast.parse(source).body[0].body[1:]                          # the statements after the docstring
    code = [line for line in source.splitlines()[body[0].lineno - 1:] if not line.strip().startswith("#")]
    assert len(code) <= 16 and all(len(line) + 4 < 100 for line in source.splitlines())
    assert not [node for node in ast.walk(ast.Module(body, [])) if isinstance(node, (ast.If, ast.IfExp))]
    assert not [word for word in (*ABLATION_CHOICES, "norm_position", "ablations") if word in "\n".join(code)]


def test_qwen3model_refuses_an_ablations_config():
    ablated = model_of(norm_position="post")
    with pytest.raises(QwenNPError, match="computes Qwen3 only"):
        Qwen3Model(ablated.config, ablated.embed_tokens, ablated.layers, ablated.norm, ablated.lm_head)


def test_without_rope_the_logits_do_not_depend_on_rope_theta():
    ids = IDS
    assert np.array_equal(model_of(1e2, use_rope=False).forward(ids), model_of(1e6, use_rope=False).forward(ids))
    assert not np.allclose(model_of(1e2).forward(ids), model_of(1e6).forward(ids))      # with RoPE they do


def test_without_rope_one_layer_cannot_tell_the_order_of_the_earlier_tokens():
    """Attention without RoPE is a weighted average over a set of keys: the last token's prediction is the same
    for any order of the tokens before it. Only the causal mask (which tokens are visible) carries order, so
    deeper layers learn position from it (earlier positions see fewer tokens)."""
    shuffled = [IDS[i] for i in (4, 0, 6, 2, 5, 1, 3)] + IDS[-1:]
    one_layer = {"num_hidden_layers": 1}
    for rope, same in ((False, True), (True, False)):
        config = Qwen3Config(**{**SMALL, **one_layer}, use_rope=rope)
        params = {n: p + 0.3 * np.random.default_rng(1).standard_normal(p.shape).astype(np.float32)
                  for n, p in parameters.init_parameters(config, 1).items()}
        model = parameters.model_from_parameters(config, params)
        last, last_shuffled = model.forward(IDS, last_only=True), model.forward(shuffled, last_only=True)
        assert np.allclose(last, last_shuffled, rtol=1e-5, atol=1e-5) == same


def test_without_qk_norm_the_layer_has_no_q_norm_or_k_norm():
    model = model_of(use_qk_norm=False)
    assert not any(name.endswith(("q_norm.weight", "k_norm.weight")) for name in expected_tensors(model.config))
    _, notes = traced(model)
    assert np.array_equal(notes["model.layers.0.self_attn.rope_q"],       # RoPE of q_proj's output itself
                          layers.rope(notes["model.layers.0.self_attn.q_proj"], *rope_tables(model.config)))
    assert not any(name.endswith("q_norm") for name in notes)


def rope_tables(config: Qwen3Config) -> tuple[np.ndarray, np.ndarray]:
    return layers.rope_angles(layers.rope_inverse_frequencies(config.head_dim, config.rope_theta), np.arange(len(IDS)))


def test_without_residuals_each_block_replaces_the_stream():
    _, notes = traced(model_of(use_residual=False))
    for i in range(SMALL["num_hidden_layers"]):
        assert np.array_equal(notes[f"model.layers.{i}.residual_attn"], notes[f"model.layers.{i}.self_attn.o_proj"])
        assert np.array_equal(notes[f"model.layers.{i}.residual_mlp"], notes[f"model.layers.{i}.mlp.down_proj"])


def test_post_norm_normalizes_after_each_residual_sum_and_not_before_a_block():
    model = model_of(norm_position="post")
    _, notes = traced(model)
    eps = model.config.rms_norm_eps
    layer_input = notes["model.embed_tokens"]
    for i, w in enumerate(model.layers):
        at = f"model.layers.{i}."
        assert np.array_equal(notes[at + "input_layernorm"], layer_input)               # attention reads x itself
        after_attention = layers.rms_norm(notes[at + "residual_attn"], w.input_layernorm, eps)
        assert np.array_equal(notes[at + "post_norm_attn"], after_attention)
        assert np.array_equal(notes[at + "post_attention_layernorm"], after_attention)  # the MLP reads it
        assert np.allclose(notes[at + "residual_mlp"], after_attention + notes[at + "mlp.down_proj"])
        layer_input = notes[at + "post_norm_mlp"]
        assert np.array_equal(layer_input, layers.rms_norm(notes[at + "residual_mlp"], w.post_attention_layernorm, eps))


def test_gelu_mlp_at_one_and_a_half_f_has_swiglus_parameters_and_no_gate():
    swiglu = Qwen3Config(**SMALL)
    gelu = Qwen3Config(**{**SMALL, "intermediate_size": SMALL["intermediate_size"] * 3 // 2}, mlp_type="gelu")
    assert parameter_count(gelu) == parameter_count(swiglu)
    assert not any("gate_proj" in name for name in expected_tensors(gelu))
    _, notes = traced(model_of(mlp_type="gelu"))
    assert np.array_equal(notes["model.layers.0.mlp.act_fn"], layers.gelu(notes["model.layers.0.mlp.up_proj"]))


def test_gelus_tanh_form_is_within_a_thousandth_of_the_exact_one():
    x = np.linspace(-6, 6, 241)
    exact = 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    assert np.abs(layers.gelu(x) - exact).max() < 1e-3


def test_mqa_and_mha_are_num_key_value_heads():
    """One KV head (MQA) and one per query head (MHA) run; a KV head's keys serve its whole group of query heads."""
    for kv_heads in (1, SMALL["num_attention_heads"]):
        model = model_of(num_key_value_heads=kv_heads)
        _, notes = traced(model)
        assert notes["model.layers.0.self_attn.k_proj"].shape == (len(IDS), kv_heads, SMALL["head_dim"])


@pytest.mark.slow
def test_the_fast_path_refuses_an_ablation_and_load_model_runs_it_readable(tmp_path: Path):
    """An ablated run trains, checkpoints and exports (config.json keeps the fields; transformers would not
    load it: it knows none of them), and load_model gives it the readable path, which the fast one refuses."""
    config_json = {**PRESET_CONFIGS["tiny"], "use_rope": False, "mlp_type": "gelu"}
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    text = tmp_path / "text.txt"
    text.write_text("".join(data.shakespeare_plays()["hamlet"].splitlines(keepends=True)[:400]), encoding="utf-8")
    result = trainer.run(run_spec.RunSpec(out=tmp_path / "run", config=tmp_path / "config.json", data=str(text),
                                         overrides={"steps": 2, "batch_size": 2, "context": 16, "eval_every": 2,
                                                    "warmup": 1}))
    exported = result.exported
    assert exported is not None
    saved = json.loads((exported / "config.json").read_text())
    assert saved["use_rope"] is False and saved["mlp_type"] == "gelu"
    params = run_state.load_state(result.last)[0]
    assert not any("gate_proj" in name for name in params)
    model = load_model(exported, memory="fp32")
    assert not model.fast and model.config.ablations == {"use_rope": False, "mlp_type": "gelu"}
    assert np.isfinite(model.forward([1, 2, 3])).all()
    with pytest.raises(QwenNPError, match="the fast path computes Qwen3 only"):
        FastQwen3Model(model.config, model.embed_tokens, model.layers, model.norm, model.lm_head)


@pytest.mark.slow
def test_recorded_ablation_runs_repeat_their_first_steps():
    """The walkthrough's ablation chapter is recorded (dozens of runs, most of an hour): a few variants' first steps,
    each at another seed, and the order task's must still come out of the code, to rtol 1e-3 (the record's 4
    digits, and the BLAS kernel's last bits)."""
    import walkthrough_chapter_ablations as chapter

    chapter.check_first_steps(chapter.load_record())        # raises naming the variant, the seed and the step


def test_the_ablation_record_holds_every_variant_at_every_seed():
    """The chapter reads a difference against the seeds' spread: every variant of both tasks needs all of them."""
    import walkthrough_chapter_ablations as chapter

    rec = chapter.load_record()
    assert len(rec["seeds"]) >= 3
    for runs, variants in ((rec["runs"], chapter.VARIANTS), (rec["copy_task"]["runs"], chapter.COPY_VARIANTS)):
        assert sorted((r["key"], r["seed"]) for r in runs) == sorted((v["key"], s) for v in variants for s in rec["seeds"])


def test_copy_rows_repeat_distinct_ids_after_a_separator_and_only_the_copy_is_learned():
    import walkthrough_chapter_ablations as chapter

    rows = chapter.copy_rows(np.random.default_rng(0), 5, 6)                       # [5, 13]
    first, separator, second = rows[:, :6], rows[:, 6], rows[:, 7:]
    assert np.array_equal(first, second) and (separator == chapter.SEPARATOR).all()
    assert all(len(set(row)) == 6 and chapter.SEPARATOR not in row for row in first)
    learned = chapter.copy_targets(rows)
    assert learned.shape == rows.shape and not learned[:, :7].any() and learned[:, 7:].all()


class _Oracle:
    """A stand-in model whose logits at each position peak on the row's token `ahead` positions later."""

    def __init__(self, rows: np.ndarray, ahead: int):
        self.rows, self.ahead = rows, ahead

    def forward_batch(self, token_ids, caches):
        T, V = self.rows.shape[1] - 1, 512
        logits = np.zeros((len(token_ids), T, V), np.float32)
        for b, ids in enumerate(token_ids):
            assert np.array_equal(ids, self.rows[b, :-1])
            logits[b, np.arange(T), self.rows[b, self.ahead:T + self.ahead]] = 30.0
        return logits.reshape(-1, V)


def test_copy_scores_grade_the_next_token_of_the_copy():
    """A model that predicts each next token scores the copy perfectly; one that repeats the token it reads (the
    off-by-one) gets none of it right."""
    import walkthrough_chapter_ablations as chapter

    rows = chapter.copy_rows(np.random.default_rng(1), 4, 8)
    right, repeat = chapter.copy_scores(_Oracle(rows, 1), rows), chapter.copy_scores(_Oracle(rows, 0), rows)
    assert right["accuracy"] == 1.0 and right["loss"] < 1e-6
    assert repeat["accuracy"] == 0.0 and repeat["loss"] > 20


def test_a_difference_is_read_only_where_the_seeds_do_not_overlap():
    import walkthrough_chapter_ablations as chapter

    assert chapter.apart([3.9, 4.0, 3.95], [4.01, 4.1, 4.05]) and chapter.apart([4.2, 4.3], [3.0, 3.1])
    assert not chapter.apart([3.9, 4.0, 3.95], [4.0, 4.1, 4.05])           # touching: one seed of each alike
    assert not chapter.apart([3.9, 4.2], [4.0, 4.1])
