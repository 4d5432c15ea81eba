"""Each exercise's check: the learner's module against qwen_np's own functions (or the `tokenizers`
library's BPE trainer, or an exact property), input by input, on seeded random inputs chosen to catch
the usual slips: GQA ratios from 1 to MQA, positions far from 0, a token repeated, ties, logits in the
hundreds. CHECKS maps each exercise's module to its check; `Setting` holds what a check may be pointed at.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import Any, Callable

import numpy as np

from ..core import layers
from ..core.config import Qwen3Config, parameter_count, preset
from ..numbers.numerics import Adapted
from .grading import Report, Wrong, answer, same_array, same_number, same_value

QWEN3 = "Qwen/Qwen3-0.6B"          # exercise 1's tokenizer, from the Hugging Face cache (or the hub)


@dataclass(frozen=True)
class Setting:
    tokenizer: str = QWEN3          # a folder or hub id holding a tokenizer with Qwen3's chat template


Check = Callable[[ModuleType, Report, Setting], None]


def normal(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def chat_tokens(module: ModuleType, report: Report, setting: Setting) -> None:
    from ..files.model_files import read_tokenizer

    tokenizer = read_tokenizer(setting.tokenizer)
    for message in ("Hello!", "Who wrote Hamlet?", "2 + 2 = ?\nAnswer in one word."):
        def one(message: str = message) -> str:
            text = tokenizer.apply_chat_template([{"role": "user", "content": message}], enable_thinking=False)
            expected = tokenizer.encode(text)
            same_value(list(module.chat_prompt_ids(tokenizer, message)), expected)
            return f"{len(expected)} tokens, {len(tokenizer.encode(message))} of them the message"
        report.case(f"message {message!r}", one)


def bpe_corpora() -> list[dict[str, int]]:
    """Small corpora of words and counts: one of English words, and random words over few letters (many ties)."""
    words = "low low low low lower lower newest newest newest widest widest the then there".split()
    rng = np.random.default_rng(2)
    randoms = [Counter("".join(rng.choice(list("abcd"), size=int(rng.integers(1, 7)))) for _ in range(int(rng.integers(5, 30))))
               for _ in range(3)]
    return [dict(Counter(words)), *[dict(c) for c in randoms]]


def trained_merges(word_counts: dict[str, int], n: int) -> list[tuple[str, str]]:
    """`tokenizers`' BpeTrainer's first n merges on these words (each word its count times, split on spaces)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    alphabet = {c for word in word_counts for c in word}
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + n, min_frequency=0, show_progress=False)
    tokenizer.train_from_iterator([word for word, count in word_counts.items() for _ in range(count)], trainer)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in merges]      # list or "a b", by version


def bpe_merges(module: ModuleType, report: Report, setting: Setting) -> None:
    for i, corpus in enumerate(bpe_corpora()):
        def one(corpus: dict[str, int] = corpus) -> str:
            expected = trained_merges(corpus, 10)
            same_value([tuple(m) for m in module.learn_merges(corpus, 10)], expected)
            return f"{len(expected)} merges, first {expected[:3]}"
        report.case(f"corpus {i} ({sum(corpus.values())} words, {len(corpus)} distinct)", one)


def embedding_backward(module: ModuleType, report: Report, setting: Setting) -> None:
    from ..training import gradients

    rng = np.random.default_rng(3)
    for ids in (np.array([5, 1, 5, 0, 5]), rng.integers(0, 7, size=12)):
        d_out = normal(rng, len(ids), 6)
        report.compare(f"ids {ids.tolist()}, vocabulary 7", module.embedding_backward, (d_out, ids, 7),
                       gradients.embed_backward(d_out, ids, 7))


def rms_norm(module: ModuleType, report: Report, setting: Setting) -> None:
    rng = np.random.default_rng(4)
    for shape, eps in (((5, 16), 1e-6), ((3, 4, 8), 1e-6), ((2, 6), 0.5)):
        x, weight = normal(rng, *shape, scale=3.0), normal(rng, shape[-1])
        report.compare(f"x {list(shape)}, eps {eps:g}", module.rms_norm, (x, weight, eps), layers.rms_norm(x, weight, eps))


