"""`pip install .` (not editable) ships the bundled model: a wheel built from this tree, installed into a
fresh virtual environment, runs `python -m qwen_np generate "ROMEO:"` offline from an unrelated folder.

No network anywhere: the wheel is built without build isolation (by the setuptools already installed),
from a copy of the files it is made of (so no build/ or egg-info lands in the checkout); the venv sees
the site-packages of the interpreter running the tests (numpy and the other dependencies: a .pth file
names them, because `venv --system-site-packages` made from inside a venv would see only the base
interpreter's), and gets the wheel with --no-deps --no-index. ~10 s, most of it pip.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import BUNDLED, ROOT

pytestmark = pytest.mark.slow      # a wheel built and installed into a fresh virtual environment

# What the wheel is built from (MANIFEST.in says what an sdist adds for its tests; a wheel needs none of it).
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "NOTICE", "MANIFEST.in", "qwen_np", "weights", "docs")
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def run(*command: str | Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run([str(part) for part in command], cwd=cwd, env=env, capture_output=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr).decode()[-3000:]
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, source / name)
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--quiet",
        "--disable-pip-version-check", "--wheel-dir", out, source, cwd=source)
    built, = out.glob("qwen_np-*.whl")
    return built


def test_the_wheel_holds_every_module_the_bundled_model_serve_s_page_and_walkthrough_but_no_test_fixture(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {path.relative_to(ROOT).as_posix() for path in (ROOT / "qwen_np").rglob("*.py")}
    assert modules <= names, f"modules missing from the wheel (list the package in pyproject.toml): {modules - names}"
    assert {f"qwen_np/weights/{name}" for name in MODEL_FILES} <= names
    assert {f"qwen_np/weights/draft/{name}" for name in MODEL_FILES} <= names          # the bundled draft
    page = {path.relative_to(ROOT).as_posix() for path in (ROOT / "qwen_np" / "serving" / "web").iterdir()}
    assert page and page <= names, f"serve's page missing from the wheel (package-data): {page - names}"
    figures = {f"qwen_np/docs/figures/{path.name}" for path in (ROOT / "docs" / "figures").glob("*.png")}
    shipped = {name for name in names if name.startswith("qwen_np/docs/")}        # /docs/walkthrough's, nothing else
    assert figures and shipped == {"qwen_np/docs/walkthrough.md", "qwen_np/docs/glossary.md"} | figures
    assert zipfile.ZipFile(wheel).read("qwen_np/weights/model.safetensors") == (BUNDLED / "model.safetensors").read_bytes()
    assert not [name for name in names if name.startswith(("tests/", "weights/", "docs/")) or "LICENSE-tokenizer" in name]


def test_an_installed_wheel_generates_and_grades_exercises_offline_from_any_folder(wheel: Path, tmp_path: Path) -> None:
    venv, elsewhere = tmp_path / "venv", tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {name: value for name, value in os.environ.items() if name not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), PIP_DISABLE_PIP_VERSION_CHECK="1")
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=elsewhere, env=env)
    python = venv / "bin" / "python"
    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=elsewhere, env=env)
    # A path line in a .pth file is appended to sys.path without running that folder's own .pth files, so an
    # editable install of qwen_np there (its import hook) stays out of the venv.
    Path(purelib.stdout.decode().strip(), "tests_environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    # pip from those site-packages installs into the venv (its sys.prefix); --force-reinstall because they
    # may hold qwen_np too (an installed copy of some checkout), which the venv must not use.
    run(python, "-m", "pip", "install", "--no-deps", "--no-index", "--force-reinstall", "--quiet", wheel,
        cwd=elsewhere, env=env)

    where = run(python, "-c", "import qwen_np.cli as cli, qwen_np.files.checkpoint as checkpoint; "
                "from qwen_np.serving import docs; print(cli.__file__); print(checkpoint.bundled_model_path()); "
                "print(docs.docs_folder()); print(docs.rendered(docs.docs_folder() / 'walkthrough.md').body.count('<img'))",
                cwd=elsewhere, env=env).stdout.decode().splitlines()
    package = Path(where[0]).resolve().parent
    assert package.is_relative_to(venv.resolve()), f"imported {package}, not the venv's qwen_np"
    assert Path(where[1]).resolve() == package / "weights"
    assert Path(where[2]).resolve() == package / "docs" and int(where[3]) >= 10      # serve's walkthrough page, figures

    result = run(python, "-m", "qwen_np", "generate", "ROMEO:", "-n", "20", "-s", "0", cwd=elsewhere, env=env)
    assert result.stdout.decode().strip()
    err = result.stderr.decode()
    assert "trained on Shakespeare" in err and "new_tokens=" in err and "error" not in err
    assert sorted(path.name for path in elsewhere.iterdir()) == []          # it wrote nothing where it ran

    # The exercises' stubs and solutions are package data: start writes one here, check grades it and the solution.
    learner = tmp_path / "learner"
    learner.mkdir()
    run(python, "-m", "qwen_np", "exercises", "start", "23", cwd=learner, env=env)
    assert [path.name for path in learner.iterdir()] == ["e23_decoder_layer.py"]
    graded = subprocess.run([str(python), "-m", "qwen_np", "exercises", "check", "23"], cwd=learner, env=env,
                            capture_output=True, timeout=300)
    assert graded.returncode == 1 and b"exercises start 4` writes it" in graded.stdout   # its pieces not written yet
    assert b"all 1 right" in run(python, "-m", "qwen_np", "exercises", "check", "23", "--solution", cwd=learner, env=env).stdout
