"""`python -m qwen_np serve` driven by the official `openai` client over loopback, on the random-weight Qwen3
fixture (it has Qwen3's chat template; the bundled model, which has none, answers chat requests with a 400).

The server runs as a subprocess on an ephemeral port (started once for the module, always stopped).
What clients rely on: greedy text equals `generate --temperature 0`, streamed equals non-streamed,
one id per stream and [DONE] at its end, the same seed gives the same text, concurrent requests share
the batch and each gets what it gets alone, stop strings straddling tokens, 4xx errors as OpenAI's JSON
after which the server keeps serving, and a client that disconnects frees its row. And that no client
hurts another: bad requests, huge bodies, half-sent bodies and cross-site requests are refused with a
4xx, never a 5xx, while other streams go on untouched and /health keeps answering.
"""

from __future__ import annotations

import contextlib
import json
import re
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from qwen_np.serving import access, app, protocol
from tests.conftest import HANG_SECONDS, QWEN3_RANDOM

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.slow      # the tests share a `serve` subprocess; several start servers of their own

ROOT = Path(__file__).resolve().parents[2]
MODEL = str(QWEN3_RANDOM)       # the name clients ask for: the fixture's folder, as --model was given it
PROMPTS = ["The quick brown fox", "Hello", "Once upon a time, in a land far away,", "1 2 3 4", "猫日本",
           "Why is the sky blue?", "def main():", "Bonjour"]


@dataclass
class Running:
    url: str                                          # the base URL, http://127.0.0.1:PORT/v1
    start: list[str]                                  # the lines it wrote on stderr while starting
    log: list[str] = field(default_factory=list)      # the lines it wrote on stderr after starting
    pid: int = 0                                      # the server's process


@pytest.fixture(scope="module")
def server(running: Running) -> str:          # running: conftest's, a server of MODEL
    return running.url


@contextlib.contextmanager
def serving(env: dict[str, str], model: str, *flags: str, launcher: tuple[str, ...] = ("-m", "qwen_np")):
    """`serve` of `model` (launcher: what python runs, the CLI by default) until the block ends."""
    process = subprocess.Popen([sys.executable, *launcher, "serve", "--model", model, "--port", "0", *flags],
                               cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                               bufsize=0)        # unbuffered: a line read ahead would hide from select()
    assert process.stderr is not None
    try:
        deadline, line, start = time.monotonic() + HANG_SECONDS, b"", []
        while b"serving" not in line:
            ready, _, _ = select.select([process.stderr], [], [], max(0.0, deadline - time.monotonic()))
            assert ready and process.poll() is None, f"server did not start: {line!r}"
            line = process.stderr.readline()
            start.append(line.decode(errors="replace").rstrip("\n"))
        running = Running(line.decode().split(" on ")[1].split()[0], start, pid=process.pid)
        assert running.url.startswith("http://127.0.0.1:")                   # loopback by default
        stderr = process.stderr

        def drain() -> None:                                                 # keep the pipe drained
            for raw in stderr:
                running.log.append(raw.decode(errors="replace").rstrip("\n"))

        threading.Thread(target=drain, daemon=True).start()
        yield running
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def chat(client, prompt: str, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], **kwargs)


def generate_cli(env: dict[str, str], prompt: str, *flags: str) -> str:
    result = subprocess.run([sys.executable, "-m", "qwen_np", "generate", "--model", MODEL, "--temperature", "0",
                             *flags, prompt], cwd=ROOT, env=env, capture_output=True, timeout=HANG_SECONDS)
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout.decode().removesuffix("\n")


def post(url: str, body: bytes | dict, **headers: str) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return fetch(urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **headers}))


def get(url: str, **headers: str) -> tuple[int, dict]:
    return fetch(urllib.request.Request(url, headers=headers))


def fetch(request: urllib.request.Request) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(request, timeout=HANG_SECONDS) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def health(server: str) -> dict:
    with urllib.request.urlopen(server.removesuffix("/v1") + "/health", timeout=HANG_SECONDS) as response:
        return json.loads(response.read())


