"""Cohere's bodies (and Jina's, which share /v1/rerank): v1/v2 embed, v1/v2 rerank. A field accepted
but not honoured (``images``, int8 embeddings) is refused in the route with a 422 that names it.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from server.schemas.common import Document, DocumentsBody, PositiveInt, _Inference


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
