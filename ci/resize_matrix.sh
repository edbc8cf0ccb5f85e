#!/usr/bin/env bash
# Resizing a running engine's KV cache (integration/resize_run.py) in one device call: unpack the staged vLLM 0.26.0
# bundle if this machine has none yet, run the cases that fit the time box (resumable: RUN keeps finished cases
# while the machine stays up), copy every JSON and log to $OUT, print the table last.
#
#   ci/resize_matrix.sh [--budget-seconds S] [--only CASE ...]
#
# The bundle and its staging are ci/worst_batch_matrix.sh's (.device-stage/p*, /tmp/stage/). Cases, in order:
# qwen3-v1-bi, llama8b-v2, qwen3-v2-bi, llama8b-v1, qwen3-v1, qwen3-v2 (one GPU; -bi: batch-invariant mode, where
# tokens must be identical), qwen3-v1-tp2 (two GPUs; skipped on one). About 4 to 5 minutes a case.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
source ci/vllm_bundle.sh
run=${RUN:-/tmp/resize-run}
mkdir -p "$run/resize"
python3 -m extensible_kv environment "$run" > /dev/null 2>&1 || true
# MATRIX_TIMEOUT_S: a hard stop for the matrix (a device call's limit), so what finished still travels back
timeout --signal=INT "${MATRIX_TIMEOUT_S:-86400}" python3 -m integration.resize_run "$run" "$@" 2>&1 \
  | tee -a "$run/matrix.log" | tail -n 40
python3 -c "import sys; from integration.resize_run import summarize; summarize(__import__('pathlib').Path(sys.argv[1]))" "$run" > /dev/null 2>&1
if [ -n "${OUT:-}" ]; then  # a device call brings back few files: the cases and logs travel as one tarball
  tar -czf "$OUT/resize.tar.gz" -C "$run" resize
  cp "$run"/resize-summary.json "$run"/resize-table.md "$run"/matrix.log "$run"/environment.json "$OUT/" 2>/dev/null
fi
