#!/usr/bin/env bash
# GPU proof of the device cache (issue 6), for an NVIDIA H200-class machine with
# NO network: everything comes from the repository (offline/: the pruned llama.cpp
# source archive and the Python wheels).
#
#   scripts/gpu_check.sh             # CUDA build for sm_90, the qwen3-30b-a3b preset, benchmark
#   scripts/gpu_check.sh --dry-run   # the same steps on the CPU (cpu backend, cpu-slots, tiny model)
#   scripts/gpu_check.sh --vulkan-dry-run
#                                    # the GPU steps on a Vulkan device (lavapipe works: needs
#                                    # scripts/vulkan_toolchain.sh): vulkan backend, vulkan:0
#                                    # cache, --n-cpu-moe rows, tiny model
#
# Steps: (1) python3 (or $PYTHON) with the packages it lacks installed from the offline wheels
# into $GPU_CHECK_WORK/site, the llama_cpp bindings from the archive; (2) `moe-offload native build
# --backend cuda --cuda-arch 90 --no-cuda-fa` from the archive; (3) the model: `moe-offload synth
# --preset qwen3-30b-a3b --top-k 6 --dtype q4_k_m` (Qwen3-30B-A3B's tensors, Q4_K_M, top-6 as the
# trace was recorded); (4) `moe-offload bench --route-trace` with the real Qwen3-30B-A3B routing
# trace (tests/runtime/traces/data: a real router's locality, not the random weights') at one
# expert budget (25% of the expert bytes): all experts on the CPU (--n-cpu-moe 48), the largest
# --n-cpu-moe N that fits the budget, our cache with lru, our phase-specific policy; the trace's
# prompt (pp28@trace) and decode rows (tg129@trace) tokens/s and hit rates, as a table written to
# docs/benchmarks/gpu-check-DATE.md (dry run: under $GPU_CHECK_WORK); then (5) the same configs
# through the Engine (runtime.bench.cache_check.py): speed, hit rates per phase, copies, and greedy
# tokens against the same placement without the cache (cpu-slots: the script fails if they
# differ; on a GPU the resident experts run on GPU kernels, so a difference is only reported).
# Knobs (env): GPU_CHECK_WORK (scratch dir), GPU_CHECK_REPS (2), GPU_CHECK_BUDGET_PCT (25),
# GPU_CHECK_P (512), GPU_CHECK_N (128), GPU_CHECK_CUDA_ARCH (90), GPU_CHECK_CUDA_FA (0: build
# without the FlashAttention kernels, which take half the compile time; 1: with them).
# Each step prints its elapsed seconds on stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
DRY=0
VK=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  --vulkan-dry-run) DRY=1; VK=1; export GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES:-0} ;;
  "") ;;
  *) echo "usage: scripts/gpu_check.sh [--dry-run | --vulkan-dry-run]" >&2; exit 2 ;;
esac
ARCHIVE=$REPO/offline/llama-cpp-python-0.3.36-pruned.tar.xz
WHEELS=$REPO/offline/wheels
WORK=${GPU_CHECK_WORK:-/tmp/moe-gpu-check}
REPS=${GPU_CHECK_REPS:-2}
PCT=${GPU_CHECK_BUDGET_PCT:-25}
P=${GPU_CHECK_P:-512}
N=${GPU_CHECK_N:-128}
ARCH=${GPU_CHECK_CUDA_ARCH:-90}
mkdir -p "$WORK"
START=$SECONDS
step() { echo "== gpu_check [$((SECONDS - START)) s]: $*" >&2; }
[[ -f "$ARCHIVE" ]] || { echo "gpu_check: missing $ARCHIVE (scripts/make_source_archive.py)" >&2; exit 1; }

# (0) tools
need() { command -v "$1" >/dev/null || { echo "gpu_check: $1 not found ($2)" >&2; exit 1; }; }
need cmake "CMake >= 3.21"; need c++ "a C++17 compiler"
command -v patch >/dev/null || need git "GNU patch or git (to apply llamacpp/patches)"
if [[ $DRY == 0 ]]; then
  [[ -x /usr/local/cuda/bin/nvcc ]] && export PATH=$PATH:/usr/local/cuda/bin
  need nvcc "the CUDA toolkit"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 || true
fi

