"""The checkpoint reader: exact BF16 upcast, and every broken checkpoint fails with a useful message."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from qwen_np import QwenNPError, load_model
from qwen_np.files.checkpoint import read_header
from qwen_np.numbers import numerics
from qwen_np.numbers.numerics import StoredRows, bf16_bits_to_f32, dtype_named, f32_to_bf16_bits


def test_bf16_upcast_is_exact_for_all_65536_bit_patterns():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    values = bf16_bits_to_f32(bits)
    # BF16 is the top half of an FP32 word: the upcast must reproduce it bit for bit
    assert np.array_equal(values.view(np.uint32), bits.astype(np.uint32) << 16)
    assert np.isposinf(values[0x7F80]) and np.isneginf(values[0xFF80])
    assert np.isnan(values[0x7FC0]) and np.isnan(values[0x7F81])            # quiet and signalling NaN
    assert values[0x0001] == np.float32(2.0 ** -133)                           # smallest subnormal
    assert values[0x8000] == 0 and np.signbit(values[0x8000])                 # -0.0 keeps its sign
    finite = ~np.isnan(values)
    assert np.array_equal(f32_to_bf16_bits(values[finite]), bits[finite])     # and back again


@pytest.mark.slow
def test_bf16_rounding_matches_torch_round_to_nearest_even():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(0).standard_normal(100_000).astype(np.float32) * 1e3
    x[:4] = [1.00390625, 1.01171875, -1.00390625, 3.0e38]                    # exact ties and overflow
    ours = f32_to_bf16_bits(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, theirs)


# --- Broken files --------------------------------------------------------------------------------

def _write_raw(path: Path, header: dict, data: bytes, header_len: int | None = None) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if header_len is None else header_len) + text + data)


def _valid_header() -> tuple[dict, bytes]:
    header = {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
              "b": {"dtype": "BF16", "shape": [4], "data_offsets": [16, 24]}}
    return header, bytes(24)


def _entry(**changes: object) -> dict:
    header, _ = _valid_header()
    header["a"] = {**header["a"], **changes}
    return header


BROKEN_FILES = {
    "empty file": (lambda p: p.write_bytes(b""), "truncated safetensors file (0 bytes"),
    "truncated length prefix": (lambda p: p.write_bytes(b"\x10\x00"), "truncated"),
    "header length past the end": (lambda p: _write_raw(p, *_valid_header(), header_len=10_000), "past the end"),
    "huge header length": (lambda p: _write_raw(p, *_valid_header(), header_len=2**40), "exceeds"),
    "header not JSON": (lambda p: p.write_bytes(struct.pack("<Q", 5) + b"{nope"), "not valid UTF-8 JSON"),
    "header not an object": (lambda p: _write_raw(p, [1, 2], b""), "not a JSON object"),
    "unknown dtype": (lambda p: _write_raw(p, _entry(dtype="F33"), bytes(24)), "unknown dtype 'F33'"),
    "negative offset": (lambda p: _write_raw(p, _entry(data_offsets=[-16, 0]), bytes(24)), "invalid data_offsets"),
    "offsets out of range": (lambda p: _write_raw(p, _valid_header()[0], bytes(20)), "run past"),
    "span != shape": (lambda p: _write_raw(p, _entry(shape=[3, 2]), bytes(24)), "byte span 16 != prod(shape [3, 2])"),
    "overlapping tensors": (lambda p: _write_raw(p, {**_valid_header()[0], "b": {"dtype": "BF16", "shape": [4],
                                                     "data_offsets": [8, 16]}}, bytes(16)), "overlaps"),
    "truncated data": (lambda p: _write_raw(p, _valid_header()[0], bytes(23)), "truncated"),
    "trailing bytes": (lambda p: _write_raw(p, _valid_header()[0], bytes(32)), "data buffer holds 32"),
    "header nested too deeply": (lambda p: p.write_bytes(struct.pack("<Q", 100_000) + b"[" * 100_000),
                                 "not valid UTF-8 JSON"),
}


@pytest.mark.parametrize("case", BROKEN_FILES, ids=list(BROKEN_FILES))
def test_broken_safetensors_file_raises_package_error_naming_the_file(tmp_path, case):
    make, message = BROKEN_FILES[case]
    path = tmp_path / "model.safetensors"
    make(path)
    with pytest.raises(QwenNPError) as error:
        read_header(path)
    assert str(path) in str(error.value) and message in str(error.value)


@pytest.mark.parametrize("case", BROKEN_FILES, ids=list(BROKEN_FILES))
def test_reference_safetensors_library_rejects_the_same_files(tmp_path, case):
    # Our validation follows the Rust reader; the safetensors package *is* that reader.
    safetensors = pytest.importorskip("safetensors")
    make, _ = BROKEN_FILES[case]
    path = tmp_path / "model.safetensors"
    make(path)
    with pytest.raises(Exception):  # noqa: B017 - any error will do: the reader's types vary by case
        with safetensors.safe_open(str(path), framework="numpy") as f:
            [f.get_slice(name) for name in f.keys()]


def test_valid_header_is_read_with_absolute_offsets(tmp_path):
    path = tmp_path / "ok.safetensors"
    _write_raw(path, *_valid_header())
    infos = read_header(path)
    header_len = len(json.dumps(_valid_header()[0]).encode())
    assert infos["a"].shape == (2, 2) and infos["a"].start == 8 + header_len
    assert infos["b"].dtype == "BF16" and infos["b"].nbytes == 8


def _rewrite_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_missing_tensor_is_named(make_checkpoint):
    folder = make_checkpoint()
    _rewrite_config(folder, num_hidden_layers=3)           # layer 2 is implied but absent
    with pytest.raises(QwenNPError, match=r"'model.layers.2.input_layernorm.weight' is missing"):
        load_model(folder)


def test_shape_that_contradicts_config_is_named(make_checkpoint):
    folder = make_checkpoint()
    _rewrite_config(folder, intermediate_size=64)
    with pytest.raises(QwenNPError, match=r"gate_proj.weight' has shape \[48, 32\] but config.json implies \[64, 32\]"):
        load_model(folder)


def test_tied_checkpoint_needs_no_lm_head_but_untied_does(make_checkpoint):
    tied = make_checkpoint("tied", tie_word_embeddings=True)
    model = load_model(tied)
    assert model.lm_head is model.embed_tokens
    _rewrite_config(tied, tie_word_embeddings=False)
    with pytest.raises(QwenNPError, match="'lm_head.weight' is missing"):
        load_model(tied)


def test_missing_config_is_reported(make_checkpoint):
    folder = make_checkpoint()
    (folder / "config.json").unlink()
    with pytest.raises(QwenNPError, match="config.json not found"):
        load_model(folder)


def test_config_not_json_is_reported(make_checkpoint):
    folder = make_checkpoint()
    (folder / "config.json").write_text("{'model_type': qwen3")
    with pytest.raises(QwenNPError, match="config.json: not valid JSON"):
        load_model(folder)


def test_config_nested_too_deeply_is_reported_not_a_recursion_error(make_checkpoint):
    folder = make_checkpoint()
    (folder / "config.json").write_text("[" * 100_000)
    with pytest.raises(QwenNPError, match="config.json: not valid JSON"):
        load_model(folder)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen2", "llama"])
def test_unsupported_model_type_is_refused(make_checkpoint, model_type):
    folder = make_checkpoint()
    _rewrite_config(folder, model_type=model_type)
    with pytest.raises(QwenNPError, match=f"model_type '{model_type}' is not supported"):
        load_model(folder)


def test_a_dense_checkpoint_called_qwen3_moe_is_refused_naming_a_dense_mlp_tensor(make_checkpoint):
    folder = make_checkpoint()
    _rewrite_config(folder, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    with pytest.raises(QwenNPError, match="does not account for, from 'model.layers.0.mlp.down_proj.weight'"):
        load_model(folder)


def test_index_naming_a_missing_shard_is_reported(make_checkpoint):
    folder = make_checkpoint(shards=3)
    (folder / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(QwenNPError, match=r"shard 'model-00002-of-00003.safetensors' .* does not exist"):
        load_model(folder)


def test_index_naming_a_tensor_its_shard_lacks_is_reported(make_checkpoint):
    folder = make_checkpoint(shards=2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = next(s for s in set(index["weight_map"].values())
                                                    if s != index["weight_map"]["model.norm.weight"])
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(QwenNPError, match="'model.norm.weight' is listed in .* but not in this shard"):
        load_model(folder)


def test_pickled_checkpoints_are_never_loaded(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04 not really a pickle")
    from qwen_np.files.checkpoint import Checkpoint
    from qwen_np.core.config import Qwen3Config
    with pytest.raises(QwenNPError, match="only safetensors checkpoints are read"):
        Checkpoint(tmp_path, Qwen3Config())


@pytest.mark.parametrize("way", ["cast", "shift"])
def test_stored_bf16_rows_widen_to_the_same_bits_by_either_way(monkeypatch, way):
    # bf16_widening picks the faster way on the machine; both must give every bit pattern's own FP32 word
    assert numerics.bf16_widening() in ("cast", "shift")
    monkeypatch.setattr(numerics, "_widening", [way])
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    out = np.full((256, 256), 7.0, np.float32)
    StoredRows(bits.view(dtype_named("bfloat16"))).widen(out)
    assert np.array_equal(out.view(np.uint32), bits.astype(np.uint32) << 16)


@pytest.mark.parametrize("fast", [True, False])
def test_either_bf16_widening_gives_the_same_logits(make_checkpoint, monkeypatch, fast):
    # whichever widening the machine's timing picks, the fast and the readable path give the same logits
    folder, ids = make_checkpoint(seed=3), [3, 1, 4, 1, 5, 9, 2, 6]
    logits = {}
    for way in ("cast", "shift"):
        monkeypatch.setattr(numerics, "_widening", [way])
        logits[way] = load_model(folder, memory="bf16", fast=fast).forward(ids)
    np.testing.assert_allclose(logits["shift"], logits["cast"], rtol=0, atol=1e-6 * np.abs(logits["cast"]).max())


def test_sharded_and_single_file_checkpoints_give_identical_logits(make_checkpoint):
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    single = load_model(make_checkpoint("one", seed=7)).forward(ids)
    sharded = load_model(make_checkpoint("many", seed=7, shards=4)).forward(ids)
    assert np.array_equal(single, sharded)


@pytest.mark.parametrize("memory", ["fp32", "bf16"])
def test_f32_and_f16_checkpoints_give_the_same_logits_as_bf16(make_checkpoint, memory):
    ids = [5, 6, 7, 8]
    bf16 = load_model(make_checkpoint("bf16", seed=3), memory=memory).forward(ids)
    for dtype in ("F32", "F16"):   # same random draw, rounded differently: BF16 keeps 8 bits
        other = load_model(make_checkpoint(dtype, seed=3, dtype=dtype), memory=memory).forward(ids)
        assert other.dtype == np.float32
        assert np.abs(other - bf16).max() <= 0.05 * np.abs(bf16).max()   # a wrong decode is O(1) off


def test_index_whose_weight_map_holds_a_non_file_name_is_reported(make_checkpoint):
    folder = make_checkpoint(shards=2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = 5
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(QwenNPError, match="weight_map entry for 'model.norm.weight' must be a file name"):
        load_model(folder)


def _backed_by_the_file(array: np.ndarray) -> bool:
    """Whether the array's memory is a mapping of a .safetensors file (Linux's /proc/self/maps)."""
    address = array.ctypes.data
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(bound, 16) for bound in fields[0].split("-"))
            if low <= address < high:
                return len(fields) >= 6 and fields[5].endswith(".safetensors")
    return False


@pytest.mark.parametrize("fast", [False, True])
def test_bf16_memory_mode_keeps_even_f32_weights_mapped_from_the_file(make_checkpoint, fast):
    folder = make_checkpoint(dtype="F32")
    kept = load_model(folder, memory="bf16", fast=fast)
    assert all(_backed_by_the_file(w.q_proj) and _backed_by_the_file(w.gate_proj) for w in kept.layers)
    resident = load_model(folder, memory="fp32", fast=fast)
    assert not any(_backed_by_the_file(w.q_proj) for w in resident.layers)


def test_an_atomic_write_syncs_the_file_before_its_rename_and_the_folder_after(tmp_path, monkeypatch):
    """As safetensors' and huggingface_hub's atomic writers: a temporary file in the same folder, fsynced,
    renamed over the old name, then the folder fsynced. A rename reaching the disk before the data is what
    leaves a power loss an empty file under the real name."""
    import stat

    from qwen_np.files.checkpoint import save_safetensors

    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        kind = "folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        events.append(("fsync", kind, Path(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def replace(source, target):
        events.append(("replace", Path(source), Path(target)))
        real_replace(source, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = tmp_path / "model.safetensors"
    save_safetensors(path, {"w": np.ones((2, 3), np.float32)}, "F32")
    partial = tmp_path / "model.safetensors.partial"
    assert events == [("fsync", "file", partial), ("replace", partial, path), ("fsync", "folder", tmp_path)]
    assert sorted(tmp_path.iterdir()) == [path]
