"""Using a LoRA adapter without merging it (qwen_np/files/adapter.py, core/adapters.py): PEFT's folder read, refused
by name where it asks for what qwen_np does not do; `generate --lora` equal to peft's model and to the merged one;
every memory kind and the fast path; a batch whose rows use different adapters equal to each row alone; and
`serve --lora NAME=DIR` answering as each adapter and as the base, concurrent requests sharing one batch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import HANG_SECONDS, QWEN3_RANDOM
from qwen_np.core.sampling import SamplingParams
from qwen_np.engine.loading import attach_adapter, load_model
from qwen_np.errors import QwenNPError
from qwen_np.files.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_adapter
from qwen_np.files.tokenizer import Tokenizer
from qwen_np.generation.batching import BatchGenerator, Request
from qwen_np.generation.generate import generate
from qwen_np.training import lora
from tests.reference.logit_match import assert_logits_match

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Once upon a time"
NEW_TOKENS = 12
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def own_adapter(folder: Path, rank: int, targets: tuple[str, ...], seed: int, alpha: float | None = None) -> Path:
    """An adapter on QWEN3_RANDOM written by qwen_np's save_adapter, B moved off zero (a fresh one changes nothing)."""
    model = load_model(QWEN3_RANDOM, memory="fp32", fast=False)
    lora.add_adapters(model, rank=rank, alpha=alpha, targets=targets, seed=seed)
    rng = np.random.default_rng(seed)
    for name, p in lora.adapter_parameters(model).items():
        if ".lora_B." in name:
            p[...] = rng.standard_normal(p.shape).astype(np.float32) * 0.5
    return lora.save_adapter(folder, model, base=str(QWEN3_RANDOM))


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two different adapters of QWEN3_RANDOM: attention-only rank 4, and MLP-and-value rank 8."""
    folder = tmp_path_factory.mktemp("adapters")
    return {"attn": own_adapter(folder / "attn", 4, ("q_proj", "k_proj", "o_proj"), seed=11),
            "mlp": own_adapter(folder / "mlp", 8, ("v_proj", "gate_proj", "up_proj", "down_proj"), seed=12, alpha=4.0)}


@pytest.fixture(scope="module")
def prompt_ids() -> np.ndarray:
    return np.array(Tokenizer.from_folder(QWEN3_RANDOM).encode(PROMPT))


# --- reading PEFT's folder -----------------------------------------------------------------------

def rewritten(source: Path, folder: Path, **settings: object) -> Path:
    """A copy of an adapter folder with some adapter_config.json fields changed."""
    shutil.copytree(source, folder)
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    (folder / ADAPTER_CONFIG).write_text(json.dumps({**config, **settings}))
    return folder


@pytest.mark.parametrize("field, value", [("use_dora", True), ("bias", "lora_only"), ("fan_in_fan_out", True),
                                          ("modules_to_save", ["lm_head"]), ("rank_pattern", {"q_proj": 8}),
                                          ("alpha_pattern", {"q_proj": 2}), ("lora_bias", True),
                                          ("peft_type", "IA3"), ("r", 0), ("lora_alpha", "x"),
                                          ("target_modules", ["q_proj", "lm_head"]), ("use_qalora", True),
                                          ("alora_invocation_tokens", [1, 2])])
def test_what_an_adapter_asks_for_beyond_lora_is_refused_naming_the_file_and_field(adapters, tmp_path, field,
                                                                                   value) -> None:
    folder = rewritten(adapters["attn"], tmp_path / "bad", **{field: value})
    config = load_model(QWEN3_RANDOM, memory="bf16").config
    with pytest.raises(QwenNPError, match=rf"^{folder / ADAPTER_CONFIG}: {field}: "):
        read_adapter(folder, config)


def test_a_tensor_that_does_not_fit_the_model_is_named(adapters, tmp_path) -> None:
    from safetensors.numpy import load_file, save_file

    config = load_model(QWEN3_RANDOM, memory="bf16").config
    name = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
    for change, why in [(lambda t: t.update({name: t[name][:, :-1]}), "has shape"),
                        (lambda t: t.update({name.replace(".lora_A.", ".lora_magnitude_vector."): t[name][0]}),
                         "is not a LoRA matrix"),
                        (lambda t: t.pop(name), "has no lora_A"),
                        (lambda t: t.update({name: np.full_like(t[name], np.nan)}), "NaN")]:
        folder = tmp_path / why.replace(" ", "_")
        shutil.copytree(adapters["attn"], folder)
        tensors = load_file(str(folder / ADAPTER_WEIGHTS))
        change(tensors)
        save_file(tensors, str(folder / ADAPTER_WEIGHTS))
        with pytest.raises(QwenNPError, match=rf"^{folder / ADAPTER_WEIGHTS}: .*{why}"):
            read_adapter(folder, config)


def test_peft_s_named_variant_and_rslora_scale_are_read(adapters, tmp_path) -> None:
    """lora_A.default.weight reads as lora_A.weight; use_rslora scales by alpha / sqrt(r), not alpha / r."""
    from safetensors.numpy import load_file, save_file

    config = load_model(QWEN3_RANDOM, memory="bf16").config
    plain = read_adapter(adapters["mlp"], config)
    folder = rewritten(adapters["mlp"], tmp_path / "named", use_rslora=True)
    tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    save_file({name.replace(".weight", ".default.weight"): t for name, t in tensors.items()}, str(folder / ADAPTER_WEIGHTS))
    named = read_adapter(folder, config, "named")
    assert named.name == "named" and plain.name == "mlp" and plain.scale == 4.0 / 8 and named.scale == 4.0 / 8 ** 0.5
    assert named.matrices.keys() == plain.matrices.keys() and plain.rank == 8
    assert all(np.array_equal(a, b) for key in plain.matrices for a, b in zip(named.matrices[key], plain.matrices[key]))
    assert named.digest != plain.digest


@pytest.mark.parametrize("field, value", [("use_rslora", "yes"), ("use_rslora", 1), ("use_dora", 0),
                                          ("fan_in_fan_out", 0), ("layers_to_transform", "0"),
                                          ("layers_to_transform", [True]), ("layers_pattern", "h"),
                                          ("exclude_modules", "q_.*")])
def test_a_field_of_the_wrong_json_type_is_refused_naming_it(adapters, tmp_path, field, value) -> None:
    """use_rslora: "yes" was read as true (and 0 as use_dora's false): booleans are JSON booleans."""
    folder = rewritten(adapters["attn"], tmp_path / "bad", **{field: value})
    config = load_model(QWEN3_RANDOM, memory="bf16").config
    with pytest.raises(QwenNPError, match=rf"^{folder / ADAPTER_CONFIG}: {field}: "):
        read_adapter(folder, config)


@pytest.mark.parametrize("settings, kept", [
    ({"target_modules": ["q_proj"]}, {(i, "q_proj") for i in range(2)}),
    ({"target_modules": ["q_proj", "o_proj"], "exclude_modules": ["model.layers.0.self_attn.o_proj"]},
     {(0, "q_proj"), (1, "q_proj"), (1, "o_proj")}),
    ({"target_modules": ["k_proj"], "layers_to_transform": 1}, {(1, "k_proj")}),
    ({"target_modules": ["model.layers.0.self_attn.k_proj", "o_proj"], "layers_to_transform": [1]},
     {(0, "k_proj"), (1, "o_proj")})])
def test_tensors_of_modules_the_config_does_not_target_are_left_out_as_peft_leaves_them(adapters, tmp_path, settings,
                                                                                         kept) -> None:
    """A ["q_proj"] adapter holding k and o tensors applies q alone, as peft's check_target_module_exists has it
    (a module by its name or a dotted tail, exclude_modules, layers_to_transform; an exact name takes any layer)."""
    folder = rewritten(adapters["attn"], tmp_path / "some", **settings)
    config = load_model(QWEN3_RANDOM, memory="bf16").config
    assert set(read_adapter(folder, config).matrices) == kept


def test_an_adapter_whose_tensors_outside_its_targets_are_left_out_gives_peft_s_logits(tmp_path, prompt_ids) -> None:
    """peft itself: q_proj and gate_proj tensors in the file, adapter_config.json saying ["gate_proj"]."""
    from tests.reference import hf_reference  # noqa: F401  (sets USE_HUB_KERNELS before transformers loads)

    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")

    def base() -> object:
        return transformers.Qwen3ForCausalLM.from_pretrained(QWEN3_RANDOM, dtype=torch.float32,
                                                             attn_implementation="eager").eval()

    tuned = peft.get_peft_model(base(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "gate_proj"],
                                                        lora_dropout=0.0))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    tuned.save_pretrained(tmp_path / "both")
    folder = rewritten(tmp_path / "both", tmp_path / "gate", target_modules=["gate_proj"])
    with torch.inference_mode():
        theirs = peft.PeftModel.from_pretrained(base(), folder).eval()(
            input_ids=torch.from_numpy(prompt_ids)[None]).logits[0].numpy()
    model = load_model(QWEN3_RANDOM)
    attach_adapter(model, read_adapter(folder, model.config))
    assert_logits_match(model.forward(prompt_ids), theirs, "the gate_proj-only adapter against peft's reading of it")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qwen_np", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=HANG_SECONDS, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.slow
