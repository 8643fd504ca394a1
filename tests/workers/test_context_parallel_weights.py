"""Weight export and checkpoints under context parallelism (issue 35 item 5): the CP ranks of one TP x PP shard
hold the same weights, so CP changes neither what is exported nor what a checkpoint holds.

Export (gloo, CPU, tiny Qwen2): at TP=1 x CP=2 (2 ranks) and TP=2 x CP=2 (4 ranks), each rank's export stays in
its own TP x PP group (no byte to or from a CP peer), moves exactly what the same ranks move at CP=1 (DP in
place of CP), and its tensors are bit for bit the CP=1 export of the same checkpoint; in server mode only the
sender's TP group exports (the other CP rank's group sends nothing), and ``save_hf_checkpoint`` at CP=2 writes
the CP=1 tensors.

Checkpoints (fp32, AdamW, synthetic gradients, cp_weights_jobs.py): saved at CP=2 and resumed at CP=1, and saved
at CP=1 and resumed at CP=2, at TP=1 and TP=2: the weights, Adam moments and steps, LR schedule and the next
step's weights, moments and gradient norm equal the uninterrupted CP=1 run's exactly; each CP rank gets its own
RNG state back at the layout that saved it. (Megatron's distributed optimizer cannot resume on CPU here,
``capabilities.distributed_optimizer_blocker``; its state is sharded over DP x CP by megatron-core itself.)

Four spawns: one rank (the CP=1 reference and checkpoint), two ranks (TP=1: DP=2 then CP=2), one rank (resume
the CP=2 checkpoint at CP=1), four ranks (TP=2: DP=2, CP=2, DP=2 again).
"""

from __future__ import annotations

from pathlib import Path

import cp_weights_jobs as jobs
import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.distributed import run_multiprocess

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("cp_weights") / "qwen2", "qwen2", with_tokenizer=False)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cp_ckpts")


@pytest.fixture(scope="module")
def reference(model_dir, workdir) -> dict:
    return run_multiprocess(jobs.reference_job, 1, str(model_dir), str(workdir), timeout_s=300)[0]


@pytest.fixture(scope="module")
def cp2(reference, model_dir, workdir) -> list[dict]:
    return run_multiprocess(jobs.cp2_job, 2, str(model_dir), str(workdir), timeout_s=400)


@pytest.fixture(scope="module")
def resumed_at_cp1(cp2, model_dir, workdir) -> dict:
    return run_multiprocess(jobs.resume_cp1_job, 1, str(model_dir), str(workdir), timeout_s=300)[0]


@pytest.fixture(scope="module")
def tp2(model_dir, workdir) -> list[dict]:
    return run_multiprocess(jobs.tp2_cp2_job, 4, str(model_dir), str(workdir), timeout_s=600)


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str,
                        ordered: bool = True) -> None:
    if ordered:
        assert list(got) == list(want), f"{what}: names or order differ"
    assert sorted(got) == sorted(want), f"{what}: names differ"
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, f"{what}: {name}"
        assert torch.equal(got[name], tensor), f"{what}: {name} differs by {(got[name] - tensor).abs().max()}"


def assert_same_state(got: dict, want: dict, what: str) -> None:
    """Weights, Adam moments and steps, LR and scheduler position, exactly (same arithmetic in both runs)."""
    assert_same_tensors(got["weights"], want["weights"], f"{what} weights")
    assert got["adam"].keys() == want["adam"].keys(), what
    for name, state in want["adam"].items():
        assert set(got["adam"][name]) == set(state) == {"step", "exp_avg", "exp_avg_sq"}, f"{what}: {name}"
        assert_same_tensors(got["adam"][name], state, f"{what} Adam state of {name}", ordered=False)
    assert (got["lr"], got["scheduler_steps"]) == (want["lr"], want["scheduler_steps"]), what


def assert_resumed(got: dict, saved: dict, uninterrupted: dict, what: str) -> None:
    assert got["extra"] == {"step": 1}, what
    assert_same_state(got["loaded"], saved, f"{what}, as loaded")
    assert_same_state(got["after_step2"], uninterrupted["after_step2"], f"{what}, after the next step")
    assert got["grad_norm2"] == uninterrupted["grad_norm2"], what


