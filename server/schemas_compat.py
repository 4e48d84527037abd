"""Bodies of the compatibility routes: TEI's extra routes, Cohere's v1/v2 embed and v2 rerank,
OpenAI's model list (pydantic v2).

Same rules as server/schemas.py: strict types where coercion would hide a client bug, unknown
fields ignored so SDKs that send extras (``priority``, ``max_tokens_per_doc``) keep working.
A field we accept but cannot honour (Cohere ``images``, int8 embeddings) is refused in the route
with a 422 that names it, never silently dropped.
"""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr

from server.schemas import Direction, Info, _Body


# -- TEI ---------------------------------------------------------------------------------------
class SimilarityInput(_Body):
    source_sentence: StrictStr
    sentences: list[StrictStr]


class SimilarityParameters(_Body):
    truncate: StrictBool | None = None
    truncation_direction: Direction = "right"
    prompt_name: StrictStr | None = None


class SimilarityRequest(_Body):
    inputs: SimilarityInput
    parameters: SimilarityParameters | None = None


class EmbedAllRequest(_Body):
    inputs: Union[StrictStr, list[StrictStr]]
    truncate: StrictBool | None = Field(None, description="default: the server's --auto-truncate")
    truncation_direction: Direction = "right"
    prompt_name: StrictStr | None = None


class DecodeRequest(_Body):
    ids: Union[list[StrictInt], list[list[StrictInt]]]
    skip_special_tokens: StrictBool = True


# -- Cohere ------------------------------------------------------------------------------------
CohereInputType = Literal["search_query", "search_document", "classification", "clustering", "image"]


class CohereEmbedRequest(_Body):
    texts: list[StrictStr] | None = None
    images: list[StrictStr] | None = Field(None, description="not supported (text models): 422")
    inputs: list[dict] | None = Field(None, description="not supported: use texts")
    model: StrictStr | None = None
    input_type: CohereInputType | None = Field(
        None, description="search_query: the model's query prompt; others: the document prompt"
    )
    embedding_types: list[StrictStr] | None = Field(None, description="float and/or base64")
    output_dimension: StrictInt | None = Field(None, ge=1, description="Matryoshka dimensions")
    truncate: Literal["NONE", "START", "END"] | None = Field(None, description="NONE refuses long inputs")


class CohereV2RerankRequest(_Body):
    query: StrictStr
    documents: list[StrictStr]
    model: StrictStr | None = None
    top_n: StrictInt | None = Field(None, ge=1)


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
    sha: str | None = Field(None, description="TEI's build commit; null (not recorded in this build)")
    docker_label: str | None = None
    prompts: dict[str, str] = Field(default_factory=dict, description="the model's sentence-transformers prompts")