def gqa_heads(module: ModuleType, report: Report, setting: Setting) -> None:
    rng = np.random.default_rng(5)
    for heads, kv_heads in ((4, 4), (4, 2), (8, 2), (6, 1)):
        q, k = normal(rng, 2, heads, 4), normal(rng, 3, kv_heads, 4)

        def scores(q: np.ndarray = q, k: np.ndarray = k, heads: int = heads) -> np.ndarray:
            """Each query head's scores against the keys the learner's expand_kv gives it: [H, T, S]."""
            return np.einsum("thd,shd->hts", q, np.asarray(module.expand_kv(k, heads))) * np.float32(0.5)   # Dh^-0.5
        report.compare(f"H {heads}, KVH {kv_heads}: the scores layers.attention_scores gives", scores, (),
                       layers.attention_scores(q, k))


def rope(module: ModuleType, report: Report, setting: Setting) -> None:
    rng = np.random.default_rng(6)
    for positions, heads, Dh, theta in (([0, 1, 2, 3], 2, 8, 1e4), ([7, 100, 4097], 3, 16, 1e6), ([31], 1, 64, 1e6)):
        x, at = normal(rng, len(positions), heads, Dh), np.array(positions)
        cos, sin = layers.rope_angles(layers.rope_inverse_frequencies(Dh, theta), at)
        report.compare(f"positions {positions}, Dh {Dh}, theta {theta:g}", module.rope, (x, at, theta),
                       layers.rope(x, cos, sin), rtol=1e-4, atol=1e-5)


ATTENTION_CASES = ((6, 6, 4, 4), (6, 6, 4, 2), (5, 9, 8, 2), (1, 7, 4, 1))      # T, S, H, KVH


def attention_inputs(rng: np.random.Generator, T: int, S: int, H: int, KVH: int) -> tuple[np.ndarray, ...]:
    """q [T, H, 8], k and v [S, KVH, 8] and the queries' positions, the last T of S."""
    return normal(rng, T, H, 8, scale=2.0), normal(rng, S, KVH, 8, scale=2.0), normal(rng, S, KVH, 8), np.arange(S - T, S)


def attention(module: ModuleType, report: Report, setting: Setting) -> None:
    rng = np.random.default_rng(7)
    for T, S, H, KVH in ATTENTION_CASES:
        q, k, v, at = attention_inputs(rng, T, S, H, KVH)
        report.compare(f"T {T} queries at positions {at[0]}..{at[-1]}, S {S} keys, H {H}, KVH {KVH}",
                       module.attention, (q, k, v, at), layers.attention(q, k, v, at))


def swiglu(module: ModuleType, report: Report, setting: Setting) -> None:
    rng = np.random.default_rng(8)
    for T, D, F in ((3, 8, 12), (1, 16, 40)):
        x, gate, up, down = normal(rng, T, D, scale=2.0), normal(rng, F, D), normal(rng, F, D), normal(rng, D, F)
        report.compare(f"x [{T}, {D}], F {F}", module.swiglu, (x, gate, up, down), layers.swiglu(x, gate, up, down))


@cache
def bundled_run() -> tuple[Any, list[int], np.ndarray]:
    """The bundled model, the walkthrough's prompt as ids, and the residual stream [L+1, D] of its last position
    (the lens steps: the embedding and each layer's output)."""
    from ..engine.loading import load_model
    from ..files.model_files import read_tokenizer
    from ..inspection.lens import is_lens_step

    model = load_model("bundled", memory="fp32", fast=False)
    ids = read_tokenizer("bundled").encode("HAMLET:\nTo be, or not to")
    stream: list[np.ndarray] = []
    model.forward(ids, trace=lambda name, value: stream.append(value[-1]) if is_lens_step(name) else None)
    return model, ids, np.stack(stream)


