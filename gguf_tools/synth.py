"""Write random-weight MoE GGUF models that llama.cpp loads and runs like real ones.

The writer streams: tensor infos first, then each tensor's data one slab at a time (one expert of
a 3D expert tensor, or a whole 1D/2D tensor), so RAM stays bounded by the largest slab even for
full-size shapes (Qwen3-30B-A3B: 48 layers x 128 experts of 2048 x 768). Every slab's values come
from an RNG seeded by (seed, tensor name, slab index): the same spec gives the same bytes.

A padded vocabulary's rows (presets: the real n_vocab) follow in slabs of 4,096 rows.

Usage::

    spec = SynthSpec(arch="qwen3moe", layers=4, experts=8, top_k=2, dtype="q8_0", skew=1.0)
    write_synthetic_model("tiny.gguf", spec)
    write_synthetic_model("q3.gguf", PRESETS["qwen3-30b-a3b"].spec("q4_k_m"))   # presets.py
"""
from __future__ import annotations

import contextlib
import math
import os
import tempfile
import zlib
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFWriter
from gguf.constants import GGML_QUANT_VERSION
from gguf.quants import quantize

from gguf_tools import synth_vocab
from gguf_tools.synth_spec import (ARCHS, DTYPES, SynthSpec,  # noqa: F401 - re-exported
                                   SynthSpecError)
from runtime.atomic_write import AtomicTarget, write_error
from gguf_tools.synth_layouts import (EMBED, LAYOUTS, NORMAL, ONES, ROUTER, SIMPLE_DTYPES, UNIFORM,
                                      ZEROS, TensorPlan, tensor_plans)
from gguf_tools.synth_blocks import BLOCK_TYPES, UNIT_COL0_TYPES, random_blocks

assert DTYPES == (*SIMPLE_DTYPES, "q4_k", "q6_k", "q4_k_m"), "synth_spec.DTYPES is stale"
assert tuple(LAYOUTS) == ARCHS, "synth_spec.ARCHS is stale"
VOCAB = synth_vocab.build_vocab()