def test_a_bad_lora_folder_is_one_line_and_exit_2(adapters, tmp_path) -> None:
    folder = rewritten(adapters["attn"], tmp_path / "dora", use_dora=True)
    for command in ("generate", "chat"):
        prompt = ["Hi"] if command == "generate" else []
        result = run_cli(command, "--model", str(QWEN3_RANDOM), "--lora", str(folder), "-n", "2", *prompt)
        assert result.returncode == 2 and result.stderr.strip().splitlines() == [
            f"error: {folder / ADAPTER_CONFIG}: use_dora: True is not supported (only False)"], result.stderr
    result = run_cli("generate", "--model", str(QWEN3_RANDOM), "--lora", str(tmp_path / "none"), "Hi")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith(f"error: --lora: {tmp_path / 'none'} does not exist"), result.stderr


# --- one adapter, every row --------------------------------------------------------------------------

@pytest.mark.parametrize("memory", ["fp32", "auto", "bf16", "int8", "q8_0", "q4_0"])
def test_an_attached_adapter_leaves_the_base_untouched_and_the_fast_path_agrees_on_every_memory_kind(
        adapters, prompt_ids, memory) -> None:
    """Unmerged: the base's weights are the same objects after; the fast path gives the readable path's logits
    (prefill, and a cached decode step); on an FP32-exact base (fp32, bf16), the merged model's."""
    merged = load_model(QWEN3_RANDOM, memory="fp32", fast=False)
    attach_adapter(merged, read_adapter(adapters["mlp"], merged.config))
    merged_logits = merged.forward(prompt_ids)                # Adapted weights of an FP32 base: x (W + s B A)^T in effect
    logits = {}
    for fast in (True, False):
        model = load_model(QWEN3_RANDOM, memory=memory, fast=fast)
        base_logits = model.forward(prompt_ids)
        bases = [getattr(layer, key) for layer in model.layers for key in ("q_proj", "down_proj")]
        attach_adapter(model, read_adapter(adapters["mlp"], model.config))
        kept = [weight for layer in model.layers for weight in (layer.q_proj, layer.down_proj.base)]
        assert all(now is then for now, then in zip(kept, bases))        # q_proj not adapted; down_proj's base kept
        logits[fast] = model.forward(prompt_ids)
        assert np.abs(logits[fast] - base_logits).max() > 0.1, "the adapter changes the logits"
        cache = model.new_cache(32)
        model.forward(prompt_ids[:-1], cache)
        assert_logits_match(model.forward(prompt_ids[-1:], cache), logits[fast][-1:], f"{memory} decode, fast={fast}")
    assert_logits_match(logits[True], logits[False], f"{memory}: fast path against the readable one")
    if memory in ("fp32", "auto", "bf16"):
        assert_logits_match(logits[True], merged_logits, f"{memory}: the adapter beside the base, as merged")


