"""The explorer behind `serve`'s web page (qwen_np/serving/web/): one traced forward pass of a prompt, as JSON.

    GET  /                    the page (index.html; its scripts and styles under /web/)
    GET  /explorer/model      the config's dimensions, the STEPS table with each step's source line
    POST /explorer/analyze    tokens (ids and bytes), every step's statistics, the logit lens
    POST /explorer/attention  one layer's softmax weights [H, T, T] and which KV head each query head reads
    POST /explorer/filter     the next token's distribution after each sampling filter (sampling.py's own)
    POST /explorer/sample     one next token drawn as generate draws it
    POST /explorer/mask       a reply constrained by a JSON schema, and at each step what the grammar's mask did:
                              how many tokens it allowed, and the likeliest ones it removed
    GET  /docs/walkthrough    the walkthrough as a page (docs.py), whose sections the views link to

The numbers are the CLI's: the flow's vectors are the values the trace reports at the last position,
statistics are trace.statistics of the same values (what `--trace-layers` prints), the lens is
lens.lens_rows over the same residual stream (`--lens`), attention the same softmax step `--attention`
reads, the filters sampling.py's functions in sampling.py's order, the mask generate()'s own: the reply is
generate()'s, each choice handed to the view by an observer of its Continuation. One forward pass serves all but the
mask: its results are kept for the last few prompts (CACHE_SIZE), so moving a sampling slider or picking
another layer runs no model.

A POST body is serve's: the checks of app.create_app (loopback Host, application/json, API key, body
limit, `model` naming the served model or one of its LoRA adapters, whose model every view but the mask
then shows) apply, its fields are bodies.REQUEST_FIELDS["/explorer/"] (and MASK_FIELDS for /explorer/mask;
any other refused by name), and its prompt and sampling fields are read as a completion's
(bodies.read_completion: `prompt` text or token ids), at most MAX_TOKENS tokens, since the trace holds
every step of every layer for each of them; Service.request resolves the sampling settings.

Imports bodies.py, requests.py, structured.py, finite.py and docs.py of serving/.
"""

from __future__ import annotations

import math
import re
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Awaitable, Callable, Protocol

import numpy as np

from ..core.adapters import Adapter
from ..core.config import DIMENSIONS, dimensions
from ..errors import APIError, QwenNPError
from .bodies import CompletionBody, Limits, check_fields, read_completion
from .requests import api_error
from ..files.model_files import GenerationDefaults
from ..inspection.lens import is_lens_step, lens_labels, lens_rows
from ..inspection.steps import STEPS, source_line
from ..inspection.trace import layer_of, statistics, step_shape, step_template
from ..core.model import Qwen3Model
from ..core.sampling import (SamplingParams, apply_repetition_penalty, next_token, require_distribution, softmax,
                             warp_stages)
from ..files.tokenizer import Tokenizer
from ..generation.constraints import Vocabulary, json_schema_grammar
from ..generation.generate import Chosen, generate
from .docs import docs_folder, rendered
from .docs import routes as docs_routes
from .finite import not_finite
from .structured import grammar_vocabulary



class Served(Protocol):
    """What the explorer needs of requests.Service (create_app builds the explorer over its Service)."""

    tokenizer: Tokenizer
    defaults: GenerationDefaults
    vocabulary: Vocabulary | None

    @property
    def model_id(self) -> str: ...

    @property
    def limits(self) -> Limits: ...

    def adapter_of(self, model: str | None) -> Adapter | None: ...

    @property
    def model(self) -> Qwen3Model: ...

    def completion_prompt(self, body: CompletionBody) -> list[int]: ...

    def request(self, body: CompletionBody, prompt: list[int]) -> Any: ...

