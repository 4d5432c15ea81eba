"""Generate tests/fixtures/<name>/: tiny random Qwen3 checkpoints with transformers logits.

Usage (needs the `reference` extra, torch + transformers):

    python tests/reference/make_fixtures.py

Each fixture directory holds the BF16 checkpoint exactly as `save_pretrained` writes it
(config.json, generation_config.json, one safetensors file or several shards plus
`model.safetensors.index.json`) and `reference.npz` with

* `input_ids`  int64   [T]            deterministic random ids over the vocab;
* `logits`     float32 [T, vocab]     transformers FP32 eager logits, no cache, every position;
* `inv_freq`   float32 [head_dim/2]   the RoPE inverse frequencies transformers used;
* `hf_config`  str                    JSON of the config fields that define the forward pass.

"original"-style fixtures get config.json rewritten to the format of the released Qwen3
checkpoints (spec §2.1: `rope_theta`, `rope_scaling: null`, `torch_dtype`, no
`layer_types`); "transformers5"-style fixtures keep what transformers 5.x writes
(`rope_parameters`, `dtype`, `layer_types`). Rerunning rewrites byte-identical files.
"""

import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests dir, for `reference`

from reference.hf_reference import (  # noqa: E402
    build_reference_model,
    make_config,
    random_token_ids,
    reference_logits,
    rope_inv_freq,
    save_bf16_checkpoint,
)
from reference.logit_match import allowed_error  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

FIXTURES_DIR = Path(__file__).resolve().parents[1] / "fixtures"

ORIGINAL_STYLE = "original"
TRANSFORMERS5_STYLE = "transformers5"

# Config fields that determine the forward pass; stored so tests can check config parsing.
FORWARD_CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
    "rms_norm_eps",
)


@dataclass(frozen=True)
class FixtureSpec:
    """One fixture: model shape, config file style, sharding and input length."""

    name: str
    model: dict = field(repr=False)  # keyword arguments of `make_config`
    seq_len: int
    config_style: str
    seed: int
    max_shard_size: str = "50GB"  # the save_pretrained default: a single file


FIXTURES = (
    # Like Qwen3-0.6B: tied, head_dim (32) > hidden/heads (16); GQA groups 2.
    FixtureSpec(
        name="tied_gqa2_wide_heads_original",
        model=dict(vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6),
        seq_len=64, config_style=ORIGINAL_STYLE, seed=1,
    ),
    # Like Qwen3-8B: untied, head_dim == hidden/heads, GQA groups 4, sharded with an index.
    FixtureSpec(
        name="untied_gqa4_sharded_original",
        model=dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                   tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6),
        seq_len=48, config_style=ORIGINAL_STYLE, seed=2, max_shard_size="150KB",
    ),
    # Original-style file with non-default theta/eps: a loader must read both, not assume them.
    # head_dim 24 (> hidden/heads 16) is not a power of two; GQA groups 2 with a single KV head.
    FixtureSpec(
        name="untied_mqa_theta1e4_eps1e5_sharded_original",
        model=dict(vocab_size=512, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=24,
                   tie_word_embeddings=False, rope_theta=1e4, rms_norm_eps=1e-5),
        seq_len=32, config_style=ORIGINAL_STYLE, seed=3, max_shard_size="40KB",
    ),
    # transformers-5 style; plain multi-head attention (groups 1); head_dim (16) < hidden/heads (24).
    FixtureSpec(
        name="untied_mha_narrow_heads_theta1e4_eps1e5_transformers5",
        model=dict(vocab_size=300, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                   tie_word_embeddings=False, rope_theta=1e4, rms_norm_eps=1e-5),
        seq_len=40, config_style=TRANSFORMERS5_STYLE, seed=4, max_shard_size="100KB",
    ),
    # Positions past 1000 (RoPE phase precision); small vocab keeps the npz under 2 MB.
    FixtureSpec(
        name="tied_gqa4_long1100_transformers5",
        model=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                   tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6),
        seq_len=1100, config_style=TRANSFORMERS5_STYLE, seed=5,
    ),
)


def original_qwen3_config_json(config: Qwen3Config) -> str:
    """Render `config` in the released Qwen3 config.json format (spec §2.1).

    Same keys, 2-space indent, sorted keys and no trailing newline as the official
    Qwen3-8B file; an integral theta is written as an int (`1000000`) like there.
    """
    theta = float(config.rope_parameters["rope_theta"])
    fields = {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": config.attention_bias,
        "attention_dropout": config.attention_dropout,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "hidden_size": config.hidden_size,
        "initializer_range": config.initializer_range,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.max_position_embeddings,
        "max_window_layers": config.max_window_layers,
        "model_type": "qwen3",
        "num_attention_heads": config.num_attention_heads,
        "num_hidden_layers": config.num_hidden_layers,
        "num_key_value_heads": config.num_key_value_heads,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": int(theta) if theta.is_integer() else theta,
        "sliding_window": None,
        "tie_word_embeddings": config.tie_word_embeddings,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": config.use_cache,
        "use_sliding_window": False,
        "vocab_size": config.vocab_size,
    }
    return json.dumps(fields, indent=2, sort_keys=True)


