"""The ``TraceHeader`` of a GGUF model: its shape and per-layer expert and dense bytes."""
from __future__ import annotations

import os
import re

from gguf_tools.facts import EXPERT_TENSOR_RE, open_gguf, scan_model
from runtime.traces.trace import TraceHeader

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")


def header_from_model(path: str | os.PathLike) -> TraceHeader:
    """Header facts for a trace recorded from the model at ``path`` (opened read-only).

    ``dense_bytes[l]`` sums layer l's tensors other than routed experts (attention, norms,
    router, shared experts), the bytes a layer streams besides its routed experts; token
    embeddings and the output head belong to no layer and are left out.
    """
    reader = open_gguf(path)
    facts, _ = scan_model(reader, path)
    dense = [0] * facts.n_layer
    for t in reader.tensors:
        m = _BLOCK_RE.match(t.name)
        if m and not EXPERT_TENSOR_RE.match(t.name) and int(m.group(1)) < facts.n_layer:
            dense[int(m.group(1))] += int(t.n_bytes)
    return TraceHeader(model=str(path), arch=facts.arch, n_layer=facts.n_layer,
                       n_expert=facts.n_expert, n_expert_used=facts.n_expert_used,
                       expert_bytes=facts.expert_bytes, dense_bytes=tuple(dense))
