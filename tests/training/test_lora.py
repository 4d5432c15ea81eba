"""LoRA (qwen_np/training/lora.py): the adapter's math and backward against finite differences and torch + peft."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from qwen_np.core import layers
from qwen_np.core.config import LAYER_MATRICES, Qwen3Config
from qwen_np.engine.loading import load_model
from qwen_np.files.adapter import PEFT_PREFIX
from qwen_np.errors import QwenNPError
from qwen_np.numbers.numerics import Adapted, upcast
from qwen_np.training import gradients, lora
from qwen_np.training.step import loss_and_gradients
from qwen_np.training.parameters import init_parameters, model_from_parameters
from tests.reference.finite_differences import central_difference

MICRO = dict(vocab_size=13, hidden_size=8, intermediate_size=12, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=4, max_position_embeddings=16)


def random_adapter(rng: np.random.Generator, out: int, inp: int, rank: int, dtype: type = np.float64) -> Adapted:
    """An adapter with B nonzero too (a fresh one's B is zero, which would leave dA zero and untested)."""
    return Adapted(rng.standard_normal((out, inp)).astype(dtype), rng.standard_normal((rank, inp)).astype(dtype),
                   rng.standard_normal((out, rank)).astype(dtype), scale=0.75)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_the_adapter_backward_matches_float64_central_differences(dropout: float) -> None:
    """dx, dA and dB of y = x W^T + s (drop(x) A^T) B^T for L = <y, g>, every entry; W gets none."""
    rng = np.random.default_rng(0)
    weight = random_adapter(rng, out=5, inp=6, rank=3)
    x, g = rng.standard_normal((2, 4, 6)), rng.standard_normal((2, 4, 5))
    keep = (rng.random(x.shape) > dropout).astype(np.float64) if dropout else None

    def loss() -> float:
        return float(np.vdot(x @ weight.base.T + lora.adapter_forward(x, weight, keep, dropout), g))

    dx_adapter, d = lora.adapter_backward(g, x, weight, keep, dropout)
    dx = dx_adapter + gradients.input_gradient(g, weight.base)
    for ours, p in ((d.a, weight.a), (d.b, weight.b), (dx, x)):
        numeric = central_difference(loss, p)
        assert np.abs(ours - numeric).max() <= 1e-7 * max(1.0, np.abs(numeric).max())


def test_linear_of_an_adapted_weight_is_the_merged_weights_product() -> None:
    """layers.linear's two thin products equal x (W + s B A)^T, which widen() (merging) forms."""
    rng = np.random.default_rng(1)
    weight = random_adapter(rng, out=7, inp=5, rank=2, dtype=np.float32)
    x = rng.standard_normal((3, 5)).astype(np.float32)
    merged = upcast(weight)
    assert np.allclose(merged, weight.base + 0.75 * weight.b @ weight.a, atol=1e-6)
    assert np.allclose(layers.linear(x, weight), x @ merged.T, atol=1e-5)
    assert np.array_equal(upcast(weight[2:5]), merged[2:5])


def micro_model(seed: int, tied: bool = False):
    config = Qwen3Config(**MICRO, tie_word_embeddings=tied, rope_theta=100.0)
    rng = np.random.default_rng(seed)
    params = {n: (p.astype(np.float64) + (0.3 if p.ndim == 1 else 0.25) * rng.standard_normal(p.shape))
              for n, p in init_parameters(config, seed=seed).items()}
    return model_from_parameters(config, params), rng


@pytest.mark.slow
@pytest.mark.parametrize("targets", [LAYER_MATRICES, ("q_proj", "down_proj")])
def test_the_networks_adapter_gradients_match_float64_central_differences(targets: tuple[str, ...]) -> None:
    """Through the whole network (adapters on some or all projections): every adapter weight's gradient,
    and no gradient for any frozen tensor."""
    model, rng = micro_model(4)
    lora.add_adapters(model, rank=2, alpha=3.0, targets=targets, seed=4)
    params = lora.adapter_parameters(model)
    for name, p in params.items():                     # float64 for the differences; B nonzero
        p[...] = rng.standard_normal(p.shape) * 0.3 if ".lora_B." in name else p
    for layer in model.layers:
        for key in LAYER_MATRICES:
            w = getattr(layer, key)
            if isinstance(w, Adapted):
                setattr(layer, key, Adapted(w.base, w.a.astype(np.float64), w.b.astype(np.float64), w.scale))
    params = lora.adapter_parameters(model)
    batch = rng.integers(0, 13, size=(2, 6))
    _, grads = loss_and_gradients(model, batch)
    assert sorted(grads) == sorted(params) and len(params) == 2 * 2 * len(targets)

    def loss() -> float:
        return gradients.cross_entropy(gradients.forward_with_tape(model, batch[:, :-1])[0], batch[:, 1:])[0]

    for name, p in params.items():
        numeric = central_difference(loss, p)
        assert np.abs(grads[name] - numeric).max() <= 1e-7 * max(1.0, np.abs(numeric).max()), name


def test_fresh_adapters_leave_the_model_unchanged_and_the_fast_path_agrees(make_checkpoint) -> None:
    """B = 0 at the start: the adapted model's logits are the base's. With B trained (random here), the fast
    path (load_model's default) gives the readable path's logits, prefill and a cached decode step."""
    folder = make_checkpoint(dtype="F32")
    ids = np.arange(1, 12) % 96
    fast, readable = load_model(folder, memory="fp32"), load_model(folder, memory="fp32", fast=False)
    assert fast.fast and not readable.fast
    before = readable.forward(ids)
    for model in (fast, readable):
        lora.add_adapters(model, rank=4, seed=1)
    assert np.array_equal(readable.forward(ids), before)
    rng = np.random.default_rng(2)
    for name, b in lora.adapter_parameters(readable).items():
        if ".lora_B." in name:
            b[...] = rng.standard_normal(b.shape).astype(np.float32) * 0.05
    for (_, ours), (_, theirs) in zip(lora.adapter_parameters(fast).items(), lora.adapter_parameters(readable).items()):
        ours[...] = theirs
    expected = readable.forward(ids)
    assert np.abs(expected - before).max() > 1e-3, "the trained adapters change the logits"
    assert np.allclose(fast.forward(ids), expected, rtol=1e-5, atol=1e-5)
    cache = fast.new_cache(32)
    fast.forward(ids[:-1], cache)
    assert np.allclose(fast.forward(ids[-1:], cache), expected[-1:], rtol=1e-5, atol=1e-5)


def test_adapters_on_a_bf16_base_train_without_widening_the_model(make_checkpoint) -> None:
    """QLoRA's idea: the frozen base stays as the checkpoint stores it (BF16 here); the adapters' gradients
    are those of the same model held in FP32."""
    folder = make_checkpoint()
    batch = np.random.default_rng(3).integers(0, 96, size=(2, 9))
    results = []
    for memory in ("bf16", "fp32"):
        model = load_model(folder, memory=memory, fast=False)
        lora.add_adapters(model, rank=2, seed=3)
        results.append(loss_and_gradients(model, batch))
    (loss16, grads16), (loss32, grads32) = results
    assert abs(loss16 - loss32) <= 1e-6 * loss32 and sorted(grads16) == sorted(grads32)
    for name in grads32:
        assert np.allclose(grads16[name], grads32[name], rtol=1e-4, atol=1e-7), name


def test_bad_adapter_settings_name_the_parameter(make_checkpoint) -> None:
    model = load_model(make_checkpoint(dtype="F32"), memory="fp32")
    with pytest.raises(QwenNPError, match="^rank:"):
        lora.add_adapters(model, rank=0)
    with pytest.raises(QwenNPError, match="^targets:.*qkv"):
        lora.add_adapters(model, rank=2, targets=("qkv",))
    lora.add_adapters(model, rank=2)
    with pytest.raises(QwenNPError, match="already has adapters"):
        lora.add_adapters(model, rank=2)


@pytest.mark.slow
def test_loss_and_every_adapter_gradient_match_torch_and_peft(tmp_path: Path) -> None:
    """The same base weights and the same A and B in transformers + peft (LoraConfig, all seven projections):
    loss and every lora_A / lora_B gradient within 1e-5 (relative to max(1, max|reference|))."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from tests.reference.hf_reference import build_reference_model, make_config, save_bf16_checkpoint

    config = make_config(vocab_size=64, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=3, head_dim=10, tie_word_embeddings=False)
    save_bf16_checkpoint(build_reference_model(config, seed=6), tmp_path)
    reference = build_reference_model(config, seed=6)     # afresh: a model taken to BF16 and back has lost its
                                                          # RoPE frequencies' low bits (a buffer, not a weight)
    model = load_model(tmp_path, memory="fp32")
    lora.add_adapters(model, rank=4, alpha=6.0, seed=6)
    rng = np.random.default_rng(6)
    ours = lora.adapter_parameters(model)
    for name, p in ours.items():
        if ".lora_B." in name:
            p[...] = rng.standard_normal(p.shape).astype(np.float32) * 0.1
    tuned = peft.get_peft_model(reference, peft.LoraConfig(r=4, lora_alpha=6.0, lora_dropout=0.0,
                                                           target_modules=list(LAYER_MATRICES)))
    theirs = {n.removeprefix("base_model.model.").replace(".default", ""): p
              for n, p in tuned.named_parameters() if p.requires_grad}
    assert sorted(theirs) == sorted(ours), "peft's names for Qwen3, less its base_model.model. prefix"
    with torch.no_grad():
        for name, p in theirs.items():
            p.copy_(torch.from_numpy(ours[name]))
    batch = rng.integers(0, 64, size=(3, 11))
    ids = torch.from_numpy(batch)
    tuned.train()
    torch_loss = tuned(input_ids=ids, labels=ids).loss
    torch_loss.backward()
    loss, grads = loss_and_gradients(model, batch)
    assert abs(loss - torch_loss.item()) <= 1e-6 * torch_loss.item()
    assert sorted(grads) == sorted(ours)
    for name, p in theirs.items():
        reference_grad = p.grad.numpy().astype(np.float64)
        error = np.abs(grads[name] - reference_grad).max() / max(1.0, np.abs(reference_grad).max())
        assert error <= 1e-5, name


@pytest.mark.slow
def test_the_adapter_loads_in_peft_and_gives_the_merged_models_greedy_text(tmp_path: Path) -> None:
    """save_adapter's folder in peft.PeftModel.from_pretrained on the base, the merged FP32 checkpoint in
    transformers and in qwen_np: one greedy continuation, not the base's (the adapters change it)."""
    import shutil

    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from tests.conftest import QWEN3_RANDOM

    model = load_model(QWEN3_RANDOM, memory="fp32")
    lora.add_adapters(model, rank=4, alpha=8.0, targets=("q_proj", "v_proj", "gate_proj", "down_proj"), seed=7)
    rng = np.random.default_rng(7)
    for name, p in lora.adapter_parameters(model).items():     # "trained": B moved away from zero
        if ".lora_B." in name:
            p[...] = rng.standard_normal(p.shape).astype(np.float32) * 0.5
    lora.save_adapter(tmp_path / "adapter", model, base=str(QWEN3_RANDOM))
    config_json = json.loads((QWEN3_RANDOM / "config.json").read_text())
    lora.save_merged(tmp_path / "model", model, config_json)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(QWEN3_RANDOM / name, tmp_path / "model" / name)

    prompt = torch.tensor([[151644, 872, 198, 9707, 0, 151645, 198, 151644, 77091, 198]])

    def greedy(hf_model) -> list[int]:
        with torch.inference_mode():
            out = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                    max_new_tokens=12, pad_token_id=151643, eos_token_id=None)
        return out[0, prompt.shape[1]:].tolist()

    def hf(folder: Path):
        return transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                             attn_implementation="eager").eval()

    base_text = greedy(hf(QWEN3_RANDOM))
    tuned = peft.PeftModel.from_pretrained(hf(QWEN3_RANDOM), tmp_path / "adapter").eval()
    loaded = {n.replace(".default", "") for n, _ in tuned.named_parameters() if "lora_" in n}
    assert loaded == {PEFT_PREFIX + n for n in lora.adapter_parameters(model)}
    peft_text = greedy(tuned)
    assert peft_text != base_text, "the adapters must change the greedy text for this test to mean anything"
    assert greedy(hf(tmp_path / "model")) == peft_text
    ours, cache = [], None
    merged = load_model(tmp_path / "model", memory="fp32")
    cache = merged.new_cache(64)
    logits = merged.forward(prompt[0].numpy(), cache, last_only=True)
    for _ in range(12):
        ours.append(int(np.argmax(logits[-1])))
        logits = merged.forward([ours[-1]], cache)
    assert ours == peft_text
    adapted_logits = model.forward(prompt[0].numpy())                   # unmerged, through layers.linear
    assert int(np.argmax(adapted_logits[-1])) == peft_text[0]


