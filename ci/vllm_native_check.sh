#!/usr/bin/env bash
# The conformance rules on vLLM's own VMM driver and ExtensibleTensor (vLLM >= 0.34), on a GPU machine where nothing
# can be installed: torch, cuda-bindings, pytest, pytest-xdist and hypothesis must be importable, and the 17
# pure-Python modules of vLLM its driver and tensor import must be on PYTHONPATH (they run on torch 2.11; no vLLM kernels).
#
#   ci/vllm_native_check.sh stage [SOURCE]   # here: copy those modules into .device-stage/vllm034/ (git-ignored)
#   ci/vllm_native_check.sh run OUTDIR       # on the GPU machine, with .device-stage/vllm034 carried
#
# SOURCE is a folder holding vllm/ (default /work/vllm034) or a vLLM wheel (the modules are unzipped from it).
# `run` writes into OUTDIR: check-driver-vllm.log and rules-driver.json (per rule: outcome and, for a rule the
# caller-guaranteed profile leaves out, its reason), tensor-rules.log and rules-tensor.json (the tensor rules on
# vLLM's ExtensibleTensor over the vllm driver, --tensor vllm), probe.txt (vLLM's version and the driver's probe),
# findings.json and findings.log (ci/vllm_native_repro.py: each code-read finding reproduced or not, with vLLM's API
# only), environment.json (plain JSON: extensible_kv.record), and the junit XML of both; it prints a short table last. The exit
# status is 0 when both steps ran to their summary (rules may have failed: the table says which), else 1.
# ci/vllm_native_rules.py writes the per-rule files and conformance-vllm.json / conformance-vllm-tensor.json (the
# conformance summary `extensible-kv report` reads) from the junit XML.
#
# Note [One process for the tensor rules]
#   On the H100 (2026-12-06) a first run of the tensor rules under `-p xdist -n 1` ended with exit status 3 (pytest's
#   internal error) and no junit XML. The run that ran to its summary was this one: one process, pytest's
#   unraisable-exception hook off. Its log shows why the hook matters: once vLLM's views outlived their tensor
#   (test_lifecycle_under_garbage_collection_stress, an illegal address, which ends the process's CUDA context), the
#   summary's commit probe failed, and the reaper's later close of the probe's tensor raised in a finalizer, which
#   the hook, under filterwarnings=error, turns into an error of the session. Every rule that runs after the illegal
#   address fails with it (reports/runs/h100-2026-12-06-vllm-native/README.md).
#
# Note [One process per rule file]
#   A rule that ends the CUDA context (vLLM's views used after their tensor was collected: F4) takes every rule after
#   it in the same process with it: on the H100 (2026-12-06) 18 of the 76 tensor rules failed that way and were
#   never judged on the GPU. Each rule file now runs in its own process and the collection rule alone, so one lost
#   context costs at most the rest of its own file; the junit XML of each process is junit-tensor-<file>.xml and
#   ci/vllm_native_rules.py reads them all as one step.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
stage_dir="$root/.device-stage/vllm034"
MODULES=(vllm/__init__.py vllm/_version.py vllm/version.py vllm/env_override.py vllm/envs.py vllm/logger.py
  vllm/utils/__init__.py vllm/utils/torch_version.py vllm/utils/vmm_driver.py vllm/utils/extensible_tensor.py)
MODULE_DIRS=(vllm/logging_utils)

case ${1:?stage or run} in
  stage)
    src=${2:-/work/vllm034}
    rm -rf "$stage_dir" && mkdir -p "$stage_dir"
    if [ -f "$src" ]; then  # a wheel: unzip only the modules
      python3 - "$src" "$stage_dir" "${MODULES[@]}" "${MODULE_DIRS[@]}" <<'EOF'
import sys, zipfile
wheel, dest, *wanted = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n in wanted or any(n.startswith(d + "/") and n.endswith(".py") and n.count("/") == d.count("/") + 1 for d in wanted)]
    z.extractall(dest, names)
print(len(names), "modules")
EOF
    else
      (cd "$src" && cp --parents "${MODULES[@]}" "$stage_dir/" && for d in "${MODULE_DIRS[@]}"; do
        mkdir -p "$stage_dir/$d" && cp "$d"/*.py "$stage_dir/$d/"; done)
    fi
    count=$(find "$stage_dir" -name '*.py' | wc -l)
    echo "staged $count modules into .device-stage/vllm034 ($(du -sh "$stage_dir" | cut -f1)); carry .device-stage/vllm034"
    [ "$count" -eq 17 ] || { echo "expected 17 modules, found $count" >&2; exit 1; }
    exit 0 ;;
  run) ;;
  *) echo "usage: $0 stage [SOURCE] | run OUTDIR" >&2; exit 2 ;;
esac

out=${2:?OUTDIR}
mkdir -p "$out"
cd "$root"
export PYTHONPATH="$stage_dir:$root/reference:$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export EXTENSIBLE_KV_REQUIRE_GPU=1
python3 -m extensible_kv environment "$out" > /dev/null 2>&1 || true
# vLLM's driver does not call cuInit: the probe makes torch's context first (Note in drivers/vllm_vmm.py).
python3 - > "$out/probe.txt" 2>&1 <<'EOF'
import torch, vllm
from extensible_kv import drivers
print("vllm", vllm.__version__, "from", vllm.__file__)
print("torch", torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
print("probe(vllm):", drivers.probe("vllm") or "available")
EOF
cat "$out/probe.txt"

status=0
# 1. Every driver rule on vLLM's VmmDriver (the caller-guaranteed profile reports what it leaves out, per rule).
python3 -m extensible_kv check-driver vllm -q "--junitxml=$out/junit-driver.xml" > "$out/check-driver-vllm.log" 2>&1
rc_driver=$?
grep -q "conformance summary" "$out/check-driver-vllm.log" || status=1
# 2. The tensor rules on vLLM's ExtensibleTensor, over the vllm driver (through the rules' Ledger): one process per
# rule file, and the collection rule in a process of its own (Note [One process per rule file]); each process
# without an xdist worker and without pytest's unraisable-exception hook (Note [One process for the tensor rules]).
files=$(python3 -c "from conformance.tensors import TENSOR_RULE_FILES as f; print(' '.join(f))")
gc_rule="conformance/test_reliability.py::test_lifecycle_under_garbage_collection_stress"
rc_tensor=0
: > "$out/tensor-rules.log"
for f in $files alone; do
  if [ "$f" = alone ]; then sel=("$gc_rule"); else sel=("conformance/$f" --deselect "$gc_rule[vllm]"); fi
  echo "== ${sel[0]}" >> "$out/tensor-rules.log"
  python3 -m pytest "${sel[@]}" --driver vllm --tensor vllm -p no:cacheprovider -p no:benchmark \
    -p no:unraisableexception -q "--junitxml=$out/junit-tensor-${f%.py}.xml" >> "$out/tensor-rules.log" 2>&1
  rc=$?; [ $rc -gt $rc_tensor ] && rc_tensor=$rc
done
grep -q "conformance summary" "$out/tensor-rules.log" || status=1

# 3. The reproducers of what reading vLLM's code suggests (ci/vllm_native_repro.py), each in its own process.
python3 ci/vllm_native_repro.py "$out/findings.json" > "$out/findings.log" 2>&1 || status=1
python3 ci/vllm_native_rules.py "$out" "$rc_driver" "$rc_tensor"
exit $status
