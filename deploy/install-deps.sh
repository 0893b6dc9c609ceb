#!/usr/bin/env bash
# Installs everything imagegen needs to build, test and run on Debian bookworm.
# Idempotent: safe to run again; it only installs what is missing.
# Used by .ci/run, the Dockerfile and new users alike.
#
#   IMAGEGEN_VENV   where the Python virtual environment with torch goes
#                   (default /opt/imagegen/venv)
#   IMAGEGEN_SKIP_APT=1  skip the Debian packages (e.g. on a GPU host without root)
#   IMAGEGEN_NO_BROWSER=1  skip Chromium (only the playground's e2e test drives it; the image
#                          build sets this)
#   IMAGEGEN_PIP_UNLOCKED=1  pip takes the newest versions, not deploy/python-constraints.txt's
#                            (only to make a new lock: see that file)
set -euo pipefail

TORCH_VERSION="2.11.0"
VENV="${IMAGEGEN_VENV:-/opt/imagegen/venv}"
# Every pip install below is held to the tested versions (the packages' own dependencies too).
LOCK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/python-constraints.txt"
PIP_C=(-c "$LOCK")
if [ "${IMAGEGEN_PIP_UNLOCKED:-0}" = "1" ]; then PIP_C=(); fi

APT_PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git ca-certificates clang-format
  python3 python3-venv python3-pip
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc libabsl-dev
  libprotoc-dev dpkg-dev
  prometheus-cpp-dev libmicrohttpd-dev prometheus openssl
  libgnutls28-dev  # the server's certificate checks and HTTPS callback (libmicrohttpd-dev's too)
  libgtest-dev libgmock-dev
  libpng-dev nlohmann-json3-dev libpcre2-dev libicu-dev
  dataset-fashion-mnist
  python3-grpcio python3-grpc-tools
  curl  # the README's calls to /metrics and the HTTP API (a minimal Debian has none)
)
if [ "${IMAGEGEN_NO_BROWSER:-0}" != "1" ]; then
  APT_PACKAGES+=(chromium chromium-driver)
fi

# --list-packages: print the Debian packages (as above) and stop; tools/ci/check_build_inputs.py
# reads them.
if [ "${1:-}" = "--list-packages" ]; then
  printf '%s\n' "${APT_PACKAGES[@]}"
  exit 0
fi

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
# Made from Debian's python3 (installed above), not whatever python3 is first on PATH: a CI or
# development machine's pyenv would give CI a virtualenv that no user's machine has.
PY="${PYTHON:-python3}"
if [ -z "${PYTHON:-}" ] && [ -x /usr/bin/python3 ]; then PY=/usr/bin/python3; fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "install-deps: creating $VENV"
  as_root mkdir -p "$(dirname "$VENV")"
  as_root "$PY" -m venv "$VENV"
fi
have_torch="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
if [ "${have_torch%%+*}" != "$TORCH_VERSION" ]; then
  echo "install-deps: pip install torch==$TORCH_VERSION (found '${have_torch}')"
  as_root "$VENV/bin/python" -m pip install -q "${PIP_C[@]}" --upgrade pip
  as_root "$VENV/bin/python" -m pip install -q "${PIP_C[@]}" "torch==$TORCH_VERSION"
fi
# numpy, safetensors, matplotlib (with Pillow): tools/ and bench plots; kubernetes-validate and
# yamllint: the Kubernetes manifests' check (deploy/k8s/check.py, a ctest); tokenizers: the
# reference the prompt tokenizer is tested against (tools/tokenizer_ref.py, a ctest fixture);
# openai: the official SDK as the HTTP API's client (tests/e2e/openai_sdk_check.py); selenium:
# drives Debian's headless Chromium through the playground page (tests/e2e/playground_check.py).
as_root "$VENV/bin/python" -m pip install -q "${PIP_C[@]}" numpy safetensors matplotlib \
  "kubernetes-validate==1.37.0" "yamllint==1.38.0" "tokenizers==0.23.3" "openai==3.57.0" \
  "selenium==4.51.0"

