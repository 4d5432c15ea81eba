"""hardware: the topology read from the OS's files (a fake sysfs here, so the test knows the answer), and
the command's measured curve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwen_np.engine import runtime
from qwen_np.inspection import hardware
from qwen_np.cli import main


def fake_sysfs(root: Path, cpus: int, smt: bool) -> tuple[Path, Path, Path]:
    """CPUs 0..cpus-1 on one socket; with smt, CPUs 2k and 2k+1 are one core. L1d 48K, L2 2048K per core, L3 shared."""
    cpu_root, node_root = root / "cpu", root / "node"
    (node_root / "node0").mkdir(parents=True)
    for cpu in range(cpus):
        core = cpu // 2 if smt else cpu
        siblings = f"{2 * core}-{2 * core + 1}" if smt else str(cpu)
        topology = cpu_root / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        for name, value in (("physical_package_id", "0"), ("core_id", str(core)), ("thread_siblings_list", siblings)):
            (topology / name).write_text(value + "\n")
        for index, (level, kind, size, shared) in enumerate([(1, "Data", "48K", siblings), (2, "Unified", "2048K", siblings),
                                                             (3, "Unified", "32M", f"0-{cpus - 1}")]):
            folder = cpu_root / f"cpu{cpu}" / "cache" / f"index{index}"
            folder.mkdir(parents=True)
            for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared),
                                ("coherency_line_size", 64)):
                (folder / name).write_text(f"{value}\n")
    cpuinfo = root / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\n")
    return cpu_root, node_root, cpuinfo


@pytest.mark.parametrize("smt", [False, True])
def test_topology_counts_cores_siblings_and_caches_from_the_os_files(tmp_path: Path, monkeypatch, smt: bool) -> None:
    monkeypatch.setattr(hardware.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    topology = hardware.read_topology(*fake_sysfs(tmp_path, 4, smt))
    assert topology.model == "Test CPU 9000" and topology.sockets == 1 and topology.numa_nodes == 1
    assert topology.cores == (2 if smt else 4)
    assert topology.siblings == ([[0, 1], [2, 3]] if smt else [[0], [1], [2], [3]])
    assert [(c.name, c.size_bytes, c.line_bytes) for c in topology.caches] == [
        ("L1d", 48 * 1024, 64), ("L2", 2048 * 1024, 64), ("L3", 32 * 1024 ** 2, 64)]
    assert topology.caches[-1].shared_by == [0, 1, 2, 3]
    assert topology.governor is None and any("governor" in what for what in topology.unknown)


def test_the_fast_paths_l2_is_the_first_usable_cores_level_2_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: {1, 2})
    cpu_root = fake_sysfs(tmp_path, 4, smt=False)[0]
    (cpu_root / "cpu1" / "cache" / "index1" / "size").write_text("512K\n")     # cpu0's stays 2048K
    assert runtime.l2_bytes(cpu_root) == 512 * 1024
    assert runtime.l2_bytes(tmp_path / "no-cpu") is None                    # fast.BLOCK_BYTES then takes 8 MiB


def test_what_the_os_does_not_say_is_named(tmp_path: Path) -> None:
    topology = hardware.read_topology(tmp_path / "no-cpu", tmp_path / "no-node", tmp_path / "no-cpuinfo")
    assert topology.cores is None and topology.caches == [] and len(topology.unknown) == 5


def test_cpu_lists_and_sizes_read_as_the_os_writes_them() -> None:
    assert hardware.cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert [runtime.cache_size_bytes(s) for s in ("32K", "1024K", "32M", "512")] == [32768, 1048576, 33554432, 512]


@pytest.mark.slow
def test_the_command_measures_a_rate_at_every_size_on_one_and_all_threads(capsys) -> None:
    assert main(["hardware", "--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["sizes"] == hardware.QUICK_SIZES
    assert all(len(rates) == len(hardware.QUICK_SIZES) and min(rates) > 0 for rates in report["read_gbs"].values())
    assert report["decode_limits"]["qwen3-8b"]["bf16"] == pytest.approx(2 * report["decode_limits"]["qwen3-8b"]["fp32"])


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3-0.6b"])
def test_hardware_and_inspect_give_one_decode_limit_the_embedding_table_unread_when_untied(name: str) -> None:
    from qwen_np import parameter_count, preset
    from qwen_np.inspection.report import inspect_report

    config = preset(name)
    plans = inspect_report(config, 1, name, 16e9)["this_machine"]["plans"]
    limits = hardware.decode_limits(config, 16.0)
    assert limits["fp32"] == pytest.approx(plans["fp32"]["max_decode_tokens_per_s"])
    assert limits["bf16"] == pytest.approx(plans["bf16"]["max_decode_tokens_per_s"])
    everything = 16e9 / (2 * parameter_count(config))            # every weight, the table included, once a token
    assert (limits["bf16"] > everything * 1.05) == (not config.tie_word_embeddings)
