"""Shared test helpers: tiny random Qwen3 checkpoints written through the real checkpoint writer.

The suite writes nothing into the checkout: fixtures made at test time go to a cache folder of the
user's (QWEN3_RANDOM below) or to pytest's tmp_path, no bytecode lands beside the sources (the next
lines), and pytest's own cache lives in the user's cache folder (pyproject.toml).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

# No __pycache__ beside the sources: not from this process (set before anything below imports qwen_np,
# tools/ or a test module) and not from the subprocesses the tests start (they inherit the environment).
sys.dont_write_bytecode = True
os.environ["PYTHONDONTWRITEBYTECODE"] = "1"


def _drop_own_bytecode() -> None:
    """pytest compiles this file (rewriting its asserts) and caches it in tests/__pycache__ before its first
    line runs, unless PYTHONDONTWRITEBYTECODE was set, and the package's tests/__init__.py with it (imported
    first, as tests.conftest's package): the two files of the suite cached so. Remove them."""
    cache = Path(__file__).parent / "__pycache__"
    for compiled in [*cache.glob(f"{Path(__file__).stem}.*.pyc"), *cache.glob("__init__.*.pyc")]:
        compiled.unlink(missing_ok=True)
    with contextlib.suppress(OSError):      # not there, or holding something else
        cache.rmdir()


_drop_own_bytecode()

import hashlib  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from typing import Callable, Iterator  # noqa: E402

import ml_dtypes  # noqa: E402,F401  safetensors.numpy reads a BF16 file only once ml_dtypes has registered bfloat16
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from qwen_np.files.checkpoint import save_checkpoint  # noqa: E402
from qwen_np.core.config import expected_tensors  # noqa: E402
from qwen_np.files.tokenizer import Tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# The bundled default model: a tiny Qwen3 trained on Shakespeare, its own 2,048-token BPE, no chat template.
BUNDLED = ROOT / "weights"
# How long a test waits for a subprocess (a command, a server starting, a notebook cell) or its output before
# calling it hung: only a hang guard, far beyond what any of them takes on a loaded two-core machine. A test
# bounds behaviour (the output it waits for), never speed.
HANG_SECONDS = 600
# Where fixtures made at test time live: $QWEN_NP_TEST_FIXTURES, else $XDG_CACHE_HOME/qwen_np/test-fixtures,
# else ~/.cache/qwen_np/test-fixtures; never the checkout (a read-only clone collects as well as any other).
FIXTURE_CACHE_ENV = "QWEN_NP_TEST_FIXTURES"
# A tiny random-weight Qwen3 with the real Qwen3 tokenizer and chat template (tools/make_bundled_model.py):
# what the tests of the tokenizer, the chat template, thinking, chat and serving chat run on. The tokenizer
# files are committed in tests/fixtures/qwen3_tokenizer_random; its weights (20 MB) are not: the folder the
# tests use is a copy of those files plus the weights, made on first use (about a second, byte-identical
# every run, test_the_random_fixture_weights_are_the_same_bytes_every_run) in the fixture cache, in a
# folder named after a hash of the generator, the tokenizer files and the weights' expected SHA-256: a change
# to any of them makes a new folder, never a stale copy.
QWEN3_RANDOM_SOURCE = ROOT / "tests" / "fixtures" / "qwen3_tokenizer_random"
QWEN3_RANDOM_COMMITTED = ("tokenizer.json", "tokenizer_config.json", "LICENSE-tokenizer")   # tools/build_tokenizer.py's
QWEN3_RANDOM_GENERATOR = ROOT / "tools" / "make_bundled_model.py"                            # writes the rest
QWEN3_RANDOM_WEIGHTS_SHA256 = "c7687f6f3188d11d6d54709a7aa22725741ef7227560378a137735d8accf6006"


def fixture_cache() -> Path:
    """The folder test-time fixtures are written to (outside the checkout)."""
    chosen = os.environ.get(FIXTURE_CACHE_ENV, "").strip()
    if chosen:
        return Path(chosen).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qwen_np" / "test-fixtures"


def _qwen3_random_folder() -> Path:
    """QWEN3_RANDOM: <fixture cache>/<hash of its sources>/qwen3_tokenizer_random, written unless it is there
    already. Written in a temporary folder and renamed, so a run stopped half-way, or a second pytest at
    once, never leaves or sees half a checkpoint."""
    digest = hashlib.sha256(QWEN3_RANDOM_WEIGHTS_SHA256.encode())
    for path in (QWEN3_RANDOM_GENERATOR, *(QWEN3_RANDOM_SOURCE / name for name in QWEN3_RANDOM_COMMITTED)):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    keyed = fixture_cache() / digest.hexdigest()[:16]
    folder = keyed / QWEN3_RANDOM_SOURCE.name
    if folder.is_dir():
        return folder
    keyed.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{keyed.name}-", dir=keyed.parent))
    try:
        (partial / folder.name).mkdir()
        for name in QWEN3_RANDOM_COMMITTED:
            shutil.copyfile(QWEN3_RANDOM_SOURCE / name, partial / folder.name / name)
        sys.path.insert(0, str(QWEN3_RANDOM_GENERATOR.parent))
        from make_bundled_model import write_fixture

        write_fixture(partial / folder.name)
        partial.rename(keyed)                   # fails if another run got there first: its copy is the same
    except OSError:
        if not folder.is_dir():
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


