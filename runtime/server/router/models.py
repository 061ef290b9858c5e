"""The router: which models are loaded, loading one on demand, unloading, and the leases that
keep a model from being unloaded under a request.

One load or unload runs at a time (``_lock``, first come first served, as llama-server's
queue): a request for a model that is not loaded waits for it, and requests for the same
model share one load. A load makes room first (``_make_room``): while ``--models-max`` models
are running or the budget pools (budgets.py) cannot hold its reservation, the least recently
used idle model is unloaded, saying why; when every other model is busy the load waits for
one to become idle. Requests for a loaded (or sleeping) model never take the lock.

Event-loop thread only; loads and unloads run their blocking parts on worker threads.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import anyio

from runtime.errors import UserError
from runtime.server.app import start_serving, stop_serving
from runtime.server.errors import APIError
from runtime.server.router.budgets import BudgetPool
from runtime.server.router.events import ModelEvents
from runtime.server.router.instance import LOADED, UNLOADED, Launch, ModelInstance
from runtime.server.router.presets import ModelSpec

log = logging.getLogger("moe_offload.server")

IDLE_POLL_S = 0.25       # s between looks at busy models while a load waits for room


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class ModelRouter:
    def __init__(self, specs: list[ModelSpec], *, prepare: Callable[[ModelSpec], Launch],
                 pool: BudgetPool, models_max: int, autoload: bool,
                 catalogue: Callable[[], list[ModelSpec]] | None = None,
                 events: ModelEvents | None = None) -> None:
        """``prepare(spec)``: the model's app, built but not started (blocking: parses its
        options, checks its file). ``models_max``: models running at once (0: no limit).
        ``catalogue()``: the specs read again (``GET /models?reload``; blocking)."""
        self.instances: dict[str, ModelInstance] = {}
        self._names: dict[str, ModelInstance] = {}
        self._index([ModelInstance(s) for s in specs])
        self._prepare = prepare
        self.read_catalogue = catalogue
        self.pool = pool
        self.models_max = models_max
        self.autoload = autoload
        self.events = events or ModelEvents()
        self._lock = asyncio.Lock()
        self._idle = asyncio.Event()          # set when some model's last lease ends
        self._tasks: set[asyncio.Task] = set()

    def _index(self, instances: list[ModelInstance]) -> None:
        self.instances = {i.name: i for i in sorted(instances, key=lambda i: i.name)}
        self._names = {n: inst for inst in self.instances.values()
                       for n in (inst.name, *inst.spec.aliases)}

    def resolve(self, name: str) -> ModelInstance | None:
        """The model called ``name`` (its name or one of its aliases)."""
        return self._names.get(name)

    def stream_owner(self, conversation_id: str) -> ModelInstance | None:
        """The running model holding a resumable stream: the one named after ``::`` in its
        id (as llama-server's web UI writes it), else the one whose sessions have it."""
        name = conversation_id.rpartition("::")[2] if "::" in conversation_id else ""
        if name:
            inst = self.resolve(name)
            return inst if inst is not None and inst.running else None
        return next((i for i in self.instances.values() if i.running
                     and i.app.state.streams.get(conversation_id) is not None), None)

    # -- requests ----------------------------------------------------------------------------
    async def acquire(self, inst: ModelInstance, *, autoload: bool) -> float | None:
        """Hold a lease on ``inst`` (release it with ``release``), loading it first when it
        is not (and ``autoload``). Returns the seconds this request waited for a load."""
        if inst.usable():
            inst.lifecycle.hold()
            return None
        if not autoload and not inst.running:
            raise APIError(400, f"model '{inst.name}' is not loaded (POST /models/load, or "
                                "start the server without --no-models-autoload)",
                           code="model_not_loaded")
        t0 = time.monotonic()
        await self.load(inst, hold=True)
        return time.monotonic() - t0

    def release(self, inst: ModelInstance, *, used: bool = True) -> None:
        """End ``acquire``'s lease; ``used``: the request needed the model (it counts for
        the idle timer and the LRU order; a read-only one does not)."""
        inst.lifecycle.release(used=used)

    # -- load / unload -----------------------------------------------------------------------
    def start_load(self, inst: ModelInstance) -> None:
        """``POST /models/load``: load in the background (its outcome goes to ``/models`` and
        ``/models/sse``), as llama-server answers at once."""
        task = asyncio.get_running_loop().create_task(self._load_logged(inst))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _load_logged(self, inst: ModelInstance) -> None:
        try:
            await self.load(inst)
        except APIError as err:
            log.warning("model %s: %s", inst.name, err.message)

    async def load(self, inst: ModelInstance, *, hold: bool = False) -> None:
        """Load ``inst`` unless it runs already; with ``hold``, take a lease on it before
        anything else may unload it. APIError 503 when it fails to load."""
        async with self._lock:
            if not inst.running:
                await self._load_locked(inst)
            if not inst.usable():
                raise APIError(503, f"model '{inst.name}' failed to load: {inst.failed}",
                               code="model_load_failed")
            if hold:
                inst.lifecycle.hold()

    async def _load_locked(self, inst: ModelInstance) -> None:
        try:
            launch = await anyio.to_thread.run_sync(self._prepare, inst.spec)
            too_big = self.pool.never_fits(launch.wants)
            if too_big:
                device, asked = next(iter(too_big.items()))
                raise UserError(f"it asks {_mib(asked)} of {device}, more than the server's "
                                f"whole {device} budget ({_mib(self.pool.pools[device])})")
        except UserError as err:
            self._failed(inst, str(err))
            return
        await self._make_room(inst, launch.wants)
        self.pool.reserve(inst.name, launch.wants)
        inst.launch, inst.failed = launch, None
        lifecycle = inst.lifecycle
        lifecycle.on_idle = self._idle.set
        lifecycle.on_change = lambda status, name=inst.name: self.events.publish(
            "status_change", name, {"status": status})
        self.events.publish("model_status", inst.name, {"status": "loading"})
        log.info("loading model %s%s", inst.name, "".join(
            f"; {d} budget {_mib(n)}" for d, n in launch.wants.items()))
        t0 = time.monotonic()
        start_serving(inst.app)
        await anyio.to_thread.run_sync(inst.app.state.host.wait_settled)
        if not inst.usable():           # failed (loaded and already asleep is usable)
            error = inst.app.state.host.error or "unknown error"
            await anyio.to_thread.run_sync(stop_serving, inst.app)
            self.pool.release(inst.name)
            inst.launch = None
            self._failed(inst, error)
            return
        engine = inst.app.state.host.engine_if_ready()
        if engine is not None:          # the real budgets (a tier may raise one)
            self.pool.settle(inst.name, settled_budgets(engine, launch.wants))
        lifecycle.last_used = time.monotonic()       # the LRU order starts at the load
        log.info("model %s loaded in %.1f s", inst.name, time.monotonic() - t0)
        self.events.publish("status_change", inst.name, {"status": LOADED})

    def _failed(self, inst: ModelInstance, message: str) -> None:
        inst.failed = message
        log.warning("model %s failed to load: %s", inst.name, message)
        self.events.publish("status_change", inst.name,
                            {"status": UNLOADED, "exit_code": 1, "error": message})

    async def _make_room(self, inst: ModelInstance, wants: dict[str, int]) -> None:
        """Unload idle models (least recently used first) until ``inst`` fits under
        ``--models-max`` and the pools; wait while only busy models could make room."""
        while True:
            others = [i for i in self.instances.values() if i.running and i is not inst]
            crowded = 0 < self.models_max <= len(others)
            short = self.pool.shortfall(wants)
            if not crowded and not short:
                return
            idle = [i for i in others if not i.busy() and not i.stopping]
            if not idle:                 # every one busy: the first to become idle goes
                self._idle.clear()
                try:
                    await asyncio.wait_for(self._idle.wait(), IDLE_POLL_S)
                except asyncio.TimeoutError:
                    pass
                continue
            victim = min(idle, key=lambda i: i.lifecycle.last_used)
            if crowded:
                why = f"--models-max {self.models_max} reached, {inst.name} is loading"
            else:
                device, missing = next(iter(short.items()))
                why = (f"{inst.name} needs {_mib(missing)} more of the {device} budget "
                       f"({_mib(self.pool.free(device))} free of {_mib(self.pool.pools[device])})")
            await self._unload_locked(victim, f"least recently used idle model: {why}")

    async def unload(self, inst: ModelInstance, reason: str | None = None) -> None:
        async with self._lock:
            await self._unload_locked(inst, reason)

    def start_unload(self, inst: ModelInstance) -> None:
        """``POST /models/unload``: unload in the background, as llama-server."""
        task = asyncio.get_running_loop().create_task(self.unload(inst, "POST /models/unload"))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _unload_locked(self, inst: ModelInstance, reason: str | None) -> None:
        """Let requests in flight end (up to the model's stop-timeout), then stop its app;
        requests that arrive meanwhile wait and load it again."""
        if not inst.running:
            return
        inst.stopping = True
        try:
            deadline = time.monotonic() + inst.spec.stop_timeout_s
            while inst.busy() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await anyio.to_thread.run_sync(stop_serving, inst.app)
        finally:
            self.pool.release(inst.name)
            inst.launch, inst.stopping = None, False
        log.info("model %s unloaded%s", inst.name, f" ({reason})" if reason else "")
        data = {"status": UNLOADED, "exit_code": 0}
        if reason:
            data["reason"] = reason
        self.events.publish("status_change", inst.name, data)

    async def reload(self, specs: list[ModelSpec]) -> None:
        """``GET /models?reload``: the catalogue as read again. A model gone from it, or
        whose options changed, is unloaded first (saying why); new ones are added, those
        marked ``load-on-startup`` loaded."""
        async with self._lock:
            fresh = {s.name: s for s in specs}
            kept = []
            for name, inst in self.instances.items():
                spec = fresh.get(name)
                if spec != inst.spec:
                    await self._unload_locked(inst, "gone from the preset" if spec is None
                                              else "its preset changed")
                    if spec is None:
                        continue
                    inst.spec, inst.failed = spec, None
                kept.append(inst)
            added = [ModelInstance(s) for n, s in fresh.items() if n not in self.instances]
            self._index(kept + added)
        log.info("models reloaded: %s", ", ".join(self.instances) or "none")
        self.events.publish("models_reload", "*")
        for inst in added:
            if inst.spec.load_on_startup:
                self.start_load(inst)

    async def start(self) -> None:
        """The models marked ``load-on-startup``, loaded in the background."""
        for inst in self.instances.values():
            if inst.spec.load_on_startup:
                self.start_load(inst)

    async def close(self) -> None:
        """Unload everything (shutdown)."""
        for task in list(self._tasks):
            task.cancel()
        for inst in self.instances.values():
            if inst.running:
                await anyio.to_thread.run_sync(stop_serving, inst.app)
                self.pool.release(inst.name)
                inst.launch = None


def settled_budgets(engine, wants: dict[str, int]) -> dict[str, int]:
    """What a loaded model really holds of each device it asked for (bytes): a RAM tier's
    whole budget (its kept experts and its one-use room: ``runtime.ramtier.split_budget``;
    the manager's capacity is the kept part only), else the manager's capacity, else the
    ask."""
    manager = getattr(engine, "manager", None)
    held = {}
    for tier in getattr(engine, "tiers", ()):
        budget = getattr(tier, "budget_bytes", None)
        if budget:                      # the RAM tier serves device "cpu"
            held["cpu"] = budget
    return {d: held.get(d) or (manager.capacity(d) if manager is not None else None) or n
            for d, n in wants.items()}
