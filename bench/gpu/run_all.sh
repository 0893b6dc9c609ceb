#!/usr/bin/env bash
# Every GPU figure of issue 14 from one command, on a fresh GPU machine (PyTorch 2.11 + CUDA 13,
# nvcc, CMake and ninja; no Debian packages, no gRPC, no network), run from the repository root:
#
#   bench/gpu/run_all.sh --phase build     # configure and build the engine, tests and benches
#   bench/gpu/run_all.sh --phase kernels   # the fused kernels against their host paths
#   bench/gpu/run_all.sh --phase tests     # CUDA parity, kernels, host syncs, exact distributions
#   bench/gpu/run_all.sh --phase bench     # step-cost curve, speculative bench, load bench
#                                          # (= --phase step,spec,load)
#   bench/gpu/run_all.sh --phase serve     # the daemon on the device (bench/gpu/pack_server.sh)
#   bench/gpu/run_all.sh --phase report    # docs/results-gpu.md from what the phases wrote
#
# (--phase all, or a list such as tests,bench, runs them in turn. With the device tool's 15
# minutes a session, bench/gpu/lease.sh runs every phase in one call with programs built
# elsewhere: docs/gpu.md.) Building here instead, what a GPU host lacks comes in .deps:
# bench/gpu/fetch_deps.sh, run on a Debian machine, downloads
# GoogleTest, libpng, zlib and nlohmann-json into .deps/debs, which this script unpacks
# (dpkg -x) into .deps/root; bench/gpu/pack_server.sh packs the daemon and its gRPC libraries
# into .deps/server for the serve phase.
#
# With --device cpu the same script runs on the CPU at a reduced scale (--quick), which is how CI
# keeps it from rotting (ctest: gpu_script_cpu, reusing the CI build with --build-dir).
# --scale lease sizes the GPU phases to fit one device-tool call (about 8 minutes for tests,
# step, spec, serve and load together); --scale full (the default on cuda) is the whole sweep.
# --prebuilt DIR runs programs built elsewhere (bench/gpu/pack_server.sh --with-benches packs
# them, with the libraries a GPU host lacks, into DIR/bin and DIR/lib): no build on the device.
# Outputs: logs and CSVs under --out (default build/gpu-results); the report goes to
# --out/results-gpu.md, and to docs/results-gpu.md with --write-docs.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD

device=cuda phase=all scale=full build=build/gpu out=build/gpu-results write_docs=0 prebuilt=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) device=$2; shift 2 ;;
    --phase) phase=$2; shift 2 ;;
    --quick) scale=quick; shift ;;
    --scale) scale=$2; shift 2 ;;
    --prebuilt) prebuilt=$2; shift 2 ;;
    --build-dir) build=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --write-docs) write_docs=1; shift ;;
    *) echo "usage: $0 [--device cuda|cpu] [--phase all|build,tests,bench,report]" \
            "[--quick | --scale quick|lease|full] [--build-dir DIR | --prebuilt DIR] [--out DIR]" \
            "[--write-docs]" >&2; exit 2 ;;
  esac
done
case "$device" in cuda|cpu) ;; *) echo "--device: expected cuda or cpu, got '$device'" >&2; exit 2 ;; esac
case "$scale" in quick|lease|full) ;;
  *) echo "--scale: expected quick, lease or full, got '$scale'" >&2; exit 2 ;; esac
mkdir -p "$out"
out=$(cd "$out" && pwd)
log() { echo "== $(date +%H:%M:%S) $*" | tee -a "$out/run_all.log"; }
. bench/gpu/carried.sh
PY=$(carried_python)  # the Python that holds PyTorch

