#!/usr/bin/env bash
# Packs the daemon and the CLI, built here, with the shared libraries they load that a GPU host
# lacks (gRPC, protobuf, Abseil, prometheus-cpp, libmicrohttpd, OpenSSL, libpng, ...), into
# .deps/server (git-ignored; about 25 MB), for bench/gpu/run_all.sh --phase serve. LibTorch
# and the NVIDIA libraries are not packed: the host's wheel provides them (the same torch
# 2.11.0, the CUDA 13 build here and there), and the C and C++ runtimes are the host's own
# (newer than bookworm's, compatible).
#
# --with-benches also packs the test and bench programs the GPU script runs (engine_tests,
# parity_tests, kernels_tests, imagegen-step-cost, -spec-bench, -load-bench, -window-churn,
# -forward-latency), stripped, so that
# a GPU session spends no device time building: run_all.sh --prebuilt DEST (docs/gpu.md).
#
#   bench/gpu/pack_server.sh [--with-benches] [BUILD_DIR [DEST]]
#       (default build/ci, else build/release; .deps/server)
set -euo pipefail
cd "$(dirname "$0")/../.."
benches=0
if [[ ${1:-} == --with-benches ]]; then benches=1; shift; fi
build=${1:-}
if [[ -z $build ]]; then
  for b in build/ci build/release; do [[ -x $b/server/imagegen-server ]] && build=$b && break; done
fi
if [[ -z $build || ! -x $build/server/imagegen-server || ! -x $build/client/imagegen ]]; then
  echo "pack_server: no imagegen-server and imagegen in ${build:-build/ci or build/release}:" \
       "build them first (cmake --preset ci && cmake --build --preset ci)" >&2
  exit 1
fi
dest=${2:-.deps/server}
rm -rf "$dest"
mkdir -p "$dest/bin" "$dest/lib"
bins=("$build/server/imagegen-server" "$build/client/imagegen")
if [[ $benches == 1 ]]; then
  for b in tests/engine_tests tests/parity_tests tests/kernels_tests bench/imagegen-step-cost \
           bench/imagegen-spec-bench bench/imagegen-load-bench bench/imagegen-window-churn \
           bench/imagegen-forward-latency; do
    if [[ -x $build/$b ]]; then
      bins+=("$build/$b")
    elif [[ $b != tests/kernels_tests ]]; then  # kernels_tests exists only where nvcc does
      echo "pack_server: $build/$b is missing: build it first" >&2
      exit 1
    fi
  done
fi
cp "${bins[@]}" "$dest/bin/"
[[ $benches == 1 ]] && strip --strip-unneeded "$dest"/bin/*
site="${IMAGEGEN_VENV:-/opt/imagegen/venv}"
ldd "$dest"/bin/* | awk '$2 == "=>" && $3 ~ /^\// {print $3}' \
  | grep -v "^$site/" \
  | grep -Ev '/(libc|libm|libdl|libpthread|librt|libresolv|ld-linux-x86-64|libstdc\+\+|libgcc_s)\.so' \
  | sort -u | xargs -r cp -L -t "$dest/lib"
echo "pack_server: $(ls "$dest/bin" | wc -l) programs, $(ls "$dest/lib" | wc -l) libraries," \
     "$(du -sh "$dest" | cut -f1), from $build"
