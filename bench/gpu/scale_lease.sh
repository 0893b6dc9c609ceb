#!/usr/bin/env bash
# A short device-tool call after bench/gpu/graphs_lease.sh on the still-warm machine (about 8
# minutes): CUDA graphs at the loads and model size the earlier calls left out, and the
# daemon with graphs.
#
#   device: bash bench/gpu/scale_lease.sh     (carry: [".deps/carry"]; $OUT is the tool's)
#
# Steps, most wanted first, each under its own limit, the output packed into $OUT/scale.tgz
# after each:
#   high    imagegen-load-bench with --cuda-graphs 1 at 16, 32 and 64 clients (ar, scd-mc,
#           sjd-pac; whole windows and the goodput controller): the earlier runs stopped at 8
#   decode  why requests fall out of steps at high load (2026-11-28: 6-18 requests a step at 16-64
#           clients): ar and scd-mc at 32 clients with whole windows, the finished images
#           decoded on the decode thread up to 16 a call (the default with graphs), on it one
#           at a time (--decode-batch 1), on the engine thread (--decode-thread 0), and not
#           decoded at all (--decode-images 0); the dec ms column is last token to image;
#           first the decoder alone at 1..32 images a call (imagegen-forward-latency --decoder)
#   trace   the goodput controller's view of every step (--trace-dir: each request's age,
#           window, expectation, commit factor and commits, and each step's captures and
#           measured time) for sjd-pac and scd-mc at 4 and 16 clients, where it lost to whole
#           windows on 2026-11-28, each cell's engine cold (--warmup 0: graphs captured as
#           the load meets their shapes) and warmed up with the cell's method and load first
#           (--warmup 1, the daemon's default with graphs): the capt column, and the cost of
#           a capture step against a replay in the trace
#   serve   the daemon with --cuda_graphs (run_all.sh --phase serve): a sneaker, imagegen load
#           for ar and scd-mc at 16 clients, /metrics, SIGTERM drain
#   gptb    a random GPT-B-shaped LlamaGen model served (tools/parity.py's gptb-random with its
#           random VQ-16 decoder at 256 px), graphs on, ar and scd-mc at 1, 8 and 32 clients.
#           Random weights: the acceptance says nothing of a trained model; the AR cells are
#           the served throughput of the shape
#   cudnn   cuDNN's attention against the memory-efficient kernel (IMAGEGEN_CUDNN_SDPA=1 / 0),
#           eager forward, ar and scd-mc at 1 and 4 clients
# SCALE_STEPS="high:100 serve:60" picks and sizes the steps; SCALE_DEVICE=cpu tries the script
# without a GPU.
set -uo pipefail
cd "$(dirname "$0")/../.."
dest=${OUT:?set OUT to the folder whose files come back}
work=${LEASE_WORK:-/tmp/imagegen-gpu}
out=$work/scale
mkdir -p "$out"
. bench/gpu/carried.sh
carried_setup "$work" || exit 1
dev=${SCALE_DEVICE:-cuda}

step_high() {
  "$b/imagegen-load-bench" --device "$dev" --dtype bf16 --cuda-graphs 1 \
    --methods ar,scd-mc,sjd-pac --concurrency "${SCALE_HIGH_CONCURRENCY:-16,32,64}" \
    --seconds 3 --seconds-per-client 0 --modes none,goodput --mixed-concurrency '' \
    --out-dir "$out/load-high" 2>&1 | tee "$out/load_high.log"
}
step_decode() {
  local rc=0 name flags
  echo "-- the VQ decoder alone: images per call"
  "$b/imagegen-forward-latency" --device "$dev" --dtype bf16 --decoder 1 \
    --batches 1,2,4,8,16,32 --reps 20 2>&1 | tee "$out/decoder_batch.log" || rc=1
  for name in thread:--decode-thread=1 thread1:--decode-thread=1,--decode-batch=1 \
    inline:--decode-thread=0 none:--decode-images=0; do
    flags=${name#*:} name=${name%%:*}
    echo "-- finished images: $name ($flags)"
    # shellcheck disable=SC2086  # the flags are split at the commas
    "$b/imagegen-load-bench" --device "$dev" --dtype bf16 --cuda-graphs 1 ${flags//,/ } \
      --methods ar,scd-mc --concurrency 32 --seconds 3 --seconds-per-client 0 --modes none \
      --mixed-concurrency '' --out-dir "$out/load-decode-$name" 2>&1 \
      | tee "$out/load_decode_$name.log" || rc=1
  done
  return $rc
}
step_trace() {
  local rc=0 w
  for w in 0 1; do
    echo "-- --warmup $w"
    "$b/imagegen-load-bench" --device "$dev" --dtype bf16 --cuda-graphs 1 \
      --methods sjd-pac,scd-mc --concurrency 4,16 --seconds 3 --seconds-per-client 0 \
      --modes goodput --warmup "$w" --mixed-concurrency '' \
      --trace-dir "$out/trace-w$w" --out-dir "$out/load-trace-w$w" 2>&1 \
      | tee "$out/load_trace_w$w.log" || rc=1
  done
  return $rc
}
step_serve() {
  IMAGEGEN_SERVE_FLAGS=--cuda_graphs bash bench/gpu/run_all.sh --prebuilt "$work/device" \
    --scale lease --device "$dev" --phase serve --out "$out/serve"
}
step_gptb() {
  # The parity references of lease.sh's tests phase hold the random GPT-B and VQ-16; written
  # here if this machine has none.
  local p=$work/device/parity m=$work/gptb-models
  if [[ ! -f $p/gptb-random/config.json ]]; then
    "$PY" tools/parity.py --out "$p" > "$out/parity_reference.log" 2>&1 || return 1
  fi
  rm -rf "$m" && mkdir -p "$m" && cp -r "$p/gptb-random" "$m/" \
    && cp -r "$p/vq16-random" "$m/llamagen-vq16" || return 1
  # The parity VQ is written for 64-px images; the GPT's 256 tokens are a 16x16 grid.
  sed -i 's/"image_size": 64/"image_size": 256/' "$m/llamagen-vq16/config.json"
  "$b/imagegen-load-bench" --device "$dev" --dtype bf16 --cuda-graphs 1 --models-dir "$m" \
    --model gptb-random --methods ar,scd-mc --concurrency "${SCALE_GPTB_CONCURRENCY:-1,8,32}" \
    --seconds 3 --seconds-per-client 0 --modes none --mixed-concurrency '' \
    --out-dir "$out/load-gptb" 2>&1 | tee "$out/load_gptb.log"
}
step_cudnn() {
  local rc=0 v
  for v in 0 1; do
    echo "-- IMAGEGEN_CUDNN_SDPA=$v"
    IMAGEGEN_CUDNN_SDPA=$v "$b/imagegen-load-bench" --device "$dev" --dtype bf16 \
      --methods ar,scd-mc --concurrency 1,4 --seconds 3 --seconds-per-client 0 --modes none \
      --mixed-concurrency '' --out-dir "$out/load-cudnn$v" 2>&1 | tee "$out/load_cudnn$v.log" \
      || rc=1
  done
  return $rc
}

nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
export out b dev PY work
carried_steps "${SCALE_STEPS:-high:100 decode:80 trace:80 serve:60 gptb:80 cudnn:70}" scale \
  "$out/steps.log" "$out" "$dest/scale.tgz"
