"""Request bodies of llama-server's native routes (``/completion``, ``/tokenize``).

As on the OpenAI routes, a field is honoured or refused with a 400 naming it: llama-server
takes many sampler knobs (mirostat, dry, xtc, ...) that this server does not implement, and
answering as if it had would be silently wrong.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from runtime.server.errors import APIError
from runtime.server.images import image_bytes, require_projector
from runtime.server.schemas import INT64

BAN = float("-inf")     # a logit bias that bans the token (llama-server's for false, ignore_eos)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None     # accepted, as llama-server does (a router picks the model by it)
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False

    @field_validator("parse_special")
    @classmethod
    def _special(cls, value: bool) -> bool:
        if not value:
            raise ValueError("parse_special=false is not supported (specials are parsed)")
        return value


@dataclass
class _Fields:
    """What ``prepare.sampling_params`` reads, with the server's defaults filled in."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repeat_penalty: float
    seed: int
    frequency_penalty: float
    presence_penalty: float
    stop: list[str]
    bias: dict[int, float]

    def stop_list(self) -> list[str]:
        return list(self.stop)

    def logit_bias_ids(self) -> dict[int, float]:
        return dict(self.bias)


class NativeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str | list[Any] | dict[str, Any]       # dict: {"prompt_string": ...}
    n_predict: int | None = Field(None, ge=-1)
    max_tokens: int | None = Field(None, ge=0)          # accepted alias of n_predict
    temperature: float | None = Field(None, ge=0.0)
    top_k: int | None = Field(None, ge=0, le=2**31 - 1)        # llama.cpp's int32
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(None, gt=0.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, **INT64)
    stop: list[str] | None = None
    stream: bool = False
    return_tokens: bool = False
    n_probs: int = Field(0, ge=0, le=20)
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    logit_bias: list[list[Any]] | dict[str, Any] | None = None
    ignore_eos: bool = False
    cache_prompt: bool | None = None                    # false: evaluate the whole prompt
    id_slot: int | None = Field(None, ge=-1)            # the -np slot to use (-1: any free)
    n_keep: int | None = Field(None, ge=-1)             # context shift: tokens kept (-1: prompt)
    model: str | None = None
    response_fields: list[str] | None = None            # answer only these ("a/b": nested)
    post_sampling_probs: bool = False                   # n_probs after the sampler chain
    return_progress: bool = False                       # stream the prompt's progress
    timings_per_token: bool = False                     # every streamed event has timings
    # llama-server: sample on the GPU backend; the chain here runs on the CPU either way and
    # picks the same tokens, so both values give the same answer
    backend_sampling: bool | None = None
    lora: Any = None                                    # [{"id", "scale"}] (checked_lora)

    def prompts(self) -> list[Any] | None:
        """llama-server's several prompts in one request: a list holding token lists, objects
        or only strings (a list mixing token ids and strings is one prompt); None: one."""
        p = self.prompt
        if not isinstance(p, list) or not p:
            return None
        if any(isinstance(x, (list, dict)) for x in p) or all(isinstance(x, str) for x in p):
            return p if len(p) > 1 or not isinstance(p[0], str) else None
        return None

    def images(self, engine: Any) -> list[bytes]:
        """The bytes of ``prompt.multimodal_data`` (bare base64, one per media marker of
        prompt_string); a 400 when the server has no projector or one is not base64."""
        data = self.prompt.get("multimodal_data") if isinstance(self.prompt, dict) else None
        if data is None or data == []:
            return []
        if not isinstance(data, list):
            raise APIError(400, "prompt.multimodal_data: must be a list of base64 strings",
                           code="invalid_value", param="prompt.multimodal_data")
        require_projector(engine, "prompt.multimodal_data", "multimodal_data")
        return [image_bytes(d, f"prompt.multimodal_data.{i}", url=False)
                for i, d in enumerate(data)]

    def n_predict_value(self) -> int | None:
        return self.n_predict if self.n_predict is not None else self.max_tokens

    def prompt_tokens_or_text(self, engine: Any) -> str | list[int]:
        """llama-server's prompt forms: a string, token ids, or a mix of both, or
        ``{"prompt_string": ..., "multimodal_data": [...]}`` (its images: ``images()``)."""

        if isinstance(self.prompt, dict):
            extra = set(self.prompt) - {"prompt_string", "multimodal_data"}
            if extra or not isinstance(self.prompt.get("prompt_string"), str):
                raise APIError(400, f"prompt.{sorted(extra)[0] if extra else 'prompt_string'}: "
                                    "a prompt object holds a text prompt_string and, for "
                                    "images, multimodal_data (base64 strings)",
                               code="invalid_value", param="prompt")
            return self.prompt["prompt_string"]
        if isinstance(self.prompt, str):
            return self.prompt
        if not self.prompt:
            raise APIError(400, "prompt: an empty list is no prompt (send a string, or token "
                                "ids)", code="invalid_value", param="prompt")
        if len(self.prompt) == 1 and isinstance(self.prompt[0], str):
            return self.prompt[0]
        tokens: list[int] = []
        for i, part in enumerate(self.prompt):
            if isinstance(part, bool) or not isinstance(part, (int, str)):
                raise APIError(400, f"prompt[{i}]: must be a token id or a string (one prompt "
                                    "per request)", code="invalid_value", param="prompt")
            if isinstance(part, str):
                tokens.extend(engine.tokenize(part, add_special=not tokens))
            else:
                tokens.append(part)
        return tokens

    def as_fields(self, defaults: Any, eog: list[int] = (), tokenize=None) -> _Fields:
        """``tokenize(text) -> ids``: llama-server's string keys bias every token of the
        string."""

        bias: dict[int, float] = {}
        items = self.logit_bias.items() if isinstance(self.logit_bias, dict) else \
            (tuple(pair) for pair in (self.logit_bias or []))
        for item in items:
            if len(item) != 2:
                raise APIError(400, f"logit_bias: {list(item)!r:.60} is not a pair: each entry "
                                    "is [token id or string, bias] (or false to ban)",
                               code="invalid_value", param="logit_bias")
            token, value = item
            if value is False:
                value = BAN                      # llama-server: false bans the token (-inf)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise APIError(400, "logit_bias: each entry is [token id or string, bias] "
                                    "(or false to ban)", code="invalid_value", param="logit_bias")
            if isinstance(token, str) and token.lstrip("-").isdigit():
                token = int(token)
            if isinstance(token, str):
                ids = tokenize(token) if tokenize is not None else []
            elif isinstance(token, int) and not isinstance(token, bool):
                ids = [token]
            else:
                raise APIError(400, f"logit_bias: {token!r} is neither a token id nor a string",
                               code="invalid_value", param="logit_bias")
            for t in ids:
                bias[int(t)] = float(value)
        for token in eog if self.ignore_eos else ():
            bias[int(token)] = BAN
        pick = lambda v, d: d if v is None else v  # noqa: E731
        return _Fields(pick(self.temperature, defaults.temperature), pick(self.top_p, defaults.top_p),
                       pick(self.top_k, defaults.top_k), pick(self.min_p, defaults.min_p),
                       pick(self.repeat_penalty, defaults.repeat_penalty),
                       pick(self.seed, defaults.seed),
                       pick(self.frequency_penalty, defaults.frequency_penalty),
                       pick(self.presence_penalty, defaults.presence_penalty),
                       self.stop if self.stop is not None else list(defaults.stop), bias)
