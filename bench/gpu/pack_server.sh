#!/usr/bin/env bash
# Packs the daemon and the CLI, built here, with the shared libraries they load that a GPU host
# lacks (gRPC, protobuf, Abseil, prometheus-cpp, libmicrohttpd, OpenSSL, libpng, ...), into
# .deps/server (git-ignored; about 25 MB), for bench/gpu/run_all.sh --phase serve. LibTorch
# and the NVIDIA libraries are not packed: the host's wheel provides them (the same torch
# 2.11.0), and the C and C++ runtimes are the host's own (newer than bookworm's, compatible).
#
#   bench/gpu/pack_server.sh [BUILD_DIR [DEST]]   (default build/ci, else build/release;
#                                                  .deps/server)
set -euo pipefail
cd "$(dirname "$0")/../.."
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
cp "$build/server/imagegen-server" "$build/client/imagegen" "$dest/bin/"
site="${IMAGEGEN_VENV:-/opt/imagegen/venv}"
ldd "$dest/bin/imagegen-server" "$dest/bin/imagegen" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' \
  | grep -v "^$site/" \
  | grep -Ev '/(libc|libm|libdl|libpthread|librt|libresolv|ld-linux-x86-64|libstdc\+\+|libgcc_s)\.so' \
  | sort -u | xargs -r cp -L -t "$dest/lib"
echo "pack_server: $(ls "$dest/lib" | wc -l) libraries, $(du -sh "$dest" | cut -f1), from $build"
