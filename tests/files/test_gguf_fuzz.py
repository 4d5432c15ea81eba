"""The GGUF reader under a seeded fuzz: a few hundred mutations of a small exported file, each loaded the way
`generate --model file.gguf` loads one (load_model, read_tokenizer, read_generation_defaults, a forward pass)
in a worker process under a time limit per file and an address-space limit. Every mutation must end as

* a clean error: one QwenNPError line naming the file;
* the same model: the logits of a short prompt equal to the original's, bit for bit;
* the model the file now declares: a mutation inside the value of rms_norm_eps or rope freq_base, loaded
  with exactly the value gguf's own reader reads there (a GGUF has no checksum: a changed number is a
  different model, and loading it as written is right);

never a hang, a traceback, a MemoryError, or logits that differ while the file declares the same model.
The mutations are bit flips and byte overwrites anywhere before the tensor data, count, length and type
fields of the header, the key/value pairs and the tensor list set to edge values, numeric values set to
edge values, and truncations anywhere. The tensor data itself is left alone: a changed weight byte is a
different model that no reader can tell from the real one.

Run as a script (`python tests/files/test_gguf_fuzz.py worker ORIGINAL FOLDER`, mutations as JSON on stdin) this
file is the worker: one result line of JSON per mutation.
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
import pytest

from tests.conftest import ROOT
from tests.files.test_gguf import PROMPT, export, tiny_checkpoint

SEED = 30
SECONDS_PER_FILE = 10            # a clean file loads in ~0.05 s here
ADDRESS_SPACE = 2 * 2 ** 30      # the worker's whole address space; it needs ~0.3 GiB
WORKERS = 2
# How many mutations of each kind; 300 in all (about 15 s of CPU).
PLAN = {"count": 80, "type": 30, "value": 30, "flip": 85, "overwrite": 40, "truncate": 35}
# The numeric keys whose value changes the logits, and the config field each one sets.
DECLARED = {"qwen3.attention.layer_norm_rms_epsilon": "rms_norm_eps", "qwen3.rope.freq_base": "rope_theta"}
ALLOWED = {"error", "same", "declared"}


# --- The file's layout, read from the unmutated original by gguf's reader ------------------------

def layout(path: Path) -> tuple[dict[str, list[tuple[int, int]]], dict[str, tuple[int, int, int]], int]:
    """(fields by role: role -> [(offset, width)]; numeric values: key -> (offset, width, value type);
    where the tensor data starts). Every part of a field lies right after the one before it in the file."""
    reader = GGUFReader(path)
    roles: dict[str, list[tuple[int, int]]] = {role: [] for role in
                                               ("header count", "key length", "string length", "array count",
                                                "entry length", "name length", "dimension count", "dimension",
                                                "tensor offset", "value type", "entry type", "tensor type")}
    numbers: dict[str, tuple[int, int, int]] = {}
    roles["header count"] += [(8, 8), (16, 8)]
    roles["value type"].append((4, 4))                                   # the version, a type of sorts
    for field in reader.fields.values():
        if field.name.startswith("GGUF."):
            continue
        spans = _spans(field.offset, field.parts)
        roles["key length"].append(spans[0])
        roles["value type"].append(spans[2])
        kind = field.types[0]
        if kind == GGUFValueType.STRING:
            roles["string length"].append(spans[3])
        elif kind == GGUFValueType.ARRAY:
            roles["entry type"].append(spans[3])
            roles["array count"].append(spans[4])
            if field.types[-1] == GGUFValueType.STRING:
                roles["entry length"] += spans[5::2]
        else:
            numbers[field.name] = (*spans[3], int(kind))
    for tensor in reader.tensors:
        spans = _spans(tensor.field.offset, tensor.field.parts)
        roles["name length"].append(spans[0])
        roles["dimension count"].append(spans[2])
        roles["dimension"] += [(spans[3][0] + 8 * i, 8) for i in range(spans[3][1] // 8)]
        roles["tensor type"].append(spans[4])
        roles["tensor offset"].append(spans[5])
    return roles, numbers, int(reader.data_offset)


def _spans(offset: int, parts: list[np.ndarray]) -> list[tuple[int, int]]:
    spans = []
    for part in parts:
        spans.append((offset, int(part.nbytes)))
        offset += int(part.nbytes)
    return spans


# --- The mutations -------------------------------------------------------------------------------

def mutations(path: Path, seed: int = SEED) -> list[dict[str, Any]]:
    """PLAN's mutations, each {"kind", "offset", "data" (hex bytes written there)} or {"kind", "truncate"},
    with "declares" naming the DECLARED key when the bytes written lie inside that key's value."""
    rng = np.random.default_rng(seed)
    roles, numbers, data_start = layout(path)
    original = path.read_bytes()
    size = len(original)
    counts = [role for role in roles if role not in ("value type", "entry type", "tensor type")]
    planned: list[dict[str, Any]] = []
    for kind, how_many in PLAN.items():
        for _ in range(how_many):
            if kind == "count":
                offset, width = _pick(rng, roles[counts[rng.integers(len(counts))]])
                old = int.from_bytes(original[offset:offset + width], "little")
                new = _edge_count(rng, old, width)
                planned.append({"kind": kind, "offset": offset, "data": new.to_bytes(width, "little").hex()})
            elif kind == "type":
                offset, width = _pick(rng, roles[("value type", "entry type", "tensor type")[rng.integers(3)]])
                new = int(rng.choice([*range(40), 255, 2 ** 31, 2 ** 32 - 1]))
                planned.append({"kind": kind, "offset": offset, "data": new.to_bytes(width, "little").hex()})
            elif kind == "value":
                key = sorted(numbers)[rng.integers(len(numbers))]
                offset, width, value_type = numbers[key]
                planned.append({"kind": kind, "offset": offset, "data": _edge_value(rng, value_type, width).hex()})
            elif kind == "flip":
                bit = int(rng.integers(8 * data_start))
                planned.append({"kind": kind, "offset": bit // 8,
                                "data": bytes([original[bit // 8] ^ (1 << bit % 8)]).hex()})
            elif kind == "overwrite":
                width = int(rng.integers(1, 9))
                offset = int(rng.integers(data_start - width))
                planned.append({"kind": kind, "offset": offset, "data": rng.bytes(width).hex()})
            else:       # half of the cuts inside the metadata and tensor list, half inside the tensor data
                end = data_start if rng.random() < 0.5 else size
                planned.append({"kind": kind, "truncate": int(rng.integers(end))})
    for mutation in planned:
        if "offset" in mutation:
            begin, end = mutation["offset"], mutation["offset"] + len(mutation["data"]) // 2
            mutation["declares"] = next((key for key in DECLARED if key in numbers
                                         and numbers[key][0] <= begin and end <= numbers[key][0] + numbers[key][1]), None)
    return planned


def _pick(rng: np.random.Generator, fields: list[tuple[int, int]]) -> tuple[int, int]:
    return fields[int(rng.integers(len(fields)))]


def _edge_count(rng: np.random.Generator, old: int, width: int) -> int:
    """A corrupt count or length: near the real one, doubled, a power of two added, or the type's extremes."""
    top = 2 ** (8 * width) - 1
    candidates = [0, 1, old - 1, old + 1, 2 * old, old + 2 ** int(rng.integers(3, 8 * width)), 2 ** 16,
                  2 ** 32 - 1, 2 ** 63, top, int(rng.integers(0, 2 ** 62)) * 4 + int(rng.integers(4))]
    return int(candidates[rng.integers(len(candidates))]) & top


def _edge_value(rng: np.random.Generator, value_type: int, width: int) -> bytes:
    """An edge value of a numeric metadata type: zero, signs, extremes, NaN/inf, tiny and huge floats."""
    if value_type in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        value = float(rng.choice([0.0, -1.0, math.nan, math.inf, -math.inf, 1e30, 1e-30, 65504.0, 1e-45, 2.0]))
        return struct.pack("<f" if width == 4 else "<d", value)
    choices = [0, 1, 2, 2 ** 16, 2 ** (8 * width - 1), 2 ** (8 * width) - 1, 3, 7]
    return int(choices[rng.integers(len(choices))]).to_bytes(width, "little")


# --- The worker ----------------------------------------------------------------------------------

class TimeLimit(BaseException):
    """Raised by the alarm in a file's load: a BaseException, so no `except Exception` in the loader can take it."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise TimeLimit()


def load(path: Path) -> tuple[np.ndarray, dict[str, Any]]:
    """What `generate --model path` reads, and the logits of PROMPT."""
    from qwen_np import load_model
    from qwen_np.files.model_files import read_config, read_generation_defaults, read_tokenizer

    model = load_model(path, memory="fp32")
    config = read_config(path)
    read_tokenizer(path)
    read_generation_defaults(path, config)
    return model.forward(PROMPT), config.to_dict()


def outcome(path: Path, mutation: dict[str, Any], reference: tuple[np.ndarray, dict[str, Any]]) -> dict[str, str]:
    """How one mutated file ends: one of ALLOWED, or what went wrong."""
    from qwen_np.errors import QwenNPError

    signal.setitimer(signal.ITIMER_REAL, SECONDS_PER_FILE)
    try:
        logits, config = load(path)
    except QwenNPError as error:
        message = str(error)
        clean = "\n" not in message and message.startswith(str(path))
        return {"outcome": "error" if clean else "unclear error", "message": message}
    except TimeLimit:
        return {"outcome": "hang", "message": f"over {SECONDS_PER_FILE} s"}
    except MemoryError:
        return {"outcome": "memory", "message": f"over the {ADDRESS_SPACE >> 20} MiB address space"}
    except Exception as error:                      # what the fuzz looks for: report it, keep going
        where = error.__traceback__
        while where is not None and where.tb_next is not None:
            where = where.tb_next
        line = f"{where.tb_frame.f_code.co_filename}:{where.tb_lineno}" if where else "?"
        return {"outcome": "traceback", "message": f"{type(error).__name__}: {error} (at {line})"}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if np.array_equal(logits, reference[0]):
        return {"outcome": "same"}
    changed = {name for name, value in config.items() if value != reference[1][name]}
    key = mutation.get("declares")
    if key is not None and changed == {DECLARED[key]}:
        field = GGUFReader(path).get_field(key)      # safe to parse: qwen_np's loader has just checked the file
        declared = np.float32(field.contents() if field is not None else math.nan)
        if config[DECLARED[key]] == float(str(declared)):
            return {"outcome": "declared", "message": f"{DECLARED[key]} = {config[DECLARED[key]]}"}
    return {"outcome": "different", "message": f"logits differ; config fields changed: {sorted(changed)}"}


def worker(original: Path, folder: Path, number: int) -> None:
    """Load each mutation of `original` read from stdin; print one JSON line per mutation. The worker runs on
    one CPU of its own (the address-space limit must not depend on how many threads a machine's core count
    would start: each reserves its stack, and malloc an arena)."""
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[number % len(cpus)]})
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
    signal.signal(signal.SIGALRM, _on_alarm)
    jobs = json.loads(sys.stdin.read())
    reference = load(original)
    source = original.read_bytes()
    for index, mutation in jobs:
        data = bytearray(source)
        if "truncate" in mutation:
            del data[mutation["truncate"]:]
        else:
            written = bytes.fromhex(mutation["data"])
            data[mutation["offset"]:mutation["offset"] + len(written)] = written
        path = folder / f"mutation-{index:04d}.gguf"        # a new name each: the parsed file is cached by path
        path.write_bytes(bytes(data))
        print(json.dumps({"index": index, "kind": mutation["kind"], **outcome(path, mutation, reference)}), flush=True)
        path.unlink()


# --- The test ------------------------------------------------------------------------------------

def run_workers(original: Path, planned: list[dict[str, Any]], folder: Path) -> list[dict[str, Any]]:
    """The mutations split between WORKERS worker processes; their results in mutation order."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1",
           "MALLOC_ARENA_MAX": "2", "HF_HUB_OFFLINE": "1"}
    shares = [[(i, m) for i, m in enumerate(planned) if i % WORKERS == w] for w in range(WORKERS)]
    processes = [subprocess.Popen([sys.executable, __file__, "worker", str(original), str(folder), str(number)],
                                  env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for number in range(WORKERS)]
    results: list[dict[str, Any]] = []
    for process, share in zip(processes, shares):
        try:
            stdout, stderr = process.communicate(json.dumps(share), timeout=20 + len(share) * SECONDS_PER_FILE)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        lines = [json.loads(line) for line in stdout.splitlines()]
        done = {line["index"] for line in lines}
        # A mutation with no result line killed its worker (a hang in C code, or a crash): it and the rest
        # of that worker's share are reported as such.
        lines += [{"index": i, "kind": m["kind"], "outcome": "worker died",
                   "message": (stderr.strip().splitlines() or ["no output"])[-1]} for i, m in share if i not in done]
        results += lines
    return sorted(results, key=lambda line: line["index"])


@pytest.mark.slow
def test_mutated_ggufs_are_a_one_line_error_or_the_model_they_declare(tmp_path: Path) -> None:
    original = export(tiny_checkpoint(tmp_path / "ckpt"), tmp_path / "tiny.gguf", "q8_0")
    planned = mutations(original)
    results = run_workers(original, planned, tmp_path)
    counts = Counter(line["outcome"] for line in results)
    print(f"\n{len(results)} mutations: " + ", ".join(f"{n} {name}" for name, n in counts.most_common()))
    for kind in PLAN:
        kind_counts = Counter(line["outcome"] for line in results if line["kind"] == kind)
        print(f"  {kind}: " + ", ".join(f"{n} {name}" for name, n in kind_counts.most_common()))
    bad = [line for line in results if line["outcome"] not in ALLOWED]
    assert not bad, "\n".join(f"#{line['index']} {line['kind']} {planned[line['index']]}: {line['outcome']}: "
                              f"{line.get('message', '')}" for line in bad[:20])
    assert len(results) == len(planned) == sum(PLAN.values())
    # A fuzz that never got past the reader, or never tripped it, would test nothing.
    assert counts["error"] >= 100 and counts["same"] >= 20, counts


def test_the_mutations_are_the_same_every_run(tmp_path: Path) -> None:
    original = export(tiny_checkpoint(tmp_path / "ckpt"), tmp_path / "tiny.gguf", "q8_0")
    again = export(tiny_checkpoint(tmp_path / "again"), tmp_path / "again.gguf", "q8_0")
    assert original.read_bytes() == again.read_bytes()
    assert mutations(original) == mutations(again) != mutations(original, seed=SEED + 1)


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