def test_the_assistant_only_loss_is_the_batch_mean_over_learned_tokens_however_the_batch_is_cut() -> None:
    """learned [B, T+1]: the loss is the mean NLL over the learned targets of the whole batch, and the same
    loss and gradients come from one piece, two micro-batches, or two micro-batches of two shards."""
    from qwen_np.training.evaluation import token_nll
    from qwen_np.training.step import loss_and_accumulated_gradients

    model, rng = micro_model(5)
    lora.add_adapters(model, rank=2, seed=5)
    for p in lora.adapter_parameters(model).values():
        p[...] = rng.standard_normal(p.shape) * 0.3
    batch = rng.integers(0, 13, size=(4, 8))
    learned = rng.random((4, 8)) < 0.4
    learned[0] = False                                           # a row with nothing to learn (weighs nothing)
    nll = np.stack([token_nll(model.forward(row[:-1]), row[1:]) for row in batch])          # [B, T]
    expected = float(nll[learned[:, 1:]].mean())
    results = [loss_and_accumulated_gradients(model, batch, micro, shards=shards, learned=learned)
               for micro, shards in ((1, 1), (2, 1), (2, 2))]
    for loss, grads in results:
        assert abs(loss - expected) <= 1e-9 * expected
        for name, g in grads.items():
            assert np.allclose(g, results[0][1][name], rtol=1e-9, atol=1e-12), name
    unmasked, _ = loss_and_accumulated_gradients(model, batch, 1)
    assert abs(unmasked - float(nll.mean())) <= 1e-9 * unmasked, "no mask: every token, as before"


