"""OpenAI-shaped error responses: ``{"error": {"message", "type", "code", "param"}}``.

Every failure the server reports — bad JSON, invalid fields, unknown routes, a full queue, an
engine error — leaves through one of the handlers installed here, so a client always gets the
same shape and the process never dies of a request.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("moe_offload.server")

# OpenAI's error types by HTTP status; anything else is a server_error.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


class APIError(Exception):
    """An error to return to the client as an OpenAI-shaped JSON body."""

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 param: str | None = None, error_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.error_type = error_type or _TYPE_BY_STATUS.get(status, "server_error")
        self.headers = headers
        self.extra: dict = {}       # more fields of the error object (llama-server's numbers)

    def body(self) -> dict:
        """The JSON body: ``{"error": {"message", "type", "param", "code", ...extra}}``."""
        body = error_body(self.message, self.error_type, self.code, self.param)
        body["error"].update(self.extra)
        return body

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# Anthropic's error types by HTTP status (the Messages API's own shape)
_ANTHROPIC_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error",
                             403: "permission_error", 404: "not_found_error",
                             405: "invalid_request_error", 413: "request_too_large",
                             429: "rate_limit_error",
                             503: "overloaded_error"}


def anthropic_error_body(err: APIError) -> dict:
    """``{"type": "error", "error": {"type", "message"}}``, as Anthropic's API answers."""
    kind = _ANTHROPIC_TYPE_BY_STATUS.get(err.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def anthropic_response(err: APIError) -> JSONResponse:
    return JSONResponse(anthropic_error_body(err), status_code=err.status, headers=err.headers)


def error_body(message: str, error_type: str, code: str | None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _field_path(loc: tuple) -> str:
    # loc looks like ("body", "messages", 0, "role"); the leading "body" says nothing useful.
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts)


def validation_error(exc: RequestValidationError) -> APIError:
    """Turn FastAPI's validation failure (its 422) into our 400 ``invalid_request_error``."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "Invalid request.", code="invalid_request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "malformed JSON")
        return APIError(400, f"We could not parse the JSON body of your request ({detail}).",
                        code="invalid_json")
    loc = tuple(first.get("loc", ()))
    if loc == ("body",) and first.get("type") in ("missing", "model_attributes_type", "dict_type"):
        return APIError(400, "The request body must be a JSON object, sent with "
                             "Content-Type: application/json.", code="invalid_json")
    param = _field_path(loc) or None
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"{param}: this field is not supported by this server (it would "
                             "be ignored, so the request is refused)",
                        code="unsupported_parameter", param=param)
    msg = str(first.get("msg", "invalid value"))
    # pydantic prefixes custom errors with "Value error, "; the client needs only the reason.
    msg = msg.removeprefix("Value error, ")
    message = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    code = "missing_required_parameter" if first.get("type") == "missing" else "invalid_value"
    return APIError(400, message, code=code, param=param)


def pydantic_error(exc: ValidationError) -> APIError:
    """A pydantic model validated by hand (not by FastAPI) failed: the same 400."""
    return validation_error(RequestValidationError(exc.errors(include_url=False)))


def llama_error(err: APIError) -> dict:
    """llama-server's error object: the HTTP status as ``code``."""
    return {"error": {"code": err.status, "message": err.message, "type": err.error_type}
            | err.extra}


def _llama_response(err: APIError) -> JSONResponse:
    return JSONResponse(llama_error(err), status_code=err.status, headers=err.headers)


# The error shape of each API other than OpenAI's: the route modules register their paths here
# (at import) with the shape their clients read; every other path answers OpenAI's shape.
_SHAPES = {"anthropic": anthropic_response, "llama": _llama_response}
_PATH_SHAPES: dict[str, str] = {}
_PREFIX_SHAPES: dict[str, str] = {}


def register_route_shape(shape: str, paths: frozenset[str] = frozenset(),
                         prefixes: tuple[str, ...] = ()) -> None:
    """Errors on ``paths`` (and on paths under ``prefixes``) take ``shape``'s form
    ("anthropic" or "llama")."""
    if shape not in _SHAPES:
        raise ValueError(f"unknown error shape {shape!r} (known: {', '.join(_SHAPES)})")
    _PATH_SHAPES.update(dict.fromkeys(paths, shape))
    _PREFIX_SHAPES.update(dict.fromkeys(prefixes, shape))


def route_shape(path: str) -> str:
    """The error shape of the API ``path`` belongs to ("openai" when none registered it)."""
    shape = _PATH_SHAPES.get(path)
    if shape is None:
        shape = next((s for p, s in _PREFIX_SHAPES.items() if path.startswith(p)), "openai")
    return shape


def route_response(path: str, err: APIError) -> JSONResponse:
    """``err`` in the shape of the API ``path`` belongs to: Anthropic's on its Messages
    routes, llama-server's on its own, OpenAI's everywhere else."""
    shape = route_shape(path)
    return err.response() if shape == "openai" else _SHAPES[shape](err)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error path of the app through the error shape of the route's API."""

    def answer(request: Request, err: APIError) -> JSONResponse:
        return route_response(request.url.path, err)

    @app.exception_handler(ValidationError)
    async def _invalid_model(request: Request, exc: ValidationError) -> JSONResponse:
        return answer(request, pydantic_error(exc))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err = APIError(404, f"Unknown request URL: {request.method} {request.url.path}.",
                           code="unknown_url")
        elif exc.status_code == 405:
            err = APIError(405, f"Method {request.method} is not allowed for "
                                f"{request.url.path}.", code="method_not_allowed")
        elif exc.status_code == 400:     # FastAPI could not read the body (not JSON text)
            err = APIError(400, f"We could not parse the JSON body of your request "
                                f"({exc.detail}).", code="invalid_json")
        else:
            err = APIError(exc.status_code, str(exc.detail), code=None)
        if exc.headers:
            err.headers = dict(exc.headers)
        return answer(request, err)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Last resort: handlers should have turned engine failures into APIError(500) already.
        log.exception("unhandled error in request")
        return answer(request, APIError(500, f"Internal server error: {type(exc).__name__}: "
                                             f"{exc}", code="internal_error"))
