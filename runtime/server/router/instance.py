"""One model of a router: its spec, its app while loaded, and the status ``/models`` shows.

llama-server's states (server-models.h): unloaded -> loading -> loaded <-> sleeping, and
back to unloaded (unloaded, or a failed load: ``failed`` with its reason). Here the status
is read from the model app's own state (its ModelHost and Lifecycle), so there is one owner
of each fact: the router only records what is not the app's (unloaded, a failure, stopping).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.server.model_host import LoadState
from runtime.server.router.presets import ModelSpec

UNLOADED, LOADING, LOADED, SLEEPING = "unloaded", "loading", "loaded", "sleeping"


@dataclass(frozen=True)
class Launch:
    """A model made ready to start (runtime.commands.serve_models builds it): its app, not
    started, the ``serve`` arguments it runs with and what it asks of each pooled device."""

    app: Any                           # FastAPI app from create_app(edge=False)
    args: tuple[str, ...]              # as ``moe-offload serve`` flags (status.args)
    wants: dict[str, int]              # device -> bytes reserved from the pool


class ModelInstance:
    """A catalogue entry and, while loaded, its running app. Event-loop thread only."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.launch: Launch | None = None
        self.failed: str | None = None    # why the last load failed (None: it did not)
        self.stopping = False             # an unload is under way: requests wait for it

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def app(self) -> Any:
        return self.launch.app if self.launch is not None else None

    @property
    def lifecycle(self) -> Any:
        return self.app.state.lifecycle if self.launch is not None else None

    @property
    def status(self) -> str:
        if self.launch is None:
            return UNLOADED
        if self.stopping:       # loaded until its app is gone (stop_serving closes the host
            return LOADED       # first, which reads "failed": not yet "unloaded")
        host = self.app.state.host
        if host.state is LoadState.READY:
            return LOADED
        if host.state is LoadState.SLEEPING:
            return SLEEPING
        return LOADING if host.state is LoadState.LOADING else UNLOADED

    @property
    def running(self) -> bool:
        """Loaded, loading or sleeping: holds a place among --models-max and its budget."""
        return self.launch is not None

    def usable(self) -> bool:
        """A request may be forwarded now (a sleeping model wakes inside its app)."""
        return self.launch is not None and not self.stopping \
            and self.status in (LOADED, SLEEPING)

    def busy(self) -> bool:
        return self.launch is not None and self.lifecycle.busy()

    def to_json(self, created: int, reserved: dict[str, int]) -> dict[str, Any]:
        """The model's entry in ``GET /models`` (llama-server's router shape, plus
        ``budgets``: the bytes it holds of each pooled device)."""
        status: dict[str, Any] = {"value": self.status,
                                  "args": list(self.launch.args) if self.launch else []}
        if self.spec.source == "preset":
            status["preset"] = self.spec.to_ini()
        if self.failed is not None and self.launch is None:
            status.update(failed=True, exit_code=1, error=self.failed)
        return {"id": self.name, "aliases": list(self.spec.aliases),
                "tags": list(self.spec.tags), "object": "model", "owned_by": "moe-offload",
                "created": created, "status": status,
                "architecture": {"input_modalities": ["text", "image"] if any(
                                     k in ("mmproj", "mm") for k, _ in self.spec.options)
                                 else ["text"], "output_modalities": ["text"]},
                "source": self.spec.source, "can_remove": False, "budgets": reserved}
