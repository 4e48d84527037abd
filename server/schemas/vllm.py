"""vLLM's bodies: /classify, /pooling, /score (vLLM's pooling protocols).
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from server.schemas.common import _Inference, _whole_int


# -1 (the server's maximum) or a token count; 18.0 is 18 (see server/schemas/common.py)
TruncateTokens = Annotated[StrictInt, Field(ge=-1), BeforeValidator(_whole_int)]


def _truncate_tokens(schema: dict[str, Any], *, allowed: tuple[dict, ...]) -> None:
    schema["properties"]["truncate_prompt_tokens"]["anyOf"] = [*allowed, {"type": "null"}]


MINUS_ONE = {"type": "integer", "enum": [-1]}


class _VllmBody(_Inference):
    # truncate_prompt_tokens 0 is a 422
    model_config = ConfigDict(extra="ignore", json_schema_extra=lambda schema: _truncate_tokens(
        schema, allowed=(MINUS_ONE, {"type": "integer", "minimum": 1})))

    model: StrictStr | None = None
    user: StrictStr | None = None
    truncate_prompt_tokens: TruncateTokens | None = Field(
        None, description="keep the last n tokens of each input (-1: the server's maximum)")


class ClassifyRequest(_VllmBody):
    inputs_field: ClassVar[str] = "input"
    inputs_name: ClassVar[str] = "input"
    input: Union[StrictStr, list[StrictStr]]


class PoolingRequest(ClassifyRequest):
    encoding_format: Literal["float"] = "float"


class ScoreRequest(_VllmBody):
    """vLLM /score: `text_1` against one or many `text_2` (one text_1, or as many as text_2).
    A text_1 is never empty (a text_2 may be); server/http/openapi.py documents the pairing."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=lambda schema: _score_schema(schema))

    inputs_field: ClassVar[str] = "text_2"
    inputs_name: ClassVar[str] = "text_2"
    text_1: Union[StrictStr, list[StrictStr]]
    text_2: Union[StrictStr, list[StrictStr]]
    use_activation: StrictBool | None = Field(None, description="sigmoid of the score (default true)")

    @classmethod
    def count_inputs(cls, data: dict) -> int:
        """The larger side: `text_1` may hold as many texts as `text_2`."""
        return max(len(v) if isinstance(v, list) else 1 for v in (data.get("text_1"), data.get("text_2")))


def _score_schema(schema: dict[str, Any]) -> None:
    """/score takes only truncate_prompt_tokens -1; text_1 is never empty, text_2 never an empty list."""
    _truncate_tokens(schema, allowed=(MINUS_ONE,))
    props = schema["properties"]
    props["text_1"]["anyOf"] = [{"type": "string", "minLength": 1},
                                {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}]
    props["text_2"]["anyOf"] = [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "string"}}]
