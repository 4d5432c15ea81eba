"""qwen_np/serving/structured.py's readers of a body's nested objects, without a server: `tagged`, the one reader of
a `{"type": ...}` object (response_format, Responses' text.format, Anthropic's thinking and tool_choice)."""

from __future__ import annotations

import pytest

from qwen_np.errors import APIError
from qwen_np.serving.structured import tagged

KINDS = {"text": ("type",), "json_schema": ("type", "name", "schema")}
SHAPES = '{"type": "text"} or {"type": "json_schema", ...}'


def test_a_tagged_object_gives_its_kind_when_every_key_is_one_that_kind_reads() -> None:
    assert tagged({"type": "json_schema", "name": "x", "schema": {}}, KINDS, "text.format", SHAPES) == "json_schema"
    assert tagged({"type": "text"}, KINDS, "text.format", SHAPES) == "text"


@pytest.mark.parametrize("value, message, code", [
    ({"type": "xml"}, f"text.format: must be {SHAPES}", None),
    ("json_schema", f"text.format: must be {SHAPES}", None),
    ({"name": "x"}, f"text.format: must be {SHAPES}", None),
    ({"type": "text", "name": "x"}, "text.format.name: not a field of text.format (it reads type)", "unknown_field"),
])
def test_an_unknown_kind_or_key_is_a_400_naming_the_place_and_the_top_level_field(value, message, code) -> None:
    with pytest.raises(APIError) as refused:
        tagged(value, KINDS, "text.format", SHAPES)
    problem = refused.value
    assert (problem.status, problem.message, problem.param, problem.code) == (400, message, "text", code)
