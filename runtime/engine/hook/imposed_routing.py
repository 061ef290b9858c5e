"""Routing imposed from a trace (``--route-trace FILE``): the model routes as the trace did.

A real router's locality is what decides an offload runtime's speed, and a synthetic model's
random router has none. With a trace recorded on a real model (or by ``trace record``), prompt
token at position p takes the trace's row for step p (prefill rows), each generated token the
next decode row, at every MoE layer. The routing hook (route_impose.c, ``rh_set_route``) sets
each MoE layer's router logits so that llama.cpp's own top-k selects exactly the trace's
experts, in the trace's slot order, with the trace's weights as far as the model's gating
reproduces them (softmax over the selected logits); the expert matmuls then run on those
experts as if the router had chosen them.

The trace's first turn plays: prefill steps 0..P-1 then decode steps P..P+D-1, every MoE
layer routing every token once with the model's top-k (the last MoE layer may hold only the
prompt's output token, as llama.cpp routes a prefill by default). A model of another shape is refused in one
line naming both shapes.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from runtime.errors import UserError

if TYPE_CHECKING:              # the hook sits below the engine: the type is the engine's
    from runtime.engine.sampling import SamplingParams

# what a non-selected expert's logit becomes (route_impose.c writes it): far below any
# log-weight, so no softmax, sigmoid or top-k lets it through
FLOOR_LOGIT = -1.0e4
_MIN_LOG_WEIGHT = -50.0       # a weight of 0 still ranks above the floor
_SLOT_GAP = 1.0e-4            # equal weights: slot order still decides the top-k order

IMPOSED_NOTE = "routing imposed from"   # every speed / hit-rate report says so, with the file


@dataclass(frozen=True)
class ImposedRouting:
    """A one-turn trace's routing per context position, as the hook consumes it."""

    source: str
    n_prompt: int               # the trace's prefill tokens (positions 0 .. n_prompt - 1)
    n_decode: int               # its decode rows (positions n_prompt .. n_prompt + n_decode - 1)
    experts: np.ndarray         # (n_pos, n_layer, k) int32, slot order; -1 on dense layers
    logits: np.ndarray          # (n_pos, n_layer, k) float32, descending per row
    all_prompt_rows: bool = True   # the last MoE layer routes every prompt token (else only
    #                                the output tokens, as llama.cpp does by default; the rows
    #                                it lacks repeat the prompt's last token's routing)

    @property
    def n_positions(self) -> int:
        return self.n_prompt + self.n_decode

    @property
    def max_new_tokens(self) -> int:
        """Tokens a generation after the trace's whole prompt can yield: one from the prompt's
        logits, then one per decode row."""
        return self.n_decode + 1

    def note(self) -> str:
        return f"{IMPOSED_NOTE} {os.path.basename(self.source)}"

    def check_request(self, n_prompt: int, max_new: int) -> None:
        """UserError in one line when a prompt of ``n_prompt`` tokens and ``max_new`` generated
        tokens need positions the trace does not hold."""
        if n_prompt > self.n_positions:
            raise UserError(f"--route-trace {self.source}: the prompt has {n_prompt} tokens; "
                            f"the trace holds {self.n_prompt} prompt + {self.n_decode} decode "
                            f"tokens ({self.n_positions} positions)")
        need = n_prompt + max(max_new, 1) - 1        # the last token is sampled, not decoded
        if need > self.n_positions:
            room = self.n_positions - n_prompt + 1
            raise UserError(f"--route-trace {self.source}: {max_new} tokens after a "
                            f"{n_prompt}-token prompt need {need} positions; the trace holds "
                            f"{self.n_prompt} prompt + {self.n_decode} decode tokens "
                            f"(at most -n {room} after this prompt)")

    @classmethod
    def load(cls, path: str | os.PathLike, *, arch: str, n_layer: int, n_expert: int,
             n_expert_used: int, moe_layers: tuple[int, ...]) -> ImposedRouting:
        """Read ``path`` (CSV or .rtb) for a model of this shape; UserError in one line for a
        missing or corrupt trace, a dense model, a shape mismatch or a trace this cannot play."""
        from runtime.traces.files import read_trace  # noqa: PLC0415
        from runtime.traces.trace import PHASE_DECODE, PHASE_PREFILL  # noqa: PLC0415

        path = os.fspath(path)
        if not moe_layers:
            raise UserError(f"--route-trace {path}: the model ({arch}) has no MoE layers; a "
                            f"routing trace applies to mixture-of-experts models only")
        trace = read_trace(path)
        h = trace.header
        trace_moe = tuple(i for i, b in enumerate(h.expert_bytes) if b > 0)
        mine = (f"{len(moe_layers)} MoE layers of {n_layer}, {n_expert} experts, "
                f"top-{n_expert_used}")
        theirs = (f"{len(trace_moe)} MoE layers of {h.n_layer}, {h.n_expert} experts, "
                  f"top-{h.n_expert_used}")
        if (h.n_layer, h.n_expert, h.n_expert_used, trace_moe) != \
                (n_layer, n_expert, n_expert_used, tuple(moe_layers)):
            raise UserError(f"--route-trace {path}: the trace's shape ({theirs}, {h.arch}) is "
                            f"not the model's ({mine}, {arch}); `moe-offload synth --preset "
                            f"NAME --top-k K` writes a model of a trace's shape")
        if len(trace) == 0:
            raise UserError(f"--route-trace {path}: the trace routes no tokens")
        turns = np.unique(trace.turn)
        first = trace.take(trace.turn == turns[0]) if len(turns) > 1 else trace
        k = n_expert_used
        steps = first.step.astype(np.int64)
        prefill = first.phase == PHASE_PREFILL
        decode = first.phase == PHASE_DECODE
        if not (prefill | decode).all():
            raise UserError(f"--route-trace {path}: mixed-phase rows cannot be imposed "
                            f"(record the trace with prefill and decode apart)")
        n_prompt = int(steps[prefill].max()) + 1 if prefill.any() else 0
        n_decode = int(len(np.unique(steps[decode])))
        n_pos = n_prompt + n_decode
        bad = (steps < 0) | (steps >= n_pos) | (prefill & (steps >= n_prompt)) | \
            (decode & (steps < n_prompt))
        if bad.any():
            raise UserError(f"--route-trace {path}: steps must run 0..{n_prompt - 1} in the "
                            f"prefill then on without gaps in the decode; found step "
                            f"{int(steps[np.argmax(bad)])}")
        slots = first.slot.astype(np.int64)
        if ((slots < 0) | (slots >= k)).any():
            raise UserError(f"--route-trace {path}: a slot outside 0..{k - 1}")
        cell = (steps * n_layer + first.layer.astype(np.int64)) * k + slots
        counts = np.bincount(cell, minlength=n_pos * n_layer * k).reshape(n_pos, n_layer, k)
        want = np.zeros((n_pos, n_layer, k), dtype=np.int64)
        want[:, list(moe_layers), :] = 1
        # llama.cpp routes only the output tokens (the prompt's last) at the last MoE layer of
        # a prefill unless every token's logits are asked for: a trace may hold just those
        last = moe_layers[-1]
        trimmed = np.zeros(n_pos, dtype=bool)
        trimmed[:n_prompt] = (counts[:n_prompt, last, :] == 0).all(axis=1)
        if n_prompt and trimmed[n_prompt - 1]:
            trimmed[:] = False      # the prompt's last token is always routed: report it
        want[trimmed, last, :] = 0
        if not np.array_equal(counts, want):
            step, layer, slot = (int(x) for x in np.argwhere(counts != want)[0])
            raise UserError(f"--route-trace {path}: step {step}, layer {layer} is routed "
                            f"{int(counts[step, layer, slot])} times in slot {slot} (each MoE "
                            f"layer must route each token once, with {k} experts)")
        experts = np.full(n_pos * n_layer * k, -1, dtype=np.int32)
        weights = np.zeros(n_pos * n_layer * k, dtype=np.float64)
        experts[cell] = first.expert
        weights[cell] = first.weight
        experts = experts.reshape(n_pos, n_layer, k)
        weights = weights.reshape(n_pos, n_layer, k)
        if trimmed.any():           # the rows no one routed: as the prompt's last token
            experts[trimmed, last] = experts[n_prompt - 1, last]
            weights[trimmed, last] = weights[n_prompt - 1, last]
        logits = _slot_logits(weights)
        logits[experts < 0] = 0.0
        return cls(path, n_prompt, n_decode, experts, logits,
                   all_prompt_rows=not trimmed.any())


