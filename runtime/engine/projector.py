"""Images through a multimodal projector (llama-server's ``--mmproj``), with llama.cpp's
libmtmd (tools/mtmd, built beside libllama by runtime/native/build.py) through
llama-cpp-python's ``llama_cpp.mtmd_cpp`` bindings.

A prompt with images is text holding one media marker (``Projector.marker``,
``<__media__>``) per image. ``Projector.prompt(text, images)`` decodes the images (PNG, JPEG,
... by stb_image), and has mtmd split the text at the markers into text chunks (token ids)
and image chunks (a preprocessed image and how many embeddings it becomes): a
``MediaPrompt``.

The engine and the batch scheduler keep a prompt as a list of token ids, compare prompts by
their common prefix (prefix reuse, slot choice, the host prompt cache) and fill the KV in
order. An image in that list is ``n_pos`` copies of one negative id (``image_id``), the same
for the same pixels and distinct for any other image in this process, so that a prefix match
runs through an identical image and stops at a different one: two prompts that differ only in
their image share no KV past the image's start. Where a prefix match would end inside an
image, ``MediaPrompt.snap`` moves it back to the image's start (an image is evaluated whole).

Evaluation (``decode_image``): mtmd encodes the image (the vision tower, on this process's
CPU or GPU as mtmd chooses), then mtmd's helper decodes the embeddings into the sequence at
the slot's position (M-RoPE positions and non-causal attention as each model needs), in
pieces of up to ``n_batch``, each piece framed for the routing hook like any prompt batch.

    projector = Projector.load(model_ptr, "mmproj.gguf", n_threads=4)
    prompt = projector.prompt("<__media__>\nWhat is this?", [png_bytes])
    engine.generate(prompt, params)        # the engine and the scheduler take a MediaPrompt
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from dataclasses import dataclass
from typing import Any

from runtime.errors import UserError

MTMD_LIB_ENV = "MTMD_CPP_LIB"          # where llama_cpp.mtmd_cpp loads libmtmd.so from
_CHUNK_TEXT = 0                        # MTMD_INPUT_CHUNK_TYPE_TEXT


class ImageError(UserError):
    """An image that cannot be used: not decodable, or not matching the prompt's markers."""


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """One image in a ``MediaPrompt``: its place and size in the token list."""

    start: int          # index of its first entry in MediaPrompt.tokens
    n_pos: int          # entries (= positions it takes in the sequence)
    n_tokens: int       # embeddings it becomes (= KV cells; n_pos too unless M-RoPE)
    chunk: int          # mtmd_input_chunk * (owned by the MediaPrompt's chunk list)


class MediaPrompt:
    """A tokenized prompt with images: ``tokens`` (text ids, and each image as ``n_pos``
    copies of its ``image_id``) and the images' spans by start index. Owns mtmd's chunks
    (freed with it). The last entry is always a text token (the logits to sample from)."""

    def __init__(self, projector: Projector, chunks: int, text: str, tokens: list[int],
                 images: dict[int, ImageSpan]):
        self.projector, self._chunks = projector, chunks
        self.text = text                   # the prompt text, a marker where each image is
        self.tokens, self.images = tokens, images

    def __len__(self) -> int:
        return len(self.tokens)

    def next_image(self, index: int) -> int:
        """The start of the first image at or after ``index``; len(tokens) when none."""
        return min((s for s in self.images if s >= index), default=len(self.tokens))

    def snap(self, keep: int) -> int:
        """``keep`` (a reused prefix length), moved back to an image's start when it falls
        inside that image."""
        for span in self.images.values():
            if span.start < keep < span.start + span.n_pos:
                return span.start
        return keep

    def text_ids(self) -> list[int]:
        return [t for t in self.tokens if t >= 0]

    def __del__(self) -> None:
        if self._chunks:
            self.projector.mtmd.mtmd_input_chunks_free(self._chunks)
            self._chunks = 0


