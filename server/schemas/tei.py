"""TEI's bodies: /embed, /rerank (texts or documents), /tokenize, /decode, /similarity,
/embed_all, /predict and /info (TEI's router/src/http/types.rs).
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictStr, Tag

from server.schemas.cohere import CohereResult
from server.schemas.common import Direction, DocumentsBody, PositiveInt, TokenIds, _Body, _Inference, _pairs, _whole
from server.schemas.openai import OpenAIUsage



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
    cuda_graphs: dict = Field(default_factory=dict, description="--cuda-graphs: mode, state (which input lengths "
                              "a CUDA graph serves, or off and why) and per bucket graph or eager and why")
    batching_policy: str
    startup: dict[str, float] = Field(default_factory=dict, description="launch to healthy: stage -> seconds, and total")
    version: str


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


class DocumentsRerankRequest(DocumentsBody):
    """/rerank in the Cohere/Jina/Infinity/vLLM shape (``documents`` rather than TEI's ``texts``).
    ``return_documents`` unset answers the documents, as vLLM always does; false leaves them out."""

    return_documents: StrictBool | None = None
    raw_scores: StrictBool = Field(False, description="Infinity's: the raw score rather than its sigmoid")
    instruction: StrictStr | None = Field(None, description="default: the model family's reranker instruction")


class DocumentsRerankResponse(BaseModel):
    """vLLM's rerank answer (Jina's and Cohere v1's results, OpenAI's usage)."""

    id: str
    model: str
    results: list[CohereResult]  # Jina's and Cohere v1's result shape
    usage: OpenAIUsage


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


class PredictRequest(_Inference):
    """TEI: `inputs` a string, a pair [str, str], or a batch [[str] or [str, str], ...]."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=_pairs)

    inputs: Union[StrictStr, list[StrictStr], list[list[StrictStr]]]
    truncate: StrictBool | None = Field(None, description="default: the server's --auto-truncate")
    truncation_direction: Direction = Field("right", description="Right or Left (any case)")
    raw_scores: StrictBool = Field(False, description="the head's logits instead of softmax/sigmoid")


class Prediction(BaseModel):
    """One label's answer of TEI's /predict."""

    score: float
    label: str
