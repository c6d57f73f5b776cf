#!/usr/bin/env bash
# Compile every csrc/*.cu with nvcc to object files (sm_80 and sm_90), so the CUDA
# kernels cannot rot on CPU-only machines. Then, where the installed torch ships
# the c10/cuda headers, syntax-check the torch binding (csrc/cuda_binding.cpp).
# Fails on any error or warning. Usage: .ci/compile_cuda.sh   (from anywhere)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
nvcc_bin="${NVCC:-nvcc}"
if ! command -v "$nvcc_bin" >/dev/null 2>&1; then
  echo "compile_cuda: nvcc not found (set NVCC=/path/to/nvcc)" >&2
  exit 1
fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

"$nvcc_bin" --version | tail -n 1
shopt -s nullglob
cu_files=("$root"/csrc/*.cu)
if [ "${#cu_files[@]}" -eq 0 ]; then
  echo "compile_cuda: no csrc/*.cu files" >&2
  exit 1
fi
# The flags torch's CUDAExtension adds (no implicit half/bf16 conversions), the oldest C++
# standard a supported torch uses, and the architectures setup.py builds for.
for f in "${cu_files[@]}"; do
  echo "nvcc $(basename "$f")"
  "$nvcc_bin" -O3 -std=c++17 -lineinfo -I"$root/csrc" \
    -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ \
    -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ \
    --expt-relaxed-constexpr -Xcompiler -fPIC \
    -gencode=arch=compute_80,code=sm_80 \
    -gencode=arch=compute_90,code=sm_90 \
    --Werror all-warnings -Xcompiler -Wall,-Werror \
    -c "$f" -o "$out/$(basename "$f").o"
done

# The binding needs torch's CUDA headers; torch's CPU wheel ships c10/cuda but not
# the cmake-generated c10/cuda/impl/cuda_cmake_macros.h, which a stub stands in for.
python="${PYTHON:-python}"
torch_inc="$("$python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))' 2>/dev/null || true)"
cuda_inc="$(dirname "$(dirname "$(readlink -f "$(command -v "$nvcc_bin")")")")/include"
if [ ! -f "$cuda_inc/cuda_runtime_api.h" ]; then
  cuda_inc="$("$nvcc_bin" -v -x cu -E /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ INCLUDES="-I\([^"]*\)".*/\1/p' | head -n 1)"
fi
if [ -n "$torch_inc" ] && [ -f "$torch_inc/c10/cuda/CUDAGuard.h" ] && [ -f "$cuda_inc/cuda_runtime_api.h" ]; then
  stub="$out/stub/c10/cuda/impl"
  mkdir -p "$stub"
  if [ ! -f "$torch_inc/c10/cuda/impl/cuda_cmake_macros.h" ]; then
    printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$stub/cuda_cmake_macros.h"
  fi
  py_inc="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
  echo "g++ -fsyntax-only cuda_binding.cpp"
  "${CXX:-g++}" -std=c++20 -fsyntax-only -Wall -Werror -Wno-unused-function \
    -I"$root/csrc" -I"$out/stub" -I"$torch_inc" -I"$torch_inc/torch/csrc/api/include" \
    -I"$cuda_inc" -I"$py_inc" -DTORCH_EXTENSION_NAME=_C_cuda "$root/csrc/cuda_binding.cpp"
else
  echo "compile_cuda: skipping the binding check (no torch c10/cuda headers or CUDA runtime headers)"
fi
echo "compile_cuda: OK (${#cu_files[@]} .cu files)"