def forward_config_summary(config: Qwen3Config) -> dict:
    """Return the forward-pass config fields, with rope_theta flattened to the top level."""
    summary = {name: getattr(config, name) for name in FORWARD_CONFIG_FIELDS}
    summary["rope_theta"] = float(config.rope_parameters["rope_theta"])
    return summary


def build_fixture(spec: FixtureSpec) -> dict:
    """Write one fixture directory from scratch, verify it, and return its table row."""
    directory = FIXTURES_DIR / spec.name
    shutil.rmtree(directory, ignore_errors=True)  # stale shards must not survive a rerun

    config = make_config(**spec.model)
    model = build_reference_model(config, seed=spec.seed)
    input_ids = random_token_ids(config.vocab_size, spec.seq_len, seed=spec.seed)
    logits = reference_logits(model, input_ids)
    inv_freq = rope_inv_freq(model)

    save_bf16_checkpoint(model, directory, max_shard_size=spec.max_shard_size)
    if spec.config_style == ORIGINAL_STYLE:
        (directory / "config.json").write_text(original_qwen3_config_json(config))
    np.savez_compressed(
        directory / "reference.npz",
        input_ids=input_ids,
        logits=logits,
        inv_freq=inv_freq,
        hf_config=np.array(json.dumps(forward_config_summary(config), sort_keys=True)),
    )

    verify_fixture(directory, spec, input_ids, logits)
    return table_row(directory, spec, config, logits)


def verify_fixture(directory: Path, spec: FixtureSpec, input_ids: np.ndarray,
                   logits: np.ndarray) -> None:
    """Check that the written files are what the tests assume.

    * transformers, loading the directory as a user would (config style included), computes
      exactly the stored logits, so the checkpoint and the reference describe one model;
    * every stored tensor is BF16, and lm_head.weight is stored iff the model is untied;
    * sharding produced several files, or a single one when not asked for;
    * every position's top-2 logit margin exceeds twice the absolute tolerance, so an
      implementation within tolerance necessarily reproduces the argmax everywhere.
    """
    reloaded = Qwen3ForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert np.array_equal(reference_logits(reloaded, input_ids), logits), spec.name

    dtypes = {}
    for path in checkpoint_files(directory):
        with safe_open(path, framework="pt") as shard:
            dtypes.update({key: shard.get_slice(key).get_dtype() for key in shard.keys()})
    assert set(dtypes.values()) == {"BF16"}, (spec.name, set(dtypes.values()))
    assert ("lm_head.weight" in dtypes) != spec.model["tie_word_embeddings"], spec.name

    is_sharded = (directory / "model.safetensors.index.json").exists()
    assert is_sharded == (len(checkpoint_files(directory)) > 1), spec.name
    assert is_sharded == (spec.max_shard_size != FixtureSpec.max_shard_size), spec.name

    assert min_top2_margin(logits) > 2 * allowed_error(logits), f"{spec.name}: near-tie; change the seed"


def checkpoint_files(directory: Path) -> list[Path]:
    """Return the safetensors files of a checkpoint directory, sorted by name."""
    return sorted(directory.glob("*.safetensors"))


def min_top2_margin(logits: np.ndarray) -> float:
    """Return the smallest gap between the two largest logits over all positions."""
    top2 = np.sort(logits, axis=-1)[:, -2:]
    return float(np.min(top2[:, 1] - top2[:, 0]))


def table_row(directory: Path, spec: FixtureSpec, config: Qwen3Config, logits: np.ndarray) -> dict:
    """Summarise one fixture for the final table."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    return {
        "name": spec.name,
        "style": spec.config_style,
        "L": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "heads/kv(grp)": f"{heads}/{kv_heads}({heads // kv_heads})",
        "head_dim(h/H)": f"{config.head_dim}({config.hidden_size // heads})",
        "vocab": config.vocab_size,
        "tied": "yes" if config.tie_word_embeddings else "no",
        "theta": f"{config.rope_parameters['rope_theta']:.0e}",
        "eps": f"{config.rms_norm_eps:.0e}",
        "files": len(checkpoint_files(directory)),
        "T": spec.seq_len,
        "ckpt KB": round(sum(p.stat().st_size for p in checkpoint_files(directory)) / 1024),
        "npz KB": round((directory / "reference.npz").stat().st_size / 1024),
        "max|logit|": f"{np.abs(logits).max():.2f}",
        "min top2 gap": f"{min_top2_margin(logits):.1e}",
    }


def print_table(rows: list[dict]) -> None:
    """Print rows as an aligned plain-text table."""
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(str(row[c])) for row in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(str(row[c]).ljust(widths[c]) for c in columns))


def main() -> None:
    """Build every fixture and print the summary table."""
    rows = [build_fixture(spec) for spec in FIXTURES]
    total_kb = sum(
        path.stat().st_size for spec in FIXTURES for path in (FIXTURES_DIR / spec.name).iterdir()
    ) / 1024
    print_table(rows)
    print(f"{len(rows)} fixtures in {FIXTURES_DIR}, {total_kb:.0f} KB in total")


if __name__ == "__main__":
    main()
