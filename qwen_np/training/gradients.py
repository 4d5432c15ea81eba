"""The backward pass of Qwen3 by hand: the gradient of every op of layers.py, then of the whole network.

Read it next to layers.py: each `<op>_backward` takes dOut (the loss's gradient with respect to the op's
output, same shape) and what the forward saw, and returns the gradients of the op's inputs. "dX" always
means dLoss/dX and has X's shape. Shapes as in layers.py, with the batch axis written out: a training
batch is [B, T] token ids.

The network's forward for training (`forward_with_tape`) is model.py's forward, with no KV cache and a
trace that records the activations each layer's backward needs (the tape). `backward` walks the tape in reverse
and returns one FP32 gradient per checkpoint tensor name. Everything is FP32, like the reference
(transformers + torch autograd in FP32), which tests/training/test_gradients.py checks tensor by tensor; in
mixed-precision training (mixed.py) only the linear layers' operands are rounded, through the hook
layers.MATMUL_INPUTS that layers.linear and linear_backward read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence, TypeGuard, cast

import numpy as np

from . import lora
from ..core import layers
from ..core.config import DENSE_MLP, EMBED_TOKENS, FINAL_NORM, LM_HEAD, Qwen3Config, layer_tensors
from ..errors import QwenNPError
from ..numbers.numerics import FULL_PRECISION, Adapted, Weight, upcast

if TYPE_CHECKING:
    from ..core.model import LayerWeights, Qwen3Model

def trainable(weight: Weight) -> TypeGuard[np.ndarray]:
    """Whether training can update a weight in place: FULL_PRECISION arrays (FP32; float64 for the gradient
    checks). Not a bf16- or int8-loaded model's weights, which a product would not even read as numbers."""
    return isinstance(weight, np.ndarray) and weight.dtype in FULL_PRECISION


# --- One op at a time, in layers.py's order ----------------------------------------------------------


# A weight's gradient: an array like the weight, or for a LoRA-adapted projection its adapter's dA and dB.
Gradient = np.ndarray | lora.AdapterGradient


def linear_backward(d_out: np.ndarray, x: np.ndarray, weight: Weight) -> tuple[np.ndarray, Gradient]:
    """y = x W^T.  d_out [..., out], x [..., in], W [out, in] -> dx [..., in], dW [out, in].

    dx = dy W;  dW = dy^T x, summed over every row of the batch (one GEMM over the B*T rows).
    Under layers.MATMUL_INPUTS (mixed precision) each product reads its operands rounded, as the
    forward's did: dx = round(dy) round(W), dW = round(dy)^T round(x). dy is rounded twice, once per
    product, because the two sum over different axes (dx over `out`, dW over the rows), which FP8's
    1x128 scale tiles follow; x is the forward's FP32 input, rounded again to the same values.
    An adapted weight (LoRA, numerics.Adapted) is frozen: dx is the frozen path's plus the adapter's,
    and the gradient is the adapter's alone (lora.adapter_backward), under the forward's dropout mask.
    """
    if isinstance(weight, Adapted):
        drop = layers.ADAPTER_INPUTS.get()            # LoRA dropout: the forward's mask, drawn again
        keep, p = (drop.keep(x, weight), drop.p) if isinstance(drop, lora.Dropout) else (None, 0.0)
        dx, d_adapter = lora.adapter_backward(d_out, x, weight, keep, p)
        return dx + input_gradient(d_out, weight.base), d_adapter
    if not trainable(weight):
        raise QwenNPError("training needs FP32 weights in memory; load the model with memory='fp32'")
    d_rows, x_rows = d_out.reshape(-1, d_out.shape[-1]), x.reshape(-1, x.shape[-1])   # [B*T, out], [B*T, in]
    rounding = layers.MATMUL_INPUTS.get()
    if rounding is None:
        return input_gradient(d_out, weight), d_rows.T @ x_rows                      # [..., in], [out, in]
    d_weight = rounding(d_rows, "gradient", 0).T @ rounding(x_rows, "activation", 0)   # [out, in]
    return input_gradient(d_out, weight), d_weight


def input_gradient(d_out: np.ndarray, weight: Weight) -> np.ndarray:
    """dx = dy W alone: what a frozen weight (a LoRA base, or any weight of a model with adapters) passes
    back. Any kind of weight: a frozen base may stay as the checkpoint stores it (BF16, int8: QLoRA's
    idea), widened to FP32 for this product only (one matrix at a time)."""
    if not isinstance(weight, np.ndarray):
        return d_out @ upcast(weight)                                                # [..., in]
    rounding = layers.MATMUL_INPUTS.get()
    if rounding is None:
        return d_out @ weight
    return rounding(d_out, "gradient", -1) @ rounding(weight, "weight", 0)