# --- several adapters in one batch ------------------------------------------------------------------

@pytest.mark.parametrize("memory, fast", [("fp32", True), ("auto", True), ("fp32", False), ("q8_0", True)])
def test_rows_of_different_adapters_in_one_pass_each_get_what_they_get_alone(adapters, prompt_ids, memory, fast) -> None:
    model = load_model(QWEN3_RANDOM, memory=memory, fast=fast)
    attn, mlp = (read_adapter(adapters[name], model.config) for name in ("attn", "mlp"))
    rows = [(prompt_ids, attn), (prompt_ids, None), (prompt_ids[:7], mlp), (prompt_ids[2:], attn)]
    alone = []
    for ids, adapter in rows:
        one = load_model(QWEN3_RANDOM, memory=memory, fast=fast)
        if adapter is not None:
            attach_adapter(one, adapter)
        cache = one.new_cache(32)
        alone.append((one.forward(ids[:-1], cache), one.forward(ids[-1:], cache)))
    caches = [model.new_cache(32) for _ in rows]
    prefill = model.forward_batch([ids[:-1] for ids, _ in rows], caches, adapters=[a for _, a in rows])
    step = model.forward_batch([ids[-1:] for ids, _ in rows], caches, adapters=[a for _, a in rows])
    ends = np.cumsum([len(ids) - 1 for ids, _ in rows])
    for b, (prompt_part, last) in enumerate(alone):
        assert_logits_match(prefill[ends[b] - len(prompt_part):ends[b]], prompt_part, f"row {b}'s prefill")
        assert_logits_match(step[b:b + 1], last, f"row {b}'s decode step")


