"""Bodies of the compatibility routes: TEI's extra routes, Cohere's v1/v2 embed and v2 rerank,
OpenAI's model list (pydantic v2).

Same rules as server/schemas.py: strict types where coercion would hide a client bug, unknown
fields ignored so SDKs that send extras (``priority``, ``max_tokens_per_doc``) keep working.
A field we accept but cannot honour (Cohere ``images``, int8 embeddings) is refused in the route
with a 422 that names it, never silently dropped. Each request body names the list that
server/bodies.py counts before validation (``inputs_field``/``count_inputs``).
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictStr, Tag

from server.routes.schemas import (CohereResult, Direction, DocumentsBody, Info, OpenAIUsage, TokenIds, PositiveInt,
                                   _Body, _Inference, _whole)


# -- TEI ---------------------------------------------------------------------------------------
class SimilarityInput(_Body):
    source_sentence: StrictStr
    sentences: list[StrictStr]


class SimilarityParameters(_Body):
    truncate: StrictBool | None = None
    truncation_direction: Direction = "right"
    prompt_name: StrictStr | None = None


class SimilarityRequest(_Inference):
    inputs_name: ClassVar[str] = "sentences"

    inputs: SimilarityInput
    parameters: SimilarityParameters | None = None

    @classmethod
    def count_inputs(cls, data: dict) -> int:
        """The source sentence plus each of ``inputs.sentences`` (each is one embedded input)."""
        inputs = data.get("inputs")
        sentences = inputs.get("sentences") if isinstance(inputs, dict) else None
        return 1 + len(sentences) if isinstance(sentences, list) else 1


class EmbedAllRequest(_Inference):
    inputs: Union[StrictStr, list[StrictStr]]
    truncate: StrictBool | None = Field(None, description="default: the server's --auto-truncate")
    truncation_direction: Direction = "right"
    prompt_name: StrictStr | None = None


def _ids_shape(value: Any) -> str | None:
    """One id list or a batch of them, judged from the first item (None: neither)."""
    if not isinstance(value, list):
        return None
    first = value[0] if value else 0
    return "ids" if _whole(first) else "batch" if isinstance(first, list) else None


# One branch validated per body (a plain Union collected one error per bad id of each branch).
DecodeIds = Annotated[
    Union[Annotated[TokenIds, Tag("ids")], Annotated[list[TokenIds], Tag("batch")]],
    Discriminator(_ids_shape, custom_error_type="ids_shape",
                  custom_error_message="ids must be a list of token ids or a list of token id lists"),
]


class DecodeRequest(_Body):
    inputs_field: ClassVar[str] = "ids"
    inputs_name: ClassVar[str] = "id lists"

    ids: DecodeIds
    skip_special_tokens: StrictBool = True

    @classmethod
    def count_inputs(cls, data: dict) -> int:
        return len(data["ids"]) if _ids_shape(data.get("ids")) == "batch" else 1


# -- Cohere ------------------------------------------------------------------------------------
CohereInputType = Literal["search_query", "search_document", "classification", "clustering", "image"]


def _texts_only(schema: dict[str, Any]) -> None:
    """The documented body is what the route serves: ``texts`` required (a list of strings),
    ``images`` and ``inputs`` null or absent, input_type not "image", embedding_types float and/or
    base64 (each of the others is a 422 naming it)."""
    props = schema["properties"]
    props["texts"] = {"type": "array", "items": {"type": "string"}, "title": "Texts"}
    for name in ("images", "inputs"):
        props[name] = {"type": "null", "description": "not supported (text models): 422 unless null"}
    props["input_type"]["anyOf"][0]["enum"] = [t for t in props["input_type"]["anyOf"][0]["enum"] if t != "image"]
    props["embedding_types"]["anyOf"][0].update(items={"enum": ["float", "base64"]}, minItems=1)
    schema["required"] = ["texts"]


class CohereEmbedRequest(_Inference):
    model_config = ConfigDict(extra="ignore", json_schema_extra=_texts_only)
    inputs_field: ClassVar[str] = "texts"
    inputs_name: ClassVar[str] = "texts"

    texts: list[StrictStr] | None = None
    images: list[StrictStr] | None = Field(None, description="not supported (text models): 422")
    inputs: list[dict] | None = Field(None, description="not supported: use texts")
    model: StrictStr | None = None
    input_type: CohereInputType | None = Field(
        None, description="search_query: the model's query prompt; others: the document prompt"
    )
    embedding_types: list[StrictStr] | None = Field(None, description="float and/or base64")
    output_dimension: PositiveInt | None = Field(None, description="Matryoshka dimensions")
    truncate: Literal["NONE", "START", "END"] | None = Field(None, description="NONE refuses long inputs")


class CohereV2RerankRequest(_Inference):
    inputs_field: ClassVar[str] = "documents"
    inputs_name: ClassVar[str] = "documents"

    query: StrictStr
    documents: list[StrictStr]
    model: StrictStr | None = None
    top_n: PositiveInt | None = None


class DocumentsRerankRequest(DocumentsBody):
    """/rerank in the Cohere/Jina/Infinity/vLLM shape (``documents`` rather than TEI's ``texts``).
    ``return_documents`` unset answers the documents, as vLLM always does; false leaves them out."""

    return_documents: StrictBool | None = None
    instruction: StrictStr | None = Field(None, description="default: the model family's reranker instruction")


class DocumentsRerankResponse(BaseModel):
    """vLLM's rerank answer (Jina's and Cohere v1's results, OpenAI's usage)."""

    id: str
    model: str
    results: list[CohereResult]  # Jina's and Cohere v1's result shape
    usage: OpenAIUsage


class InfinityRerankRequest(DocumentsBody):
    return_documents: StrictBool = False
    raw_scores: StrictBool = False


class InfinityRerankResult(BaseModel):
    relevance_score: float
    index: int
    document: str | None = None


class InfinityRerankResponse(BaseModel):
    """Infinity's rerank answer: a returned document is a plain string."""

    object: Literal["rerank"] = "rerank"
    results: list[InfinityRerankResult]
    model: str
    usage: OpenAIUsage
    id: str
    created: int


