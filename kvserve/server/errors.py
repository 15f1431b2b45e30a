"""OpenAI-style errors: every failure becomes ``{"error": {"message", "type", "param", "code"}}``
with a 4xx status that fits, never a bare 500 or a crash; and strict JSON body parsing."""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.sampling_params import InvalidRequestError

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def from_exception(e: BaseException) -> APIError:
    """Map any exception raised while handling a request to an APIError."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequestError):
        return APIError(400, str(e), e.param, "invalid_value")
    if isinstance(e, ValidationError):
        return validation_error(e)
    log.exception("unexpected error", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}", type_="server_error", code="internal_error")


def _loc_to_param(loc) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "int", "list[str]", "list[int]", "list[list[int]]", "float", "bool") or "[" in str(part):
            continue  # union branch names, not fields
        else:
            out += ("." if out else "") + str(part)
    return out


def validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    param = _loc_to_param(err["loc"])
    got = err.get("input")
    got_text = "" if isinstance(got, (dict, list)) and len(str(got)) > 80 else f" (got {got!r})"
    return APIError(400, f"{param}: {err['msg']}{got_text}", param or None, "invalid_type")


async def parse_body(request: Request, model: type[BaseModel], max_bytes: int) -> BaseModel:
    """Read and validate a JSON object body. 413 when larger than ``max_bytes``; 400 for broken JSON,
    a body that is not an object, or fields of the wrong type."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise APIError(413, f"request body of {length} bytes exceeds the limit of {max_bytes} bytes",
                       code="request_too_large")
    # A chunked upload has no Content-Length: read until past the limit, not whole (request.body() held
    # a 300 MB upload in memory before the 413, in an adversarial review).
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"request body exceeds the limit of {max_bytes} bytes", code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        data = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer past Python's 4,300 digits
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # arrays or objects nested past the parser's recursion limit (~1,000 levels)
        raise APIError(400, "request body is not valid JSON: nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, e: APIError):
        return e.response()

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, e: InvalidRequestError):
        # A handler for ``Exception`` runs in Starlette's ServerErrorMiddleware, which re-raises after
        # answering (logged as a crash, connection dropped): user errors need their own handler.
        return from_exception(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return APIError(e.status_code, str(e.detail), code=code).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        err = e.errors()[0]
        param = _loc_to_param(err["loc"][1:] if err["loc"] and err["loc"][0] == "body" else err["loc"])
        return APIError(400, f"{param}: {err['msg']}", param or None, "invalid_type").response()

    @app.exception_handler(Exception)
    async def _any(_: Request, e: Exception):
        return from_exception(e).response()