def _slot_logits(weights: np.ndarray) -> np.ndarray:
    """(…, k) weights in slot order -> logits whose softmax over the slots gives the weights'
    ratios and which strictly descend by slot (so top-k keeps the trace's slot order)."""
    logits = np.log(np.maximum(weights, 1e-30)).clip(_MIN_LOG_WEIGHT, None)
    for s in range(1, logits.shape[-1]):
        logits[..., s] = np.minimum(logits[..., s], logits[..., s - 1] - _SLOT_GAP)
    return logits.astype(np.float32)


def imposed_for(path: str | os.PathLike | ImposedRouting | None, facts
                ) -> ImposedRouting | None:
    """``ImposedRouting.load`` for a model's facts (gguf_tools.facts.ModelFacts); None for
    no path; a routing already loaded (for these facts) as it is."""
    if path is None or isinstance(path, ImposedRouting):
        return path
    return ImposedRouting.load(path, arch=facts.arch, n_layer=facts.n_layer,
                               n_expert=facts.n_expert, n_expert_used=facts.n_expert_used,
                               moe_layers=tuple(facts.moe_layers))


def imposed_request(engine, prompt: str | list[int] | None, params: SamplingParams,
                    args: argparse.Namespace) -> tuple[str | list[int], SamplingParams]:
    """The prompt and sampling a run under ``--route-trace`` takes: no prompt given = as many
    tokens as the trace's prefill; -n not given = every position the trace has left."""
    routing = engine.imposed
    if routing is None:
        if prompt is None:
            raise UserError("give a prompt: -p TEXT or -f FILE")
        return prompt, params
    if prompt is None:
        filler = engine.tokenize("The quick brown fox jumps over the lazy dog. " * 64,
                                 add_special=True)
        prompt = (filler * (routing.n_prompt // max(len(filler), 1) + 1))[:routing.n_prompt]
    if not getattr(args, "predict_given", False):
        n_prompt = len(prompt) if isinstance(prompt, list) else len(engine.tokenize(prompt))
        params = dataclasses.replace(params, max_tokens=max(
            1, routing.n_positions - n_prompt + 1))
    return prompt, params
