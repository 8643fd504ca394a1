"""Builds the `megatron_rl._C` extension from csrc/; package metadata lives in pyproject.toml.

The C++ CPU kernels are always built. The CUDA kernels (csrc/cuda/*.cu) are added when torch was built
with CUDA and nvcc is found; MEGATRON_RL_BUILD_CUDA=1 requires them (error if impossible),
MEGATRON_RL_BUILD_CUDA=0 leaves them out. TORCH_CUDA_ARCH_LIST picks the GPU architectures as usual; unset
with no GPU visible (a build node), the presets' Hopper/Blackwell list is used (setup_cuda.cuda_arch_list) and
printed, where torch's builder would fail on the empty list of visible GPUs.
"""

import os
import platform
import sys
from glob import glob
from pathlib import Path

from setuptools import setup
from torch.utils import cpp_extension

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT))
from setup_cuda import CUDA_ENV, apply_cuda_arch_list, cuda_build_decision, nvcc_version  # noqa: E402


def _rel(paths):
    return sorted(str(Path(p).relative_to(ROOT)) for p in paths)


def _want_cuda() -> bool:
    """Build the CUDA kernels? A toolkit whose CUDA major differs from torch's is refused with
    MEGATRON_RL_BUILD_CUDA=1 and gives a CPU-only build with a warning otherwise (setup_cuda.py)."""
    import torch

    toolkit = nvcc_version(cpp_extension.CUDA_HOME)
    build, warning = cuda_build_decision(
        torch.version.cuda,
        toolkit,
        os.environ.get(CUDA_ENV),
        cuda_home=cpp_extension.CUDA_HOME,
    )
    if warning:
        print(warning, file=sys.stderr)
    if build:  # torch's builder reads the list when it compiles the .cu files
        print(apply_cuda_arch_list(os.environ, torch.cuda.device_count(), toolkit), file=sys.stderr)
    return build


def _extension():
    sources = ["csrc/bindings.cpp"] + _rel(glob(str(ROOT / "csrc/cpu/*.cpp")))
    # -fopenmp: ATen's parallel_for is an inline OpenMP region compiled into this extension; at run time
    # it binds to the libgomp torch already loaded.
    cxx = ["-O3", "-fopenmp"]
    if not _want_cuda():
        return cpp_extension.CppExtension(
            "megatron_rl._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"]
        )
    return cpp_extension.CUDAExtension(
        "megatron_rl._C",
        sources + _rel(glob(str(ROOT / "csrc/cuda/*.cu"))),
        define_macros=[("MEGATRON_RL_WITH_CUDA", None)],
        extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]},
        extra_link_args=["-fopenmp"],
    )


class BuildExtension(cpp_extension.BuildExtension):
    """torch's BuildExtension, plus per-file ISA flags: csrc/cpu/*_avx2.cpp get AVX2+FMA on x86-64.

    Those kernels are chosen at run time only on CPUs that have AVX2, so the rest of the extension keeps
    the baseline instruction set (as ATen builds its own per-ISA kernels).
    """

    def build_extension(self, ext):
        isa_sources = [s for s in ext.sources if s.endswith("_avx2.cpp")]
        ext.sources = [s for s in ext.sources if s not in isa_sources]
        flags = dict(ext.extra_compile_args)
        if platform.machine().lower() in ("x86_64", "amd64"):
            flags["cxx"] = flags["cxx"] + ["-mavx2", "-mfma", "-mf16c"]
        ext.extra_objects = ext.extra_objects + self.compiler.compile(
            isa_sources,
            output_dir=self.build_temp,
            macros=ext.define_macros,
            include_dirs=ext.include_dirs,
            extra_postargs=flags,
        )
        super().build_extension(ext)


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
