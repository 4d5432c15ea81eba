"""Mixed-precision training: the operands of every linear layer's product rounded to BF16, FP16 or FP8.

What a GPU run in mixed precision computes, and what this module makes the NumPy training step compute:

* The master weights and AdamW's moments stay FP32 (trainer.py, training.AdamW): an update of 2e-4 is
  below half a BF16 ulp of every weight with |w| >= 1/16, so weights held in BF16 would not move at
  all there (`stalled_by_update` measures the share).
* Each linear layer's matrix product reads its operands in the format, as a tensor core is fed them:
  forward y = round(x) round(W)^T; backward dx = round(dy) round(W), dW = round(dy)^T round(x). The
  products themselves run in FP32 on the rounded values: what an FP32-accumulating tensor core gives
  (up to the order of its sums). RMSNorm, RoPE, attention's softmax and products, the loss and the
  optimizer stay FP32, as in torch.autocast's BF16 recipe.
* FP16's 5 exponent bits make small gradients underflow to 0 (at most 2^-25, half its smallest subnormal), so FP16 scales the loss
  up before the backward and the gradients down after (`LossScaler`, dynamic as torch's GradScaler).
* FP8 follows DeepSeek-V3 (arXiv:2412.19437, section 3.3): E4M3 everywhere, with fine-grained scales,
  one per 1x128 tile of an activation or gradient (128 consecutive values along the product's inner
  axis) and one per 128x128 block of a weight, each mapping its tile's amax onto 448. The tiles'
  scales are applied before the FP32 product: the same sum as DeepSeek's kernels, which multiply
  the E4M3 codes and scale each 128-long partial sum in FP32, up to the order of the additions.

How the rounding reaches the one readable network: layers.MATMUL_INPUTS, a context variable that
layers.linear and gradients.linear_backward consult (see layers.py for why a context variable).
`operands(precision)` gives the function to set there; training.loss_and_gradients sets it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import QwenNPError
from ..numbers.formats import round_trip
from ..core.layers import MatmulInputs
from .settings import LOSS_SCALE_GROWTH_INTERVAL, PRECISIONS

TILE = 128                    # DeepSeek-V3's FP8 tile: 1x128 for activations and gradients, 128x128 for weights
FP8_FORMAT = "fp8_e4m3_rows"  # formats' E4M3FN with one amax/448 scale per row: each row here is one tile


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise QwenNPError(f"expected one of {', '.join(PRECISIONS)}, got {precision!r}", "precision")
    return precision


def operands(precision: str | MatmulInputs) -> MatmulInputs | None:
    """The rounding of a linear layer's operands in `precision`; None for fp32 (nothing is touched,
    so an fp32 step is the plain FP32 step bit for bit). A rounding function is returned as it is."""
    if callable(precision):
        return precision
    check_precision(precision)
    if precision == "fp32":
        return None
    if precision == "fp8":
        return round_fp8
    return lambda a, kind, axis: round_trip(a, precision)     # a plain cast: the same for every kind and axis


def round_fp8(a: np.ndarray, kind: str, axis: int) -> np.ndarray:
    """E4M3 with DeepSeek-V3's scales: a weight [out, in] in 128x128 blocks, anything else in 1x128
    tiles along `axis` (the axis the product sums over). FP32 values of the same shape."""
    return fp8_blocks(a) if kind == "weight" else fp8_tiles(a, axis)


def fp8_tiles(a: np.ndarray, axis: int) -> np.ndarray:
    """a [..., n, ...] rounded to E4M3 with one scale per TILE consecutive values along `axis`.

    n need not be a multiple of TILE: the last tile is padded with zeros, which change no tile's
    amax and are cut off again.
    """
    moved = np.moveaxis(np.asarray(a, dtype=np.float32), axis, -1)                 # [..., n]
    n = moved.shape[-1]
    rows = np.pad(moved.reshape(-1, n), ((0, 0), (0, -n % TILE)))                  # [R, n rounded up]
    rounded = round_trip(rows.reshape(-1, TILE), FP8_FORMAT).reshape(rows.shape)[:, :n]
    return np.ascontiguousarray(np.moveaxis(rounded.reshape(moved.shape), -1, axis))


def fp8_blocks(w: np.ndarray) -> np.ndarray:
    """w [out, in] rounded to E4M3 with one scale per TILE x TILE block (edge blocks zero-padded)."""
    rows, columns = w.shape
    padded = np.pad(np.asarray(w, dtype=np.float32), ((0, -rows % TILE), (0, -columns % TILE)))   # [R, C]
    R, C = padded.shape
    blocks = padded.reshape(R // TILE, TILE, C // TILE, TILE).swapaxes(1, 2)        # [R/128, C/128, 128, 128]
    rounded = round_trip(blocks.reshape(-1, TILE * TILE), FP8_FORMAT).reshape(blocks.shape)
    return np.ascontiguousarray(rounded.swapaxes(1, 2).reshape(R, C)[:rows, :columns])


# --- FP16's dynamic loss scaling ---------------------------------------------------------------------


@dataclass
class LossScaler:
    """Dynamic loss scaling, as torch.amp.GradScaler: the loss's gradient is multiplied by `scale` before
    the backward, so gradients that FP16 would flush to 0 stay representable, and the FP32 gradients are
    divided by it after. A step whose gradients hold an inf or NaN (the scale was too large: FP16
    overflowed past 65504) is skipped and the scale halved; after `growth_interval` clean steps in a row
    it doubles again, to keep as much of the small gradients as overflow allows.

    The scale stays a power of two, so scaling and unscaling are exact in FP32. Defaults: torch's
    initial 2^16; a growth interval of 200 (settings.LOSS_SCALE_GROWTH_INTERVAL) rather than torch's 2000.
    """

    scale: float = 2.0 ** 16
    growth_interval: int = LOSS_SCALE_GROWTH_INTERVAL
    clean_steps: int = 0                    # steps since the last overflow or growth

    def unscale(self, grads: dict[str, np.ndarray]) -> bool:
        """Divide every gradient by the scale, in place; returns whether all of them are finite."""
        inverse = np.float32(1.0 / self.scale)
        finite = all(bool(np.isfinite(g).all()) for g in grads.values())
        for g in grads.values():
            g *= inverse
        return finite

    def update(self, finite: bool) -> str:
        """After a step: halve on overflow, double after growth_interval clean steps. Returns the event
        ("overflow": the step is to be skipped, "grow", or "")."""
        if not finite:
            self.scale, self.clean_steps = self.scale / 2, 0
            return "overflow"
        self.clean_steps += 1
        if self.clean_steps < self.growth_interval:
            return ""
        self.scale, self.clean_steps = self.scale * 2, 0
        return "grow"


@dataclass
class UnderflowCount:
    """The FP16 rounding of mixed.operands("fp16"), counting the gradient values (dy) it flushes to zero:
    the measurement behind training.fp16_underflow. Counts in one thread: call it unsharded."""

    nonzero: int = 0                        # gradient values seen that are not 0 in FP32
    flushed: int = 0                        # of those, the ones FP16 rounds to 0 (|dy| <= 2^-25)

    def __call__(self, a: np.ndarray, kind: str, axis: int) -> np.ndarray:
        rounded = round_trip(a, "fp16")
        if kind == "gradient":
            nonzero = a != 0
            self.nonzero += int(np.count_nonzero(nonzero))
            self.flushed += int(np.count_nonzero(nonzero & (rounded == 0)))
        return rounded


# --- Why the master weights stay FP32 ---------------------------------------------------------------


def stalled_by_update(weights: np.ndarray, update: float, fmt: str = "bf16") -> float:
    """The share of weights that an update of size `update` cannot move if they are held in `fmt`:
    round(round(w) - update) == round(w), i.e. the update is below half an ulp of the stored weight
    (BF16's 8 significant bits: an ulp is 2^-7 of |w|'s power of two, half an ulp 2^-8). FP32 master
    weights keep every such update; AdamW's steps are about lr each, so at lr 2e-4 a BF16 copy would
    freeze every weight with |w| >= 1/16.
    """
    held = round_trip(np.asarray(weights, dtype=np.float32).reshape(-1), fmt)
    moved = round_trip(held - np.float32(update), fmt)
    return float(np.mean(moved == held))