WEB = Path(__file__).parent / "web"          # the page: plain HTML, CSS and JS, no build step, nothing fetched
MAX_TOKENS = 64                              # a prompt's tokens the explorer traces
CACHE_SIZE = 4                               # prompts whose forward pass is kept
LENS_TOP = 5                                 # tokens per row of the logit lens
LISTED = 40                                  # tokens the filter view lists, the most likely first
PROBABILITY_BINS = 512                       # the flow's probability strip: the largest probability of each bin of ids
MASK_TOP = 5                                 # removed tokens the mask view lists per step, the most likely first
MASK_MAX_TOKENS = 64                         # a constrained reply's tokens, each step's mask reported
MASK_FIELDS = ("json_schema", "max_tokens")  # /explorer/mask's own fields, beside REQUEST_FIELDS["/explorer/"]
# The forward pass as the flow view draws it: the steps whose output vector (at the last position) it shows.
FLOW_STEPS = ("model.embed_tokens", "self_attn.o_proj", "residual_attn", "mlp.down_proj", "residual_mlp", "model.norm")
# Each view's section of the walkthrough, found by the words its heading starts with (not its number, which
# moves when a chapter is added); each step's by its name in backticks (section 3's headings).
VIEW_SECTIONS = {"tokens": "Prompt → token ids", "embedding": "Token ids → vectors", "steps": "Inside layer 0",
                 "attention": "`self_attn.softmax`", "lens": "The other layers", "next": "Final norm → logits",
                 "flow": "Inside layer 0", "mask": "What a serving engine adds"}


@dataclass(frozen=True)
class Run:
    """One traced forward pass of a prompt: what every view reads."""

    ids: tuple[int, ...]
    steps: list[dict[str, Any]]        # one per traced step, in the order forward reports them
    attention: list[np.ndarray]        # L x [H, T, T] softmax weights
    lens: np.ndarray                   # [L+1, V] lens probabilities at the last position
    logits: np.ndarray                 # [V] the model's logits at the last position
    flow: list[tuple[str, np.ndarray]]  # (step name, its output at the last position [D]) for FLOW_STEPS, in order


def traced_run(model: Qwen3Model, ids: list[int], adapter: Adapter | None = None) -> Run:
    """Run `ids` through the model (with `adapter`'s updates, None: the base) once, noting every step's
    statistics, each layer's attention weights and the residual stream the lens reads."""
    steps: list[dict[str, Any]] = []
    attention: list[np.ndarray] = []
    residuals: list[np.ndarray] = []
    flow: list[tuple[str, np.ndarray]] = []

    def watch(name: str, value: np.ndarray) -> None:
        mean, std, largest, masked = statistics(value)
        steps.append({"name": name, "step": step_template(name), "layer": layer_of(name), "shape": list(value.shape),
                      "symbols": step_shape(name, value), "mean": _finite(mean), "std": _finite(std),
                      "max_abs": _finite(largest), "masked": masked})
        if name.endswith(".self_attn.softmax"):
            attention.append(value.copy())                                       # [H, T, T]
        if is_lens_step(name):
            residuals.append(value[-1].copy())                                   # [D]
        if step_template(name).removeprefix("model.layers.{i}.") in FLOW_STEPS:
            flow.append((name, value[-1].copy()))                                # [D]

    logits = model.forward_batch([ids], [None], trace=watch, adapters=[adapter])  # [T, V]
    return Run(tuple(ids), steps, attention, lens_rows(model, np.stack(residuals)), logits[-1], flow)


def walkthrough_links(walkthrough: Path) -> dict[str, dict[str, str]]:
    """Links from the page into the walkthrough served at /docs/walkthrough (docs.py): each view's section
    (VIEW_SECTIONS) and each step's (section 3's headings name them), as /docs/walkthrough#id, the id the
    served page gives the heading. Empty where the file is not there."""
    if not walkthrough.is_file():
        return {"views": {}, "steps": {}}
    headings = [heading for heading in rendered(walkthrough).headings if heading.level in (2, 3)]

    def link(start: str) -> str | None:            # the heading's words without its number ("3.2 ")
        found = next((heading for heading in headings if re.sub(r"^[\d.]+ ", "", heading.source).startswith(start)), None)
        return f"/docs/walkthrough#{found.anchor}" if found else None

    views = {view: link(start) for view, start in VIEW_SECTIONS.items()}
    steps = {step.name: link(f"`{step.name.removeprefix('model.layers.{i}.')}`") for step in STEPS}
    steps["model.embed_tokens"], steps["model.norm"], steps["lm_head"] = views["embedding"], views["next"], views["next"]
    return {"views": {k: v for k, v in views.items() if v}, "steps": {k: v for k, v in steps.items() if v}}