def assert_openai_error(code: int, answer: dict, status: int, param: str | None = None) -> None:
    assert code == status, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["message"]
    assert "Traceback" not in answer["error"]["message"]
    if param is not None:
        assert answer["error"]["param"] == param


def test_models_lists_the_served_model(client) -> None:
    assert [model.id for model in client.models.list().data] == [MODEL]


def test_greedy_chat_and_completion_equal_the_generate_command(client, env) -> None:
    reply = chat(client, "Why is the sky blue?", max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == generate_cli(env, "Why is the sky blue?", "-n", "12")
    assert reply.choices[0].finish_reason == "length" and reply.id.startswith("chatcmpl-")
    completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    assert completion.choices[0].text == generate_cli(env, "Once upon a time", "-n", "12", "--no-chat")
    assert completion.usage.prompt_tokens == 4 and completion.usage.completion_tokens == 12
    assert completion.usage.total_tokens == 16


def test_streamed_text_equals_the_whole_response_with_one_id_and_usage_last(client) -> None:
    whole = chat(client, "Hello", max_tokens=10, temperature=0)
    chunks = list(chat(client, "Hello", max_tokens=10, temperature=0, stream=True,
                       stream_options={"include_usage": True}))
    assert len({chunk.id for chunk in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].text for c in client.completions.create(model=MODEL, prompt="Hello", max_tokens=10,
                                                                          temperature=0, stream=True))
    assert text == client.completions.create(model=MODEL, prompt="Hello", max_tokens=10, temperature=0).choices[0].text


def test_a_raw_stream_is_server_sent_events_ending_with_done(server) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    request = urllib.request.Request(server + "/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=HANG_SECONDS) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [e for e in response.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert len({json.loads(e[6:])["id"] for e in events[:-1]}) == 1


def test_the_same_seed_gives_the_same_text(client) -> None:
    texts = [chat(client, "Tell me a story", max_tokens=16, temperature=1.0, seed=1234).choices[0].message.content
             for _ in range(2)]
    assert texts[0] == texts[1] and texts[0]


def test_thinking_switch_as_vllm_takes_it(client, env) -> None:
    reply = chat(client, "Hello", max_tokens=8, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reply.choices[0].message.content == generate_cli(env, "Hello", "-n", "8", "--no-think")
    assert reply.usage.prompt_tokens == 13           # the template adds an empty think block


def test_eight_concurrent_clients_share_the_batch_and_each_get_what_they_get_alone(client, server) -> None:
    alone = [chat(client, p, max_tokens=24, temperature=0).choices[0] for p in PROMPTS]
    assert all(choice.finish_reason == "length" for choice in alone)      # none ends early: all 8 stay in
    started = threading.Barrier(len(PROMPTS) + 1, timeout=HANG_SECONDS)

    def stream(prompt: str) -> str:
        pieces, waited = [], False
        for chunk in chat(client, prompt, max_tokens=24, temperature=0, stream=True):
            pieces.append(chunk.choices[0].delta.content or "")
            if not waited and any(pieces):
                started.wait()                   # every client has its first token: all 8 rows are in
                waited = True
                started.wait()                   # hold until the batch has been looked at
        return "".join(pieces)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = [pool.submit(stream, p) for p in PROMPTS]
        started.wait()
        running = health(server)["running"]
        started.wait()
        texts = [reply.result(timeout=HANG_SECONDS) for reply in replies]
    assert running == len(PROMPTS)
    assert texts == [choice.message.content for choice in alone]


def test_stop_strings_split_across_tokens(client) -> None:
    pieces = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24,
                                                                     temperature=0, stream=True)]
    cut = next(i for i in range(1, len(pieces)) if len(pieces[i - 1]) >= 2 and len(pieces[i]) >= 2)
    stop = pieces[cut - 1][-2:] + pieces[cut][:2]
    full = "".join(pieces)
    for stream in (False, True):
        response = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                                             stop=["never in it", stop], stream=stream)
        choices = [c.choices[0] for c in response] if stream else response.choices
        assert "".join(c.text for c in choices) == full[:full.index(stop)]
        assert choices[-1].finish_reason == "stop"


