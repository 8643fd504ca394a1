"""The CUDA compile check (scripts/check_cuda.sh, `make check-cuda`) and the registers/spills table of
docs/kernels.md (scripts/ptxas_table.py), issue 49 item 8. The compile tests need nvcc and skip without it; the
others read files only."""
from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "check_cuda.sh"
DOC = ROOT / "docs" / "kernels.md"
spec = importlib.util.spec_from_file_location("ptxas_table", ROOT / "scripts" / "ptxas_table.py")
ptxas_table = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = ptxas_table  # its dataclasses look their module up there
spec.loader.exec_module(ptxas_table)

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH: no CUDA compile check here")


def _setup_py_nvcc_flags() -> list[str]:
    """The literal list setup.py passes as extra_compile_args["nvcc"]."""
    for node in ast.walk(ast.parse((ROOT / "setup.py").read_text())):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "nvcc":
                    return ast.literal_eval(value)
    raise AssertionError("setup.py passes no extra_compile_args['nvcc']")


def test_the_check_compiles_with_the_extension_builds_flags():
    """Before issue 49 the check left out torch's COMMON_NVCC_FLAGS (no implicit bf16/half conversions), so a
    kernel could pass `make check-cuda` and still fail in setup.py's build on a GPU node."""
    from torch.utils import cpp_extension

    flags = subprocess.run([str(CHECK), "--print-flags"], capture_output=True, text=True, check=True,
                           timeout=30).stdout.split("\n")
    for flag in cpp_extension.COMMON_NVCC_FLAGS + _setup_py_nvcc_flags():
        assert flag in flags, f"scripts/check_cuda.sh does not pass {flag!r}, which the extension build does"
    assert "-std=c++20" in flags  # torch >= 2.10 builds extensions as C++20
    for arch in (80, 90):
        assert f"arch=compute_{arch},code=sm_{arch}" in flags
    assert {"--Werror", "all-warnings", "-Xptxas", "-v"} <= set(flags)


BAD_SOURCES = {
    # nvcc front-end warning #177 (unused variable): an error under --Werror all-warnings
    "warning.cu": ("__global__ void unused_kernel(float* out) {\n  int unused = 3;\n  out[threadIdx.x] = 1.0f;\n}\n",
                   'variable "unused" was declared but never referenced'),
    # compiles with nvcc's defaults, not with torch's -D__CUDA_NO_BFLOAT16_CONVERSIONS__
    "bf16_conversion.cu": ("#include <cuda_bf16.h>\n__global__ void implicit_kernel(const __nv_bfloat16* in, "
                           "float* out) {\n  float x = in[threadIdx.x];\n  out[threadIdx.x] = x;\n}\n",
                           'no suitable conversion function from "const __nv_bfloat16" to "float"'),
    "syntax.cu": ("__global__ void broken_kernel(float* out) { out[threadIdx.x] = 1.0f }\n", 'expected a ";"'),
}
GOOD_SOURCE = ("#include <cuda_bf16.h>\n__global__ void scale_kernel(const __nv_bfloat16* in, float* out, float s) "
               "{\n  out[threadIdx.x] = __bfloat162float(in[threadIdx.x]) * s;\n}\n")


