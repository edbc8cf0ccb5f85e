#!/usr/bin/env bash
# Two engines on one GPU trading KV memory through the coordinator against a fixed 50/50 split
# (integration/share_run.py), in one device call: unpack the staged vLLM 0.26.0 bundle if this machine has none yet,
# run the harness into RUN (default /tmp/share-run, emptied first: not resumable), then put everything it wrote into
# one tarball, $OUT/share.tar.gz, beside $OUT/share-summary.json and $OUT/share-table.md (a device call brings back
# at most 8 files). The table is printed last; the exit status is the harness's (1: a stage did not finish).
#
#   OUT=$OUT ci/share_matrix.sh [--budget-seconds S] [--util U] [--headroom H] ...
#
# The bundle and its staging are ci/worst_batch_matrix.sh's (.device-stage/p*, /tmp/stage/). About 7 minutes with
# the default --budget-seconds 540: two server starts, one after the other, then four phases of up to 60 s.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
source ci/vllm_bundle.sh
run=${RUN:-/tmp/share-run}
rm -rf "$run"
mkdir -p "$run"
python3 -m extensible_kv environment "$run" > /dev/null 2>&1 || true
nvidia-smi > "$run/nvidia-smi.txt" 2>&1 || true
# MATRIX_TIMEOUT_S: a hard stop (a device call's limit); the harness stops both servers on the interrupt
timeout --signal=INT --kill-after=30 "${MATRIX_TIMEOUT_S:-86400}" python3 -m integration.share_run "$run" "$@" > "$run/share.log" 2>&1
status=$?
tail -n 60 "$run/share.log"
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  tar -czf "$OUT/share.tar.gz" -C "$(dirname "$run")" "$(basename "$run")"
  cp "$run"/share-summary.json "$run"/share-table.md "$OUT/" 2>/dev/null
fi
exit $status
