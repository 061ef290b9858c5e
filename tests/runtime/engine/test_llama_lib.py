"""Low-level loading: ggml opened by soname maps no second copy; LLAMA_CPP_LIB_PATH is chosen
before llama_cpp loads (a copied library directory is really the one used); the override
array reaches llama.cpp."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

PROBE = r"""
import json, sys
from runtime.native import ggml_lib
from runtime.engine.engine import Engine
from runtime.engine.sampling import SamplingParams
from runtime.engine.types import EngineSettings
lib_dir = sys.argv[2] if len(sys.argv) > 2 else None
engine = Engine(EngineSettings(model_path=sys.argv[1], n_ctx=256, n_threads=1,
                               n_threads_batch=1, lib_dir=lib_dir), progress=False)
text = "".join(c.text for c in engine.generate("The sea", SamplingParams(max_tokens=4,
                                                                         temperature=0)))
ggml_lib.ggml()          # open ggml by soname, as the hook does
maps = open("/proc/self/maps").read().split("\n")
paths = sorted({line.split()[-1] for line in maps if "libggml-base" in line or "libllama" in line})
import llama_cpp.llama_cpp as ll
print(json.dumps({"paths": paths, "llama": ll._lib._name, "text": text,
                  "cpu_buft": ggml_lib.buffer_type_name(ggml_lib.cpu_buffer_type())}))
"""


def _probe(model, *extra):
    env = dict(os.environ)
    env.pop("LLAMA_CPP_LIB_PATH", None)          # the engine's own choice, unless given
    proc = subprocess.run([sys.executable, "-c", PROBE, str(model), *extra], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[3],
                          env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_one_copy_of_ggml_and_a_chosen_library_dir(tiny_model, tmp_path, llama_build):
    installed = Path(llama_build.lib_dir)             # the engine's default: this install's
    default = _probe(tiny_model)
    assert default["llama"].startswith(str(installed))
    base = [p for p in default["paths"] if "libggml-base" in p]
    assert len(base) == 1, default["paths"]          # by soname: the copy libllama loaded
    assert base[0].startswith(str(installed))
    assert default["cpu_buft"] == "CPU"

    copy = tmp_path / "lib"
    shutil.copytree(installed, copy, symlinks=True)
    swapped = _probe(tiny_model, str(copy))
    assert swapped["llama"].startswith(str(copy))
    assert all(p.startswith(str(copy)) for p in swapped["paths"]), swapped["paths"]
    assert swapped["text"] == default["text"]


def test_select_library_dir_rules(tmp_path):
    code = (
        "from runtime.native import llama_lib\n"
        "import os, sys\n"
        "try:\n"
        f"    llama_lib.select_library_dir({str(tmp_path)!r})\n"
        "except FileNotFoundError as e: print('missing', e)\n"
        "llama_lib.bindings()\n"
        "try:\n"
        f"    llama_lib.select_library_dir({str(tmp_path)!r})\n"
        "except (RuntimeError, FileNotFoundError) as e: print('late', type(e).__name__)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).resolve().parents[3])
    assert proc.returncode == 0, proc.stderr
    assert "missing" in proc.stdout and "no libllama.so" in proc.stdout
    assert "late RuntimeError" in proc.stdout


def test_expert_override_reaches_llama_cpp(tiny_model, cli):
    on = cli("complete", "-m", str(tiny_model), "-p", "x", "-n", "1", "-t", "1", "-v")
    off = cli("complete", "-m", str(tiny_model), "-p", "x", "-n", "1", "-t", "1", "-v",
              "--no-residency")
    assert on.returncode == 0 and off.returncode == 0
    assert "blk.0.ffn_up_exps.weight" in on.stderr and "overridden to CPU" in on.stderr
    assert "overridden" not in off.stderr