@pytest.mark.slow
def test_the_batch_generator_runs_each_rows_adapter_and_never_shares_cached_blocks_across_adapters(adapters) -> None:
    """Greedy rows of the base and of two adapters together give generate()'s text with that adapter attached;
    a row reuses prefix-cache blocks only of rows of its own adapter."""
    tok = Tokenizer.from_folder(QWEN3_RANDOM)
    model = load_model(QWEN3_RANDOM)
    attn, mlp = (read_adapter(adapters[name], model.config) for name in ("attn", "mlp"))
    prompt = tok.encode("A prompt long enough to fill two whole blocks of the prefix cache. " * 3)
    assert len(prompt) > 33
    greedy = SamplingParams(temperature=0)
    expected = {}
    for adapter in (None, attn, mlp):
        alone = load_model(QWEN3_RANDOM)
        if adapter is not None:
            attach_adapter(alone, adapter)
        expected[adapter] = [event.token_id for event in generate(alone, tok, prompt, greedy, NEW_TOKENS)]
    assert len({tuple(ids) for ids in expected.values()}) == 3, "each adapter changes the greedy text"
    generator = BatchGenerator(model, tok, max_batch=6)
    order = [None, attn, mlp, mlp, attn, None]
    rows = [generator.submit(Request(prompt, greedy, NEW_TOKENS, adapter=adapter)) for adapter in order]
    while not generator.idle:
        generator.step()
    assert max(generator.batch_sizes) == len(order)                  # every row in one pass
    assert [row.generated for row in rows] == [expected[adapter] for adapter in order]
    # The first row of each adapter reads the prompt; a later one of the same adapter waits for it and takes
    # its full blocks (BatchGenerator.follows), never a row of another adapter's.
    full = len(prompt) // 16 * 16
    assert [row.cached_tokens for row in rows] == [0, 0, 0, full, full, full]
    again = [generator.submit(Request(prompt, greedy, NEW_TOKENS, adapter=adapter)) for adapter in (attn, None)]
    while not generator.idle:
        generator.step()
    assert [row.generated for row in again] == [expected[attn], expected[None]]
    assert all(row.cached_tokens == len(prompt) // 16 * 16 for row in again)    # its own adapter's blocks
    fresh = load_model(QWEN3_RANDOM)
    lone = BatchGenerator(fresh, tok, max_batch=2)
    first = lone.submit(Request(prompt, greedy, NEW_TOKENS))
    while not lone.idle:
        lone.step()
    other = lone.submit(Request(prompt, greedy, NEW_TOKENS, adapter=attn))
    while not lone.idle:
        lone.step()
    assert first.generated == expected[None] and other.generated == expected[attn]
    assert other.cached_tokens == 0, "the base's blocks hold the base's keys, not the adapter's"


# --- against peft itself ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def peft_made(tmp_path_factory: pytest.TempPathFactory, prompt_ids: np.ndarray) -> dict[str, dict]:
    """Adapters made by peft itself on transformers' Qwen3 of QWEN3_RANDOM (random non-zero A and B), each saved by
    save_pretrained, with peft's greedy tokens and logits, and its merge_and_unload() saved as a checkpoint."""
    from tests.reference import hf_reference  # noqa: F401  (sets USE_HUB_KERNELS before transformers loads)

    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("peft")
    made = {}
    settings = {"plain": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]),
                "rslora": dict(r=8, lora_alpha=4, use_rslora=True, target_modules="all-linear")}
    for seed, (name, lora_settings) in enumerate(settings.items()):
        base = transformers.Qwen3ForCausalLM.from_pretrained(QWEN3_RANDOM, dtype=torch.float32,
                                                             attn_implementation="eager").eval()
        tuned = peft.get_peft_model(base, peft.LoraConfig(lora_dropout=0.0, **lora_settings)).eval()
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for parameter_name, p in tuned.named_parameters():
                if "lora_" in parameter_name:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
        tuned.save_pretrained(out / name)
        ids = torch.from_numpy(prompt_ids)[None]
        with torch.inference_mode():
            logits = tuned(input_ids=ids).logits[0].numpy()
            greedy = tuned.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                                    pad_token_id=151643, eos_token_id=None)[0, ids.shape[1]:].tolist()
        tuned.merge_and_unload().save_pretrained(out / f"{name}-merged")
        for file in TOKENIZER_FILES:
            shutil.copy(QWEN3_RANDOM / file, out / f"{name}-merged" / file)
        made[name] = {"folder": out / name, "merged": out / f"{name}-merged", "logits": logits, "greedy": greedy}
    return made


