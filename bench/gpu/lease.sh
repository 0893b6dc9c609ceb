#!/usr/bin/env bash
# Every GPU figure in one call of the device tool (docs/gpu.md), with nothing built there:
#
#   here:   bench/gpu/pack_server.sh --with-benches build/ci .deps/device
#           tar cJf .deps/carry/device.tar.xz -C .deps device
#   device: bash bench/gpu/lease.sh          (carry: [".deps/carry"]; $OUT is the tool's)
#
# Runs run_all.sh --scale lease phase by phase (kernels, tests, spec, step, serve, load,
# report), each under its own time limit, and after each phase packs what the phases wrote into
# $OUT/gpu.tgz, so a call cut off at the tool's limit still brings back every finished phase.
# Phase limits (seconds) can be changed with LEASE_PHASES="tests:120 spec:130 ...", the device
# with LEASE_DEVICE=cpu (to try the script without a GPU).
set -uo pipefail
cd "$(dirname "$0")/../.."
dest=${OUT:?set OUT to the folder whose files come back}
work=${LEASE_WORK:-/tmp/imagegen-gpu}
mkdir -p "$work/out"
. bench/gpu/carried.sh
carried_unpack "$work" || exit 1
nvidia-smi > "$work/out/nvidia-smi.txt" 2>&1 || true
phases=${LEASE_PHASES:-"kernels:40 tests:110 spec:130 step:90 serve:60 load:100 report:20"}
for pt in $phases; do
  p=${pt%%:*} t=${pt##*:}
  carried_phase lease "$p" "$t" "$work/out/lease.log" \
    bash bench/gpu/run_all.sh --prebuilt "$work/device" --scale lease \
    --device "${LEASE_DEVICE:-cuda}" --phase "$p" --out "$work/out"
  tar czf "$dest/gpu.tgz" -C "$work/out" .
done
