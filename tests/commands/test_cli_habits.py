"""The command line's Unix habits: prompts from stdin and files (several run as one batch), --stop, --json,
--version, the drawn seed, llama.cpp-style aliases (on the bundled model), chat commands and a context that
drops old turns (on the Qwen3 fixture, which has a chat template)."""

from __future__ import annotations

import io
import json
import re

import pytest

from qwen_np.commands.generate import ReplyWriter
from tests.commands.test_cli import QWEN3, ROOT, assert_one_error_line, qwen

pytestmark = pytest.mark.slow      # every test runs `python -m qwen_np` as a subprocess


def replies(result) -> list[dict]:
    assert result.returncode == 0, result.stderr.decode()
    return [json.loads(line) for line in result.stdout.decode().splitlines()]


def test_a_dash_reads_the_prompt_from_stdin(env) -> None:
    piped = qwen(env, "generate", "-", "-n", "6", "--temp", "0", stdin="Why is the sky blue?\n")
    given = qwen(env, "generate", "Why is the sky blue?", "-n", "6", "--temperature", "0")
    assert piped.returncode == given.returncode == 0
    assert piped.stdout == given.stdout and piped.stdout.strip()


def test_prompts_from_a_file_run_as_one_batch_and_each_gets_its_own_reply(env, tmp_path) -> None:
    prompts = ["Bonjour", "Hello", "Why is the sky blue?"]          # -p prompts first, then the file's lines
    (tmp_path / "prompts.txt").write_text("\n".join(prompts[1:]) + "\n\n")
    batch = replies(qwen(env, "generate", "--file", str(tmp_path / "prompts.txt"), "-p", prompts[0], "-n", "6",
                         "--temp", "0", "--json"))
    assert [reply["prompt"] for reply in batch] == prompts
    for prompt, reply in zip(prompts, batch):
        alone, = replies(qwen(env, "generate", prompt, "-n", "6", "--temp", "0", "--json"))
        assert reply["text"] == alone["text"] and reply["token_ids"] == alone["token_ids"]
        assert reply["usage"] == alone["usage"] == {"prompt_tokens": alone["usage"]["prompt_tokens"],
                                                   "completion_tokens": 6,
                                                   "total_tokens": alone["usage"]["prompt_tokens"] + 6}


def test_json_has_text_ids_finish_usage_timings_and_seed(env) -> None:
    reply, = replies(qwen(env, "generate", "Hello", "-n", "5", "-s", "7", "--json"))
    assert set(reply) == {"prompt", "text", "token_ids", "finish_reason", "usage", "timings", "seed"}
    assert reply["seed"] == 7 and reply["finish_reason"] == "length" and len(reply["token_ids"]) == 5
    assert set(reply["timings"]) == {"load_s", "prefill_s", "decode_s", "decode_tok_s"}


def test_stop_ends_the_text_before_the_stop_string(env) -> None:
    full, = replies(qwen(env, "generate", "--no-chat", "Once upon a time", "-n", "16", "--temp", "0", "--json"))
    stop = full["text"][5:8]
    stopped, = replies(qwen(env, "generate", "--no-chat", "Once upon a time", "-n", "16", "--temp", "0", "--json",
                            "--stop", "never there", "--stop", stop))
    assert stopped["text"] == full["text"][:full["text"].index(stop)] and stopped["finish_reason"] == "stop"


def test_a_run_without_seed_says_which_it_drew_and_that_seed_repeats_it(env) -> None:
    first = qwen(env, "generate", "Tell me a story", "-n", "8")
    seed = re.search(r" seed=(\d+)$", first.stderr.decode().splitlines()[-1])
    assert first.returncode == 0 and seed
    again = qwen(env, "generate", "Tell me a story", "-n", "8", "--seed", seed[1])
    assert again.stdout == first.stdout
    assert " seed=" not in again.stderr.decode()


def test_version_aliases_and_the_threads_warning(env) -> None:
    version = qwen(env, "--version")
    assert version.returncode == 0 and re.fullmatch(r"qwen_np \S+\n", version.stdout.decode())
    aliased = qwen(env, "generate", "-m", "weights", "-p", "Hi", "-s", "1", "--temp", "0.5", "--repeat-penalty", "1.1",
                   "-t", "64", "-n", "3")
    assert aliased.returncode == 0, aliased.stderr.decode()
    assert "warning: --threads 64 is more than the" in aliased.stderr.decode()


