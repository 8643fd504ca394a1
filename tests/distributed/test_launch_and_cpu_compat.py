"""Launcher environment parsing and the reversible CPU compatibility layer (in-process, no ranks)."""

import pytest
import torch

from megatron_rl.distributed.cpu_compat import cpu_compat_installed, cuda_type_names, install_cpu_compat
from megatron_rl.distributed.process_group import first_slurm_host, read_launch_env


def test_torchrun_variables_win():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "n0",
        "MASTER_PORT": "1234",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "8",
    }
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.master_addr, launch.master_port) == (
        3,
        4,
        1,
        "n0",
        1234,
    )
    assert launch.source == "torchrun"


def test_slurm_variables_give_first_node_and_a_job_derived_port():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "16",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "gpu[03-05,9],cpu1",
        "SLURM_JOB_ID": "123456",
    }
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank) == (5, 16, 1)
    assert launch.master_addr == "gpu03" and launch.master_port == 15000 + 123456 % 20000
    assert launch.source == "slurm"
    assert read_launch_env({**env, "MASTER_ADDR": "head", "MASTER_PORT": "999"}).master_addr == "head"


def test_no_launcher_means_one_process_and_bad_values_are_named():
    assert read_launch_env({}).world_size == 1 and read_launch_env({}).source == "single"
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        read_launch_env({"RANK": "x", "WORLD_SIZE": "2"})


@pytest.mark.parametrize(
    "nodelist, host", [("node1", "node1"), ("a[1-2]", "a1"), ("x[007,9]", "x007"), ("h-1,h-2", "h-1")]
)
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_type_names_are_cuda_names_inside_the_scope_only():
    t = torch.ones(2)
    with cuda_type_names(), cuda_type_names():  # nests (the engine's optimizer scope may be re-entered)
        assert t.type() == "torch.cuda.FloatTensor"  # what Megatron's gradient clipping asserts
        assert torch.nn.Parameter(t).type() == "torch.cuda.FloatTensor"
        assert t.type(torch.float64).dtype == torch.float64  # conversions are untouched
        assert torch._C._len_torch_function_stack() == 0  # no per-op Python handler
    assert t.type() == "torch.FloatTensor"


def test_cpu_compat_is_reversible_and_nests():
    from megatron.core.tensor_parallel import random as mcore_random

    originals = (
        torch.cuda.current_device,
        torch.cuda.synchronize,
        torch.Tensor.cuda,
        mcore_random._CUDA_RNG_STATE_TRACKER,
        torch.tensor,
        torch.zeros,
        torch.empty_like,
    )
    with install_cpu_compat(force=True):
        inner = install_cpu_compat(force=True)
        assert torch.cuda.current_device() == torch.device("cpu")
        torch.cuda.synchronize()  # no error without a GPU
        assert torch.ones(1).cuda().device.type == "cpu"
        with mcore_random.get_cuda_rng_tracker().fork():  # no-op fork: no CUDA generator needed
            pass
        assert torch.tensor([1.0], device="cuda").device.type == "cpu"  # e.g. FP32Optimizer._scale
        # the pipeline schedules' token count
        assert torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
        assert torch.empty_like(torch.ones(2), device=torch.device("cuda", 0)).device.type == "cpu"
        assert torch.ones(1, device=0).device.type == "cpu"
        assert torch.zeros(2, device="cpu", dtype=torch.int8).dtype == torch.int8  # other arguments pass on
        # no torch-function mode: ordinary ops (the model's forward, the HF engine's generation) are not
        # routed through a Python handler (one was, ~20 % of a demo-sized CPU step)
        assert torch._C._len_torch_function_stack() == 0
        inner.uninstall()
        assert cpu_compat_installed()  # the outer holder keeps it
    assert not cpu_compat_installed()
    restored = (
        torch.cuda.current_device,
        torch.cuda.synchronize,
        torch.Tensor.cuda,
        mcore_random._CUDA_RNG_STATE_TRACKER,
    )
    assert all(a is b for a, b in zip(restored, originals))
    if not torch.cuda.is_available():
        with pytest.raises((AssertionError, RuntimeError)):  # "Torch not compiled with CUDA enabled"
            torch.zeros(1, device="cuda")


def test_device_contexts_still_place_factory_calls_when_the_layer_comes_first():
    """torch's ``with torch.device(...)`` finds the calls to place by identity in a set made on first use; a
    process that installs the layer before any device context (a Megatron worker that then loads an HF model
    under transformers' meta-device init) must still get meta tensors there. In a fresh process: this one's set
    is already made. Failed before the fix with cpu tensors, and an HF model with uninitialised RoPE buffers."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from megatron_rl.distributed.cpu_compat import install_cpu_compat\n"
        "with install_cpu_compat():\n"
        "    with torch.device('meta'):\n"
        "        made = [torch.empty(2), torch.tensor([1.0]), torch.zeros(2), torch.arange(3)]\n"
        "    print(sorted({t.device.type for t in made}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "['meta']", out.stdout + out.stderr
