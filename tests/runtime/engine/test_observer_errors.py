"""An exception inside a routing observer must fail the decode call loudly (not silently cut
the graph short while llama_decode returns 0), leave no half-computed KV entries behind, and
leave the engine usable."""
from __future__ import annotations

import pytest

from runtime.engine.engine import Engine
from runtime.engine.hook.events import RouteCaptureError
from runtime.engine.sampling import SamplingParams
from runtime.residency.types import Phase

GREEDY = SamplingParams(max_tokens=12, temperature=0)


class Exploding:
    """Raises ``exc`` at the route event of ``layer`` in ``phase`` (once)."""

    def __init__(self, exc: BaseException, layer: int, phase: Phase):
        self.exc, self.layer, self.phase = exc, layer, phase
        self.armed = True
        self.after = 0            # events delivered after the explosion in the same batch

    def on_route(self, event):
        if not self.armed:
            return
        if event.layer == self.layer and event.phase == self.phase:
            self.armed = False
            raise self.exc

    def on_batch_end(self, phase, n_tokens):
        pass


class Count:
    def __init__(self):
        self.layers = []

    def on_route(self, event):
        self.layers.append(event.layer)

    def on_batch_end(self, phase, n_tokens):
        pass


def _text(chunks):
    return "".join(c.text for c in chunks)


@pytest.mark.parametrize("phase", [Phase.PREFILL, Phase.DECODE], ids=["prefill", "decode"])
def test_observer_exception_fails_the_decode_and_engine_recovers(tiny_model, make_settings,
                                                                 prompt, phase):
    with Engine(make_settings(tiny_model, manage_residency=False, capture_all_tokens=True),
                progress=False) as engine:
        clean = _text(engine.generate(prompt, GREEDY))
        first_moe = engine.facts.moe_layers[0]
        bomb = Exploding(ValueError("boom"), first_moe, phase)
        count = Count()
        engine.add_route_observer(count)      # sees each event before the bomb does
        engine.add_route_observer(bomb)
        engine._forget_from(0)   # evaluate the whole prompt again
        with pytest.raises(RouteCaptureError, match="boom") as info:
            list(engine.generate(prompt, GREEDY))
        assert isinstance(info.value.__cause__, ValueError)
        # the graph stopped at the failing layer: no later layer of that batch was observed
        assert count.layers[-1] == first_moe
        # the failed batch left nothing in the KV cache that a later prompt could reuse
        assert len(engine._kv) <= (len(engine.tokenize(prompt)) if phase == Phase.DECODE else 0)
        assert _text(engine.generate(prompt, GREEDY)) == clean


def test_keyboard_interrupt_in_observer_is_reraised(tiny_model, make_settings, prompt):
    with Engine(make_settings(tiny_model, manage_residency=False, capture_all_tokens=True),
                progress=False) as engine:
        engine.add_route_observer(Exploding(KeyboardInterrupt(), engine.facts.moe_layers[-1],
                                            Phase.PREFILL))
        with pytest.raises(KeyboardInterrupt):
            list(engine.generate(prompt, GREEDY))
        assert engine._kv == []
        assert _text(engine.generate(prompt, GREEDY))   # usable again


def test_no_hook_without_residency(tiny_model, make_settings):
    with Engine(make_settings(tiny_model, manage_residency=False), progress=False) as engine:
        assert engine.hook is None and engine.manager is None
        with pytest.raises(RuntimeError, match="routing hook is off"):
            engine.add_route_observer(Count())
