"""Training a Qwen3 with the hand-written backward pass (gradients.py).

One optimizer step, top to bottom:

    batch [B, T+1] token ids, cut from the shuffled training text
      -> loss_and_gradients        forward with a tape, cross-entropy, backward  (per micro-batch)
      -> accumulate                micro-batches of B / grad_accum add up to the batch's mean gradient
      -> clip_gradients            scale every gradient so their global L2 norm is at most 1
      -> learning_rate(step)       linear warmup, then cosine decay
      -> AdamW.update              decoupled weight decay, bias-corrected moments, in place

The parameters are the model's own arrays (`named_parameters`), updated in place, so the model that is
trained is the model that generates. They stay FP32 in every precision: mixed precision (mixed.py)
rounds only what the linear layers' products read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from . import gradients, lora, mixed, objectives
from ..core import layers
from ..core.config import EMBED_TOKENS, FINAL_NORM, LM_HEAD, is_matrix, layer_tensors
from ..errors import QwenNPError
from ..core.layers import MatmulInputs
from ..core.model import Qwen3Model
from ..numbers.numerics import Weight


def loss_and_gradients(model: Qwen3Model, batch: np.ndarray, recompute: bool = False,
                       precision: str | MatmulInputs = "fp32", loss_scale: float = 1.0,
                       weights: np.ndarray | None = None,
                       dropout: lora.Dropout | None = None) -> tuple[float, dict[str, np.ndarray]]:
    """Mean next-token cross-entropy of a batch and every parameter's FP32 gradient.

    batch: int array [B, T+1]; the model reads batch[:, :-1] and predicts batch[:, 1:], the loss
    transformers' Qwen3ForCausalLM computes with labels=input_ids. grads maps each checkpoint tensor
    name to an array of that tensor's shape. recompute: activation checkpointing (keep each layer's
    input only, run the layer again in the backward): less memory, one more forward, the same bits.
    precision (mixed.PRECISIONS): the format every linear layer's product reads its operands in,
    forward and backward (mixed.py); the weights stay the model's FP32 arrays (or a rounding function
    itself, for a measurement such as fp16_underflow's). loss_scale: the loss's gradient is multiplied
    by it before the backward (FP16's loss scaling), so the gradients come back scaled by it too
    (mixed.LossScaler.unscale divides them again). The loss itself is not scaled. weights [B, T]: each
    predicted token's weight in the loss (gradients.cross_entropy; chat SFT's assistant-only mask). A Qwen3-MoE's
    loss adds its load-balancing term (router_loss).
    dropout: LoRA dropout on every adapter's input, in this forward and its backward (layers.ADAPTER_INPUTS).
    """
    batch = check_batch(batch, model.config.vocab_size)
    if not lora.has_adapters(model):    # an adapted model trains its FP32 adapters; its base may be any kind
        named_parameters(model)         # raises, naming the tensor, unless every weight is a float array
    else:
        refuse_moe_adapters(model)
    hook = layers.MATMUL_INPUTS.set(mixed.operands(precision))     # this thread's forward and backward only
    dropping = layers.ADAPTER_INPUTS.set(dropout)
    try:
        logits, tape = gradients.forward_with_tape(model, batch[:, :-1], recompute)  # [B, T, V]
        loss, d_logits = gradients.cross_entropy(logits, batch[:, 1:], weights)
        balance, d_routers = router_loss(model, tape)
        loss += balance
        scale = np.float32(loss_scale)
        if loss_scale == 1.0:
            return loss, gradients.backward(model, tape, d_logits, d_routers)
        # A scaled backward may overflow FP16: loss scaling expects that now and then and checks the
        # gradients for inf (mixed.LossScaler.unscale), so NumPy's warnings would only be noise.
        with np.errstate(over="ignore", invalid="ignore"):
            return loss, gradients.backward(model, tape, d_logits * scale, {i: d * scale for i, d in d_routers.items()})
    finally:
        layers.ADAPTER_INPUTS.reset(dropping)
        layers.MATMUL_INPUTS.reset(hook)


def router_loss(model: Qwen3Model, tape: gradients.Tape) -> tuple[float, dict[int, np.ndarray]]:
    """A Qwen3-MoE's load-balancing term of the training loss, config.router_aux_loss_coef times
    gradients.load_balancing_loss over every sparse layer's router, and its gradient per layer [B, T, E]; for a
    dense Qwen3, 0 and none. transformers adds the same term to Qwen3MoeForCausalLM's loss when output_router_logits
    is set (Qwen3-30B-A3B's config.json has it false); loss_and_gradients always adds it, with the config's
    coefficient (0 leaves it out): it is what keeps a router from sending most tokens to a few experts. Over every
    position of the batch, as transformers' with no attention mask; per micro-batch and shard, as its gradient
    accumulation: the term is a product of two means over the rows, so the pieces' average is not the whole batch's.
    DPO's and GRPO's objectives (policy_gradients) are theirs alone, as TRL's without output_router_logits."""
    coefficient = model.config.router_aux_loss_coef
    if not tape.router_logits:
        return 0.0, {}
    aux, d_logits = gradients.load_balancing_loss(list(tape.router_logits.values()), model.config.num_experts_per_tok)
    scale = np.float32(coefficient)
    return coefficient * aux, {i: d * scale for i, d in zip(tape.router_logits, d_logits)}


def refuse_moe_adapters(model: Qwen3Model) -> None:
    """LoRA trains adapters on the dense projections (lora.add_adapters); a Qwen3-MoE's router and experts have none,
    and their backward here forms their full gradients, which a frozen base neither needs nor, held as BF16 or int8,
    allows."""
    if model.config.is_moe:
        raise QwenNPError("LoRA on a Qwen3-MoE is not trained here (its router and experts take no adapters); "
                          "train every weight of it", "model")


def completion_log_probs(model: Qwen3Model, ids: np.ndarray, completion: np.ndarray) -> np.ndarray:
    """Each predicted token's log-probability under `model`, zero off the completion: what DPO sums and
    GRPO's ratio and KL read, without a tape (a reference's, or the sampling policy's).
    ids [B, T+1] (rows padded at their end), completion [B, T+1] bool -> [B, T], FP32 as the logits."""
    B = ids.shape[0]
    logits = model.forward_batch(list(ids[:, :-1]), [None] * B).reshape(B, ids.shape[1] - 1, -1)   # [B, T, V]
    return gradients.token_log_probs(logits, ids[:, 1:])[0] * completion[:, 1:]


def policy_gradients(model: Qwen3Model, ids: np.ndarray, completion: np.ndarray,
                     objective: Callable[[np.ndarray], tuple[Any, np.ndarray]],
                     dropout: lora.Dropout | None = None) -> tuple[Any, dict[str, np.ndarray]]:
    """A loss over the completion tokens' log-probabilities (DPO's, GRPO's: objectives.py) and every trained
    parameter's gradient: forward with a tape, log p of each token (gradients.token_log_probs), the objective
    ([B, T] log-probs, zero off the completion -> its result and d loss / d log-probs [B, T]), then
    d log-probs -> d logits -> the network's backward, as loss_and_gradients does for cross-entropy.
    ids, completion [B, T+1]. One piece, FP32 (no shards, micro-batches or mixed precision)."""
    ids = check_batch(ids, model.config.vocab_size)
    if not lora.has_adapters(model):
        named_parameters(model)
    else:
        refuse_moe_adapters(model)
    mask = np.asarray(completion, dtype=bool)[:, 1:]                                 # [B, T]
    dropping = layers.ADAPTER_INPUTS.set(dropout)
    try:
        logits, tape = gradients.forward_with_tape(model, ids[:, :-1])               # [B, T, V]
        log_probs, probs = gradients.token_log_probs(logits, ids[:, 1:])             # [B, T], [B, T, V]
        result, d_log_probs = objective(log_probs * mask)
        d_logits = gradients.token_log_probs_backward(d_log_probs * mask, probs, ids[:, 1:])
        return result, gradients.backward(model, tape, d_logits)
    finally:
        layers.ADAPTER_INPUTS.reset(dropping)


def dpo_loss_and_gradients(model: Qwen3Model, ids: np.ndarray, completion: np.ndarray, reference: np.ndarray,
                           beta: float = objectives.DPO_BETA,
                           dropout: lora.Dropout | None = None) -> tuple[objectives.DpoLoss, dict[str, np.ndarray]]:
    """DPO on P preference pairs (objectives.dpo_loss) and every trained parameter's gradient.

    ids, completion [2P, T+1]: the P chosen rows, then the P rejected ones (TRL's order), each a prompt and
    its reply padded at the end, completion True on the reply's tokens; reference [2P]: each row's summed
    log-probability under the reference (completion_log_probs of the starting weights: with LoRA, the base
    with its adapters off, lora.without_adapters)."""
    P = len(ids) // 2

    def objective(log_probs: np.ndarray) -> tuple[objectives.DpoLoss, np.ndarray]:
        sequence = log_probs.sum(axis=1)                                             # [2P]
        result = objectives.dpo_loss(sequence[:P], sequence[P:], reference[:P], reference[P:], beta)
        d_sequence = np.concatenate([result.d_chosen, result.d_rejected])            # [2P]
        return result, np.broadcast_to(d_sequence[:, None], log_probs.shape).astype(log_probs.dtype)

    return policy_gradients(model, ids, completion, objective, dropout)


def grpo_loss_and_gradients(model: Qwen3Model, ids: np.ndarray, completion: np.ndarray, advantages: np.ndarray,
                            loss_type: str = "dapo", beta: float = 0.0, reference: np.ndarray | None = None,
                            old: np.ndarray | None = None, max_completion_length: int | None = None,
                            dropout: lora.Dropout | None = None) -> tuple[objectives.GrpoLoss, dict[str, np.ndarray]]:
    """GRPO on N sampled completions (objectives.grpo_loss) and every trained parameter's gradient.

    ids, completion [N, T+1]: prompt and completion rows; advantages [N] (objectives.group_advantages);
    reference, old [N, T]: the reference's and the sampling policy's completion_log_probs (old None: this
    step's own, detached, as TRL with one update per generation: the ratio is 1 and keeps its gradient)."""
    def objective(log_probs: np.ndarray) -> tuple[objectives.GrpoLoss, np.ndarray]:
        result = objectives.grpo_loss(log_probs, log_probs.copy() if old is None else old, advantages,
                                      np.asarray(completion, dtype=bool)[:, 1:], loss_type, beta, reference,
                                      max_completion_length=max_completion_length)
        return result, result.d_log_probs.astype(log_probs.dtype)

    return policy_gradients(model, ids, completion, objective, dropout)


def fp16_underflow(model: Qwen3Model, batch: np.ndarray, loss_scale: float = 1.0) -> float:
    """The share of the nonzero gradient values entering the backward's products (each linear layer's
    dy) that an FP16 step with this loss scale flushes to zero: what loss scaling is there to prevent."""
    count = mixed.UnderflowCount()
    loss_and_gradients(model, batch, precision=count, loss_scale=loss_scale)
    return count.flushed / max(1, count.nonzero)


def check_batch(batch: np.ndarray, vocab_size: int) -> np.ndarray:
    """A [B, T+1] integer batch with T >= 1 and every id inside the vocabulary."""
    batch = np.asarray(batch)
    if batch.ndim != 2 or batch.shape[1] < 2 or not np.issubdtype(batch.dtype, np.integer):
        raise QwenNPError(f"batch: expected integer token ids [B, T+1] with T >= 1, got shape {batch.shape} {batch.dtype}")
    if batch.min() < 0 or batch.max() >= vocab_size:
        raise QwenNPError(f"batch: token ids must lie in [0, {vocab_size})")
    return batch.astype(np.int64)


def named_parameters(model: Qwen3Model) -> dict[str, np.ndarray]:
    """The model's trainable arrays by checkpoint tensor name (the arrays themselves, not copies).

    A tied LM head is the embedding table, so it appears once, as model.embed_tokens.weight.
    """
    params: dict[str, Weight] = {EMBED_TOKENS: model.embed_tokens}
    for i, layer in enumerate(model.layers):      # an ablation's layer lacks some; a sparse one has its experts
        params.update({spec.name.format(i=i): tensor for key, spec in layer_tensors(model.config, i).items()
                       if (tensor := layer.tensor(key)) is not None})
    params[FINAL_NORM] = model.norm
    if not model.config.tie_word_embeddings:
        params[LM_HEAD] = model.lm_head
    for name, array in params.items():
        if not gradients.trainable(array):
            raise QwenNPError(f"{name}: training needs FP32 weights in memory; load the model with memory='fp32'")
    return {name: array for name, array in params.items() if isinstance(array, np.ndarray)}


def loss_and_accumulated_gradients(model: Qwen3Model, batch: np.ndarray, micro_batches: int,
                                   threads: int = 1, shards: int | None = None, recompute: bool = False,
                                   precision: str = "fp32", loss_scale: float = 1.0, learned: np.ndarray | None = None,
                                   dropout: lora.Dropout | None = None, blas_threads: int | None = None
                                   ) -> tuple[float, dict[str, np.ndarray]]:
    """Gradient accumulation: the batch's loss and gradient from `micro_batches` equal slices of its rows.

    Each slice's mean loss and gradient are averaged, which equals the whole batch's mean (equal-sized
    slices); only one slice's activations are alive at a time, so memory drops by the same factor.
    Each slice is cut again into `shards` equal pieces (default: as many as divide its rows and
    `threads`), computed `threads` at a time and summed in shard order, each shard's products on
    `blas_threads` BLAS threads (default: the threads the shards leave, threads // shards): the result is the
    same mean, and bit for bit the same for any thread count with the same `shards` and `blas_threads`
    (OpenBLAS's Haswell kernel sums in another order on more threads; its SkylakeX kernel does not).
    recompute, precision, loss_scale: as loss_and_gradients, for every slice. learned [B, T+1] (chat SFT):
    the tokens the loss is over; the loss is then their mean over the whole batch: each token weighs
    pieces / count, so that the average over the pieces (micro-batches times shards) is sum / count
    whatever piece a token falls in. dropout: LoRA dropout, each piece (micro-batch times shard, numbered in
    order) with masks of its own (lora.Dropout.piece).
    """
    B = batch.shape[0]
    if micro_batches < 1 or B % micro_batches:
        raise QwenNPError(f"{micro_batches} does not divide the batch size {B}", "micro_batches")
    rows = B // micro_batches
    shards = math.gcd(rows, max(1, threads)) if shards is None else shards
    if shards < 1 or rows % shards:
        raise QwenNPError(f"{shards} does not divide the {rows} rows of a micro-batch", "shards")
    inner = max(1, threads // shards) if blas_threads is None else blas_threads

    weights = None
    if learned is not None:
        counted = np.asarray(learned, dtype=bool)[:, 1:]                            # [B, T]: predicted tokens
        weights = counted * (micro_batches * shards / max(1, int(counted.sum())))      # float64 [B, T]

    def step(part: np.ndarray, part_weights: np.ndarray | None, piece: int) -> tuple[float, dict[str, np.ndarray]]:
        return loss_and_gradients(model, part, recompute, precision, loss_scale, part_weights,
                                  None if dropout is None else dropout.piece(piece))

    total_loss, total = 0.0, dict[str, np.ndarray]()
    for micro, start in enumerate(range(0, B, rows)):
        loss, grads = _loss_and_gradients_in_shards(batch[start:start + rows], shards, threads, step,
                                                    None if weights is None else weights[start:start + rows],
                                                    micro * shards, inner)
        total_loss += loss / micro_batches
        for g in grads.values():
            g *= np.float32(1.0 / micro_batches)
        _add(total, grads)
    return total_loss, total


def _loss_and_gradients_in_shards(batch: np.ndarray, shards: int, threads: int,
                                  step: Callable[[np.ndarray, np.ndarray | None, int], tuple[float, dict[str, np.ndarray]]],
                                  weights: np.ndarray | None = None, first: int = 0, blas_threads: int = 1
                                  ) -> tuple[float, dict[str, np.ndarray]]:
    """step (a loss_and_gradients) of `shards` equal row slices, up to `threads` at once, averaged in shard order,
    each on `blas_threads` BLAS threads; step's third argument numbers the slices from `first` (the step's pieces:
    LoRA dropout's masks).

    Why threads: NumPy runs every elementwise pass (softmax, SiLU, norms, the cross-entropy) on one
    core, and OpenBLAS's threads wait on each other between the many small attention products; one
    whole slice per core keeps both cores busy. Measured in bench/README.md (training section).
    Why BLAS threads only where the shards leave cores (a batch of one row on two cores): OpenBLAS's threads
    spin-wait for each other, and each shard on one core of its own ran faster; but one shard on one of two
    cores left half the machine idle (bench/README.md, "A LoRA step and a full step"). The trainer saves
    blas_threads with the shards, so a run resumed with another --threads sums in the same order.
    """
    from concurrent.futures import ThreadPoolExecutor

    from ..engine.runtime import blas_threads as blas_limit

    rows = batch.shape[0] // shards
    slices = [batch[i * rows:(i + 1) * rows] for i in range(shards)]
    weight_slices = [None if weights is None else weights[i * rows:(i + 1) * rows] for i in range(shards)]
    loss, grads = 0.0, dict[str, np.ndarray]()
    with blas_limit(blas_threads), ThreadPoolExecutor(max(1, min(shards, threads))) as pool:
        for part_loss, part in pool.map(step, slices, weight_slices, range(first, first + shards)):   # in order
            loss += part_loss
            _add(grads, part)
    for g in grads.values():
        g *= np.float32(1.0 / shards)
    return loss / shards, grads


def _add(total: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> None:
    """total += grads, name by name (the first arrays are taken over, not copied)."""
    for name, g in grads.items():
        if name in total:
            total[name] += g
        else:
            total[name] = g


def global_norm(grads: dict[str, np.ndarray]) -> float:
    """The L2 norm of all gradients together, as if they were one vector (accumulated in float64)."""
    return math.sqrt(sum(float(np.vdot(g, g)) for g in grads.values()))


def clip_gradients(grads: dict[str, np.ndarray], max_norm: float) -> float:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)), as torch's clip_grad_norm_. Returns the norm before."""
    norm = global_norm(grads)
    scale = max_norm / (norm + 1e-6)
    if scale < 1.0:
        for g in grads.values():
            g *= np.float32(scale)
    return norm


def learning_rate(step: int, peak: float, warmup: int, total: int, final_fraction: float = 0.1) -> float:
    """Linear warmup to `peak` over `warmup` steps, then cosine decay to final_fraction * peak at `total`.

    step counts from 0 (the first update). Warmup keeps the first updates small while AdamW's second
    moments are still poor estimates.
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    floor = final_fraction * peak
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


@dataclass
class AdamW:
    """torch.optim.AdamW's update (its single-tensor CPU path), step for step.

    Weight decay is decoupled (it shrinks the weight, not the gradient) and applies only to the names
    in `decay`: here every matrix, embeddings included (as nanoGPT), never the RMSNorm weights, whose
    natural value is 1, not 0.
    """

    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay: set[str] = field(default_factory=set)
    m: dict[str, np.ndarray] = field(default_factory=dict)      # first moments, like the parameters
    v: dict[str, np.ndarray] = field(default_factory=dict)      # second moments
    step: int = 0                                               # updates done

    @staticmethod
    def decay_matrices(params: dict[str, np.ndarray]) -> set[str]:
        """The names weight decay applies to: every matrix (config.is_matrix), not the norms."""
        return {name for name in params if is_matrix(name)}

    def update(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray], lr: float) -> None:
        """One step: every parameter moves in place."""
        self.step += 1
        t = self.step
        step_size = lr / (1 - self.beta1 ** t)
        bias_correction2_sqrt = (1 - self.beta2 ** t) ** 0.5
        for name, p in params.items():
            g = grads[name]
            m = self.m.setdefault(name, np.zeros_like(p))
            v = self.v.setdefault(name, np.zeros_like(p))
            if name in self.decay:
                p *= 1 - lr * self.weight_decay                 # decoupled decay, applied first
            m += (1 - self.beta1) * (g - m)                      # torch's lerp form of b1*m + (1-b1)*g
            v *= self.beta2
            v += (1 - self.beta2) * g * g
            denom = np.sqrt(v) / bias_correction2_sqrt + self.eps
            p -= step_size * m / denom


def adamw_for(params: dict[str, np.ndarray], **settings: Any) -> AdamW:
    """An AdamW whose weight decay covers the matrices of `params`."""
    return AdamW(decay=AdamW.decay_matrices(params), **settings)
