"""Request and response bodies of every route, in each ecosystem's dialect (pydantic v2).

Types are strict where a lax coercion would hide a client bug (token ids must be JSON integers,
texts must be JSON strings); a number without a fraction (``18.0``) is the integer JSON Schema
says it is, while ``18.5``, ``"18"`` and ``true`` are refused; unknown fields are ignored so SDKs that send extras keep working.
Semantic checks that need the model (dimensions vs hidden size, vocabulary, prompt names, input
length) happen in the routes, which answer 422 in the same body format.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, PlainValidator, StrictBool,
    StrictInt, StrictStr, Tag, WithJsonSchema,
)


class _Body(BaseModel):
    """A request body. ``inputs_field`` names the list that ``count_inputs`` counts before any
    per-item validation (server/bodies.py refuses more than the server's maximum there)."""

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


# -- TEI ---------------------------------------------------------------------------------------
class EmbedRequest(_Inference):
    inputs: Union[StrictStr, list[StrictStr]]
    truncate: StrictBool | None = Field(None, description="default: the server's --auto-truncate")
    truncation_direction: Direction = Field("right", description="Right or Left (any case)")
    prompt_name: StrictStr | None = Field(None, description="a key of the model's prompts")
    normalize: StrictBool = True
    dimensions: PositiveInt | None = Field(None, description="Matryoshka: keep the first n dims")


class RerankRequest(_Inference):
    inputs_field: ClassVar[str] = "texts"
    inputs_name: ClassVar[str] = "texts"

    query: StrictStr
    texts: list[StrictStr]
    truncate: StrictBool | None = None
    truncation_direction: Direction = "right"
    raw_scores: StrictBool = Field(False, description="false: sigmoid(logit(yes) - logit(no))")
    return_text: StrictBool = False
    instruction: StrictStr | None = Field(None, description="default: the model family's reranker instruction")


class Rank(BaseModel):
    index: int
    score: float
    text: str | None = None


class TokenizeRequest(_Body):
    inputs: Union[StrictStr, list[StrictStr]]
    add_special_tokens: StrictBool = True
    prompt_name: StrictStr | None = None


class SimpleToken(BaseModel):
    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


class Info(BaseModel):
    model_id: str
    model_dtype: str
    model_type: dict = Field(description='{"embedding": {"pooling": ...}}, {"reranker": {...}}, '
                                         '{"classifier": {"id2label": ...}} or {"reward": {...}}')
    head: str = Field("pooling", description="pooling, yes-no (two lm_head rows) or score (a classification head)")
    routes: list[str] = Field(default_factory=list, description="the POST routes that run this model")
    max_concurrent_requests: int
    max_input_length: int
    max_batch_tokens: int
    max_batch_requests: int | None
    max_client_batch_size: int
    radix_mlp_threshold: float
    radix_attention: str
    attention_backend: str
    attention_backend_rejected: dict[str, str] = Field(default_factory=dict)
    tree_attention: str = Field("off", description='the policy and the path that runs, e.g. "auto (cpu-flash)"')
    linear: str = "F.linear"  # "onednn-packed": CPU float32 linears on weights packed at load
    linear_choice: str = Field("", description='the CPU linear weights\' precision and kernel, and what was '
                               'measured at load, e.g. "int8: int8-dynamic (1.31x int8-rowwise ...)"')
    cpu_attention: str = Field("", description='CPU float32: the kernel of large attention blocks and '
                               'what was measured at load, e.g. "onednn-tiles for large blocks (1.29x '
                               'the flash kernel at 2 threads)"; "" off the CPU')
    prefix_cache: dict = Field(default_factory=dict,
                               description="the prefix cache's size: tokens, bytes, bytes_per_token, why")
    memory: dict[str, int] = Field(default_factory=dict,
                                   description="weights_bytes; on CUDA allocated_bytes and reserved_bytes after load")
    batching_policy: str
    startup: dict[str, float] = Field(default_factory=dict, description="launch to healthy: stage -> seconds, and total")
    version: str


# -- OpenAI ------------------------------------------------------------------------------------
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


# -- Cohere / Jina -----------------------------------------------------------------------------
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


class CohereRerankRequest(DocumentsBody):
    return_documents: StrictBool = False


class CohereResult(BaseModel):
    index: int
    relevance_score: float
    document: Document | None = None


class CohereUsage(BaseModel):
    total_tokens: int


class CohereRerankResponse(BaseModel):
    model: str
    results: list[CohereResult]
    usage: CohereUsage