def _finite(x: float) -> float | None:
    """JSON has no NaN: a statistic of no finite value is null."""
    return x if math.isfinite(x) else None


def filter_stages(logits: np.ndarray, params: SamplingParams, context_ids: list[int]) -> list[tuple[str, np.ndarray]]:
    """The next token's logits [V] after each step of sampling.next_token, named: the model's, after the
    repetition penalty (every context token counts, as in next_token), then warp's stages, or the argmax
    alone when greedy. The explorer's context is all prompt, so the presence penalty (generated tokens
    only) has nothing to act on. Raises QwenNPError as next_token does."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):     # overflow is caught as an error
        penalised = apply_repetition_penalty(logits, context_ids, params.repetition_penalty)
        stages = [("model", logits), ("repetition penalty", penalised)]
        if params.greedy:
            best = int(np.argmax(require_distribution(penalised, params)))
            return stages + [("greedy", np.where(np.arange(logits.size) == best, penalised, -np.inf))]
        return stages + warp_stages(penalised, params)


class Explorer:
    """The explorer's endpoints over a serve.Service: its model, tokenizer, prompt and sampling checks."""

    def __init__(self, service: Served) -> None:
        self.service = service
        self.model = service.model
        self.tokenizer = service.tokenizer
        self.runs: OrderedDict[tuple[bytes, tuple[int, ...]], Run] = OrderedDict()    # (adapter digest, ids)
        self.lock = threading.Lock()                 # handlers run on worker threads

    # --- the prompt and its run ---

    def prompt(self, body: CompletionBody) -> list[int]:
        ids = self.service.completion_prompt(body)
        if len(ids) > MAX_TOKENS:
            raise APIError(400, f"prompt: the explorer traces at most {MAX_TOKENS} tokens, this prompt has {len(ids)}",
                           "prompt", "context_length_exceeded")
        return ids

    def run(self, ids: list[int], body: CompletionBody) -> Run:
        """The traced run of `ids` by the model `body` names (the base, or an adapter over it), from the cache
        when one of the last CACHE_SIZE prompts of that model."""
        adapter = self.service.adapter_of(body.model)
        key = (adapter.digest if adapter is not None else b"", tuple(ids))
        with self.lock:
            if key in self.runs:
                self.runs.move_to_end(key)
                return self.runs[key]
        run = traced_run(self.model, ids, adapter)      # outside the lock: other prompts need not wait
        if not np.isfinite(run.logits).all():           # JSON has no NaN: no view of it, and none kept
            raise not_finite(self.model, self.tokenizer, ids, "prompt", "prompt")
        with self.lock:
            self.runs[key] = run
            while len(self.runs) > CACHE_SIZE:
                self.runs.popitem(last=False)
        return run

    def token(self, token_id: int) -> dict[str, Any]:
        """A token as the page shows it: its id, its bytes in hex, and its text when the bytes are whole
        UTF-8 (a byte-level token may hold part of a character; then text is null)."""
        raw = self.tokenizer.token_bytes(token_id)
        try:
            text: str | None = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        return {"id": token_id, "bytes": raw.hex(" "), "text": text}

    def _top(self, probs: np.ndarray, k: int) -> list[dict[str, Any]]:
        top = np.argsort(-probs, kind="stable")[:k]
        return [{**self.token(int(i)), "p": float(probs[i])} for i in top]

    # --- the endpoints ---

    def describe(self) -> dict[str, Any]:
        """The model's dimensions and the STEPS table, each step with the line of code that computes it."""
        config = self.model.config
        steps = []
        for step in STEPS:
            file, line, code = source_line(step)
            steps.append({"name": step.name, "what": step.what, "function": step.code.__qualname__,
                          "inputs": [[what, list(shape)] for what, shape in step.inputs], "output": list(step.output),
                          "weight": list(step.weight) if step.weight else None, "flops": step.flops,
                          "source": {"file": file, "line": line, "code": code}})
        return {"model": self.service.model_id, "dimensions": dimensions(config), "symbols": DIMENSIONS,
                "group_size": config.group_size, "steps": steps, "max_tokens": MAX_TOKENS,
                "chat": self.tokenizer.has_chat_template, "defaults": vars(self.service.defaults.sampling),
                "links": walkthrough_links(docs_folder() / "walkthrough.md"), "mask_max_tokens": MASK_MAX_TOKENS}

    def analyze(self, body: CompletionBody, fields: dict[str, Any]) -> dict[str, Any]:
        ids = self.prompt(body)
        run = self.run(ids, body)
        lens = [{"label": label, "top": self._top(row, LENS_TOP)} for label, row in zip(lens_labels(self.model), run.lens)]
        probs = softmax(run.logits)
        per_bin = -(-probs.size // PROBABILITY_BINS)                               # ids per bin, rounded up
        flow = [{"name": name, "step": step_template(name), "layer": layer_of(name), "values": values.tolist()}
                for name, values in run.flow]
        return {"tokens": [self.token(i) for i in ids], "text": self.tokenizer.decode(ids), "steps": run.steps,
                "lens": lens, "model_top": self._top(probs, LENS_TOP), "flow": flow,
                "probability_bins": {"ids_per_bin": per_bin,
                                     "max": [float(probs[i:i + per_bin].max()) for i in range(0, probs.size, per_bin)]}}

    def attention(self, body: CompletionBody, fields: dict[str, Any]) -> dict[str, Any]:
        ids, L = self.prompt(body), self.model.config.num_hidden_layers
        layer = fields.get("layer")
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < L:
            raise APIError(400, f"layer: must be an integer in [0, {L})", "layer")
        weights = self.run(ids, body).attention[layer]                                 # [H, T, T]
        group = self.model.config.group_size
        return {"layer": layer, "weights": weights.tolist(),
                "kv_head": [h // group for h in range(weights.shape[0])]}

    def filter(self, body: CompletionBody, fields: dict[str, Any]) -> dict[str, Any]:
        """The LISTED most likely tokens (after the repetition penalty) with their probability after each
        stage (null: filtered out), and how many tokens each stage keeps."""
        ids = self.prompt(body)
        stages = filter_stages(self.run(ids, body).logits, self._params(body, ids), ids)
        probs = [softmax(logits) for _, logits in stages]                        # stages x [V]
        listed = np.argsort(-probs[1], kind="stable")[:LISTED]
        tokens = [{**self.token(int(i)), "p": [float(p[i]) if np.isfinite(logits[i]) else None
                                               for p, (_, logits) in zip(probs, stages)]} for i in listed]
        return {"stages": [{"name": name, "kept": int(np.isfinite(logits).sum())} for name, logits in stages],
                "tokens": tokens}

    def sample(self, body: CompletionBody, fields: dict[str, Any]) -> dict[str, Any]:
        ids = self.prompt(body)
        params = self._params(body, ids)
        chosen = next_token(self.run(ids, body).logits, params, np.random.default_rng(params.seed), ids, [])
        return self.token(chosen)

    def mask(self, body: CompletionBody, fields: dict[str, Any]) -> dict[str, Any]:
        """A reply to `prompt` under `json_schema`, generated by generate() (so its tokens are those generate
        gives for the same grammar, settings and seed), and at each step what the grammar's mask did to the
        model's distribution: the tokens it allowed, the probability it removed, and the likeliest tokens it
        removed (probabilities before any filter). The base model's only: generate() runs no adapter."""
        if self.service.adapter_of(body.model) is not None:
            raise APIError(400, f"model: the mask view runs the base model only, not an adapter; ask it of "
                                f"`{self.service.model_id}`", "model")
        ids = self.service.completion_prompt(body)
        max_tokens = body.max_tokens or MASK_MAX_TOKENS
        if max_tokens > MASK_MAX_TOKENS:
            raise APIError(400, f"max_tokens: must be an integer in [1, {MASK_MAX_TOKENS}]", "max_tokens")
        params = self.service.request(replace(body, max_tokens=max_tokens), ids).params
        grammar = json_schema_grammar(fields.get("json_schema"), grammar_vocabulary(self.service.vocabulary, "json_schema"))
        steps: list[dict[str, Any]] = []
        events = list(generate(self.model, self.tokenizer, ids, params, max_tokens, grammar=grammar,
                               eos_token_ids=self.service.defaults.eos_token_ids,
                               observe=lambda chosen: steps.append(self._masked(chosen))))
        # Complete: the grammar was (the last token completed it) or it allowed the end that came.
        return {"vocab_size": self.model.config.vocab_size, "steps": steps, "text": "".join(e.text for e in events),
                "complete": events[-1].finish_reason in ("stop", "eos")}

    def _masked(self, chosen: Chosen) -> dict[str, Any]:
        """One step of the mask view: the token chosen, how many tokens the grammar allowed, the probability
        it removed and the MASK_TOP likeliest tokens it removed."""
        assert chosen.allowed is not None                # mask() always gives a grammar
        probs = softmax(chosen.logits)                                                  # [V]
        removed = np.flatnonzero(~chosen.allowed)
        top = removed[np.argsort(-probs[removed], kind="stable")[:MASK_TOP]]
        return {"token": self.token(chosen.token), "allowed": int(chosen.allowed.sum()),
                "removed_p": float(probs[removed].sum()),
                "removed": [{**self.token(int(i)), "p": float(probs[i])} for i in top]}

    def _params(self, body: CompletionBody, ids: list[int]) -> SamplingParams:
        """The sampling settings of `body`, checked and defaulted as /v1/completions does."""
        return self.service.request(body, ids).params

    # --- mounting ---

    def routes(self, read_body: Callable[[Any], Awaitable[dict[str, Any]]],
               error: Callable[[Any], Any]) -> list[Any]:
        """Starlette routes for the page and the endpoints; read_body and error are create_app's (its
        body limit and parse_body, OpenAI's error JSON)."""
        from starlette.concurrency import run_in_threadpool
        from starlette.responses import FileResponse, JSONResponse, Response
        from starlette.routing import Mount, Route
        from starlette.staticfiles import StaticFiles


        def posted(method: Callable[[CompletionBody, dict[str, Any]], dict[str, Any]]) -> Callable[[Any], Awaitable[Response]]:
            async def handle(http: Any) -> Response:
                try:
                    fields = await read_body(http)
                    own = MASK_FIELDS if method == self.mask else ()
                    check_fields({key: value for key, value in fields.items() if key not in own}, "/explorer/")
                    body = read_completion(fields, self.service.limits)      # its prompt and sampling: a completion's
                    return JSONResponse(await run_in_threadpool(method, body, fields))
                except APIError as problem:
                    return error(problem)
                except QwenNPError as problem:           # sampling settings that make no distribution
                    return error(api_error(problem))
                except Exception as problem:             # a bug: say so in one line, keep serving
                    print(f"explorer: internal error: {type(problem).__name__}: {problem}", file=sys.stderr)
                    return error(APIError(500, f"internal error: {type(problem).__name__}", kind="server_error"))
            return handle

        async def describe(http: Any) -> Response:
            return JSONResponse(await run_in_threadpool(self.describe))

        async def page(http: Any) -> Response:
            return FileResponse(WEB / "index.html")          # its headers: app.create_app's, as every page file's

        return [Route("/", page, methods=["GET"]), Mount("/web", StaticFiles(directory=WEB), name="web"),
                *docs_routes(docs_folder()),
                Route("/explorer/model", describe, methods=["GET"]),
                *[Route(f"/explorer/{name}", posted(getattr(self, name)), methods=["POST"])
                  for name in ("analyze", "attention", "filter", "sample", "mask")]]

