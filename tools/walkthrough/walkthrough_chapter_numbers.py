"""The walkthrough's chapters on numbers: 7, the number formats (and what upcasting and quantizing do), and
8, why decode speed is set by memory bandwidth."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from qwen_np.core import layers
from qwen_np.precision import lab as precision
from qwen_np import preset
from qwen_np.core.config import parameter_count
from qwen_np.numbers.names import FORMATS
from qwen_np.inspection import forward_flops, weight_bytes_read_per_token
from qwen_np.numbers.numerics import BYTES_PER_VALUE, bf16_bits_to_f32, f32_to_bf16_bits
from walkthrough_chapter_measured import caches_of, hardware_part, load
from walkthrough_training import below
from walkthrough_common import EXAMPLE_BANDWIDTH, EXAMPLE_FLOPS, LAYER, REAL, Run, code_block, num, values


def formats_section(run: Run) -> str:
    real = preset(REAL)
    params = parameter_count(real)
    stored = run.model.layers[0].q_proj[0, :3]                       # FP32, upcast from the stored BF16
    bits = f32_to_bf16_bits(stored)
    pi_bf16, big_bf16 = round_to_bf16(np.pi), round_to_bf16(70000)
    with np.errstate(over="ignore"):
        big_fp16 = np.float16(70000)
    accumulated = np.float32(0)
    for _ in range(1000):    # add 0.01 a thousand times, rounding the running total to BF16 each time
        accumulated = round_to_bf16(accumulated + np.float32(0.01))
    rows = "\n".join(f"| {fmt} | {BYTES_PER_VALUE[fmt]:g} | {layout} | "
                     f"{num(params * BYTES_PER_VALUE[fmt] / 2 ** 30)} GiB |" for fmt, layout in FORMAT_LAYOUTS.items())
    run.figures["formats"] = formats_figure_data(run)
    errors = run.figures["formats"]["errors"]
    return f"""## 7. Number formats: FP32, BF16, FP16, FP8, and what upcasting does

A weight is a real number stored in a fixed number of bits: a sign, an exponent (the range) and a
mantissa (the precision).

| format | bytes | sign / exponent / mantissa bits, largest value, relative step | Qwen3-8B weights |
|---|---:|---|---:|
{rows}

* **BF16** keeps FP32's 8 exponent bits (same range, about 1e-38 to 3e38) and cuts the mantissa to 7
  bits: about 3 significant digits. π becomes {float(pi_bf16)}. Qwen3 is released in BF16.
* **FP16** has more precision (10 mantissa bits) but a tiny range: 70,000 becomes {big_fp16} in FP16,
  {float(big_bf16):,.0f} in BF16. Activations of large models do exceed 65,504, and at the other end small
  gradients fall below FP16's smallest number (6e-8) and become 0 (underflow): FP16 training multiplies the
  loss by a large factor before the backward pass and divides the gradients by it afterwards (**loss
  scaling**), lowering the factor whenever a gradient overflows. BF16's FP32 range needs neither, which is
  why training moved to BF16. FP16 is not faster than BF16 where the hardware has both: the two are
  the same width, and NVIDIA's A100 and H100 tensor cores list the same TFLOP/s for FP16 and BF16
  matrix products. The choice between them is range against precision, not speed.
* **FP8** (E4M3, E5M2) is used for inference and, on hardware with FP8 matrix units (NVIDIA Hopper
  and Ada GPUs such as H100 and L40S, AMD MI300, Intel Gaudi 2 and later), for training too: matrix
  products in FP8 with per-tensor or per-block scale factors,
  master weights and optimizer state kept in higher precision (DeepSeek-V3 was trained this way).
  **INT8/INT4** are inference formats: weights quantized after training, with a scale per block
  (a few % extra bytes, not counted above). `python -m qwen_np precision` measures what each format
  does to this model's predictions.

