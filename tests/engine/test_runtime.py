"""runtime: on a busy machine the fast path uses the cores other processes leave it, and all of them again
when they stop; steady_threads() holds the count for work that must repeat bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Iterator

import pytest

from qwen_np.engine import runtime


@pytest.fixture
def adaptive(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Adaptation on (conftest holds it off), 2 cores, and a load the test sets: runnable tasks not ours."""
    load = [0]
    monkeypatch.setattr(runtime, "_adaptive", True)
    monkeypatch.setattr(runtime, "usable_cores", lambda: 2)
    monkeypatch.setattr(runtime, "_others_running", lambda: load[0])
    monkeypatch.setattr(runtime, "LOAD_CHECK_SECONDS", 0.0)
    monkeypatch.setattr(runtime, "_busy_readings", [])
    before = runtime.threads()
    runtime.set_threads(2)
    yield load
    runtime.set_threads(before)


def blas_threads() -> set[int]:
    return {info["num_threads"] for info in runtime.blas_info()}


def test_a_steady_neighbour_takes_a_thread_and_gives_it_back_when_it_stops(adaptive: list[int]) -> None:
    adaptive[0] = 1
    for _ in range(runtime.LOAD_SAMPLES):
        runtime.adapt_to_load()
    assert runtime.threads() == 1 and blas_threads() == {1}
    adaptive[0] = 0
    runtime.adapt_to_load()
    assert runtime.threads() == 2 and blas_threads() == {2}


def test_a_moment_of_load_does_not_cost_a_thread(adaptive: list[int]) -> None:
    for load in [1] * (runtime.LOAD_SAMPLES - 1) + [0] + [1] * (runtime.LOAD_SAMPLES - 1):
        adaptive[0] = load
        runtime.adapt_to_load()
        assert runtime.threads() == 2


def test_steady_threads_keep_every_thread_under_load(adaptive: list[int]) -> None:
    adaptive[0] = 3
    with runtime.steady_threads():
        for _ in range(2 * runtime.LOAD_SAMPLES):
            runtime.adapt_to_load()
        assert runtime.threads() == 2 and blas_threads() == {2}


@pytest.mark.parametrize(("most", "cores", "readings", "expected"), [
    (2, 2, [0, 0, 0, 0], 2),        # quiet: every thread
    (3, 2, [0, 0, 0, 0], 3),        # quiet: what was asked, even beyond the cores
    (2, 2, [1, 1, 1, 1], 1),        # one busy neighbour on 2 cores: one thread
    (2, 2, [3, 4, 3, 3], 1),        # never fewer than one
    (8, 16, [1, 2, 5, 3], 8),       # enough cores left for all
    (16, 16, [1, 2, 5, 3], 15),     # the least busy reading decides
])
def test_threads_for_load_uses_the_cores_others_leave(most: int, cores: int, readings: list[int], expected: int) -> None:
    assert runtime.threads_for_load(most, cores, readings) == expected



def test_inside_single_threaded_blas_the_load_changes_nothing(adaptive: list[int]) -> None:
    """Training's shards run with single-threaded BLAS: a busy or quiet reading must not hand BLAS threads back."""
    adaptive[0] = 1
    for _ in range(runtime.LOAD_SAMPLES):
        runtime.adapt_to_load()
    assert runtime.threads() == 1
    with runtime.single_threaded_blas():
        adaptive[0] = 0                          # the neighbour stops: outside, this gives the threads back
        for _ in range(2 * runtime.LOAD_SAMPLES):
            runtime.adapt_to_load()
        assert blas_threads() == {1} and runtime.threads() == 1
    runtime.adapt_to_load()
    assert runtime.threads() == 2 and blas_threads() == {2}


def test_independent_jobs_share_the_items_out_between_threads_each_single_threaded_in_order(adaptive) -> None:
    import threading
    import time

    seen: list[tuple[str, int, set[int]]] = []

    def job(item: int) -> int:
        seen.append((threading.current_thread().name, runtime.threads(), blas_threads()))
        time.sleep(0.01 * (item % 3))                  # uneven jobs: a thread takes the next as it finishes
        return item * item

    assert runtime.independent_jobs(job, list(range(12))) == [i * i for i in range(12)]
    assert len({name for name, _, _ in seen}) == 2 and {(t, tuple(b)) for _, t, b in seen} == {(1, (1,))}
    assert runtime.threads() == 2 and blas_threads() == {2}               # all given back afterwards
    assert runtime.independent_jobs(job, [5], most=4) == [25]             # one item: on this thread


@pytest.mark.parametrize("given, kept", [(None, "18"), ("28", "28")])
def test_openblas_idle_threads_spin_briefly_unless_the_user_said_otherwise(given: str | None, kept: str) -> None:
    """qwen_np sets OPENBLAS_THREAD_TIMEOUT before NumPy loads OpenBLAS (which reads it once), so that
    OpenBLAS's idle threads do not take the cores from the few-row products that follow (bench/README.md)."""
    env = {name: value for name, value in os.environ.items() if name != "OPENBLAS_THREAD_TIMEOUT"}
    if given is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = given
    code = "import os, qwen_np, numpy; print(os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == kept
