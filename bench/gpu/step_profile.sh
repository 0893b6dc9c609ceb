#!/usr/bin/env bash
# Where a served step's time goes on the device, and two A/Bs: the load bench (the engine's
# continuous batching, AR and scd-mc at 1 and 4 clients) as imagegen runs by default (cuDNN's
# attention off, PrepareAttention in engine/model/device.h; CUDA graphs on, the CUDA default
# since 2026-11-28, engine/model/cuda_graphs.h), with the eager forward (--cuda-graphs 0), and
# with cuDNN's attention on
# (IMAGEGEN_CUDNN_SDPA=1, LibTorch's default); the forward alone, eager against graphs
# (imagegen-step-cost); the per-op profile (IMAGEGEN_OP_PROFILE=1, bench/op_profile.h); the
# speculative bench at batch 1 (speedups with the step split off, then the split, profiled).
# Prebuilt programs as in bench/gpu/lease.sh; results packed into $OUT/profile.tgz after each
# part.
#
#   device: bash bench/gpu/step_profile.sh        (carry: [".deps/carry"])
set -uo pipefail
cd "$(dirname "$0")/../.."
dest=${OUT:?set OUT}
work=${LEASE_WORK:-/tmp/imagegen-gpu}
o=$work/profile
mkdir -p "$o"
. bench/gpu/carried.sh
carried_unpack "$work" || exit 1
carried_wrappers "$work/device" "$(carried_python)" || exit 1
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
# Most wanted first (a call cut off at its limit keeps what finished): the default engine (CUDA
# graphs), the same with the eager forward, the forward alone eager against graphs, then the
# profile, the spec bench, and last cuDNN's attention (LibTorch's choice, which the first GPU
# run measured).
load load_default IMAGEGEN_CUDNN_SDPA=0 "$B/imagegen-load-bench" --device "$dev" --dtype bf16
load load_eager IMAGEGEN_CUDNN_SDPA=0 "$B/imagegen-load-bench" --device "$dev" --dtype bf16 \
  --cuda-graphs 0
# Finished images decoded on the engine thread (the default on CUDA is the decode thread).
load load_inline_decode IMAGEGEN_CUDNN_SDPA=0 "$B/imagegen-load-bench" --device "$dev" \
  --dtype bf16 --decode-thread 0
timeout -k 5 60 "$B/imagegen-step-cost" --device "$dev" --shapes bundled,gpt-b --dtypes bf16 \
  --requests 1,4,16 --tokens 1,4,16,64,256 --reps 5 --forwards eager,graphs \
  --csv "$o/step_cost_graphs.csv" > "$o/step_cost_graphs.log" 2>&1
echo "step-cost exit $?" | tee -a "$o/parts.log"; pack
# LlamaGen's own serving figures are 8 images of 384 px (576 tokens) with CFG: the step of 8
# requests at one token each, at the mean context (--grid 24), eager and with graphs.
timeout -k 5 60 "$B/imagegen-step-cost" --device "$dev" --shapes gpt-b,gpt-l,gpt-xl \
  --dtypes bf16 --grid 24 --requests 8 --tokens 8 --reps 5 --forwards eager,graphs \
  --csv "$o/step_cost_vllm.csv" > "$o/step_cost_vllm.log" 2>&1
echo "step-cost-llamagen exit $?" | tee -a "$o/parts.log"
python3 bench/gpu/report.py --llamagen "$o/step_cost_vllm.csv" > "$o/llamagen.md" 2>&1; pack
load load_profile IMAGEGEN_OP_PROFILE=1 "$B/imagegen-load-bench" --device "$dev" --dtype bf16
timeout -k 5 80 "$B/imagegen-spec-bench" --device "$dev" --dtype bf16 --per-class 1 \
  --methods sjd,scd-mc,sjd-pac,sd --windows 32 --sd-windows 8 --split 0 --python python3 \
  --out-dir "$o/spec" > "$o/spec.log" 2>&1
echo "spec exit $?" | tee -a "$o/parts.log"; pack
timeout -k 5 60 env IMAGEGEN_OP_PROFILE=1 "$B/imagegen-spec-bench" --device "$dev" \
  --dtype bf16 --per-class 1 --methods scd-mc --windows 32 --split 1 --fused-verify all \
  --python python3 \
  --out-dir "$o/spec-split" > "$o/spec_split.log" 2>&1
echo "spec-split exit $?" | tee -a "$o/parts.log"; pack
load load_cudnn IMAGEGEN_CUDNN_SDPA=1 "$B/imagegen-load-bench" --device "$dev" --dtype bf16
head -n 5 "$o/load_default.log" "$o/load_eager.log" "$o/load_inline_decode.log" \
  "$o/load_cudnn.log"
tail -n 30 "$o/step_cost_graphs.log"; cat "$o/llamagen.md"; tail -n 40 "$o/load_profile.log"
tail -n 14 "$o/spec.log"
