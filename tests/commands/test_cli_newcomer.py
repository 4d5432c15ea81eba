"""What a new user met on the command line (issue 42): `bundled` as a model everywhere a model is taken, under
one clean id where it is served; a missing path said to be missing; a --lora that is no adapter folder named
as --lora; serve's port checked before the model is read; eval through an adapter; one vocabulary of flags
across the commands; every command's --help without NumPy."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import QWEN3_RANDOM
from qwen_np.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[2]
SHORT_TEXT = "To be, or not to be, that is the question."


def error_lines(argv: list[str], capsys) -> list[str]:
    """main(argv)'s stderr, checked to be an exit 2 with nothing on stdout."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err.splitlines()


# --- `bundled`: the bundled model wherever a model is taken -------------------------------------------

@pytest.mark.slow
def test_model_bundled_is_the_bundled_model_in_every_command_from_any_folder(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)                      # nothing called weights/ or bundled/ here
    text = tmp_path / "short.txt"
    text.write_text(SHORT_TEXT)
    scores = []
    for model in ([], ["--model", "bundled"]):
        assert main(["eval", *model, "--text", str(text), "--json"]) == 0
        scores.append(json.loads(capsys.readouterr().out))
    assert scores[0] == scores[1] and scores[0]["model"] == "bundled"
    assert main(["inspect", "--model", "bundled", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "bundled"
    assert main(["export", "out.gguf", "--model", "bundled", "--type", "f32"]) == 0
    assert (tmp_path / "out.gguf").stat().st_size > 0
    capsys.readouterr()
    replies = []
    for model in (["--model", "bundled"], ["--model", "out.gguf"]):
        assert main(["generate", *model, "--no-chat", "-n", "6", "--temp", "0", "-q", "ROMEO:"]) == 0
        captured = capsys.readouterr()
        replies.append(captured.out)
    assert replies[0].strip() and replies[0] == replies[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.gguf", "short.txt"]


def test_load_model_bundled_loads_the_bundled_model_from_any_folder(tmp_path, monkeypatch) -> None:
    from qwen_np import load_model
    from qwen_np.files.checkpoint import bundled_model_path

    monkeypatch.chdir(tmp_path)
    model, reference = load_model("bundled"), load_model(bundled_model_path())
    ids = np.array([1, 2, 3])
    assert np.array_equal(model.forward(ids), reference.forward(ids))


@pytest.mark.slow
def test_the_walkthrough_s_tracing_snippet_runs_from_any_folder(env, tmp_path) -> None:
    page = (ROOT / "docs" / "walkthrough.md").read_text(encoding="utf-8")
    snippet = next(block for block in re.findall(r"```python\n(.*?)```", page, flags=re.DOTALL) if "Tracer()" in block)
    result = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr.decode()
    assert "model.layers.0" in result.stdout.decode() + result.stderr.decode()      # the trace it prints


@pytest.mark.slow
def test_the_bundled_model_is_served_and_answers_as_bundled(env) -> None:
    from openai import OpenAI
    from tests.serving.test_serve import serving

    with serving(env, "bundled") as running:
        client = OpenAI(base_url=running.url, api_key="none")
        assert [model.id for model in client.models.list()] == ["bundled"]
        reply = client.completions.create(model="bundled", prompt="ROMEO:", max_tokens=3, temperature=0)
        assert reply.model == "bundled" and reply.choices[0].text


# --- A path that does not exist, a --lora that is no adapter folder ------------------------------------

@pytest.mark.parametrize("given", ["./no-such-folder", "no-such-folder", "/no/such/folder", "~/no-such-folder",
                                   "no/such/folder", "../no-such/model.gguf"])
def test_a_model_path_that_does_not_exist_is_said_to_not_exist(given, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert error_lines(["inspect", "--model", given], capsys) == [
        f"error: --model: {given!r} does not exist (a model is a checkpoint folder, a GGUF file or a hub id like "
        "'Qwen/Qwen3-8B')"]


def test_a_file_that_is_not_a_gguf_is_said_to_be_no_gguf(tmp_path, capsys) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"not a model")
    assert error_lines(["inspect", "--model", str(path)], capsys) == [
        f"error: --model: {str(path)!r} is a file but not a GGUF file (a model is a checkpoint folder, a GGUF file "
        "or a hub id like 'Qwen/Qwen3-8B')"]


def test_a_hub_id_that_is_not_cached_offline_still_asks_the_hub(env) -> None:
    result = subprocess.run([sys.executable, "-m", "qwen_np", "inspect", "--model", "nobody/no-such-model"],
                            cwd=ROOT, env=env, capture_output=True, timeout=120)
    assert result.returncode == 2 and "python -m qwen_np download nobody/no-such-model" in result.stderr.decode()


LORA_COMMANDS = {"generate": ["generate", "-m", str(QWEN3_RANDOM), "hi", "--lora"],
                 "eval": ["eval", "-m", str(QWEN3_RANDOM), "--lora"],
                 "serve": ["serve", "-m", str(QWEN3_RANDOM), "--port", "0", "--lora"]}


@pytest.mark.slow
@pytest.mark.parametrize("command", LORA_COMMANDS)
@pytest.mark.parametrize("what", ["is a file, not a folder", "does not exist"])
def test_a_lora_that_is_no_adapter_folder_names_lora_and_says_what_an_adapter_is(command, what, tmp_path,
                                                                                  capsys) -> None:
    adapter = tmp_path / "adapter.gguf"
    if what == "is a file, not a folder":
        adapter.write_bytes(b"GGUF" + bytes(20))
    value = f"mine={adapter}" if command == "serve" else str(adapter)
    lines = error_lines([*LORA_COMMANDS[command], value], capsys)
    assert lines == [f"error: --lora: {adapter} {what}: a LoRA adapter is a folder holding "
                     "adapter_config.json and adapter_model.safetensors (PEFT's format; GGUF adapters are not read)"]


# --- eval --lora: the score of the fine-tune, not of its base ------------------------------------------

@pytest.mark.slow
def test_eval_lora_scores_the_text_through_the_adapter(tmp_path, capsys) -> None:
    from qwen_np.engine.loading import attach_adapter, load_model
    from qwen_np.files.adapter import read_adapter
    from qwen_np.files.tokenizer import Tokenizer
    from tests.files.test_lora_adapters import own_adapter

    adapter = own_adapter(tmp_path / "adapter", 4, ("q_proj", "v_proj", "down_proj"), seed=5)
    text = tmp_path / "short.txt"
    text.write_text(SHORT_TEXT + "\n")
    scores = {}
    for name, flags in (("base", []), ("adapter", ["--lora", str(adapter)])):
        assert main(["eval", "-m", str(QWEN3_RANDOM), "--text", str(text), "--json", *flags]) == 0
        scores[name] = json.loads(capsys.readouterr().out)
    model = load_model(QWEN3_RANDOM, memory="fp32")
    attach_adapter(model, read_adapter(adapter, model.config))
    tokenizer = Tokenizer.from_folder(QWEN3_RANDOM)       # eval starts each text with <|endoftext|>
    ids = np.array([tokenizer.token_to_id("<|endoftext|>"), *tokenizer.encode(SHORT_TEXT + "\n")])
    logits = model.forward(ids[:-1]).astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    nll = np.log(np.exp(shifted).sum(axis=-1)) - shifted[np.arange(len(ids) - 1), ids[1:]]
    assert scores["adapter"]["tokens"] == len(ids) - 1 and scores["adapter"]["lora"] == str(adapter)
    assert scores["adapter"]["loss_per_token"] == pytest.approx(nll.mean(), rel=1e-5)
    assert abs(scores["adapter"]["loss_per_token"] - scores["base"]["loss_per_token"]) > 1e-3


# --- serve: a port taken is said before the model is read ----------------------------------------------

@pytest.mark.parametrize("flag", ["--port", "--host"])
def test_serve_checks_its_address_before_reading_the_model(env, tmp_path, flag) -> None:
    """The model here has no tokenizer, which reading it would say: the address is refused first, at once."""
    folder = tmp_path / "no_tokenizer"
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (folder / name).symlink_to(QWEN3_RANDOM / name)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        address = ["--port", str(port)] if flag == "--port" else ["--host", "192.0.2.1", "--port", "0"]
        started = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "qwen_np", "serve", "-m", str(folder), *address],
                                cwd=ROOT, env=env, capture_output=True, timeout=120)
    lines = result.stderr.decode().splitlines()
    assert result.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: --host/--port: cannot listen on ") and "tokenizer" not in lines[0]
    assert time.monotonic() - started < 60


# --- One vocabulary: a flag several commands take is spelt and takes its value alike in each --------------

# The flags whose value differs by command on purpose, and what it is in each: --lora names an adapter to
# run through (a folder; serve: several, each NAME=DIR) or, where adapters are made or planned, their rank;
# --preset is a training run's preset in train and a published Qwen3 size in inspect.
MEANINGS = {"--lora": {"generate": "DIR", "chat": "DIR", "eval": "DIR", "serve": "NAME=DIR", "train": "RANK",
                       "inspect": "RANK"},
            "--preset": {"train": "{shakespeare,tiny}", "inspect": "PRESET"}}


def shown_value(action) -> str | None:
    """What --help shows an option takes: its metavar, its choices, or its name in capitals; None: no value."""
    if action.nargs == 0:
        return None
    if action.metavar is not None:
        return action.metavar
    return "{" + ",".join(action.choices) + "}" if action.choices else action.dest.upper()


def test_a_flag_several_commands_take_has_the_same_spellings_and_value_in_each() -> None:
    import argparse
    from collections import defaultdict

    from qwen_np.cli import build_parser

    parsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    shapes: dict[str, dict[str, tuple]] = defaultdict(dict)
    for command, parser in parsers.items():
        for action in parser._actions:
            for option in action.option_strings:
                shapes[option][command] = (tuple(sorted(action.option_strings)), shown_value(action), action.nargs)
    for option, meaning in MEANINGS.items():
        assert {command: value for command, (_, value, _) in shapes[option].items()} == meaning, option
    disagree = {option: by_command for option, by_command in shapes.items()
                if option not in MEANINGS and len(set(by_command.values())) > 1}
    assert disagree == {}
    # and the flags a new user reached for: --model, --seed, --threads and --ctx-size with their letters
    for option, letter in (("--model", "-m"), ("--seed", "-s"), ("--threads", "-t"), ("--ctx-size", "-c")):
        assert all(letter in spellings for spellings, _, _ in shapes[option].values()), option
    assert {"generate", "chat", "eval", "serve"} <= set(shapes["--lora"])


# --- Every command's --help without NumPy --------------------------------------------------------------

@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_command_s_help_imports_no_numpy(env, command) -> None:
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "qwen_np", command, "--help"], cwd=ROOT, env=env,
                            capture_output=True, timeout=120)
    assert result.returncode == 0 and b"usage:" in result.stdout, result.stderr.decode()[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.decode().splitlines()
                if line.startswith("import time:")}
    assert "qwen_np.cli" in imported and "numpy" not in imported


def test_the_names_help_shows_are_the_library_s() -> None:
    """core.defaults names what --help shows; the tables that use the names hold them all, in their order."""
    from qwen_np.core import defaults
    from qwen_np.files.gguf_export import FILE_TYPES
    from qwen_np.numbers.formats import FORMAT_TABLE

    assert tuple(FORMAT_TABLE) == defaults.FORMATS and tuple(FILE_TYPES) == defaults.GGUF_FILE_TYPES
    assert set(defaults.ACTIVATION_FORMATS) | set(defaults.HELD_FORMATS) <= set(FORMAT_TABLE)