def logit_lens(module: ModuleType, report: Report, setting: Setting) -> None:
    from ..inspection.lens import lens_rows

    model, _, stream = bundled_run()
    expected = np.log(lens_rows(model, stream))                                     # [L+1, V] log-probabilities
    def one() -> str:
        got = np.asarray(module.lens_logits(stream, model.norm, model.config.rms_norm_eps, model.lm_head))
        if got.shape != expected.shape:
            raise Wrong(f"expected shape {list(expected.shape)}, got {list(got.shape)}")
        same_array(np.asarray(layers.log_softmax(got.reshape(-1, got.shape[-1]))), expected, rtol=1e-4, atol=1e-4)
        return f"top token after each layer {np.argmax(expected, axis=-1).tolist()}"
    report.case(f"the bundled model's stream after each of its {len(stream)} lens steps", one)


def minus_log_p(module: ModuleType, report: Report, setting: Setting) -> None:
    model, ids, _ = bundled_run()
    last = model.forward(ids)[-1]
    rng = np.random.default_rng(10)
    for what, logits, token in (("the bundled model's last row, token 0", last, 0),
                                ("its likeliest token", last, int(np.argmax(last))),
                                ("logits near a thousand", normal(rng, 50, scale=500.0), 7)):
        expected = -float(layers.log_softmax(logits[None])[0, token])
        report.compare(what, module.minus_log_p, (logits, token), expected, rtol=1e-5)


def cross_entropy(module: ModuleType, report: Report, setting: Setting) -> None:
    from ..training import gradients

    rng = np.random.default_rng(11)
    for B, T, V, scale in ((2, 3, 10, 1.0), (1, 5, 7, 40.0)):
        logits, targets = normal(rng, B, T, V, scale=scale), rng.integers(0, V, size=(B, T))
        loss, d_logits = gradients.cross_entropy(logits, targets)
        def one(logits: np.ndarray = logits, targets: np.ndarray = targets, loss: float = loss,
                d_logits: np.ndarray = d_logits) -> None:
            got = module.cross_entropy(logits, targets)
            if not (isinstance(got, tuple) and len(got) == 2):
                raise Wrong(f"expected (loss, d_logits), got {type(got).__name__}")
            same_number(got[0], loss, rtol=1e-5)
            same_array(np.asarray(got[1]), d_logits)
        report.case(f"logits [{B}, {T}, {V}] of scale {scale:g}", one)


REAL_SIZES = ("qwen3-0.6b", "qwen3-8b", "qwen3-14b", "qwen3-32b")


def kv_cache_bytes(module: ModuleType, report: Report, setting: Setting) -> None:
    from ..engine import memory

    for name, width in ((name, 2) for name in REAL_SIZES):
        config = preset(name)
        expected = memory.kv_cache_bytes_per_token(config, bytes_per_value=width)
        report.compare(f"{name}, {width} bytes a value", module.kv_cache_bytes_per_token, (config, width), expected,
                       f"{expected:,} bytes a token")


def bf16_rounding(module: ModuleType, report: Report, setting: Setting) -> None:
    from ..numbers import formats

    rng = np.random.default_rng(13)
    cases = {"1000 to 1004": np.array([1000, 1001, 1002, 1003, 1004], dtype=np.float32),
             "ties on both sides of even": np.array([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8)], dtype=np.float32),
             "random, tiny to huge": (normal(rng, 200) * np.float32(10.0) ** rng.integers(-30, 30, size=200)).astype(np.float32)}
    for what, x in cases.items():
        report.compare(what, module.to_bf16, (x,), formats.round_trip(x, "bf16"), rtol=0.0, atol=0.0)


def decode_bound(module: ModuleType, report: Report, setting: Setting) -> None:
    from ..inspection.counts import weight_bytes_read_per_token

    for name, width in (("qwen3-0.6b", 2), ("qwen3-8b", 2), ("qwen3-8b", 0.5)):
        config = preset(name)
        expected = 50e9 / weight_bytes_read_per_token(config, width)
        report.compare(f"{name} ({'tied' if config.tie_word_embeddings else 'untied'}), {width:g} bytes a weight, 50 GB/s",
                       module.max_tokens_per_second, (config, 50e9, width), expected, f"{expected:.3g} tokens/s", rtol=1e-6)