BAD_COMPLETIONS = {                    # the id: (body, status, param)
    "malformed-json": (b"{not json", 400, None),
    "unknown-model": ({"model": "no-such-model", "prompt": "Hi"}, 404, "model"),
    "negative-max-tokens": ({"model": MODEL, "prompt": "Hi", "max_tokens": -1}, 400, "max_tokens"),
    "max-tokens-past-context": ({"model": MODEL, "prompt": "Hi", "max_tokens": 5000}, 400, "prompt"),  # 4096 context
    "prompt-past-context": ({"model": MODEL, "prompt": "Hi " * 5000}, 400, "prompt"),
    "infinite-temperature": ({"model": MODEL, "prompt": "Hi", "temperature": float("inf")}, 400, None),
    "n-past-the-batch": ({"model": MODEL, "prompt": "Hi", "n": 9}, 400, "n"),      # --max-batch 8
    "empty-prompt": ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    "bad-stop": ({"model": MODEL, "prompt": "Hi", "stop": 3}, 400, "stop"),
    "vanishing-temperature": ({"model": MODEL, "prompt": "Hi", "temperature": 1e-300}, 400, "temperature"),
    "boolean-token-ids": ({"model": MODEL, "prompt": [True, False]}, 400, "prompt"),
    "vanishing-repetition-penalty": ({"model": MODEL, "prompt": "Hi", "temperature": 1, "repetition_penalty": 1e-308},
                                     400, "repetition_penalty"),
    "surrogate-model": (b'{"model": "\\ud800", "prompt": "Hi"}', 400, "model"),
    "surrogate-prompt": (('{"model": "%s", "prompt": "\\ud800"}' % MODEL).encode(), 400, "prompt"),
    "surrogate-field-name": (('{"model": "%s", "prompt": "Hi", "\\udfff": 1}' % MODEL).encode(), 400, None),
    "deeply-nested": (('{"model": "%s", "prompt": %s}' % (MODEL, "[" * 100_000 + "]" * 100_000)).encode(), 400, None),
    "five-stops": ({"model": MODEL, "prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    "long-stop": ({"model": MODEL, "prompt": "Hi", "stop": ["x" * 257]}, 400, "stop"),
}


@pytest.mark.parametrize("body, status, param", BAD_COMPLETIONS.values(), ids=BAD_COMPLETIONS.keys())
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client, body, status, param) -> None:
    assert_openai_error(*post(server + "/completions", body), status, param)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None


BAD_CHATS = {
    "surrogate-content": (('{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % MODEL).encode(),
                          "messages"),
    "reasoning-content-object": ({"model": MODEL, "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "reasoning_content": {"strip": 1}},
        {"role": "user", "content": "Again"}]}, "messages"),
    "name-object": ({"model": MODEL, "messages": [{"role": "user", "content": "Hi", "name": ["x"]}]}, "messages"),
}


@pytest.mark.parametrize("body, param", BAD_CHATS.values(), ids=BAD_CHATS.keys())
def test_bad_chat_bodies_get_a_400_naming_the_field(server, body, param) -> None:
    assert_openai_error(*post(server + "/chat/completions", body), 400, param)


def test_a_prompt_too_long_for_the_context_is_refused_by_its_length_before_tokenising(server) -> None:
    code, answer = post(server + "/completions", {"model": MODEL, "prompt": "x" * 4_500_000})
    assert_openai_error(code, answer, 400, "prompt")
    assert answer["error"]["code"] == "context_length_exceeded" and "4500000 characters" in answer["error"]["message"]


def send_raw(server: str, request: bytes) -> tuple[bytes, bytes]:
    """The server's answer to `request`, sent as is on a new connection (and left unfinished): its head and
    its body, once the server has closed the connection."""
    port = int(server.split(":")[2].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_SECONDS) as connection:
        connection.sendall(request)
        reply = b""
        while chunk := connection.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return head, body


POST_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


def test_a_body_over_the_limit_gets_413_unread(server) -> None:
    head, body = send_raw(server, POST_HEAD + b"Content-Length: %d\r\n\r\n{" % (app.MAX_BODY_BYTES + 1))
    assert head.startswith(b"HTTP/1.1 413")
    assert_openai_error(413, json.loads(body), 413)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_post_that_is_not_json_gets_415(server, content_type) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    assert_openai_error(*post(server + "/completions", body, **{"Content-Type": content_type}), 415)
    code, _ = post(server + "/completions", body, **{"Content-Type": "Application/JSON; charset=utf-8"})
    assert code == 200


def test_a_loopback_server_answers_only_loopback_host_names(server) -> None:
    port = server.split(":")[2].split("/")[0]
    for host in ("evil.example", f"evil.example:{port}", "localhost.evil.example", "127.0.0.2"):
        assert_openai_error(*get(server + "/models", Host=host), 400)
    for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert get(server + "/models", Host=host)[0] == 200


def test_a_half_sent_body_times_out_with_408(server) -> None:
    head, body = send_raw(server, POST_HEAD + b'Content-Length: 100\r\n\r\n{"model":')
    assert head.startswith(b"HTTP/1.1 408")
    assert_openai_error(408, json.loads(body), 408)


def test_a_connection_that_never_finishes_its_headers_is_closed_and_the_server_keeps_serving(server) -> None:
    port = int(server.split(":")[2].split("/")[0])
    silent = socket.create_connection(("127.0.0.1", port))                        # sends nothing at all
    opened = time.monotonic()
    head, body = send_raw(server, b"GET /health HTTP/1.1\r\nHost: 127.0")
    assert head == body == b"" and time.monotonic() - opened > protocol.HEADER_SECONDS - 1  # by the header timeout
    silent.settimeout(HANG_SECONDS)
    assert silent.recv(1) == b""                                                  # closed by the server too
    silent.close()
    assert health(server)["status"] == "ok"


def test_every_request_is_logged_in_one_line(running, client) -> None:
    client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3)
    deadline = time.monotonic() + HANG_SECONDS
    pattern = re.compile(r"POST /v1/completions 200 prompt_tokens=4 completion_tokens=3 [\d.]+s")
    while not any(pattern.fullmatch(line) for line in running.log) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any(pattern.fullmatch(line) for line in running.log), running.log[-5:]


