"""A GGUF file's weights (llama.cpp, Ollama, LM Studio) under their Hugging Face names: GGUFCheckpoint,
which answers what the loader asks of a checkpoint.Checkpoint. A GGUF holds a Qwen3's config, weights,
tokenizer and chat template in one file, read with ggml's own `gguf` package (gguf_reader: the layout
checked and the file parsed; gguf_metadata: the config, sampling defaults and tensor names;
gguf_tokenizer: the tokenizer) and written with its GGUFWriter (gguf_export).

Layout, as the reader and writer see it (the metadata's keys and tensor names: gguf_metadata):
* Dimensions are listed in ggml order, the contiguous axis first (ne[0]), i.e. reversed from the NumPy
  shape: an HF [out, in] matrix is stored with dims [in, out] and the same bytes, so it is read as
  the NumPy shape reversed(dims) with no transpose. Quantization blocks run along ne[0] (a row).
* Q and K rows are stored exactly as in the HF checkpoint: llama.cpp's convert_hf_to_gguf.py permutes
  them only in LlamaModel (conversion/llama.py), which Qwen3Model(Qwen2Model) does not inherit, and
  llama.cpp runs QWEN2/QWEN3 with NEOX RoPE, HF's rotate-half pairing (src/llama-model.cpp); so does
  transformers' GGUF loader, which un-permutes only "llama" (modeling_gguf_pytorch_utils.py).

Weights are held as the safetensors loader holds them: F32, F16 and BF16 tensors
are zero-copy views of the memory-mapped file, read through checkpoint.Checkpoint. Quantized tensors
kept as stored are zero-copy views too, dequantized block of rows by block of rows on use: Q8_0 and
Q4_0 as their blocks' scales and codes (formats.FormatRows), Q4_1, Q5_0, Q5_1 and the K-quants as
their blocks' bytes (ggml_blocks.BlockRows); but Q8_0, Q4_0, Q4_K and Q6_K, within a memory budget,
are repacked at load (ggml_repacked.RepackedRows: their parts taken apart once, not on every product).
The other types (the IQ kinds, ...) are dequantized to FP32 at load with gguf.quants.dequantize, so
they cost 4 bytes per weight in memory.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GGML

from .checkpoint import Checkpoint, TensorInfo
from ..core.config import MODEL_TENSORS, expected_tensors
from ..errors import QwenNPError
from ..numbers.formats import FormatRows
from ..numbers.ggml_blocks import BLOCK_KINDS, BlockRows
from ..numbers.ggml_checks import EXPONENTS, FP16_FIELDS, first_bad_scale, first_not_finite
from ..numbers.ggml_repacked import REPACKINGS, RepackedRows, repackable
from ..numbers.numerics import Weight, upcast
from .gguf_metadata import expert_slice, gguf_tensor_name, read_config
from .gguf_reader import tensors_by_name, open_reader

# Held as stored (views of the file): ggml type -> the safetensors dtype name Checkpoint reads.
STORED_TYPES = {GGML.F32: "F32", GGML.F16: "F16", GGML.BF16: "BF16"}
# Held as their blocks when the weights are kept as stored (--memory bf16, or auto when FP32 does not fit):
# ggml type -> the formats.HELD_FORMATS name whose parts hold the same scales and codes.
BLOCK_FORMATS = {GGML.Q8_0: "q8_0", GGML.Q4_0: "q4_0"}
# Kept as stored, the tensors of the kinds ggml_repacked repacks (REPACKINGS: Q8_0, Q4_0, Q4_K, Q6_K) are held
# repacked while that adds at most this share to the bytes of the file's tensors (GGUFCheckpoint._repacked):
# speed for a bounded cost in memory. Q8_0, Q4_0 and Q4_K add 6-11%, Q6_K 30%: a Q4_K_M file (Qwen3-0.6B's
# tied Q6_K embedding included) gets all of them, an all-Q6_K file about two thirds.
REPACK_BUDGET = 0.2


def _held_as_blocks(tensor: Any) -> bool:
    """Whether a quantized tensor is kept as its blocks when the weights are kept as stored: Q8_0 and Q4_0
    (formats.FormatRows) and ggml_blocks.BLOCK_KINDS; the IQ kinds and the rest are dequantized at load."""
    return tensor.tensor_type in BLOCK_FORMATS or tensor.tensor_type.name in BLOCK_KINDS


class GGUFCheckpoint(Checkpoint):
    """A GGUF's tensors under their Hugging Face names, read as Checkpoint reads safetensors.

    F32/F16/BF16 tensors are described by the same TensorInfo (file, dtype, absolute byte span), so
    Checkpoint.mapped / read serve them unchanged. Quantized ones are described as the F32 tensor
    they become, and read/mapped dequantize them (a new FP32 array each call; read's buffer is not
    used for them, since gguf.quants.dequantize allocates its result).
    """

    # A GGUF is never cached: the cache's spot check re-reads every tensor, i.e. dequantizes it again.
    cacheable = False
    held_copies = True      # repacked tensors (REPACK_BUDGET) are copies of the file's blocks
    source_views = True

    def __init__(self, path: str | Path) -> None:   # no super().__init__: that one indexes a folder of safetensors
        self.folder = Path(path).expanduser()
        self.config = read_config(self.folder)
        self._maps = {}
        self._quantized: dict[str, Any] = {}
        self.tensors = self._index()
        self._check_values()
        self.repacked = self._repacked()           # names held as ggml_repacked.RepackedRows

    def _index(self) -> dict[str, TensorInfo]:
        reader = open_reader(self.folder)
        stored = tensors_by_name(reader)
        tensors = {}
        for name, shape in expected_tensors(self.config).items():
            gguf_name = self._gguf_name(name)
            tensor = stored.get(gguf_name)
            if tensor is None:
                raise QwenNPError(f"{self.folder}: tensor {gguf_name!r} ({name}) is missing")
            tensor = self._expert(name, tensor)
            numpy_shape = tuple(reversed([int(n) for n in tensor.shape]))      # ggml lists ne[0] first
            if numpy_shape != shape:
                raise QwenNPError(f"{self.folder}: tensor {gguf_name!r} has shape {list(numpy_shape)} (NumPy order) "
                                  f"but the metadata implies {list(shape)}")
            dtype = STORED_TYPES.get(tensor.tensor_type)
            if dtype is None:
                self._quantized[name] = tensor
            tensors[name] = TensorInfo(self.folder, name, dtype or "F32", shape, int(tensor.data_offset),
                                       int(tensor.n_bytes) if dtype else 4 * math.prod(shape))
        # llama.cpp refuses a file with more tensors than its metadata implies; running without them would
        # be running a different network than the file holds.
        used = {self._gguf_name(name) for name in tensors}
        extra = [name for name in stored if name not in used]
        if extra:
            raise QwenNPError(f"{self.folder}: {len(extra)} tensor(s) the metadata does not account for, from "
                              f"{extra[0]!r} (a Qwen3 of this shape has no such tensor)")
        return tensors

    def _gguf_name(self, name: str) -> str:
        """The file's tensor that holds checkpoint tensor `name` (a qwen3moe expert's: the stacked one)."""
        stacked = expert_slice(name, self.config.num_hidden_layers)
        return gguf_tensor_name(name, self.config.num_hidden_layers) if stacked is None else stacked[0]

    def _expert(self, name: str, tensor: Any) -> Any:
        """The tensor itself, or for a qwen3moe expert's matrix its slice of the stacked [E, rows, columns] tensor
        (experts lie one after another in it, each its rows' blocks in order): a ReaderTensor of that expert's
        bytes alone, a view of the file, so every kind reads, holds and checks it as a matrix of its own."""
        stacked = expert_slice(name, self.config.num_hidden_layers)
        if stacked is None:
            return tensor
        e, experts = stacked[1], int(tensor.shape[-1])                      # ggml lists the expert axis last
        if not 0 <= e < experts or tensor.n_bytes % experts:
            raise QwenNPError(f"{self.folder}: tensor {stacked[0]!r} holds {experts} experts, not expert {e}")
        size = int(tensor.n_bytes) // experts
        return tensor._replace(name=f"{tensor.name}[{e}]", shape=tensor.shape[:-1], n_elements=tensor.n_elements // experts,
                               n_bytes=size, data_offset=int(tensor.data_offset) + e * size, data=tensor.data[e])

    def _check_values(self) -> None:
        """Refuse a tensor with an inf or NaN where its values come from: any block's FP16 scales (every kind's
        d, m and dmin: ggml_checks.FP16_FIELDS) or an F32/F16/BF16 tensor's values. A start-up forward pass
        reads the embedding rows of its own tokens only, so a bad row of an untied embedding would load and
        serve NaN. Each tensor's pages are let go once checked (release): a view maps them again on use. The
        kinds gguf dequantizes at load are checked once dequantized (_dequantized)."""
        for name, info in self.tensors.items():
            tensor = self._quantized.get(name)
            if tensor is None:
                found = first_not_finite(self._plain_bits(name), info.dtype)
                where = None if found is None else f"row {found[0]}, column {found[1]} is {found[2]}"
            elif tensor.tensor_type.name in FP16_FIELDS:
                bad = first_bad_scale(tensor.tensor_type.name, self._block_bytes(name))
                where = None if bad is None else f"block {bad[2]} of row {bad[1]} has {bad[0]} = {bad[3]}"
            else:
                continue
            self.release(name)
            if where is not None:
                raise self._not_finite(name, where)

    def _plain_bits(self, name: str) -> np.ndarray:
        """An F32/F16/BF16 tensor's values as unsigned integers of their width, [rows, columns] (a 1-D one as one
        row): a view of the mapped file."""
        info = self.tensors[name]
        data = open_reader(self.folder).data[info.start:info.start + info.nbytes]
        return data.view(EXPONENTS[info.dtype][0]).reshape(-1, info.shape[-1])

    def _not_finite(self, name: str, where: str) -> QwenNPError:
        return QwenNPError(f"{self.folder}: tensor {self._gguf_name(name)!r} ({name}) is not "
                           f"finite: {where} (a damaged file: its values would be NaN)")

    def dequantization_note(self) -> str | None:
        """What holding the tensors no weight kind holds (the IQ kinds, ...) as FP32 costs, against their size
        in the file (None: there are none; Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants are held as their
        blocks unless --memory asks for another form)."""
        dequantized = {name: t for name, t in self._quantized.items() if not _held_as_blocks(t)}
        if not dequantized:
            return None
        kinds = "/".join(sorted({tensor.tensor_type.name for tensor in dequantized.values()}))
        fp32 = sum(self.tensors[name].nbytes for name in dequantized)
        stored = sum(int(tensor.n_bytes) for tensor in dequantized.values())
        return (f"{self.folder}: its {kinds} tensors are dequantized to FP32 at load: {fp32 / 2 ** 30:.3f} GiB in "
                f"memory for {stored / 2 ** 30:.3f} GiB in the file")

    def held(self, name: str) -> Weight:
        """Q8_0 and Q4_0 tensors as their blocks (formats.FormatRows: the file's scales and codes as two
        strided views of its memory-mapped blocks), the other block kinds as their blocks' bytes
        (ggml_blocks.BlockRows, a view of the file), those of repacked() with their parts taken apart
        (ggml_repacked.RepackedRows, the file's pages then let go); the rest as Checkpoint holds them (IQ
        kinds dequantized to FP32)."""
        if name in self.repacked:
            tensor = self._quantized[name]
            repacked = RepackedRows.from_blocks(tensor.tensor_type.name, self._block_bytes(name))
            self.release(name)
            return repacked
        blocks = self._blocks(name)
        return super().held(name) if blocks is None else blocks

    def release(self, name: str) -> None:
        """Let go of the file's pages of tensor `name` once it has been copied out of them (gguf_reader.CheckedReader.release):
        repacked, dequantized, or requantized by the loader (--memory int8, q8_0, q4_0)."""
        tensor, info = self._quantized.get(name), self.tensors[name]
        start, nbytes = (info.start, info.nbytes) if tensor is None else (int(tensor.data_offset), int(tensor.n_bytes))
        open_reader(self.folder).release(start, nbytes)

    def source(self, name: str, buffer: np.ndarray | None) -> Weight:
        """A converting mode (int8, q8_0, q4_0) quantizes a GGUF's tensors as stored (views of the file gguf's
        reader maps anyway; its blocks widened a block of rows at a time): no FP32 copy, and no buffer."""
        return self.as_stored(name)

    def as_stored(self, name: str) -> Weight:
        """Tensor `name` as the file stores it, views of its mapped bytes: quantized ones as their blocks
        (FormatRows, BlockRows: never repacked), the rest as Checkpoint holds them."""
        blocks = self._blocks(name)
        return super().held(name) if blocks is None else blocks

    def _repacked(self) -> frozenset[str]:
        """The tensors held repacked (ggml_repacked.REPACKINGS), the cheapest in extra bytes per byte first,
        while together they add at most REPACK_BUDGET to the bytes the file's tensors hold. An untied
        model's token embedding is not: only the prompt's rows of it are ever read."""
        budget = REPACK_BUDGET * sum(int(t.n_bytes) for t in tensors_by_name(open_reader(self.folder)).values())
        lookup_only = set() if self.config.tie_word_embeddings else {MODEL_TENSORS["embed_tokens"].name}
        candidates = [(self._held_bytes(name, repacked=True) / int(tensor.n_bytes), name)
                      for name, tensor in self._quantized.items()
                      if repackable(tensor.tensor_type.name, self.tensors[name].shape[-1]) and name not in lookup_only]
        chosen = []
        for _, name in sorted(candidates):
            extra = self._held_bytes(name, repacked=True) - int(self._quantized[name].n_bytes)
            if extra <= budget:
                budget -= extra
                chosen.append(name)
        return frozenset(chosen)

    def _held_bytes(self, name: str, repacked: bool) -> int:
        """The bytes tensor `name` takes held as stored: the file's bytes as blocks; repacked, what
        ggml_repacked.Repacking.held_bytes counts; 4 a value dequantized to FP32."""
        tensor = self._quantized.get(name)
        if tensor is None or not _held_as_blocks(tensor):
            return self.tensors[name].nbytes
        if not repacked:
            return int(tensor.n_bytes)
        return REPACKINGS[tensor.tensor_type.name].held_bytes(math.prod(self.tensors[name].shape))

    def _block_bytes(self, name: str) -> np.ndarray:
        """A quantized tensor's blocks, [out, in/QK, bytes] uint8: a view of the mapped file."""
        tensor = self._quantized[name]
        rows, columns = self.tensors[name].shape
        block_values, _ = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        return np.asarray(tensor.data, dtype=np.uint8).reshape(rows, columns // block_values, -1)

    def _blocks(self, name: str) -> Weight | None:
        """A quantized tensor held as blocks (FormatRows or BlockRows, views of the file), else None."""
        tensor = self._quantized.get(name)
        if tensor is None or not _held_as_blocks(tensor):
            return None
        blocks, columns = self._block_bytes(name), self.tensors[name].shape[1]          # [out, in/QK, bytes]
        fmt = BLOCK_FORMATS.get(tensor.tensor_type)
        if fmt is None:
            return BlockRows(tensor.tensor_type.name, blocks)
        scales = blocks[..., :2].view(np.float16)[..., 0]                                  # [out, in/32] FP16
        # Views of the mapped file, never copies: a copy of the codes would sit in memory beside the file's
        # pages, which the scales keep mapped (Qwen3-32B in Q4_0: 16 GiB of codes next to an 18 GiB file).
        codes = blocks[..., 2:]                                # [out, in/32, 32 | 16]: q8_0 int8, q4_0 nibbles
        return FormatRows(fmt, (codes.view(np.int8) if fmt == "q8_0" else codes, scales), columns)

    def file_summary(self) -> dict[str, Any]:
        """The file as `inspect` describes it, plain data: its path and size, its tensors' count and bytes per ggml
        kind (the most bytes first), their bytes in all, and the bytes they take held as stored (held_bytes_per_value:
        the repacked kinds' parts, the kinds dequantized to FP32)."""
        kinds: dict[str, dict[str, int]] = {}
        for name, info in self.tensors.items():
            tensor = self._quantized.get(name)
            kind = kinds.setdefault(info.dtype if tensor is None else tensor.tensor_type.name, {"tensors": 0, "bytes": 0})
            kind["tensors"] += 1
            kind["bytes"] += info.nbytes if tensor is None else int(tensor.n_bytes)
        values = sum(math.prod(info.shape) for info in self.tensors.values())
        return {"path": str(self.folder), "file_bytes": self.folder.stat().st_size,
                "kinds": dict(sorted(kinds.items(), key=lambda item: -item[1]["bytes"])),
                "tensor_bytes": sum(kind["bytes"] for kind in kinds.values()),
                "held_bytes": round(self.held_bytes_per_value() * values)}

    def held_bytes_per_value(self) -> float:
        """As held "as stored": the file's bytes for F32/F16/BF16 and the tensors held as their blocks, the
        repacked ones' parts, 4 a value for the tensors dequantized to FP32 (_held_bytes)."""
        values = sum(math.prod(info.shape) for info in self.tensors.values())
        return sum(self._held_bytes(name, name in self.repacked) for name in self.tensors) / values

    def mapped(self, name: str) -> np.ndarray:
        return self._dequantized(name) if name in self._quantized else super().mapped(name)

    def read(self, name: str, buffer: np.ndarray | None = None) -> np.ndarray:
        return self._dequantized(name) if name in self._quantized else super().read(name, buffer)

    def _dequantized(self, name: str) -> np.ndarray:
        """A quantized tensor in FP32: its blocks widened (the same bits as gguf.quants.dequantize, ~50x
        faster) where it is held as blocks, else gguf's dequantizer."""
        tensor = self._quantized[name]
        blocks = self._blocks(name)
        if blocks is not None:
            values = upcast(blocks)
            self.release(name)           # the copy replaces the file's pages
            return values
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise QwenNPError(f"{self.folder}: tensor {tensor.name!r} is {tensor.tensor_type.name}, which "
                              "gguf.quants cannot dequantize") from None
        shape = self.tensors[name].shape
        values = values.astype(np.float32, copy=False).reshape(shape)
        found = first_not_finite(values.view(np.uint32).reshape(-1, shape[-1]), "F32")
        if found is not None:                   # a kind _check_values cannot read the scales of
            raise self._not_finite(name, f"row {found[0]}, column {found[1]} dequantizes to {found[2]}")
        return values