def embed_backward(d_out: np.ndarray, token_ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """Row lookup, reversed: scatter-add each position's gradient into its token's row.

    d_out [B, T, D], token_ids [B, T] -> d_embed_tokens [V, D]. A token seen twice gets both
    gradients: np.add.at accumulates repeated indices, where `d[ids] += rows` would keep only one.
    """
    d_table = np.zeros((vocab_size, d_out.shape[-1]), dtype=d_out.dtype)             # [V, D]
    np.add.at(d_table, token_ids.reshape(-1), d_out.reshape(-1, d_out.shape[-1]))
    return d_table


def rms_norm_backward(d_out: np.ndarray, x: np.ndarray, weight: np.ndarray,
                      eps: float) -> tuple[np.ndarray, np.ndarray]:
    """y = w * x_hat, x_hat = x * r, r = 1 / sqrt(mean(x^2) + eps), over the last axis of size n.

    dw = sum over all rows of dy * x_hat (the per-head q/k norms share one [Dh] weight across heads
    and positions, so their sum runs over those too).  With g = dy * w:
    dx = r * (g - x_hat * mean(g * x_hat)): the second term is r's own dependence on x.
    """
    r = np.float32(1.0) / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))  # [..., 1]
    x_hat = x * r                                                                    # [..., n]
    d_weight = (d_out * x_hat).reshape(-1, x.shape[-1]).sum(axis=0)                  # [n]
    g = d_out * weight                                                               # [..., n]
    dx = r * (g - x_hat * np.mean(g * x_hat, axis=-1, keepdims=True))                # [..., n]
    return dx, d_weight


