"""Live routing capture: llama.cpp's eval callback (``cb_eval``) turned into ``RouteEvent``s.

Per MoE layer ``L`` the graph (``build_moe_ffn`` in src/llama-graph.cpp) has the nodes
``ffn_moe_topk-L`` (I32 ``[n_expert_used, n_tokens]``, a strided view of the argsort) and the
router weights ``ffn_moe_weights-L`` (``[1, n_expert_used, n_tokens]``), optionally followed by
``ffn_moe_weights_softmax-L``, ``ffn_moe_weights_norm-L`` and ``ffn_moe_weights_scaled-L``; the
LAST of these is the weight the experts' outputs are multiplied by. Names are matched exactly
(``"ffn_moe_probs-0 (reshaped)"`` and friends also exist).

How the scheduler drives the callback (ggml-backend.cpp, compute_splits): every node gets one
``ask=True`` call before anything from it onwards is computed; for a node we answer True to,
the nodes up to it are computed, the backend synchronised, and the callback called again with
``ask=False`` and the data. So at the ``ask`` call of the layer's first expert matmul
(``ffn_moe_up-L`` / ``ffn_moe_gate_up-L`` / ``ffn_moe_weighted-L``) the router outputs are known
and no expert of that layer has run: that is where ``on_route`` fires.

Errors: an exception escaping a ctypes callback makes it return False, which on a data call
silently stops the graph while ``llama_decode`` still returns 0. So the callback catches
everything, remembers the first error, stops the graph at the next chance, and ``end_batch``
raises ``RouteCaptureError`` (or re-raises a KeyboardInterrupt) after the decode call.

``RouteAssembler`` holds the logic and needs no llama.cpp (it is fed arrays); ``RoutingHook``
is the thin ctypes wrapper. Together they are the slow reference of the live hook, the C one
(route_hook.c, c_hook.py: the same rules, no Python call per layer-step); tests run an
engine with each and compare the events and the managers' counters. In the reference, the
bookkeeping (ResidencyObserver), the device caches and the RAM tiers are observers whose
``on_route`` calls the same mechanism.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from runtime.engine.hook.config import HookConfig
from runtime.engine.hook.events import RouteCaptureError, RouteEvent, RouteObserver, raise_failure
from runtime.residency.types import Phase

# Node kinds the hook cares about.
_TOPK, _WEIGHTS, _FLUSH, _WATCH = 0, 1, 2, 3
# Weight stages in graph order; the highest present is the applied one.
_WEIGHT_STAGES = ("ffn_moe_weights", "ffn_moe_weights_softmax", "ffn_moe_weights_norm",
                  "ffn_moe_weights_scaled")
# First node that consumes the experts in build_moe_ffn (any one of them, per arch).
_PREFIX = b"ffn_moe_"   # every node the hook reads is named "ffn_moe_*" (8 bytes)
_FLUSH_NODES = ("ffn_moe_weighted", "ffn_moe_gate_up", "ffn_moe_up", "ffn_moe_gate")


@dataclass(slots=True)
class _Pending:
    experts: np.ndarray | None = None   # (n_tokens, k) int32
    weights: np.ndarray | None = None   # (n_tokens, k) float32
    stage: int = -1                     # which _WEIGHT_STAGES entry ``weights`` came from
    done: bool = False


class RouteAssembler:
    """Turns one decode call's router outputs into ``RouteEvent``s (no llama.cpp needed).

    ``begin_batch`` → ``on_topk`` / ``on_weights`` / ``flush`` per layer and ubatch →
    ``end_batch``. Tracks ubatches inside one decode call (a layer id that does not increase
    starts the next ubatch) so every event carries the context position of its first token.
    """

    def __init__(self, moe_layers: tuple[int, ...], n_expert_used: int, n_layer: int):
        self.moe_layers = tuple(moe_layers)
        self.n_expert_used = int(n_expert_used)
        self.last_layer = int(n_layer) - 1
        self.observers: list[RouteObserver] = []
        self.turn = 0
        self.strict = False              # check every token of every MoE layer was routed
        self.final_stage: dict[int, int] = {}   # layer -> index into _WEIGHT_STAGES
        self._phase = Phase.PREFILL
        self._batch_start = 0            # context position of the batch's first token
        self._n_tokens = self._n_outputs = 0
        self._ubatch_offset = 0          # tokens of this batch in earlier ubatches
        self._ubatch_rows = 0            # tokens in the current ubatch (first MoE layer)
        self._prev_layer = -1
        self._pending: dict[int, _Pending] = {}
        self._rows: dict[int, int] = {}  # layer -> rows routed in this batch
        self.in_batch = False

    # -- batch framing --------------------------------------------------------------------

    def begin_batch(self, phase: Phase, first_step: int, n_tokens: int, n_outputs: int) -> None:
        self._phase = Phase(phase)
        self._batch_start, self._n_tokens, self._n_outputs = first_step, n_tokens, n_outputs
        self._ubatch_offset = self._ubatch_rows = 0
        self._prev_layer = -1
        self._pending.clear()
        self._rows = {layer: 0 for layer in self.moe_layers}
        self.in_batch = True

    def end_batch(self) -> None:
        """Flush layers whose expert matmul was never seen, check completeness, then tell
        observers the batch ended. Raises RouteCaptureError on a gap in strict mode."""
        for layer in sorted(self._pending):
            if not self._pending[layer].done:
                self.flush(layer)
        self.in_batch = False
        if self.strict:
            for layer, rows in self._rows.items():
                want = self._n_outputs if layer == self.last_layer else self._n_tokens
                if rows != want:
                    raise RouteCaptureError(f"layer {layer}: routed {rows} tokens of {want} "
                                            f"in a {self._phase.name.lower()} batch")
        failure = None
        for observer in self.observers:     # every observer ends its batch (leases)
            try:
                observer.on_batch_end(self._phase, self._n_tokens)
            except Exception as exc:  # noqa: BLE001 - reported below, as the graph's are
                failure = failure or exc
        if failure is not None:
            raise_failure(failure)

    def abort_batch(self) -> None:
        """The decode failed: still let observers end the batch (release leases), then stop."""
        self.in_batch = False
        for observer in self.observers:
            try:
                observer.on_batch_end(self._phase, self._n_tokens)
            except Exception:  # noqa: BLE001 - the original error is the one to report
                pass

    # -- node data ------------------------------------------------------------------------

    def on_topk(self, layer: int, experts: np.ndarray) -> None:
        """experts: (n_tokens, n_expert_used) int32 for this ubatch."""
        if layer <= self._prev_layer:       # the next ubatch of the same decode call
            for earlier in sorted(self._pending):
                if not self._pending[earlier].done:
                    self.flush(earlier)
            self._ubatch_offset += self._ubatch_rows
            self._pending.clear()
        if layer <= self._prev_layer or self._prev_layer < 0:
            self._ubatch_rows = int(experts.shape[0])
        self._prev_layer = layer
        self._pending[layer] = _Pending(experts=experts)

    def on_weights(self, layer: int, stage: int, weights: np.ndarray) -> None:
        pending = self._pending.get(layer)
        if pending is not None and stage >= pending.stage:
            pending.weights, pending.stage = weights, stage

    def flush(self, layer: int) -> None:
        """The layer's experts are about to run: emit its event to every observer."""
        pending = self._pending.get(layer)
        if pending is None or pending.done or pending.experts is None:
            return
        pending.done = True
        if pending.weights is None:
            raise RouteCaptureError(f"layer {layer}: router weights were not captured")
        self.final_stage.setdefault(layer, pending.stage)
        rows = int(pending.experts.shape[0])
        self._rows[layer] = self._rows.get(layer, 0) + rows
        if rows == 0:
            return
        # Rows trimmed to the outputs (the last layer) are the ubatch's final tokens.
        first = self._batch_start + self._ubatch_offset + max(0, self._ubatch_rows - rows)
        event = RouteEvent(layer=layer, phase=self._phase, first_step=first, turn=self.turn,
                           experts=pending.experts, weights=pending.weights)
        for observer in self.observers:
            observer.on_route(event)