# (1) Python: the interpreter (PYTHON, default python3) with whatever it lacks installed from the
# offline wheels into $WORK/site (on PYTHONPATH). No venv: on the GPU machine python3 is itself
# a venv's (PyTorch's, Python 3.12, numpy included) and a venv made from it would not see those.
PY=${PYTHON:-python3}
MISSING=$("$PY" - <<'PYEOF'
import importlib.util
dists = {"numpy": "numpy", "gguf": "gguf", "cffi": "cffi", "pycparser": "pycparser",
         "psutil": "psutil", "tqdm": "tqdm", "jinja2": "jinja2", "markupsafe": "markupsafe",
         "diskcache": "diskcache", "typing_extensions": "typing_extensions", "yaml": "pyyaml",
         "requests": "requests", "urllib3": "urllib3", "idna": "idna", "certifi": "certifi",
         "charset_normalizer": "charset_normalizer"}
print(" ".join(d for m, d in dists.items() if importlib.util.find_spec(m) is None))
PYEOF
)
if [[ -n "$MISSING" ]]; then
  step "installing from $WHEELS (no network) into $WORK/site: $MISSING"
  rm -rf "$WORK/site"
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --no-index --no-deps --no-compile --find-links "$WHEELS" \
      --target "$WORK/site" $MISSING \
    || { echo "gpu_check: the offline wheels do not fit $("$PY" -V) (cp311 and, for cffi," \
              "cp312, x86_64); set PYTHON to an interpreter that has: $MISSING" >&2; exit 1; }
  SITE=$WORK/site:
else
  SITE=
fi
rm -rf "$WORK/py" && mkdir -p "$WORK/py"
tar -xJf "$ARCHIVE" -C "$WORK/py" --strip-components=1 llama_cpp_python-0.3.36/llama_cpp
export PYTHONPATH=$SITE$REPO:$WORK/py
CLI=("$PY" -m runtime.cli)