def test_health_answers_while_a_big_prompt_tokenises(server) -> None:
    # Allowed by its length (4M characters) and its size, but 960k tokens: refused after it is tokenised (seconds).
    body = {"model": MODEL, "prompt": "Hello world, how are you " * 160_000}
    with ThreadPoolExecutor(1) as pool:
        opened = time.monotonic()
        big = pool.submit(post, server + "/completions", body)
        latencies = []
        while not big.done():
            started = time.monotonic()
            assert health(server)["status"] == "ok"
            latencies.append(time.monotonic() - started)
            time.sleep(0.05)
        assert_openai_error(*big.result(), 400, "prompt")
        took = time.monotonic() - opened
    # Tokenising on the event loop would hold a health check for most of the request: one answer, or few.
    assert len(latencies) >= 3 and max(latencies) < took / 3, (latencies, took)


def test_bad_chat_requests_and_routes_are_4xx_through_the_client(client, server) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        chat(client, "Hi", max_tokens=-3)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        chat(client, "Hi", max_tokens=4096)
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "Hi"}])
    code, answer = post(server + "/audio/speech", {"model": MODEL, "input": "Hi"})
    assert code == 404 and "error" in answer


def test_a_client_that_disconnects_frees_its_row(client, server) -> None:
    before = metrics(server)["generation_tokens_total"]
    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4000, temperature=0, stream=True)
    for _, _chunk in zip(range(3), stream):
        pass
    assert health(server)["running"] == 1
    stream.close()
    deadline = time.monotonic() + HANG_SECONDS
    while health(server)["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert health(server) == {"status": "ok", "running": 0, "waiting": 0}
    assert metrics(server)["generation_tokens_total"] - before < 4000       # cancelled, not run to its end


def test_an_api_key_from_the_environment_is_required_of_all_but_health_and_quiet_logs_nothing(env) -> None:
    with serving({**env, access.API_KEY_ENV: "sesame"}, MODEL, "--quiet") as running:
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            assert_openai_error(*post(running.url + "/completions", body, **headers), 401)
            assert_openai_error(*get(running.url + "/models", **headers), 401)
            assert_openai_error(*post(running.url + "/rerank", {"query": "q", "documents": ["d"]}, **headers), 401)
            assert_openai_error(*post(running.url.removesuffix("/v1") + "/tokenize", {"prompt": "Hi"}, **headers), 401)
        assert post(running.url + "/completions", body, Authorization="Bearer sesame")[0] == 200
        assert health(running.url)["status"] == "ok"
        keyed = openai.OpenAI(base_url=running.url, api_key="sesame", max_retries=0)
        assert keyed.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None
        time.sleep(0.2)
    assert running.log == []


def test_only_a_server_listening_beyond_loopback_warns_at_start() -> None:
    assert access.exposure_warning("127.0.0.1", None) is None and access.exposure_warning("::1", None) is None
    assert "--api-key" in access.exposure_warning("0.0.0.0", None)
    assert "--api-key" not in access.exposure_warning("192.168.1.5", "sesame")


def test_a_greedy_stream_is_untouched_by_adversarial_clients_and_health_stays_quick(client, server) -> None:
    prompt, n = "Once upon a time", 48
    solo = "".join(c.choices[0].text for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=n,
                                                                          temperature=0, stream=True))
    attacks = [lambda body=body: post(server + "/completions", body)[0] for body, _, _ in BAD_COMPLETIONS.values()]
    attacks += [lambda body=body: post(server + "/chat/completions", body)[0] for body, _ in BAD_CHATS.values()]
    attacks += [
        lambda: post(server + "/completions", {"model": MODEL, "prompt": "Hi"}, **{"Content-Type": "text/plain"})[0],
        lambda: get(server + "/models", Host="evil.example")[0],
        lambda: post(server + "/completions", {"model": MODEL, "prompt": "x" * 4_500_000})[0],
        lambda: post(server + "/completions", {"model": MODEL, "prompt": "Hello world, how are you " * 160_000})[0],
        lambda: post(server + "/completions", {"model": MODEL, "prompt": "Hi", "stop": ["s"] * 20_000})[0],
        lambda: int(send_raw(server, POST_HEAD + b"Content-Length: %d\r\n\r\n{" % (2 * app.MAX_BODY_BYTES))[0][9:12]),
    ]
    pieces: list[str] = []
    with ThreadPoolExecutor(4) as pool:
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True)
        pieces.append(next(iter(stream)).choices[0].text)            # the row is in the batch: now the attacks
        opened = time.monotonic()
        statuses = [pool.submit(attack) for attack in attacks]
        latencies = []
        while not all(status.done() for status in statuses):
            started = time.monotonic()
            assert health(server)["status"] == "ok"
            latencies.append(time.monotonic() - started)
            time.sleep(0.05)
        took = time.monotonic() - opened
        pieces.extend(chunk.choices[0].text for chunk in stream)
    assert "".join(pieces) == solo
    assert all(400 <= status.result() < 500 for status in statuses), [status.result() for status in statuses]
    assert max(latencies) < took / 3, (latencies, took)       # no attack held the event loop for long


