"""GGUF in and out: export -> load round trips, the metadata and tensor mapping, damaged files, the
tokenizer rebuilt from tokenizer.ggml.* on the real Qwen3 vocabulary, and the CLI.

Files llama.cpp itself made (its converter and quantizer) are committed fixtures (tests/fixtures/llama_cpp);
the rest are checked through gguf's own reader and writer and qwen_np.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import struct
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGML
from gguf import GGUFReader, GGUFValueType, GGUFWriter, TokenType
import gguf

from qwen_np import QwenNPError, Qwen3Model, load_model
from qwen_np.core.config import LAYER_TENSORS, MODEL_TENSORS, Qwen3Config, expected_tensors
from qwen_np.files.checkpoint import save_checkpoint
from qwen_np.numbers.formats import round_trip
from qwen_np.files.gguf_export import write_gguf, write_gguf_tensors
from qwen_np.files.gguf_file import GGUFCheckpoint
from qwen_np.files.gguf_metadata import gguf_tensor_name
from qwen_np.files.gguf_reader import open_reader
from qwen_np.files.model_files import ModelFiles, open_checkpoint, read_config, read_generation_defaults, read_tokenizer
from qwen_np.numbers.numerics import upcast
from qwen_np.files.tokenizer import Tokenizer
from qwen_np.core.sampling import SamplingParams
from tests.conftest import BUNDLED, HANG_SECONDS, QWEN3_RANDOM, ROOT, write_random_checkpoint
from tests.reference.logit_match import assert_logits_match

PROMPT = [5, 17, 300, 42, 1999, 7, 7, 64, 1024, 3]


def tiny_checkpoint(folder: Path, tied: bool = False, **overrides: object) -> Path:
    """A random BF16 Qwen3 (q is [64, 32]: not square, so a transposed matrix cannot pass the shape check)
    with the bundled model's 2,048-token tokenizer."""
    write_random_checkpoint(folder, **{"vocab_size": 2048, "intermediate_size": 64, "tie_word_embeddings": tied, **overrides})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED / name, folder / name)
    return folder


def export(source: Path, out: Path, file_type: str) -> Path:
    checkpoint = open_checkpoint(source)
    sampling = read_generation_defaults(source, checkpoint.config).sampling
    write_gguf(out, checkpoint, read_tokenizer(source), sampling, file_type)
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def source(request, tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("src") / "ckpt", tied=request.param)


def logits(path: Path) -> np.ndarray:
    return load_model(path, memory="fp32").forward(PROMPT)


# --- Names and metadata ----------------------------------------------------------------------------

def test_every_tensor_of_the_config_table_has_llama_cpps_name() -> None:
    expected = {"input_layernorm": "blk.3.attn_norm", "q_proj": "blk.3.attn_q", "k_proj": "blk.3.attn_k",
                "v_proj": "blk.3.attn_v", "q_norm": "blk.3.attn_q_norm", "k_norm": "blk.3.attn_k_norm",
                "o_proj": "blk.3.attn_output", "post_attention_layernorm": "blk.3.ffn_norm",
                "gate_proj": "blk.3.ffn_gate", "up_proj": "blk.3.ffn_up", "down_proj": "blk.3.ffn_down"}
    assert {key: gguf_tensor_name(spec.name.format(i=3), 4) for key, spec in LAYER_TENSORS.items()} == \
        {key: name + ".weight" for key, name in expected.items()}
    assert {key: gguf_tensor_name(spec.name) for key, spec in MODEL_TENSORS.items()} == \
        {"embed_tokens": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}


def test_metadata_holds_the_config_and_dims_are_in_ggml_order(source, tmp_path) -> None:
    path = export(source, tmp_path / "m.gguf", "f32")
    config = read_config(source)
    back = read_config(path)
    assert {**back.to_dict(), "torch_dtype": None, "eos_token_id": None} == \
        {**config.to_dict(), "torch_dtype": None, "eos_token_id": None}
    reader = GGUFReader(path)
    assert reader.get_field("general.architecture").contents() == "qwen3"
    assert reader.get_field("qwen3.attention.key_length").contents() == config.head_dim
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    # ggml lists ne[0] (the contiguous `in` axis) first: HF [H*Dh, D] = [64, 32] is stored as dims [32, 64]
    assert list(q.shape) == [config.hidden_size, config.num_attention_heads * config.head_dim]
    names = {t.name for t in reader.tensors}
    assert ("output.weight" in names) is not config.tie_word_embeddings
    assert {t.tensor_type for t in reader.tensors if t.name.endswith("norm.weight")} == {GGML.F32}


# --- Round trips -----------------------------------------------------------------------------------

@pytest.mark.parametrize("file_type", ["f32", "bf16", "f16"])
def test_float_exports_load_to_the_source_logits(source, tmp_path, file_type) -> None:
    reference = logits(source)
    loaded = logits(export(source, tmp_path / f"m-{file_type}.gguf", file_type))
    difference = float(np.max(np.abs(loaded - reference)))
    # The source is BF16: F32 and BF16 hold its values exactly; F16 too, but for values below F16's
    # smallest normal (6e-5), which lose mantissa bits.
    assert difference <= (1e-3 if file_type == "f16" else 0.0), difference


@pytest.mark.parametrize("file_type", ["q8_0", "q4_0"])
def test_quantized_exports_hold_ggufs_own_blocks_and_load_as_their_dequantization(source, tmp_path, file_type) -> None:
    kind = {"q8_0": GGML.Q8_0, "q4_0": GGML.Q4_0}[file_type]
    path = export(source, tmp_path / f"m-{file_type}.gguf", file_type)
    stored = {t.name: t for t in GGUFReader(path).tensors}
    original = open_checkpoint(source)
    loaded = GGUFCheckpoint(path)
    for name in original.tensors:
        values = upcast(original.read(name))
        tensor = stored[gguf_tensor_name(name, original.config.num_hidden_layers)]
        if values.ndim == 1:
            assert tensor.tensor_type == GGML.F32
            continue
        assert tensor.tensor_type == kind
        assert np.array_equal(tensor.data, gguf.quants.quantize(values, kind)), name     # the file's bytes
        assert np.array_equal(loaded.read(name), round_trip(values, file_type)), name    # and what is loaded


def greedy(model: Qwen3Model, ids: list[int], steps: int) -> list[int]:
    ids = list(ids)
    for _ in range(steps):
        ids.append(int(model.forward(ids, last_only=True)[-1].argmax()))
    return ids[-steps:]