# (2) the patched libraries from the pruned archive. The CPU dry run asks for what `pip install
# -e .` built (same archive, patches, flags and CMAKE_ARGS: the same key), so it compiles
# nothing on an installed checkout. `native build` records what it builds as the install's
# llama.cpp: a dry run puts the install's record back, so the Vulkan one does not switch this
# install to its build.
if [[ $VK == 1 ]]; then BUILD=(--backend vulkan)
elif [[ $DRY == 1 ]]; then BUILD=(--backend cpu)
else BUILD=(--backend cuda --cuda-arch "$ARCH"); fi
[[ $DRY == 1 || "${GPU_CHECK_CUDA_FA:-0}" == 1 ]] || BUILD+=(--no-cuda-fa)   # half the compile time
RECORD=$("$PY" -c 'from runtime.native.install import RECORD
from runtime.native.source import cache_root
print(cache_root() / RECORD)')
KEPT=$WORK/installed.json.kept
rm -f "$KEPT"
[[ $DRY == 1 && -f $RECORD ]] && cp "$RECORD" "$KEPT"
step "native build ${BUILD[*]}"
LIB=$("${CLI[@]}" native build "${BUILD[@]}" --source "$ARCHIVE" --json \
      | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["lib_dir"])')
[[ -f $KEPT ]] && mv "$KEPT" "$RECORD"
export LLAMA_CPP_LIB_PATH=$LIB
step "libraries: $LIB"

# (3) the model
if [[ $DRY == 1 ]]; then
  MODEL=$WORK/dry-run-model.gguf
  # the real depth and top-k (48 layers, top-8), tiny widths: what scales with depth is covered.
  # Vulkan: 4 layers; lavapipe (Mesa 22.3) crashes intermittently in its shader threads at 48
  # layers with the cache and the routing hook on (cause not found; see llamacpp/README.md)
  # (the CPU dry run: the trace's shape, 48 layers x 128 experts, top-6, so it plays the trace)
  if [[ $VK == 1 ]]; then
    SHAPE=(--arch qwen3moe --layers 4 --experts 16 --top-k 8 --embd 64 --ff 32 --dtype q4_0)
  else
    SHAPE=(--arch qwen3moe --layers 48 --experts 128 --top-k 6 --embd 64 --ff 32 --dtype q4_0)
  fi
else
  MODEL=$WORK/qwen3-30b-a3b-q4_k_m-top6.gguf
  SHAPE=(--preset qwen3-30b-a3b --top-k 6 --dtype q4_k_m)
fi
# the real Qwen3-30B-A3B routing (28 prompt + 128 decode tokens, top-6); not on the 4-layer model
TRACE=$REPO/tests/runtime/traces/data/qwen3-30b-a3b.route.csv
ROUTE=()
[[ $VK == 1 ]] || ROUTE=(--route-trace "$TRACE")
if [[ ! -f $MODEL ]]; then
  step "writing $MODEL"
  "${CLI[@]}" synth "$MODEL" "${SHAPE[@]}" --skew 1.0 --seed 0 --quiet
fi

# (4) budgets and configs
read -r BUDGET NCPU TOTAL NMOE < <("$PY" - "$MODEL" "$PCT" <<'PYEOF'
import sys
from gguf_tools.facts import read_model_facts
facts = read_model_facts(sys.argv[1])
budget = facts.total_expert_bytes * int(sys.argv[2]) // 100
per_layer = max(facts.expert_bytes) * facts.n_expert
moe = len(facts.moe_layers)
# --n-cpu-moe N keeps the experts of layers >= N on the GPU: the smallest N whose GPU share fits
print(budget, moe - budget // per_layer, facts.total_expert_bytes, moe)
PYEOF
)
if [[ $VK == 1 ]]; then DEVICE=vulkan:0; elif [[ $DRY == 1 ]]; then DEVICE=cpu-slots; else DEVICE=cuda:0; fi
cat > "$WORK/lru.toml" <<TOML
[devices]
"$DEVICE" = "${BUDGET}B"
[policy]
phase_specific = false
[policy.decode]
admission = "always"
prefetch = "none"
eviction = "lru"
TOML
cat > "$WORK/phase-specific.toml" <<TOML
[devices]
"$DEVICE" = "${BUDGET}B"
[policy]
phase_specific = true
[policy.prefill]
admission = "always"
prefetch = "chunk-plan"
eviction = "lru"
[policy.decode]
admission = "reuse-threshold"
prefetch = "none"
eviction = "lfu-decay"
TOML
step "expert bytes $TOTAL, budget $BUDGET ($PCT%), --n-cpu-moe $NCPU"

# (5) the benchmark
BENCH=("${CLI[@]}" bench -m "$MODEL" --config "$WORK/lru.toml" --config "$WORK/phase-specific.toml"
       -r "$REPS" --cold 0 --no-progress ${ROUTE[@]+"${ROUTE[@]}"})
if [[ $VK == 1 ]]; then
  BENCH+=(-p 32 -n 8 -t 1 --n-cpu-moe "$NMOE" --n-cpu-moe "$NCPU")
  RESULT=$WORK/bench-vulkan-dry-run.md
elif [[ $DRY == 1 ]]; then
  BENCH+=(-p 32 -n 8)
  RESULT=$WORK/bench-dry-run.md
else
  BENCH+=(-p "$P" -n "$N" --n-cpu-moe "$NMOE" --n-cpu-moe "$NCPU")
  mkdir -p "$REPO/docs/benchmarks"
  RESULT=$REPO/docs/benchmarks/gpu-check-$(date -u +%Y-%m-%d).md
fi
step "${BENCH[*]}"
if [[ $VK == 1 ]]; then CHECK=(-p 32 -n 8 -t 1 -ngl -1)
elif [[ $DRY == 1 ]]; then CHECK=(-p 32 -n 8 -t 1 -ngl 0)
else CHECK=(-p "$P" -n "$N" -ngl -1); fi
if [[ $VK == 1 ]]; then TITLE=" (dry run: Vulkan, $DEVICE)"
elif [[ $DRY == 1 ]]; then TITLE=" (dry run: CPU, cpu-slots)"
else TITLE=""; fi
{
  echo "# gpu_check $(date -u +%Y-%m-%dT%H:%MZ)$TITLE"
  echo
  echo "libraries: $LIB"
  echo "expert budget: $BUDGET bytes ($PCT% of $TOTAL); device: $DEVICE"
  echo
  echo "## moe-offload bench"
  echo
  "${BENCH[@]}"
  echo
  echo "## the cache through the Engine (greedy; dense layers per -ngl), python -m runtime.bench.cache_check"
  echo
  "$PY" -m runtime.bench.cache_check "$MODEL" --config "$WORK/lru.toml" \
      --config "$WORK/phase-specific.toml" "${CHECK[@]}"
  if [[ $VK != 1 ]]; then   # lavapipe crashes intermittently at 48 layers (llamacpp/README.md)
    echo
    echo "## the cache machinery's cost per token and per MoE layer (48 layers, top-8, tiny widths)"
    echo
    if [[ $DRY == 1 ]]; then OVER=(-n 8 --reps 1 --device "$DEVICE" -ngl 0)
    else OVER=(-n 64 --reps 3 --device "$DEVICE" -ngl 99); fi
    "$PY" "$REPO/scripts/bench_cache_overhead.py" "${OVER[@]}"
  fi
} | tee "$RESULT"
step "wrote $RESULT"