# ---------------------------------------------------------------------------------------- export
def check_cp_export(cp2_export: dict, dp2_export: dict, reference_export: dict, cp_rank: int, tp_rank: int,
                    what: str) -> None:
    want = reference_export["colocated"]["tensors"]
    colocated, server = cp2_export["colocated"], cp2_export["server"]
    # Colocated: every rank feeds its own engine from its own TP group's gather, the CP=1 tensors bit for bit.
    assert_same_tensors(colocated["tensors"], want, f"{what} colocated export")
    # Nothing leaves the TP group (no CP peer takes part), and exactly the traffic of the same ranks at CP=1.
    assert colocated["traffic"]["inter_send"] == colocated["traffic"]["inter_recv"] == 0, what
    assert colocated["traffic"] == dp2_export["colocated"]["traffic"], what
    assert colocated["buckets"] == dp2_export["colocated"]["buckets"] == reference_export["colocated"]["buckets"]
    # Server mode (only global rank 0 sends): one export, by the TP x PP shard of rank 0; the CP peer's group idles.
    assert server["traffic"] == dp2_export["server"]["traffic"], what
    assert server["traffic"]["inter_send"] == server["traffic"]["inter_recv"] == 0, what
    if cp_rank == 0 and tp_rank == 0:
        assert_same_tensors(server["tensors"], want, f"{what} server export")
        assert server["buckets"] == reference_export["server"]["buckets"]
    else:
        assert server["buckets"] == 0 and not server["tensors"], what
    if cp_rank > 0:
        assert server["traffic"]["collectives"] == 0, f"{what}: a CP rank > 0 took part in the server export"


def test_export_at_tp1_cp2_is_the_cp1_export_once_per_shard(reference, cp2, workdir):
    for out in cp2:
        tp_rank, cp_rank, dp_rank = out["layout"]
        assert (tp_rank, cp_rank, dp_rank) == (0, out["rank"], 0)
        check_cp_export(out["cp2/export"], out["dp2/export"], reference["export"], cp_rank, tp_rank,
                        f"TP=1 x CP=2 rank {out['rank']}")
    # save_hf_checkpoint at CP=2: one writer, the CP=1 tensors
    written = load_file(str(workdir / "hf_cp2" / "model.safetensors"))
    want = reference["export"]["colocated"]["tensors"]
    assert sorted(written) == sorted(want)
    assert all(torch.equal(written[name], want[name]) for name in want)


def test_export_at_tp2_cp2_is_the_cp1_export_once_per_shard(reference, tp2):
    for out in tp2:
        tp_rank, cp_rank, dp_rank = out["cp2/layout"]
        assert (tp_rank, cp_rank, dp_rank) == (out["rank"] % 2, out["rank"] // 2, 0)
        assert out["dp2/layout"] == (tp_rank, 0, cp_rank)  # the same ranks, DP in place of CP
        check_cp_export(out["cp2/export"], out["dp2/export"], reference["export"], cp_rank, tp_rank,
                        f"TP=2 x CP=2 rank {out['rank']}")


# ---------------------------------------------------------------------------------------- checkpoints
def test_checkpoint_saved_at_cp2_resumes_at_cp1(reference, cp2, resumed_at_cp1):
    run = reference["run"]
    for out in cp2:
        # The CP=2 run took the CP=1 run's step (same gradients): what it saved is the CP=1 state on both ranks.
        assert_same_state(out["cp2/run"]["saved"], run["saved"], f"CP=2 rank {out['rank']} at its save")
        assert out["cp2/run"]["grad_norm1"] == run["grad_norm1"]
    assert_resumed(resumed_at_cp1, run["saved"], run, "TP=1: saved at CP=2, resumed at CP=1")


def test_checkpoint_saved_at_cp1_resumes_at_cp2(reference, cp2):
    run = reference["run"]
    for out in cp2:
        assert_resumed(out["cp2/resume_cp1"], run["saved"], run, f"TP=1: saved at CP=1, resumed at CP=2 rank {out['rank']}")


def test_each_cp_rank_restores_its_own_rng_state(reference, cp2, resumed_at_cp1, workdir):
    from megatron_rl.workers.checkpoint import read_checkpoint_metadata

    assert [out["cp2/rng_round_trip"] for out in cp2] == [True, True]
    assert read_checkpoint_metadata(workdir / "ckpt_tp1cp2")["layout"] == {"tp": 1, "pp": 1, "cp": 2, "dp": 1, "vpp": 1}
    assert read_checkpoint_metadata(workdir / "ckpt_tp1cp1")["layout"]["cp"] == 1
    # a CP=1 checkpoint whose metadata predates the recorded CP size still restores its RNG state at CP=1
    assert torch.equal(resumed_at_cp1["legacy_rng"], reference["run"]["rng_at_save"])


def test_tp2_checkpoints_between_cp2_and_cp1(tp2):
    by_rank = {out["rank"]: out for out in tp2}
    for rank, out in by_rank.items():
        cp1 = by_rank[rank]["dp2/run"]  # the same TP rank at CP=1 (DP=2): the same local shards
        assert_same_state(out["cp2/run"]["saved"], cp1["saved"], f"TP=2 x CP=2 rank {rank} at its save")
        assert out["cp2/run"]["grad_norm1"] == cp1["grad_norm1"]
        assert_resumed(out["cp2/resume_cp1"], cp1["saved"], cp1, f"TP=2: saved at CP=1, resumed at CP=2 rank {rank}")
        assert_resumed(out["dp2/resume_cp2"], cp1["saved"], cp1, f"TP=2: saved at CP=2, resumed at CP=1 rank {rank}")