SCENE = "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n"
# Measured on the bundled model after SCENE: max |logit difference| / max |logit| 0.0056 (q8_0) and 0.086
# (q4_0); the greedy text of q8_0 equals the source's for all 32 tokens, q4_0's for the first 15.
QUANTIZED_BOUNDS = {"q8_0": (0.01, 32), "q4_0": (0.15, 8)}


@pytest.mark.slow
@pytest.mark.parametrize("file_type", QUANTIZED_BOUNDS)
def test_quantized_exports_of_a_trained_model_keep_its_predictions(tmp_path, file_type) -> None:
    relative, same_tokens = QUANTIZED_BOUNDS[file_type]
    ids = read_tokenizer(BUNDLED).encode(SCENE)
    source, exported = load_model(BUNDLED, memory="fp32"), load_model(export(BUNDLED, tmp_path / "m.gguf", file_type))
    reference, quantized = source.forward(ids), exported.forward(ids)
    assert np.max(np.abs(quantized - reference)) < relative * np.max(np.abs(reference))
    assert np.array_equal(quantized.argmax(-1), reference.argmax(-1))
    assert greedy(exported, ids, 32)[:same_tokens] == greedy(source, ids, 32)[:same_tokens]


@pytest.mark.parametrize("file_type", ["f16", "q8_0"])
def test_every_memory_mode_runs_a_gguf(source, tmp_path, file_type) -> None:
    path = export(source, tmp_path / "m.gguf", file_type)
    fp32, stored, int8 = (load_model(path, memory=mode).forward(PROMPT) for mode in ("fp32", "bf16", "int8"))
    assert np.allclose(stored, fp32, rtol=0, atol=1e-5)            # the same weights, upcast per use
    assert np.max(np.abs(int8 - fp32)) < 0.05 * np.max(np.abs(fp32))


def test_a_tied_export_has_no_output_tensor_and_loads_one_shared_matrix(tmp_path) -> None:
    path = export(tiny_checkpoint(tmp_path / "tied", tied=True), tmp_path / "tied.gguf", "bf16")
    model = load_model(path, memory="bf16")
    assert model.config.tie_word_embeddings and model.lm_head is model.embed_tokens


def test_rows_that_are_not_whole_blocks_fall_back_to_f16_with_a_note(tmp_path) -> None:
    source = tiny_checkpoint(tmp_path / "ckpt", intermediate_size=48)           # down_proj rows: 48 values
    checkpoint = open_checkpoint(source)
    notes = write_gguf(tmp_path / "m.gguf", checkpoint, read_tokenizer(source),
                       read_generation_defaults(source, checkpoint.config).sampling, "q8_0")
    types = {t.name: t.tensor_type for t in GGUFReader(tmp_path / "m.gguf").tensors}
    assert types["blk.0.ffn_down.weight"] == GGML.F16 and types["blk.0.ffn_up.weight"] == GGML.Q8_0
    assert any("blk.0.ffn_down.weight stays F16" in note for note in notes)


def test_a_failed_export_leaves_no_file(source, tmp_path, monkeypatch) -> None:
    calls = []

    def failing(values: np.ndarray, kind: GGML) -> np.ndarray:
        calls.append(kind)
        if len(calls) == 3:
            raise OSError("disk full")
        return original(values, kind)

    original = gguf.quants.quantize
    monkeypatch.setattr(gguf.quants, "quantize", failing)
    with pytest.raises(OSError):
        export(source, tmp_path / "m.gguf", "f16")
    assert list(tmp_path.iterdir()) == []