# Where the programs are: a build directory's tests/ and bench/, or one prebuilt bin/.
tests_bin="$build/tests" bench_bin="$build/bench" parity_dir="$build/tests/parity"
if [[ -n $prebuilt ]]; then
  prebuilt=$(cd "$prebuilt" && pwd)
  parity_dir="$prebuilt/parity"
  # Each program runs through a wrapper that puts the packed libraries and the host's LibTorch
  # on its library path (bench/gpu/carried.sh).
  carried_wrappers "$prebuilt" "$PY"
  tests_bin="$prebuilt/run" bench_bin="$prebuilt/run"
  export IMAGEGEN_SERVER_PACK=${IMAGEGEN_SERVER_PACK:-$prebuilt}
  # The programs were built elsewhere: the models directory compiled into them may not exist.
  export IMAGEGEN_MODELS_DIR=${IMAGEGEN_MODELS_DIR:-$ROOT/models}
fi

# Debian packages carried as .deb files (a GPU host has none of them).
if compgen -G ".deps/debs/*.deb" >/dev/null; then
  if [[ ! -f .deps/root/.unpacked ]]; then
    mkdir -p .deps/root
    for d in .deps/debs/*.deb; do dpkg -x "$d" .deps/root; done
    touch .deps/root/.unpacked
  fi
  export CMAKE_PREFIX_PATH="$ROOT/.deps/root/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export LD_LIBRARY_PATH="$ROOT/.deps/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

machine_info() {
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "host: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
    echo "cpu: $(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo)"
    "$PY" -c "import torch; print('torch:', torch.__version__, '| cuda:', torch.version.cuda, '| gpu:', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')"
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
    fi
  } > "$out/machine.txt" 2>&1 || true
}

phase_build() {
  if [[ -n $prebuilt ]]; then
    log "build: prebuilt programs in $prebuilt"
    local p
    for p in engine_tests parity_tests; do
      "$tests_bin/$p" --gtest_list_tests > /dev/null || { echo "build: $p does not start" >&2; return 1; }
    done
    return 0
  fi
  log "build ($build)"
  local jobs; jobs=$(nproc)
  if [[ ! -f "$build/CMakeCache.txt" ]]; then
    cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DIMAGEGEN_BUILD_SERVER=OFF \
      -DIMAGEGEN_PYTHON="$PY" 2>&1 | tee -a "$out/build.log" | tail -5
  fi
  local targets=(engine_tests parity_tests imagegen-step-cost imagegen-spec-bench
                 imagegen-load-bench)
  if grep -q "^kernels_tests:" <(ninja -C "$build" -t targets all 2>/dev/null | sed 's/: .*/:/'); then
    targets+=(kernels_tests)
  fi
  cmake --build "$build" -j "$jobs" --target "${targets[@]}" 2>&1 | tee -a "$out/build.log" | tail -3
}

phase_tests() {
  log "tests on $device"
  export IMAGEGEN_TEST_DEVICE=$device
  local t="$tests_bin"
  # The static-shape forward and its CUDA graphs (StaticForwardTest: replays equal the eager
  # static forward; SpecStaticShapesTest and EngineTest.CudaGraphs*: the same images as the
  # ragged forward) in every scale; and the decode thread on its own stream (the same images
  # as decoding on the engine thread, completions delivered at shutdown), and batched decoding
  # (each image within rounding of decoding it alone).
  local graphs='StaticForward*:SpecStaticShapes*:EngineTest.CudaGraphs*'
  graphs+=':DecodeQueueTest.*:EngineTest.Decode*:EngineTest.ShutdownDelivers*'
  graphs+=':EngineTest.BatchedDecode*'
  # The fused kernels through the engine: the chain verification and the final distributions
  # (exact distributions through them, their launches, their host paths).
  local fused='ChainVerify*:GuidedProbs*:SpecFusedProbs*:LaunchesTest.Fused*'
  # The match rule's identity (scd-gm draws ar-gm's grids) holds bit for bit only where the
  # forward's rows do not depend on the window: on CUDA it is a measurement.
  local filter="*HostSync*:Presets/SpecLossless*:SpeculativePowerTest*:SpecMatchRule*:GptTest*"
  filter+=":DeviceTest*:$graphs"
  filter+=":$fused"
  [[ $scale == quick ]] && filter='*HostSync*:GptTest*:StaticForward*'
  if [[ $scale == lease ]]; then  # four of the nine exact-distribution cases, and the power test
    local c=Presets/SpecLosslessTest.MatchesTheExactArDistribution
    filter="*HostSync*:GptTest*:DeviceTest*:$graphs:SpeculativePowerTest*:$c/ar:$c/scd_mc_L6"
    filter+=":$fused"
    filter+=":$c/sjd_pac_K2_D3_L9_onehot:$c/sd_L4:$c/scd_gm_L6:SpecMatchRule*"
  fi
  # A failing test fails the phase but does not stop it: the parity tests still run (the first
  # H200 run of the fused kernels lost them to two failing engine tests).
  local rc=0
  "$t/engine_tests" --gtest_filter="$filter" 2>&1 | tee "$out/engine_tests.log" | tail -3 || rc=1
  if [[ $device == cuda ]]; then
    # The parity references (tools/parity.py, the checkpoints' own Python code paths) are written
    # by the CPU's PyTorch; the CUDA checks compare the GPU's logits with them.
    "$PY" tools/parity.py --out "$parity_dir" > "$out/parity_reference.log" 2>&1 || rc=1
    IMAGEGEN_PARITY_DIR="$parity_dir" "$t/parity_tests" 2>&1 | tee "$out/parity_tests.log" \
      | tail -3 || rc=1
    [[ -f $out/kernels_tests.log ]] || phase_kernels || true
  fi
  return $rc
}

