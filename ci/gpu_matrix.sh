#!/usr/bin/env bash
# The GPU matrix on a machine where nothing can be installed: torch, cuda-bindings, pytest and pydantic (the
# measurement schema) must be importable, vllm too for the layouts and integration stages (e.g. unpacked onto
# PYTHONPATH).
#
#   ci/gpu_matrix.sh OUTDIR STAGE [pytest args...]
#
# STAGE: conformance | memcheck | bench | layouts | integration | matrix. EXTENSIBLE_KV_DRIVER picks the driver (default cuda; hip on
# ROCm). Logs, JSON (extensible_kv_lab.measurements), environment.json and a junit XML per stage land in OUTDIR, which
# `python3 -m extensible_kv report OUTDIR` renders; the integration stage also packs its per-case JSON and logs into
# OUTDIR/integration.tgz (unpack it into OUTDIR/integration/ for the report).
set -uo pipefail
out=${1:?OUTDIR}; stage=${2:?STAGE}; shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
cd "$root"
export PYTHONPATH="$root/reference:$root/lab:$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -m extensible_kv environment "$out" > /dev/null || echo "environment.json not written" >&2
export EXTENSIBLE_KV_REQUIRE_GPU=1
if [ -n "${EXTENSIBLE_KV_COMPILE_CACHE:-}" ]; then  # compile caches that travel between calls (README, integration)
  export VLLM_CACHE_ROOT="$EXTENSIBLE_KV_COMPILE_CACHE/vllm" TRITON_CACHE_DIR="$EXTENSIBLE_KV_COMPILE_CACHE/triton" \
    TORCHINDUCTOR_CACHE_DIR="$EXTENSIBLE_KV_COMPILE_CACHE/inductor"
fi

# The vllm.general_plugins entry point, registered without installing the package.
ep=$(mktemp -d)/extensible_kv-0.1.0.dist-info
mkdir -p "$ep"
printf 'Metadata-Version: 2.1\nName: extensible-kv\nVersion: 0.1.0\n' > "$ep/METADATA"
printf '[vllm.general_plugins]\nextensible_kv = extensible_kv.vllm.plugin:register\n' > "$ep/entry_points.txt"
export PYTHONPATH="$(dirname "$ep"):$PYTHONPATH"

driver=${EXTENSIBLE_KV_DRIVER:-cuda}
common=(-p no:cacheprovider -q "--junitxml=$out/junit-$stage.xml")
rules=(conformance --driver "$driver")  # the rules
case $stage in
  conformance)
    python3 -m pytest "${rules[@]}" "--summary-json=$out/conformance-$driver.json" --commit-probe-bytes=34359738368 \
      "${common[@]}" "$@" ;;
  memcheck)
    # The conformance rules under compute-sanitizer memcheck (fewer Hypothesis examples; the OOM rule, which commits
    # the whole GPU, is left out). Note [accessible() probes unmapped addresses] in drivers/cuda.py: API errors are
    # deliberate there, so only memory errors count.
    sanitizer=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$sanitizer" --tool memcheck --report-api-errors no --print-limit 10000 \
      --error-exitcode 99 python3 -m pytest "${rules[@]}" --hypothesis-profile=extensible-kv-meta -k "not past_the_device_memory" \
      "${common[@]}" "$@" > "$out/memcheck-$driver.txt" 2>&1
    rc=$?
    grep -E "ERROR SUMMARY|passed|failed" "$out/memcheck-$driver.txt" | tail -n 3
    exit $rc ;;
  bench)
    python3 -m pytest bench --bench-driver "$driver" --benchmark-enable "--benchmark-json=$out/bench-$driver.json" \
      "${common[@]}" "$@" ;;
  layouts)
    export EXTENSIBLE_KV_REQUIRE_VLLM=1
    python3 -m pytest integration/test_backend_layouts.py "${common[@]}" "$@"
    rc=$?
    python3 -m extensible_kv validate-backend FLASH_ATTN TRITON_ATTN FLEX_ATTENTION ROCM_ATTN --layout both \
      --driver "$driver" --json "$out/validate-backend-$driver.json" > "$out/validate-backend-$driver.txt" 2>&1
    python3 -m extensible_kv validate-backend TRITON_MLA FLASHMLA CUTLASS_MLA FLASH_ATTN_MLA --num-kv-heads 1 \
      --head-size 576 --driver "$driver" --json "$out/validate-backend-$driver-mla.json" \
      >> "$out/validate-backend-$driver.txt" 2>&1
    tail -n 3 "$out/validate-backend-$driver.txt"
    exit $rc ;;
  integration)
    work=$(mktemp -d)
    export EXTENSIBLE_KV_REPORT_DIR=$work
    python3 -m pytest integration/test_greedy_parity.py "${common[@]}" "$@"
    rc=$?
    tar -czf "$out/integration.tgz" -C "$work" .
    exit $rc ;;
  matrix)
    # The vLLM parity matrix (integration/matrix.py): one process per engine, resumable from OUTDIR/integration;
    # the rest of the arguments go to it (--only GROUP|PATTERN, --part N/M, --budget-seconds S, --list).
    python3 -m integration.matrix "$out" "$@" ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
