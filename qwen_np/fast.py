"""The fast forward path: the same math as model.py, arranged so that a token costs little more than
reading every weight once.

Decoding is memory-bound: each new token reads every weight and does one multiply-add with it. So
this path adds no new math; it stops wasting memory traffic and Python time:

* Activation buffers for a call are allocated once per token count and reused by every layer; a
  decode step (T = 1) reuses the same ones token after token. Elementwise steps write in place.
* q/k/v and gate/up are one matrix each (fuse_projections); q and k get one RMSNorm and one RoPE call.
* Attention reads the KV cache where it lies: the queries served by one KV head are stacked into a
  [group*T, Dh] matrix and multiplied with that head's cached keys as a strided view, which BLAS
  accepts, instead of np.repeat-copying the whole cache for every layer and token. A decode step
  uses one GEMV per query (np.matvec / np.vecmat) instead.
* A weight kept as BF16 is streamed: each worker thread upcasts a block of rows into its own reused
  FP32 buffer that stays in cache, multiplies it from there with single-threaded BLAS, and moves on.
  NumPy's BF16 upcast is single-threaded, so splitting rows between threads is what lets both cores
  convert (upcast alone: 24 GB/s of BF16 on one thread, 38 on two). The norms, RoPE, attention and
  SiLU of a prompt are then split by token rows between the same threads.
* Prefill for generation asks for the last position's logits only (forward(last_only=True)).

The decode buffers and fused weights are kept per model, so one model must not run two forward
passes at once from different threads (the readable path has no such state).

Where a decode step's time goes (measured, per token, 128-192 cached positions): Qwen3-0.6B FP32
54.0 ms in a process streaming at ~49 GB/s = products 49.1, attention 2.6 (one GEMV per query and
KV head: call overhead and cache misses, not bandwidth), norms 0.8, RoPE 0.3, SiLU 0.2, the rest
(Python per layer, logits) 1.0; Qwen3-8B BF16 625 ms = products 614 (the same products alone, back
to back: 617-628 ms).

Every function reproduces the matching function in layers.py up to FP32 rounding (BLAS may sum in a
different order); tests/test_fast_path.py holds the two paths to 1e-5 relative.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import nullcontext
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from . import layers
from .memory import allocate, usable_cores
from .numerics import upcast

try:  # optional: its C cast upcasts BF16 about 1.5x faster than NumPy's shift (see _upcast_rows)
    import ml_dtypes
except ImportError:  # pragma: no cover - exercised only where ml_dtypes is missing
    ml_dtypes = None

if TYPE_CHECKING:  # model.py imports this module; these names are needed only for the type hints
    from .config import Qwen3Config
    from .model import KVCache, LayerWeights, Qwen3Model

# FP32 bytes each thread upcasts per block of a BF16 weight (two threads: 16 MiB of the 32 MiB L3).
# Measured with two threads over 1 GiB of BF16 [rows, 4096], BF16 GB/s: blocks of 2 MiB 24.8,
# 4 MiB 27.1, 8 MiB 26.2 (the upcast alone runs at ~38 and the GEMV from cache at 40-78, so the sum
# of the two bounds it); Qwen3-8B decode with 1, 2, 4, 8 MiB blocks: 1.18, 1.41, 1.47, 1.60 tok/s
# (fewer, larger blocks: less Python per weight, longer BLAS calls); 0.6B: 8 MiB best, 16 MiB worse.
BLOCK_BYTES = 8 * 1024 ** 2


# --- threads -------------------------------------------------------------------------------------
#
# FP32 products use BLAS's own threads. Products with a BF16 weight split the weight's rows between
# our threads instead, each running single-threaded BLAS on its slice: NumPy's BF16 upcast is
# single-threaded, and only with the rows split do both cores upcast. Splitting FP32 products the
# same way was measured too (0.6B decode, interleaved runs): 15 tok/s vs 17.5 with OpenBLAS's threads
# on an idle machine, since each hand-off to a Python thread costs ~0.1 ms and a token makes 113.
# But OpenBLAS's threads spin-wait for each other, so when another process wants a core the FP32
# path can slow down several-fold (seen: 3.3 tok/s) where the row split kept 15 tok/s.

_threads = usable_cores()
_pool: ThreadPoolExecutor | None = None
_blas: Any = None        # threadpoolctl controller for the BLAS libraries, created on first use


def set_threads(threads: int | None) -> None:
    """Use `threads` threads for the matrix products (None: one per core); the CLI's --threads.

    Also sets the BLAS thread count, for matrix products made outside the fast path.
    """
    global _threads, _pool
    _threads = threads or usable_cores()
    _controller().limit(limits=_threads, user_api="blas")
    if _pool is not None:
        _pool.shutdown()
        _pool = None


def blas_info() -> list[dict[str, Any]]:
    """The BLAS NumPy runs: internal_api, architecture (the kernel chosen), num_threads, version."""
    return [info for info in _controller().info() if info.get("user_api") == "blas"]


def _controller() -> Any:
    global _blas
    if _blas is None:
        from threadpoolctl import ThreadpoolController   # runtime dependency, imported where used

        _blas = ThreadpoolController().select(user_api="blas")
    return _blas


def single_threaded_blas() -> Any:
    """Context in which BLAS runs on the calling thread only (our threads split the work instead).

    A cached controller: threadpoolctl.threadpool_limits() rescans the loaded libraries, 0.5 ms.
    """
    return _controller().limit(limits=1, user_api="blas")


def blas_threads_for(weight: np.ndarray) -> Any:
    """Single-threaded BLAS while BF16 weights are streamed by our threads; else BLAS's own threads."""
    return nullcontext() if weight.dtype == np.float32 else single_threaded_blas()