def test_a_model_without_a_chat_template_refuses_chat_with_a_400_and_still_completes(env) -> None:
    with serving(env, "weights") as running:            # the bundled Shakespeare model
        url = running.url
        code, answer = post(url + "/chat/completions", {"model": "weights", "messages": [{"role": "user", "content": "Hi"}]})
        assert code == 400 and answer["error"]["code"] == "no_chat_template"
        assert "no chat template" in answer["error"]["message"] and "/v1/completions" in answer["error"]["message"]
        code, answer = post(url + "/completions", {"model": "weights", "prompt": "ROMEO:", "max_tokens": 8})
        assert code == 200 and answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] <= 8


def metrics(server: str) -> dict[str, float]:
    """GET /metrics, checked to be Prometheus' text format: each sample after its # HELP and # TYPE lines."""
    with urllib.request.urlopen(server.removesuffix("/v1") + "/metrics", timeout=HANG_SECONDS) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        lines = response.read().decode().splitlines()
    samples = {}
    for help_line, type_line, sample in zip(lines[::3], lines[1::3], lines[2::3]):
        name, value = sample.split(" ")
        assert help_line.startswith(f"# HELP {name} ") and type_line.split()[:3] == ["#", "TYPE", name]
        assert type_line.split()[3] == ("counter" if name.endswith("_total") else "gauge")
        samples[name.removeprefix("qwen_np_")] = float(value)
    return samples