def rms_norm_backward(module: ModuleType, report: Report, setting: Setting) -> None:
    from ..training import gradients

    rng = np.random.default_rng(15)
    for shape, eps in (((3, 8), 1e-6), ((2, 3, 4), 1e-2)):
        x, weight, d_out = (rng.standard_normal(s) for s in (shape, shape[-1:], shape))
        def one(x: np.ndarray = x, weight: np.ndarray = weight, d_out: np.ndarray = d_out, eps: float = eps) -> str:
            got = module.rms_norm_backward(d_out, x, weight, eps)
            if not (isinstance(got, tuple) and len(got) == 2):
                raise Wrong(f"expected (dx, dw), got {type(got).__name__}")
            dx, dw = (np.asarray(g, dtype=np.float64) for g in got)
            numeric_dx, numeric_dw = finite_differences(lambda a, w: float((d_out * layers.rms_norm(a, w, eps)).sum()), x, weight)
            same_array(dx, numeric_dx, rtol=1e-5, atol=1e-6)
            same_array(dw, numeric_dw, rtol=1e-5, atol=1e-6)
            ours = gradients.rms_norm_backward(d_out.astype(np.float32), x.astype(np.float32), weight.astype(np.float32), eps)
            same_array(dx.astype(np.float32), ours[0], rtol=1e-4, atol=1e-5)
            same_array(dw.astype(np.float32), ours[1], rtol=1e-4, atol=1e-5)
            return "dx and dw equal to central differences and to gradients.rms_norm_backward"
        report.case(f"x {list(shape)}, eps {eps:g}", one)


def finite_differences(loss: Callable[[np.ndarray, np.ndarray], float], x: np.ndarray,
                       w: np.ndarray, step: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """Central differences of loss(x, w) in every entry of x and of w (float64: the step's rounding is ~1e-10)."""
    def partials(array: np.ndarray, at: Callable[[np.ndarray], float]) -> np.ndarray:
        out = np.zeros_like(array)
        for index in np.ndindex(array.shape):
            bumped = [array.copy(), array.copy()]
            bumped[0][index] += step
            bumped[1][index] -= step
            out[index] = (at(bumped[0]) - at(bumped[1])) / (2 * step)
        return out
    return partials(x, lambda a: loss(a, w)), partials(w, lambda a: loss(x, a))


def memory_remedy(module: ModuleType, report: Report, setting: Setting) -> None:
    from ..engine.step_memory import training_remedies

    totals = {name: parts["total"] for name, parts in training_remedies(preset("qwen3-0.6b"), 8, 1024).items()}
    single = sorted(set(totals) - {"baseline", "all_three"})

    def one() -> str:            # any single remedy that fits and keeps the update is right (the plan says which)
        given = answer(module)
        if given not in single:
            raise Wrong(f"expected one of {single}, got {given!r}")
        if given == "quarter_batch":
            raise Wrong("a quarter of the batch fits, but it is another update (fewer rows, more noise)")
        if totals[given] > 24 * 2 ** 30:
            raise Wrong(f"{given} needs {totals[given] / 2 ** 30:.3g} GiB, over 24")
        return f"{totals[given] / 2 ** 30:.3g} GiB"
    report.case("ANSWER", one)


def flash_attention(module: ModuleType, report: Report, setting: Setting) -> None:
    rng = np.random.default_rng(17)
    for T, S, H, KVH in ATTENTION_CASES[1:]:
        q, k, v, at = attention_inputs(rng, T, S, H, KVH)
        for block in (1, 5, S):
            report.compare(f"block {block}: T {T}, S {S}, H {H}, KVH {KVH}", module.flash_attention, (q, k, v, at, block),
                           layers.attention(q, k, v, at))


LEARNING_RATES, DIVERGE_STEPS, BLOW_UP = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0), 12, 5.0