# The fused kernels against their host paths (kernels_tests), on their own and first in a lease:
# exit 1 where they fail, so that bench/gpu/lease.sh can run the later phases on the eager path
# (IMAGEGEN_FUSED_KERNELS=0) rather than lose them to a kernel that never ran on a GPU before.
phase_kernels() {
  log "kernels tests on $device"
  if [[ $device != cuda || ! -x "$tests_bin/kernels_tests" ]]; then
    echo "kernels: none to run (device $device)" | tee "$out/kernels_tests.log"
    return 0
  fi
  # KernelsTest alone decides (the rotary scatter's kernel is opt-in: reported on its own).
  "$tests_bin/kernels_tests" --gtest_filter='RopeScatterKernelTest.*' > "$out/rope_kernel_tests.log" \
    2>&1 || echo "rope scatter kernel: FAILED (LoadOptions::rope_scatter is off by default)"
  tail -n 3 "$out/rope_kernel_tests.log"
  "$tests_bin/kernels_tests" --gtest_filter='KernelsTest.*' 2>&1 | tee "$out/kernels_tests.log" \
    | tail -3
}

gbps() {  # HBM bandwidth of the GPU, for the weight-read limit
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" in
    *H200*) echo 4800 ;;
    *H100*) echo 3350 ;;
    *) echo 0 ;;
  esac
}

phase_step() {
  log "step-cost curve on $device"
  local b="$bench_bin"
  if [[ $scale == quick ]]; then
    "$b/imagegen-step-cost" --device "$device" --shapes bundled,tiny --requests 1,4 \
      --tokens 1,4,16,64 --reps 3 --forwards eager,static-rope --kernel-profile 2 --kernel-top 3 \
      --csv "$out/step_cost.csv" \
      > "$out/step_cost.log" 2>&1
  elif [[ $scale == lease ]]; then
    # CUDA graphs with the fused layer (the CUDA default) and with the reference layer, side
    # by side for each shape, in bf16 (the eager forward and fp32: docs/results-gpu.md, 2026-11-27;
    # both in the full scale).
    "$b/imagegen-step-cost" --device "$device" --shapes bundled,gpt-b,gpt-l,gpt-xl \
      --dtypes bf16 --requests 1,4,16,64 --tokens 1,4,16,64,256,1024,4096 --reps 5 \
      --forwards graphs,graphs-ref --hbm-gbps "$(gbps)" --csv "$out/step_cost.csv" \
      > "$out/step_cost.log" 2>&1
    # The rotary scatter (opt-in, its kernel new) beside the fused layer, in a process of its
    # own: a fault there costs only this A/B.
    "$b/imagegen-step-cost" --device "$device" --shapes bundled,gpt-b,gpt-l,gpt-xl \
      --dtypes bf16 --requests 1,16 --tokens 1,16,256 --reps 5 --forwards graphs,graphs-rope \
      --hbm-gbps "$(gbps)" --csv "$out/step_cost_rope.csv" > "$out/step_cost_rope.log" 2>&1 \
      || echo "rope scatter A/B: FAILED (step_cost_rope.log)"
  else
    "$b/imagegen-step-cost" --device "$device" --shapes bundled,gpt-b,gpt-l,gpt-xl \
      --dtypes bf16,fp32 --forwards eager,static,graphs,graphs-ref --hbm-gbps "$(gbps)" \
      --csv "$out/step_cost.csv" > "$out/step_cost.log" 2>&1
  fi
  tail -n 3 "$out/step_cost.log"
}