def test_metrics_count_requests_blocks_tokens_and_prefix_hits(client, server, running) -> None:
    before = metrics(server)
    client.completions.create(model=MODEL, prompt="Counting the tokens of this request", max_tokens=5, temperature=0)
    after = metrics(server)
    assert set(after) >= {"requests_running", "requests_waiting", "kv_blocks_used", "kv_blocks_free",
                          "prefix_cache_hit_rate", "generation_tokens_total", "preemptions_total"}
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == 5
    assert after["requests_running"] == after["requests_waiting"] == after["kv_blocks_used"] == 0
    assert 0 <= after["prefix_cache_hit_rate"] <= 1 and after["kv_blocks_free"] > 0
    assert any(line.startswith("KV cache: ") and "default: the RAM left after the weights" in line
               for line in running.start)


def test_a_resent_conversation_reports_its_cached_tokens_and_answers_as_a_cold_run(client) -> None:
    system = {"role": "system", "content": "You are a patient assistant who explains things carefully. " * 8}
    first = [system, {"role": "user", "content": "What is a prime number?"}]
    reply = client.chat.completions.create(model=MODEL, messages=first, max_tokens=10, temperature=0)
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0
    second = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                      {"role": "user", "content": "And a composite one?"}]
    warm = client.chat.completions.create(model=MODEL, messages=second, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=second, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    # Only the whole blocks of the first request's prompt are sure to be in common (the reply is re-rendered).
    assert warm.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens // 16 * 16 - 16 > 0
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= warm.usage.prompt_tokens_details.cached_tokens
    cold = "".join(generate_cli_messages(second))
    assert warm.choices[0].message.content == cold


def generate_cli_messages(messages: list[dict]) -> list[str]:
    """The greedy reply to `messages` from generate() in this process: no cache shared with the server."""
    from qwen_np import load_model
    from qwen_np.generation.generate import generate, resolve_sampling
    from qwen_np.files.model_files import read_generation_defaults
    from qwen_np.files.tokenizer import Tokenizer

    folder = QWEN3_RANDOM
    model, tok = load_model(folder), Tokenizer.from_folder(folder)
    defaults = read_generation_defaults(folder, model.config)
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    return [event.text for event in generate(model, tok, ids, resolve_sampling(defaults, temperature=0), 10,
                                             eos_token_ids=defaults.eos_token_ids)]


def test_under_a_small_kv_budget_concurrent_streams_get_their_solo_texts_and_a_request_too_big_a_400(env) -> None:
    with serving(env, MODEL, "--kv-memory", "256KiB", "--max-batch", "4") as running:     # 16 blocks: 256 positions
        assert any("KV cache: 0.2 MiB" in line or "256 positions" in line for line in running.start), running.start
        url, prompts = running.url, [f"Story {i}: once upon a time there was a number called {i}" for i in range(4)]
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=HANG_SECONDS)

        def text(prompt: str) -> str:
            return "".join(c.choices[0].text for c in client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=100, temperature=0, stream=True))

        solo = [text(p) for p in prompts]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(text, prompts))
        assert together == solo and metrics(url)["preemptions_total"] > 0
        for stream in (False, True):
            code, answer = post(url + "/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 300,
                                                       "stream": stream})
            assert_openai_error(code, answer, 400, "max_tokens")
            assert answer["error"]["code"] == "kv_cache_exceeded" and "256" in answer["error"]["message"]
        answer = client.completions.create(model=MODEL, prompt="Hello", temperature=0)    # max_tokens: what fits
        assert answer.usage.prompt_tokens + answer.usage.completion_tokens <= 256


