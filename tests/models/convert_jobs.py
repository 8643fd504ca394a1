"""Rank jobs of test_convert_cli.py (importable by spawned ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def verify_under_nccl_like_job(hf_dir: str) -> dict[str, Any]:
    """``--verify``'s comparison on one rank, inside the NCCL device check."""
    import torch

    from megatron_rl.distributed import destroy_model_parallel, init_model_parallel
    from megatron_rl_testing.nccl_like import NcclDeviceError, nccl_like
    from megatron_rl.models.api import build_from_hf
    from megatron_rl.weights.convert_cli import _parser, _verify

    init_model_parallel(tp=1)
    chunks = build_from_hf(hf_dir, params_dtype=torch.float32)
    args = _parser().parse_args(["hf-to-mcore", "--hf-dir", hf_dir, "--out", str(Path(hf_dir) / "unused"), "--verify"])
    out: dict[str, Any] = {}
    try:
        with nccl_like():
            out["diff"] = _verify(chunks, Path(hf_dir), torch.float32, args)
    except NcclDeviceError as err:
        out["error"] = str(err)
    # The check itself: a CPU tensor in an all-reduce is caught.
    try:
        with nccl_like():
            torch.distributed.all_reduce(torch.zeros(1))
        out["self_check"] = "not caught"
    except NcclDeviceError as err:
        out["self_check"] = str(err)
    with nccl_like():
        flag = torch.zeros(1, device="cuda") + 1  # what a GPU machine would have on its device
        torch.distributed.all_reduce(flag)
        out["device_tensor_ok"] = float(flag.item())
    destroy_model_parallel()
    return out
