#!/usr/bin/env bash
# Where a served step's time goes on the device, and the cuDNN-attention A/B: the load bench
# (the engine's continuous batching, AR and scd-mc at 1 and 4 clients) with cuDNN's attention
# on (IMAGEGEN_CUDNN_SDPA=1, LibTorch's default) and off (imagegen's default, PrepareAttention
# in engine/model/device.h), side by side; then with the per-op profile (IMAGEGEN_OP_PROFILE=1,
# bench/op_profile.h); then the speculative bench at batch 1 (speedups with the step split off,
# then the split, profiled). Prebuilt programs as in bench/gpu/lease.sh; results packed into
# $OUT/profile.tgz after each part.
#
#   device: bash bench/gpu/step_profile.sh        (carry: [".deps/carry"])
set -uo pipefail
cd "$(dirname "$0")/../.."
dest=${OUT:?set OUT}
work=${LEASE_WORK:-/tmp/imagegen-gpu}
o=$work/profile
mkdir -p "$o"
if [[ ! -x $work/device/bin/engine_tests ]]; then
  tar xJf .deps/carry/device.tar.xz -C "$work" 2>/dev/null \
    || python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
         .deps/carry/device.tar.xz "$work" || exit 1
fi
if [[ ! -e /work/main ]]; then mkdir -p /work && ln -s "$PWD" /work/main; fi
# The wrappers (library paths) that run_all.sh --prebuilt writes.
bash bench/gpu/run_all.sh --prebuilt "$work/device" --phase build --out "$o" > /dev/null 2>&1
B=$work/device/run
dev=${LEASE_DEVICE:-cuda}
pack() { tar czf "$dest/profile.tgz" -C "$o" .; }
load() {  # name, env..., then load-bench flags
  local name=$1; shift
  timeout -k 5 60 env "$@" --methods ar,scd-mc --concurrency 1,4 --seconds 3 \
    --seconds-per-client 0 --modes none --mixed-concurrency "" --out-dir "$o/$name" \
    > "$o/$name.log" 2>&1
  echo "$name exit $?" | tee -a "$o/parts.log"
  pack
}
load load_cudnn IMAGEGEN_CUDNN_SDPA=1 "$B/imagegen-load-bench" --device "$dev" --dtype bf16
load load_default IMAGEGEN_CUDNN_SDPA=0 "$B/imagegen-load-bench" --device "$dev" --dtype bf16
load load_profile IMAGEGEN_OP_PROFILE=1 "$B/imagegen-load-bench" --device "$dev" --dtype bf16
timeout -k 5 80 "$B/imagegen-spec-bench" --device "$dev" --dtype bf16 --per-class 1 \
  --methods sjd,scd-mc,sjd-pac,sd --windows 32 --sd-windows 8 --split 0 --python python3 \
  --out-dir "$o/spec" > "$o/spec.log" 2>&1
echo "spec exit $?" | tee -a "$o/parts.log"; pack
timeout -k 5 60 env IMAGEGEN_OP_PROFILE=1 "$B/imagegen-spec-bench" --device "$dev" \
  --dtype bf16 --per-class 1 --methods scd-mc --windows 32 --split 1 --python python3 \
  --out-dir "$o/spec-split" > "$o/spec_split.log" 2>&1
echo "spec-split exit $?" | tee -a "$o/parts.log"; pack
head -n 5 "$o/load_cudnn.log" "$o/load_default.log"; tail -n 40 "$o/load_profile.log"
tail -n 14 "$o/spec.log"