def test_a_bad_kv_memory_is_one_line_naming_the_flag(env) -> None:
    for flag in (["--kv-memory", "lots"], ["--kv-memory", "1KiB"]):
        result = subprocess.run([sys.executable, "-m", "qwen_np", "serve", "--model", MODEL, "--port", "0", *flag],
                                cwd=ROOT, env=env, capture_output=True, timeout=HANG_SECONDS)
        assert result.returncode == 2 and result.stderr.decode().count("\n") == 1, result.stderr
        assert result.stderr.decode().startswith("error: --kv-memory: ")


def test_a_chat_reply_gives_its_thinking_apart_under_both_names_unless_raw() -> None:
    from qwen_np.serving.responses import assistant_message

    reply = "<think>\nLet me think.\n</think>\n\nFour."
    assert assistant_message(reply, True) == {"role": "assistant", "content": "Four.",
                                              "reasoning_content": "Let me think.", "reasoning": "Let me think."}
    assert assistant_message(reply, False) == {"role": "assistant", "content": reply}
    assert assistant_message("Four.", True) == {"role": "assistant", "content": "Four."}


# --- a scripted model: the real tokenizer and template, weights that make greedy decoding a fixed chain ----

SCRIPT = ["\n", "<think>", "Hmm", "</think>", "Four", ".", "<|im_end|>"]     # each token -> the next, greedy
SCRIPTED_NAMES = ("qwen3-scripted", "alias")


