"""moe-offload runtime: the residency manager, policies, traces, replay, engine, CLI and server."""