def test_an_f16_export_refuses_values_past_f16s_range(tmp_path) -> None:
    source = tiny_checkpoint(tmp_path / "ckpt")
    checkpoint, read = open_checkpoint(source), open_checkpoint(source).read
    checkpoint.read = lambda name, buffer=None: upcast(read(name)) * (1e6 if name.endswith("v_proj.weight") else 1)
    with pytest.raises(QwenNPError, match="tensor 'blk.0.attn_v.weight' has values beyond F16's largest"):
        write_gguf(tmp_path / "m.gguf", checkpoint, read_tokenizer(source), SamplingParams(), "f16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_an_ollama_blob_without_a_suffix_is_recognised_by_its_magic(source, tmp_path) -> None:
    blob = tmp_path / "sha256-0123abcd"
    export(source, blob, "f32")
    assert np.array_equal(logits(blob), logits(source))


def test_a_gguf_and_its_folder_give_a_run_the_same_config_and_tokenizer(source, tmp_path) -> None:
    folder, file = ModelFiles(source), ModelFiles(export(source, tmp_path / "m.gguf", "f32"))
    # (its eos_token_id and torch_dtype are the GGUF's own: the tokenizer's end token, the file's type)
    assert expected_tensors(Qwen3Config.from_dict(file.config_json())) == expected_tensors(folder.config)
    assert file.weight_files() == [file.path]
    assert [path.name for path in folder.weight_files()] == ["model.safetensors"]
    text = "<|im_start|>user\nHello there<|im_end|>"
    for files in (folder, file):
        out = tmp_path / f"{files.path.name}.tokenizer"
        out.mkdir()
        files.save_tokenizer_files(out)
        assert Tokenizer.from_folder(out).encode(text) == folder.tokenizer.encode(text)


# --- Damaged files ---------------------------------------------------------------------------------

def rewrite(good: Path, out: Path, architecture: str = "qwen3", drop: str = "", transpose: str = "",
            replace: dict[str, tuple[np.ndarray, GGML]] | None = None,
            metadata: dict[str, tuple[object, GGUFValueType] | None] | None = None) -> Path:
    """A copy of an F32 GGUF through gguf's writer, with one thing changed (replace: tensor name -> bytes,
    type, added when the file has no such tensor; metadata: key -> (value, type), or None to drop the key)."""
    reader = GGUFReader(good)
    writer = GGUFWriter(out, architecture)
    metadata = metadata or {}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name in metadata:
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    for key, given in metadata.items():
        if given is not None:
            value, kind = given
            writer.add_key_value(key, value, kind, sub_type=GGUFValueType.STRING if kind == GGUFValueType.ARRAY else None)
    replace = replace or {}
    for tensor in reader.tensors:
        if tensor.name in replace:
            writer.add_tensor(tensor.name, replace[tensor.name][0], raw_dtype=replace[tensor.name][1])
        elif tensor.name != drop:
            writer.add_tensor(tensor.name, tensor.data.T.copy() if tensor.name == transpose else np.array(tensor.data))
    for name in replace.keys() - {tensor.name for tensor in reader.tensors}:
        writer.add_tensor(name, replace[name][0], raw_dtype=replace[name][1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("good")
    return export(tiny_checkpoint(folder / "ckpt"), folder / "good.gguf", "f32")


DAMAGE = {
    "truncated": (lambda good, out: out.write_bytes(good.read_bytes()[:-100]) and out,
                  "tensor 'output.weight' runs to byte"),
    "truncated header": (lambda good, out: out.write_bytes(good.read_bytes()[:200]) and out, "a truncated or corrupt GGUF file"),
    "missing tensor": (lambda good, out: rewrite(good, out, drop="blk.1.ffn_up.weight"),
                       "tensor 'blk.1.ffn_up.weight' (model.layers.1.mlp.up_proj.weight) is missing"),
    "llama": (lambda good, out: rewrite(good, out, architecture="llama"), "general.architecture is 'llama'"),
    "transposed": (lambda good, out: rewrite(good, out, transpose="blk.0.attn_q.weight"),
                   "tensor 'blk.0.attn_q.weight' has shape [32, 64] (NumPy order) but the metadata implies [64, 32]"),
    "not gguf": (lambda good, out: out.write_bytes(b"GGUF" + bytes(3)) and out, "not a valid GGUF file"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_gguf_is_one_error_naming_the_field_or_tensor(good, tmp_path, case) -> None:
    make, message = DAMAGE[case]
    path = make(good, tmp_path / "bad.gguf")
    with pytest.raises(QwenNPError) as raised:
        load_model(path)
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert str(path) in str(raised.value)


# --- What a hostile probe got through: each reproduced on the file it was found on --------------------

class TookTooLong(BaseException):
    """A BaseException, so that no `except Exception` in the code under test can swallow the alarm."""


@contextmanager
def within(seconds: int) -> Iterator[None]:
    """Fail, instead of hanging the suite, when the block runs longer than `seconds`."""
    def expire(signum: int, frame: object) -> None:
        raise TookTooLong(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def refused(path: Path, message: str, seconds: int = 20) -> str:
    """The one-line QwenNPError naming `path` that loading `path` (model, tokenizer) gives, which holds `message`."""
    with within(seconds), pytest.raises(QwenNPError) as raised:
        load_model(path)
        read_tokenizer(path)
    text = str(raised.value)
    assert message in text and "\n" not in text and text.startswith(str(path)), text
    return text


def patched(source: Path, out: Path, offset: int, data: bytes) -> Path:
    """A copy of `source` with `data` written over its bytes at `offset` (the layout otherwise unchanged)."""
    raw = bytearray(source.read_bytes())
    raw[offset:offset + len(data)] = data
    out.write_bytes(bytes(raw))
    return out


def value_at(path: Path, key: str) -> int:
    """Where a metadata key's value starts: after its name's length, its name and its type (an array's: its entry type)."""
    field = GGUFReader(path).get_field(key)
    return field.offset + 8 + len(key.encode()) + 4


@pytest.fixture(scope="module")
def bundled_gguf(tmp_path_factory) -> Path:
    """The bundled 6-layer model as an F32 GGUF, the file the probe ran on (its token_type array ends where a
    whole number of int32s ends: gguf read past it as empty entries, forever)."""
    return export(BUNDLED, tmp_path_factory.mktemp("bundled") / "bundled.gguf", "f32")


@pytest.mark.parametrize("count", [2 ** 40, 2 ** 64 - 1, 2 ** 20 + 1, 10 ** 6, 2049, 1])
@pytest.mark.parametrize("key", ["tokenizer.ggml.token_type", "tokenizer.ggml.tokens", "tokenizer.ggml.merges"])
def test_an_array_claiming_more_entries_than_the_file_holds_is_refused_before_gguf_walks_it(
        bundled_gguf, tmp_path, key, count) -> None:
    path = patched(bundled_gguf, tmp_path / "bad.gguf", value_at(bundled_gguf, key) + 4, struct.pack("<Q", count))
    refused(path, "a truncated or corrupt GGUF file", seconds=10)


@pytest.mark.parametrize("layers", [65536, 2 ** 32 - 1])
def test_a_block_count_past_the_files_layers_is_refused_before_their_tensors_are_listed(
        bundled_gguf, tmp_path, layers) -> None:
    path = patched(bundled_gguf, tmp_path / "bad.gguf", value_at(bundled_gguf, "qwen3.block_count"), struct.pack("<I", layers))
    refused(path, f"qwen3.block_count is {layers} but the file's tensors hold 6 layers (tensor 'blk.6.attn_norm.weight' "
                  "is missing)", seconds=10)


def test_fewer_layers_declared_than_a_gguf_holds_are_refused_naming_the_tensors(bundled_gguf, tmp_path) -> None:
    path = patched(bundled_gguf, tmp_path / "two.gguf", value_at(bundled_gguf, "qwen3.block_count"), struct.pack("<I", 2))
    refused(path, "qwen3.block_count is 2 but the file holds tensors of 6 layers (44 tensors the metadata does not "
                  "account for, from 'blk.2.attn_norm.weight')")


def test_fewer_layers_declared_than_a_checkpoint_holds_are_refused_naming_the_tensors(tmp_path) -> None:
    folder = tmp_path / "two"
    shutil.copytree(BUNDLED, folder, ignore=shutil.ignore_patterns("draft"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    with pytest.raises(QwenNPError, match=r"config.json: num_hidden_layers is 2 but the checkpoint's tensors hold 6 "
                                          r"layers \(44 tensors config.json does not account for, from 'model.layers.2."):
        load_model(folder)


def test_a_tensor_no_config_accounts_for_is_refused_naming_it(good, tmp_path) -> None:
    extra = np.ones(16, np.float32)
    refused(rewrite(good, tmp_path / "extra.gguf", replace={"rope_freqs.weight": (extra, GGML.F32)}),
            "1 tensor(s) the metadata does not account for, from 'rope_freqs.weight'")
    folder = tiny_checkpoint(tmp_path / "ckpt")
    tensors = {name: open_checkpoint(folder).read(name) for name in open_checkpoint(folder).tensors}
    save_checkpoint(folder, json.loads((folder / "config.json").read_text()),
                    [{**tensors, "model.layers.0.mlp.bias": extra}])
    with pytest.raises(QwenNPError, match="1 tensor\\(s\\) config.json does not account for, from 'model.layers.0.mlp.bias'"):
        load_model(folder)


def test_two_tensors_on_the_same_bytes_are_refused(bundled_gguf, tmp_path) -> None:
    first, second = GGUFReader(bundled_gguf).tensors[:2]
    offset = second.field.offset + sum(int(part.nbytes) for part in second.field.parts) - 8     # its data offset, last
    path = patched(bundled_gguf, tmp_path / "shared.gguf", offset, struct.pack("<Q", int(first.field.parts[-1][0])))
    refused(path, f"tensor {second.name!r} has data offset 0 where ggml expects")


def test_an_rms_norm_eps_of_1e30_is_refused_in_a_gguf_and_a_checkpoint(bundled_gguf, tmp_path) -> None:
    path = patched(bundled_gguf, tmp_path / "eps.gguf", value_at(bundled_gguf, "qwen3.attention.layer_norm_rms_epsilon"),
                   struct.pack("<f", 1e30))
    refused(path, "rms_norm_eps is 1e+30; it must be at most 0.001")
    folder = tiny_checkpoint(tmp_path / "ckpt")
    config = json.loads((folder / "config.json").read_text())
    for field, value, message in (("rms_norm_eps", 1e30, "rms_norm_eps is 1e+30; it must be at most 0.001"),
                                  ("rope_theta", "1e400", "rope_theta must be finite, got inf")):
        (folder / "config.json").write_text(json.dumps({**config, field: value}).replace('"1e400"', "1e400"))
        with pytest.raises(QwenNPError, match=re.escape(message)):
            load_model(folder)


def qwen2_tokenizer_gguf(good: Path, out: Path, tokens: list[str] | None = None, merges: list[str] | None = None) -> Path:
    """`good` with its tokenizer described only by tokenizer.ggml.* (pre "qwen2", no tokenizer.json), as
    llama.cpp's converter writes Qwen's, so that qwen_np rebuilds the BPE from the token list and merges."""
    reader = GGUFReader(good)
    tokens = tokens or reader.get_field("tokenizer.ggml.tokens").contents()
    merges = merges or reader.get_field("tokenizer.ggml.merges").contents()
    return rewrite(good, out, metadata={"tokenizer.huggingface.json": None,
                                        "tokenizer.ggml.pre": ("qwen2", GGUFValueType.STRING),
                                        "tokenizer.ggml.tokens": (tokens, GGUFValueType.ARRAY),
                                        "tokenizer.ggml.merges": (merges, GGUFValueType.ARRAY)})


@pytest.mark.slow
def test_damaged_text_in_the_metadata_is_one_error_naming_the_key(good, tmp_path) -> None:
    reader = GGUFReader(good)
    embedded = reader.get_field("tokenizer.huggingface.json")
    json_at = embedded.offset + sum(int(part.nbytes) for part in embedded.parts[:4])       # its first character
    for offset, byte, message in (
            (json_at + 100, 0xa2, "metadata key 'tokenizer.huggingface.json' is not valid UTF-8"),
            (json_at + 100, ord("b"), "metadata key 'tokenizer.huggingface.json' is not a tokenizer.json tokenizers can read"),
            (value_at(good, "tokenizer.ggml.tokens") + 12 + 8, 0xff, "metadata key 'tokenizer.ggml.tokens' is not valid UTF-8"),
            (reader.get_field("general.architecture").offset + 8, 0xff,
             "the name of metadata key #0 at byte 32 is not valid UTF-8")):
        refused(patched(good, tmp_path / "bad.gguf", offset, bytes([byte])), message)
    refused(rewrite(good, tmp_path / "template.gguf", metadata={"tokenizer.chat_template": ("{% if %}", GGUFValueType.STRING)}),
            "metadata key 'tokenizer.chat_template' does not compile as a chat template (line 1: ")
    tokens = reader.get_field("tokenizer.ggml.tokens").contents()
    merges = reader.get_field("tokenizer.ggml.merges").contents()
    assert read_tokenizer(qwen2_tokenizer_gguf(good, tmp_path / "qwen2.gguf")).encode("ROMEO: a word")   # it builds
    refused(qwen2_tokenizer_gguf(good, tmp_path / "twice.gguf", tokens=[*tokens[:300], tokens[299], *tokens[301:]]),
            f"tokenizer.ggml.tokens holds {tokens[299]!r} twice (ids 299 and 300)")
    refused(qwen2_tokenizer_gguf(good, tmp_path / "merge.gguf", merges=["zzqx qqzx", *merges[1:]]),
            "tokenizer.ggml.merges does not fit tokenizer.ggml.tokens (Error while initializing BPE: Token `zzqx` out of "
            "vocabulary)")


UNKNOWN_KEYS = {
    "misspelt": ({"qwen3.rope.freq_base": None, "qwen3.rope.freq_basf": (1e6, GGUFValueType.FLOAT32)},
                 "metadata key 'qwen3.rope.freq_basf' is not a qwen3 setting qwen_np knows"),
    "yarn attention factor": ({"qwen3.rope.scaling.yarn_attn_factor": (1.2, GGUFValueType.FLOAT32)},
                              "metadata key 'qwen3.rope.scaling.yarn_attn_factor' is not a qwen3 setting qwen_np knows"),
    "factor without yarn": ({"qwen3.rope.scaling.factor": (4.0, GGUFValueType.FLOAT32)},
                            "qwen3.rope.scaling.factor is set but qwen3.rope.scaling.type is not 'yarn'"),
    "linear rope scaling": ({"qwen3.rope.scaling.type": ("linear", GGUFValueType.STRING)},
                            "qwen3.rope.scaling.type is 'linear'; only default RoPE and 'yarn' are supported"),
    "yarn without its window": ({"qwen3.rope.scaling.type": ("yarn", GGUFValueType.STRING),
                                 "qwen3.rope.scaling.factor": (4.0, GGUFValueType.FLOAT32)},
                                "YaRN scaling needs qwen3.rope.scaling.original_context_length"),
    "partial rope": ({"qwen3.rope.dimension_count": (8, GGUFValueType.UINT32)}, "qwen3.rope.dimension_count is 8, not 16"),
    "vocab size": ({"qwen3.vocab_size": (4096, GGUFValueType.UINT32)}, "qwen3.vocab_size is 4096, not 2048"),
}


@pytest.mark.parametrize("case", UNKNOWN_KEYS)
def test_a_qwen3_key_that_would_change_the_network_is_refused_not_ignored(good, tmp_path, case) -> None:
    metadata, message = UNKNOWN_KEYS[case]
    refused(rewrite(good, tmp_path / "bad.gguf", metadata=metadata), message)


def test_the_known_keys_given_their_right_values_load(good, tmp_path) -> None:
    path = rewrite(good, tmp_path / "keys.gguf", metadata={"qwen3.rope.dimension_count": (16, GGUFValueType.UINT32),
                                                           "qwen3.vocab_size": (2048, GGUFValueType.UINT32)})
    assert np.array_equal(logits(path), logits(good))


# Qwen's documented YaRN (factor 4 over the original window, here 16 positions: the prompt's 10 tokens and 30
# more through the cache reach 2.5 times past it), and one with its betas given.
YARN = {"documented": {"factor": 4.0}, "betas": {"factor": 3.0, "beta_fast": 16.0, "beta_slow": 2.0}}


@pytest.mark.parametrize("case", YARN)
def test_a_yarn_checkpoint_exported_as_gguf_reads_back_its_scaling_and_gives_its_logits_past_the_window(
        tmp_path, case) -> None:
    """tests/core/test_yarn.py holds the checkpoint's YaRN to transformers; its GGUF (rope.scaling.type, factor,
    original_context_length and the betas where not llama.cpp's defaults) must give the same network."""
    scaling = {"rope_type": "yarn", "original_max_position_embeddings": 16, **YARN[case]}
    source = tiny_checkpoint(tmp_path / "ckpt", rope_scaling=scaling, max_position_embeddings=16)
    path = export(source, tmp_path / "yarn.gguf", "f32")
    fields = GGUFReader(path).fields
    assert fields["qwen3.rope.scaling.type"].contents() == "yarn"
    assert ("qwen3.rope.scaling.yarn_beta_fast" in fields) == (case == "betas")
    assert read_config(path).rope_scaling == read_config(source).rope_scaling is not None
    ids = np.random.default_rng(3).integers(0, 2048, 40)
    models = [load_model(p, memory="fp32") for p in (source, path)]
    caches = [model.new_cache(40) for model in models]
    for model, cache in zip(models, caches):
        model.forward(ids[:10], cache)
    steps = [np.concatenate([model.forward(ids[t:t + 1], cache) for t in range(10, 40)]) for model, cache in
             zip(models, caches)]
    assert_logits_match(steps[1], steps[0], "the GGUF's decode past the original window")


@pytest.mark.parametrize("scaling, field", [({"attention_factor": 1.3}, "attention_factor"),
                                            ({"truncate": False}, "truncate")])
def test_a_yarn_llama_cpp_would_compute_otherwise_is_not_exported(tmp_path, scaling, field) -> None:
    source = tiny_checkpoint(tmp_path / "ckpt", max_position_embeddings=16,
                             rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                           **scaling})
    with pytest.raises(QwenNPError, match="YaRN rope_scaling with its own attention_factor .* or truncate false") as raised:
        export(source, tmp_path / "yarn.gguf", "f32")
    assert raised.value.param == "model" and field in str(raised.value)
    assert not list(tmp_path.glob("*.gguf*"))


def test_iq_kinds_are_dequantized_to_fp32_at_load_by_gguf_and_say_so(tmp_path) -> None:
    good = export(tiny_checkpoint(tmp_path / "ckpt", hidden_size=256), tmp_path / "f32.gguf", "f32")
    blocks = np.random.default_rng(0).integers(0, 256, size=(64, 8, 18), dtype=np.uint8)   # q_proj: 64 rows of 256
    blocks[..., :2] = np.array([1e-3], np.float16).view(np.uint8)    # each IQ4_NL block's FP16 scale: small, finite
    path = rewrite(good, tmp_path / "iq4_nl.gguf", replace={"blk.0.attn_q.weight": (blocks.reshape(64, -1), GGML.IQ4_NL)})
    checkpoint = GGUFCheckpoint(path)
    q_proj = LAYER_TENSORS["q_proj"].name.format(i=0)
    assert np.array_equal(checkpoint.read(q_proj), gguf.quants.dequantize(blocks.reshape(64, -1), GGML.IQ4_NL))
    assert isinstance(checkpoint.held(q_proj), np.ndarray)
    assert "its IQ4_NL tensors are dequantized to FP32 at load" in (checkpoint.dequantization_note() or "")
    assert np.isfinite(load_model(path).forward(PROMPT)).all()


# --- Files of llama.cpp's block kinds, kept as stored ------------------------------------------------

BLOCK_KIND_CYCLE = ["Q4_K", "Q6_K", "Q5_K", "Q3_K", "Q2_K", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_0"]


def block_gguf(source: Path, out: Path, kinds: list[str] = BLOCK_KIND_CYCLE) -> Path:
    """The source checkpoint as a GGUF whose matrices are random blocks of `kinds`, in turn (a mix, as a
    Q4_K_M file mixes Q4_K and Q6_K), FP16 scales ~1e-3; norms F32. Written through gguf's writer
    (gguf cannot quantize the K-quants: these are the blocks a quantizer could have written)."""
    from tests.conftest import FP16_FIELDS, random_blocks

    f32 = export(source, out.with_suffix(".f32.gguf"), "f32")
    replace: dict[str, tuple[np.ndarray, GGML]] = {}
    matrices = [t for t in GGUFReader(f32).tensors if len(t.shape) == 2]
    for i, tensor in enumerate(matrices):
        kind, (rows, columns) = kinds[i % len(kinds)], (int(tensor.shape[1]), int(tensor.shape[0]))
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[GGML[kind]]
        if kind in FP16_FIELDS:
            blocks = random_blocks(kind, rows, columns // block_values, seed=i, scales=(2e-4, 2e-3))
        else:                                                          # Q8_0, Q4_0: gguf's own quantizer
            blocks = gguf.quants.quantize(np.asarray(tensor.data).reshape(rows, columns), GGML[kind])
        replace[tensor.name] = (blocks.reshape(rows, -1), GGML[kind])
    rewrite(f32, out, replace=replace)
    f32.unlink()
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def blocks_file(request, tmp_path_factory) -> Path:
    """A tiny Qwen3 (rows of 256 and 512 values: whole K-quant blocks) as a GGUF of every block kind."""
    folder = tmp_path_factory.mktemp("blocks")
    source = tiny_checkpoint(folder / "ckpt", tied=request.param, hidden_size=256, intermediate_size=512,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    return block_gguf(source, folder / "blocks.gguf")


@pytest.mark.slow
def test_every_block_kind_is_kept_as_views_of_the_file_or_repacked_and_planned_at_its_size(blocks_file: Path) -> None:
    """Each matrix a view of the file's blocks, but those repacked at load (Q8_0, Q4_0, Q4_K, Q6_K: the cheapest in
    extra bytes first, within 20% of the file's tensor bytes); the plan counts what is held."""
    from qwen_np.files.gguf_file import REPACK_BUDGET
    from qwen_np.numbers.formats import FormatRows
    from qwen_np.numbers.ggml_blocks import BlockRows
    from qwen_np.numbers.ggml_repacked import REPACKINGS, RepackedRows, repackable

    model = load_model(blocks_file, memory="stored")
    checkpoint = GGUFCheckpoint(blocks_file)
    file_types = {t.name: t.tensor_type.name for t in GGUFReader(blocks_file).tensors}
    assert checkpoint.dequantization_note() is None
    layers, seen, repacked = model.config.num_hidden_layers, set(), set()
    for i, layer in enumerate(model.layers):
        for key in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            name = LAYER_TENSORS[key].name.format(i=i)
            weight, kind = getattr(layer, key), file_types[gguf_tensor_name(name, layers)]
            seen.add(kind)
            if name in checkpoint.repacked:     # its parts taken apart: what Repacking.held_bytes counts
                assert isinstance(weight, RepackedRows) and weight.kind == kind
                assert weight.nbytes == REPACKINGS[kind].held_bytes(weight.shape[0] * weight.shape[1])
                repacked.add(kind)
            elif kind in ("Q8_0", "Q4_0"):
                assert isinstance(weight, FormatRows) and weight.fmt == kind.lower()
            else:
                assert isinstance(weight, BlockRows) and weight.kind == kind and not weight.blocks.flags.owndata
                assert np.shares_memory(weight.blocks, open_reader(blocks_file).data)   # a view of the mapped file
    assert seen >= set(BLOCK_KIND_CYCLE) - {"Q4_0"}                  # 14 matrices: every kind in the layers but one
    assert repacked >= {"Q8_0", "Q4_K"} & seen                       # the cheap ones first
    embedding = MODEL_TENSORS["embed_tokens"].name
    assert repackable(file_types["token_embd.weight"], model.config.hidden_size)
    if not model.config.tie_word_embeddings:                        # untied: only its prompt rows are read
        assert embedding not in checkpoint.repacked and not isinstance(model.embed_tokens, RepackedRows)
    tensors = {t.name: t for t in GGUFReader(blocks_file).tensors}
    stored = sum(int(t.n_bytes) for t in tensors.values())
    extra = sum(REPACKINGS[t.tensor_type.name].held_bytes(int(t.n_elements)) - int(t.n_bytes)
                for name, t in tensors.items() if name in {gguf_tensor_name(n, layers) for n in checkpoint.repacked})
    assert 0 < extra <= REPACK_BUDGET * stored
    assert model.plan.mode == "bf16" and model.plan.stored_weight_bytes == pytest.approx(stored + extra, rel=1e-6)
    assert stored < blocks_file.stat().st_size                      # the rest: metadata and the vocabulary


def assert_transformers_logits_on_ggufs_dequantization(path: Path, config_folder: Path) -> None:
    """The done-when's check: transformers' Qwen3ForCausalLM with the file's tensors as transformers' own GGUF
    loader reads them (gguf.quants.dequantize, its name mapping) against qwen_np kept as stored, fast and
    readable, a prompt at once and then decoded a token and 5 at a time: within 1e-4 of the largest logit,
    the same argmax (tests/reference/logit_match.py at the done-when's tolerance)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import AutoConfig, Qwen3ForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(config_folder)
    config._attn_implementation = "eager"
    reference = Qwen3ForCausalLM(config).float().eval()
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=reference)["tensors"]
    missing, unexpected = reference.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}          # tied: the embedding's
    ids = [5, 17, 300, 42, 1999, 7, 7, 64, 1024, 3, 11, 12, 13, 14, 15, 16]
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0].numpy()
    for fast in (True, False):
        model = load_model(path, memory="stored", fast=fast)
        cache = model.new_cache(32)
        got = np.concatenate([model.forward(ids[:10], cache), model.forward(ids[10:11], cache),
                              model.forward(ids[11:], cache)])
        assert_logits_match(got, want, f"{path.name}, fast={fast}", tolerance=1e-4)


@pytest.mark.slow
def test_a_block_kind_gguf_gives_transformers_logits_on_ggufs_own_dequantization(blocks_file: Path) -> None:
    assert_transformers_logits_on_ggufs_dequantization(blocks_file, blocks_file.parent / "ckpt")


def test_int8_from_a_block_kind_gguf_requantizes_its_dequantized_rows(blocks_file: Path) -> None:
    from qwen_np.numbers.formats import round_trip
    from qwen_np.numbers.numerics import Int8Rows

    stored, int8 = load_model(blocks_file, memory="stored"), load_model(blocks_file, memory="int8")
    assert isinstance(int8.layers[0].q_proj, Int8Rows)
    for name in ("q_proj", "down_proj"):
        ours = getattr(int8.layers[1], name)
        want = round_trip(upcast(getattr(stored.layers[1], name)), "int8")
        assert np.array_equal(upcast(ours), want)            # the file's values, quantized to int8 rows
    reference, quantized = stored.forward(PROMPT), int8.forward(PROMPT)
    assert np.max(np.abs(quantized - reference)) < 0.05 * np.max(np.abs(reference))
    assert np.array_equal(load_model(blocks_file, memory="bf16").forward(PROMPT), stored.forward(PROMPT))


def test_an_extensionless_copy_of_a_block_kind_gguf_loads_as_the_file(blocks_file: Path, tmp_path: Path) -> None:
    blob = tmp_path / "sha256-5eee1ed3f1e2"                          # an Ollama blob: no suffix, recognised by its magic
    shutil.copy(blocks_file, blob)
    assert np.array_equal(load_model(blob, memory="stored").forward(PROMPT),
                          load_model(blocks_file, memory="stored").forward(PROMPT))


# --- Files llama.cpp made ----------------------------------------------------------------------------
# Made by llama.cpp's own converter and quantizer (tests/fixtures/llama_cpp/README.md; remade by
# tools/make_llama_cpp_ggufs.py): its scales and minima as its quantizer picks them, its per-tensor mixes
# (Q4_K_M's Q6_K layers, Q3_K_M's four kinds, Q4_0's Q6_K embedding), its metadata and alignment.

LLAMA_CPP = ROOT / "tests" / "fixtures" / "llama_cpp"
LLAMA_CPP_FILES = sorted(LLAMA_CPP.glob("*.gguf"))


def test_the_llama_cpp_fixtures_are_the_done_whens_six_mixes() -> None:
    assert {p.stem for p in LLAMA_CPP_FILES} >= {"Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "Q8_0", "Q4_0", "Q4_K_M-untied"}


@pytest.mark.parametrize("path", LLAMA_CPP_FILES, ids=lambda p: p.stem)
def test_a_file_llama_cpps_quantizer_made_is_held_as_its_blocks_at_its_size(path: Path) -> None:
    """Its blocks (some repacked, for at most 20% more), nothing widened to FP32, within 1.25x the file."""
    from qwen_np.numbers.formats import FormatRows
    from qwen_np.numbers.ggml_blocks import BlockRows
    from qwen_np.numbers.ggml_repacked import RepackedRows

    model = load_model(path, memory="stored")
    assert GGUFCheckpoint(path).dequantization_note() is None          # nothing widened to FP32 at load
    for layer in model.layers:
        for key in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            assert isinstance(getattr(layer, key), (BlockRows, FormatRows, RepackedRows)), f"{path.name}: {key}"
    stored = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
    assert stored <= model.plan.stored_weight_bytes <= 1.2 * stored <= 1.25 * path.stat().st_size


@pytest.mark.slow
@pytest.mark.parametrize("path", LLAMA_CPP_FILES, ids=lambda p: p.stem)
def test_a_file_llama_cpps_quantizer_made_gives_transformers_logits_on_its_dequantization(path: Path, tmp_path: Path) -> None:
    config = json.loads((LLAMA_CPP / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": "untied" not in path.stem}))
    assert_transformers_logits_on_ggufs_dequantization(path, tmp_path)


def resident_bytes(path: Path) -> int:
    """This process's resident bytes of its mappings of `path` (/proc/self/smaps' Rss lines)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
@pytest.mark.parametrize("memory", ["int8", "q8_0", "stored"])
def test_a_tensor_copied_out_of_a_gguf_lets_go_of_the_files_pages(tmp_path: Path, memory: str) -> None:
    """--memory int8 / q8_0 copy every matrix out of the file, and kept as stored the repacked ones are copied: the
    file's pages of what was copied leave the process's resident memory (the page cache keeps them), so a load
    costs its copy, not its copy and the file. Q4_K_M's repacked tensors: most of this file's bytes."""
    path = tmp_path / "copy.gguf"
    shutil.copy(LLAMA_CPP / "Q4_K_M.gguf", path)                     # a reader of its own: no pages touched before
    model = load_model(path, memory=memory)
    tensors = GGUFReader(path).tensors
    repacked = {gguf_tensor_name(name, model.config.num_hidden_layers) for name in GGUFCheckpoint(path).repacked}
    copied = sum(int(t.n_bytes) for t in tensors if len(t.shape) == 2) if memory != "stored" else \
        sum(int(t.n_bytes) for t in tensors if t.name in repacked)
    model.forward(PROMPT)                                            # stored: the blocks' pages are read here
    assert copied > 0.2 * path.stat().st_size
    # Not every copied page stays out: Linux's fault-around maps up to 64 KiB of cached pages around each
    # later read of the file (its header, the norms kept mapped), some of them a copied tensor's; how many
    # varies with the kernel and the run (the whole file stays resident without the release)
    assert resident_bytes(path) <= path.stat().st_size - copied // 3


# --- The tokenizer on the real Qwen3 vocabulary ----------------------------------------------------

@pytest.fixture(scope="module")
def qwen3_gguf(tmp_path_factory) -> Path:
    return export(QWEN3_RANDOM, tmp_path_factory.mktemp("qwen3") / "qwen3.gguf", "q8_0")


TEXTS = ["Hello, world! It's a test.", "def f(x):\n    return x**2  # square\n\n\n", "猫は日本語を話しますか？中文也可以。",
         "emoji 🤖🎉👩‍💻 and accents: café naïve Ångström", "   leading and trailing spaces   ", "123456789 3.14159 1e-6",
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nok<|endoftext|>",
         "<tool_call>{\"name\": \"f\"}</tool_call> <|fim_prefix|>a<|fim_suffix|>", "e\u0301 (decomposed é, NFC)", "\t\r\n tabs"]


@pytest.mark.slow
def test_the_gguf_tokenizer_gives_the_hugging_face_ids(qwen3_gguf) -> None:
    hf, ours = read_tokenizer(QWEN3_RANDOM), read_tokenizer(qwen3_gguf)
    for text in TEXTS:
        ids = hf.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == hf.decode(ids)
    assert ours.vocab_size == hf.vocab_size == 151669          # the [PAD] padding is not a token
    assert (ours.eos_token_id, ours.pad_token_id) == (hf.eos_token_id, hf.pad_token_id) == (151645, 151643)


@pytest.mark.slow
def test_the_gguf_chat_template_renders_as_the_checkpoints(qwen3_gguf) -> None:
    hf, ours = read_tokenizer(QWEN3_RANDOM), read_tokenizer(qwen3_gguf)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}, {"role": "user", "content": "猫?"}]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    for thinking in (None, False):
        assert ours.apply_chat_template(messages, enable_thinking=thinking, tools=tools) == \
            hf.apply_chat_template(messages, enable_thinking=thinking, tools=tools)


@pytest.mark.slow
def test_qwen3_vocabulary_is_written_as_llama_cpps_converter_writes_it(qwen3_gguf) -> None:
    reader = GGUFReader(qwen3_gguf)
    field = reader.get_field
    tokens, types = field("tokenizer.ggml.tokens").contents(), field("tokenizer.ggml.token_type").contents()
    assert (field("tokenizer.ggml.model").contents(), field("tokenizer.ggml.pre").contents()) == ("gpt2", "qwen2")
    assert len(tokens) == 151936 and tokens[151669] == "[PAD151669]" and types[151669] == TokenType.UNUSED
    assert types[tokens.index("<|im_start|>")] == types[tokens.index("<|fim_prefix|>")] == TokenType.CONTROL
    assert types[tokens.index("<think>")] == TokenType.USER_DEFINED and types[tokens.index("Ġthe")] == TokenType.NORMAL
    assert [field(f"tokenizer.ggml.{key}_token_id").contents() for key in ("bos", "eos", "padding")] == \
        [151643, 151645, 151643]
    assert field("tokenizer.huggingface.json") is None and field("tokenizer.chat_template") is not None
    assert read_config(qwen3_gguf).eos_token_ids == [151645, 151643]     # <|im_end|>, then <|endoftext|>
    assert read_generation_defaults(qwen3_gguf, read_config(qwen3_gguf)) == \
        read_generation_defaults(QWEN3_RANDOM, read_config(QWEN3_RANDOM))  # temperature 0.6, top-p 0.95, top-k 20


# --- The command line ------------------------------------------------------------------------------

def qwen(*args: str) -> subprocess.CompletedProcess:
    env = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "QWEN_NP_CACHE": "off",
           "PYTHONDONTWRITEBYTECODE": "1"}                                  # no __pycache__ in the checkout
    return subprocess.run([sys.executable, "-m", "qwen_np", *args], cwd=ROOT, capture_output=True, timeout=HANG_SECONDS,
                          env=env)


@pytest.mark.slow
def test_export_from_the_cli_then_generate_from_the_gguf_gives_the_same_text(tmp_path) -> None:
    out = tmp_path / "bundled.gguf"
    exported = qwen("export", str(out), "--type", "bf16")              # default: the bundled model
    assert exported.returncode == 0 and out.is_file(), exported.stderr.decode()
    flags = ("generate", "--no-chat", "--temperature", "0", "-n", "16", "ROMEO:")
    from_gguf, from_folder = qwen(*flags, "--model", str(out)), qwen(*flags)
    assert from_gguf.returncode == 0, from_gguf.stderr.decode()
    assert from_gguf.stdout == from_folder.stdout and len(from_gguf.stdout.decode().strip()) > 0


@pytest.mark.slow
def test_a_bad_gguf_on_the_cli_is_one_error_line_and_exit_2(tmp_path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    result = qwen("generate", "--model", str(bad), "hi")
    lines = result.stderr.decode().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {bad}")
    result = qwen("export", str(tmp_path / "no-such-folder" / "out.gguf"))
    assert result.returncode == 2 and result.stderr.decode().startswith("error: OUT.gguf:")


@pytest.mark.parametrize("file_type", ["q8_0", "q4_0"])
def test_a_q8_0_or_q4_0_gguf_kept_as_stored_holds_its_blocks_not_fp32(source: Path, tmp_path: Path, file_type: str) -> None:
    """--memory bf16 ("as stored") on a Q8_0/Q4_0 file: its blocks repacked at load where they can be (Q4_0: rows of
    256 values; this model's are 32 and 64, kept as the file's blocks), or, as_stored, views of the file's blocks; the
    same values and logits as quantizing the source checkpoint at load (--memory q8_0/q4_0), and the plan counts
    what is held: the file's bytes and the repacking's few percent."""
    from qwen_np.numbers.formats import FormatRows
    from qwen_np.numbers.ggml_repacked import REPACKINGS, RepackedRows, repackable

    path = export(source, tmp_path / f"m-{file_type}.gguf", file_type)
    from_file = load_model(path, memory="bf16")
    at_load = load_model(source, memory=file_type)
    checkpoint = GGUFCheckpoint(path)
    for i, (ours, theirs) in enumerate(zip(from_file.layers, at_load.layers)):
        if repackable(file_type.upper(), ours.q_proj.shape[1]):
            assert isinstance(ours.q_proj, RepackedRows) and ours.q_proj.kind == file_type.upper()
        else:
            assert isinstance(ours.q_proj, FormatRows) and ours.q_proj.fmt == file_type
        assert np.array_equal(upcast(ours.q_proj), upcast(theirs.q_proj))
        blocks = checkpoint.as_stored(LAYER_TENSORS["q_proj"].name.format(i=i))
        assert isinstance(blocks, FormatRows) and blocks.fmt == file_type
        assert np.may_share_memory(*blocks.parts)         # codes and scales interleave: views of the blocks, no copy
        assert all(np.array_equal(a.reshape(b.shape), b) for a, b in zip(blocks.parts, theirs.q_proj.parts))
    prompt = np.arange(1, 12)
    assert_logits_match(from_file.forward(prompt), at_load.forward(prompt), f"{file_type} file, repacked")
    repacking = REPACKINGS[file_type.upper()]
    assert repacking.held_bytes(1024) / 1024 <= 1.12 * (repacking.bits / 8 + 2 / 32)     # 6-11% over the blocks
    assert from_file.plan.stored_weight_bytes < 0.6 * load_model(source, memory="bf16").plan.stored_weight_bytes


def test_tensors_written_as_given_blocks_are_held_as_those_bytes(tmp_path: Path) -> None:
    """write_gguf_tensors writes whatever bytes it is handed (bench/big_models.py's random Q4_0 blocks,
    without any model in memory): the file holds them, and a load keeps them as they are."""
    config = read_config(tiny_checkpoint(tmp_path / "src"))
    given: dict[str, np.ndarray] = {}

    def tensor_data(hf: str, gguf_name: str, shape: tuple[int, ...], kind: GGML) -> np.ndarray:
        rng = np.random.default_rng(len(given))
        if len(shape) == 1:
            given[hf] = rng.standard_normal(shape).astype(np.float32)
        else:
            blocks = rng.integers(0, 256, size=(shape[0], shape[1] // 32, 18), dtype=np.uint8)
            blocks[..., :2] = np.float16(0.01).reshape(1).view(np.uint8)      # finite scales
            given[hf] = blocks.reshape(gguf.quants.quant_shape_to_byte_shape(shape, kind))
        return given[hf]

    path = tmp_path / "blocks.gguf"
    write_gguf_tensors(path, config, read_tokenizer(tmp_path / "src"), SamplingParams(), tensor_data, "q4_0")
    model = load_model(path, memory="bf16")
    held = model.layers[1].down_proj
    codes, scales = held.parts
    blocks = given[LAYER_TENSORS["down_proj"].name.format(i=1)].reshape(*scales.shape, 18)
    assert np.array_equal(codes, blocks[..., 2:]) and np.array_equal(scales, blocks[..., :2].view(np.float16)[..., 0])
    assert np.array_equal(model.layers[1].input_layernorm, given[LAYER_TENSORS["input_layernorm"].name.format(i=1)])


def test_a_mix_writes_each_matrix_in_its_own_type(tmp_path: Path) -> None:
    """write_gguf_tensors with a Mix (llama.cpp's per-tensor choices, as a Q4_K_M file's): every matrix in the
    type the mix names for it, 1-D tensors F32, and the file type the mix declares."""
    from gguf import LlamaFileType

    from qwen_np.files.gguf_export import Mix

    config = read_config(tiny_checkpoint(tmp_path / "src"))
    mix = Mix(LlamaFileType.MOSTLY_Q4_K_M, lambda name: GGML.Q8_0 if "ffn_down" in name else GGML.Q4_0)

    def tensor_data(hf: str, gguf_name: str, shape: tuple[int, ...], kind: GGML) -> np.ndarray:
        if len(shape) == 1:
            return np.ones(shape, np.float32)
        return gguf.quants.quantize(np.full(shape, 0.01, np.float32), kind)

    path = tmp_path / "mix.gguf"
    write_gguf_tensors(path, config, read_tokenizer(tmp_path / "src"), SamplingParams(), tensor_data, mix)
    reader = open_reader(path)
    types = {t.name: GGML(t.tensor_type) for t in reader.tensors}
    assert {name for name, kind in types.items() if kind == GGML.Q8_0} == \
        {f"blk.{i}.ffn_down.weight" for i in range(config.num_hidden_layers)}
    assert all(kind == (GGML.F32 if name.endswith("norm.weight") else GGML.Q4_0)
               for name, kind in types.items() if "ffn_down" not in name)
    assert int(reader.fields["general.file_type"].parts[-1][0]) == LlamaFileType.MOSTLY_Q4_K_M