@pytest.mark.parametrize("args, expected", [
    (["generate", "hi", "--temperature", "inf"], "--temperature: must be 0 (greedy) or a number >= 0.01"),
    (["generate", "hi", "--top-p", "nan"], "--top-p: must be a number in (0, 1]"),
    (["generate"], "prompt: none given"),
    (["generate", "--file", "/no/such/file"], "--file /no/such/file"),
    (["generate", "a", "b", "--trace"], "one prompt at a time"),
], ids=["infinite-temperature", "nan-top-p", "no-prompt", "missing-file", "trace-of-a-batch"])
def test_bad_values_say_what_is_allowed(env, args, expected) -> None:
    assert_one_error_line(qwen(env, *args), expected)


def test_chat_commands(env) -> None:
    script = "Hello\n/help\n/system Be brief.\n/think off\nSecond\n/clear\n/nonsense\nThird\n/exit\nnever sent\n"
    result = qwen(env, "chat", *QWEN3, "-n", "3", "--temp", "0", "--verbose", stdin=script)
    assert result.returncode == 0, result.stderr.decode()
    err = result.stderr.decode()
    for line in ("/clear", "/system TEXT", "/think on|off", "/exit", "/help", "chat: system prompt set",
                 "chat: thinking off", "chat: conversation cleared", "chat: unknown command /nonsense"):
        assert line in err, line
    assert err.count("stats:") == 3                         # Hello, Second, Third; nothing after /exit
    assert len(result.stdout.decode().splitlines()) == 3


def test_chat_drops_the_oldest_turns_when_the_context_fills(env) -> None:
    script = "one two three four five six seven\nagain a long message here\nand a third long message\n"
    result = qwen(env, "chat", *QWEN3, "-n", "8", "-c", "64", "--temp", "0", "--no-think", stdin=script)
    assert result.returncode == 0, result.stderr.decode()
    err = result.stderr.decode()
    assert "is full: dropped the oldest" in err and "error" not in err
    assert len(result.stdout.decode().splitlines()) == 3 and "stats:" not in err    # stats only with --verbose


def test_hide_think_shows_only_the_answer() -> None:
    out = io.StringIO()
    writer = ReplyWriter(out, hide_think=True)
    for piece in ["<think>", "\nLet me ", "think.\n", "</think>", "\n\n", "The answer", " is 4."]:
        writer.write(piece)
    writer.end()
    assert out.getvalue() == "The answer is 4.\n"


def test_several_prompts_print_their_replies_apart_with_a_blank_line(env) -> None:
    batch = replies(qwen(env, "generate", "-p", "ROMEO:", "-p", "JULIET:", "-n", "6", "--temp", "0", "--json"))
    text = qwen(env, "generate", "-p", "ROMEO:", "-p", "JULIET:", "-n", "6", "--temp", "0").stdout.decode()
    assert text == batch[0]["text"] + "\n\n" + batch[1]["text"] + "\n"


def test_minus_one_new_tokens_runs_until_the_context_is_full(env) -> None:
    reply, = replies(qwen(env, "generate", "--no-chat", "ROMEO:", "-n", "-1", "--temp", "0", "--json"))
    context = json.loads((ROOT / "weights" / "config.json").read_text())["max_position_embeddings"]
    assert reply["finish_reason"] in ("eos", "context")
    assert reply["finish_reason"] == "eos" or reply["usage"]["total_tokens"] == context


def test_quiet_leaves_out_the_bundled_models_note(env) -> None:
    loud = qwen(env, "generate", "ROMEO:", "-n", "2", "--temp", "0").stderr.decode()
    quiet = qwen(env, "generate", "ROMEO:", "-n", "2", "--temp", "0", "-q").stderr.decode()
    assert "note: using the bundled model" in loud and "note:" not in quiet


def test_ctx_size_bounds_prompt_and_reply_together_in_generate(env) -> None:
    reply, = replies(qwen(env, "generate", "--no-chat", "ROMEO:", "-n", "50", "-c", "12", "--temp", "0", "--json"))
    assert reply["usage"]["total_tokens"] <= 12
    assert_one_error_line(qwen(env, "generate", "--no-chat", "ROMEO: and JULIET", "-c", "3"), "--ctx-size")
