"""What a new user meets first on the command line: `--help` that loads no NumPy, a command that loads only
what it needs, one spelling of each flag in every command (aliases kept), usage errors that point at the
command's own help, the bundled draft by name from any folder, `eval --compare` that prints everything or
nothing, `inspect`'s fit at the context it is given, and a model with a chat template made offline."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from qwen_np import cli
from qwen_np.cli import COMMANDS, build_parser, main
from qwen_np.commands.comparison import format_names
from qwen_np.core.config import preset
from qwen_np.engine.memory import candidate_plans
from qwen_np.inspection.report import inspect_report

ROOT = Path(__file__).resolve().parents[2]
SHORT_TEXT = "To be, or not to be, that is the question."      # 15 tokens: shorter than eval's window (256)


def loaded_after(env: dict[str, str], argv: list[str]) -> set[str]:
    """The heavy modules (NumPy, ml_dtypes) and command modules a fresh interpreter holds after main(argv)."""
    probe = ("import sys\nfrom qwen_np.cli import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
             "print('loaded:', *(m for m in sys.modules if m in ('numpy', 'ml_dtypes') or m.startswith('qwen_np.commands.')))"
             % argv)
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr.decode()
    return set(result.stdout.decode().splitlines()[-1].split()[1:])      # the help, then the probe's line


# --- Import cost: a command loads what it needs -------------------------------------------------------

@pytest.mark.parametrize("argv", [["--help"], ["--version"], []])
def test_the_top_level_help_version_and_usage_error_load_no_numpy_and_no_command(env, argv) -> None:
    assert loaded_after(env, argv) == set()


def test_building_the_parser_without_commands_loads_no_numpy(env) -> None:
    code = ("import sys\nfrom qwen_np.cli import build_parser\nbuild_parser(flags_of=[])\n"
            "print('numpy' in sys.modules, 'ml_dtypes' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, cwd=ROOT, timeout=120)
    assert result.stdout.decode().split() == ["False", "False"], result.stderr.decode()


@pytest.mark.parametrize("command, own", [("hardware", {"qwen_np.commands.hardware"}),
                                          ("inspect", {"qwen_np.commands.inspect", "qwen_np.commands.common"})])
def test_a_command_s_help_loads_its_own_module_and_not_the_others(env, command, own) -> None:
    loaded = loaded_after(env, [command, "--help"])
    assert {m for m in loaded if m.startswith("qwen_np.commands.")} == own
    if command == "hardware":                   # the machine's probes need no model code (nor its BF16 dtypes)
        assert "ml_dtypes" not in loaded


@pytest.mark.parametrize("argv", [["generate", "--help"], ["train", "--help"], ["serve", "--help"],
                                  ["precision", "--help"], ["eval", "--bogus"]])
def test_a_command_s_help_and_usage_error_load_no_ml_dtypes(env, argv) -> None:
    """ml_dtypes (most of a second to import) comes with the first BF16 or FP8 dtype (numerics.dtype_named),
    which neither the help nor a usage error asks for."""
    assert "ml_dtypes" not in loaded_after(env, argv)


def subcommands(parser) -> dict:
    return next(a for a in parser._actions if isinstance(a, cli.argparse._SubParsersAction)).choices


def test_the_full_parser_builds_every_command_as_its_own_run_does() -> None:
    every = subcommands(build_parser())          # what tools/ walk for the flags that exist
    assert list(every) == list(COMMANDS)
    for name, command in every.items():
        alone = subcommands(build_parser(flags_of=[name]))[name]
        dests = [action.dest for action in command._actions]
        assert len(dests) > 1 and dests == [action.dest for action in alone._actions], name


# --- One spelling: -c/--ctx-size everywhere (--context kept), formats space- or comma-separated -------

CONTEXT_COMMANDS = {"generate": [], "chat": [], "serve": [], "eval": [], "precision": [], "inspect": [],
                    "train": ["--out", "somewhere"]}


@pytest.mark.parametrize("command", CONTEXT_COMMANDS)
def test_every_command_spells_the_context_c_ctx_size_and_still_takes_context(command) -> None:
    parser = build_parser(flags_of=[command])
    values = [vars(parser.parse_args([command, *CONTEXT_COMMANDS[command], flag, "64"]))
              for flag in ("-c", "--ctx-size", "--context")]
    dest = "context" if command == "train" else "ctx_size"        # train's run settings call it context
    assert [v[dest] for v in values] == [64, 64, 64]


@pytest.mark.parametrize("command, flag", [("eval", "--compare"), ("precision", "--formats")])
def test_formats_are_taken_space_or_comma_separated_in_both_commands(command, flag) -> None:
    parser = build_parser(flags_of=[command])
    for words in (["bf16", "q8_0", "fp16"], ["bf16,q8_0,fp16"], ["bf16,q8_0", "fp16"], ["bf16, q8_0,", "fp16"]):
        args = parser.parse_args([command, flag, *words])
        assert format_names(getattr(args, flag.removeprefix("--"))) == ["bf16", "q8_0", "fp16"], words


@pytest.mark.parametrize("argv", [["eval", "--bogus"], ["inspect", "--preset", "qwen3-8b", "--no-such-flag"],
                                  ["generate", "hi", "--ctx-size"], ["precision", "--activations", "fp7"]])
def test_a_usage_error_of_a_command_points_at_that_command_s_help(argv, capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and err[0].endswith(f"(see `qwen-np {argv[0]} --help`)")


# --- The bundled draft by name ----------------------------------------------------------------------

@pytest.mark.slow
def test_the_bundled_draft_is_named_bundled_and_works_from_any_folder(env, tmp_path) -> None:
    def greedy(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "qwen_np", "generate", "--no-chat", "ROMEO:", "-n", "12",
                               "--temp", "0", *flags], cwd=tmp_path, env=env, capture_output=True, timeout=120)

    drafted, plain = greedy("--draft", "bundled"), greedy()
    assert drafted.returncode == plain.returncode == 0, drafted.stderr.decode()
    assert drafted.stdout == plain.stdout and drafted.stdout.strip()      # greedy: the same tokens
    assert " speculative=draft " in drafted.stderr.decode().splitlines()[-1]
    assert sorted(tmp_path.iterdir()) == []


# --- eval --compare: everything or nothing; --json one document --------------------------------------

@pytest.fixture
def short_text(tmp_path) -> Path:
    path = tmp_path / "short.txt"
    path.write_text(SHORT_TEXT)
    return path


@pytest.mark.slow
def test_eval_compare_on_a_text_shorter_than_a_window_compares_on_eval_s_own_window(short_text, capsys) -> None:
    assert main(["eval", "--text", str(short_text), "--compare", "bf16,q8_0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{short_text}: 15 tokens") and "context 256" in out[0]
    rows = [line.split()[0] for line in out[out.index(next(x for x in out if x.startswith("format"))) + 1:]]
    assert rows[:2] == ["bf16", "q8_0"] and "over 15 positions" in out[-1]


@pytest.mark.slow
def test_eval_json_with_compare_prints_exactly_one_json_document(short_text, capsys) -> None:
    assert main(["eval", "--text", str(short_text), "--compare", "bf16", "q8_0", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)            # the whole of stdout, or this raises
    assert document["tokens"] == 15 and list(document["compare"]) == ["bf16", "q8_0"]
    assert document["compare"]["bf16"]["positions"] == 15


def test_a_failing_comparison_prints_nothing_but_its_error_line(short_text, capsys, monkeypatch) -> None:
    from qwen_np.commands import evaluate
    from qwen_np.errors import QwenNPError

    def refuse(*args: object) -> None:
        raise QwenNPError("--compare: q4_0 cannot hold this model")

    monkeypatch.setattr(evaluate, "format_comparison", refuse)
    assert main(["eval", "--text", str(short_text), "--compare", "q4_0"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.splitlines() == ["error: --compare: q4_0 cannot hold this model"]


# --- inspect: does it fit, at the context given -------------------------------------------------------

def test_inspect_s_fit_on_this_machine_uses_the_context_it_is_given() -> None:
    config = preset("qwen3-32b")
    short, default = (inspect_report(config, 7, "32b", 1e10, context=n)["this_machine"] for n in (1024, None))
    assert (short["context_tokens"], default["context_tokens"]) == (1024, 4096)
    # the plans load_model would weigh for a 1,024-token run, on the memory the report saw
    expected = candidate_plans(config, 1024, 2, short["available_bytes"])
    for mode, plan in short["plans"].items():
        assert (plan["needs_bytes"], plan["fits"]) == (expected[mode].total_bytes, expected[mode].fits), mode
        assert plan["needs_bytes"] < default["plans"][mode]["needs_bytes"], mode


# --- A model with a chat template, offline -----------------------------------------------------------

@pytest.mark.slow
def test_the_readme_recipe_makes_a_model_that_chats(env, tmp_path) -> None:
    readme = (ROOT / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, flags=re.DOTALL) if "make_bundled_model.py" in b)
    folder = tmp_path / "qwen3-random"
    for line in block.strip().splitlines():
        command = line.split("  #")[0].strip().replace("qwen3-random", shlex.quote(str(folder)))
        command = re.sub(r"^python ", shlex.quote(sys.executable) + " ", command)
        chats = " chat " in command
        if chats:
            command += " -n 4"                 # four tokens of the random model's reply are enough
        result = subprocess.run(command, shell=True, cwd=ROOT, env=env, capture_output=True, timeout=300,
                                input=b"Hello\n" if chats else None)
        assert result.returncode == 0, (command, result.stderr.decode())
    assert chats and result.stdout.strip(), "the recipe's last line chats"