phase_spec() {
  log "speculative bench (batch 1) on $device"
  local b="$bench_bin"
  if [[ $scale == quick ]]; then
    "$b/imagegen-spec-bench" --device "$device" --per-class 1 --windows 16 --sd-windows 4 \
      --methods sjd,scd-mc,sd --python "$PY" --out-dir "$out/spec" > "$out/spec_bench.log" 2>&1
  else
    # Speedups with the step split off (its device syncs would slow every step), then the
    # split (forward vs the rest) in a second, smaller run.
    local per_class=5 methods=all split_methods=all
    if [[ $scale == lease ]]; then
      per_class=2 methods=sjd,scd-mc,sjd-pac,sd split_methods=scd-mc
    fi
    "$b/imagegen-spec-bench" --device "$device" --dtype bf16 --per-class "$per_class" \
      --methods "$methods" --windows 32 --sd-windows 8 --split 0 --python "$PY" \
      --out-dir "$out/spec" > "$out/spec_bench.log" 2>&1
    tail -n 12 "$out/spec_bench.log"
    # The split with the fused chain verification (kernels/chain_verify.cu) and without, row by
    # row ("+eager").
    "$b/imagegen-spec-bench" --device "$device" --dtype bf16 --per-class 1 \
      --methods "$split_methods" --windows 32 --sd-windows 8 --split 1 --fused-verify both \
      --python "$PY" --out-dir "$out/spec-split" > "$out/spec_split.log" 2>&1
    tail -n 16 "$out/spec_split.log"
    return 0
  fi
  tail -n 12 "$out/spec_bench.log"
}

phase_load() {
  log "load bench on $device"
  local b="$bench_bin"
  if [[ $scale == quick ]]; then
    "$b/imagegen-load-bench" --device "$device" --methods ar,scd-mc --concurrency 1,2 \
      --seconds 2 --seconds-per-client 0 --modes none,budget:256,goodput \
      --mixed-methods ar,scd-mc --mixed-concurrency 2 --mixed-modes goodput \
      --out-dir "$out/load" > "$out/load_bench.log" 2>&1
  elif [[ $scale == lease ]]; then
    "$b/imagegen-load-bench" --device "$device" --dtype bf16 --methods ar,scd-mc,sjd-pac \
      --concurrency 1,8,64 --seconds 3 --seconds-per-client 0.05 \
      --modes none,budget:2048,goodput --mixed-concurrency 16 --mixed-modes goodput \
      --out-dir "$out/load" > "$out/load_bench.log" 2>&1
  else
    "$b/imagegen-load-bench" --device "$device" --dtype bf16 --methods ar,sjd,scd-mc,sjd-pac \
      --concurrency 1,4,16,64 --seconds 4 --seconds-per-client 0.1 \
      --modes none,budget:512,budget:2048,goodput --mixed-concurrency 16,64 \
      --out-dir "$out/load" > "$out/load_bench.log" 2>&1
  fi
  tail -n 3 "$out/load_bench.log"
}

phase_bench() { phase_step; phase_spec; phase_load; }