def losses_at(lr: float) -> list[float]:
    """The losses of DIVERGE_STEPS clipped AdamW steps of the tiny preset's fresh model at a constant rate, on a
    batch of 4 x 17 ids drawn over its vocabulary. (At lr 0.3 the loss rises 0.99 nats, at 1 by 13-14: the 5-nat
    line leaves a wide margin on either side, whatever the BLAS kernel.)"""
    from ..training import parameters, step
    from ..training.settings import PRESET_CONFIGS

    config = Qwen3Config(**PRESET_CONFIGS["tiny"])
    batch = np.random.default_rng(0).integers(0, config.vocab_size, size=(4, 17))
    params = parameters.init_parameters(config, seed=0)
    model, optimizer = parameters.model_from_parameters(config, params), step.adamw_for(params)
    losses = []
    for _ in range(DIVERGE_STEPS):
        loss, grads = step.loss_and_gradients(model, batch)
        step.clip_gradients(grads, 1.0)
        losses.append(loss)
        optimizer.update(params, grads, lr)
    return losses


@cache                    # the same twelve runs whoever asks: a check, then the solution's
def first_diverging_rate() -> tuple[float, dict[float, float]]:
    """The first of LEARNING_RATES whose loss rises BLOW_UP nats above its first, and each rate's largest rise."""
    rises = {lr: max(losses) - losses[0] for lr in LEARNING_RATES for losses in [losses_at(lr)]}
    return next(lr for lr, rise in rises.items() if rise > BLOW_UP), rises


def divergence(module: ModuleType, report: Report, setting: Setting) -> None:
    def one() -> str:
        first, rises = first_diverging_rate()
        same_value(answer(module), first)
        return "largest rise above the first loss: " + ", ".join(f"lr {lr:g} {rise:.3g}" for lr, rise in rises.items())
    report.case("ANSWER", one)