class CohereApiVersion(BaseModel):
    version: str


class CohereBilled(BaseModel):
    input_tokens: int | None = None
    search_units: int | None = None


class CohereMeta(BaseModel):
    api_version: CohereApiVersion
    billed_units: CohereBilled


class CohereV2Result(BaseModel):
    index: int
    relevance_score: float


class CohereV2RerankResponse(BaseModel):
    id: str
    results: list[CohereV2Result]
    meta: CohereMeta


class CohereEmbeddings(BaseModel):
    float_: list[list[float]] | None = Field(None, alias="float")
    base64: list[str] | None = None


class CohereEmbedResponse(BaseModel):
    id: str
    response_type: Literal["embeddings_floats", "embeddings_by_type"] | None = None
    embeddings: Union[CohereEmbeddings, list[list[float]]]
    texts: list[str]
    meta: CohereMeta


# -- OpenAI ------------------------------------------------------------------------------------
class OpenAIModel(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class OpenAIModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIModel]


# -- /info -------------------------------------------------------------------------------------
class InfoCompat(Info):
    """Our /info: TEI's fields where they apply, plus the radix fields."""

    model_sha: str | None = Field(None, description="the hub snapshot's commit; null for a local directory")
    served_model_name: str
    auto_truncate: bool
    tokenization_workers: int
    api_server_count: int = Field(1, description="processes serving the HTTP API (--api-server-count)")
    sha: str | None = Field(None, description="TEI's build commit; null (not recorded in this build)")
    docker_label: str | None = None
    prompts: dict[str, str] = Field(default_factory=dict, description="the model's sentence-transformers prompts")