def mtmd_bindings(lib_dir: str) -> Any:
    """``llama_cpp.mtmd_cpp``, loading libmtmd from ``lib_dir`` (the patched build's); a
    UserError naming the fix when that build has none."""
    if not os.path.isfile(os.path.join(lib_dir, "libmtmd.so")):
        raise UserError(f"--mmproj: the llama.cpp build in {lib_dir} has no libmtmd.so (built "
                        "before images were supported): run `moe-offload native build`")
    os.environ[MTMD_LIB_ENV] = lib_dir     # read once, at the bindings' first import
    import llama_cpp.mtmd_cpp as mtmd  # noqa: PLC0415

    return mtmd


class Projector:
    """A loaded mmproj for one model (``load``); ``prompt`` and ``decode_image`` use it.
    One lock: mtmd's context is not shared between threads."""

    def __init__(self, mtmd: Any, ctx: int, path: str):
        self.mtmd, self.ctx, self.path = mtmd, ctx, path
        self.vision = bool(mtmd.mtmd_support_vision(ctx))
        self.audio = bool(mtmd.mtmd_support_audio(ctx))
        self.marker = (mtmd.mtmd_default_marker() or b"<__media__>").decode()
        self.lock = threading.Lock()
        self._ids: dict[bytes, int] = {}      # image digest -> its id in token lists

    @classmethod
    def load(cls, model_ptr: Any, path: str, *, n_threads: int, use_gpu: bool = True,
             verbose: bool = False) -> Projector:
        """mtmd's context for ``path`` over the loaded model ``model_ptr``; libmtmd comes from
        the directory the process's libllama was loaded from (they go together)."""
        from runtime.native import llama_lib  # noqa: PLC0415

        if not os.path.isfile(path):
            raise UserError(f"--mmproj {path}: no such file")
        mtmd = mtmd_bindings(os.path.dirname(llama_lib.bindings()._lib._name))  # noqa: SLF001

        log = llama_lib.set_logging(verbose)      # mtmd's log goes where llama.cpp's goes
        mtmd.mtmd_helper_log_set(log._callback, None)  # noqa: SLF001
        params = mtmd.mtmd_context_params_default()
        params.use_gpu, params.n_threads, params.print_timings = use_gpu, n_threads, False
        ctx = mtmd.mtmd_init_from_file(os.fsencode(path), model_ptr, params)
        if not ctx:
            why = " ".join(log.last_error().split()) or ("not an mmproj GGUF, an unsupported projector, or an "
                                       "embedding width other than the model's")
            raise UserError(f"--mmproj {path}: llama.cpp cannot load it as a projector for "
                            f"this model ({why})")
        return cls(mtmd, ctx, path)

    def close(self) -> None:
        if self.ctx:
            self.mtmd.mtmd_free(self.ctx)
            self.ctx = 0

    def image_id(self, digest: bytes) -> int:
        """The negative id standing for the image with ``digest`` in token lists."""
        return self._ids.setdefault(digest, -1 - len(self._ids))

    def prompt(self, text: str, images: list[bytes]) -> MediaPrompt:
        """``text`` (one marker per image, in order) with ``images`` (encoded files) as a
        MediaPrompt; ImageError (one line) for an image that does not decode or a marker
        count that differs from the images'."""
        mt = self.mtmd
        markers = text.count(self.marker)
        if markers != len(images):
            raise ImageError(f"the prompt has {markers} image marker(s) ({self.marker}) for "
                             f"{len(images)} image(s)")
        bitmaps = []
        try:
            with self.lock:
                for i, data in enumerate(images):
                    buf = (ctypes.c_ubyte * len(data)).from_buffer_copy(data)
                    bitmap = mt.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(data), False)
                    if bitmap:
                        bitmaps.append(bitmap)
                    if not bitmap or mt.mtmd_bitmap_is_audio(bitmap):
                        raise ImageError(f"image {i}: not an image this server can decode "
                                         "(PNG, JPEG, BMP, GIF, ...)")
                    pixels = ctypes.string_at(mt.mtmd_bitmap_get_data(bitmap),
                                              mt.mtmd_bitmap_get_n_bytes(bitmap))
                    size = (mt.mtmd_bitmap_get_nx(bitmap), mt.mtmd_bitmap_get_ny(bitmap))
                    digest = hashlib.sha256(repr(size).encode() + pixels).digest()
                    mt.mtmd_bitmap_set_id(bitmap, digest.hex().encode())
                return self._tokenize(text, bitmaps)
        finally:
            for bitmap in bitmaps:
                mt.mtmd_bitmap_free(bitmap)

    def _tokenize(self, text: str, bitmaps: list[int]) -> MediaPrompt:
        mt = self.mtmd
        raw = text.encode("utf-8", errors="replace")
        inp = mt.mtmd_input_text(raw, len(raw), True, True)
        array = (ctypes.c_void_p * max(1, len(bitmaps)))(*bitmaps)
        chunks = mt.mtmd_input_chunks_init()
        rc = mt.mtmd_tokenize(self.ctx, chunks, ctypes.byref(inp), array, len(bitmaps))
        if rc != 0:
            mt.mtmd_input_chunks_free(chunks)
            raise ImageError(f"an image could not be preprocessed (mtmd_tokenize: {rc})")
        tokens: list[int] = []
        spans: dict[int, ImageSpan] = {}
        for i in range(mt.mtmd_input_chunks_size(chunks)):
            chunk = mt.mtmd_input_chunks_get(chunks, i)
            if mt.mtmd_input_chunk_get_type(chunk) == _CHUNK_TEXT:
                n = ctypes.c_size_t(0)
                ids = mt.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                tokens.extend(ids[:n.value])
                continue
            n_pos = int(mt.mtmd_input_chunk_get_n_pos(chunk))
            digest = bytes.fromhex(mt.mtmd_input_chunk_get_id(chunk).decode())
            spans[len(tokens)] = ImageSpan(len(tokens), n_pos,
                                           int(mt.mtmd_input_chunk_get_n_tokens(chunk)), chunk)
            tokens.extend([self.image_id(digest)] * n_pos)
        prompt = MediaPrompt(self, chunks, text, tokens, spans)
        if not tokens or tokens[-1] < 0:
            raise ImageError("the prompt ends with an image: put some text after it (the "
                             "answer is sampled after the prompt's last text token)")
        return prompt


