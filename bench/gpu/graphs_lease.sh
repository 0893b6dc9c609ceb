#!/usr/bin/env bash
# A second, shorter device-tool call after bench/gpu/lease.sh (about 7.5 minutes): the fused
# kernels' tests, then the engine with CUDA graphs against the eager forward, side by side.
#
#   here:   bench/gpu/pack_server.sh --with-benches build/ci .deps/device
#           tar cJf .deps/carry/device.tar.xz -C .deps device
#   device: bash bench/gpu/graphs_lease.sh     (carry: [".deps/carry"]; $OUT is the tool's)
#
# Steps, each under its own limit, the output packed into $OUT/graphs.tgz after each:
#   kernels   kernels_tests (on failure the rest runs with IMAGEGEN_FUSED_KERNELS=0:
#             carried_phase, bench/gpu/carried.sh, as for lease.sh)
#   tests     the launch-count and CUDA-graph tests of engine_tests (the capture-stream test
#             among them), and the exact distributions through the fused kernels
#   load      imagegen-load-bench at 1, 4 and 8 clients with --cuda-graphs 1 (4 clients crashed
#             before the capture stream of its own), the goodput controller with its cost model
#             frozen (--refine-step-cost 0), with hysteresis, with the commit models
#             learning from widened windows too (--commit-learn-growth 1), then at 1 and 8
#             clients without graphs
#   split     imagegen-spec-bench --split 1 with CUDA graphs: the forward against the rest of
#             a step, with the fused verification and without
#   fused     imagegen-step-cost: the static forward's fused layer against the reference one,
#             then (a process of its own) against the fused layer with the rotary scatter
#             (LoadOptions::rope_scatter), through CUDA graphs (bundled and GPT-B in bf16)
#   churn     imagegen-window-churn: sjd-pac and scd-mc with windows held at 16 and moving
#             (16 +- 8), eager against CUDA graphs, cut drafts dropped and kept (issue 15: the
#             controller's sjd-pac at 8 clients committed 1.51 tokens a step at 19 nodes with
#             graphs, 2.6 on the CPU at 15; NFE is exact, no timing)
#   profile   where the device time goes, kernel by kernel (bench/kernel_profile.h, CUPTI
#             through LibTorch's profiler): the graphed forward of GPT-B and the bundled model
#             (imagegen-step-cost --kernel-profile; fused and reference layer and the rotary
#             scatter, 1 and 16 requests), then whole batch-1 steps of ar, scd-mc and sjd-pac
#             with graphs (imagegen-spec-bench --kernel-profile: the device's busy share of a
#             step); the
#             forward again with IMAGEGEN_SDPA_BOOL_MASK=1 (the attention bias's A/B)
# GRAPHS_STEPS="kernels:30 load:200" picks and sizes the steps; GRAPHS_DEVICE=cpu tries the
# script without a GPU.
set -uo pipefail
cd "$(dirname "$0")/../.."
dest=${OUT:?set OUT to the folder whose files come back}
work=${LEASE_WORK:-/tmp/imagegen-gpu}
out=$work/graphs
mkdir -p "$out"
. bench/gpu/carried.sh
carried_setup "$work" || exit 1
dev=${GRAPHS_DEVICE:-cuda}

