"""Generate tests/fixtures/gradients/<name>/: tiny random Qwen3 checkpoints with torch autograd's
loss and gradients for one batch, so tests/training/test_gradients.py checks the backward pass without torch.

Usage (needs the `reference` extra, torch + transformers):

    python tests/reference/make_gradient_fixtures.py

Each folder holds the BF16 checkpoint (config.json, model.safetensors; the weights are BF16-exact, so
the FP32 model is the same function) and `reference.npz` with `batch` int64 [B, T+1], `loss` (the
FP32 loss of Qwen3ForCausalLM(input_ids=batch, labels=batch)) and one `grad/<tensor name>` per
parameter. Feeding all T+1 tokens with labels gives the same loss and gradients as feeding the first
T and predicting the last T (causality), which is what qwen_np.training.step.loss_and_gradients does.
"""

import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests dir, for `reference`

from reference.hf_reference import build_reference_model, make_config, save_bf16_checkpoint  # noqa: E402

FIXTURES_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "gradients"

# name -> (config fields, batch rows, sequence length T+1). Together: tied and untied heads, GQA, MHA
# and MQA, head_dim above and below hidden/heads, theta 1e4 and 1e6, B from 1 to 4.
SPECS = {
    "untied_gqa2_wide_heads": (dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    tie_word_embeddings=False), 3, 17),
    "tied_mha": (dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                      tie_word_embeddings=True, rope_theta=1e4, rms_norm_eps=1e-5), 2, 24),
    "untied_mqa_narrow_heads": (dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=1, head_dim=6,
                                     tie_word_embeddings=False), 4, 9),
    "tied_gqa4_single_row": (dict(hidden_size=32, num_attention_heads=8, num_key_value_heads=2, head_dim=4,
                                  tie_word_embeddings=True), 1, 33),
}
VOCAB, LAYERS, MLP = 80, 2, 56


def make_fixture(name: str, fields: dict, rows: int, length: int, seed: int) -> None:
    import torch

    config = make_config(vocab_size=VOCAB, intermediate_size=MLP, num_hidden_layers=LAYERS, **fields)
    model = build_reference_model(config, seed=seed)
    batch = np.random.default_rng(seed).integers(0, VOCAB, size=(rows, length), dtype=np.int64)
    model.train()
    ids = torch.from_numpy(batch)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    arrays = {"batch": batch, "loss": np.float64(loss.item())}
    arrays.update({f"grad/{n}": p.grad.numpy().astype(np.float32) for n, p in model.named_parameters()})
    folder = FIXTURES_DIR / name
    shutil.rmtree(folder, ignore_errors=True)
    save_bf16_checkpoint(model, folder)
    (folder / "generation_config.json").unlink(missing_ok=True)
    np.savez_compressed(folder / "reference.npz", **arrays)
    print(f"{name}: loss {loss.item():.6f}, {len(arrays) - 2} gradients")


def make_adamw_fixture(path: Path, steps: int = 10) -> None:
    """torch.optim.AdamW's trajectory on two tensors (a decayed matrix, an undecayed vector) over
    `steps` steps with a changing learning rate: what qwen_np.training.step.AdamW must reproduce."""
    import torch

    rng = np.random.default_rng(7)
    start = {"matrix": rng.standard_normal((6, 5)).astype(np.float32), "vector": rng.standard_normal(5).astype(np.float32)}
    grads = {name: rng.standard_normal((steps, *p.shape)).astype(np.float32) for name, p in start.items()}
    lrs = 3e-3 * (0.5 + np.arange(steps) / steps)
    params = {name: torch.tensor(p, requires_grad=True) for name, p in start.items()}
    optimizer = torch.optim.AdamW([{"params": [params["matrix"]], "weight_decay": 0.1},
                                   {"params": [params["vector"]], "weight_decay": 0.0}],
                                  lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    for step in range(steps):
        for name, p in params.items():
            p.grad = torch.from_numpy(grads[name][step])
        for group in optimizer.param_groups:
            group["lr"] = float(lrs[step])
        optimizer.step()
    np.savez_compressed(path, lrs=lrs, **{f"start/{n}": p for n, p in start.items()},
                        **{f"grads/{n}": g for n, g in grads.items()},
                        **{f"end/{n}": p.detach().numpy() for n, p in params.items()})
    print(f"{path.name}: {steps} AdamW steps")


if __name__ == "__main__":
    make_adamw_fixture(FIXTURES_DIR / "adamw_reference.npz")
    for number, (name, (fields, rows, length)) in enumerate(SPECS.items()):
        make_fixture(name, fields, rows, length, seed=100 + number)
