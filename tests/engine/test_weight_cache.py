"""The FP32 weight cache (qwen_np/engine/weight_cache.py): built once, mapped after, never stale, damaged or half
written, never changed by writes to the loaded weights, and the same logits as loading without it."""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qwen_np import load_config, load_model
from qwen_np.engine import weight_cache
from qwen_np.files.checkpoint import Checkpoint

IDS = [3, 17, 5, 60, 2, 41, 9]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cache on, in a folder of this test's own, for models of any size."""
    folder = tmp_path / "cache"
    monkeypatch.setenv(weight_cache.CACHE_ENV, str(folder))
    monkeypatch.setattr(weight_cache, "MIN_BYTES", 0)
    return folder


def cache_path(folder: Path) -> Path:
    path = weight_cache.cache_file(Checkpoint(folder, load_config(folder)))
    assert path is not None
    return path


def logits(folder: Path, fast: bool = True) -> np.ndarray:
    model = load_model(folder, memory="fp32", fast=fast)
    cache = model.new_cache(16)
    model.forward(IDS, cache)
    return np.concatenate([model.forward(IDS, cache), model.forward([7], cache)])   # prefill, then decode


def without_cache(folder: Path, monkeypatch: pytest.MonkeyPatch, fast: bool = True) -> np.ndarray:
    with monkeypatch.context() as patch:
        patch.setenv(weight_cache.CACHE_ENV, "off")
        return logits(folder, fast)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_cache_root_follows_the_env_vars(monkeypatch, tmp_path):
    monkeypatch.delenv(weight_cache.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert weight_cache.cache_root() == tmp_path / "xdg" / "qwen_np"
    monkeypatch.setenv(weight_cache.CACHE_ENV, str(tmp_path / "mine"))
    assert weight_cache.cache_root() == tmp_path / "mine"
    monkeypatch.setenv(weight_cache.CACHE_ENV, "off")
    assert weight_cache.cache_root() is None


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "readable"])
def test_logits_are_identical_with_and_without_the_cache(make_checkpoint, cache, monkeypatch, fast):
    folder = make_checkpoint(seed=4)
    built = logits(folder, fast)               # converts and writes the cache, then maps it
    mapped = logits(folder, fast)              # maps the cache built above
    assert np.array_equal(built, without_cache(folder, monkeypatch, fast))
    assert np.array_equal(mapped, built)


def test_first_load_builds_and_later_loads_map_without_rebuilding(make_checkpoint, cache, monkeypatch, capfd):
    folder = make_checkpoint(seed=1, shards=3)
    before = sorted(p.name for p in folder.iterdir())
    load_model(folder, memory="fp32")
    assert "converting" in capfd.readouterr().err and cache_path(folder).is_file()
    monkeypatch.setattr(weight_cache, "_build", lambda *args: pytest.fail("a valid cache was rebuilt"))
    model = load_model(folder, memory="fp32")
    assert capfd.readouterr().err == ""
    q = model.layers[0].q_proj
    assert isinstance(q.base, np.ndarray) and isinstance(q.base.base.obj, mmap.mmap)   # a view of the mapped file
    assert sorted(p.name for p in folder.iterdir()) == before            # nothing written beside the checkpoint


def test_cached_layers_keep_fused_qkv_and_gate_up_views(make_checkpoint, cache):
    model = load_model(make_checkpoint(seed=2), memory="fp32", fast=True)
    for i in range(len(model.layers)):
        qkv, gate_up = model.fused_weights(i)
        w = model.layers[i]
        assert qkv is not None and np.shares_memory(qkv, w.q_proj) and np.array_equal(qkv[-len(w.v_proj):], w.v_proj)
        assert gate_up is not None and np.array_equal(gate_up[len(w.gate_proj):], w.up_proj)


def test_bf16_and_small_models_never_touch_the_cache(make_checkpoint, cache, monkeypatch):
    folder = make_checkpoint(seed=3)
    load_model(folder, memory="bf16")
    monkeypatch.setattr(weight_cache, "MIN_BYTES", 10 ** 9)
    load_model(folder, memory="fp32")
    assert not cache.exists()


def test_disabled_cache_writes_nothing(make_checkpoint, cache, monkeypatch, capfd):
    monkeypatch.setenv(weight_cache.CACHE_ENV, "off")
    load_model(make_checkpoint(seed=3), memory="fp32")
    assert not cache.exists() and capfd.readouterr().err == ""


def test_a_changed_checkpoint_gets_a_new_cache_and_the_stale_one_goes(make_checkpoint, cache, monkeypatch):
    folder = make_checkpoint(seed=5)
    logits(folder)
    stale = cache_path(folder)
    make_checkpoint(seed=6)                                              # same folder, same sizes, new values
    for file in folder.iterdir():
        os.utime(file, ns=(1, 10 ** 18))                                 # a modification time unlike the first
    assert cache_path(folder) != stale
    assert np.array_equal(logits(folder), without_cache(folder, monkeypatch))
    assert list(stale.parent.glob("*.safetensors")) == [cache_path(folder)]


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 4)


def _garble_header(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"not json")


def _change_first_value(path: Path) -> None:       # the first value of the first tensor
    start = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(np.float32(123.0).tobytes())


@pytest.mark.parametrize("damage", [_truncate, _garble_header, _change_first_value])
def test_a_damaged_cache_is_rebuilt_never_used(make_checkpoint, cache, monkeypatch, capfd, damage):
    folder = make_checkpoint(seed=7)
    expected = logits(folder)
    damage(cache_path(folder))
    capfd.readouterr()
    assert np.array_equal(logits(folder), expected)
    assert "damaged, rebuilding" in capfd.readouterr().err
    monkeypatch.setattr(weight_cache, "_build", lambda *args: pytest.fail("the rebuilt cache was not valid"))
    assert np.array_equal(logits(folder), expected)


