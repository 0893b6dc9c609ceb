#!/usr/bin/env bash
# Copies into DEST the shared libraries from the torch wheel's virtualenv (LibTorch, the NVIDIA
# libraries) that the given binaries load at start-up (their ldd closure), at the same paths, so
# that the binaries' RPATH and the libraries' $ORIGIN-relative RUNPATHs still find them.
# The CPU image holds only these; the GPU image takes the whole of torch/lib and nvidia/, since
# LibTorch opens more of them (cuDNN's engines, NVRTC, the linalg library) on a GPU at run time.
#
#   deploy/runtime-libs.sh DEST BINARY...
set -euo pipefail
dest="$1"
shift
site="${IMAGEGEN_VENV:-/opt/imagegen/venv}"
n=0
while read -r lib; do
  # torch/lib/../../nvidia/cu13/lib/x.so -> nvidia/cu13/lib/x.so, without resolving symlinks
  path="$(realpath -m --no-symlinks "$lib")"
  mkdir -p "$dest$(dirname "$path")"
  cp -L "$lib" "$dest$path"
  n=$((n + 1))
done < <(ldd "$@" | awk -v site="$site" 'index($3, site) == 1 {print $3}' | sort -u)
[ "$n" -gt 0 ] || { echo "runtime-libs: no library under $site in the ldd closure of $*" >&2; exit 1; }
echo "runtime-libs: $n libraries, $(du -sh "$dest" | cut -f1), into $dest"
