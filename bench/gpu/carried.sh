# Programs built here and carried to a GPU host (sourced by run_all.sh, lease.sh and
# step_profile.sh; not run). bench/gpu/pack_server.sh --with-benches packs them into DIR/bin with
# the Debian libraries a GPU host lacks in DIR/lib; tar cJf .deps/carry/device.tar.xz -C .deps
# device carries them (docs/gpu.md).

# Unpacks .deps/carry/device.tar.xz into folder $1 (giving $1/device), unless done before, and
# points /work/main (where the programs were built, and where the spec bench finds its plotting
# script) at this checkout where that path does not exist. Run from the repository root.
carried_unpack() {
  local work=$1
  mkdir -p "$work"
  if [[ ! -x $work/device/bin/engine_tests ]]; then
    tar xJf .deps/carry/device.tar.xz -C "$work" 2> /dev/null \
      || python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
           .deps/carry/device.tar.xz "$work" \
      || { echo "carried: cannot unpack .deps/carry/device.tar.xz" >&2; return 1; }
  fi
  if [[ ! -e /work/main ]]; then mkdir -p /work && ln -s "$PWD" /work/main; fi
}

# The Python that holds PyTorch: IMAGEGEN_PYTHON, the project's virtualenv, or python3 (a GPU
# host's).
carried_python() {
  if [[ -n ${IMAGEGEN_PYTHON:-} ]]; then echo "$IMAGEGEN_PYTHON"
  elif [[ -x /opt/imagegen/venv/bin/python ]]; then echo /opt/imagegen/venv/bin/python
  else command -v python3; fi
}

# The host wheel's LibTorch and NVIDIA library folders, from the Python $1 that holds PyTorch.
carried_torch_libs() {
  "$1" -c 'import glob, os, torch
t = os.path.dirname(torch.__file__)
print(":".join([os.path.join(t, "lib")] +
               sorted(glob.glob(os.path.join(os.path.dirname(t), "nvidia", "*", "lib")))))'
}

# Writes $1/run/P for every program $1/bin/P: a wrapper that puts $1/lib and the host's LibTorch
# (from the Python $2) on the library path and runs P line-buffered (stdbuf), so that a program
# stopped at a time limit keeps its log. Python (parity references, the classifier) keeps the
# host's own libraries.
carried_wrappers() {
  local dir=$1 torch_lib p
  torch_lib=$(carried_torch_libs "$2") || return 1
  mkdir -p "$dir/run"
  for p in "$dir"/bin/*; do
    printf '#!/bin/sh\nLD_LIBRARY_PATH="%s" exec %s "%s" "$@"\n' \
      "$dir/lib:$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
      "$(command -v stdbuf > /dev/null && echo 'stdbuf -oL -eL')" "$p" \
      > "$dir/run/${p##*/}"
    chmod +x "$dir/run/${p##*/}"
  done
}

# Runs the command `$5...` as phase $2 of script $1 (its name in the log lines) under a limit of
# $3 seconds, appends its exit status to the log $4, and after a failed kernels phase sets
# IMAGEGEN_FUSED_KERNELS=0 for the later phases (the engine's CUDA steps then take the eager
# path, the same decisions in more launches): a kernel bug costs the kernels' figures, not the
# call's. Shared by lease.sh and graphs_lease.sh.
carried_phase() {
  local who=$1 name=$2 limit=$3 log=$4 s rc
  shift 4
  s=$(date +%s)
  timeout -k 5 "$limit" "$@"
  rc=$?
  echo "$who: phase $name exit $rc after $(( $(date +%s) - s )) s (limit $limit s)" | tee -a "$log"
  if [[ $name == kernels && $rc != 0 ]]; then
    export IMAGEGEN_FUSED_KERNELS=0
    echo "$who: kernels failed: IMAGEGEN_FUSED_KERNELS=0 for the later phases" | tee -a "$log"
  fi
}

# The set-up of a step script (graphs_lease.sh, scale_lease.sh): the programs unpacked into
# folder $1 with their wrappers; sets PY (the Python that holds PyTorch) and b (the wrappers).
carried_setup() {
  carried_unpack "$1" || return 1
  PY=$(carried_python)
  carried_wrappers "$1/device" "$PY" || return 1
  b=$1/device/run
}

# Runs the steps $1 ("name:seconds ...") of script $2: each function step_NAME under its limit
# (carried_phase, log $3), then packs folder $4 into $5, so that a call cut off at the tool's
# limit keeps every finished step. The caller exports what the steps read.
carried_steps() {
  local who=$2 log=$3 from=$4 tgz=$5 st s t
  for st in $1; do
    s=${st%%:*} t=${st##*:}
    echo "== $(date +%T) $s"
    export -f "step_$s"
    carried_phase "$who" "$s" "$t" "$log" bash -c "step_$s"
    tar czf "$tgz" -C "$from" .
  done
}