def generate_json(*flags: str) -> dict:
    result = run_cli("generate", "--temperature", "0", "-n", str(NEW_TOKENS), "--no-chat", "--json", *flags, PROMPT)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain", "rslora"])
def test_generate_lora_with_peft_s_own_adapter_gives_peft_s_greedy_text_and_the_merged_model_s(peft_made, name,
                                                                                              prompt_ids) -> None:
    made = peft_made[name]
    base = generate_json("--model", str(QWEN3_RANDOM))["token_ids"]
    tuned = generate_json("--model", str(QWEN3_RANDOM), "--lora", str(made["folder"]))
    assert tuned["finish_reason"] == "length" and tuned["token_ids"] == made["greedy"]
    assert tuned["token_ids"] != base, "the adapter must change the greedy text for this test to mean anything"
    assert generate_json("--model", str(made["merged"]))["token_ids"] == made["greedy"]
    model = load_model(QWEN3_RANDOM)
    attach_adapter(model, read_adapter(made["folder"], model.config))
    ours = model.forward(prompt_ids)
    assert_logits_match(ours, made["logits"], f"{name}: qwen_np with the adapter against peft")
    assert_logits_match(ours, load_model(made["merged"]).forward(prompt_ids), f"{name}: against the merged model")


# --- serve --lora ----------------------------------------------------------------------------------

