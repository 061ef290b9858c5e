"""Router mode: one ``moe-offload serve`` process serving several GGUF files, as llama-server's
router does (``--models-dir``, ``--models-preset``, ``--models-max``, ``/models``,
``/models/load``, ``/models/unload``, ``/models/sse``; the request's ``"model"`` picks the
file). llama-server runs one child process per model and proxies to it; here each loaded
model is one in-process app (``runtime.server.app.create_app(edge=False)``) that the router
forwards requests to, so that every model shares one host-RAM budget.

- presets.py: the catalogue of models (a directory of GGUF files, an INI preset file);
- budgets.py: the server's budget per device, split into fixed per-model reservations;
- instance.py: one model's state (unloaded, loading, loaded, sleeping) and its app;
- models.py: the router itself (load, unload, LRU eviction, requests' leases);
- events.py: ``/models/sse``'s event feed;
- routes.py: the router's HTTP app and its own routes;
- dispatch.py: every other request, run in its model's app.
"""
