#!/usr/bin/env bash
# The one prepared script for a session that is lent a GPU (the device tool's `run`), from the repository root:
#
#     bash bench/gpu_session.sh [SECONDS]        # default 540: leave the call's limit some slack
#
# A lent machine has its own Python (CuPy for CUDA 13, Numba, NumPy, transformers, torch) and no network, so the
# packages it lacks travel as wheels in .whl/ (gguf and blake3 today; see the device notes) and are installed
# into /tmp/site. Each step runs under its share of SECONDS, counted from the start, and writes into $OUT
# (./gpu-session without one), so a step cut short still leaves what it printed:
#   1. what the machine has (GPU, driver, CUDA, package versions); a plain checkout gets freetoken.cpu_kernels
#      mapped in (bench/checkout_finder.py as sitecustomize); a Numba warm-up starts in the background,
#      so the CPU reference model of step 3 does not compile its kernels on the clock of the GPU steps;
#   2. bench/gpu_check.py's kernel table, compiled for this card only with parallel NVRTC (CI compiles every
#      target); failing cases are rerun with FREETOKEN_NO_MMA=1 (passing then points at the tensor-core path);
#   3. host cost per launch (bench/launch_overhead.py), then the end-to-end check (bench/gpu_model_check.py):
#      logits against the cpu device, decode rates, bench bw;
#   4. the pytest cases marked gpu in the device-parametrized test modules, with the time left.
# Record what it shows in bench/GPU_RESULTS.md (the only record of freetoken on real GPUs).
set -u
BUDGET=${1:-540}
OUT=${OUT:-$PWD/gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
left() { echo $((BUDGET - SECONDS)); }
step() { echo; echo "=== $* (t=${SECONDS}s, $(left)s left)"; }

step "1. the machine"
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if ! $PY -c "import freetoken.cpu_kernels" 2>/dev/null; then  # a plain checkout: map cpu_kernels/ in
    mkdir -p /tmp/ft_site && cp bench/checkout_finder.py /tmp/ft_site/sitecustomize.py
    export PYTHONPATH="/tmp/ft_site:$PYTHONPATH" FREETOKEN_CHECKOUT=$PWD
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$OUT/machine.txt"
$PY - <<'EOF' 2>&1 | tee -a "$OUT/machine.txt"
import importlib, platform
print("python", platform.python_version(), "cpus", __import__("os").cpu_count())
for m in ("numpy", "numba", "cupy", "gguf", "blake3", "xxhash", "safetensors", "tokenizers", "torch", "transformers"):
    try:
        print(f"{m:<13}", getattr(importlib.import_module(m), "__version__", "?"))
    except Exception as e:
        print(f"{m:<13} MISSING ({e})")
from freetoken.device.nvrtc import nvrtc_version, base_options
from freetoken.device import device_status
print("nvrtc", nvrtc_version(), "runtime headers:", [o for o in base_options("sm_90") if "include" in o])
print("devices", device_status())
EOF
$PY - >"$OUT/numba_warmup.txt" 2>&1 <<'EOF' &
import time, numpy as np
t = time.perf_counter()
from freetoken.engine.loading.load import load
m = load(None, device="cpu")
ids = np.asarray(m.encode("import os\nimport sys\n\n\ndef main(argv):\n"))
m.decoder.reset(); m.decoder.forward(ids); m.decoder.forward(ids[:1])
print(f"numba warm-up done in {time.perf_counter() - t:.1f}s")
EOF
WARM=$!

step "2. kernel table (bench/gpu_check.py)"
timeout $(( $(left) - 150 )) $PY bench/gpu_check.py --archs native --jobs 12 --no-model-check \
    --deadline-s $(( $(left) - 180 )) 2>&1 | tee "$OUT/gpu_check.txt"
FAILED=$(awk '$3 == "FAIL" {print $1}' "$OUT/gpu_check.txt" | paste -sd'|')
if [ -n "$FAILED" ] && [ "$(left)" -gt 200 ]; then
    step "2b. the failing cases with FREETOKEN_NO_MMA=1: $FAILED"
    FREETOKEN_NO_MMA=1 timeout 90 $PY bench/gpu_check.py --archs native --no-model-check --only "^($FAILED)$" \
        2>&1 | tee "$OUT/gpu_check_no_mma.txt"
fi

step "2c. launch overhead (bench/launch_overhead.py)"
timeout 40 $PY bench/launch_overhead.py 2>&1 | tee "$OUT/launch_overhead.txt"
timeout 40 $PY bench/launch_overhead.py --step 2>&1 | tee -a "$OUT/launch_overhead.txt"

step "3. end to end (bench/gpu_model_check.py)"
timeout $(( $(left) > 150 ? $(left) - 90 : 30 )) tail --pid=$WARM -f /dev/null
cat "$OUT/numba_warmup.txt"
timeout $(( $(left) > 110 ? $(left) - 60 : 50 )) $PY -c "
import sys; sys.path.insert(0, 'bench')
from gpu_model_check import run
sys.exit(min(run('gpu'), 1))" 2>&1 | tee "$OUT/model_check.txt"

step "4. pytest -m gpu"
if [ "$(left)" -gt 30 ]; then
    timeout $(( $(left) - 10 )) $PY -m pytest -q -m gpu -p no:cacheprovider -n 8 --durations=0 \
        --junitxml "$OUT/gpu_tests.xml" tests/test_kernel_parity.py tests/test_model_parity.py tests/test_cache.py \
        tests/test_cache_semantics.py tests/test_expert_runner.py tests/test_latent_attention.py tests/test_linear.py \
        tests/test_kquant_kernels.py tests/test_qstar.py tests/test_hybrid_models.py tests/test_cache_scored.py \
        tests/test_policy.py 2>&1 | tail -60 \
        | tee "$OUT/gpu_tests.txt"
fi
step "done"