def layer_configs() -> dict[str, Qwen3Config]:
    from dataclasses import replace

    base = preset("qwen3-0.6b")
    return {"qwen3-0.6b": base, "qwen3-8b": preset("qwen3-8b"), "no QK-norm": replace(base, use_qk_norm=False),
            "GELU MLP": replace(base, mlp_type="gelu", intermediate_size=base.intermediate_size * 3 // 2),
            "MQA": replace(base, num_key_value_heads=1), "MHA": replace(base, num_key_value_heads=base.num_attention_heads)}


def layer_parameters(module: ModuleType, report: Report, setting: Setting) -> None:
    from dataclasses import replace

    for what, config in layer_configs().items():
        expected = parameter_count(config) - parameter_count(replace(config, num_hidden_layers=0))
        expected //= config.num_hidden_layers
        report.compare(what, module.layer_parameters, (config,), expected, f"{expected:,} a layer")


def lora(module: ModuleType, report: Report, setting: Setting) -> None:
    rng = np.random.default_rng(20)
    for rank, alpha in ((1, 2.0), (2, 4.0), (8, 16.0)):
        x, w, a, b = normal(rng, 3, 12), normal(rng, 10, 12), normal(rng, rank, 12), normal(rng, 10, rank)
        adapted = Adapted(base=w, a=a, b=b, scale=alpha / rank)
        def one(x: np.ndarray = x, w: np.ndarray = w, a: np.ndarray = a, b: np.ndarray = b, alpha: float = alpha,
                adapted: Adapted = adapted) -> None:
            same_array(np.asarray(module.lora_linear(x, w, a, b, alpha)), layers.linear(x, adapted), rtol=1e-4, atol=1e-5)
            same_array(np.asarray(module.merged(w, a, b, alpha)) @ x.T, layers.linear(x, adapted).T, rtol=1e-4, atol=1e-5)
        report.case(f"rank {rank}, alpha {alpha:g}", one)


def pass_at_k(module: ModuleType, report: Report, setting: Setting) -> None:
    from ..training import rollouts

    # Exactly k wrong (4 of 8, k 4) is where "fewer than k wrong" and "at most k" part; n 2,000 overflows binomials.
    for n, c, k in ((8, 0, 1), (8, 3, 1), (8, 3, 4), (8, 4, 4), (8, 7, 8), (2000, 37, 100)):
        expected = rollouts.pass_at_k(n, c, k)
        report.compare(f"n {n}, c {c}, k {k}", module.pass_at_k, (n, c, k), expected, f"{expected:.6g}", rtol=1e-9)


def speculative(module: ModuleType, report: Report, setting: Setting) -> None:
    rng = np.random.default_rng(21)
    p1, q1 = rng.dirichlet(np.ones(6)), rng.dirichlet(np.ones(6))
    peaked = np.array([0.9, 0.05, 0.05, 0.0])
    for what, p, q in (("random p and q over 6 tokens", p1, q1), ("a draft that never proposes a likely token", peaked,
                        np.array([0.0, 0.5, 0.25, 0.25])), ("p equal to q", p1, p1.copy())):
        def one(p: np.ndarray = p, q: np.ndarray = q) -> None:
            chances = {x: float(module.acceptance(p, q, x)) for x in range(p.size) if q[x] > 0}
            for x, chance in chances.items():
                if not 0.0 <= chance <= 1.0:
                    raise Wrong(f"token {x} (p {p[x]:.3g}, q {q[x]:.3g}): acceptance {chance:.4g}, not a probability in [0, 1]")
            kept = np.array([q[x] * chances.get(x, 0.0) for x in range(p.size)])
            rejected = 1.0 - kept.sum()
            emitted = kept + rejected * np.asarray(module.residual(p, q), dtype=np.float64)
            same_array(emitted, p, rtol=1e-9, atol=1e-12)
        report.case(what, one)


def decoder_layer(module: ModuleType, report: Report, setting: Setting) -> None:
    from ..core.model import Qwen3Model
    from ..training import parameters

    config = Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    params = parameters.init_parameters(config, seed=22)
    rng = np.random.default_rng(22)
    for name in params:                   # norms of 1 would hide a norm left out; weights of 0.02 a missing scale
        params[name] = (params[name] * (1 + 9 * rng.random(params[name].shape))).astype(np.float32) \
            if name.endswith("norm.weight") else params[name] * np.float32(10.0)
    model: Qwen3Model = parameters.model_from_parameters(config, params)
    ids = rng.integers(0, config.vocab_size, size=11)
    def one() -> str:
        x = layers.embed(ids, model.embed_tokens)
        positions = np.arange(len(ids))
        for layer in model.layers:
            x = np.asarray(module.decoder_layer(x, layer, config, positions), dtype=np.float32)
        logits = layers.linear(layers.rms_norm(x, model.norm, config.rms_norm_eps), model.lm_head)
        same_array(logits, model.forward(ids), rtol=1e-4, atol=1e-4)
        return f"logits [{len(ids)}, {config.vocab_size}] equal to Qwen3Model.forward's"
    report.case(f"a random Qwen3 of {config.num_hidden_layers} layers, H 4, KVH 2, {len(ids)} tokens", one)


CHECKS: dict[str, Check] = {
    "e01_chat_tokens": chat_tokens, "e02_bpe_merges": bpe_merges, "e03_embedding_backward": embedding_backward,
    "e04_rms_norm": rms_norm, "e05_gqa_heads": gqa_heads, "e06_rope": rope, "e07_attention": attention,
    "e08_swiglu": swiglu, "e09_logit_lens": logit_lens, "e10_minus_log_p": minus_log_p,
    "e11_cross_entropy": cross_entropy, "e12_kv_cache_bytes": kv_cache_bytes, "e13_bf16_rounding": bf16_rounding,
    "e14_decode_bound": decode_bound, "e15_rms_norm_backward": rms_norm_backward, "e16_memory_remedy": memory_remedy,
    "e17_flash_attention": flash_attention, "e18_divergence": divergence, "e19_layer_parameters": layer_parameters,
    "e20_lora": lora, "e21_speculative": speculative, "e22_pass_at_k": pass_at_k,
    "e23_decoder_layer": decoder_layer,
}