QWEN3_RANDOM = _qwen3_random_folder()

TINY_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 96, "hidden_size": 32,
    "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 2048,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}


def write_random_checkpoint(folder: Path, seed: int = 0, shards: int = 1, dtype: str = "BF16",
                            **overrides: object) -> Path:
    """A Qwen3 checkpoint with random weights (norm weights random too, so q/k norm bugs show)."""
    from qwen_np.core.config import Qwen3Config

    config_json = {**TINY_CONFIG, **overrides}
    config = Qwen3Config.from_dict(config_json)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in expected_tensors(config).items():
        if len(shape) == 1:
            tensors[name] = (1.0 + 0.5 * rng.standard_normal(shape)).astype(np.float32)
        else:
            tensors[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
    names = sorted(tensors)
    groups = [names[i::shards] for i in range(shards)]
    return save_checkpoint(folder, config_json, [{n: tensors[n] for n in g} for g in groups], dtype=dtype)


# Byte offsets of the FP16 fields (d, and m or dmin) in the block of each GGUF kind qwen_np.numbers.ggml_blocks holds.
FP16_FIELDS = {"Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,)}
# Q8_0's and Q4_0's blocks (formats.FormatRows, or ggml_repacked.RepackedRows): their bytes and their FP16 d's offset.
FORMAT_BLOCKS = {"Q8_0": 34, "Q4_0": 18}


def block_bytes(kind: str) -> tuple[int, tuple[int, ...]]:
    """A ggml kind's bytes a block and the offsets of its FP16 fields."""
    from qwen_np.numbers.ggml_blocks import BLOCK_KINDS

    return (BLOCK_KINDS[kind].size, FP16_FIELDS[kind]) if kind in BLOCK_KINDS else (FORMAT_BLOCKS[kind], (0,))


def random_blocks(kind: str, rows: int, count: int, seed: int,
                  scales: tuple[float, float] | None = None) -> np.ndarray:
    """[rows, count, bytes] blocks of a ggml_blocks kind, every byte random, as a file's: the FP16 fields
    any finite FP16 (subnormals, zeros, negatives), or uniform in `scales` (values of a trained matrix's
    size for scales ~1e-3)."""
    size, fields = block_bytes(kind)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, count, size), dtype=np.uint8)
    for at in fields:
        bits = raw[..., at:at + 2].view(np.uint16)
        if scales is None:
            bits[(bits & 0x7C00) == 0x7C00] &= np.uint16(0xBFFF)      # inf/NaN exponent -> a finite one
        else:
            bits[...] = rng.uniform(*scales, size=bits.shape).astype(np.float16).view(np.uint16)
    return raw


# A module that marks all its tests slow says so in one line; see pytest_ignore_collect.
WHOLLY_SLOW = re.compile(r"^pytestmark = pytest\.mark\.slow\b", re.MULTILINE)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """`-m "not slow"` (the inner loop) does not import the modules that are slow as a whole only to deselect
    every test: two of them import torch and transformers, seconds of CPU before the first test."""
    if (config.getoption("markexpr") == "not slow" and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")
            and WHOLLY_SLOW.search(collection_path.read_text(encoding="utf-8"))):
        return True
    return None


# A library the suite's extras install, missing: pytest.importorskip skips its tests with this reason. CI
# (.ci/run sets QWEN_NP_NO_IMPORT_SKIPS=1) counts such a skip as a failure: an extra left out of README's install
# line would otherwise pass CI with its reference tests (TRL's losses, peft's adapters, transformers' logits) unrun.
IMPORT_SKIP = "could not import"


def _fail_import_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    if (report.skipped and os.environ.get("QWEN_NP_NO_IMPORT_SKIPS") == "1"
            and IMPORT_SKIP in str(report.longrepr)):
        report.outcome = "failed"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    _fail_import_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    _fail_import_skip(outcome.get_result())


@pytest.fixture
def make_checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """Factory: make_checkpoint(name="ckpt", seed=0, shards=1, dtype="BF16", **config_overrides) -> folder."""
    def make(name: str = "ckpt", **kwargs: object) -> Path:
        return write_random_checkpoint(tmp_path / name, **kwargs)
    return make


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment a CLI or server subprocess runs in: no network, an empty Hugging Face cache (what a
    fresh offline machine has), this checkout on the path."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path_factory.mktemp("hf_home")),
            "PYTHONPATH": str(ROOT)}


@pytest.fixture(autouse=True, scope="session")
def no_weight_cache_in_home() -> Iterator[None]:
    """No test writes an FP32 weight cache into the user's cache folder (a full-width test model is
    2.5 GB in FP32): the cache is off unless a test turns it on in a folder of its own."""
    from qwen_np.engine.weight_cache import CACHE_ENV

    patch = pytest.MonkeyPatch()
    patch.setenv(CACHE_ENV, "off")
    yield
    patch.undo()


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    """The real Qwen3 tokenizer and chat template (QWEN3_RANDOM's), for every test that needs one."""
    return Tokenizer.from_folder(QWEN3_RANDOM)


@pytest.fixture(autouse=True)
def steady_threads() -> Iterator[None]:
    """Every test runs with the thread count it sets, however busy the machine is (runtime.adapt_to_load
    would use fewer while other processes run: tests/engine/test_runtime.py tests that)."""
    from qwen_np.engine import runtime

    with runtime.steady_threads():
        yield