CRASH = ("import os, sys; from qwen_np import load_model; from qwen_np.engine import weight_cache\n"
         "weight_cache.MIN_BYTES = 0; write = weight_cache._write\n"
         "def write_then_die(f, *args):\n    write(f, *args); f.flush(); os._exit(9)\n"
         "weight_cache._write = write_then_die; load_model(sys.argv[1], memory='fp32')")


@pytest.mark.slow
def test_a_build_killed_mid_way_leaves_no_cache_under_the_real_name(make_checkpoint, cache, monkeypatch):
    folder = make_checkpoint(seed=9)
    killed = subprocess.run([sys.executable, "-c", CRASH, str(folder)], env={**os.environ, weight_cache.CACHE_ENV: str(cache)},
                            cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True)
    assert killed.returncode == 9, killed.stderr                           # died with no chance to clean up
    path = cache_path(folder)
    assert not path.exists() and len(list(path.parent.glob("*.tmp"))) == 1
    assert np.array_equal(logits(folder), without_cache(folder, monkeypatch))
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(["lock", path.name])


def test_writing_to_loaded_weights_never_changes_the_cache_file(make_checkpoint, cache):
    folder = make_checkpoint(seed=10)
    expected = logits(folder)
    before = digest(cache_path(folder))
    model = load_model(folder, memory="fp32")
    for w in [model.embed_tokens, model.layers[0].q_proj, model.layers[1].down_proj, model.norm]:
        w[...] = 0.0                                                      # copy-on-write: this process's pages only
    assert not model.layers[0].q_proj.any()
    assert digest(cache_path(folder)) == before
    assert np.array_equal(logits(folder), expected)


def test_an_unwritable_cache_folder_falls_back_to_memory(make_checkpoint, cache, monkeypatch, capfd):
    folder = make_checkpoint(seed=11)
    (cache.parent / "a file").write_text("")
    monkeypatch.setenv(weight_cache.CACHE_ENV, str(cache.parent / "a file" / "cache"))
    assert np.array_equal(logits(folder), without_cache(folder, monkeypatch))
    assert "cache unavailable" in capfd.readouterr().err


LOAD = ("import sys, numpy as np; from qwen_np import load_model; from qwen_np.engine import weight_cache; "
        "weight_cache.MIN_BYTES = 0; "
        "m = load_model(sys.argv[1], memory='fp32'); np.save(sys.argv[2], m.forward([3, 17, 5]))")


@pytest.mark.slow
def test_two_processes_building_at_once_build_once_and_agree(make_checkpoint, cache, tmp_path):
    folder = make_checkpoint(seed=12)
    path = cache_path(folder)
    path.parent.mkdir(parents=True)
    env = {**os.environ, weight_cache.CACHE_ENV: str(cache)}
    with open(path.parent / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # both start while a third builder holds the lock
        runs = [subprocess.Popen([sys.executable, "-c", LOAD, str(folder), str(tmp_path / f"{n}.npy")], env=env,
                                 stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
                for n in range(2)]
        assert all("waiting for another process" in run.stderr.readline() for run in runs if run.stderr)
    errors = [run.communicate()[1] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], errors
    assert sum("converting" in err for err in errors) == 1                # one built, the other mapped its file
    assert np.array_equal(np.load(tmp_path / "0.npy"), np.load(tmp_path / "1.npy"))
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(["lock", path.name])


def test_the_panel_layout_has_a_cache_file_of_its_own_built_once_with_the_same_logits(make_checkpoint, cache,
                                                                                     monkeypatch, capfd):
    """load_model's default holds FP32 as numerics.Panels in a fast model: its cache file holds that
    layout, beside the "rows" file of memory="fp32"; neither load deletes the other's file."""
    from qwen_np.engine import runtime
    from qwen_np.numbers.numerics import Panels

    monkeypatch.setattr(runtime, "blas_has_small_matrix_kernel", lambda: True)   # Panels on any BLAS kernel
    folder = make_checkpoint(seed=9)
    with monkeypatch.context() as patch:
        patch.setenv(weight_cache.CACHE_ENV, "off")
        expected = load_model(folder).forward(IDS)
    capfd.readouterr()
    model = load_model(folder)
    assert "converting" in capfd.readouterr().err
    panels_file = weight_cache.cache_file(Checkpoint(folder, load_config(folder)), "panels")
    assert panels_file is not None and panels_file.is_file() and not cache_path(folder).exists()
    assert isinstance(model.layers[0].q_proj, Panels) and isinstance(model.layers[0].q_proj.values.base.base.obj, mmap.mmap)
    assert np.array_equal(model.forward(IDS), expected)               # the same values, the same layout
    load_model(folder, memory="fp32")                                 # builds the rows file beside it
    assert cache_path(folder).is_file() and panels_file.is_file()
    original_build = weight_cache._build
    monkeypatch.setattr(weight_cache, "_build", lambda *args: pytest.fail("a valid cache was rebuilt"))
    assert np.array_equal(load_model(folder).forward(IDS), expected)
    monkeypatch.setattr(weight_cache, "_build", original_build)
    _change_first_value(panels_file)                                  # W[0, 0]: panel 0's first value
    capfd.readouterr()
    assert np.array_equal(load_model(folder).forward(IDS), expected)
    assert "damaged, rebuilding" in capfd.readouterr().err
