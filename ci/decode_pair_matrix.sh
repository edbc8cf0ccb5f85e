#!/usr/bin/env bash
# Decode throughput of a resized engine against a never-resized one of the same model on one GPU, in paired windows
# (integration/decode_pair_run.py), in one device call: unpack the staged vLLM 0.26.0 bundle if this machine has none
# yet, run the harness into RUN (default /tmp/decode-pair-run, emptied first: not resumable), then put everything it
# wrote into one tarball, $OUT/decode-pair.tar.gz, beside $OUT/decode-pair-summary.json, $OUT/decode-pair-table.md
# and both engines' logs (a device call brings back at most 8 files). The table is printed last; the exit status is
# the harness's (1: a stage did not finish).
#
#   OUT=$OUT ci/decode_pair_matrix.sh [--model llama-8b-shape] [--runner v1] [--rounds 6] [--max-tokens 256] ...
#
# The bundle and its staging are ci/worst_batch_matrix.sh's (.device-stage/p*, /tmp/stage/). About 6 minutes with
# the defaults (8B shape, 6 rounds before and after, 256 tokens): two server starts, one after the other, then 52
# windows of about 3.5 s and the resize; --budget-seconds (480) is the hard box.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
source ci/vllm_bundle.sh
run=${RUN:-/tmp/decode-pair-run}
rm -rf "$run"
mkdir -p "$run"
python3 -m extensible_kv environment "$run" > /dev/null 2>&1 || true
nvidia-smi > "$run/nvidia-smi.txt" 2>&1 || true
# MATRIX_TIMEOUT_S: a hard stop (a device call's limit); the harness stops both servers on the interrupt
timeout --signal=INT --kill-after=30 "${MATRIX_TIMEOUT_S:-86400}" python3 -m integration.decode_pair_run "$run" "$@" > "$run/decode-pair.log" 2>&1
status=$?
tail -n 60 "$run/decode-pair.log"
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  tar -czf "$OUT/decode-pair.tar.gz" -C "$(dirname "$run")" "$(basename "$run")"
  cp "$run"/decode-pair-summary.json "$run"/decode-pair-table.md "$run"/engine-a.log "$run"/engine-b.log "$OUT/" 2>/dev/null
fi
exit $status
