"""OpenAI's model routes: GET /v1/models and GET /v1/models/{id} (the served model only).

The id is --served-model-name (default: the model id); ``created`` is when the server started,
so a client that caches the list sees a restart. An unknown id answers 404 in OpenAI's error shape
(``NotFoundError`` in the SDK).
"""
from __future__ import annotations

import time

from fastapi import APIRouter

from server.errors import ApiError
from server.schemas_compat import OpenAIModel, OpenAIModelList


def build_router(*, model_name: str) -> APIRouter:
    router = APIRouter()
    model = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "radixserve"}

    @router.get("/v1/models", response_model=OpenAIModelList, tags=["OpenAI"])
    async def list_models() -> dict:
        """The one served model."""
        return {"object": "list", "data": [model]}

    @router.get("/v1/models/{model_id:path}", response_model=OpenAIModel, tags=["OpenAI"])
    async def get_model(model_id: str) -> dict:
        """The served model; any other id is 404."""
        if model_id != model_name:
            raise ApiError("not_found", f"The model '{model_id}' does not exist")
        return model

    return router
