"""The ``model`` a request names: which names this one-model server answers to.

Two servers, two answers. TEI ignores the field (its OpenAI route reads it and never looks at it),
so a client's default name (the OpenAI SDK examples' ``text-embedding-3-small``, LangChain's
``text-embedding-ada-002``, litellm's ``openai/...``, a README's hub id) reaches the one model it
serves. vLLM answers 404 for a name it does not serve, so a client configured for another model
learns it instead of getting this model's vectors in silence. radixserve does the first when it
was started without ``--served-model-name`` (nothing names the model, so no name can be wrong), and
the second when it was: then a request's ``model`` must be one of the served names, the model id
or Infinity's client's default ``default/not-specified``; any other is a 404 ``model_not_found``
naming the ones served. No ``model`` at all is always served.
"""
from __future__ import annotations

from dataclasses import dataclass

from server.http.errors import ApiError

# The model name Infinity's own client sends unless told: Infinity serves its default model.
INFINITY_DEFAULT_MODEL = "default/not-specified"


@dataclass(frozen=True)
class ModelNames:
    """``reported``: the name answers carry; ``enforced``: the names a request may give (None: any)."""

    reported: str
    enforced: frozenset[str] | None = None

    @classmethod
    def of(cls, *, served: tuple[str, ...], model_id: str) -> "ModelNames":
        """``served``: --served-model-name's names (empty when it was not given)."""
        if not served:
            return cls(reported=model_id)
        return cls(reported=served[0], enforced=frozenset((*served, model_id, INFINITY_DEFAULT_MODEL)))

    def check(self, model: str | None) -> None:
        """404 ``model_not_found`` for a name this server does not answer to (vLLM's answer)."""
        if model is None or self.enforced is None or model in self.enforced:
            return
        served = ", ".join(f"`{n}`" for n in sorted(self.enforced - {INFINITY_DEFAULT_MODEL}))
        raise ApiError(
            "model_not_found",
            f"The model `{model}` does not exist. This server was started with --served-model-name and "
            f"answers to {served}; send one of them, leave `model` out, or add the name to "
            "--served-model-name NAME[,NAME...]")