def _workers() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(_threads - 1, thread_name_prefix="qwen_np")
    return _pool


# --- matrix products -------------------------------------------------------------------------------

def linear(x: np.ndarray, weight: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = x W^T, as layers.linear, written into `out`.  x [T, in], weight [out, in], out [T, out].

    FP32 weights go straight to BLAS. For a BF16 weight the rows of W (columns of out) are split
    evenly between _threads threads; call it inside single_threaded_blas() (forward does), or each
    thread's BLAS call would start threads of its own.
    """
    if weight.dtype == np.float32:
        return np.matmul(x, weight.T, out=out)
    _split(weight.shape[0], _threads, lambda rows: _rows(x, weight, out, rows))
    return out


def _split(n: int, parts: int, job: Callable[[slice], object]) -> None:
    """job(part) for `parts` consecutive slices of range(n) at once: the first on this thread, the
    others on the worker threads (NumPy releases the GIL inside its loops and BLAS calls)."""
    bounds = np.linspace(0, n, parts + 1).astype(int).tolist()
    pending = [_workers().submit(job, slice(a, b)) for a, b in zip(bounds[1:-1], bounds[2:])]
    job(slice(bounds[0], bounds[1]))
    for done in pending:
        done.result()


def _rows(x: np.ndarray, weight: np.ndarray, out: np.ndarray, part: slice) -> None:
    """out[:, part] = x W[part]^T for a stored (BF16) W, upcast a cache-sized block of rows at a time."""
    rows, hi = _block_rows(weight.shape[1]), part.stop
    buffer = _thread_buffer(rows * weight.shape[1])
    for start in range(part.start, hi, rows):
        stop = min(start + rows, hi)
        block = buffer[:(stop - start) * weight.shape[1]].reshape(stop - start, weight.shape[1])
        _upcast_rows(weight[start:stop], block)
        np.matmul(x, block.T, out=out[:, start:stop])


def _block_rows(columns: int) -> int:
    """Rows of a BF16 weight upcast per block: BLOCK_BYTES of FP32, rounded down to a multiple of 64.

    Measured on Qwen3-8B's down_proj ([4096, 12288], 8 MiB = 170 rows): 128-row blocks run the
    128-token GEMM at 222 GFLOP/s vs 214 and the decode GEMV at 29.7 GB/s vs 28.1.
    """
    rows = max(1, BLOCK_BYTES // (4 * columns))
    return rows - rows % 64 if rows >= 64 else rows


_local = threading.local()


def _thread_buffer(size: int) -> np.ndarray:
    """This thread's reused FP32 scratch (allocating per block would fault in fresh pages each time)."""
    buffer = getattr(_local, "buffer", None)
    if buffer is None or buffer.size < size:
        buffer = _local.buffer = np.empty(size, dtype=np.float32)
    return buffer


def _upcast_rows(stored: np.ndarray, out: np.ndarray) -> None:
    """Exact BF16 (or F16) -> FP32 into `out`.

    Measured single-threaded on this machine, BF16 bytes read per second: ml_dtypes' cast 24 GB/s;
    NumPy's widening copy into uint32 then in-place shift (numerics.upcast) 16 GB/s;
    np.left_shift(..., dtype=uint32) 8 GB/s, because it casts through a buffered loop.
    """
    if stored.dtype == np.uint16 and ml_dtypes is not None:
        np.copyto(out, stored.view(ml_dtypes.bfloat16), casting="unsafe")
    else:
        upcast(stored, out)


# --- the forward pass --------------------------------------------------------------------------------

class _Buffers:
    """Every activation of one decoder layer for T tokens, reused by all layers (and later calls)."""

    def __init__(self, config: Qwen3Config, T: int) -> None:
        D, F, H, KVH, Dh = (config.hidden_size, config.intermediate_size, config.num_attention_heads,
                            config.num_key_value_heads, config.head_dim)
        self.h = np.empty((T, D), np.float32)                          # normed input of a block
        self.qkv = np.empty((T, (H + 2 * KVH) * Dh), np.float32)      # q | k | v, side by side
        self.rope_scratch = np.empty((2, T, H + KVH, Dh // 2), np.float32)
        self.mixed = np.empty((T, H * Dh), np.float32)                 # attention output, head-major
        self.block_out = np.empty((T, D), np.float32)                  # o_proj / down_proj output
        self.gate_up = np.empty((T, 2 * F), np.float32)                # gate | up, side by side
        self.silu_scratch = np.empty((T, F), np.float32)


# Per model, kept between calls (weak keys: a dropped model frees them): the decode buffers, the
# fused projection weights of each layer when fuse_projections made them, and the stacked q/k norms.
_decode_buffers: "weakref.WeakKeyDictionary[Qwen3Model, _Buffers]" = weakref.WeakKeyDictionary()
_fused: "weakref.WeakKeyDictionary[Qwen3Model, list[tuple[np.ndarray, np.ndarray]]]" = weakref.WeakKeyDictionary()
_qk_norms: "weakref.WeakKeyDictionary[Qwen3Model, list[np.ndarray]]" = weakref.WeakKeyDictionary()


def fuse_projections(model: Qwen3Model) -> None:
    """Store each layer's q/k/v weights as one [q; k; v] array and gate/up as one [gate; up] array.

    Projections that read the same input then cost one product instead of three (or two): fewer,
    larger products keep the memory stream busy. Measured on the 0.6B model, one token's q/k/v and
    gate/up GEMVs: 25.3 ms fused vs 26.3 ms separate. The layer's own q_proj, k_proj, ... become
    views into the fused arrays, so there is never a second copy and the readable path still works.
    Only FP32-resident weights are fused; memory-mapped BF16 weights stay where the file has them.
    """
    kept_as_stored = model.plan is not None and model.plan.mode != "fp32"   # even F32 files: no copies
    if kept_as_stored or any(w.q_proj.dtype != np.float32 for w in model.layers):
        return
    fused = []
    for w in model.layers:
        q_rows, kv_rows, f_rows = w.q_proj.shape[0], w.k_proj.shape[0], w.gate_proj.shape[0]
        qkv = _joined([w.q_proj, w.k_proj, w.v_proj])
        w.q_proj, w.k_proj, w.v_proj = qkv[:q_rows], qkv[q_rows:q_rows + kv_rows], qkv[q_rows + kv_rows:]
        gate_up = _joined([w.gate_proj, w.up_proj])
        w.gate_proj, w.up_proj = gate_up[:f_rows], gate_up[f_rows:]
        fused.append((qkv, gate_up))
    _fused[model] = fused


def _stack_qk_norm(w: LayerWeights, config: Qwen3Config) -> np.ndarray:
    """q_norm's weight for each of the H query heads, then k_norm's for each of the KVH key heads.

    q and k lie side by side in the q|k|v buffer, so with this [H + KVH, Dh] weight one RMSNorm and
    one RoPE call treat both (in a 0.6B decode step the per-call overhead is most of their cost).
    """
    H, KVH = config.num_attention_heads, config.num_key_value_heads
    return np.concatenate([np.broadcast_to(w.q_norm, (H, config.head_dim)),
                           np.broadcast_to(w.k_norm, (KVH, config.head_dim))])


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """The matrices stacked as one [rows, in] array: a view when they lie back to back in one
    allocation (load_model allocates a layer's matrices so), else a copy."""
    first, rows = parts[0], sum(part.shape[0] for part in parts)
    flat = first.base
    if isinstance(flat, np.ndarray) and flat.ndim == 1 and flat.flags.c_contiguous:
        start = (first.ctypes.data - flat.ctypes.data) // flat.itemsize
        offsets = np.cumsum([start] + [part.size for part in parts[:-1]]).tolist()
        if all(part.base is flat and part.flags.c_contiguous and part.ctypes.data == flat[offset:].ctypes.data
               for part, offset in zip(parts, offsets)):
            return flat[start:start + rows * first.shape[1]].reshape(rows, first.shape[1])
    return np.concatenate(parts, out=allocate((rows, first.shape[1])))


def forward(model: Qwen3Model, ids: np.ndarray, cache: KVCache | None, last_only: bool = False) -> np.ndarray:
    """Qwen3Model.forward without tracing: logits [T, V] for checked token ids (see model.py)."""
    config, T = model.config, len(ids)
    start = cache.length if cache is not None else 0
    positions = np.arange(start, start + T)
    cos, sin = layers.rope_angles(model.inv_freq, positions)                       # [T, Dh] each
    if T == 1:
        if model not in _decode_buffers:
            _decode_buffers[model] = _Buffers(config, 1)
        buffers = _decode_buffers[model]
    else:
        buffers = _Buffers(config, T)
    x = layers.embed(ids, model.embed_tokens)                                     # [T, D]
    fused = _fused.get(model) or [None] * len(model.layers)
    if model not in _qk_norms:
        _qk_norms[model] = [_stack_qk_norm(w, config) for w in model.layers]
    # The steps between products split a prompt's rows between our threads, but only while BLAS
    # runs single-threaded on them (BF16 weights): OpenBLAS's own threads spin-wait between FP32
    # products and take the second core (measured there: 0.6B prefill slower, 672 vs 630 ms).
    parts = 1 if model.lm_head.dtype == np.float32 else min(_threads, T // MIN_ROWS_PER_THREAD)
    # SiLU's exp(-x) overflows to inf for x < -88, where silu(x) = x / inf = -0 is right: no warning.
    with blas_threads_for(model.lm_head), np.errstate(over="ignore"):
        for i, weights in enumerate(model.layers):
            _decoder_layer(model, i, weights, fused[i], _qk_norms[model][i], x, positions, cos, sin, cache,
                           buffers, parts)
        _rms_norm(x, model.norm, config.rms_norm_eps, out=buffers.h)
        h = buffers.h[-1:] if last_only else buffers.h
        logits = linear(h, model.lm_head, np.empty((len(h), config.vocab_size), np.float32))
    if cache is not None:
        cache.length += T
    return logits


def _decoder_layer(model: Qwen3Model, i: int, w: LayerWeights, fused: tuple[np.ndarray, np.ndarray] | None,
                   qk_norm: np.ndarray, x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                   cache: KVCache | None, b: _Buffers, parts: int) -> None:
    """x += attention(input_layernorm(x)); x += mlp(post_attention_layernorm(x)), in place.  x [T, D].

    Every step between the products treats token rows independently (attention too, once this call's
    keys are in the cache), so each runs as `parts` slices of rows at once (see _split).
    """
    c, T = model.config, x.shape[0]
    H, KVH, Dh, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
    q_end, k_end, F = H * Dh, (H + KVH) * Dh, c.intermediate_size

    def by_rows(step: Callable[[slice], object]) -> None:
        if parts > 1:
            _split(T, parts, step)
        else:
            step(slice(0, T))

    by_rows(lambda r: _rms_norm(x[r], w.input_layernorm, eps, out=b.h[r]))
    if fused is not None:
        linear(b.h, fused[0], b.qkv)
    else:
        linear(b.h, w.q_proj, b.qkv[:, :q_end])
        linear(b.h, w.k_proj, b.qkv[:, q_end:k_end])
        linear(b.h, w.v_proj, b.qkv[:, k_end:])
    qk = b.qkv[:, :k_end].reshape(T, H + KVH, Dh)          # q heads, then k heads
    by_rows(lambda r: (_rms_norm(qk[r], qk_norm, eps, out=qk[r]),    # q_norm on q heads, k_norm on k heads
                       _rope(qk[r], cos[r], sin[r], b.rope_scratch[:, r])))
    q = b.qkv[:, :q_end].reshape(T, H, Dh)
    k = b.qkv[:, q_end:k_end].reshape(T, KVH, Dh)
    v = b.qkv[:, k_end:].reshape(T, KVH, Dh)
    if cache is not None:
        start = positions[0]
        cache.keys[i, start:start + T] = k
        cache.values[i, start:start + T] = v
        k, v = cache.keys[i, :start + T], cache.values[i, :start + T]           # [S, KVH, Dh]
    by_rows(lambda r: _attention(q[r], k, v, positions[r], b.mixed[r]))
    linear(b.mixed, w.o_proj, b.block_out)

    def add_and_norm(r: slice) -> None:
        x[r] += b.block_out[r]
        _rms_norm(x[r], w.post_attention_layernorm, eps, out=b.h[r])

    by_rows(add_and_norm)
    if fused is not None:
        linear(b.h, fused[1], b.gate_up)
    else:
        linear(b.h, w.gate_proj, b.gate_up[:, :F])
        linear(b.h, w.up_proj, b.gate_up[:, F:])
    gate, up = b.gate_up[:, :F], b.gate_up[:, F:]
    by_rows(lambda r: _silu_times(gate[r], up[r], b.silu_scratch[r]))
    linear(gate, w.down_proj, b.block_out)
    by_rows(lambda r: np.add(x[r], b.block_out[r], out=x[r]))


# Rows per thread below which a step stays on one thread: handing a job to a worker thread costs
# ~0.05-0.1 ms, more than the norms or RoPE of a few rows take.
MIN_ROWS_PER_THREAD = 16


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> np.ndarray:
    """layers.rms_norm into `out` (which may be x itself).

    np.vecdot sums the squares without writing them out (np.mean(x * x) makes two passes and a
    temporary, plus ~5 us of Python): Qwen3-0.6B's q of 128 tokens [128, 16, 128] 105 vs 162 us; of one token 5 vs 6 us.
    """
    inverse = np.vecdot(x, x)[..., None]                                        # [..., 1] sum of squares
    inverse /= np.float32(x.shape[-1])
    inverse += np.float32(eps)
    np.sqrt(inverse, out=inverse)
    np.divide(np.float32(1.0), inverse, out=inverse)
    np.multiply(x, inverse, out=out)
    out *= weight
    return out


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, scratch: np.ndarray) -> None:
    """layers.rope in place on x [T, heads, Dh]: (a, b) -> (a cos - b sin, b cos + a sin) per half.

    Both halves of the cos/sin tables are equal, so only the first is read. a*cos + (-b)*sin in
    layers.rope rounds exactly like a*cos - b*sin: negation is exact.
    """
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    c, s = cos[:, None, :half], sin[:, None, :half]
    b_sin, a_sin = scratch[0], scratch[1]
    np.multiply(b, s, out=b_sin)
    np.multiply(a, s, out=a_sin)
    a *= c
    a -= b_sin
    b *= c
    b += a_sin


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray, out: np.ndarray) -> None:
    """layers.attention into `out` [T, H*Dh]: q [T, H, Dh], k/v [S, KVH, Dh] (cache views).

    Query head h = j*group + g reads KV head j, so the group's queries are rows of one matrix per KV
    head: scores [KVH, group*T, S] = q_j @ k_j^T, with k_j a strided view of the cache.
    """
    T, H, Dh = q.shape
    S, KVH = k.shape[0], k.shape[1]
    group = H // KVH
    if T == 1 and positions[0] + 1 == S:
        return _decode_attention(q[0], k, v, out[0])
    queries = q.reshape(T, KVH, group, Dh).transpose(1, 2, 0, 3).reshape(KVH, group * T, Dh)
    scores = np.matmul(queries, k.transpose(1, 2, 0))                            # [KVH, group*T, S]
    scores *= np.float32(Dh ** -0.5)
    if T > 1 or positions[0] + 1 != S:      # a decode step at the end of the cache sees every key
        future = np.arange(S)[None, :] > positions[:, None]                       # [T, S]
        np.copyto(scores.reshape(KVH, group, T, S), -np.inf, where=future)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    mixed = np.matmul(scores, v.transpose(1, 0, 2))                              # [KVH, group*T, Dh]
    out.reshape(T, KVH, group, Dh)[...] = mixed.reshape(KVH, group, T, Dh).transpose(2, 0, 1, 3)


def _decode_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray) -> None:
    """One new token at the end of the cache (it sees every key): q [H, Dh], k/v [S, KVH, Dh], out [H*Dh].

    Per KV head this is a matrix-vector product per query of its group, so NumPy's matvec/vecmat
    (one BLAS GEMV per query, no batching machinery) beat a batched matmul of [group, Dh] x [Dh, S]
    matrices: measured over 28 layers at S = 160, keys/values not in cache, 2.2 vs 2.8 ms.
    """
    H, Dh = q.shape
    KVH = k.shape[1]
    queries = q.reshape(KVH, H // KVH, Dh)                                         # [KVH, group, Dh]
    scores = np.matvec(k.transpose(1, 0, 2)[:, None], queries)                     # [KVH, group, S]
    scores *= np.float32(Dh ** -0.5)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    np.vecmat(scores, v.transpose(1, 0, 2)[:, None], out=out.reshape(KVH, H // KVH, Dh))


def _silu_times(gate: np.ndarray, up: np.ndarray, scratch: np.ndarray) -> None:
    """gate <- silu(gate) * up, in place, rounding as layers.silu(gate) * up does."""
    np.negative(gate, out=scratch)
    np.exp(scratch, out=scratch)                 # overflows to inf for gate < -88 (forward ignores it)
    scratch += np.float32(1.0)
    np.divide(gate, scratch, out=gate)
    gate *= up

