#!/usr/bin/env bash
# One device call on the H200 (../shared/device/README.md): unpack the staged vllm bundle if needed, run the named
# stages, pack every log and JSON into $OUT/run.tgz.
#
#   RUN_TAG=<name> ci/h200_session.sh STAGE...      STAGE: conformance | connectors | sleep | serve-sleep
#
# conformance: `extensible-kv check-driver cuda` (the rules alone, as a backend team runs them); connectors:
# integration/connector_run.py; sleep: integration/sleep_mode.py; serve-sleep: integration/serve_sleep.py (sleep mode
# through `vllm serve`'s dev routes, one server per mode, the plugin from a dist-info it writes; SERVE_SLEEP_ARGS adds
# its options). Results land in /tmp/run-$RUN_TAG/<stage>/, which survives between calls while the machine stays
# warm, so a later call can add stages to the same run.
set -u
t0=$(date +%s)
if [ ! -d /tmp/site/vllm ]; then
  last=$(ls .device-stage/p* 2>/dev/null | tail -n 1)
  [ -n "$last" ] || { echo "no .device-stage part carried and no /tmp/site: stage the bundle first"; exit 3; }
  mkdir -p /tmp/site && cat /tmp/stage/p* "$last" | xz -d | tar -x -C /tmp/site || exit 3
fi
echo "unpacked in $(( $(date +%s) - t0 )) s"
export PYTHONPATH=/tmp/site:$PWD/reference:$PWD/lab:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export VLLM_CACHE_ROOT=/tmp/cc/vllm TRITON_CACHE_DIR=/tmp/cc/triton TORCHINDUCTOR_CACHE_DIR=/tmp/cc/inductor
R=/tmp/run-${RUN_TAG:?set RUN_TAG}; mkdir -p "$R"
python3 -m extensible_kv environment "$R" > /dev/null 2>&1 || echo "environment.json not written"
for stage in "$@"; do
  s0=$(date +%s); mkdir -p "$R/$stage"
  case $stage in
    conformance)
      python3 -m extensible_kv check-driver cuda --summary-json "$R/conformance/conformance-cuda.json" \
        > "$R/conformance/check-driver-cuda.log" 2>&1
      echo "conformance rc=$?"; tail -n 5 "$R/conformance/check-driver-cuda.log" ;;
    connectors)
      python3 integration/connector_run.py "$R/connectors" ${CONNECTOR_ARGS:-} > "$R/connectors/run.log" 2>&1
      echo "connectors rc=$?"; tail -n 40 "$R/connectors/run.log" ;;
    sleep)
      python3 integration/sleep_mode.py "$R/sleep" --budget-seconds "${SLEEP_BUDGET:-390}" ${SLEEP_ARGS:-} \
        > "$R/sleep/run.log" 2>&1
      echo "sleep rc=$?"; tail -n 30 "$R/sleep/run.log" ;;
    serve-sleep)
      python3 integration/serve_sleep.py "$R/serve-sleep" ${SERVE_SLEEP_ARGS:-} > "$R/serve-sleep/run.log" 2>&1
      echo "serve-sleep rc=$?"; tail -n 30 "$R/serve-sleep/run.log" ;;
    *) echo "unknown stage $stage" ;;
  esac
  echo "$stage took $(( $(date +%s) - s0 )) s"
done
mkdir -p "$OUT" && tar -czf "$OUT/run.tgz" -C "$R" --exclude=example-storage --exclude=models .  # the connector's store
