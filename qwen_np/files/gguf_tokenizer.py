"""The tokenizer and chat template a GGUF holds (tokenizer.ggml.*, tokenizer.chat_template): read back as the
Hugging Face tokenizer it came from (read_tokenizer), and written as llama.cpp's converter writes a byte-level
BPE (add_vocabulary, for gguf_export)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from gguf import GGUFWriter, Keys, TokenType
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors

from ..core.config import Qwen3Config
from ..errors import QwenNPError
from .gguf_metadata import token_id_of
from .gguf_reader import metadata_value, open_reader
from .tokenizer import Tokenizer

# Qwen2's pre-tokenizer regex (tokenizer.ggml.pre = "qwen2"), as in llama.cpp's src/llama-vocab.cpp and
# in the Split of every Qwen2/Qwen3 tokenizer.json.
QWEN2_PRE = "qwen2"
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def read_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer and chat template of a GGUF, giving the same ids as the Hugging Face tokenizer it came from.

    `tokenizer.huggingface.json` (the whole tokenizer.json, written by export for tokenizers that are not
    Qwen2's) is used as is when present; otherwise the byte-level BPE is rebuilt from tokenizer.ggml.*
    the way transformers' GGUF loader does (CONTROL tokens special, USER_DEFINED ones plain added tokens),
    with Qwen2's pre-tokenizer.
    """
    reader = open_reader(path)
    source = reader.path
    tokens = metadata_value(reader, Keys.Tokenizer.LIST, list)
    embedded = metadata_value(reader, Keys.Tokenizer.HF_JSON, str, None)
    if embedded is not None:
        try:
            backend = tokenizers.Tokenizer.from_str(embedded)
        except Exception as bad:                # the binding raises plain Exception for JSON and schema errors
            raise QwenNPError(f"{source}: metadata key {Keys.Tokenizer.HF_JSON!r} is not a tokenizer.json "
                              f"tokenizers can read ({_first_line(bad)})") from None
    else:
        model = metadata_value(reader, Keys.Tokenizer.MODEL, str)
        pre = metadata_value(reader, Keys.Tokenizer.PRE, str, None)
        if model != "gpt2" or pre != QWEN2_PRE:
            raise QwenNPError(f"{source}: tokenizer.ggml.model {model!r} with tokenizer.ggml.pre {pre!r} is not "
                              f"supported (qwen_np rebuilds only Qwen2's byte-level BPE: 'gpt2' with {QWEN2_PRE!r})")
        types = metadata_value(reader, Keys.Tokenizer.TOKEN_TYPE, list)
        if len(types) != len(tokens):
            raise QwenNPError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
        backend = _qwen2_backend(source, tokens, types, metadata_value(reader, Keys.Tokenizer.MERGES, list))
    names = {"bos_token": Keys.Tokenizer.BOS_ID, "eos_token": Keys.Tokenizer.EOS_ID, "pad_token": Keys.Tokenizer.PAD_ID}
    special = {name: tokens[token_id] for name, key in names.items()
               if (token_id := token_id_of(reader, key, tokens)) is not None}
    try:
        return Tokenizer(backend, special, metadata_value(reader, Keys.Tokenizer.CHAT_TEMPLATE, str, None))
    except jinja2.TemplateSyntaxError as bad:
        raise QwenNPError(f"{source}: metadata key {Keys.Tokenizer.CHAT_TEMPLATE!r} does not compile as a chat "
                          f"template (line {bad.lineno}: {bad.message})") from None


def _first_line(error: Exception) -> str:
    """An exception's message as one line (a library's may span several)."""
    return next(iter(str(error).splitlines()), type(error).__name__)


