"""Request bodies of the score-head routes: TEI's /predict, vLLM's /classify, /score, /pooling.

Shapes follow the originals (TEI's router/src/http/types.rs; vLLM's pooling protocols): unknown
fields are ignored, texts are strict JSON strings.
"""
from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Union

from pydantic import BaseModel, BeforeValidator, Field, StrictBool, StrictInt, StrictStr

from server.routes.schemas import Direction, _Inference, _whole_int

# -1 (the server's maximum) or a token count; 18.0 is 18 (see server/routes/schemas.py)
TruncateTokens = Annotated[StrictInt, Field(ge=-1), BeforeValidator(_whole_int)]


class PredictRequest(_Inference):
    """TEI: `inputs` a string, a pair [str, str], or a batch [[str] or [str, str], ...]."""

    inputs: Union[StrictStr, list[StrictStr], list[list[StrictStr]]]
    truncate: StrictBool | None = Field(None, description="default: the server's --auto-truncate")
    truncation_direction: Direction = Field("right", description="Right or Left (any case)")
    raw_scores: StrictBool = Field(False, description="the head's logits instead of softmax/sigmoid")


class _VllmBody(_Inference):
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
    """vLLM /score: `text_1` against one or many `text_2` (one text_1, or as many as text_2)."""

    inputs_field: ClassVar[str] = "text_2"
    inputs_name: ClassVar[str] = "text_2"
    text_1: Union[StrictStr, list[StrictStr]]
    text_2: Union[StrictStr, list[StrictStr]]
    use_activation: StrictBool | None = Field(None, description="sigmoid of the score (default true)")

    @classmethod
    def count_inputs(cls, data: dict) -> int:
        """The larger side: `text_1` may hold as many texts as `text_2`."""
        return max(len(v) if isinstance(v, list) else 1 for v in (data.get("text_1"), data.get("text_2")))



class Prediction(BaseModel):
    """One label's answer of TEI's /predict."""

    score: float
    label: str