def write_scripted_checkpoint(folder: Path) -> Path:
    """A Qwen3 that greedily continues the chat generation prompt (which ends in "\\n") with SCRIPT:
    o_proj and down_proj are zero, so the last hidden state is the current token's embedding; SCRIPT's
    tokens embed as one-hot vectors and lm_head maps each to the next one's logit (80 against 0), so a
    reply with thinking comes out of a real server, through the real template and tokenizer."""
    import shutil

    from qwen_np.files.checkpoint import save_checkpoint
    from qwen_np.core.config import Qwen3Config, expected_tensors
    from qwen_np.files.tokenizer import Tokenizer

    config_json = {**json.loads((QWEN3_RANDOM / "config.json").read_text()), "tie_word_embeddings": False}
    config = Qwen3Config.from_dict(config_json)
    tensors = {name: (np.ones(shape) if len(shape) == 1 else np.zeros(shape)).astype(np.float32)
               for name, shape in expected_tensors(config).items()}
    tokenizer = Tokenizer.from_folder(QWEN3_RANDOM)
    ids = [tokenizer.encode(token) for token in SCRIPT]
    assert all(len(one) == 1 for one in ids), ids
    for k, (token, following) in enumerate(zip(ids, ids[1:])):
        tensors["model.embed_tokens.weight"][token[0], k] = 1.0
        tensors["lm_head.weight"][following[0], k] = 10.0
    save_checkpoint(folder, config_json, [tensors])
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(QWEN3_RANDOM / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def scripted(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory):
    """A server of the scripted model, under two names, requests without max_tokens capped at 6."""
    folder = write_scripted_checkpoint(tmp_path_factory.mktemp("scripted"))
    with serving(env, str(folder), "--served-model-name", *SCRIPTED_NAMES, "--default-max-tokens", "6") as running:
        yield running


def test_the_official_client_reads_a_replys_thinking_apart_whole_and_streamed(scripted) -> None:
    client = openai.OpenAI(base_url=scripted.url, api_key="none", max_retries=0, timeout=HANG_SECONDS)
    messages = [{"role": "user", "content": "What is two and two?"}]
    reply = client.chat.completions.create(model=SCRIPTED_NAMES[0], messages=messages, temperature=0).choices[0]
    assert reply.message.content == "Four." and reply.finish_reason == "stop"
    assert reply.message.reasoning_content == reply.message.reasoning == "Hmm"       # llama-server's and vLLM's
    chunks = list(client.chat.completions.create(model=SCRIPTED_NAMES[0], messages=messages, temperature=0,
                                                 stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(delta.content or "" for delta in deltas) == "Four."
    for field_name in ("reasoning_content", "reasoning"):
        assert "".join(getattr(delta, field_name, None) or "" for delta in deltas) == "Hmm"


def test_aliases_answer_under_the_first_name_and_a_request_without_model_gets_the_served_one(scripted) -> None:
    client = openai.OpenAI(base_url=scripted.url, api_key="none", max_retries=0, timeout=HANG_SECONDS)
    assert [model.id for model in client.models.list().data] == list(SCRIPTED_NAMES)
    for name in SCRIPTED_NAMES:
        answer = client.completions.create(model=name, prompt="Hello", max_tokens=2, temperature=0)
        assert answer.model == SCRIPTED_NAMES[0] and answer.usage.completion_tokens == 2
    code, answer = post(scripted.url + "/completions", {"prompt": "Hello", "max_tokens": 2})
    assert code == 200 and answer["model"] == SCRIPTED_NAMES[0]
    with pytest.raises(openai.NotFoundError, match="qwen3-scripted"):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)


def test_a_request_without_max_tokens_stops_at_the_servers_default(scripted) -> None:
    code, answer = post(scripted.url + "/completions", {"model": "alias", "prompt": "Hello", "temperature": 0})
    assert code == 200 and answer["usage"]["completion_tokens"] == 6 and answer["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("flags", [["--default-max-tokens", "0"], ["--served-model-name", "a", "a"],
                                   ["--served-model-name", " "]])
def test_bad_names_and_default_max_tokens_are_one_line_naming_the_flag(env, flags) -> None:
    result = subprocess.run([sys.executable, "-m", "qwen_np", "serve", "--model", MODEL, "--port", "0", *flags],
                            cwd=ROOT, env=env, capture_output=True, timeout=HANG_SECONDS)
    assert result.returncode == 2 and result.stderr.decode().count("\n") == 1, result.stderr
    assert result.stderr.decode().startswith(f"error: {flags[0]}: ")


@pytest.mark.parametrize("flags", [("--lookup", "2"), ("--draft", MODEL, "--draft-tokens", "3")],
                         ids=["lookup", "draft"])
def test_a_speculating_servers_concurrent_greedy_streams_equal_the_plain_ones_with_usage(client, env, flags) -> None:
    plain = [chat(client, p, max_tokens=24, temperature=0).choices[0].message.content for p in PROMPTS]

    def stream(spec_client, prompt: str) -> tuple[str, object]:
        chunks = list(chat(spec_client, prompt, max_tokens=24, temperature=0, stream=True,
                           stream_options={"include_usage": True}))
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage

    with serving(env, MODEL, *flags) as speculating:
        spec_client = openai.OpenAI(base_url=speculating.url, api_key="none", max_retries=0, timeout=HANG_SECONDS)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            replies = [reply.result(timeout=HANG_SECONDS) for reply in [pool.submit(stream, spec_client, p) for p in PROMPTS]]
    assert [text for text, _ in replies] == plain
    for _, usage in replies:
        spec = usage.model_extra["speculative_decoding"]
        assert spec["target_steps"] * spec["tokens_per_step"] == pytest.approx(usage.completion_tokens, rel=1e-3)
        assert usage.completion_tokens_details.accepted_prediction_tokens == spec["accepted_tokens"]
    if flags[0] == "--draft":                           # the model drafting for itself: every guess is right
        assert all(usage.model_extra["speculative_decoding"]["acceptance_rate"] == 1.0 for _, usage in replies)