# The wheel's LibTorch is the CUDA 13 build, and its CMake config wants a CUDA toolkit even for
# a CPU-only machine: nvcc, the CUDA headers, the unversioned libcudart.so and libnvrtc.so, and
# the driver stub libcuda.so. Rather than depend on a system toolkit (which the development
# machines happen to have and a fresh machine does not), assemble one in the virtualenv from
# NVIDIA's PyPI wheels of the exact CUDA release torch pins (its cuda-toolkit meta-package, with
# the nvcc extra). CMake uses it whenever it exists (CMakeLists.txt, IMAGEGEN_CUDA_ROOT), so CI
# builds the way a fresh machine does. Nothing here needs a GPU or a driver: the binaries do not
# link libcuda (LibTorch loads the driver at run time, on a GPU host only).
# The cccl extra: CCCL's headers (nv/target, cuda/std), which cuda_fp16.h includes and so every
# file that includes ATen/cuda/CUDAContext.h; a development machine with a system toolkit finds
# them elsewhere (/usr/local/include), a fresh one did not (2026-12-03).
cuda_meta="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("cuda-toolkit"))')"
if ! "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("nvidia-cuda-nvcc"); m.version("nvidia-nvvm"); m.version("nvidia-cuda-cccl")' 2>/dev/null; then
  echo "install-deps: pip install cuda-toolkit[nvcc,cudart,cccl]==$cuda_meta (nvcc and CCCL for LibTorch's CMake config)"
  as_root "$VENV/bin/python" -m pip install -q "${PIP_C[@]}" "cuda-toolkit[nvcc,cudart,cccl]==$cuda_meta"
fi
# nvcc's wheel asks for nvidia-nvvm and nvidia-cuda-crt without a version, so pip takes the newest,
# whose PTX the pinned ptxas rejects ("Unsupported .version 9.5; current version is '9.0'"): pin
# them to nvcc's own release.
nvcc_v="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("nvidia-cuda-nvcc"))')"
for w in nvidia-nvvm nvidia-cuda-crt; do
  have="$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('$w'))" 2>/dev/null || true)"
  if [ "$have" != "$nvcc_v" ]; then
    echo "install-deps: pip install $w==$nvcc_v (found '$have'; nvcc is $nvcc_v)"
    as_root "$VENV/bin/python" -m pip install -q "${PIP_C[@]}" "$w==$nvcc_v"
  fi
done
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
wheel_cuda="$site/nvidia/cu13"
cuda_root="$VENV/cuda"
if [ ! -x "$cuda_root/bin/nvcc" ] || [ ! -e "$cuda_root/lib64/stubs/libcuda.so" ]; then
  echo "install-deps: assembling a CUDA toolkit root in $cuda_root from $wheel_cuda"
  as_root rm -rf "$cuda_root"
  as_root mkdir -p "$cuda_root/lib64/stubs"
  # bin/ holds links to the files, not a link to the folder: nvcc finds the libraries at
  # bin/../lib64, and through a linked folder '..' would be the wheel's (which has lib/ only).
  as_root mkdir -p "$cuda_root/bin"
  for f in "$wheel_cuda"/bin/*; do as_root ln -s "$f" "$cuda_root/bin/$(basename "$f")"; done
  for d in include nvvm; do as_root ln -s "$wheel_cuda/$d" "$cuda_root/$d"; done
  as_root ln -s lib64 "$cuda_root/lib"
  for f in "$wheel_cuda"/lib/*; do as_root ln -s "$f" "$cuda_root/lib64/$(basename "$f")"; done
  for lib in cudart nvrtc cublas cublasLt cufft curand cusparse cusolver nvJitLink cupti; do
    v="$(cd "$wheel_cuda/lib" && ls "lib$lib.so."* 2>/dev/null | sort | head -n 1)"
    [ -n "$v" ] && as_root ln -sf "$v" "$cuda_root/lib64/lib$lib.so"
  done
  # The driver is not on PyPI. CMake's FindCUDAToolkit only has to find a file to define its
  # CUDA::cuda_driver target (which LibTorch's config names); nothing links it, so an empty
  # library with the driver's soname stands in, as the toolkit's own stubs/libcuda.so does.
  echo 'void imagegen_cuda_driver_stub(void) {}' > /tmp/imagegen_libcuda_stub.c
  as_root cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$cuda_root/lib64/stubs/libcuda.so" \
    /tmp/imagegen_libcuda_stub.c
  rm -f /tmp/imagegen_libcuda_stub.c
fi

echo "install-deps: done. Torch CMake prefix: $("$VENV/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
