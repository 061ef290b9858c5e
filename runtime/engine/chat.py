"""Chat prompts from the model's own template (GGUF ``tokenizer.chat_template``).

Rendered with jinja2 in a sandbox, with the variables and helpers Hugging Face templates use
(``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``raise_exception``,
``strftime_now``, ``tojson``) — the same way llama-cpp-python's ``Jinja2ChatFormatter`` does.
A model without a template gets ChatML, llama.cpp's own fallback.
"""
from __future__ import annotations

import json
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runtime.errors import UserError

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ROLES = ("system", "user", "assistant", "tool")
# firefunction-v2's template wants ``datetime`` and ``functions`` (the tools as JSON text);
# llama.cpp recognises it by this piece of its source
FIREFUNCTION_MARK = " functools["


def _raise(message: str) -> None:
    raise UserError(f"chat template: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class ChatTemplate:
    """A compiled chat template; ``render(messages)`` gives the prompt text."""

    def __init__(self, source: str | None, *, bos_token: str, eos_token: str):
        self.source = source or CHATML
        self.builtin = source is None
        self.bos_token, self.eos_token = bos_token, eos_token
        env = ImmutableSandboxedEnvironment(loader=jinja2.BaseLoader(), trim_blocks=True,
                                            lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateError as exc:
            raise UserError(f"chat template: cannot parse ({exc})") from None

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True,
               tools: list[dict] | None = None, variables: dict | None = None) -> str:
        """The prompt for ``messages`` (each ``{"role": ..., "content": ...}``, plus
        ``tool_calls`` / ``tool_call_id`` where present); ``tools`` reaches the template as
        the variable ``tools`` (None: undefined, as Hugging Face renders without tools);
        ``variables`` are more template variables (llama-server's ``chat_template_kwargs``,
        ``enable_thinking`` among them)."""
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES \
                    or not isinstance(m.get("content"), str):
                raise UserError(f"messages[{i}]: needs a role in {ROLES} and string content")
        extra = {"tools": tools} if tools else {}
        if FIREFUNCTION_MARK in self.source:     # its own variables, as llama.cpp's chat.cpp
            extra |= {"datetime": datetime.now().strftime("%b %d %Y %H:%M:%S GMT"),
                      "functions": json.dumps(tools, indent=2) if tools else ""}
        extra |= variables or {}
        try:
            return self._template.render(
                **extra, messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token,
                raise_exception=_raise, strftime_now=lambda f: datetime.now().strftime(f),
                date_string=datetime.now().strftime("%d %b %Y"))   # as llama.cpp passes it
        except jinja2.TemplateError as exc:
            raise UserError(f"chat template: {exc}") from None


def model_template_source(model: int) -> str | None:
    """``tokenizer.chat_template`` of a loaded model, or None."""
    from runtime.native.llama_lib import bindings  # noqa: PLC0415

    raw = bindings().llama_model_chat_template(model, None)
    return raw.decode("utf-8") if raw else None


class BuiltinChatTemplate:
    """One of llama.cpp's built-in chat templates by name (``chatml``, ``llama3``,
    ``command-r`` ...; llama_chat_apply_template), as llama-server's ``--chat-template NAME``.
    Tools are not part of these templates."""

    builtin = True

    def __init__(self, name: str, *, bos_token: str, eos_token: str):
        self.name, self.source = name, name
        self.bos_token, self.eos_token = bos_token, eos_token
        self.render([{"role": "user", "content": "x"}])     # UserError for an unknown name

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True,
               tools: list[dict] | None = None, variables: dict | None = None) -> str:
        """``variables``: none of the built-in templates has any; they change nothing."""
        import ctypes  # noqa: PLC0415

        from runtime.native.llama_lib import bindings  # noqa: PLC0415

        ll = bindings()
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES \
                    or not isinstance(m.get("content"), str):
                raise UserError(f"messages[{i}]: needs a role in {ROLES} and string content")
        chat = (ll.llama_chat_message * len(messages))(
            *[ll.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in messages])
        size = 1024 + 2 * sum(len(m["content"].encode()) for m in messages)
        buf = ctypes.create_string_buffer(size)
        n = ll.llama_chat_apply_template(self.name.encode(), chat, len(messages),
                                         add_generation_prompt, buf, size)
        if n < 0:
            raise UserError(f"chat template: {self.name!r} is not one of llama.cpp's built-in "
                            "templates")
        if n > size:
            buf = ctypes.create_string_buffer(n + 1)
            n = ll.llama_chat_apply_template(self.name.encode(), chat, len(messages),
                                             add_generation_prompt, buf, n + 1)
        return buf.raw[:n].decode("utf-8", errors="replace")


def builtin_template_names() -> list[str]:
    """The names llama.cpp knows (llama_chat_builtin_templates)."""
    import ctypes  # noqa: PLC0415

    from runtime.native.llama_lib import bindings  # noqa: PLC0415

    ll = bindings()
    n = ll.llama_chat_builtin_templates(None, 0)
    out = (ctypes.c_char_p * n)()
    ll.llama_chat_builtin_templates(out, n)
    return [name.decode() for name in out]
