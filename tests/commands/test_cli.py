"""`python -m qwen_np` end to end, as a subprocess (offline, empty HF cache): on the bundled Shakespeare model
(no chat template) when nothing needs Qwen3's chat template, else on the random-weight Qwen3 fixture."""

import io
import json
import re
import resource
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from qwen_np.commands.generate import ReplyWriter
from qwen_np.files.tokenizer import Tokenizer
from tests.conftest import BUNDLED, HANG_SECONDS, QWEN3_RANDOM

pytestmark = pytest.mark.slow      # every test runs `python -m qwen_np` as a subprocess

ROOT = Path(__file__).resolve().parents[2]
STATS = re.compile(r"^stats: model=.+ prompt_tokens=(\d+) cached_tokens=(\d+) new_tokens=(\d+) load=[\d.]+s "
                   r"prefill=\S+ decode=\S+ peak_rss=\d+MiB finish=(\w+)$")
DIM, RESET = ReplyWriter.DIM, ReplyWriter.RESET


def qwen(env, *args: str, stdin: str | bytes | None = None) -> subprocess.CompletedProcess:
    data = stdin.encode() if isinstance(stdin, str) else stdin
    return subprocess.run([sys.executable, "-m", "qwen_np", *args], cwd=ROOT, env=env, capture_output=True,
                          input=data, timeout=HANG_SECONDS)


def stderr_lines(result: subprocess.CompletedProcess) -> list[str]:
    return result.stderr.decode().splitlines()


def ids_line(lines: list[str], label: str) -> list[int]:
    line = next(line for line in lines if line.startswith(label))
    return [int(n) for n in re.findall(r"\d+", line[len(label):])]


QWEN3 = ("-m", str(QWEN3_RANDOM))      # the flags that run a command on the Qwen3 fixture


def test_greedy_completion_streams_valid_utf8_equal_to_the_decoded_ids(env, tok) -> None:
    result = qwen(env, "generate", *QWEN3, "--no-chat", "--temperature", "0", "-n", "24", "--verbose", "猫日本")
    assert result.returncode == 0, result.stderr.decode()
    text = result.stdout.decode("utf-8")                      # strict: raises on half a character
    lines = stderr_lines(result)
    assert ids_line(lines, "prompt ids:") == tok.encode("猫日本")
    generated = ids_line(lines, "generated ids:")
    assert len(generated) == 24
    assert text == tok.decode(generated) + "\n"
    assert any(ord(ch) > 0x7F for ch in text) and "\ufffd" not in text
    assert "memory plan:" in result.stderr.decode()


def test_default_run_continues_the_text_with_the_bundled_model_says_so_and_ends_with_one_stats_line(env) -> None:
    result = qwen(env, "generate", "ROMEO:", "-n", "5", "--seed", "3")
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().strip()
    lines = stderr_lines(result)
    assert len(lines) == 3, lines
    assert "no chat template" in lines[0] and "plain text" in lines[0]
    assert "trained on Shakespeare" in lines[1] and "--model" in lines[1] and "RANDOM" not in lines[1]
    match = STATS.match(lines[-1])
    assert match, lines[-1]
    prompt_tokens = len(Tokenizer.from_folder(BUNDLED).encode("ROMEO:"))      # the text as is, no template
    assert (int(match[1]), int(match[2])) == (prompt_tokens, 0) and 1 <= int(match[3]) <= 5


def test_a_model_without_a_chat_template_generates_as_with_no_chat(env) -> None:
    plain = qwen(env, "generate", "ROMEO:", "-n", "8", "--seed", "4")
    no_chat = qwen(env, "generate", "--no-chat", "ROMEO:", "-n", "8", "--seed", "4")
    assert plain.returncode == no_chat.returncode == 0
    assert plain.stdout == no_chat.stdout and plain.stdout.strip()
    assert "no chat template" not in no_chat.stderr.decode()          # --no-chat asked for it: no note


def test_same_seed_same_text_across_runs(env) -> None:
    first = qwen(env, "generate", "Once upon a time", "-n", "12", "--seed", "5", "--no-think")
    second = qwen(env, "generate", "Once upon a time", "-n", "12", "--seed", "5", "--no-think")
    assert first.returncode == second.returncode == 0
    assert first.stdout == second.stdout and first.stdout.strip()