def rope_backward(d_out: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """RoPE rotates each (i, i + Dh/2) pair by the angle theta; its transpose rotates by -theta.

    So the backward is the forward with sin negated: dx1 = dy1 cos + dy2 sin, dx2 = dy2 cos - dy1 sin.
    d_out [B, T, heads, Dh] -> dx [B, T, heads, Dh].
    """
    return layers.rope(d_out, cos, -sin)


def softmax_backward(d_probs: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """p = softmax(s) over the last axis:  ds = p * (dp - sum_j dp_j p_j).

    Masked (future) positions have p = 0 exactly, so their ds is 0: the causal mask needs no
    backward of its own.
    """
    d_scores = d_probs * probs                                                      # [..., S]
    d_scores -= probs * np.sum(d_scores, axis=-1, keepdims=True)                     # p*dp - p*sum(dp*p)
    return d_scores


def sum_over_groups(d_repeated: np.ndarray, kv_heads: int) -> np.ndarray:
    """Undo GQA's np.repeat: [B, H, S, Dh] (one per query head) -> [B, S, KVH, Dh] (one per KV head).

    Query head h read KV head h // group, so heads kv*group .. kv*group + group-1 sum into head kv.
    """
    B, H, S, Dh = d_repeated.shape
    summed = d_repeated.reshape(B, kv_heads, H // kv_heads, S, Dh).sum(axis=2)       # [B, KVH, S, Dh]
    return layers.heads_first(summed)                                                # [B, S, KVH, Dh]


def contiguous_heads(x: np.ndarray) -> np.ndarray:
    """[B, T, H, Dh] -> [B, H, T, Dh] copied contiguous. Trap: np.matmul of a transposed stack by a
    strided one falls back to a loop without BLAS, ~40x slower here (see bench/README.md)."""
    return np.ascontiguousarray(layers.heads_first(x))


def weighted_sum_backward(d_out: np.ndarray, probs: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """out = probs @ v per head.  d_out [B, T, H*Dh], probs [B, H, T, S], v [B, S, KVH, Dh].

    dprobs = dout v^T;  dv = probs^T dout, summed over the query heads sharing each KV head.
    """
    B, H, T, _ = probs.shape
    KVH, Dh = v.shape[-2:]
    d_heads = contiguous_heads(d_out.reshape(B, T, H, Dh))                          # [B, H, T, Dh]
    v_heads = layers.heads_first(np.repeat(v, H // KVH, axis=-2))                    # [B, H, S, Dh]
    d_probs = d_heads @ np.swapaxes(v_heads, -1, -2)                                 # [B, H, T, S]
    dv = sum_over_groups(np.swapaxes(probs, -1, -2) @ d_heads, KVH)                  # [B, S, KVH, Dh]
    return d_probs, dv


def attention_scores_backward(d_scores: np.ndarray, q: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """scores = q k^T * s, s = Dh^-0.5.  d_scores [B, H, T, S], q [B, T, H, Dh], k [B, S, KVH, Dh].

    dq = ds k * s;  dk = ds^T q * s, summed over the query heads sharing each KV head.
    """
    H, KVH, Dh = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = np.float32(Dh ** -0.5)                  # applied to the [.., Dh] products, not the [.., T, S] scores
    k_heads = layers.heads_first(np.repeat(k, H // KVH, axis=-2))                    # [B, H, S, Dh]
    dq = layers.heads_first(d_scores @ k_heads) * scale                              # [B, T, H, Dh]
    dk = sum_over_groups(np.swapaxes(d_scores, -1, -2) @ contiguous_heads(q), KVH) * scale   # [B, S, KVH, Dh]
    return dq, dk


def attention_backward(d_out: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                       probs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """layers.attention reversed: weighted sum, softmax (the mask passes nothing back), scores.

    d_out [B, T, H*Dh] -> dq [B, T, H, Dh], dk and dv [B, S, KVH, Dh].
    """
    d_probs, dv = weighted_sum_backward(d_out, probs, v)                             # [B, H, T, S]
    d_scores = softmax_backward(d_probs, probs)                                      # [B, H, T, S]
    dq, dk = attention_scores_backward(d_scores, q, k)
    return dq, dk, dv


def silu_backward(d_out: np.ndarray, x: np.ndarray) -> np.ndarray:
    """d/dx [x * sigmoid(x)] = sigmoid(x) * (1 + x * (1 - sigmoid(x)))."""
    with np.errstate(over="ignore"):                  # exp(-x) = inf for x << 0 gives sigmoid 0: right
        sig = np.float32(1.0) / (np.float32(1.0) + np.exp(-x))
    return d_out * sig * (np.float32(1.0) + x * (np.float32(1.0) - sig))


def swiglu_backward(d_out: np.ndarray, x: np.ndarray, gate: np.ndarray, up: np.ndarray, gate_proj: Weight,
                    up_proj: Weight, down_proj: Weight) -> tuple[np.ndarray, dict[str, Gradient]]:
    """down(silu(gate) * up) reversed.  d_out [B, T, D]; x [B, T, D]; gate, up [B, T, F] from the forward.

    Returns dx [B, T, D] and the three weights' gradients. x feeds both gate_proj and up_proj, so
    its gradient is the sum of the two paths.
    """
    silu_gate = layers.silu(gate)                                                    # [B, T, F]
    d_act, d_down = linear_backward(d_out, silu_gate * up, down_proj)                # [B, T, F]
    d_gate = silu_backward(d_act * up, gate)                                         # [B, T, F]
    d_up = d_act * silu_gate                                                         # [B, T, F]
    dx_gate, d_gate_proj = linear_backward(d_gate, x, gate_proj)                     # [B, T, D]
    dx_up, d_up_proj = linear_backward(d_up, x, up_proj)                             # [B, T, D]
    return dx_gate + dx_up, {"gate_proj": d_gate_proj, "up_proj": d_up_proj, "down_proj": d_down}


def route_backward(d_weights: np.ndarray, probs: np.ndarray, chosen: np.ndarray, normalize: bool) -> np.ndarray:
    """layers.route reversed: d weights [N, K] -> d router logits [N, E].  probs [N, E] (the softmax), chosen [N, K].

    The top-k choice is piecewise constant in the logits (a small change moves no token to another expert), so it
    passes nothing back: the K weights are the chosen experts' probabilities p_k, and their gradient lands on those
    E-entries only. With norm_topk_prob, w_k = p_k / S, S = sum_j p_j over the K chosen, and
    dp_k = (dw_k - sum_j dw_j w_j) / S (S's own dependence on p_k: a weight renormalised does not care about the
    scale of the K together). Then the softmax: every logit moves, the unchosen ones through its denominator.
    """
    picked = np.take_along_axis(probs, chosen, axis=-1)                              # [N, K]
    if normalize:
        total = picked.sum(axis=-1, keepdims=True)                                   # S [N, 1]
        d_picked = (d_weights - np.sum(d_weights * (picked / total), axis=-1, keepdims=True)) / total
    else:
        d_picked = d_weights
    d_probs = np.zeros_like(probs)                                                   # [N, E]
    np.put_along_axis(d_probs, chosen, d_picked, axis=-1)        # K distinct experts a row: no two land together
    return softmax_backward(d_probs, probs)


def moe_backward(d_out: np.ndarray, x: np.ndarray, router_logits: np.ndarray, router: Weight,
                 experts: Sequence[layers.Expert], top_k: int, normalize: bool,
                 d_router_logits: np.ndarray | None = None) -> tuple[np.ndarray, dict[str, Gradient]]:
    """layers.moe reversed: out = sum over each token's K chosen experts of w_k * expert_k(x).
    d_out, x [N, D] (the N = B*T rows); router_logits [N, E] from the forward; d_router_logits [N, E]: what the
    load-balancing loss adds to the logits' gradient (None: no such loss).

    Per expert e, over the n rows routed to it: dw = <d_out, expert_e(x)> (each row's weight scales its whole
    output), and expert_e's SwiGLU backward with d_out * w. The expert's activations are computed again here from
    x (the tape keeps only the router's logits: keeping them would be 2 K Fe values a token, traded here for one
    more pass of the chosen experts' products), with the same rows and products as the forward's, so the same
    values. dx sums every chosen expert's path and the router's (logits = x router^T). An expert no token chose
    gets a zero gradient (AdamW still steps its decay).
    Returns dx [N, D] and the gradients keyed as config.layer_tensors: "router", "experts.{e}.gate_proj", ...
    """
    probs = layers.router_probabilities(router_logits)                               # [N, E]
    chosen, weights = layers.route(router_logits, top_k, normalize)                  # [N, K] each
    dx, d_weights = np.zeros_like(x), np.zeros_like(weights)                         # [N, D], [N, K]
    grads: dict[str, Gradient] = {}
    for e, (gate_proj, up_proj, down_proj) in enumerate(experts):
        tokens, slot = np.nonzero(chosen == e)           # the rows routed to expert e, and which of their K picks
        if tokens.size == 0:
            grads.update({f"experts.{e}.{key}": np.zeros(w.shape, d_out.dtype)
                          for key, w in zip(DENSE_MLP, (gate_proj, up_proj, down_proj))})
            continue
        x_e = x[tokens]                                                              # [n, D]
        gate, up = layers.linear(x_e, gate_proj), layers.linear(x_e, up_proj)        # [n, Fe] each
        y = layers.linear(layers.silu(gate) * up, down_proj)                         # expert_e(x) [n, D]
        d_weights[tokens, slot] = np.sum(d_out[tokens] * y, axis=-1)                 # [n]
        dx_e, branch = swiglu_backward(d_out[tokens] * weights[tokens, slot, None], x_e, gate, up,
                                       gate_proj, up_proj, down_proj)                # [n, D]
        dx[tokens] += dx_e                # a token picks an expert at most once: `tokens` has no repeats
        grads.update({f"experts.{e}.{key}": g for key, g in branch.items()})
    d_logits = route_backward(d_weights, probs, chosen, normalize)                   # [N, E]
    if d_router_logits is not None:
        d_logits = d_logits + d_router_logits
    dx_router, grads["router"] = linear_backward(d_logits, x, router)                # [N, D], [E, D]
    return dx + dx_router, grads


def gelu_backward(d_out: np.ndarray, x: np.ndarray) -> np.ndarray:
    """layers.gelu reversed. With t = tanh(c (x + a x^3)):
    d/dx [0.5 x (1 + t)] = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2)."""
    c, a = layers.GELU_C, layers.GELU_CUBIC
    t = np.tanh(c * (x + a * x * x * x))
    half = np.float32(0.5)
    return d_out * (half * (np.float32(1.0) + t) + half * x * (np.float32(1.0) - t * t) * c * (np.float32(1.0) + 3 * a * x * x))


def gelu_mlp_backward(d_out: np.ndarray, x: np.ndarray, up: np.ndarray, up_proj: Weight,
                      down_proj: Weight) -> tuple[np.ndarray, dict[str, Gradient]]:
    """down(gelu(up(x))) reversed (the GELU-MLP ablation).  d_out [B, T, D]; x [B, T, D]; up [B, T, F] from the forward."""
    d_act, d_down = linear_backward(d_out, layers.gelu(up), down_proj)               # [B, T, F]
    dx, d_up_proj = linear_backward(gelu_backward(d_act, up), x, up_proj)            # [B, T, D]
    return dx, {"up_proj": d_up_proj, "down_proj": d_down}


def cross_entropy(logits: np.ndarray, targets: np.ndarray,
                  weights: np.ndarray | None = None) -> tuple[float, np.ndarray]:
    """Mean next-token cross-entropy and its gradient, with the log-softmax fused in.

    logits [B, T, V], targets [B, T] -> loss (mean over the B*T positions, as transformers' loss with
    labels) and dlogits = (softmax(logits) - onehot(target)) / (B*T). Shifting by the row max keeps
    exp() finite; the mean is accumulated in float64 so a long batch does not lose digits.
    weights [B, T]: each position's weight instead of 1 / (B*T) (chat SFT: 1 / count on the assistant's
    tokens, 0 elsewhere, as transformers' labels of -100): loss = sum(w * nll), dlogits scaled the same.
    One [B, T, V] array is made and reused in place (exp, then softmax): at Qwen3's 151,936-way vocabulary
    each is 78 MB for 128 tokens, whose fresh pages cost more to fault in than the pass itself (a LoRA
    step's loss took ~0.4 s with three of them).
    """
    shifted = logits - logits.max(axis=-1, keepdims=True)                            # [B, T, V]
    target_shifted = np.take_along_axis(shifted, targets[..., None], axis=-1)       # [B, T, 1]
    exp = np.exp(shifted, out=shifted)                                               # [B, T, V], in place
    total = exp.sum(axis=-1, keepdims=True)                                          # [B, T, 1]
    picked = target_shifted - np.log(total)                                          # log p(target) [B, T, 1]
    d_logits = np.divide(exp, total, out=exp)                                        # softmax [B, T, V]
    np.add.at(d_logits, (*np.indices(targets.shape), targets), np.float32(-1.0))     # - onehot
    if weights is not None:
        d_logits *= weights[..., None].astype(d_logits.dtype)
        return -float((picked[..., 0] * weights).sum(dtype=np.float64)), d_logits
    n = targets.size
    d_logits *= np.float32(1.0 / n)
    return -float(picked.sum(dtype=np.float64)) / n, d_logits


def load_balancing_loss(router_logits: Sequence[np.ndarray], top_k: int) -> tuple[float, list[np.ndarray]]:
    """A Qwen3-MoE's auxiliary loss, transformers' load_balancing_loss_func (the Switch Transformer's), and its
    gradient. router_logits: the sparse layers' (L_s of them; a dense layer has no router), each [..., E], taken
    together as one set of M = L_s * (B*T) rows:

        f_e = (how often expert e is among a row's top_k) / M      the load: sums to K over the experts
        P_e = sum over the rows of softmax(logits)_e / M            the router's mean probability: sums to 1
        loss = E * sum_e f_e P_e

    Uniform routing gives K; a router that sends most rows to a few experts and is sure of it, more. The training
    loss adds it times config.router_aux_loss_coef (transformers: when output_router_logits; it is what keeps the
    experts from collapsing to a few). f is piecewise constant (counts of a top-k), so only P passes a gradient:
    d loss / d p_{r,e} = E f_e / M for every row r, then each row's softmax backward.
    Returns the loss and d loss / d logits, one array per layer, each its logits' shape.
    """
    E = router_logits[0].shape[-1]
    rows = [logits.reshape(-1, E) for logits in router_logits]                        # L_s x [N, E]
    probs = [layers.router_probabilities(r) for r in rows]                           # L_s x [N, E]
    M = sum(len(r) for r in rows)
    load = np.zeros(E, dtype=np.float64)                                             # f_e * M
    for r in rows:
        load += np.bincount(layers.route(r, top_k, normalize=False)[0].reshape(-1), minlength=E)
    f = load / M                                                                     # [E]
    mean_prob = sum(p.sum(axis=0, dtype=np.float64) for p in probs) / M             # P [E]
    d_p = (E * f / M).astype(probs[0].dtype)                                         # [E], the same for every row
    d_logits = [softmax_backward(np.broadcast_to(d_p, p.shape), p).reshape(logits.shape)
                for p, logits in zip(probs, router_logits)]
    return float(E * np.dot(f, mean_prob)), d_logits


def token_log_probs(logits: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """log p(target) at every position, and the softmax its backward needs: what DPO and GRPO (objectives.py)
    build their losses from, as cross_entropy is SFT's.  logits [B, T, V], targets [B, T] -> [B, T], [B, T, V].

    In the logits' dtype (FP32 in training; float64 in the tests), the row max shifted out so exp() stays finite."""
    shifted = logits - logits.max(axis=-1, keepdims=True)                            # [B, T, V]
    exp = np.exp(shifted)                                                            # [B, T, V]
    total = exp.sum(axis=-1, keepdims=True)                                          # [B, T, 1]
    picked = np.take_along_axis(shifted, targets[..., None], axis=-1) - np.log(total)   # [B, T, 1]
    return picked[..., 0], exp / total


def token_log_probs_backward(d_log_probs: np.ndarray, probs: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """token_log_probs reversed: d log p_y / d logits = onehot(y) - softmax, so
    d_logits = d_log_probs * (onehot(target) - probs).  d_log_probs [B, T], probs [B, T, V] -> [B, T, V]."""
    d_logits = probs * -d_log_probs[..., None].astype(probs.dtype)                   # [B, T, V]
    np.add.at(d_logits, (*np.indices(targets.shape), targets), d_log_probs.astype(probs.dtype))
    return d_logits


# --- The whole network -------------------------------------------------------------------------------


@dataclass
class LayerTape:
    """What one decoder layer's backward needs from its forward (all [B, T, ...] FP32). An ablation's layer
    records the same steps, the ones it skips holding their input (model.decoder_layer)."""

    x: np.ndarray          # layer input (the residual stream)           [B, T, D]
    h: np.ndarray          # input_layernorm(x), attention's input        [B, T, D]
    q: np.ndarray          # q_proj(h), before q_norm                     [B, T, H, Dh]
    k: np.ndarray          # k_proj(h), before k_norm                     [B, T, KVH, Dh]
    v: np.ndarray          # v_proj(h)                                    [B, T, KVH, Dh]
    q_rot: np.ndarray      # rope(q_norm(q))                              [B, T, H, Dh]
    k_rot: np.ndarray      # rope(k_norm(k))                              [B, T, KVH, Dh]
    probs: np.ndarray      # softmax(masked scores)                       [B, H, T, T]
    mixed: np.ndarray      # attention output, o_proj's input             [B, T, H*Dh]
    x_mid: np.ndarray      # x + o_proj(mixed)                            [B, T, D]
    h_mlp: np.ndarray      # post_attention_layernorm(x_mid), MLP's input [B, T, D]
    x_out: np.ndarray      # x_mid + mlp(h_mlp): the layer's output (post-norm: before its norm)  [B, T, D]
    up: np.ndarray | None = None       # up_proj(h_mlp); None in a sparse layer  [B, T, F]
    gate: np.ndarray | None = None     # gate_proj(h_mlp); None in a GELU MLP or a sparse layer  [B, T, F]
    router_logits: np.ndarray | None = None   # a sparse layer's router(h_mlp) (Qwen3-MoE)  [B, T, E]


@dataclass
class Tape:
    """The whole forward's saved activations."""

    token_ids: np.ndarray          # [B, T]
    cos: np.ndarray                # [T, Dh]
    sin: np.ndarray                # [T, Dh]
    inputs: list[np.ndarray]       # each layer's input, the residual stream  L x [B, T, D]
    layers: list[LayerTape] | None   # each layer's activations; None: recomputed in the backward
    x_final: np.ndarray            # the residual stream before the final norm  [B, T, D]
    h_final: np.ndarray            # norm(x_final), the LM head's input          [B, T, D]
    # Every sparse layer's router logits (Qwen3-MoE), kept even with recomputation: the load-balancing loss
    # reads all of them before the backward starts.  layer -> [B, T, E]
    router_logits: dict[int, np.ndarray]


def decoder_layer_backward(d_out: np.ndarray, w: LayerWeights, tape: LayerTape, cos: np.ndarray, sin: np.ndarray,
                           config: Qwen3Config, d_router_logits: np.ndarray | None = None
                           ) -> tuple[np.ndarray, dict[str, Gradient]]:
    """model.py's decoder layer (as Recorder notes it) reversed.  d_out [B, T, D] -> dx [B, T, D] and the layer's 11 gradients
    (fewer for an ablation without some weights; a sparse layer's: the router and 3 per expert in the MLP's 3's place).
    d_router_logits [B, T, E]: a sparse layer's share of the load-balancing loss's gradient (load_balancing_loss).

    Two residual blocks (residual_block_backward), the MLP's then the attention's, each with its branch's backward.
    """
    B, T, _ = d_out.shape
    eps = config.rms_norm_eps
    grads: dict[str, Gradient] = {}

    def mlp_backward(d_mlp_out: np.ndarray) -> np.ndarray:                          # -> d h_mlp [B, T, D]
        if w.router is not None and w.experts is not None and tape.router_logits is not None:   # Qwen3-MoE's sparse layer
            E = config.num_experts
            d_rows, branch = moe_backward(
                d_mlp_out.reshape(B * T, -1), tape.h_mlp.reshape(B * T, -1), tape.router_logits.reshape(B * T, E),
                w.router, w.experts, config.num_experts_per_tok, config.norm_topk_prob,
                None if d_router_logits is None else d_router_logits.reshape(B * T, E))
            grads.update(branch)
            return d_rows.reshape(B, T, -1)
        up, down, up_out = cast(Weight, w.up_proj), cast(Weight, w.down_proj), cast(np.ndarray, tape.up)   # dense
        if w.gate_proj is None or tape.gate is None:                                 # ablation: the GELU MLP
            d_h, branch = gelu_mlp_backward(d_mlp_out, tape.h_mlp, up_out, up, down)
        else:
            d_h, branch = swiglu_backward(d_mlp_out, tape.h_mlp, tape.gate, up_out, w.gate_proj, up, down)
        grads.update(branch)
        return d_h

    def attention_branch_backward(d_attn_out: np.ndarray) -> np.ndarray:           # -> d h [B, T, D]
        d_mixed, grads["o_proj"] = linear_backward(d_attn_out, tape.mixed, w.o_proj)   # [B, T, H*Dh]
        dq, dk, dv = attention_backward(d_mixed, tape.q_rot, tape.k_rot, tape.v, tape.probs)
        if config.use_rope:                                                          # ablation: no RoPE, nothing to undo
            dq, dk = rope_backward(dq, cos, sin), rope_backward(dk, cos, sin)
        if w.q_norm is not None and w.k_norm is not None:                            # ablation: no QK-norm
            dq, grads["q_norm"] = rms_norm_backward(dq, tape.q, w.q_norm, eps)       # [B, T, H, Dh]
            dk, grads["k_norm"] = rms_norm_backward(dk, tape.k, w.k_norm, eps)       # [B, T, KVH, Dh]
        dh_q, grads["q_proj"] = linear_backward(dq.reshape(B, T, -1), tape.h, w.q_proj)   # [B, T, D]
        dh_k, grads["k_proj"] = linear_backward(dk.reshape(B, T, -1), tape.h, w.k_proj)
        dh_v, grads["v_proj"] = linear_backward(dv.reshape(B, T, -1), tape.h, w.v_proj)
        return dh_q + dh_k + dh_v

    between = tape.x_mid if config.norm_position == "pre" else tape.h_mlp          # the stream between the blocks
    d_between, grads["post_attention_layernorm"] = residual_block_backward(
        d_out, between, tape.x_out, w.post_attention_layernorm, mlp_backward, config)
    dx, grads["input_layernorm"] = residual_block_backward(
        d_between, tape.x, tape.x_mid, w.input_layernorm, attention_branch_backward, config)
    return dx, grads


def residual_block_backward(d_out: np.ndarray, x: np.ndarray, total: np.ndarray, norm: np.ndarray,
                            branch_backward: Callable[[np.ndarray], np.ndarray],
                            config: Qwen3Config) -> tuple[np.ndarray, np.ndarray]:
    """One block of a decoder layer reversed: Qwen3's out = x + f(norm(x)), or an ablation's: post-norm
    out = norm(x + f(x)); without the residual, f alone in place of x + f.  d_out, x, total [B, T, D].

    total: the forward's sum x + f (f without the residual), which post-norm normalizes. branch_backward: f's
    backward (d f -> d of f's input; it keeps f's weight gradients). Returns dx and the norm weight's gradient.
    The residual passes d_out's gradient straight through to x, around the branch: why deep stacks train.
    """
    eps = config.rms_norm_eps
    if config.norm_position == "pre":
        d_total = d_out
        dx, d_norm = rms_norm_backward(branch_backward(d_total), x, norm, eps)
    else:
        d_total, d_norm = rms_norm_backward(d_out, total, norm, eps)
        dx = branch_backward(d_total)
    return (dx + d_total if config.use_residual else dx), d_norm


# The trace notes of model.py's decoder layer that its backward reads: LayerTape's field -> step name.
# Every other note of the forward (scores, act_fn, ...) is dropped as it is made.
TAPE_STEPS = {"h": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
              "q_rot": "self_attn.rope_q", "k_rot": "self_attn.rope_k", "probs": "self_attn.softmax",
              "mixed": "self_attn.weighted_sum", "x_mid": "residual_attn", "h_mlp": "post_attention_layernorm",
              "gate": "mlp.gate_proj", "up": "mlp.up_proj", "router_logits": "mlp.gate", "x_out": "residual_mlp"}


class Recorder:
    """A trace for model.py's forward that keeps what the backward needs: the tape is the trace.

    The forward packs the B sequences one after another as rows [B*T, ...]; attention runs one sequence
    at a time, so its softmax is noted B times, [H, T, T] each. `layers`: the layers whose activations
    are kept (all of them; none with recomputation, which keeps only each layer's input)."""

    def __init__(self, layers: range) -> None:
        self.wanted = {f"model.layers.{i}.{step}": (i, field) for i in layers for field, step in TAPE_STEPS.items()}
        self.layers: dict[int, dict[str, list[np.ndarray]]] = {i: {} for i in layers}
        self.outputs: dict[str, np.ndarray] = {}            # the embedding, each layer's output, the final norm
        self.router_logits: dict[int, np.ndarray] = {}      # every sparse layer's, recomputing or not  [B*T, E]

    def __call__(self, name: str, value: np.ndarray) -> None:
        if name in self.wanted:
            i, field = self.wanted[name]
            self.layers[i].setdefault(field, []).append(value)
        if name.endswith(".mlp.gate"):                                  # model.layers.{i}.mlp.gate
            self.router_logits[int(name.split(".")[2])] = value
        if name == "model.embed_tokens" or name == "model.norm":
            self.outputs[name] = value
        elif name.endswith((".residual_mlp", ".post_norm_mlp")):      # a layer's output: the last of these it notes
            self.outputs[name.rsplit(".", 1)[0]] = value

    def layer_tape(self, i: int, x: np.ndarray, B: int, T: int) -> LayerTape:
        """Layer i's record, rows [B*T, ...] as [B, T, ...] and the softmaxes stacked; x: its input [B, T, D]."""
        fields = {field: np.stack(values) if field == "probs" else values[0].reshape(B, T, *values[0].shape[1:])
                  for field, values in self.layers[i].items()}                           # probs [B, H, T, T]
        return LayerTape(x=x, **fields)

    def tape(self, token_ids: np.ndarray, config: Qwen3Config, inv_freq: np.ndarray, rope_scale: float) -> Tape:
        """The record as the backward reads it."""
        B, T = token_ids.shape
        cos, sin = layers.rope_angles(inv_freq, np.arange(T), rope_scale)            # [T, Dh] each
        names = ["model.embed_tokens"] + [f"model.layers.{i}" for i in range(config.num_hidden_layers)]
        inputs = [self.outputs[name].reshape(B, T, -1) for name in names]            # L + 1 x [B, T, D]
        kept = [self.layer_tape(i, inputs[i], B, T) for i in self.layers] if self.layers else None
        return Tape(token_ids, cos, sin, inputs[:-1], kept, inputs[-1], self.outputs["model.norm"].reshape(B, T, -1),
                    {i: logits.reshape(B, T, -1) for i, logits in self.router_logits.items()})


def forward_with_tape(model: Qwen3Model, token_ids: np.ndarray, recompute: bool = False) -> tuple[np.ndarray, Tape]:
    """Logits [B, T, V] for a batch of sequences that all start at position 0, and the tape.

    This is model.py's forward itself (the readable path, which every traced call runs), with a
    Recorder as its trace: there is one copy of the network, and the backward reads what it noted.
    recompute (activation checkpointing): keep only each layer's input; the backward runs each layer
    again, just before it needs it, so one layer's activations are alive at a time instead of L."""
    B, T = token_ids.shape
    record = Recorder(range(0 if recompute else model.config.num_hidden_layers))
    logits = model.forward_batch(list(token_ids), [None] * B, trace=record)          # [B*T, V]
    return logits.reshape(B, T, -1), record.tape(token_ids, model.config, model.inv_freq, model.rope_scale)


def recomputed_layer(model: Qwen3Model, i: int, tape: Tape) -> LayerTape:
    """Layer i's activations, by running model.decoder_layer on its saved input again: the same function on
    the same values, so the same bits as the forward's."""
    B, T = tape.token_ids.shape
    record = Recorder(range(i, i + 1))
    batch = model.pack(list(tape.token_ids), [None] * B)                  # the forward's packed rows, again
    model.decoder_layer(i, tape.inputs[i].reshape(B * T, -1), batch, record)
    return record.layer_tape(i, tape.inputs[i], B, T)


def backward(model: Qwen3Model, tape: Tape, d_logits: np.ndarray,
             d_router_logits: dict[int, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Every parameter's gradient, keyed by checkpoint tensor name.  d_logits [B, T, V]; d_router_logits: a
    Qwen3-MoE's load-balancing loss's gradient, sparse layer -> [B, T, E] (None: the loss has no such term).

    A tied LM head is the embedding table itself: its gradient adds into model.embed_tokens.weight
    and there is no lm_head.weight. A model with LoRA adapters (lora.add_adapters) trains its adapters
    only: the gradients are theirs (named as lora.adapter_parameters), and the frozen rest's are not
    formed where that saves work (the LM head's [V, D] product, the embedding's scatter, the norms).
    """
    config = model.config
    adapted = lora.has_adapters(model)
    grads: dict[str, np.ndarray] = {}
    if adapted:
        d_h, d_head = input_gradient(d_logits, model.lm_head), None                  # [B, T, D]
    else:
        d_h, d_head = linear_backward(d_logits, tape.h_final, model.lm_head)         # [B, T, D], [V, D]
    dx, d_final_norm = rms_norm_backward(d_h, tape.x_final, model.norm, config.rms_norm_eps)
    for i in reversed(range(config.num_hidden_layers)):
        layer_tape = tape.layers[i] if tape.layers is not None else recomputed_layer(model, i, tape)
        dx, layer_grads = decoder_layer_backward(dx, model.layers[i], layer_tape, tape.cos, tape.sin, config,
                                                 (d_router_logits or {}).get(i))
        del layer_tape                                   # recomputed: freed before the next layer's
        specs = layer_tensors(config, i)
        for key, g in layer_grads.items():
            name = specs[key].name.format(i=i)
            if isinstance(g, lora.AdapterGradient):
                grads[lora.adapter_name(name, "A")], grads[lora.adapter_name(name, "B")] = g.a, g.b
            elif not adapted:
                grads[name] = g
    if adapted or not isinstance(d_head, np.ndarray):
        return grads
    grads[FINAL_NORM] = d_final_norm
    d_embed = embed_backward(dx, tape.token_ids, config.vocab_size)                  # [V, D]
    if config.tie_word_embeddings:
        grads[EMBED_TOKENS] = d_embed + d_head
    else:
        grads[EMBED_TOKENS], grads[LM_HEAD] = d_embed, d_head
    return grads