def decode_image(engine: Any, span: ImageSpan, pos: int, seq: int) -> None:
    """Encode ``span``'s image and decode its embeddings into sequence ``seq`` at position
    ``pos`` (``span.n_pos`` positions), in pieces of up to ``engine.n_batch``, each framed
    for the routing hook as a prompt batch (phase PREFILL, no output rows). Raises
    RuntimeError when mtmd or llama_decode fails (what the KV holds from ``pos`` on is then
    unknown: the caller drops it)."""
    from runtime.engine.decode import framed_call  # noqa: PLC0415
    from runtime.residency.types import Phase  # noqa: PLC0415

    projector = engine.projector
    mt = projector.mtmd
    n_batch = int(engine.n_batch)
    pieces = [(off, min(n_batch, span.n_tokens - off)) for off in range(0, span.n_tokens,
                                                                        n_batch)]
    with projector.lock:
        if mt.mtmd_encode_chunk(projector.ctx, span.chunk) != 0:
            raise RuntimeError(f"the projector failed to encode an image at position {pos}")
        embd = mt.mtmd_get_output_embd(projector.ctx)
        new_pos = ctypes.c_int32(0)
        # mtmd's helper calls llama_decode once per piece; the hook frames one piece at a
        # time: the first frame is opened here, each later one by the callback after the
        # piece before it (framed_call ends the last)
        with framed_call(engine, Phase.PREFILL, pos, pieces[0][1], 0,
                         f"on an image at position {pos}") as frame:
            def after_piece(_view, _user) -> int:
                return frame.next_piece(pos + pieces[frame.piece + 1][0],
                                        pieces[frame.piece + 1][1]) \
                    if frame.piece + 1 < len(pieces) else 0
            callback = mt.mtmd_helper_post_decode_callback(after_piece)
            rc = mt.mtmd_helper_decode_image_chunk(projector.ctx, engine.ctx_ptr, span.chunk,
                                                   embd, pos, seq, n_batch,
                                                   ctypes.byref(new_pos), callback, None)
            frame.check(rc)
