"""lm-evaluation-harness (the `lm-eval` extra) drives `serve` through its own Python API, `lm_eval.simple_evaluate`,
on the random-weight Qwen3 fixture (the real tokenizer and template), over tasks this file writes: a jsonl of
documents and a task config beside it, found by a TaskManager's `include_path`. Offline: the documents are
local (`dataset_path: json`), the tokenizer is the fixture's folder, nothing is fetched.

- `local-completions` scores a multiple-choice task by log-likelihood: it sends each context + choice as token
  ids with `echo`, `logprobs: 1` and `max_tokens: 1`, and sums the choice's tokens' log-probabilities. Each sum
  equals transformers' (a float64 log-softmax of its FP32 logits) within 1e-5 nats.
- `local-chat-completions` generates (`generate_until`) with the task's stop strings and token limit: each
  reply is the one serve gives the official client for the same chat request, greedily.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import HANG_SECONDS, QWEN3_RANDOM
from tests.serving.test_serve import MODEL, serving
from tests.serving.test_serve_choices import reference_logprobs

openai = pytest.importorskip("openai")
lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("starlette")

pytestmark = pytest.mark.slow      # a server in a subprocess; lm_eval imports datasets and transformers

CHOICE_DOCS = [{"question": "The sky is", "choices": ["blue", "green", "made of cheese"], "answer": 0},
               {"question": "Two plus two is", "choices": ["four", "five"], "answer": 0},
               {"question": "猫は", "choices": ["かわいい", "dog"], "answer": 0}]
GENERATE_DOCS = [{"question": "Name a colour.", "answer": "blue"}, {"question": "Say hello.", "answer": "hello"}]
UNTIL, MAX_GEN_TOKS = ["\n\n", "."], 12


@pytest.fixture(scope="module")
def server(env: dict[str, str]):
    """A server of MODEL, as test_serve.py's."""
    with serving(env, MODEL) as running:
        yield running.url


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No Hugging Face hub nor dataset download (honoured where datasets and transformers are not yet imported;
    the task's documents and tokenizer are local files either way)."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")


def task(folder: Path, name: str, docs: list[dict], **config: object):
    """A TaskManager that finds task `name`: `docs` in a jsonl, its config (JSON, which is YAML) beside them;
    the dataset's cache in `folder` too, not the user's."""
    from lm_eval.tasks import TaskManager

    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in docs), encoding="utf-8")
    dataset = {"data_files": {"test": str(data)}, "cache_dir": str(folder / "datasets")}
    (folder / f"{name}.yaml").write_text(json.dumps({"task": name, "dataset_path": "json", "dataset_kwargs": dataset,
                                                     "test_split": "test", "doc_to_text": "{{question}}",
                                                     "doc_to_target": "answer", **config}), encoding="utf-8")
    return TaskManager(include_path=str(folder))


def test_local_completions_scores_each_choice_as_transformers_does(server, tok, tmp_path, offline) -> None:
    manager = task(tmp_path, "qwen_np_choices", CHOICE_DOCS, output_type="multiple_choice",
                   doc_to_choice="{{choices}}")
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=["qwen_np_choices"], task_manager=manager, log_samples=True,
        model_args=f"base_url={server}/completions,model={MODEL},tokenizer_backend=huggingface,"
                   f"tokenizer={QWEN3_RANDOM}")
    samples = sorted(results["samples"]["qwen_np_choices"], key=lambda sample: sample["doc_id"])
    assert [sample["doc"] for sample in samples] == CHOICE_DOCS
    for sample, doc in zip(samples, CHOICE_DOCS):
        assert [continuation for _, continuation in sample["arguments"]] == [" " + c for c in doc["choices"]]
        for (context, continuation), (score, _) in zip(sample["arguments"], sample["filtered_resps"], strict=True):
            # lm_eval's split: the context's tokens, then the rest of the whole text's (its _encode_pair)
            whole, context_length = tok.encode(context + continuation), len(tok.encode(context))
            expected = reference_logprobs(whole)[context_length - 1:].sum()
            assert abs(score - expected) < 1e-5, (context, continuation, score, expected)


def test_local_chat_completions_replies_are_serves_greedy_chat_replies(server, tmp_path, offline) -> None:
    manager = task(tmp_path, "qwen_np_replies", GENERATE_DOCS, output_type="generate_until",
                   generation_kwargs={"until": UNTIL, "max_gen_toks": MAX_GEN_TOKS})
    results = lm_eval.simple_evaluate(model="local-chat-completions", model_args=f"base_url={server}/chat/completions,"
                                      f"model={MODEL}", tasks=["qwen_np_replies"], task_manager=manager,
                                      apply_chat_template=True, log_samples=True)
    samples = sorted(results["samples"]["qwen_np_replies"], key=lambda sample: sample["doc_id"])
    assert [sample["doc"] for sample in samples] == GENERATE_DOCS
    client = openai.OpenAI(base_url=server, api_key="none", max_retries=0, timeout=HANG_SECONDS)
    for sample in samples:
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": sample["doc"]["question"]}],
                                               max_tokens=MAX_GEN_TOKS, temperature=0, stop=UNTIL)
        text = reply.choices[0].message.content
        assert text and sample["resps"] == [[text]], (sample["resps"], text)
