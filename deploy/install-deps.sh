#!/usr/bin/env bash
# Installs everything imagegen needs to build, test and run on Debian bookworm.
# Idempotent: safe to run again; it only installs what is missing.
# Used by .ci/run, the Dockerfile and new users alike.
#
#   IMAGEGEN_VENV   where the Python virtual environment with torch goes
#                   (default /opt/imagegen/venv)
#   IMAGEGEN_SKIP_APT=1  skip the Debian packages (e.g. on a GPU host without root)
set -euo pipefail

TORCH_VERSION="2.11.0"
VENV="${IMAGEGEN_VENV:-/opt/imagegen/venv}"

APT_PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git ca-certificates clang-format
  python3 python3-venv python3-pip
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc libabsl-dev
  prometheus-cpp-dev libmicrohttpd-dev prometheus openssl
  libgtest-dev libgmock-dev
  libpng-dev nlohmann-json3-dev
  dataset-fashion-mnist
  python3-grpcio python3-grpc-tools
)

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

if [ "${IMAGEGEN_SKIP_APT:-0}" != "1" ]; then
  missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "install-deps: apt-get install ${missing[*]}"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" > /dev/null
  else
    echo "install-deps: Debian packages present"
  fi
fi

# LibTorch comes from the official PyTorch wheel (pinned), in a virtual environment
# so that it neither needs nor disturbs the system Python.
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "install-deps: creating $VENV"
  as_root mkdir -p "$(dirname "$VENV")"
  as_root "$PY" -m venv "$VENV"
fi
have_torch="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
if [ "${have_torch%%+*}" != "$TORCH_VERSION" ]; then
  echo "install-deps: pip install torch==$TORCH_VERSION (found '${have_torch}')"
  as_root "$VENV/bin/python" -m pip install -q --upgrade pip
  as_root "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION"
fi
as_root "$VENV/bin/python" -m pip install -q numpy safetensors matplotlib

echo "install-deps: done. Torch CMake prefix: $("$VENV/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