class RoutingHook:
    """The Python ``cb_eval`` (the reference of c_hook.CHook, with its wiring and its
    constructor): router outputs framed into RouteEvents for observers by a RouteAssembler
    built from the same ``config``. Every graph node costs a Python call: for tests. Keep the
    hook alive as long as the context."""

    def __init__(self, config: HookConfig):
        from runtime.native import ggml_tensor, llama_lib  # noqa: PLC0415 - loads llama.cpp

        self._tensors = ggml_tensor
        self.config = config
        assembler = RouteAssembler(config.moe_layers, config.n_expert_used, config.n_layer)
        assembler.strict = config.strict
        self.assembler = assembler
        self.error: BaseException | None = None
        self.watchers: dict[bytes, Callable[[str, np.ndarray], None]] = {}
        self._nodes: dict[bytes, tuple[int, int, int]] = {}   # name -> (kind, layer, stage)
        for layer in assembler.moe_layers:
            self._nodes[f"ffn_moe_topk-{layer}".encode()] = (_TOPK, layer, 0)
            for stage, base in enumerate(_WEIGHT_STAGES):
                self._nodes[f"{base}-{layer}".encode()] = (_WEIGHTS, layer, stage)
            for base in _FLUSH_NODES:
                self._nodes[f"{base}-{layer}".encode()] = (_FLUSH, layer, 0)
        self._layout_checked = False
        self._topk_node: dict[int, int] = {}   # layer -> its ffn_moe_topk tensor (this graph)
        self._prefix_of = ctypes.c_uint64.from_address
        self._prefix = int.from_bytes(_PREFIX, "little")
        self._name_offset = ggml_tensor.NAME_OFFSET
        callback_type = llama_lib.bindings().ggml_backend_sched_eval_callback
        self._py_callback = callback_type(self._on_eval)
        self.callback, self.user_data = self._py_callback, None
        self._n_own = 0              # observers of the hook's wiring, before the engine's

    # -- wiring (CHook's, as observers) ----------------------------------------------
    @property
    def turn(self) -> int:
        """The turn the next batches' events carry (the engine sets it per generation)."""
        return self.assembler.turn

    @turn.setter
    def turn(self, turn: int) -> None:
        self.assembler.turn = turn

    def add_observer(self, observer: RouteObserver) -> None:
        """Receive every route event (after the hook's own observers)."""
        self.assembler.observers.append(observer)

    def _own(self, observer) -> None:
        self.assembler.observers.insert(self._n_own, observer)
        self._n_own += 1

    def feed(self, manager, devices) -> None:
        """Keep ``devices`` of ``manager`` informed of every route (bookkeeping devices)."""
        from runtime.engine.hook.residency_observer import ResidencyObserver  # noqa: PLC0415

        self._own(ResidencyObserver(manager, devices))

    def add_cache(self, cache) -> None:
        """A device cache: its ``on_route`` calls the same C (dc_route)."""
        self._own(cache)

    def add_tier(self, tier) -> None:
        """A RAM tier: its ``on_route`` calls the same C (rt_step)."""
        self._own(tier)

    def watch(self, name: str, fn: Callable[[str, np.ndarray], None]) -> None:
        """Also read node ``name`` (exact match, e.g. ``"ffn_moe_probs-3"``; it must start with
        ``ffn_moe_``) and pass its data (shape (ne3, ne2, ne1, ne0)) to ``fn``. For tests and
        diagnostics."""
        if not name.encode().startswith(_PREFIX):
            raise ValueError(f"{name!r}: only ffn_moe_* nodes can be watched")
        self.watchers[name.encode()] = fn

    # -- framing, called by the engine around each llama_decode --------------------------

    def begin_batch(self, phase, first_step: int, n_tokens: int, n_outputs: int) -> None:
        self.error = None
        self.assembler.begin_batch(phase, first_step, n_tokens, n_outputs)

    def abort_batch(self) -> None:
        """The decode failed: observers still end the batch (leases get released)."""
        self.assembler.abort_batch()

    @property
    def in_batch(self) -> bool:
        """Between begin_batch and the end (or abort) of a decode call."""
        return self.assembler.in_batch

    def end_batch(self) -> None:
        """After ``llama_decode``: raise what went wrong inside the graph, else finish."""
        error, self.error = self.error, None
        if error is not None:
            self.assembler.abort_batch()
            raise_failure(error)
        self.assembler.end_batch()

    # -- the callback ---------------------------------------------------------------------

    def _on_eval(self, tensor: int, ask: bool, _user: int) -> bool:
        # Called for every graph node (hundreds per token): the common case must be cheap.
        # Nodes not named "ffn_moe_*" are rejected on their first 8 name bytes.
        try:
            if self._prefix_of(tensor + self._name_offset).value != self._prefix:
                return False
            if self.error is not None:
                return ask          # ask: compute up to here; data: False stops the graph
            if not self.assembler.in_batch:
                return False        # a decode the engine did not frame (e.g. warm-up)
            name = self._tensors.tensor_name(tensor)
            node = self._nodes.get(name)
            if node is None:
                return name in self.watchers if ask else self._on_watch(name, tensor)
            kind, layer, stage = node
            a = self.assembler
            final = a.final_stage.get(layer)     # None until the layer's first flush
            if ask:
                if kind == _FLUSH:
                    a.flush(layer)
                    return False
                if kind == _TOPK:
                    self._topk_node[layer] = tensor
                    return final is None         # later: read with the final weights
                return final is None or final == stage
            if not self._layout_checked:
                self._tensors.check_tensor_layout(tensor)
                self._layout_checked = True
            k = a.n_expert_used
            data = self._tensors.read_tensor(tensor).reshape(-1, k)
            if kind == _TOPK:
                a.on_topk(layer, data.astype(np.int32, copy=False))
            elif final is None:
                a.on_weights(layer, stage, data.astype(np.float32, copy=False))
            else:
                # One sync per layer: the topk view is still live here (the expert matmuls
                # read it next), so read it now together with the applied weights.
                topk = self._tensors.read_tensor(self._topk_node[layer]).reshape(-1, k)
                a.on_topk(layer, topk.astype(np.int32, copy=False))
                a.on_weights(layer, stage, data.astype(np.float32, copy=False))
                a.flush(layer)
            return True
        except BaseException as exc:  # noqa: BLE001 - must never escape into ctypes
            if self.error is None:
                self.error = exc
            return ask

    def _on_watch(self, name: bytes, tensor: int) -> bool:
        self.watchers[name](name.decode(), self._tensors.read_tensor(tensor))
        return True

