"""Every ```python block of README.md runs as it is written, offline, from a folder outside the checkout
(so a block cannot lean on a relative path that works only in the repository): a README example that no
longer runs is a failing test, not a reader's surprise.

A block that talks to `serve` over the OpenAI or Anthropic client gets a server of the Qwen3-format fixture (it has
Qwen3's chat template) under the model name the block asks for; only the block's address is changed, to
the server's ephemeral port.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import HANG_SECONDS, QWEN3_RANDOM, ROOT

README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCKS = [(README.count("\n", 0, found.start()) + 2, found[1])        # (the first code line's number, the code)
          for found in re.finditer(r"^```python\n(.*?)^```$", README, re.MULTILINE | re.DOTALL)]
SERVE_URL = "http://127.0.0.1:8000"             # serve's default address, which a client block is written for (the
                                                # openai client's base_url adds /v1, the anthropic client's does not)
LOCAL = [(line, code) for line, code in BLOCKS if SERVE_URL not in code]
CLIENTS = [(line, code) for line, code in BLOCKS if SERVE_URL in code]


def run_block(code: str, env: dict[str, str], folder: Path) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-c", code], cwd=folder, env=env, capture_output=True, text=True,
                            timeout=HANG_SECONDS)
    assert result.returncode == 0, f"{code}\n{result.stderr[-3000:]}"
    return result


def test_the_readme_has_python_examples_of_the_library_and_of_the_client() -> None:
    assert len(LOCAL) >= 2 and len(CLIENTS) >= 1, [line for line, _ in BLOCKS]


@pytest.mark.slow
@pytest.mark.parametrize("code", [code for _, code in LOCAL], ids=[f"README.md:{line}" for line, _ in LOCAL])
def test_a_python_example_of_the_readme_runs_on_the_bundled_model(code: str, env, tmp_path: Path) -> None:
    run_block(code, env, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("code", [code for _, code in CLIENTS], ids=[f"README.md:{line}" for line, _ in CLIENTS])
def test_a_client_example_of_the_readme_runs_against_serve(code: str, env, tmp_path: Path) -> None:
    pytest.importorskip("anthropic" if "from anthropic" in code else "lm_eval" if "import lm_eval" in code else "openai")
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from tests.serving.test_serve import serving

    names = set(re.findall(r'\bmodel="([^"]+)"', code)) | set(re.findall(r'[",]model=([^,"]+)', code))  # lm_eval's model_args
    assert len(names) == 1, f"one model name per client example, not {names}"
    flags = ("--served-model-name", *names, "--default-max-tokens", "16")     # a reply without max_tokens stays short
    with serving(env, str(QWEN3_RANDOM), *flags) as running:
        run_block(code.replace(SERVE_URL, running.url.removesuffix("/v1")), env, tmp_path)


def test_the_readme_documents_constrained_generation_and_installs_only_extras_that_exist() -> None:
    """generate's flags that need an extra (their help names it) are in the README with that extra, and
    every extra an install line of the README names is one pyproject.toml has."""
    import argparse
    import tomllib

    from qwen_np.cli import build_parser

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installed = {name for found in re.findall(r'pip install -e "\.\[([\w,-]+)\]"', README) for name in found.split(",")}
    assert installed and installed <= set(extras), installed - set(extras)
    generate = next(a for a in build_parser(flags_of=["generate"])._actions
                    if isinstance(a, argparse._SubParsersAction)).choices["generate"]
    needing = {option: re.search(r"qwen_np\[(\w+)\]", action.help)[1]
               for action in generate._actions if action.help and "qwen_np[" in action.help
               for option in action.option_strings}
    assert "--json-schema" in needing
    for option, extra in {**needing, "--grammar": needing["--json-schema"]}.items():   # --grammar: as --json-schema
        assert f"`{option} FILE`" in README and f'".[{extra}]"' in README, option