def test_chat_keeps_the_cache_across_turns(env) -> None:
    result = qwen(env, "chat", *QWEN3, "--temperature", "0", "-n", "4", "--verbose",
                  stdin="Hello!\nAnd a second question?\n")
    assert result.returncode == 0, result.stderr.decode()
    stats = [STATS.match(line) for line in stderr_lines(result) if line.startswith("stats:")]
    assert len(stats) == 2 and all(stats)
    (prompt1, cached1, _, _), (prompt2, cached2, _, _) = (tuple(map(int, m.groups()[:3])) + (m[4],) for m in stats)
    assert cached1 == 0 and cached2 >= prompt1 and prompt2 < prompt1 + 10
    assert len(result.stdout.decode().splitlines()) == 2     # one line per reply


def test_ctrl_c_stops_cleanly_and_prints_stats(env) -> None:
    """Interrupted once it streams text, it stops: exit 130, no traceback, a stats line saying so. What it
    waits for is output and the exit, however long a loaded machine takes; the timer only ends a hang."""
    command = [sys.executable, "-m", "qwen_np", "generate", *QWEN3, "--no-chat", "-n", "30000", "--seed", "0", "Hello"]
    # SIGINT as a terminal's Ctrl-C delivers it: a suite started in the background of a shell without job
    # control inherits SIGINT ignored, and Python then leaves it ignored (the run would go to its end)
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    hung = threading.Timer(HANG_SECONDS, process.kill)
    hung.start()
    try:
        assert process.stdout.read(1)                        # it is generating
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate()
    finally:
        hung.cancel()
        process.kill()
    lines = stderr.decode().splitlines()
    assert process.returncode == 130, stderr.decode()[-2000:]
    assert "Traceback" not in stderr.decode()
    match = STATS.match(lines[-1])
    assert match and match[4] == "interrupted" and 0 < int(match[3]) < 30000


def test_help_explains_every_flag(env) -> None:
    result = qwen(env, "generate", "--help")
    assert result.returncode == 0
    text = result.stdout.decode()
    for flag in ("--model", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--min-p",
                 "--repetition-penalty", "--presence-penalty", "--seed", "--no-chat", "--think", "--no-think",
                 "--system", "--memory", "--threads", "--verbose", "--trace", "--trace-layers", "--lens",
                 "--attention", "--attention-png", "--kv-dtype"):
        assert flag in text, flag


