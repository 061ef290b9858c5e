"""Experts on other machines through llama.cpp's own RPC backend (ggml-rpc).

- ``endpoint``: ``rpc:HOST:PORT[/N]`` device names, parsed and validated;
- ``probe``: a short-timeout client of the RPC protocol (HELLO, device memory, a round-trip
  and bandwidth probe) for ``config check`` and for planning at load, before llama.cpp's own
  client connects;
- ``plan``: what lives on each remote (whole layer ranges or expert tensors only), chosen by a
  link cost model; pure;
- ``backend``: the patched libggml-rpc through ctypes (add a remote, failure state, server);
- ``server``: ``moe-offload rpc-server``.

No transport of our own: tensors and graphs travel over ggml-rpc. Patch 0004 makes its client
report a lost connection (``ggml_backend_rpc_failure_count``) instead of aborting the process.
"""