@pytest.fixture(scope="module")
def check_run(tmp_path_factory):
    """One run of the check over three bad files and one good one (one nvcc call each)."""
    tmp = tmp_path_factory.mktemp("cuda_check")
    for name, (source, _) in BAD_SOURCES.items():
        (tmp / name).write_text(source)
    (tmp / "good.cu").write_text(GOOD_SOURCE)
    sources = [str(tmp / name) for name in BAD_SOURCES] + [str(tmp / "good.cu")]
    run = subprocess.run([str(CHECK), *sources], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PTXAS_LOG": str(tmp / "ptxas.log")})
    return tmp, run


@needs_nvcc
def test_the_check_fails_on_each_bad_file_and_names_it(check_run):
    tmp, run = check_run
    assert run.returncode == 1, run.stdout + run.stderr
    for name, (_, message) in BAD_SOURCES.items():
        assert f"FAIL sm_80,sm_90 {tmp / name}:" in run.stderr
        assert message in run.stderr
    assert f"ok   sm_80,sm_90 {tmp / 'good.cu'}" in run.stdout


@needs_nvcc
def test_the_checks_ptxas_report_parses_into_the_table(check_run):
    tmp, _ = check_run
    report = ptxas_table.parse_ptxas_log((tmp / "ptxas.log").read_text())
    assert re.fullmatch(r"release \d+\.\d+, V[\d.]+", report.nvcc)
    assert {(Path(k.source).name, k.arch) for k in report.kernels} == {("good.cu", "sm_80"), ("good.cu", "sm_90")}
    assert all(k.registers > 0 and k.spill_store_bytes == 0 for k in report.kernels)
    table = ptxas_table.render_table(report)
    assert re.search(r"\| good\.cu \| `scale_kernel` \| \d+ \| 0 / 0 \| \d+ \| 0 / 0 \|", table), table


# Two entry functions of nvcc 13.0's report for log_probs.cu (sm_80), a non-entry function between them.
PTXAS_SAMPLE = """# nvcc: release 13.0, V13.0.88
== csrc/cuda/log_probs.cu
ptxas info    : 28 bytes gmem, 224 bytes cmem[4]
ptxas info    : Compiling entry function '_ZN11megatron_rl4cuda45_GLOBAL__N__0bb91216_12_log_probs_cu_6f8fe94d16row_grads_kernelI13__nv_bfloat16EEvNS_11LogProbGradE' for 'sm_80'
ptxas info    : Function properties for _ZN11megatron_rl4cuda45_GLOBAL__N__0bb91216_12_log_probs_cu_6f8fe94d16row_grads_kernelI13__nv_bfloat16EEvNS_11LogProbGradE
    8 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 48 registers, used 0 barriers, 8 bytes cumulative stack size, 480 bytes cmem[0]
ptxas info    : Compile time = 233.149 ms
ptxas info    : Function properties for _Z6helperv
    16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function '_ZN11megatron_rl4cuda45_GLOBAL__N__0bb91216_12_log_probs_cu_6f8fe94d12merge_kernelIfEEvNS_12LogProbMergeE' for 'sm_80'
ptxas info    : Function properties for _ZN11megatron_rl4cuda45_GLOBAL__N__0bb91216_12_log_probs_cu_6f8fe94d12merge_kernelIfEEvNS_12LogProbMergeE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 29 registers, used 0 barriers, 432 bytes cmem[0]
"""  # noqa: E501


def test_ptxas_report_parsing():
    report = ptxas_table.parse_ptxas_log(PTXAS_SAMPLE)
    assert report.nvcc == "release 13.0, V13.0.88"
    assert [(k.registers, k.stack_bytes, k.spill_store_bytes, k.spill_load_bytes) for k in report.kernels] == [
        (48, 8, 4, 8), (29, 0, 0, 0)]
    assert {k.source for k in report.kernels} == {"csrc/cuda/log_probs.cu"}
    table = ptxas_table.render_table(report)
    assert "| log_probs.cu | `row_grads_kernel<__nv_bfloat16>` | 48 | 4 / 8 |" in table
    assert "| log_probs.cu | `merge_kernel<float>` | 29 | 0 / 0 |" in table


def test_a_truncated_ptxas_report_is_refused_naming_the_kernel():
    truncated = PTXAS_SAMPLE.rsplit("ptxas info    : Used 29", 1)[0]
    with pytest.raises(ValueError, match="ends inside .*merge_kernel.* \\(sm_80\\): no 'Used N registers' line"):
        ptxas_table.parse_ptxas_log(truncated)
    with pytest.raises(ValueError, match="comes before any '== <file.cu>' line"):
        ptxas_table.parse_ptxas_log(PTXAS_SAMPLE.replace("== csrc/cuda/log_probs.cu\n", ""))


def test_the_doc_table_is_written_between_its_markers_only(tmp_path):
    doc = tmp_path / "kernels.md"
    doc.write_text(f"before\n{ptxas_table.BEGIN}\nold table\n{ptxas_table.END}\nafter\n")
    ptxas_table.update_doc(doc, ptxas_table.parse_ptxas_log(PTXAS_SAMPLE))
    text = doc.read_text()
    intro = "ptxas's report from nvcc (release 13.0, V13.0.88)"
    assert text.startswith(f"before\n{ptxas_table.BEGIN}\n{intro}") and text.endswith(f"{ptxas_table.END}\nafter\n")
    assert "old table" not in text and "`merge_kernel<float>`" in text
    doc.write_text("no markers\n")
    with pytest.raises(ValueError, match="kernels.md needs exactly one '<!-- ptxas-table"):
        ptxas_table.update_doc(doc, ptxas_table.parse_ptxas_log(PTXAS_SAMPLE))


def test_every_cuda_kernel_has_a_row_for_each_architecture_in_the_docs_table():
    """A kernel added to csrc/cuda without `make cuda-ptxas-table` run again is missing from docs/kernels.md."""
    text = DOC.read_text()
    assert ptxas_table.BEGIN in text, f"docs/kernels.md has no {ptxas_table.BEGIN!r} block"
    table = text.split(ptxas_table.BEGIN)[1].split(ptxas_table.END)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "`" in line]
    for source in sorted((ROOT / "csrc" / "cuda").glob("*.cu")):
        for kernel in re.findall(r"__global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(", source.read_text()):
            mine = [row for row in rows if row.startswith(f"| {source.name} | `{kernel}")]
            assert mine, f"{source.name}: kernel {kernel} is not in docs/kernels.md's registers/spills table"
            assert all(" - |" not in row for row in mine), f"{kernel}: an architecture is missing: {mine}"


def test_the_extension_build_refuses_a_toolkit_without_cuda_headers_before_installing(tmp_path):
    """scripts/build_cuda_extension.sh takes the toolkit nvcc names (`nvcc -dryrun`'s TOP), not the parent of
    `which nvcc` as torch does: here that is /usr/local, which has no CUDA headers. A toolkit it cannot build
    with is named before the multi-GB torch install starts."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvcc").write_text(f"#!/bin/sh\necho '#$ TOP={tmp_path}/bin/..'\n")
    (fake_bin / "nvcc").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_bin}:/usr/bin:/bin", "CUDA_BUILD_VENV": str(tmp_path / "venv")}
    env.pop("CUDA_HOME", None)
    run = subprocess.run([str(ROOT / "scripts" / "build_cuda_extension.sh")], capture_output=True, text=True,
                         env=env, timeout=60)
    assert run.returncode == 1
    assert f"CUDA_HOME={tmp_path} has no bin/nvcc or include/cuda_runtime_api.h" in run.stderr
    assert not (tmp_path / "venv").exists()
