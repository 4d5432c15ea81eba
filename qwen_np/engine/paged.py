"""The paged KV cache: keys and values in fixed-size blocks from one pool, a block table per sequence.

core/kv_cache.py's contiguous cache (one sequence, positions in order) must be sized for prompt +
max_tokens before the first token, and most of it is never used. Here every sequence's keys and values
live in blocks of BLOCK_SIZE positions taken from one BlockPool as the sequence grows, and its block
table says which:

    a sequence of 38 positions, BLOCK_SIZE 16:   positions 0..15 | 16..31 | 32..37 (10 slots free)
    its block table:                             [       7,          2,       9        ]
    position p lives in slot p % 16 of block table[p // 16]: position 20 is pool.keys[l, 2, 4]

So a sequence holds at most one partly filled block, a pool of N blocks serves any mix of
sequences whose blocks add up to N, and a finished sequence's blocks go back at once.

Attention reads a sequence's keys in position order: append() returns its blocks gathered in
table order (pool.keys[l, table] is [n, BLOCK_SIZE, KVH, Dh], reshaped to [S, KVH, Dh]). NumPy
has no strided view over scattered blocks, so that gather is a copy, except when the blocks lie in
order in the pool (a lone sequence's always do), which is read in place. A copy of every key per
layer and step would cost a decode step dearly, so the fast path's decode step reads runs() instead:
the table's runs of consecutive blocks, each a view, and the pool keeps a sequence's blocks in a few
such runs (BlockPool). The stored dtype may be BF16 or FP16 (half the memory), or int8 codes with an FP32
scale per position and head beside them (pool.key_scales [L, N, BLOCK_SIZE, KVH]; core/kv_cache.py); the
keys are widened to FP32 as they are read, so attention itself always runs in FP32.

Automatic prefix caching: a full block is named by a digest of its tokens and of every token
before it (the digest of the previous block, chained), so two sequences with the same first 160
tokens name their first 10 blocks alike, and keys/values depend only on the tokens up to their
position, so a new sequence can take those blocks as they are. Blocks are shared by reference
count; a block no sequence holds stays cached (and findable) until the pool needs it, least
recently used first. A shared block is always full and a sequence writes only after its last
position, so a shared block is never written (truncate copies a partly kept shared block first).
Keys and values also depend on the weights that computed them: a sequence whose rows run with a LoRA
adapter starts its chain from that adapter's digest (its `root`), so it shares blocks only with
sequences of the same adapter, never with the base model's or another adapter's.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from typing import Sequence

import numpy as np

from ..core.config import Qwen3Config
from ..core.kv_cache import Unscaled, kv_dtype, kv_position_bytes, kv_scales, store, unscaled_into
from .budget import BLOCK_SIZE, blocks_for, pool_blocks
from ..errors import QwenNPError


def block_bytes(config: Qwen3Config, dtype: str = "fp32", block_size: int = BLOCK_SIZE) -> int:
    """Bytes one block takes: keys and values of block_size positions in every layer (int8: with their scales)."""
    return block_size * kv_position_bytes(config, dtype)


def block_runs(table: Sequence[int]) -> list[tuple[int, int]]:
    """A block table as runs of consecutive blocks, (first block, count) each: [7, 8, 9, 2, 3] -> [(7, 3), (2, 2)]."""
    blocks = np.asarray(table)
    starts = np.flatnonzero(np.diff(blocks, prepend=-2) != 1)          # where a block does not follow the one before
    counts = np.diff(starts, append=len(blocks))
    return list(zip(blocks[starts].tolist(), counts.tolist()))


def block_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    """A full block's name: SHA-256 of the previous block's name and this block's token ids.

    A cryptographic hash, not Python's hash(): a collision would hand one request another's keys
    and values (a wrong answer, and a leak between users), and a 64-bit hash can be forced to collide.
    """
    return hashlib.sha256(parent + np.asarray(tokens, dtype=np.int64).tobytes()).digest()


class BlockPool:
    """num_blocks blocks of keys and values for every layer, with their reference counts and the
    prefix cache's index (when `prefix_caching`).

    keys[l, b, s] is layer l's key in slot s of block b ([L, N, BLOCK_SIZE, KVH, Dh]), values alike.
    A block is free (in no sequence and cached by nobody), held (refs > 0), or cached but unheld:
    evictable, in least-recently-released order. allocate() takes a free block, else evicts one.

    Which free block: a sequence's blocks are best consecutive in the pool, because a run of consecutive
    blocks is read in place (PagedKVCache.runs) where scattered ones are gathered, a copy per layer and
    step. So a sequence's first block is the lowest free one (a lone sequence's blocks then lie in order
    from 0), its next one the block after its last when free, and otherwise the middle of the longest
    stretch of free blocks: sequences growing side by side would interleave block by block if each took
    the lowest free one, while there each has free blocks after it to grow into.
    """

    def __init__(self, config: Qwen3Config, num_blocks: int, dtype: str = "fp32", block_size: int = BLOCK_SIZE,
                 prefix_caching: bool = False) -> None:
        if num_blocks < 1:
            raise QwenNPError(f"the KV cache needs at least one block of {block_size} positions "
                              f"({block_bytes(config, dtype, block_size)} bytes), got {num_blocks} blocks", "num_blocks")
        shape = (config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.keys = np.zeros(shape, dtype=kv_dtype(dtype))         # [L, N, BLOCK_SIZE, KVH, Dh]
        self.values = np.zeros(shape, dtype=kv_dtype(dtype))       # [L, N, BLOCK_SIZE, KVH, Dh]
        self.key_scales, self.value_scales = kv_scales(shape, dtype), kv_scales(shape, dtype)   # [L, N, BLOCK_SIZE, KVH]
        self.dtype, self.num_blocks, self.block_size = dtype, num_blocks, block_size
        self.prefix_caching = prefix_caching
        self.refs = [0] * num_blocks
        self._is_free = np.ones(num_blocks, dtype=bool)
        self._free_count = num_blocks
        self._lowest = list(range(num_blocks))            # a heap of free blocks (and of some taken since: skipped)
        self._cached: dict[bytes, int] = {}               # digest -> block, for blocks in the prefix cache
        self._digest: dict[int, bytes] = {}               # block -> digest, the same pairs
        self._evictable: OrderedDict[int, None] = OrderedDict()   # cached, unheld: least recently released first
        self._scratch: dict[tuple[str, np.dtype], np.ndarray] = {}

    @property
    def free_blocks(self) -> int:
        """Blocks allocate() can hand out: free ones and cached ones no sequence holds."""
        return self._free_count + len(self._evictable)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    def allocate(self, after: int | None = None) -> int:
        """A block for one sequence (refs 1) whose last block is `after` (None: its first): a free one as the class
        says, else the least recently used cached one."""
        if self._free_count:
            block = (after + 1 if after is not None and after + 1 < self.num_blocks and self._is_free[after + 1]
                     else self._lowest_free() if after is None else self._roomiest_free())
            self._is_free[block] = False
            self._free_count -= 1
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._cached[self._digest.pop(block)]
        else:
            raise QwenNPError(f"KV cache: all {self.num_blocks} blocks of {self.block_size} positions are in use")
        self.refs[block] = 1
        return block

    def hold(self, block: int) -> None:
        """One more sequence holds `block` (a prefix cache hit)."""
        if self.refs[block] == 0:
            del self._evictable[block]
        self.refs[block] += 1

    def release(self, block: int) -> None:
        """A sequence lets go of `block`: unheld, it stays cached (evictable) if it is in the prefix cache."""
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self._digest:
                self._evictable[block] = None             # the most recently released: evicted last
            else:
                self._is_free[block] = True
                self._free_count += 1
                heapq.heappush(self._lowest, block)
                if len(self._lowest) > 2 * self.num_blocks:     # mostly entries taken since: start it afresh
                    self._lowest = np.flatnonzero(self._is_free).tolist()     # sorted, so a heap

    def _lowest_free(self) -> int:
        while not self._is_free[self._lowest[0]]:         # taken since it was pushed (after+1, or roomiest)
            heapq.heappop(self._lowest)
        return heapq.heappop(self._lowest)

    def _roomiest_free(self) -> int:
        """The middle block of the longest stretch of free blocks."""
        edges = np.flatnonzero(np.diff(self._is_free, prepend=False, append=False))     # starts, ends, ...
        starts, ends = edges[::2], edges[1::2]
        longest = int(np.argmax(ends - starts))
        return int(starts[longest] + ends[longest]) // 2

    def register(self, block: int, digest: bytes) -> None:
        """Put a full block in the prefix cache under `digest` (the first block named so stays)."""
        if self.prefix_caching and digest not in self._cached:
            self._cached[digest] = block
            self._digest[block] = digest

    def forget(self, block: int) -> None:
        """Take a held block out of the prefix cache (its contents are about to change)."""
        del self._cached[self._digest.pop(block)]

    def cached(self, block: int) -> bool:
        return block in self._digest

    def scratch(self, name: str, blocks: int, dtype: np.dtype, inner: tuple[int, ...] | None = None) -> np.ndarray:
        """A reused buffer for `blocks` blocks, [blocks, *inner] (default [blocks, BLOCK_SIZE, KVH, Dh]), to read a
        sequence's keys or values (or int8's scales) into (`name`): valid until the next read into the same one.
        A fresh array per read is slow: two of several MiB alive at once (keys and values) are mapped and
        page-faulted in anew each time (measured: 8.6 ms for two 8 MiB gathers, 0.3 ms for one)."""
        inner = self.keys.shape[2:] if inner is None else inner
        buffer = self._scratch.get((name, dtype))
        if buffer is None or len(buffer) < blocks:
            buffer = self._scratch[name, dtype] = np.empty((blocks, *inner), dtype)
        return buffer[:blocks]

    def lookup(self, tokens: Sequence[int], root: bytes = b"") -> tuple[list[int], list[bytes]]:
        """The cached blocks holding the longest run of whole blocks that starts `tokens` (in the chain that
        starts from `root`), and their digests."""
        blocks, digests, parent = [], [], root
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size) if self.prefix_caching else ():
            parent = block_digest(parent, tokens[start:start + self.block_size])
            if parent not in self._cached:
                break
            blocks.append(self._cached[parent])
            digests.append(parent)
        return blocks, digests


class PagedKVCache:
    """One sequence's keys and values: its block table into `pool`, for up to `max_tokens` positions.

    `length` positions are filled (the ids in `tokens`). A forward pass reserves blocks for its T
    new tokens, appends each layer's keys/values after the `length` cached positions, and then
    advances the cache by its ids (which names the blocks it filled, for the prefix cache).
    """

    def __init__(self, pool: BlockPool, max_tokens: int, root: bytes = b"") -> None:
        if max_tokens <= 0:
            raise QwenNPError(f"max_tokens: the KV cache needs at least one position, got {max_tokens}")
        self.pool, self.max_tokens = pool, max_tokens
        self.root = root                           # the prefix cache's chain starts here: its adapter's digest
        self.table: list[int] = []                 # block of positions [i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)
        self.tokens: list[int] = []                # the ids whose keys/values are held
        self.digests: list[bytes] = []             # the digest of each full block, in order
        self._runs: tuple[tuple[int, ...], list[tuple[int, int]]] = ((), [])   # block_runs of a table prefix, kept:
        # every layer of a step reads the same blocks, and finding runs costs as much as a tiny model's layer

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def dtype(self) -> str:
        return self.pool.dtype

    def blocks_needed(self, new_tokens: int) -> int:
        """Blocks to allocate before `new_tokens` more positions fit."""
        return max(0, blocks_for(self.length + new_tokens, self.pool.block_size) - len(self.table))

    def reserve(self, new_tokens: int) -> None:
        """Allocate the blocks `new_tokens` more positions need (a QwenNPError if the pool has none left)."""
        for _ in range(self.blocks_needed(new_tokens)):
            self.table.append(self.pool.allocate(self.table[-1] if self.table else None))

    def reuse_prefix(self, prompt: Sequence[int]) -> int:
        """Take the prefix cache's blocks for the longest run of whole blocks that starts `prompt`, leaving
        at least its last token to compute (its logits are the next token's); returns the positions reused."""
        if self.length:
            raise QwenNPError("cache: a prefix can be reused only by an empty cache")
        blocks, digests = self.pool.lookup(prompt[:-1], self.root)
        for block in blocks:
            self.pool.hold(block)
        reused = len(blocks) * self.pool.block_size
        self.table, self.digests, self.tokens = blocks, digests, [int(t) for t in prompt[:reused]]
        return reused

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store a forward call's keys/values k, v [T, KVH, Dh] of `layer` after the `length` cached positions
        (blocks reserved)."""
        positions = np.arange(self.length, self.length + len(k))                       # [T]
        blocks = np.asarray(self.table)[positions // self.pool.block_size]             # [T] block of each position
        slots = positions % self.pool.block_size                                       # [T] its slot in the block
        store(self.pool.keys, self.pool.key_scales, (layer, blocks, slots), k)
        store(self.pool.values, self.pool.value_scales, (layer, blocks, slots), v)

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """write(), then return every key and value so far in position order, FP32 [S, KVH, Dh] each: views
        of the pool, or of its scratch buffers, valid until the next append to a cache of this pool."""
        self.write(layer, k, v)
        end = self.length + len(k)
        pool = self.pool
        return (self._read(pool.keys[layer], None if pool.key_scales is None else pool.key_scales[layer], end, "keys"),
                self._read(pool.values[layer], None if pool.value_scales is None else pool.value_scales[layer], end,
                           "values"))

    def runs(self, layer: int, end: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Positions [0, end) of `layer` as views of the pool, nothing copied: a (keys, values) pair [S_i, KVH, Dh]
        per run of consecutive blocks in the table, in position order (an FP32 pool: others need widening, int8 its scales)."""
        pieces, start = [], 0
        table = tuple(self.table[:blocks_for(end, self.pool.block_size)])
        if table != self._runs[0]:
            self._runs = table, block_runs(table)
        for first, n in self._runs[1]:
            stop = min(start + n * self.pool.block_size, end)
            keys, values = (a[layer, first:first + n].reshape(-1, *a.shape[3:])[:stop - start]
                            for a in (self.pool.keys, self.pool.values))
            pieces.append((keys, values))
            start = stop
        return pieces

    def unscaled(self, layer: int, end: int) -> Unscaled:
        """Positions [0, end) of `layer` as a decode step reads them (kv_cache.Unscaled), in order: views of the
        pool, or of its scratch buffers, valid until the next read from a cache of this pool."""
        pool = self.pool
        keys, key_scales = self._stored(pool.keys[layer], None if pool.key_scales is None else pool.key_scales[layer],
                                        end, "keys")
        values, value_scales = self._stored(pool.values[layer], None if pool.value_scales is None
                                            else pool.value_scales[layer], end, "values")
        return Unscaled(keys, values, key_scales, value_scales)

    def _read(self, blocks: np.ndarray, scales: np.ndarray | None, end: int, name: str) -> np.ndarray:
        """Positions [0, end) of one layer's pool array [N, BLOCK_SIZE, KVH, Dh] (int8: with its scales
        [N, BLOCK_SIZE, KVH]), in order: [end, KVH, Dh] FP32, int8's codes times their scales."""
        read, gathered_scales = self._stored(blocks, scales, end, name)
        if gathered_scales is not None:
            read *= gathered_scales[..., None]            # the widened codes are the pool's scratch: scaled in place
        return read

    def _stored(self, blocks: np.ndarray, scales: np.ndarray | None, end: int,
                name: str) -> tuple[np.ndarray, np.ndarray | None]:
        """Positions [0, end) of one layer's pool array, in order, FP32 [end, KVH, Dh] (BF16 / FP16 widened exactly,
        int8's codes widened, not scaled), and int8's scales [end, KVH] (None for the others)."""
        table = self.table[:blocks_for(end, self.pool.block_size)]
        mine = self._gathered(blocks, table, name)
        if mine.dtype != np.float32:
            mine = unscaled_into(mine, self.pool.scratch(name, len(table), np.dtype(np.float32)))
        if scales is not None:
            scales = self._gathered(scales, table, name + ".scales").reshape(-1, scales.shape[-1])[:end]   # [end, KVH]
        return mine.reshape(-1, *mine.shape[2:])[:end], scales

    def _gathered(self, blocks: np.ndarray, table: list[int], name: str) -> np.ndarray:
        """blocks[table] ([n, ...] of a pool array [N, ...]): a view when the table's blocks lie in order, else
        gathered into the pool's scratch `name`."""
        first, n = table[0], len(table)
        if table[-1] - first == n - 1 and table == list(range(first, first + n)):
            return blocks[first:first + n]                                            # in order: a view
        # mode="clip": with the default "raise", take() copies through a buffer
        return np.take(blocks, table, axis=0, out=self.pool.scratch(name, n, blocks.dtype, blocks.shape[1:]), mode="clip")

    def advance(self, ids: Sequence[int] | np.ndarray) -> None:
        """Count the positions just appended as filled (their ids are `ids`), and name each block they filled
        for the prefix cache."""
        self.tokens.extend(int(t) for t in ids)
        size = self.pool.block_size
        while self.pool.prefix_caching and len(self.digests) < self.length // size:
            i = len(self.digests)
            self.digests.append(block_digest(self.digests[-1] if i else self.root, self.tokens[i * size:(i + 1) * size]))
            self.pool.register(self.table[i], self.digests[-1])

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (e.g. to re-render a chat's changed history)."""
        if not 0 <= length <= self.length:
            raise QwenNPError(f"cache: cannot truncate {self.length} cached positions to {length}")
        keep = blocks_for(length, self.pool.block_size)
        for block in self.table[keep:]:
            self.pool.release(block)
        del self.table[keep:], self.tokens[length:], self.digests[length // self.pool.block_size:]
        last = self.table[-1] if self.table else None
        if last is None or not length % self.pool.block_size:
            return
        # The next append writes into this partly kept block. Held by another sequence too: copy it first,
        # never write a shared one. Held by this one only but named in the prefix cache (e.g. it was filled
        # by speculative tokens that were then rejected): drop its name, so no sequence finds it after.
        if self.pool.refs[last] > 1:
            copy = self.pool.allocate()
            for stored in (self.pool.keys, self.pool.values, self.pool.key_scales, self.pool.value_scales):
                if stored is not None:
                    stored[:, copy] = stored[:, last]
            self.pool.release(last)
            self.table[-1] = copy
        elif self.pool.cached(last):
            self.pool.forget(last)

    def free(self) -> None:
        """Give every block back (cached ones stay findable until evicted); the cache is empty after."""
        self.truncate(0)


class OwnPoolCache(PagedKVCache):
    """A PagedKVCache for one sequence of up to `max_tokens` positions over a pool of its own, as one
    generation or chat on the fast path needs (FastQwen3Model.new_cache; a draft model's cache): its
    pool has room for max_tokens from the start, and since its blocks lie in order, `keys` / `values`
    are the whole cache as [L, S_max, KVH, Dh] views (position p at index p), as core.kv_cache.KVCache's
    (int8: the codes, their scales in pool.key_scales / value_scales)."""

    def __init__(self, config: Qwen3Config, max_tokens: int, dtype: str = "fp32") -> None:
        if max_tokens <= 0:
            raise QwenNPError(f"max_tokens: the KV cache needs at least one position, got {max_tokens}")
        super().__init__(BlockPool(config, pool_blocks([max_tokens]), dtype), max_tokens)

    @property
    def keys(self) -> np.ndarray:
        return _positions(self.pool.keys)[:, :self.max_tokens]                          # [L, S_max, KVH, Dh]

    @property
    def values(self) -> np.ndarray:
        return _positions(self.pool.values)[:, :self.max_tokens]                        # [L, S_max, KVH, Dh]


def _positions(pool: np.ndarray) -> np.ndarray:
    """A pool array [L, N, BLOCK_SIZE, KVH, Dh] as [L, N * BLOCK_SIZE, KVH, Dh] (a view)."""
    return pool.reshape(pool.shape[0], -1, *pool.shape[3:])
