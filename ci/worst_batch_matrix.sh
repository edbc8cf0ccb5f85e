#!/usr/bin/env bash
# The worst-batch matrix (integration/worst_batch_run.py) in one device call: unpack the staged vLLM 0.26.0 bundle
# if this machine has none yet, run as many cases as fit the time box (resumable: RUN keeps finished cases while
# the machine stays up), copy every JSON and log to $OUT, print the table last.
#
#   ci/worst_batch_matrix.sh [--budget-seconds S] [--only CASE ...] [--batches N]
#
# The bundle: ../shared/device/stage-vllm.sh wrote .device-stage/p0, p1, ...; every part but the last is copied to
# /tmp/stage/ by earlier calls (`mkdir -p /tmp/stage && cp .device-stage/pK /tmp/stage/`), the last is carried here.
# RUN (default /tmp/worst-batch-run) holds results between calls; WORST_BATCH_SEED_DIR, a folder of earlier JSON in
# the tree, seeds it after a fresh machine.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
source ci/vllm_bundle.sh
run=${RUN:-/tmp/worst-batch-run}
mkdir -p "$run/worst-batch"
if [ -n "${WORST_BATCH_SEED_DIR:-}" ] && [ -d "$WORST_BATCH_SEED_DIR" ]; then
  cp -n "$WORST_BATCH_SEED_DIR"/*.json "$run/worst-batch/" 2>/dev/null
fi
python3 -m extensible_kv environment "$run" > /dev/null 2>&1 || true
python3 -m integration.worst_batch_run "$run" "$@" 2>&1 | tee -a "$run/matrix.log" | tail -n 40
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT/worst-batch"
  cp "$run"/worst-batch/*.json "$run"/worst-batch/*.log "$OUT/worst-batch/" 2>/dev/null
  cp "$run"/worst-batch-summary.json "$run"/worst-batch-table.md "$run"/matrix.log "$run"/environment.json "$OUT/" 2>/dev/null
fi
