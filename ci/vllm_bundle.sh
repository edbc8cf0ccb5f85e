#!/usr/bin/env bash
# Unpack the staged vLLM 0.26.0 bundle into /tmp/site unless this machine has it already; sourced by the device
# scripts (worst_batch_matrix.sh, resize_matrix.sh, h200_session.sh) from the repository root.
#
# The bundle: ../shared/device/stage-vllm.sh wrote .device-stage/p0, p1, ...; every part but the last is copied to
# /tmp/stage/ by earlier calls (`mkdir -p /tmp/stage && cp .device-stage/pK /tmp/stage/`), the last is carried into
# the call that sources this. The multimodal case's torchvision and pillow come as wheels in /tmp/stage/mm/.
# Then the environment every device script runs vLLM in: the bundle, the package, the lab and the tree on PYTHONPATH,
# no flashinfer sampler (not in the bundle), vLLM's and torch's compile caches under /tmp/cc (kept between calls).
t0=$(date +%s)
if [ ! -d /tmp/site/vllm ]; then
  last=$(ls .device-stage/p* 2>/dev/null | sort -V | tail -n 1)
  [ -n "$last" ] || { echo "no .device-stage/p* carried and no /tmp/site: stage and carry the last part"; exit 3; }
  ls /tmp/stage/p* > /dev/null 2>&1 || { echo "no /tmp/stage/p*: copy the earlier parts first"; exit 3; }
  mkdir -p /tmp/site && cat $(ls /tmp/stage/p* | sort -V) "$last" | xz -d | tar -x -C /tmp/site || exit 3
fi
if [ -d /tmp/stage/mm ] && [ ! -d /tmp/site/torchvision ]; then
  for w in /tmp/stage/mm/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
fi
echo "vllm unpacked in $(( $(date +%s) - t0 )) s"
root=${root:-$PWD}
export PYTHONPATH="/tmp/site:$root/reference:$root/lab:$root" VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export VLLM_CACHE_ROOT=/tmp/cc/vllm TRITON_CACHE_DIR=/tmp/cc/triton TORCHINDUCTOR_CACHE_DIR=/tmp/cc/inductor