def _qwen2_backend(source: Path, tokens: list[str], types: list[int], merges: list[str]) -> tokenizers.Tokenizer:
    """Qwen2's tokenizer.json, rebuilt: byte-level BPE, NFC (GGUF has no normalizer key, and Qwen's
    tokenizer.json applies NFC), Qwen2's split regex; CONTROL tokens become special added tokens,
    USER_DEFINED ones plain added tokens (e.g. <think>), UNUSED padding ([PAD151669]...) is left out. A token
    listed twice or a merge of tokens not in the list is refused (the file is damaged, or not Qwen2's BPE)."""
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        if kind != TokenType.UNUSED and vocab.setdefault(token, i) != i:
            raise QwenNPError(f"{source}: {Keys.Tokenizer.LIST} holds {token!r} twice (ids {vocab[token]} and {i})")
    pairs = [(left, right) for left, _, right in (merge.partition(" ") for merge in merges)]
    try:
        bpe = models.BPE(vocab, pairs, dropout=None, unk_token=None, continuing_subword_prefix="",
                         end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
    except Exception as bad:                    # the binding raises plain Exception ("Token `x` out of vocabulary")
        raise QwenNPError(f"{source}: {Keys.Tokenizer.MERGES} does not fit {Keys.Tokenizer.LIST} "
                          f"({_first_line(bad)})") from None
    backend = tokenizers.Tokenizer(bpe)
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    added = {kind: [AddedToken(token, special=kind == TokenType.CONTROL, normalized=False)
                    for token, token_kind in zip(tokens, types) if token_kind == kind]
             for kind in (TokenType.CONTROL, TokenType.USER_DEFINED)}
    backend.add_special_tokens(added[TokenType.CONTROL])
    backend.add_tokens(added[TokenType.USER_DEFINED])
    return backend


def add_vocabulary(writer: GGUFWriter, tokenizer: Tokenizer, config: Qwen3Config) -> list[str]:
    """tokenizer.ggml.* as llama.cpp's converter writes a byte-level BPE (get_vocab_base): the token list
    padded to the model's vocab_size with [PAD{i}] (UNUSED), merges as "A B", the special ids and the
    chat template. A tokenizer that is not Qwen2's also gets its whole tokenizer.json (returns a note)."""
    spec = json.loads(tokenizer.backend.to_str())
    added = {entry["id"]: entry for entry in spec["added_tokens"]}
    by_id = {i: token for token, i in spec["model"]["vocab"].items()} | {i: e["content"] for i, e in added.items()}
    if max(by_id) >= config.vocab_size:
        raise QwenNPError(f"export: the tokenizer has token id {max(by_id)} but the model only {config.vocab_size} embeddings")
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(config.vocab_size)]
    types = [_token_type(i, by_id, added) for i in range(config.vocab_size)]
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in spec["model"]["merges"]]
    qwen2 = _is_qwen2(spec)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(QWEN2_PRE if qwen2 else "gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for token_id, add in ((_special_id(tokenizer, "bos_token", config.bos_token_id), writer.add_bos_token_id),
                          (_special_id(tokenizer, "eos_token", next(iter(config.eos_token_ids), None)), writer.add_eos_token_id),
                          (_special_id(tokenizer, "pad_token", None), writer.add_pad_token_id)):
        if token_id is not None:
            add(token_id)
    writer.add_add_bos_token(False)              # Qwen3 adds no BOS (tokenizer_config.json: add_bos_token false)
    if tokenizer.chat_template is not None:
        writer.add_chat_template(tokenizer.chat_template)
    if qwen2:
        return []
    writer.add_string(Keys.Tokenizer.HF_JSON, tokenizer.backend.to_str())
    return ["the tokenizer is not Qwen2's: llama.cpp will split text with GPT-2's regex (tokenizer.ggml.pre "
            "'gpt-2'); qwen_np reads the exact tokenizer back from tokenizer.huggingface.json"]


def _token_type(token_id: int, by_id: dict[int, str], added: dict[int, Any]) -> int:
    """NORMAL, UNUSED padding, or for an added token CONTROL when it is special or looks like <|...|>
    (llama.cpp's does_token_look_special), else USER_DEFINED (Qwen3's <think>, <tool_call>)."""
    if token_id not in by_id:
        return TokenType.UNUSED
    if token_id not in added:
        return TokenType.NORMAL
    token = by_id[token_id]
    special = added[token_id]["special"] or token.startswith("<|") and token.endswith("|>")
    return TokenType.CONTROL if special else TokenType.USER_DEFINED


def _special_id(tokenizer: Tokenizer, name: str, fallback: int | None) -> int | None:
    """The id of a named special token, else the config's id (Qwen3 names no bos_token: config.json's
    bos_token_id is used, as llama.cpp's converter does)."""
    token = tokenizer.special_token(name)
    return fallback if token is None else tokenizer.token_to_id(token)


def _is_qwen2(spec: dict[str, Any]) -> bool:
    """Whether tokenizer.json is Qwen2's byte-level BPE: NFC, then Split on QWEN2_PATTERN, then ByteLevel."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    return (spec.get("normalizer") == {"type": "NFC"} and len(steps) == 2
            and steps[0].get("pattern") == {"Regex": QWEN2_PATTERN} and steps[1].get("type") == "ByteLevel")
