"""RAM tier test helpers: an engine with a cpu budget (the tier attached) or without (plain
mmap), one thread, and greedy generation."""
from __future__ import annotations

from runtime.engine.engine import Engine, EngineSettings, SamplingParams
from runtime.residency.config import parse_config


def tier_engine(model: str, budget: str | None = None, **kw) -> Engine:
    """The engine over ``model``: with ``budget`` the RAM tier governs a cpu budget, without
    it plain llama.cpp (mmap, residency off)."""
    config = parse_config({"devices": {"cpu": budget}}, source="test") if budget else None
    return Engine(EngineSettings(model_path=model, n_ctx=256, n_threads=1, seed=0,
                                 manage_residency=budget is not None, config=config, **kw),
                  progress=False)


def greedy(engine: Engine, prompt: str, n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt``."""
    out = [c.token for c in engine.generate(prompt, SamplingParams(max_tokens=n, temperature=0))
           if c.token is not None]
    assert len(out) == n
    return out