def test_dropout_in_the_training_step_is_the_same_mask_forward_and_backward() -> None:
    """loss_and_gradients with LoRA dropout: every adapter gradient is the central difference of the loss under
    the same masks (the backward draws the forward's mask again), the same with --recompute, a piece of its own
    drops differently, and inference (no dropout set) drops nothing."""
    model, rng = micro_model(8)
    lora.add_adapters(model, rank=2, seed=8)
    for layer in model.layers:                         # float64 adapters, B nonzero: central differences to 1e-6
        for key in LAYER_MATRICES:
            w = getattr(layer, key)
            setattr(layer, key, Adapted(w.base, 0.3 * rng.standard_normal(w.a.shape), 0.3 * rng.standard_normal(w.b.shape),
                                        w.scale))
    params = lora.adapter_parameters(model)
    batch = rng.integers(0, 13, size=(2, 7))
    dropout = lora.Dropout.of(model, 0.4, (8, 0))
    loss, grads = loss_and_gradients(model, batch, dropout=dropout)
    for name in ("model.layers.0.self_attn.q_proj.lora_A.weight", "model.layers.1.mlp.down_proj.lora_B.weight"):
        numeric = central_difference(lambda: loss_and_gradients(model, batch, dropout=dropout)[0], params[name])
        assert np.abs(grads[name] - numeric).max() <= 1e-6 * max(1.0, np.abs(numeric).max()), name
    recomputed = loss_and_gradients(model, batch, recompute=True, dropout=dropout)
    assert recomputed[0] == loss and all(np.array_equal(recomputed[1][n], g) for n, g in grads.items())
    assert loss_and_gradients(model, batch, dropout=dropout.piece(1))[0] != loss
    plain = loss_and_gradients(model, batch)[0]
    assert plain != loss and layers.ADAPTER_INPUTS.get() is None
