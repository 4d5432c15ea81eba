"""The page `serve` shows at /: the explorer's endpoints over HTTP, then the page itself in a real browser
(Debian's chromium driven by Playwright's Python client, the `browser` extra), against servers on loopback.

What the page promises: its numbers are qwen_np's (the tokenizer's tokens, the trace's statistics, the
attention weights of inspection.attention_weights, the tokens sampling.py keeps, the API's greedy text),
read here from the page's own data (window.qwenExplorer), not from pixels; the endpoints keep serve's rules;
and the page reads at 1280x800 and on a 390-pixel-wide phone. The browser tests skip, saying why, where
chromium or playwright is missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from tests.reference.logit_match import RELATIVE_TOLERANCE, max_relative_error

from qwen_np.serving import docs, explorer
from qwen_np import load_model
from qwen_np.serving.explorer import filter_stages
from qwen_np.inspection import STEPS, attention_weights, lens_probabilities
from qwen_np.inspection.steps import source_line
from qwen_np.inspection.trace import statistics
from qwen_np.core.sampling import SamplingParams, apply_repetition_penalty, warp
from qwen_np.files.model_files import folder_generation_defaults
from qwen_np.files.tokenizer import Tokenizer
from qwen_np.generation.generate import generate, resolve_sampling
from tests.conftest import HANG_SECONDS
from tests.serving.test_serve import ROOT, MODEL, assert_openai_error, get, post, serving

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

BUNDLED = "weights"                       # the bundled model, named by its folder relative to ROOT
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Headless, and nothing that reaches out: the browser must work offline, as the page does.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
# é is two byte-level tokens here, neither a whole character (and, unlike CJK, in the fonts Debian's chromium has).
PROMPT = "ROMEO: café, soft"
SCREENSHOTS_ENV = "QWEN_NP_SCREENSHOTS"        # a folder for the screenshots (docs/figures for the README's)


@pytest.fixture(scope="module")
def serve_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The servers' environment: offline, a Hub cache of their own, this checkout's qwen_np."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path_factory.mktemp("hf_home")), "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def bundled(serve_env: dict[str, str]):
    with serving(serve_env, BUNDLED) as server:
        yield server.url.removesuffix("/v1")


@pytest.fixture(scope="module")
def qwen(serve_env: dict[str, str]):
    with serving(serve_env, MODEL) as server:
        yield server.url.removesuffix("/v1")


@pytest.fixture(scope="module")
def model():
    return load_model(ROOT / BUNDLED)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_folder(ROOT / BUNDLED)


def ask(base: str, path: str, model: str = BUNDLED, **body: object) -> tuple[int, dict]:
    return post(base + path, {"model": model, **body})


# --- the library pieces the page shows ------------------------------------------------------------------

@pytest.mark.parametrize("step", STEPS, ids=[step.name for step in STEPS])
def test_every_step_points_at_the_line_of_model_or_layers_that_computes_it(step) -> None:
    file, line, code = source_line(step)
    text = (ROOT / "qwen_np" / file).read_text().splitlines()[line - 1]
    assert file in ("core/model.py", "core/layers.py") and text.strip() == code and "=" in code


@pytest.mark.parametrize("folder", [BUNDLED, MODEL])
def test_a_token_s_bytes_join_to_the_text_even_where_one_holds_part_of_a_character(folder: str) -> None:
    tokenizer = Tokenizer.from_folder(ROOT / folder)
    text = "ROMEO: 猫 é\n  x" + ("<|im_end|>" if folder == MODEL else "")
    ids = tokenizer.encode(text)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode()
    assert all(tokenizer.token_bytes(i).decode(errors="replace") == tokenizer.decode([i]) for i in range(2000))


@pytest.mark.parametrize("settings", [{"temperature": 0.7, "top_k": 5}, {"temperature": 1.3, "top_p": 0.8, "min_p": 0.05},
                                      {"temperature": 0}, {"temperature": 1.0, "repetition_penalty": 1.5}])
def test_the_filter_stages_end_in_the_distribution_next_token_draws_from(settings: dict) -> None:
    logits, context = np.random.default_rng(0).normal(size=300).astype(np.float32) * 3, [1, 5, 7]
    params = SamplingParams(**settings)
    stages = filter_stages(logits, params, context)
    penalised = apply_repetition_penalty(logits, context, params.repetition_penalty)
    if params.greedy:
        assert np.flatnonzero(np.isfinite(stages[-1][1])).tolist() == [int(np.argmax(penalised))]
    else:
        np.testing.assert_array_equal(stages[-1][1], warp(penalised, params))


# --- the endpoints ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_analyze_gives_the_tokenizer_s_tokens_the_trace_s_statistics_and_the_lens(bundled, model, tokenizer) -> None:
    status, answer = ask(bundled, "/explorer/analyze", prompt=PROMPT)
    assert status == 200, answer
    ids = tokenizer.encode(PROMPT)
    assert [t["id"] for t in answer["tokens"]] == ids
    assert [t["text"] for t in answer["tokens"] if t["text"] is None] and answer["text"] == PROMPT
    seen: list[tuple[str, tuple[float, ...]]] = []
    model.forward(ids, trace=lambda name, value: seen.append((name, statistics(value))))
    assert [row["name"] for row in answer["steps"]] == [name for name, _ in seen]
    for row, (_, (mean, std, largest, masked)) in zip(answer["steps"], seen):
        assert row["masked"] == masked
        np.testing.assert_allclose([row["mean"], row["std"], row["max_abs"]], [mean, std, largest], rtol=1e-5, atol=1e-7)
    labels, lens, _ = lens_probabilities(model, ids)
    assert [row["label"] for row in answer["lens"]] == labels
    assert [[t["id"] for t in row["top"]] for row in answer["lens"]] == np.argsort(-lens, axis=1)[:, :explorer.LENS_TOP].tolist()


@pytest.mark.slow
def test_the_explorer_keeps_serve_s_rules(bundled) -> None:
    too_long = " ".join(["and"] * (explorer.MAX_TOKENS + 1))
    for path, body, status, param in [("/explorer/analyze", {"prompt": too_long}, 400, "prompt"),
                                      ("/explorer/analyze", {"prompt": ""}, 400, "prompt"),
                                      ("/explorer/attention", {"prompt": "x", "layer": 99}, 400, "layer"),
                                      ("/explorer/filter", {"prompt": "x", "temperature": 5}, 400, "temperature"),
                                      ("/explorer/sample", {"prompt": "x", "top_p": 0}, 400, "top_p")]:
        assert_openai_error(*ask(bundled, path, **body), status, param)
    assert_openai_error(*ask(bundled, "/explorer/analyze", model="other", prompt="x"), 404, "model")
    plain = urllib.request.Request(bundled + "/explorer/analyze", data=b"{}", headers={"Content-Type": "text/plain"})
    assert_openai_error(*fetch_json(plain), 415)
    assert_openai_error(*get(bundled + "/explorer/model", Host="evil.example"), 400)
    assert_openai_error(*get(bundled + "/", Host="evil.example"), 400)


@pytest.mark.slow
def test_the_flow_holds_the_trace_s_vectors_at_the_last_position(bundled, model, tokenizer) -> None:
    status, answer = ask(bundled, "/explorer/analyze", prompt=PROMPT)
    assert status == 200, answer
    seen: dict[str, np.ndarray] = {}
    logits = model.forward(tokenizer.encode(PROMPT), trace=lambda name, value: seen.__setitem__(name, value[-1].copy()))
    L = model.config.num_hidden_layers
    assert [row["name"] for row in answer["flow"]] == ["model.embed_tokens", *[f"model.layers.{i}.{step}" for i in range(L)
            for step in ("self_attn.o_proj", "residual_attn", "mlp.down_proj", "residual_mlp")], "model.norm"]
    for row in answer["flow"]:        # the suite's one closeness rule: the kernels round the last digits apart
        assert max_relative_error(np.asarray(row["values"]), seen[row["name"]]) <= RELATIVE_TOLERANCE, row["name"]
    probs = np.exp(logits[-1] - logits[-1].max())
    probs /= probs.sum()
    bins = answer["probability_bins"]
    assert len(bins["max"]) == -(-model.config.vocab_size // bins["ids_per_bin"]) <= explorer.PROBABILITY_BINS
    np.testing.assert_allclose(bins["max"][0], probs[:bins["ids_per_bin"]].max(), rtol=1e-5)


def test_headings_get_github_s_ids_and_links_to_a_served_page_s_markdown_land_on_the_page(tmp_path: Path) -> None:
    (tmp_path / "walkthrough.md").write_text("# Top\n\n## 5. Final norm → logits\n\n### 3.10 `self_attn.softmax`: q -> w\n\n"
                                             "## Top\n\n[a](glossary.md#x) [b](walkthrough.ipynb)\n", encoding="utf-8")
    page = docs.rendered(tmp_path / "walkthrough.md")
    assert [h.anchor for h in page.headings] == ["top", "5-final-norm--logits", "310-self_attnsoftmax-q---w", "top-1"]
    assert '<h2 id="5-final-norm--logits">' in page.body and page.title == "Top"
    assert '<a href="glossary#x">a</a>' in page.body and '<a href="walkthrough.ipynb">b</a>' in page.body


def test_the_glossary_s_links_land_on_headings_of_the_walkthrough() -> None:
    folder = docs.docs_folder()
    anchors = {h.anchor for h in docs.rendered(folder / "walkthrough.md").headings}
    links = re.findall(r'href="walkthrough#([^"]+)"', docs.rendered(folder / "glossary.md").body)
    assert len(links) >= 10 and set(links) <= anchors


def fetch(url: str) -> tuple[int, str, bytes]:
    """A GET's status, Content-Type and body, an error's too."""
    try:
        with urllib.request.urlopen(url, timeout=HANG_SECONDS) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read()


@pytest.mark.slow
def test_every_view_links_to_a_heading_of_the_walkthrough_page_which_shows_its_figures(bundled) -> None:
    status, info = get(bundled + "/explorer/model")
    assert status == 200
    links = {**info["links"]["views"], **info["links"]["steps"]}
    assert set(info["links"]["views"]) == set(explorer.VIEW_SECTIONS) and set(info["links"]["steps"]) == {s.name for s in STEPS}
    assert all(link.startswith("/docs/walkthrough#") for link in links.values())
    status, kind, body = fetch(bundled + "/docs/walkthrough")
    page = body.decode()
    assert status == 200 and kind.startswith("text/html")
    ids = set(re.findall(r'<h[1-6] id="([^"]+)"', page))
    headings = re.findall(r"^#+ ", (ROOT / "docs" / "walkthrough.md").read_text(encoding="utf-8"), flags=re.MULTILINE)
    assert len(ids) == len(headings) and {link.split("#")[1] for link in links.values()} <= ids
    assert "<table>" in page and "<pre><code" in page and "<details>" in page
    sources = re.findall(r'<img src="([^"]+)"', page)
    assert len(sources) >= 10
    for source in sources:
        status, kind, image = fetch(f"{bundled}/docs/{source}")
        assert (status, kind, image[:8]) == (200, "image/png", b"\x89PNG\r\n\x1a\n"), source
    for missing in ("figures/nothing.png", "figures/ablations.json", "figures/..%2fwalkthrough.md", "walkthrough.md"):
        status, kind, error = fetch(f"{bundled}/docs/{missing}")
        assert status == 404 and json.loads(error)["error"]["message"].startswith("no route"), missing


NAME_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"],
               "additionalProperties": False}


@pytest.mark.slow
def test_the_mask_view_reports_each_step_s_allowed_tokens_and_the_likeliest_it_removed(bundled, model, tokenizer) -> None:
    constraints = pytest.importorskip("qwen_np.generation.constraints")
    pytest.importorskip("llguidance")
    status, answer = ask(bundled, "/explorer/mask", prompt="ROMEO:", json_schema=NAME_SCHEMA, temperature=0, max_tokens=32)
    assert status == 200, answer
    reply = json.loads(answer["text"])
    assert answer["complete"] and list(reply) == ["name"] and isinstance(reply["name"], str) and len(reply["name"]) <= 6
    ends = folder_generation_defaults(ROOT / BUNDLED, model.config).eos_token_ids
    vocab = constraints.vocabulary(tokenizer, model.config.vocab_size, ends)
    constraint = constraints.json_schema_grammar(NAME_SCHEMA, vocab).constraint()
    ids = tokenizer.encode("ROMEO:")
    for step in answer["steps"]:                       # replayed: the grammar's own mask on the model's own logits
        allowed, logits = constraint.allowed(), model.forward(ids)[-1]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        removed = [t["id"] for t in step["removed"]]
        assert step["allowed"] == int(allowed.sum()) and allowed[step["token"]["id"]] and not allowed[removed].any()
        np.testing.assert_allclose(step["removed_p"], probs[~allowed].sum(), rtol=1e-4, atol=1e-6)
        assert removed == np.flatnonzero(~allowed)[np.argsort(-probs[~allowed], kind="stable")][:explorer.MASK_TOP].tolist()
        if step["token"]["id"] in vocab.ends:
            break
        constraint.consume(step["token"]["id"])
        ids.append(step["token"]["id"])
    assert_openai_error(*ask(bundled, "/explorer/mask", prompt="x", json_schema=NAME_SCHEMA, max_tokens=999), 400, "max_tokens")
    assert_openai_error(*ask(bundled, "/explorer/mask", prompt="x", json_schema=NAME_SCHEMA, stream=True), 400, "stream")


@pytest.mark.slow
@pytest.mark.parametrize("settings", [{"temperature": 0}, {"temperature": 1.0, "seed": 3}, {"temperature": 1.2, "seed": 8}],
                         ids=["greedy", "seed 3", "seed 8"])
def test_the_mask_view_s_reply_is_generate_s_for_the_same_schema_settings_and_seed(bundled, model, tokenizer,
                                                                                    settings) -> None:
    constraints = pytest.importorskip("qwen_np.generation.constraints")
    pytest.importorskip("llguidance")
    status, answer = ask(bundled, "/explorer/mask", prompt="ROMEO:", json_schema=NAME_SCHEMA, max_tokens=32, **settings)
    assert status == 200, answer
    defaults = folder_generation_defaults(ROOT / BUNDLED, model.config)
    vocab = constraints.vocabulary(tokenizer, model.config.vocab_size, defaults.eos_token_ids)
    events = list(generate(model, tokenizer, tokenizer.encode("ROMEO:"), resolve_sampling(defaults, **settings), 32,
                           eos_token_ids=defaults.eos_token_ids, grammar=constraints.json_schema_grammar(NAME_SCHEMA, vocab)))
    assert answer["text"] == "".join(event.text for event in events)
    assert [step["token"]["id"] for step in answer["steps"]] == [event.token_id for event in events]
    assert answer["complete"] == (events[-1].finish_reason in ("stop", "eos"))


def fetch_json(request: urllib.request.Request) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(request, timeout=HANG_SECONDS) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.slow
def test_the_page_loads_nothing_from_elsewhere_and_opens_without_the_key_its_data_needs(serve_env) -> None:
    with serving(serve_env, BUNDLED, "--api-key", "sesame") as server:
        base = server.url.removesuffix("/v1")
        with urllib.request.urlopen(base + "/", timeout=HANG_SECONDS) as response:
            page, policy = response.read().decode(), response.headers["Content-Security-Policy"]
        assert "default-src 'self'" in policy and "http" not in page.replace("http-equiv", "")
        for name in ("app.js", "style.css", "docs.css"):
            with urllib.request.urlopen(f"{base}/web/{name}", timeout=HANG_SECONDS) as response:
                assert response.status == 200 and b"http" not in response.read()
        for path in ("/docs/walkthrough", "/docs/figures/rope.png"):             # the page's links: no key either
            with urllib.request.urlopen(base + path, timeout=HANG_SECONDS) as response:
                assert response.status == 200 and response.headers["Content-Security-Policy"] == policy
        assert_openai_error(*get(base + "/explorer/model"), 401)
        status, info = get(base + "/explorer/model", Authorization="Bearer sesame")
        assert status == 200 and info["dimensions"]["L"] == 6 and len(info["steps"]) == len(STEPS)


# --- in the browser ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="the browser tests need playwright (the `browser` extra)")
    if not shutil.which(CHROMIUM):
        pytest.skip(f"the browser tests need chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=HANG_SECONDS * 1000)
        yield launched
        launched.close()


def new_page(browser, **options):
    """A page whose waits wait for what they name, however long a loaded machine takes (Playwright's own
    default gives up after 30 s); bypass_csp: Playwright's waits evaluate strings, which the page's policy
    (no eval) forbids."""
    page = browser.new_page(bypass_csp=True, **options)
    page.set_default_timeout(HANG_SECONDS * 1000)
    return page


def open_page(browser, base: str, width: int = 1280, height: int = 800):
    page = new_page(browser, viewport={"width": width, "height": height})
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(base + "/")
    page.wait_for_selector("body[data-ready=true]")
    page.errors = errors
    return page


def state(page, path: str):
    return page.evaluate(f"window.qwenExplorer.{path}")


def explore(page, prompt: str) -> None:
    runs = state(page, "runs")
    page.fill("#explore-prompt", prompt)
    page.press("#explore-prompt", "Control+Enter")
    page.wait_for_function(f"() => window.qwenExplorer.runs > {runs}")


def set_slider(page, name: str, value: float) -> None:
    page.eval_on_selector(f"#{name}", "(e, v) => { e.value = v; e.dispatchEvent(new Event('input')); }", value)


@pytest.fixture(scope="module")
def explored(browser, bundled):
    page = open_page(browser, bundled)
    explore(page, PROMPT)
    yield page
    assert not page.errors
    page.close()


@pytest.mark.slow
def test_the_page_shows_the_tokenizer_s_tokens_with_the_bytes_of_partial_characters(explored, tokenizer) -> None:
    ids = tokenizer.encode(PROMPT)
    assert [int(i) for i in explored.eval_on_selector_all("#tokens li", "items => items.map(i => i.dataset.id)")] == ids
    partial = explored.eval_on_selector_all("#tokens li .partial", "items => items.map(i => i.textContent)")
    assert partial == ["⟨c3⟩", "⟨a9⟩"]                         # é is c3 a9 in UTF-8


@pytest.mark.slow
def test_the_heatmap_of_layer_1_head_0_holds_qwen_np_s_attention_weights(explored, model, tokenizer) -> None:
    explored.select_option("#att-layer", "1")
    explored.wait_for_function("() => window.qwenExplorer.attention.layer === 1")
    explored.select_option("#att-head", "0")
    heatmap = state(explored, "heatmap")
    assert (heatmap["layer"], heatmap["head"]) == (1, 0)
    expected = attention_weights(model, tokenizer.encode(PROMPT), 1)[0]                    # [T, T]
    np.testing.assert_allclose(np.array(heatmap["weights"]), expected, rtol=1e-5, atol=1e-7)
    assert np.all(np.triu(np.array(heatmap["weights"]), 1) == 0)                        # the mask: no future
    assert len(explored.query_selector_all(".multiple")) == model.config.num_attention_heads
    assert "Head 0 reads KV head 0, as do heads 0, 1." in explored.text_content("#gqa")


@pytest.mark.slow
def test_moving_temperature_and_top_k_keeps_the_tokens_sampling_keeps(explored, model, tokenizer) -> None:
    logits = model.forward(tokenizer.encode(PROMPT))[-1]
    set_slider(explored, "filter-temperature", 0.6)
    explored.focus("#filter-top_k")
    for _ in range(int(explored.input_value("#filter-top_k")) - 7):                     # the keyboard moves it
        explored.keyboard.press("ArrowLeft")
    explored.wait_for_function("() => window.qwenExplorer.filter.settings.top_k === 7")
    settings = state(explored, "filter.settings")
    assert settings["temperature"] == 0.6
    kept = [t["id"] for t in state(explored, "filter.tokens") if t["p"][-1] is not None]
    context = tokenizer.encode(PROMPT)
    ours = warp(apply_repetition_penalty(logits, context, settings["repetition_penalty"]), SamplingParams(**settings))
    assert sorted(kept) == np.flatnonzero(np.isfinite(ours)).tolist() and len(kept) <= 7


@pytest.mark.slow
def test_the_page_opens_on_the_default_prompt_s_numbers_and_draws_its_flow_as_strips(browser, bundled) -> None:
    page = open_page(browser, bundled)                           # no click: the default prompt has run
    analysis = state(page, "analysis")
    assert analysis["text"] == page.input_value("#explore-prompt") and state(page, "runs") == 1
    assert len(page.query_selector_all("#flow canvas.strip")) == len(analysis["flow"]) + 1          # and the probabilities
    assert page.eval_on_selector("#flow canvas.strip", "c => c.width") >= len(analysis["flow"][0]["values"])
    assert len(page.query_selector_all("#flow details.flow-layer")) == 6
    hrefs = page.eval_on_selector_all("a.doc:not([hidden])", "links => links.map(a => a.getAttribute('href'))")
    assert len(hrefs) >= 6 and all(href.startswith("/docs/walkthrough#") for href in hrefs)
    assert not page.errors
    page.close()


@pytest.mark.slow
def test_a_view_s_walkthrough_link_opens_the_page_at_its_section(browser, bundled) -> None:
    page = open_page(browser, bundled)
    target = page.get_attribute('a.doc[data-view="attention"]', "href").split("#")[1]
    page.click('a.doc[data-view="attention"]')
    page.wait_for_url(f"**/docs/walkthrough#{target}")
    page.wait_for_load_state("load")                              # its figures too, above the section
    shown = page.evaluate("id => { const e = document.getElementById(id); if (!e) return null;"
                          " const r = e.getBoundingClientRect(); return [e.textContent, r.top, r.bottom, window.innerHeight]; }",
                          target)
    assert shown is not None, f"no heading #{target}"
    text, top, bottom, height = shown
    assert text.startswith("3.10 self_attn.softmax") and 0 <= top < bottom <= height        # the heading is in view
    assert page.evaluate("window.scrollY") > 1000                    # far down the page, not at its top
    assert page.evaluate("[...document.images].every(image => image.complete && image.naturalWidth > 0)")
    assert not page.errors
    page.close()


@pytest.mark.slow
def test_the_playground_with_a_schema_shows_each_step_s_mask(browser, bundled) -> None:
    pytest.importorskip("llguidance")
    page = open_page(browser, bundled)
    page.click("#tab-playground")
    page.fill("#play-schema", json.dumps(NAME_SCHEMA))
    shown = play(page, "ROMEO:", 32)
    status, answer = ask(bundled, "/explorer/mask", prompt="ROMEO:", json_schema=NAME_SCHEMA, max_tokens=32,
                         **{field: shown_value for field, shown_value in state(page, "mask_settings").items()})
    assert status == 200 and shown["text"] == answer["text"] == page.text_content("#reply")
    assert state(page, "mask.steps") == answer["steps"]
    assert len(page.query_selector_all("#mask-table tr")) == len(answer["steps"]) + 1 and page.is_visible("#mask-box")
    assert not page.errors
    page.close()


@pytest.mark.slow
def test_sample_then_append_continues_the_prompt_by_that_token(explored) -> None:
    before = state(explored, "ids")
    explored.click("#sample")
    explored.wait_for_function("() => window.qwenExplorer.chosen !== null")
    chosen = state(explored, "chosen.id")
    explored.click("#append")
    explored.wait_for_function(f"() => window.qwenExplorer.ids.length === {len(before) + 1} && !window.qwenExplorer.chosen")
    assert state(explored, "ids") == before + [chosen]


@pytest.mark.slow
def test_a_server_with_an_api_key_gets_it_from_the_page_which_then_works(browser, serve_env) -> None:
    with serving(serve_env, BUNDLED, "--api-key", "sesame") as server:
        page = new_page(browser)
        page.goto(server.url.removesuffix("/v1") + "/")
        page.wait_for_selector("#key-box:not([hidden])")
        assert "API key" in page.text_content("#status")
        page.fill("#api-key", "sesame")
        page.press("#api-key", "Enter")
        page.wait_for_selector("body[data-ready=true]")
        explore(page, "ROMEO:")
        assert page.is_hidden("#key-box") and state(page, "ids")


def play(page, prompt: str, max_tokens: int) -> dict:
    page.click("#tab-playground")
    page.fill("#play-prompt", prompt)
    page.fill("#play-max", str(max_tokens))
    set_slider(page, "play-temperature", 0)
    page.click("#play-send")
    page.wait_for_function("() => window.qwenExplorer.play && window.qwenExplorer.play.done")
    return state(page, "play")


@pytest.mark.slow
def test_a_greedy_completion_streamed_in_the_playground_equals_the_api_s(browser, bundled) -> None:
    page = open_page(browser, bundled)
    shown = play(page, "ROMEO:", 24)
    status, answer = ask(bundled, "/v1/completions", prompt="ROMEO:", max_tokens=24, temperature=0)
    assert status == 200 and shown["text"] == answer["choices"][0]["text"] and page.text_content("#reply") == shown["text"]
    assert shown["usage"] == answer["usage"] and "tok/s" in page.text_content("#play-stats")
    assert page.is_disabled("#mode-chat")                       # the bundled model has no chat template
    assert not page.errors


@pytest.mark.slow
def test_a_chat_in_the_playground_equals_the_api_s_and_shows_reasoning_apart(browser, qwen) -> None:
    page = open_page(browser, qwen)
    page.click("#tab-playground")
    page.check("#mode-chat")
    page.uncheck("#play-thinking")
    shown = play(page, "Why is the sky blue?", 12)
    question = [{"role": "user", "content": "Why is the sky blue?"}]
    status, answer = ask(qwen, "/v1/chat/completions", model=MODEL, messages=question, max_tokens=12, temperature=0,
                         chat_template_kwargs={"enable_thinking": False})
    assert status == 200 and shown["text"] == answer["choices"][0]["message"]["content"]
    assert f"prompt {answer['usage']['prompt_tokens']} tokens" in page.text_content("#play-stats")
    assert page.text_content("#transcript").startswith("user: Why is the sky blue?")
    # Qwen3's reasoning, as a thinking reply streams it: shown apart from the answer.
    page.evaluate("""() => { window.qwenExplorer.play = {text: "", reasoningContent: ""};
                             handleEvent({choices: [{delta: {content: "<think>\\nrays scatter\\n</think>\\n\\nBlue."}}]}); }""")
    assert (page.text_content("#reasoning"), page.text_content("#reply")) == ("rays scatter", "Blue.")
    assert page.is_visible("#reasoning-box") and not page.errors


@pytest.mark.slow
@pytest.mark.parametrize("width, height", [(1280, 800), (390, 844)])
def test_the_page_reads_at_1280_and_on_a_390_pixel_phone_and_works_from_the_keyboard(browser, bundled, width, height,
                                                                                    tmp_path) -> None:
    """Also writes the README's screenshots:
    QWEN_NP_SCREENSHOTS=docs/figures python -m pytest tests/serving/test_web.py -k reads"""
    shots = Path(os.environ.get(SCREENSHOTS_ENV) or tmp_path)
    page = open_page(browser, bundled, width, height)
    explore(page, PROMPT)
    assert page.evaluate("document.documentElement.scrollWidth") <= width       # tables scroll in their boxes
    page.screenshot(path=shots / f"web_explorer_{width}.png")
    for view in ("attention", "next"):
        page.eval_on_selector(f"#{view}-title", "title => title.scrollIntoView()")
        page.screenshot(path=shots / f"web_{view}_{width}.png")
    page.focus("#tab-explorer")
    page.keyboard.press("ArrowRight")                                            # the tabs follow the arrow keys
    assert page.is_visible("#playground") and not page.is_visible("#explorer")
    play(page, "ROMEO:", 32)
    assert page.evaluate("document.documentElement.scrollWidth") <= width
    page.screenshot(path=shots / f"web_playground_{width}.png")
    assert all((shots / f"web_{view}_{width}.png").stat().st_size for view in ("explorer", "attention", "next", "playground"))
    assert not page.errors
