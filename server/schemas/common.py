"""Shared pieces of every dialect's request bodies (pydantic v2): strict types where a lax coercion
would hide a client bug (token ids must be JSON integers, texts must be JSON strings); a number
without a fraction (``18.0``) is the integer JSON Schema says it is, while ``18.5``, ``"18"`` and
``true`` are refused; unknown fields are ignored so SDKs that send extras keep working.
Semantic checks that need the model (dimensions vs hidden size, vocabulary, prompt names, input
length) happen in the routes, which answer 422 in the same body format.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, StrictInt, StrictStr, WithJsonSchema


class _Body(BaseModel):
    """A request body. ``inputs_field`` names the list that ``count_inputs`` counts before any
    per-item validation (server/http/bodies.py refuses more than the server's maximum there)."""

    model_config = ConfigDict(extra="ignore")
    inputs_field: ClassVar[str] = "inputs"
    inputs_name: ClassVar[str] = "inputs"  # what the error message calls them

    @classmethod
    def count_inputs(cls, data: dict) -> int:
        value = data.get(cls.inputs_field)
        return len(value) if isinstance(value, list) else 1


class _Inference(_Body):
    """A body that runs the model: it may name a prefix-cache namespace."""

    cache_salt: StrictStr | None = Field(
        None, min_length=1, max_length=1024,
        description="prefix-cache namespace (as vLLM's cache_salt): cached prefixes are shared only between "
                    "requests with the same salt; none: the shared namespace")


def _direction(value: str) -> str:
    low = value.lower()
    if low not in ("right", "left"):
        raise ValueError("truncation_direction must be Right or Left")
    return low


Direction = Annotated[StrictStr, AfterValidator(_direction)]  # "Right"/"left"/... -> "right"|"left"


def _whole(value: Any) -> bool:
    """An integer, or a float without a fraction (JSON Schema's ``integer`` admits ``18.0``)."""
    return type(value) is int or (type(value) is float and value.is_integer())


def _whole_int(value: Any) -> Any:
    return int(value) if type(value) is float and value.is_integer() else value


# Strict integers that also take 18.0 as 18 (never 18.5, "18" or true). NOTE: the bound sits
# inside the Annotated, before the validator: a Field(ge=...) outside it lands in the JSON schema
# as a non-standard "ge" rather than "minimum".
PositiveInt = Annotated[StrictInt, Field(ge=1), BeforeValidator(_whole_int)]


NonNegativeInt = Annotated[StrictInt, Field(ge=0), BeforeValidator(_whole_int)]


def _token_ids(value: Any) -> list[int]:
    # NOTE: one check over the whole list in C (set of element types), and at most one error: a
    # per-element pydantic validator built one error object per bad id (hundreds of MB).
    if type(value) is not list:
        raise ValueError("expected a list of integer token ids")
    types = set(map(type, value))
    if types <= {int}:
        return value
    if types <= {int, float} and all(map(_whole, value)):
        return [int(v) for v in value]  # 18.0 is the id 18
    bad = next(i for i, v in enumerate(value) if not _whole(v))
    kind = "a float with a fraction" if type(value[bad]) is float else type(value[bad]).__name__
    raise ValueError(f"token ids must be JSON integers; item {bad} is {kind}")


TokenIds = Annotated[
    list[int], PlainValidator(_token_ids), WithJsonSchema({"type": "array", "items": {"type": "integer"}})
]


class Document(_Body):
    text: StrictStr


class DocumentsBody(_Inference):
    """A query and documents (str or {text}): what every Cohere/Jina-like rerank body shares."""

    inputs_field: ClassVar[str] = "documents"
    inputs_name: ClassVar[str] = "documents"

    query: StrictStr
    documents: list[Union[StrictStr, Document]]
    top_n: PositiveInt | None = None
    model: StrictStr | None = None


def _pairs(schema: dict[str, Any]) -> None:
    """An input is one string or a pair: every list of strings holds one or two."""
    for shape in schema["properties"]["inputs"]["anyOf"]:
        texts = shape.get("items", {}) if shape.get("items", {}).get("type") == "array" else shape
        if texts.get("type") == "array":
            texts.update(minItems=1, maxItems=2)
