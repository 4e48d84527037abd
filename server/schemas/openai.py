"""OpenAI's bodies: /v1/embeddings and the model list.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, Discriminator, Field, StrictStr, Tag

from server.schemas.common import NonNegativeInt, TokenIds, _Inference, _whole


def _input_shape(value: Any) -> str | None:
    """Which form an OpenAI ``input`` takes, judged from its first item (None: none of them)."""
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list):
        return None
    first = value[0] if value else ""
    if isinstance(first, str):
        return "texts"
    if _whole(first):
        return "ids"
    if isinstance(first, list):
        return "batch"
    return None


# One branch validated per body: a plain Union tried every form and collected one error per item
# of each failed form.
OpenAIInput = Annotated[
    Union[
        Annotated[StrictStr, Tag("text")],
        Annotated[list[StrictStr], Tag("texts")],
        Annotated[TokenIds, Tag("ids")],
        Annotated[list[TokenIds], Tag("batch")],
    ],
    Discriminator(
        _input_shape,
        custom_error_type="input_shape",
        custom_error_message=(
            "input must be a string, a list of strings, a list of token ids or a list of token id lists"
        ),
    ),
]


class OpenAIEmbeddingRequest(_Inference):
    inputs_field: ClassVar[str] = "input"

    input: OpenAIInput

    @classmethod
    def count_inputs(cls, data: dict) -> int:
        value = data.get("input")
        return 1 if _input_shape(value) in ("text", "ids") else len(value) if isinstance(value, list) else 1
    model: StrictStr | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: NonNegativeInt | None = Field(None, description="Matryoshka: keep the first n dims; 0 (what "
                                         "Infinity's client always sends): full size")
    user: StrictStr | None = None


class OpenAIEmbedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    index: int


class OpenAIUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class OpenAIEmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIEmbedding]
    model: str
    usage: OpenAIUsage


class OpenAIModel(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class OpenAIModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIModel]
