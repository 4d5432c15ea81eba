"""engine/budget.py: the context a run gets, the blocks a pool holds and the prefill chunks, each rule in one
function that every caller asks (no module of the package writes a second formula for them)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from qwen_np import QwenNPError
from qwen_np.core.config import Qwen3Config
from qwen_np.core.defaults import DEFAULT_CONTEXT
from qwen_np.engine.budget import BLOCK_SIZE, PREFILL_CHUNK, context_for, pool_blocks, prefill_chunks

PACKAGE = Path(__file__).resolve().parents[2] / "qwen_np"


def config(positions: int) -> Qwen3Config:
    return Qwen3Config(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=4, max_position_embeddings=positions)


def test_the_context_is_the_asked_else_the_default_never_past_the_models():
    big, small = config(40960), config(1000)
    assert context_for(big) == DEFAULT_CONTEXT and context_for(small) == 1000
    assert context_for(big, 123) == 123 and context_for(small, 5000) == 1000
    assert context_for(big, default=None) == 40960 and context_for(big, default=2048) == 2048


def test_a_context_past_the_models_is_an_error_naming_its_parameter_where_one_is_given():
    with pytest.raises(QwenNPError, match="1000 positions") as raised:
        context_for(config(1000), 1001, param="context")
    assert raised.value.param == "context"
    assert context_for(config(1000), 1000, param="context") == 1000


def test_a_pool_holds_each_rows_blocks_and_prefill_covers_a_prompt_in_chunks():
    assert pool_blocks([1, BLOCK_SIZE, BLOCK_SIZE + 1, 0]) == 1 + 1 + 2
    for tokens in (1, PREFILL_CHUNK - 1, PREFILL_CHUNK, 2 * PREFILL_CHUNK + 3):
        chunks = prefill_chunks(tokens)
        assert [i for chunk in chunks for i in range(tokens)[chunk]] == list(range(tokens))
        assert all(1 <= chunk.stop - chunk.start <= PREFILL_CHUNK for chunk in chunks)
        assert all(chunk.stop - chunk.start == PREFILL_CHUNK for chunk in chunks[:-1])


def test_no_module_but_budget_writes_a_context_pool_or_chunk_formula():
    """The second formulas the budget replaced: min(..., max_position_embeddings), a block count multiplied
    or summed, a range() stepping by PREFILL_CHUNK."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "budget.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            text = ast.unparse(node)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max") \
                    and "max_position_embeddings" in text:
                found.append(f"{path.name}: {text}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range" \
                    and "PREFILL_CHUNK" in text:
                found.append(f"{path.name}: {text}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "BlockPool" \
                    and "blocks_for" in text:
                found.append(f"{path.name}: {text}")
    assert not found