The bits of each floating-point format, and one block of {QUANTIZED_BLOCK} real weights (layer 0's `q_proj`, row 0)
stored in three of them, with what each loses (`qwen_np.numbers.formats`): the largest error is
{", ".join(f"{num(e, 2)} in {fmt}" for fmt, e in errors.items())}, of weights up to
{num(max(abs(w) for w in run.figures["formats"]["weights"]), 2)}:

![Bit layouts of FP32, BF16, FP16 and FP8, and one quantized block and its error](figures/formats.png)

**Upcasting BF16 → FP32 is exact**: a BF16 number is the top 16 bits of an FP32 number, so qwen_np
shifts the stored bits left by 16 and reinterprets them. No information is added or lost:

{code_block(inspect.getsource(bf16_bits_to_f32))}

The first stored weights of layer 0's `q_proj` are the BF16 bit patterns
{", ".join(f"0x{b:04x}" for b in bits)}, which upcast to {values(stored, 3)}.

What computing in FP32 buys is precision in the *arithmetic*: sums over thousands of products lose
far less to rounding. Adding 0.01 a thousand times should give 10; rounding the running total to BF16
after every addition (as a BF16-only computation would) gives {num(accumulated)}, because once the
total is large, 0.01 is smaller than half a BF16 step and the addition does nothing. qwen_np computes
everything in FP32 (what transformers' FP32 reference does), from weights that were BF16 on disk.

{precision_part(run)}"""


QUANTIZED_BLOCK = 32              # one Q8_0 / Q4_0 block
KLD_SHOWN = ("fp8_e4m3", "int8", "q8_0", "q4_0")   # the formats whose KLD the text quotes


def precision_part(run: Run) -> str:
    """What storing the weights in each format does to the predictions: `precision`'s report on the bundled model
    (its default text and window, the formats of README's table: the per-row FP8 variants left out)."""
    text, text_name = precision.default_text()
    formats = [fmt for fmt in FORMATS if not fmt.endswith("_rows")]
    report = precision.precision_report(run.model_dir, text, text_name, formats, precision.SCORING_WINDOW,
                                        precision.DEFAULT_MAX_TOKENS)
    rows = {r["format"]: r for r in report["rows"]}
    run.figures["precision_kld"] = {"model": "the bundled model", "text": report["text"],
                                    "rows": [{key: r[key] for key in ("format", "bits_per_weight", "kld_mean")}
                                             for r in report["rows"]]}
    if not rows["q8_0"]["kld_mean"] * 10 < rows["fp8_e4m3"]["kld_mean"]:
        raise AssertionError("walkthrough: Q8_0 no longer diverges ten times less than FP8 E4M3")
    positions, bf16 = int(rows["fp32"]["positions"]), rows["bf16"]["kld_mean"]
    quoted = "; ".join(f"{fmt} {rows[fmt]['kld_mean']:.2g} nats ({rows[fmt]['same_top_percent']:.0f}% the same top "
                       "token)" for fmt in KLD_SHOWN)
    return f"""**What each format does to this model's predictions.** `python -m qwen_np precision` scores a text
with the model in FP32 and again with its weights stored in each format, and compares the next-token
distributions as `llama-perplexity --kl-divergence` does: KL(FP32 ‖ format), averaged over
{positions:,} positions of {report['text']}. BF16 gives exactly {bf16:g} (the checkpoint is stored in
BF16), FP16 less than {below(rows['fp16']['kld_mean'], 1e-9)} (FP32 rounding); then {quoted}.
Fewer bits, more divergence; but how the bits are spent matters as much as how many: Q8_0 spends its
8 bits on 255 evenly spaced levels per block of 32 weights (one FP16 scale each), FP8 E4M3 spends 4 of
its 8 on an exponent and keeps 3 bits of precision, and Q8_0 moves the predictions more than ten
times less.

![Mean KLD against FP32, per format, against bits per weight](figures/precision_kld.png)"""
BIT_LAYOUTS = {"FP32": (1, 8, 23), "BF16": (1, 8, 7), "FP16": (1, 5, 10), "FP8 E4M3": (1, 4, 3), "FP8 E5M2": (1, 5, 2)}


def formats_figure_data(run: Run) -> dict[str, Any]:
    """Sign/exponent/mantissa bits per format, and one block of real weights through fp8_e4m3, q8_0 and q4_0.
    No BLAS: quantizing is elementwise, so these digits are the same on every machine."""
    from qwen_np.numbers.formats import get_format

    weights = np.asarray(run.model.layers[LAYER].q_proj[0, :QUANTIZED_BLOCK], dtype=np.float32)[None, :]  # [1, 32]
    stored = {}
    for fmt in ("fp8_e4m3", "q8_0", "q4_0"):
        entry = get_format(fmt)
        stored[fmt] = entry.dequantize(*entry.quantize(weights))[0]
    return {"layouts": BIT_LAYOUTS, "weights": weights[0].tolist(),
            "stored": {fmt: values.tolist() for fmt, values in stored.items()},
            "errors": {fmt: float(np.abs(values - weights[0]).max()) for fmt, values in stored.items()}}


def round_to_bf16(x: float) -> np.float32:
    """x rounded to the nearest BF16 number (as torch's .to(bfloat16) does), back in FP32."""
    return bf16_bits_to_f32(f32_to_bf16_bits(np.array([x], dtype=np.float32)))[0]


FORMAT_LAYOUTS = {
    "FP32": "1 / 8 / 23, 3.4e38, 1.2e-7",
    "BF16": "1 / 8 / 7, 3.4e38, 7.8e-3",
    "FP16": "1 / 5 / 10, 65504, 9.8e-4",
    "FP8": "E4M3: 1 / 4 / 3, 448, 0.125; E5M2: 1 / 5 / 2, 57344, 0.25",
    "INT8": "integers −127…127 (symmetric: −128 unused, as formats.INT8_MAX), times a scale per row or block",
    "INT4": "integers −8…7, times a scale per block",
}


def bandwidth_section(run: Run) -> str:
    real = preset(REAL)
    read = weight_bytes_read_per_token(real, 2)
    decode = forward_flops(real, 1, 1001)
    memory_time, compute_time = read / EXAMPLE_BANDWIDTH, decode / EXAMPLE_FLOPS
    block_bytes = layers.UPCAST_BLOCK_ROWS * real.hidden_size * 4
    down_block_bytes = layers.UPCAST_BLOCK_ROWS * real.intermediate_size * 4
    ours = weight_bytes_read_per_token(run.model.config, 4)
    c = run.model.config
    head = c.vocab_size * c.hidden_size
    head_share = head * 4 / ours
    weight_flops = 2 * (read // 2)                     # 2 FLOPs (multiply + add) per weight read
    last_cache = [c for c in caches_of(load("hardware")) if c.kind != "Instruction"][-1]   # the recorded machine's
    weights_over_cache = parameter_count(real) * 2 / last_cache.size_bytes
    return f"""## 8. Why decode speed is set by memory bandwidth, and what the CPU caches do

A decode step multiplies one token's vector by every weight matrix: each weight is read once and
used for one multiply-add (2 FLOPs). For Qwen3-8B in BF16 that is {num(read / 1e9)} GB of weights read
(every weight but the embedding table, of which only the token's row is needed; GB here is 10⁹ bytes,
as bandwidth is quoted, where section 7's table counts GiB, 2³⁰ bytes, as memory is: its
{num(parameter_count(real) * 2 / 2 ** 30)} GiB of BF16 weights are {num(parameter_count(real) * 2 / 1e9)} GB) for
{num(weight_flops / 1e9)} GFLOP of matrix-vector products: 2 FLOPs per 2 bytes, one FLOP per byte.
Attention over a 1,000-token cache adds {num((decode - weight_flops) / 1e9, 2)} GFLOP (and reads the cache),
so the whole step is {num(decode / 1e9)} GFLOP.

Take a desktop with, say, {EXAMPLE_BANDWIDTH / 1e9:g} GB/s of memory bandwidth and {EXAMPLE_FLOPS / 1e12:g}
TFLOP/s of FP32 matmul (round example figures; `python -m qwen_np inspect` measures this machine's
bandwidth). Reading the weights takes {num(memory_time, 2)} s, the step's {num(decode / 1e9)} GFLOP of arithmetic
{num(compute_time, 2)} s. The
processor spends most of each token waiting for memory, so **decode speed ≈ bandwidth ÷ bytes of
weights**: at most {num(1 / memory_time, 2)} tokens/s here, whatever the core count. Fewer bytes per
weight (BF16 instead of FP32, or INT4) is faster for exactly this reason, *when the matrix product
reads the narrow format directly* (llama.cpp's kernels do). NumPy multiplies FP32 only, so qwen_np upcasts
each block first; that costs arithmetic, and when the FP32 weights fit in RAM they are faster
(README's table: Qwen3-0.6B decodes slower from BF16 than from FP32). BF16 pays off in qwen_np when
FP32 would not fit.

Prefill is different: the T prompt tokens share each weight read, so it does T FLOPs per byte and is
limited by arithmetic instead. That is why a long prompt is processed far faster per token than
tokens are generated.

**CPU caches.** Caches (a few MiB to tens of MiB of L3) hold recently used memory close to the cores. The 8B
weights ({num(parameter_count(real) * 2 / 2 ** 30)} GiB in BF16) are {weights_over_cache:,.0f} times larger than the
{last_cache.size_bytes / 2 ** 20:g} MiB {last_cache.name} of the machine measured below, so every
token streams them from DRAM again; caching cannot help with the weights themselves. It does help
with what we do to them: when the weights stay in BF16, `layers.linear` upcasts
{layers.UPCAST_BLOCK_ROWS} rows at a time ({num(block_bytes / 2 ** 20)} MiB in FP32 for Qwen3-8B's D-wide rows, and
{num(down_block_bytes / 2 ** 20)} MiB for `down_proj`, whose rows are F wide), a block
small enough to still be in cache when the matrix product reads it back, so the FP32 copy costs no
extra DRAM traffic and never exists in full:

{code_block(inspect.getsource(layers.linear))}

The bundled model reads {ours / 2 ** 20:.1f} MiB of FP32 weights per token, {head_share:.1%} of it the
[V, D] LM head matrix ({head:,} of its {parameter_count(c):,} parameters): a tiny network still pays
for a real vocabulary, but most of this one is its layers.

{hardware_part(run.figures)}"""