# The daemon itself on the device: packed here by bench/gpu/pack_server.sh (the GPU host has no
# gRPC), LibTorch from the host's wheel. Health, one image classified by the bundled classifier,
# `imagegen load` on loopback, /metrics, then a SIGTERM drain that must exit 0.
phase_serve() {
  log "daemon on $device"
  local pack=${IMAGEGEN_SERVER_PACK:-$ROOT/.deps/server}
  local bin="$pack/bin"
  if [[ ! -x $bin/imagegen-server ]]; then
    echo "serve: $pack is missing: run bench/gpu/pack_server.sh on the build machine" >&2
    return 1
  fi
  local torch_lib
  torch_lib=$(carried_torch_libs "$PY")
  local lp="$pack/lib:$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  local S=(env LD_LIBRARY_PATH="$lp" "$bin/imagegen-server")
  local C=(env LD_LIBRARY_PATH="$lp" "$bin/imagegen")
  rm -f "$out/ports"
  # IMAGEGEN_SERVE_FLAGS: more daemon flags (bench/gpu/scale_lease.sh: --cuda_graphs).
  # shellcheck disable=SC2086
  "${S[@]}" --device "$device" --models_dir "$ROOT/models" --listen 127.0.0.1:0 \
    --metrics_listen 127.0.0.1:0 ${IMAGEGEN_SERVE_FLAGS:-} \
    --port_file "$out/ports" --grace_seconds 60 > "$out/daemon.log" 2>&1 &
  local pid=$! port="" i
  for i in $(seq 1 240); do  # up to 120 s for the models to load
    if [[ -s $out/ports ]] && "${C[@]}" --target "127.0.0.1:$(cut -d' ' -f1 "$out/ports")" health \
         > /dev/null 2>&1; then
      port=$(cut -d' ' -f1 "$out/ports")
      break
    fi
    kill -0 "$pid" 2>/dev/null || { cat "$out/daemon.log" >&2; return 1; }
    sleep 0.5
  done
  [[ -n $port ]] || { echo "serve: not SERVING after 120 s" >&2; kill "$pid"; return 1; }
  local t=(--target "127.0.0.1:$port")
  "${C[@]}" "${t[@]}" generate --cls sneaker --seed 1 --out "$out/sneaker.png" | tee "$out/serve.log"
  "$PY" tools/classify_png.py --expect sneaker "$out/sneaker.png" | tee -a "$out/serve.log"
  local c=16 d=20
  [[ $scale == quick ]] && c=2 d=3
  [[ $scale == lease ]] && d=8
  "${C[@]}" "${t[@]}" load --concurrency "$c" --duration "$d" --method ar 2>&1 \
    | tee -a "$out/serve.log"
  "${C[@]}" "${t[@]}" load --concurrency "$c" --duration "$d" --method scd-mc 2>&1 \
    | tee -a "$out/serve.log"
  if command -v curl >/dev/null; then
    curl -s "http://127.0.0.1:$(cut -d' ' -f2 "$out/ports")/metrics" > "$out/metrics.txt" || true
  fi
  kill -TERM "$pid"
  local rc=0
  wait "$pid" || rc=$?
  echo "daemon exit status after SIGTERM: $rc" | tee -a "$out/serve.log"
  [[ $rc == 0 ]]
}

phase_report() {
  log "report"
  local args=(--out "$out" --device "$device")
  [[ $scale == quick ]] && args+=(--strict)
  [[ $write_docs == 1 ]] && args+=(--docs "$ROOT/docs/results-gpu.md")
  "$PY" bench/gpu/report.py "${args[@]}"
}

machine_info
if [[ $phase == all ]]; then
  phase=build,tests,bench
  [[ -x ${IMAGEGEN_SERVER_PACK:-.deps/server}/bin/imagegen-server ]] && phase+=,serve
  phase+=,report
fi
IFS=, read -r -a phases <<< "$phase"
for p in "${phases[@]}"; do
  case "$p" in
    build|kernels|tests|bench|step|spec|load|serve|report) ;;
    *) echo "--phase: expected all or a list of build, kernels, tests, bench (= step, spec, load)," \
            "serve, report; got '$p'" >&2; exit 2 ;;
  esac
done
for p in "${phases[@]}"; do "phase_$p"; done
log "done ($phase)"
