"""What an engine's model gives as text: its vocabulary (tokenize, a token's bytes, the
end-of-generation and fill-in-the-middle ids, detokenize) and its chat template.

``ModelText`` is a base of ``Engine`` (runtime/engine/engine.py): it reads the loaded model's
``_ll`` (llama.cpp's bindings), ``_vocab``, ``n_vocab``, ``model_ptr`` and keeps the compiled
template in ``_template`` (None until first asked for).
"""
from __future__ import annotations

from runtime.engine.chat import ChatTemplate, model_template_source
from runtime.engine.types import check_token_ids
from runtime.errors import UserError


class ModelText:
    """The vocabulary and chat template half of ``Engine``."""

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are parsed as such.
        A BOS the text already starts with is not doubled."""
        try:
            raw = text.encode("utf-8")
        except UnicodeEncodeError as exc:      # a lone surrogate ("\ud800") from JSON
            raise UserError(f"text: not valid Unicode ({exc.reason} at character "
                            f"{exc.start})") from None
        cap = len(raw) + 8
        buf = (self._ll.llama_token * cap)()
        n = self._ll.llama_tokenize(self._vocab, raw, len(raw), buf, cap, add_special, True)
        if n < 0:
            cap = -n
            buf = (self._ll.llama_token * cap)()
            n = self._ll.llama_tokenize(self._vocab, raw, len(raw), buf, cap, add_special, True)
        tokens = list(buf[:n])
        bos = self._ll.llama_vocab_bos(self._vocab)
        if add_special and len(tokens) >= 2 and tokens[0] == tokens[1] == bos:
            tokens.pop(0)
        return tokens

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        """The bytes one token renders as (control tokens: b"" unless ``special``)."""
        # llama.cpp indexes its vocabulary unchecked here: a bad id throws std::out_of_range
        # through the C API, which no caller can catch (the process terminates)
        check_token_ids((token,), self.n_vocab, "token")
        buf = ctypes_buffer(64)
        n = self._ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes_buffer(-n)
            n = self._ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return bytes(buf[:n])

    def eog_tokens(self) -> list[int]:
        """End-of-generation token ids (EOS, EOT) the model has."""
        ids = {self._ll.llama_vocab_eos(self._vocab), self._ll.llama_vocab_eot(self._vocab)}
        return sorted(t for t in ids if t >= 0)

    def fim_tokens(self) -> tuple[int, int, int] | None:
        """(prefix, suffix, middle) fill-in-the-middle token ids, or None without them."""
        ids = (self._ll.llama_vocab_fim_pre(self._vocab), self._ll.llama_vocab_fim_suf(self._vocab),
               self._ll.llama_vocab_fim_mid(self._vocab))
        return ids if all(t >= 0 for t in ids) else None

    def has_fim(self) -> bool:
        return self.fim_tokens() is not None

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="ignore")

    def chat_prompt(self, messages: list[dict], *, tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, variables: dict | None = None) -> str:
        """The prompt for ``messages`` by the model's chat template (ChatML if it has none);
        ``tools`` (OpenAI's tool list) is passed to the template as ``tools``, ``variables``
        as more template variables."""
        return self.chat_template.render(messages, tools=tools, variables=variables,
                                         add_generation_prompt=add_generation_prompt)

    def use_chat_template(self, source: str) -> None:
        """Render chats with ``source`` instead of the model's own template: one of
        llama.cpp's built-in template names (``chatml``, ``llama3`` ...), else jinja."""
        from runtime.engine.chat import BuiltinChatTemplate, builtin_template_names  # noqa: PLC0415

        self.chat_template                     # noqa: B018 - builds the special tokens
        tokens = dict(bos_token=self._template.bos_token, eos_token=self._template.eos_token)
        if source.strip() in builtin_template_names():
            self._template = BuiltinChatTemplate(source.strip(), **tokens)
        else:
            self._template = ChatTemplate(source, **tokens)

    @property
    def chat_template(self) -> ChatTemplate:
        """The model's compiled chat template (``.source``; ``.builtin`` when ChatML)."""
        if self._template is None:
            text = lambda tok: self.token_bytes(tok, special=True).decode("utf-8", "ignore")  # noqa: E731
            bos, eos = (self._ll.llama_vocab_bos(self._vocab), self._ll.llama_vocab_eos(self._vocab))
            self._template = ChatTemplate(model_template_source(self.model_ptr),
                                          bos_token=text(bos) if bos >= 0 else "",
                                          eos_token=text(eos) if eos >= 0 else "")
        return self._template


def ctypes_buffer(size: int):
    import ctypes  # noqa: PLC0415

    return (ctypes.c_char * size)()
