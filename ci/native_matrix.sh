#!/usr/bin/env bash
# vLLM 0.34's own extensible KV cache against the same engine with it off (integration/native_run.py), on a GPU
# machine whose image has torch 2.11: vLLM 0.34 runs on its own torch 2.14.0, triton 3.8.0 and NCCL 2.30.7, staged
# by ci/stage_vllm034.sh into .device-stage034/{a,b,c}K parts of at most 48 MiB.
#
#   (every part but the last, one call each)  mkdir -p /tmp/stage034 && cp .device-stage034/<part> /tmp/stage034/
#   (the last part carried)                    OUT=$OUT ci/native_matrix.sh [--budget-seconds S] [--only CASE ...]
#
# Unpacks the three archives into /tmp/site034 once (a: torch, torchvision, triton; b: vLLM 0.34.0 without its
# FA2, MoE and router binaries, and the Python packages it needs newer than the image's; c: libnccl.so.2, whose
# newer symbols torch 2.14 links), links the image's other CUDA libraries beside them (torch finds them through its
# RPATH, $ORIGIN/../../nvidia/<lib>/lib), then runs the matrix with /tmp/site034 first on PYTHONPATH and the
# vLLM 0.26.0 bundle's packages (/tmp/site, where staged) after it. RUN (default /tmp/native-run) keeps finished
# engines while the machine stays up. Everything written comes back under $OUT; the table is printed last.
set -u
run=${RUN:-/tmp/native-run}
copy_out() {  # on every exit, a time limit's too: what ran comes back
  if [ -n "${OUT:-}" ] && [ -d "$run" ]; then
    mkdir -p "$OUT"
    tar -czf "$OUT/native.tar.gz" -C "$(dirname "$run")" "$(basename "$run")"
    cp "$run"/native-summary.json "$run"/native-table.md "$OUT/" 2>/dev/null
  fi
}
trap copy_out EXIT
trap 'exit 143' TERM INT
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
t0=$(date +%s)
site=/tmp/site034
if [ ! -f "$site/.unpacked" ]; then
  shopt -s nullglob
  mkdir -p /tmp/stage034 "$site"
  for carried in .device-stage034/*; do cp "$carried" /tmp/stage034/; done
  for g in a b c; do
    parts=(/tmp/stage034/"$g"[0-9]*)  # split's two-digit suffixes sort in order
    [ ${#parts[@]} -gt 0 ] || { echo "no /tmp/stage034/${g}* parts: stage them first"; exit 3; }
    cat "${parts[@]}" | xz -d | tar -x -C "$site" || { echo "archive $g did not unpack (a part missing?)"; exit 3; }
  done
  image=$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
  for lib in "$image"/nvidia/*; do
    [ -e "$site/nvidia/$(basename "$lib")" ] || ln -s "$lib" "$site/nvidia/$(basename "$lib")"
  done
  touch "$site/.unpacked"
fi
echo "vLLM 0.34 unpacked in $(( $(date +%s) - t0 )) s"
extra=""
[ -d /tmp/site/vllm ] && extra=":/tmp/site"
export PYTHONPATH="$site$extra:$root/reference:$root/lab:$root" VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 NCCL_NVLS_ENABLE=0
export VLLM_CACHE_ROOT=/tmp/cc034/vllm TRITON_CACHE_DIR=/tmp/cc034/triton TORCHINDUCTOR_CACHE_DIR=/tmp/cc034/inductor
mkdir -p "$run"
python3 -c 'import torch, vllm; print("torch", torch.__version__, torch.__file__); print("vllm", vllm.__version__, vllm.__file__); print("nccl", torch.cuda.nccl.version())' 2>&1 | tee "$run/versions.txt"
python3 -m extensible_kv environment "$run" > /dev/null 2>&1 || true
python3 -m integration.native_run "$run" "$@" >> "$run/matrix.log" 2>&1 &
wait $!  # in the background: a signal reaches the trap now, not after the matrix ends
status=$?
tail -n 30 "$run/matrix.log"
exit $status