step_kernels() {
  # KernelsTest alone decides the fallback (IMAGEGEN_FUSED_KERNELS=0); the rotary scatter's
  # kernel is opt-in (LoadOptions::rope_scatter) and reported on its own.
  "$b/kernels_tests" --gtest_filter='KernelsTest.*' > "$out/kernels_tests.log" 2>&1
  local rc=$?
  grep -E '^\[  (PASSED|FAILED) |FAILED TEST|bit for bit' "$out/kernels_tests.log"
  "$b/kernels_tests" --gtest_filter='RopeScatterKernelTest.*' > "$out/rope_kernel_tests.log" 2>&1 \
    || echo "rope scatter kernel: FAILED (its timings in the fused and profile steps stand alone)"
  grep -E '^\[  (PASSED|FAILED) |FAILED TEST' "$out/rope_kernel_tests.log"
  return $rc
}
step_tests() {
  "$b/engine_tests" \
    --gtest_filter='LaunchesTest.Fused*:EngineTest.CudaGraphs*:StaticForward*:SpecStaticShapes*:SpecFusedProbs*' \
    > "$out/engine_tests.log" 2>&1
  local rc=$?
  grep -E 'launches per step|^\[  (PASSED|FAILED|SKIPPED) ' "$out/engine_tests.log"
  return $rc
}
step_load() {
  # CUDA graphs on: every lossless chain and tree preset, with and without the goodput
  # controller; off: AR and scd-mc alone (the side-by-side baseline).
  local rc=0
  echo "-- load bench, --cuda-graphs 1"
  "$b/imagegen-load-bench" --device "$dev" --dtype bf16 --cuda-graphs 1 \
    --methods ar,sjd,scd-mc,sjd-pac --concurrency 1,4,8 --seconds 3 --seconds-per-client 0 \
    --modes none,goodput --mixed-concurrency '' --out-dir "$out/load-graphs1" 2>&1 \
    | tee "$out/load_graphs1.log" || rc=1
  # The goodput controller with its cost model frozen after calibration (issue 15: are the
  # windows moving with a cost model refined from jittery sub-millisecond steps? Compare dwin,
  # NFE and images/s with the refined cells above).
  echo "-- load bench, --cuda-graphs 1 --refine-step-cost 0"
  "$b/imagegen-load-bench" --device "$dev" --dtype bf16 --cuda-graphs 1 --refine-step-cost 0 \
    --methods scd-mc,sjd-pac --concurrency 8 --seconds 3 --seconds-per-client 0 \
    --modes goodput --mixed-concurrency '' --out-dir "$out/load-frozen" 2>&1 \
    | tee "$out/load_frozen.log" || rc=1
  # Hysteresis (--window-stickiness, off by default; a CPU replay showed no gain from it).
  echo "-- load bench, --cuda-graphs 1 --window-stickiness 0.05"
  "$b/imagegen-load-bench" --device "$dev" --dtype bf16 --cuda-graphs 1 --window-stickiness 0.05 \
    --methods scd-mc,sjd-pac --concurrency 8 --seconds 3 --seconds-per-client 0 \
    --modes goodput --mixed-concurrency '' --out-dir "$out/load-sticky" 2>&1 \
    | tee "$out/load_sticky.log" || rc=1
  # The commit models learning from every step, windows widened included (the behaviour
  # before 2026-11-28; --commit-learn-growth, off by default): against the goodput cells above.
  echo "-- load bench, --cuda-graphs 1 --commit-learn-growth 1"
  "$b/imagegen-load-bench" --device "$dev" --dtype bf16 --cuda-graphs 1 --commit-learn-growth 1 \
    --methods scd-mc,sjd-pac --concurrency 8 --seconds 3 --seconds-per-client 0 \
    --modes goodput --mixed-concurrency '' --out-dir "$out/load-growth" 2>&1 \
    | tee "$out/load_growth.log" || rc=1
  echo "-- load bench, --cuda-graphs 0"
  "$b/imagegen-load-bench" --device "$dev" --dtype bf16 --cuda-graphs 0 \
    --methods ar,scd-mc --concurrency 1,8 --seconds 3 --seconds-per-client 0 \
    --modes none --mixed-concurrency '' --out-dir "$out/load-graphs0" 2>&1 \
    | tee "$out/load_graphs0.log" || rc=1
  return $rc
}
step_churn() {
  "$b/imagegen-window-churn" --device "$dev" --dtype bf16 --methods sjd-pac,scd-mc \
    --windows 16 --swing 8 --schedules const,random --keep-cut-drafts 0,1 \
    --forwards eager,graphs --per-class 1 --csv "$out/churn.csv" > "$out/churn.log" 2>&1
  local rc=$?
  cat "$out/churn.log"
  return $rc
}
step_fused() {
  # The static forward's fused layer (docs/engine.md, "The fused layer") against the reference
  # layer, both through CUDA graphs: GPT-B and the bundled model in bf16.
  local gbps=0  # for the weight-read limit
  case $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1) in
    *H200*) gbps=4800 ;; *H100*) gbps=3350 ;; esac
  "$b/imagegen-step-cost" --device "$dev" --shapes bundled,gpt-b --dtypes bf16 --requests 1,16 \
    --tokens 1,16,256 --reps 5 --forwards graphs,graphs-ref --hbm-gbps "$gbps" \
    --csv "$out/fused_step.csv" > "$out/fused_step.log" 2>&1
  local rc=$?
  cat "$out/fused_step.log"
  # The rotary scatter (LoadOptions::rope_scatter, opt-in, its kernel new) beside the fused
  # layer, in a process of its own: a fault there costs only this A/B.
  "$b/imagegen-step-cost" --device "$dev" --shapes bundled,gpt-b --dtypes bf16 --requests 1,16 \
    --tokens 1,16,256 --reps 5 --forwards graphs,graphs-rope --hbm-gbps "$gbps" \
    --csv "$out/rope_step.csv" > "$out/rope_step.log" 2>&1 || rc=1
  cat "$out/rope_step.log"
  return $rc
}
step_profile() {
  "$b/imagegen-step-cost" --device "$dev" --shapes gpt-b,bundled --dtypes bf16 --requests 1,16 \
    --tokens 1,16 --reps 5 --forwards graphs,graphs-ref --kernel-profile 5 --kernel-top 30 \
    --csv "$out/kernel_step.csv" > "$out/kernel_step.log" 2>&1
  local rc=$?
  grep -E '^(gpt-b|bundled)|kernels:|CPU ops' "$out/kernel_step.log"
  # The rotary scatter's forward, kernel by kernel (a process of its own, as in step_fused).
  "$b/imagegen-step-cost" --device "$dev" --shapes gpt-b,bundled --dtypes bf16 --requests 1,16 \
    --tokens 1,16 --reps 5 --forwards graphs-rope --kernel-profile 5 --kernel-top 30 \
    --csv "$out/kernel_step_rope.csv" > "$out/kernel_step_rope.log" 2>&1 || rc=1
  grep -E '^(gpt-b|bundled)|kernels:|CPU ops' "$out/kernel_step_rope.log"
  # The A/B of the static forward's attention bias: SDPA given the boolean mask, as before.
  IMAGEGEN_SDPA_BOOL_MASK=1 "$b/imagegen-step-cost" --device "$dev" --shapes gpt-b,bundled \
    --dtypes bf16 --requests 1,16 --tokens 1,16 --reps 5 --forwards graphs --kernel-profile 5 \
    --kernel-top 30 --csv "$out/kernel_step_boolmask.csv" > "$out/kernel_step_boolmask.log" 2>&1
  [[ $? -eq 0 ]] || rc=1
  grep -E '^(gpt-b|bundled)|kernels:|CPU ops' "$out/kernel_step_boolmask.log"
  "$b/imagegen-spec-bench" --device "$dev" --dtype bf16 --cuda-graphs 1 --per-class 1 \
    --methods scd-mc,sjd-pac --windows 32 --split 0 --kernel-profile 2 --noise-row 0 \
    --python "$PY" --out-dir "$out/kernel_spec" > "$out/kernel_spec.log" 2>&1
  [[ $? -eq 0 ]] || rc=1
  grep -A100 '^kernel profile' "$out/kernel_spec.log" | grep -E 'kernels:|CPU ops'
  return $rc
}
step_split() {
  "$b/imagegen-spec-bench" --device "$dev" --dtype bf16 --cuda-graphs 1 --per-class 1 \
    --methods scd-mc,sjd-pac --windows 32 --split 1 --fused-verify both --noise-row 0 \
    --python "$PY" --out-dir "$out/split" > "$out/spec_split.log" 2>&1
  local rc=$?
  tail -n 9 "$out/spec_split.log"
  return $rc
}

nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
export out b dev PY
carried_steps "${GRAPHS_STEPS:-kernels:30 tests:75 fused:40 profile:100 churn:40 load:215 split:60}" graphs \
  "$out/steps.log" "$out" "$dest/graphs.tgz"