def test_the_servers_default_kv_budget_leaves_the_adapters_their_bytes(adapters) -> None:
    from qwen_np.serving.launch import default_kv_memory

    model = load_model(QWEN3_RANDOM)
    held = sum(read_adapter(folder, model.config).nbytes for folder in adapters.values())
    assert held > 0 and model.plan is not None
    unbounded = 2 ** 62
    assert default_kv_memory(model, unbounded, None, held) == max(model.plan.room_for_kv_cache - held, 0)
    assert default_kv_memory(model, unbounded) == max(model.plan.room_for_kv_cache, 0)


@pytest.mark.slow
def test_serve_answers_as_each_adapter_and_as_the_base_with_rows_of_all_three_in_one_batch(adapters, tmp_path) -> None:
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from tests.serving.test_serve import get, health, post, serving

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": str(ROOT)}
    base_name = str(QWEN3_RANDOM)
    prompts = {None: ["The quick brown fox", "1 2 3 4"], "attn": ["Hello", "Why is the sky blue?"],
               "mlp": ["def main():", "Bonjour"]}
    expected = {}
    for name, texts in prompts.items():
        lora_flags = ["--lora", str(adapters[name])] if name else []
        flags = [flag for text in texts for flag in ("-p", text)]
        result = run_cli("generate", "--model", base_name, *lora_flags, "--temperature", "0", "-n", "16", "--no-chat",
                         "--json", *flags)
        assert result.returncode == 0, result.stderr
        expected[name] = [json.loads(line)["text"] for line in result.stdout.splitlines()]
    assert len({text for texts in expected.values() for text in texts}) == 6
    with serving(env, base_name, "--lora", f"attn={adapters['attn']}", "--lora", f"mlp={adapters['mlp']}") as running:
        assert any(line.startswith(f"LoRA adapters over {base_name}: attn (rank 4), mlp (rank 8)") for line in running.start)
        code, listed = get(running.url + "/models")
        assert code == 200 and [(m["id"], m.get("parent")) for m in listed["data"]] == [
            (base_name, None), ("attn", base_name), ("mlp", base_name)]
        code, answer = post(running.url + "/completions", {"model": "nope", "prompt": "Hi", "max_tokens": 2})
        assert code == 404 and answer["error"]["param"] == "model" and "`attn`" in answer["error"]["message"]
        client = openai.OpenAI(base_url=running.url, api_key="none", max_retries=0, timeout=HANG_SECONDS)
        jobs = [(name, text) for name, texts in prompts.items() for text in texts]
        started = threading.Barrier(len(jobs) + 1, timeout=HANG_SECONDS)

        def stream(name: str | None, text: str) -> tuple[str, set[str]]:
            pieces, models, waited = [], set(), False
            for chunk in client.completions.create(model=name or base_name, prompt=text, max_tokens=16, temperature=0,
                                                   stream=True):
                pieces.append(chunk.choices[0].text)
                models.add(chunk.model)
                if not waited and any(pieces):
                    started.wait()                   # every client has its first token: all rows are in
                    waited = True
                    started.wait()                   # hold until the batch has been looked at
            return "".join(pieces), models

        with ThreadPoolExecutor(len(jobs)) as pool:
            replies = [pool.submit(stream, name, text) for name, text in jobs]
            started.wait()
            together = health(running.url)["running"]
            started.wait()
            answers = [reply.result(timeout=HANG_SECONDS) for reply in replies]
        assert together == len(jobs)
        assert [text for text, _ in answers] == [text for name in prompts for text in expected[name]]
        assert [models for _, models in answers] == [{name or base_name} for name, _ in jobs]
        whole = client.completions.create(model="mlp", prompt="def main():", max_tokens=16, temperature=0)
        assert whole.model == "mlp" and whole.choices[0].text == expected["mlp"][0]