def tensor_nbytes(plan: TensorPlan) -> int:
    """Bytes of one tensor's data (without alignment padding)."""
    block, type_size = GGML_QUANT_SIZES[plan.qtype]
    rows = math.prod(plan.shape[1:])
    return rows * (plan.shape[0] // block) * type_size


def planned_data_bytes(spec: SynthSpec, alignment: int = 32) -> int:
    """Bytes of the data section, padding included (for progress bars)."""
    return sum(_align(tensor_nbytes(p), alignment) for p in tensor_plans(spec))


def planned_file_bytes(spec: SynthSpec) -> int:
    """The size of the file ``write_synthetic_model`` writes for ``spec``, without writing it.

    The metadata is serialized with the synthetic vocabulary only (a temporary file of a few
    hundred KB); each padding token adds its GGUF array entries: a uint64 length and the
    string, a float32 score and an int32 type."""
    writer = _new_writer(spec, VOCAB)
    with tempfile.TemporaryDirectory(prefix="moe-offload-synth-") as tmp:
        try:
            writer.write_header_to_file(Path(tmp) / "metadata.gguf")
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            metadata = writer.fout[0].tell()
        finally:
            writer.close()
    metadata += sum(8 + len(token.encode()) + 4 + 4
                    for token in synth_vocab.pad_tokens(VOCAB.size, spec.vocab_size))
    return _align(metadata, writer.data_alignment) + planned_data_bytes(spec,
                                                                        writer.data_alignment)


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _rng(spec: SynthSpec, name: str, slab: int) -> np.random.Generator:
    return np.random.default_rng([spec.seed, zlib.crc32(name.encode()), slab])


def _router_bias(spec: SynthSpec, layer: int) -> np.ndarray:
    # (n_expert,) float32: -skew * log(rank + 1), ranks permuted per layer
    ranks = _rng(spec, f"router-rank.{layer}", 0).permutation(spec.experts)
    return (-spec.skew * np.log1p(ranks)).astype(np.float32)


def _slab_values(spec: SynthSpec, plan: TensorPlan, slab: int, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of one slab, numpy order ``shape``."""
    if plan.init == ONES:
        return np.ones(shape, np.float32)
    if plan.init == ZEROS:
        return np.zeros(shape, np.float32)
    rng = _rng(spec, plan.name, slab)
    if plan.init == UNIFORM:
        return rng.uniform(plan.low, plan.high, shape).astype(np.float32)
    x = rng.standard_normal(shape, dtype=np.float32)
    if plan.init == EMBED:  # (n_vocab, n_embd); channel 0 is the constant bias channel
        x[:, 0] = 1.0
    elif plan.init == ROUTER:  # (n_expert, n_embd)
        x *= plan.std
        x[:, 0] = _router_bias(spec, plan.layer)
    elif plan.init == NORMAL:
        x *= plan.std
        if plan.zero_row0:  # output channel 0 stays untouched in the residual stream
            if plan.name.endswith(".bias"):
                x[..., 0] = 0.0
            else:
                x[..., 0, :] = 0.0
    else:  # pragma: no cover - layouts only use the kinds above
        raise AssertionError(plan.init)
    return x


_PAD_ROWS_PER_SLAB = 4096   # vocabulary padding is written this many rows at a time


def _slab_bytes(spec: SynthSpec, plan: TensorPlan) -> Iterator[np.ndarray]:
    """The tensor's data as uint8/float arrays, one slab (expert) at a time."""
    np_shape = tuple(reversed(plan.shape))
    if len(np_shape) == 3:
        for s in range(np_shape[0]):
            yield _slab(spec, plan, s, np_shape[1:])
        return
    if not plan.live_rows:
        yield _slab(spec, plan, 0, np_shape)
        return
    # A padded vocabulary: the live rows are the unpadded tensor's bytes (slab 0); the padding
    # follows in bounded slabs. Output rows of padding are zero: those tokens' logits are 0,
    # below the best live token's, so greedy text stays in the synthetic vocabulary.
    rows, row_len = np_shape
    yield _slab(spec, plan, 0, (plan.live_rows, row_len))
    for k, start in enumerate(range(plan.live_rows, rows, _PAD_ROWS_PER_SLAB)):
        n = min(_PAD_ROWS_PER_SLAB, rows - start)
        if plan.init == EMBED:
            yield _slab(spec, plan, 1 + k, (n, row_len))
        else:
            block, type_size = GGML_QUANT_SIZES[plan.qtype]
            yield np.zeros((n, row_len // block * type_size), np.uint8)


def _slab(spec: SynthSpec, plan: TensorPlan, s: int, slab_shape: tuple[int, ...]) -> np.ndarray:
    """Slab ``s`` of numpy shape ``slab_shape`` as stored: float32/float16 or uint8 blocks."""
    rows = math.prod(slab_shape[:-1])
    if plan.qtype in BLOCK_TYPES and plan.init == NORMAL:
        # random quants written directly: fast, and the only way for K-quants
        return random_blocks(_rng(spec, plan.name, s), plan.qtype, rows, slab_shape[-1],
                             std=plan.std, zero_row0=plan.zero_row0)
    if plan.qtype in UNIT_COL0_TYPES and plan.init == EMBED:   # gguf-py cannot quantize these
        return random_blocks(_rng(spec, plan.name, s), plan.qtype, rows, slab_shape[-1],
                             std=1.0, unit_col0=True)
    values = _slab_values(spec, plan, s, slab_shape)
    if plan.qtype == Q.F32:
        return values
    if plan.qtype == Q.F16:
        return values.astype(np.float16)
    return quantize(values, plan.qtype)


def write_synthetic_model(path: str | os.PathLike[str], spec: SynthSpec, *,
                          progress: Callable[[int], None] | None = None,
                          metadata: dict[str, int | str] | None = None) -> Path:
    """Write ``spec`` as a GGUF file at ``path`` and return the path.

    Writes to a temporary file in the same directory and renames it into place
    (runtime.atomic_write), so an interrupted write never leaves a partial ``path`` and the
    next write removes a killed one's temp file. ``progress(n)`` is called with the number
    of data bytes written since the last call (summing to ``planned_data_bytes(spec)``).
    ``metadata``: more keys (an int is written as uint32, a str as a string), e.g. a
    reranker's pooling type (gguf_tools/synth_adapters.py).
    """
    out = Path(path)
    target = AtomicTarget(out)
    plans = tensor_plans(spec)
    writer = _new_writer(spec, synth_vocab.build_vocab(spec.vocab_size), metadata)
    with published_gguf(target, writer):
        writer.write_header_to_file(target.tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout = writer.fout[0]
        writer.write_padding(fout, fout.tell())
        for plan in plans:
            written = 0
            for chunk in _slab_bytes(spec, plan):
                buf = memoryview(np.ascontiguousarray(chunk)).cast("B")
                fout.write(buf)
                written += len(buf)
                if progress:
                    progress(len(buf))
            assert written == tensor_nbytes(plan), (plan.name, written)
            writer.write_padding(fout, written)
            if progress:   # count the alignment padding too: the total is planned_data_bytes
                progress(-(-written // writer.data_alignment) * writer.data_alignment - written)
    return out


@contextlib.contextmanager
def published_gguf(target: AtomicTarget, writer: GGUFWriter) -> Iterator[None]:
    """Around writing ``writer``'s file at ``target.tmp``: close the writer and publish the
    file; on a failure close it and remove the temp file (an ``OSError`` as one line)."""
    try:
        yield
        writer.close()
    except OSError as err:
        writer.close()
        target.discard()
        raise write_error(target.path, err) from None
    except BaseException:
        writer.close()
        target.discard()
        raise
    target.publish()


def _new_writer(spec: SynthSpec, vocab: synth_vocab.SynthVocab,
                metadata: dict[str, int | str] | None = None) -> GGUFWriter:
    """A writer holding ``spec``'s metadata (with ``vocab``, then ``metadata``) and tensor
    infos, nothing written."""
    writer = GGUFWriter(None, LAYOUTS[spec.arch].name)
    _add_metadata(writer, spec, vocab)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)
    for plan in tensor_plans(spec):
        writer.add_tensor_info(plan.name, tuple(reversed(plan.shape)), np.dtype(np.float32),
                               tensor_nbytes(plan), raw_dtype=plan.qtype)
    return writer


def _add_metadata(w: GGUFWriter, spec: SynthSpec, vocab: synth_vocab.SynthVocab) -> None:
    layout = LAYOUTS[spec.arch]
    extra = layout.extra_kv(spec)
    w.add_name(spec.name or f"synthetic-{spec.arch}")
    w.add_description(f"random-weight {layout.real_model} shaped MoE model written by moe-offload "
                      f"synth (seed {spec.seed}, skew {spec.skew}, dtype {spec.dtype})")
    w.add_quantization_version(GGML_QUANT_VERSION)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(spec.embd)
    w.add_block_count(spec.layers)
    if "feed_forward_length" not in extra:
        w.add_feed_forward_length(spec.ff)
    w.add_head_count(spec.heads)
    if "attention.head_count_kv" not in extra:
        w.add_head_count_kv(spec.heads_kv)
    if spec.head_dim and "attention.key_length" not in extra:
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_expert_count(spec.experts)
    w.add_expert_used_count(spec.top_k)
    if layout.uses_expert_ff_key:
        w.add_expert_feed_forward_length(spec.ff)
    for key, value in extra.items():
        full = f"{layout.name}.{key}"
        if isinstance(value, float):
            w.add_float32(full, value)
        else:
            w.add_uint32(full, value)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(list(vocab.tokens))
    w.add_token_scores(list(vocab.scores))
    w.add_token_types(list(vocab.token_types))
    w.add_bos_token_id(synth_vocab.BOS_ID)
    w.add_eos_token_id(synth_vocab.EOS_ID)
    w.add_eot_token_id(synth_vocab.IM_END_ID)
    w.add_unk_token_id(synth_vocab.UNK_ID)
    w.add_add_bos_token(True)
    w.add_chat_template(synth_vocab.CHAT_TEMPLATE)
