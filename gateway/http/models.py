"""GET /v1/models and GET /v1/models/{id}: OpenAI's model list (one model: the served one,
with its context as `max_model_len`, as vLLM adds), behind the same API key as generation."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvmesh.engine.outcomes import FailureCause
from kvmesh.gateway.failure import RequestFailed
from kvmesh.gateway.http.errors import error_response, failure_response
from kvmesh.gateway.request_path import RequestPath


class ModelList:
    """The served model as OpenAI's model objects; `created` (Unix seconds) is the front's start."""

    def __init__(self, path: RequestPath, created: int) -> None:
        self.path = path
        self.created = created

    async def models(self, request: Request) -> Response:
        """GET /v1/models: OpenAI's model list (one model: the served one)."""
        try:
            return JSONResponse({"object": "list", "data": self._model_list(request)})
        except RequestFailed as failure:
            return failure_response(failure)

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id}: the served model, or 404."""
        try:
            models = self._model_list(request)
        except RequestFailed as failure:
            return failure_response(failure)
        wanted = request.path_params["model"]
        for m in models:
            if m["id"].lower() == wanted.lower():
                return JSONResponse(m)
        return error_response(404, f"unknown model {wanted[:64]!r}", FailureCause.UNKNOWN_MODEL, "model")

    def _model_list(self, request: Request) -> list[dict]:
        """The model objects; raises RequestFailed when the key is refused."""
        info = self.path.models(request.headers.get("authorization"))
        return [
            {
                "id": m,
                "object": "model",
                "created": self.created,
                "owned_by": "kvmesh",
                "max_model_len": info.max_context_tokens,
            }
            for m in info.models
        ]
