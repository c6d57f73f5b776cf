"""Build yafsdp and its kernels.

    pip install --no-build-isolation -e .      # editable, builds the extensions in place
    pip install --no-build-isolation .         # regular install

`--no-build-isolation` builds against the torch already installed (the extension's
ABI must match it) and keeps pip from fetching another torch.

What is built:
- `yafsdp._C`       the CPU kernels and the op schemas (csrc/ops.cpp, csrc/cpu_kernels.cpp);
                    always, unless YAFSDP_NO_EXT=1.
- `yafsdp._C_cuda`  the CUDA kernels (csrc/*.cu + csrc/cuda_binding.cpp); when torch was
                    built with CUDA and nvcc is found, unless YAFSDP_NO_CUDA=1.

Switches (environment variables, "1" to set):
- YAFSDP_NO_EXT     build no extension; yafsdp runs on its pure-PyTorch kernels.
- YAFSDP_NO_CUDA    skip the CUDA extension.
- YAFSDP_FORCE_CUDA build the CUDA extension or fail (instead of skipping it quietly when
                    torch has no CUDA or nvcc is missing).
- TORCH_CUDA_ARCH_LIST  CUDA architectures (torch's variable); default here: sm_80, sm_90
                    and compute_90 PTX.
- MAX_JOBS          parallel compile jobs (torch's variable).
"""
from __future__ import annotations

import os
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _log(msg: str) -> None:
    print(f"yafsdp setup: {msg}", file=sys.stderr)


def _extensions():
    if _flag("YAFSDP_NO_EXT"):
        _log("YAFSDP_NO_EXT=1: building no extension (pure-PyTorch kernels)")
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        _log("torch is not importable here; building no extension. Install torch first and "
             "use `pip install --no-build-isolation .` to build the kernels")
        return [], {}

    csrc = "csrc"  # setuptools wants paths relative to setup.py
    # -ffp-contract=off: the kernels place every fused multiply-add explicitly (see
    # [Note: AdamW numerics] in csrc/cpu_kernels.cpp); the compiler must not add others.
    # The C++ standard is torch's choice. -Wno-maybe-uninitialized: GCC 12's AVX-512 headers.
    cxx_flags = ["-O3", "-ffp-contract=off", "-Wno-maybe-uninitialized"]
    link_flags = []
    # at::parallel_for is inlined into the extension: with torch's OpenMP backend the extension
    # must be compiled with -fopenmp or it runs on one thread. It then links libgomp.so.1, the
    # soname torch's bundled copy has, so one OpenMP runtime serves both.
    if torch.backends.openmp.is_available() and sys.platform.startswith("linux"):
        cxx_flags.append("-fopenmp")
        link_flags.append("-fopenmp")
    extensions = [
        cpp_extension.CppExtension(
            name="yafsdp._C",
            sources=[f"{csrc}/ops.cpp", f"{csrc}/cpu_kernels.cpp"],
            include_dirs=[os.path.join(ROOT, csrc)],
            extra_compile_args=cxx_flags,
            extra_link_args=link_flags,
        )
    ]

    force_cuda = _flag("YAFSDP_FORCE_CUDA")
    if _flag("YAFSDP_NO_CUDA"):
        _log("YAFSDP_NO_CUDA=1: skipping the CUDA extension")
        if force_cuda:
            raise RuntimeError("yafsdp setup: YAFSDP_NO_CUDA=1 and YAFSDP_FORCE_CUDA=1 contradict")
    else:
        why_not = None
        if torch.version.cuda is None:
            why_not = f"torch {torch.__version__} was built without CUDA"
        elif cpp_extension.CUDA_HOME is None or not (
            shutil.which("nvcc") or os.path.exists(os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc"))
        ):
            why_not = "nvcc was not found (set CUDA_HOME)"
        if why_not is None:
            nvcc_flags = ["-O3", "-lineinfo"]
            if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
                nvcc_flags += [
                    "-gencode=arch=compute_80,code=sm_80",
                    "-gencode=arch=compute_90,code=sm_90",
                    "-gencode=arch=compute_90,code=compute_90",
                ]
            extensions.append(
                cpp_extension.CUDAExtension(
                    name="yafsdp._C_cuda",
                    sources=[
                        f"{csrc}/cuda_binding.cpp",
                        f"{csrc}/adamw_cuda.cu",
                        f"{csrc}/copy_cuda.cu",
                        f"{csrc}/nf4_cuda.cu",
                        f"{csrc}/fp8_cuda.cu",
                    ],
                    include_dirs=[os.path.join(ROOT, csrc)],
                    extra_compile_args={"cxx": ["-O3"], "nvcc": nvcc_flags},
                )
            )
            _log(f"building the CUDA extension (torch CUDA {torch.version.cuda})")
        elif force_cuda:
            raise RuntimeError(f"yafsdp setup: YAFSDP_FORCE_CUDA=1 but {why_not}")
        else:
            _log(f"skipping the CUDA extension: {why_not}")

    return extensions, {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()

setup(
    name="yafsdp",
    version="0.1.0",
    description="YaFSDP-style sharded data-parallel engine for PyTorch",
    packages=find_packages(include=["yafsdp", "yafsdp.*"]),
    python_requires=">=3.10",
    # torch is deliberately not listed: pip must never replace the installed (CPU or CUDA)
    # torch. Install torch first.
    install_requires=["numpy"],
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
