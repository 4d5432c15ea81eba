"""Random-weight checkpoints at real Qwen3 shapes, written as BF16 safetensors without holding the model.

A benchmark of a memory-bound decoder needs the real tensor shapes, not the real values. Each tensor
is drawn from its own generator seeded by its name, so the files are the same on every machine and
every run. Values come from a fixed 65536-entry table of BF16 normals (std 0.02, like a trained
model's projections) indexed by random 16-bit words: one cheap gather per value, so the 16.4 GB
Qwen3-8B checkpoint is written in a few minutes, one 2 GB shard in memory at a time.
Norm weights are 1.0, as at initialisation.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np

from qwen_np.files.checkpoint import save_safetensors, write_index
from qwen_np.core.config import expected_tensors
from qwen_np.core.config import PRESETS, Qwen3Config

CACHE_ENV = "QWEN_NP_BENCH_CACHE"
FORMAT_VERSION = 1             # bump to invalidate cached checkpoints when the generator changes
SHARD_BYTES = 2 * 1024 ** 3    # like the hub's ~4 GB shards, smaller so one shard never dominates
CHUNK_VALUES = 1 << 23         # values drawn per call (the generator's stream defines the checkpoint)
WEIGHT_STD = 0.02
MODELS = {"0.6b": "qwen3-0.6b", "8b": "qwen3-8b"}
# The real Qwen3 tokenizer (the test fixture's): generated checkpoints have random weights, but the tools
# that read them (llama.cpp's converter, a GGUF) need a vocabulary of the model's size.
TOKENIZER = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "qwen3_tokenizer_random"


def cache_dir() -> Path:
    """Where generated checkpoints live: $QWEN_NP_BENCH_CACHE or ~/.cache/qwen_np_bench (never the repo)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "qwen_np_bench")


def config_json(config: Qwen3Config) -> dict[str, object]:
    """The config.json a hub checkpoint of these shapes would carry."""
    fields = config.to_dict()
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
            "attention_bias": False, "use_sliding_window": False, **fields}


def checkpoint_folder(model: str, layers: int | None = None) -> Path:
    """Where the random checkpoint for `model` ('0.6b' or '8b'; `layers`: only that many decoder layers) is
    cached (whether or not it exists yet)."""
    return cache_dir() / f"{MODELS[model]}{f'-{layers}layers' if layers else ''}-random-v{FORMAT_VERSION}"


def ensure_checkpoint(model: str, log=print, layers: int | None = None) -> Path:
    """The folder of the cached random checkpoint for `model` ('0.6b' or '8b'), generated if missing;
    `layers` keeps only that many decoder layers (the real shapes of each, a fraction of the bytes)."""
    folder = checkpoint_folder(model, layers)
    if (folder / "config.json").exists():
        return folder
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    config = PRESETS[MODELS[model]]
    if layers:
        config = dataclasses.replace(config, num_hidden_layers=layers)
    log(f"generating {folder} (random BF16 weights, written shard by shard) ...")
    write_random_checkpoint(partial, config)
    partial.rename(folder)     # config.json appears under the real name only when every shard is complete
    return folder


def write_random_checkpoint(folder: Path, config: Qwen3Config) -> None:
    shapes = expected_tensors(config)
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():          # model order: embedding, layer by layer, norm, head
        nbytes = 2 * int(np.prod(shape))
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    table = _value_table()
    weight_map = {}
    for number, names in enumerate(shards, start=1):
        file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(folder / file_name, {n: shapes[n] for n in names}, table)
        weight_map.update({n: file_name for n in names})
    total = sum(2 * int(np.prod(s)) for s in shapes.values())
    write_index(folder, weight_map, total)
    (folder / "config.json").write_text(json.dumps(config_json(config), indent=2, sort_keys=True))


def _value_table() -> np.ndarray:
    """65536 BF16 values of N(0, WEIGHT_STD): a random 16-bit word picks one."""
    normals = np.random.default_rng(FORMAT_VERSION).standard_normal(65536).astype(np.float32)
    return (WEIGHT_STD * normals).astype(ml_dtypes.bfloat16)


def _write_shard(path: Path, shapes: dict[str, tuple[int, ...]], table: np.ndarray) -> None:
    """One BF16 safetensors file: its tensors generated a chunk at a time, then written together."""
    tensors = {}
    for name, shape in shapes.items():
        count = int(np.prod(shape))
        values = np.ones(count, table.dtype)           # norm weights: 1.0, as at initialisation
        if len(shape) > 1:
            rng = np.random.default_rng(zlib.crc32(name.encode()))
            for start in range(0, count, CHUNK_VALUES):
                n = min(CHUNK_VALUES, count - start)
                np.take(table, np.frombuffer(rng.bytes(2 * n), dtype="<u2"), out=values[start:start + n])
        tensors[name] = values.reshape(shape)
    save_safetensors(path, tensors, "BF16")


def gguf_path(folder: Path, mode: str) -> Path:
    """Where the GGUF copy of a generated checkpoint lives: next to it, F32 or BF16 ("fp32" | "bf16")."""
    return folder.with_name(f"{folder.name}.{'f32' if mode == 'fp32' else 'bf16'}.gguf")


def ensure_gguf(folder: Path, mode: str, convert_script: Path | None, log=print) -> Path | None:
    """The GGUF file llama.cpp runs for this checkpoint, converted with llama.cpp's own
    convert_hf_to_gguf.py when missing (None when it is missing and no script was given).

    The converter needs a tokenizer next to the weights: TOKENIZER's files are linked in (the weights are
    random, so any valid vocabulary of the right size would do).
    """
    target = gguf_path(folder, mode)
    if target.exists():
        return target
    if convert_script is None:
        return None
    staging = target.with_name(target.name + ".source")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    for source in [*folder.iterdir(), TOKENIZER / "tokenizer.json", TOKENIZER / "tokenizer_config.json"]:
        (staging / source.name).symlink_to(source)
    partial = target.with_name(target.name + ".partial")
    log(f"converting {folder.name} to {target.name} with {convert_script} ...")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(convert_script.parent / "gguf-py"),
                                                                       os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(convert_script), str(staging), "--outtype",
                           "f32" if mode == "fp32" else "bf16", "--outfile", str(partial)],
                          env=env, capture_output=True, text=True)
    shutil.rmtree(staging, ignore_errors=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        log(f"  conversion failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        return None
    partial.rename(target)
    return target
