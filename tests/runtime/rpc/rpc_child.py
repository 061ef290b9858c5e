"""Run the Engine once (greedy) in its own process and print one JSON line: tokens, the
remote plan, llama.cpp's buffer-size lines, the manager's snapshot. Args (JSON): model, config (path or null), n,
prompt, no_residency."""
from __future__ import annotations

import json
import sys


def main() -> None:
    args = json.loads(sys.argv[1])
    from runtime.engine.engine import Engine
    from runtime.native.llama_lib import set_logging
    from runtime.engine.sampling import SamplingParams
    from runtime.engine.types import EngineSettings

    settings = EngineSettings(model_path=args["model"], n_ctx=args.get("n_ctx", 512),
                              n_threads=1, n_threads_batch=1,
                              config_path=args.get("config"),
                              manage_residency=not args.get("no_residency", False))
    engine = Engine(settings, progress=False)
    tokens = [c.token for c in engine.generate(args.get("prompt", "the king saw a river"),
                                                SamplingParams(max_tokens=args.get("n", 24),
                                                               temperature=0.0))
              if c.token is not None]
    log = set_logging(False)
    remote = engine.remote.to_dict() if engine.remote is not None else None
    snapshot = (json.loads(engine.manager.snapshot().to_json())
                if engine.manager is not None else None)
    engine.close()
    print(json.dumps({"tokens": tokens, "remote": remote, "buffers": list(log.buffers),
                      "residency": snapshot}))


if __name__ == "__main__":
    main()