@pytest.fixture(scope="module")
def broken_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A checkpoint without tokenizer files, and one whose safetensors file is garbage."""
    root = tmp_path_factory.mktemp("checkpoints")
    no_tokenizer, garbage = root / "no_tokenizer", root / "garbage"
    tokenizer_files = ["tokenizer.json", "tokenizer_config.json"]
    for folder, names in ((no_tokenizer, ["config.json", "generation_config.json", "model.safetensors"]),
                          (garbage, ["config.json", "generation_config.json", *tokenizer_files])):
        folder.mkdir()
        for name in names:
            (folder / name).symlink_to(QWEN3_RANDOM / name)
    (garbage / "model.safetensors").write_bytes(b"this is not a safetensors file")
    return {"no_tokenizer": no_tokenizer, "garbage": garbage}


BAD_INPUTS = {
    "negative temperature": (["generate", "hi", "--temperature", "-1"], "--temperature"),
    "top-p zero": (["generate", "hi", "--top-p", "0"], "--top-p"),
    "top-p above one": (["generate", "hi", "--top-p", "1.5"], "--top-p"),
    "negative top-k": (["generate", "hi", "--top-k", "-1"], "--top-k"),
    "min-p above one": (["generate", "hi", "--min-p", "1.5"], "--min-p"),
    "zero repetition penalty": (["generate", "hi", "--repetition-penalty", "0"], "--repetition-penalty"),
    "vanishing repetition penalty": (["generate", *QWEN3, "--repetition-penalty", "1e-308", "--temperature", "1",
                                      "hi"], "--repetition-penalty: must be a number >= 0.01"),
    "vanishing temperature": (["generate", "hi", "--temperature", "1e-300"], "--temperature"),
    "negative max tokens": (["generate", "hi", "-n", "-2"], "--max-new-tokens"),
    "non-numeric top-k": (["generate", "hi", "--top-k", "many"], "--top-k"),
    "zero threads": (["generate", "hi", "--threads", "0"], "--threads"),
    "empty prompt": (["generate", ""], "prompt: empty"),
    "prompt longer than the context": (["generate", *QWEN3, "--no-chat", "a " * 42000], "40960-token context"),
    "unknown hub id offline": (["generate", "--model", "nobody/no-such-model", "hi"], "python -m qwen_np download"),
    "download offline": (["download", "nobody/no-such-model"], "nobody/no-such-model"),
    "not a model": (["generate", "--model", "/no/such/folder", "hi"], "--model"),
    "system without chat": (["generate", "--no-chat", "--system", "x", "hi"], "--system"),
    "attention out of range": (["generate", "hi", "--attention", "99:0"], "--attention"),
    "attention png alone": (["generate", "hi", "--attention-png", "out.png"], "--attention-png"),
    "chat with a tiny context": (["chat", "--ctx-size", "1"], "--ctx-size"),
    "chat without a chat template": (["chat"], "this model has no chat template: use generate, which continues text"),
    "system without a chat template": (["generate", "--system", "x", "ROMEO:"], "--system: this model has no chat "
                                                                                "template"),
    "eval with a zero context": (["eval", "--context", "0"], "--context: must be >= 1"),
    "eval with a negative context": (["eval", "--context", "-5"], "--context: must be >= 1"),
    "unknown kv dtype": (["generate", "hi", "--kv-dtype", "int4"], "--kv-dtype"),
    "serve with a size that is none": (["serve", "--kv-memory", "lots"], "--kv-memory: expected a size"),
    "a negative thinking budget": (["generate", *QWEN3, "hi", "--thinking-budget", "-1"], "--thinking-budget"),
    "a thinking budget for a model that does not think": (["generate", "-q", "ROMEO:", "-n", "2", "--thinking-budget", "4"],
                                                          "--thinking-budget: this tokenizer has no <think>"),
}


@pytest.mark.parametrize("args, expected", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_is_one_line_and_exit_code_2(env, args, expected) -> None:
    result = qwen(env, *args)
    assert_one_error_line(result, expected)


@pytest.mark.parametrize("prompts", [["ROMEO:"], ["ROMEO:", "JULIET:"]], ids=["one", "a batch"])
def test_bf16_and_int8_kv_caches_generate_the_fp32_caches_greedy_text(env, prompts) -> None:
    """On the bundled model (trained): BF16 keys/values move its predictions by ~6e-6 nats, int8 by ~3e-5
    (tests/engine/test_kv_cache.py), far too little to change a greedy choice over a few tokens."""
    flags = [arg for prompt in prompts for arg in ("-p", prompt)] + ["--temperature", "0", "-n", "12"]
    texts = [qwen(env, "generate", *flags, "--kv-dtype", dtype) for dtype in ("fp32", "bf16", "int8")]
    assert all(result.returncode == 0 for result in texts), [result.stderr.decode() for result in texts]
    assert texts[0].stdout and texts[0].stdout == texts[1].stdout == texts[2].stdout


def test_a_penalty_that_overflows_the_logits_mid_run_ends_it_with_one_error_line(env) -> None:
    # The presence penalty only counts generated tokens: the first is drawn (and printed), the second cannot be.
    result = qwen(env, "generate", *QWEN3, "--presence-penalty=-1e308", "--temperature", "1", "-n", "3", "hi")
    assert result.returncode == 2
    lines = stderr_lines(result)
    assert len(lines) == 1 and lines[0].startswith("error: sampling: the next token's logits are not finite"), lines


@pytest.mark.parametrize("command", [["generate", "-"], ["generate", "--file", "-"]])
def test_a_prompt_on_stdin_that_is_not_utf8_is_one_line_naming_stdin(env, command) -> None:
    for locale in ("C", "C.UTF-8"):        # the C locale's stdin would let the byte through as a surrogate
        result = qwen({**env, "LC_ALL": locale}, *command, stdin=b"ROMEO\xff:")
        assert_one_error_line(result, "stdin: not UTF-8 text (byte 0xff at offset 5)")


@pytest.mark.parametrize("which, expected", [("no_tokenizer", "tokenizer.json not found"),
                                             ("garbage", "model.safetensors")])
def test_broken_checkpoint_is_one_line_and_exit_code_2(env, broken_checkpoints, which, expected) -> None:
    result = qwen(env, "generate", "--model", str(broken_checkpoints[which]), "hi")
    assert_one_error_line(result, expected)


def assert_one_error_line(result: subprocess.CompletedProcess, expected: str) -> None:
    lines = stderr_lines(result)
    assert result.returncode == 2, result.stderr.decode()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert result.stdout == b""
    assert not (ROOT / "out.png").exists()


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve", "--port", "0"], ["inspect"]])
def test_a_config_with_more_layers_than_its_weights_is_one_line_before_anything_grows(env, tmp_path, command) -> None:
    """num_hidden_layers 10^9 against a 2-layer checkpoint, under a 4 GiB address-space limit: refused by
    name, where listing the tensors it implies would take without bound."""
    folder = tmp_path / "huge"
    folder.mkdir()
    for name in ("generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).symlink_to(QWEN3_RANDOM / name)
    config = json.loads((QWEN3_RANDOM / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10 ** 9}))

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 * 2 ** 30, 4 * 2 ** 30))

    result = subprocess.run([sys.executable, "-m", "qwen_np", *command, "--model", str(folder)], cwd=ROOT, env=env,
                            capture_output=True, timeout=HANG_SECONDS, preexec_fn=limit_memory)
    assert_one_error_line(result, "config.json: num_hidden_layers is 1000000000 but the checkpoint's tensors hold 2")


def poisoned_checkpoint(folder: Path, tensor: str, value: float) -> Path:
    """The Qwen3 fixture with the first weight of `tensor` set to `value` (NaN or Inf)."""
    from qwen_np.files.checkpoint import Checkpoint, save_checkpoint
    from qwen_np.core.config import load_config
    from qwen_np.numbers.numerics import upcast

    stored = Checkpoint(QWEN3_RANDOM, load_config(QWEN3_RANDOM))
    tensors = {name: upcast(stored.read(name)) for name in stored.tensors}
    tensors[tensor].flat[0] = value
    save_checkpoint(folder, json.loads((QWEN3_RANDOM / "config.json").read_text()), [tensors])
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).symlink_to(QWEN3_RANDOM / name)
    return folder


NON_FINITE = {
    "greedy generate": ["generate", "--temperature", "0", "hello"],
    "sampled generate": ["generate", "--seed", "1", "hello"],
    "a batch": ["generate", "-p", "hello", "-p", "there"],
    "chat": ["chat"],
    "eval": ["eval", "--text", str(ROOT / "LICENSE")],
    "serve": ["serve", "--port", "0"],
}


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("command", NON_FINITE.values(), ids=NON_FINITE.keys())
def test_weights_holding_nan_or_inf_are_one_line_naming_the_first_layer_that_is_not_finite(
        env, tmp_path, command, value) -> None:
    folder = poisoned_checkpoint(tmp_path / "poisoned", "model.layers.1.mlp.down_proj.weight", value)
    result = qwen(env, *command, "--model", str(folder))
    assert_one_error_line(result, "not finite (NaN or Inf): model.layers.1 is the first layer whose output is not "
                                  "(first at model.layers.1.mlp.down_proj)")


def test_inspect_reads_only_the_config(env) -> None:
    result = qwen(env, "inspect", "--preset", "qwen3-8b", "--json")
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.strip()
    assert qwen(env, "inspect", "--tokens", "3").returncode == 0


def test_trace_lens_and_attention_print_on_stderr(env, tmp_path) -> None:
    png = tmp_path / "head.png"
    result = qwen(env, "generate", "Hi", "-n", "2", "--trace-layers", "1", "--lens", "--attention", "1:3",
                  "--attention-png", str(png))
    assert result.returncode == 0, result.stderr.decode()
    assert len(stderr_lines(result)) > 5
    assert png.exists()


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_thinking_is_dimmed_on_a_terminal_and_left_alone_in_a_pipe(monkeypatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    deltas = ["<think>", "\nhmm", "\n</think>", "\n\nAnswer"]
    for stream, expected in ((Terminal(), f"{DIM}<think>\nhmm\n</think>{RESET}\n\nAnswer\n"),
                             (io.StringIO(), "<think>\nhmm\n</think>\n\nAnswer\n")):
        writer = ReplyWriter(stream)
        for delta in deltas:
            writer.write(delta)
        writer.end()
        assert stream.getvalue() == expected
    unfinished = Terminal()
    writer = ReplyWriter(unfinished)
    writer.write("<think>\nstill thinking")
    writer.end()
    assert unfinished.getvalue() == f"{DIM}<think>\nstill thinking{RESET}\n"


def test_an_install_without_the_bundled_model_asks_for_model(monkeypatch, tmp_path, capsys) -> None:
    import qwen_np.cli as cli
    from qwen_np.files import checkpoint

    monkeypatch.setattr(checkpoint, "bundled_model_path", lambda: tmp_path / "weights")
    for argv in (["generate", "hi"], ["generate", "--model", "bundled", "hi"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.splitlines()
        assert err == [f"error: --model: the bundled model is not at {tmp_path / 'weights'} (reinstall qwen_np, or "
                       "pass a hub id like Qwen/Qwen3-0.6B or a checkpoint folder)"]
