"""The servers the serving tests share, each started once per module that asks for it (always stopped): `running`,
`serve` of the random-weight Qwen3 (test_serve.MODEL), and `scripted_server`, the same over the scripted model
(scripted_serve.py: its replies are what a conversation's first user message scripts), with the official
`openai` client on each (`client`, `scripted`). A module that needs a server of its own (other flags, another
client) defines its fixture under the same name, which overrides these.

The server helpers are imported when a fixture runs: test_serve skips a module without openai, starlette or
uvicorn, which a module that asks for a server has already required.
"""

from __future__ import annotations

import pytest

from tests.conftest import HANG_SECONDS


def _client(url: str):
    import openai

    return openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=HANG_SECONDS)


@pytest.fixture(scope="module")
def running(env: dict[str, str]):
    """A server of the random-weight Qwen3 on 127.0.0.1 and an ephemeral port; stopped when the module ends."""
    from tests.serving.test_serve import MODEL, serving

    with serving(env, MODEL) as server:
        yield server


@pytest.fixture(scope="module")
def client(running):
    return _client(running.url)


@pytest.fixture(scope="module")
def scripted_server(env: dict[str, str]):
    """The real `serve` of the random-weight Qwen3 over the scripted model's logits (scripted_serve.py)."""
    from tests.serving.test_serve import MODEL, ROOT, serving

    with serving(env, MODEL, launcher=(str(ROOT / "tests" / "serving" / "scripted_serve.py"),)) as server:
        yield server


@pytest.fixture(scope="module")
def scripted(scripted_server):
    return _client(scripted_server.url)
