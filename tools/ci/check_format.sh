#!/usr/bin/env bash
# Fails if any tracked C++/CUDA source differs from clang-format's output (.clang-format:
# Google style, 100 columns). Fix with: clang-format -i $(git ls-files '*.cc' '*.h' '*.cu')
set -euo pipefail
cd "$(dirname "$0")/../.."
mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh' | grep -v '^proto/')
if ! clang-format --dry-run --Werror "${files[@]}"; then
  echo "check_format: the files above are not clang-formatted" >&2
  exit 1
fi
echo "check_format: ${#files[@]} files formatted"
