"""Images in requests: what each route's image parts carry (base64 data), checked and turned
into the engine's ``MediaPrompt`` (runtime/engine/projector.py) with the server's ``--mmproj``.

The routes' shapes, as llama-server takes them:

- OpenAI chat: ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``
  content parts (schemas.ImagePart);
- Anthropic: ``{"type": "image", "source": {"type": "base64", "media_type": ..., "data":
  ...}}`` blocks, turned into the chat's image parts (anthropic/routes.py);
- llama-server ``/completion``: ``{"prompt_string": "... <__media__> ...",
  "multimodal_data": ["<base64>", ...]}``.

Each image stands where the prompt text holds a media marker (``MEDIA_MARKER``): the chat
routes put one where each image part is. Images come inline only: a URL to fetch is refused
(the server fetches nothing for a client). Every failure is a 400 naming the part.
"""
from __future__ import annotations

import base64
import binascii
from typing import Any

from runtime.engine.projector import ImageError, MediaPrompt
from runtime.server.errors import APIError
from runtime.server.schemas import MEDIA_MARKER

__all__ = ["MEDIA_MARKER", "image_bytes", "media_prompt", "require_projector", "anthropic_image"]
NO_PROJECTOR = ("needs a multimodal projector (llama-server's --mmproj), and this server has "
                "none: start it with --mmproj FILE (the model's mmproj GGUF)")


def image_bytes(data: Any, param: str, *, url: bool) -> bytes:
    """The bytes of one image: a ``data:[type];base64,...`` URL (``url``) or bare base64;
    a 400 naming ``param`` otherwise."""
    if not isinstance(data, str):
        raise APIError(400, f"{param}: must be a string", code="invalid_value", param=param)
    if url:
        if not data.startswith("data:"):
            raise APIError(400, f"{param}: only data: URLs (data:image/png;base64,...) are "
                                "taken; this server fetches no URL", code="invalid_value",
                           param=param)
        head, sep, data = data.partition(",")
        if not sep or not head.endswith(";base64"):
            raise APIError(400, f"{param}: a data: URL with base64 content is needed "
                                "(data:image/png;base64,...)", code="invalid_value", param=param)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{param}: not valid base64", code="invalid_value",
                       param=param) from None
    if not raw:
        raise APIError(400, f"{param}: an empty image", code="invalid_value", param=param)
    return raw


def anthropic_image(source: Any, param: str) -> dict[str, Any]:
    """An Anthropic image block's ``source`` as the chat's ``image_url`` part (a data: URL);
    a 400 naming ``param`` for a source that is not inline base64."""
    if not isinstance(source, dict) or source.get("type") != "base64":
        kind = source.get("type") if isinstance(source, dict) else type(source).__name__
        raise APIError(400, f"{param}: only base64 image sources are taken (got {kind!r}); "
                            "this server fetches no URL", code="invalid_value", param=param)
    media_type, data = source.get("media_type"), source.get("data")
    if not isinstance(media_type, str) or not isinstance(data, str):
        raise APIError(400, f"{param}: a base64 source needs media_type and data strings",
                       code="invalid_value", param=param)
    return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}


def require_projector(engine: Any, param: str, what: str = "image input") -> Any:
    """The engine's projector, or the 400 naming what is missing."""
    projector = getattr(engine, "projector", None)
    if projector is None:
        raise APIError(400, f"{param}: {what} {NO_PROJECTOR}", code="invalid_value",
                       param=param)
    if not projector.vision:
        raise APIError(400, f"{param}: {what} needs a projector with a vision encoder; "
                            f"{projector.path} has none", code="invalid_value", param=param)
    return projector


def media_prompt(engine: Any, text: str, images: list[bytes], param: str) -> MediaPrompt:
    """``text`` with ``images`` at its markers as the engine's prompt; a 400 naming
    ``param`` for an image that does not decode or markers that do not match."""
    projector = require_projector(engine, param)
    try:
        return projector.prompt(text, images)
    except ImageError as exc:
        raise APIError(400, f"{param}: {exc}", code="invalid_value", param=param) from None
