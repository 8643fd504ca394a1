"""Rank jobs of test_convert_expert_parallel.py (importable by spawned ranks): the converter's rank functions at
several TP / PP / EP / ETP layouts in one group of ranks, and trainer checkpoints written at EP=2."""

from __future__ import annotations

from typing import Any

# One conversion: (command, source, out, tp, pp, ep, etp); directories relative to the job's work dir.
Step = tuple[str, str, str, int, int, int, int | None]


def _record_expert_reads() -> list[str]:
    """Names of the HF expert tensors this rank reads from now on (a counter of loaded expert tensors)."""
    from megatron_rl.models.hf_checkpoint import HFCheckpointReader

    names: list[str] = []
    original = HFCheckpointReader.read

    def read(self, name, *args, **kwargs):
        if ".experts." in name:
            names.append(name)
        return original(self, name, *args, **kwargs)

    HFCheckpointReader.read = read
    return names


def convert_steps_job(hf_dir: str, work: str, steps: list[Step]) -> list[dict[str, Any]]:
    """Run ``steps`` in order through hf_to_mcore_rank / mcore_to_hf_rank; per step this rank's reports, the
    expert tensors it read from the HF files and the experts it owns."""
    from pathlib import Path

    from megatron.core import parallel_state

    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.models.moe import local_experts
    from megatron_rl.weights.convert_cli import _parser, hf_to_mcore_rank, mcore_to_hf_rank

    reads = _record_expert_reads()
    moe = load_hf_config(hf_dir).moe
    results = []
    for command, source, out, tp, pp, ep, etp in steps:
        src = hf_dir if source == "hf" else str(Path(work) / source)
        argv = [command, "--hf-dir" if command == "hf-to-mcore" else "--mcore-dir", src,
                "--out", str(Path(work) / out), "--tp", str(tp), "--pp", str(pp), "--ep", str(ep)]
        argv += [] if etp is None else ["--etp", str(etp)]
        reads.clear()
        rank_fn = hf_to_mcore_rank if command == "hf-to-mcore" else mcore_to_hf_rank
        reports = rank_fn(_parser().parse_args(argv))
        owned = local_experts(moe, ep, parallel_state.get_expert_model_parallel_rank())
        results.append({"reports": reports, "reads": sorted(set(reads)), "owned": list(owned)})
    return results


def trainer_checkpoint_job(hf_dir: str, other_hf_dir: str, ckpt: str, work: str) -> dict[str, Any]:
    """An actor at EP=2 takes one PPO update and writes its checkpoint; actors built from ``other_hf_dir`` (other
    weights) load it with the trainer's loader at EP=2 (weights and Adam state) and EP=1 (weights); then the
    converter turns the checkpoint into HF directories at EP=2 and EP=1."""
    import sys
    from dataclasses import replace
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers"))
    from workers_jobs import actor_config, dp_shard, make_actor, training_batch, update, weights

    from megatron_rl.distributed import init_model_parallel
    from megatron_rl.weights.convert_cli import _parser, mcore_to_hf_rank

    def actor_at(ep: int, model_dir: str):
        init_model_parallel(tp=1, pp=1, ep=ep)
        config = actor_config()
        return make_actor(model_dir, replace(config, megatron=replace(config.megatron, expert_model_parallel_size=ep)))

    trained = actor_at(2, hf_dir)
    update(trained, dp_shard(training_batch(seed=0)))
    trained.save_checkpoint(ckpt)
    out: dict[str, Any] = {"trained": weights(trained), "loaded": {}, "converted": {}}
    del trained
    for ep in (2, 1):
        resumed = actor_at(ep, other_hf_dir)
        # the Adam state resumes at any EP too (tests/workers/test_checkpoint_ep_reshard.py checks it per
        # expert); here the weights are what the converter is compared with
        resumed.load_checkpoint(ckpt, load_optimizer=True)
        out["loaded"][ep] = weights(resumed)
        del resumed
    for ep in (2, 1):
        hf_out = str(Path(work) / f"hf_from_trainer_ep{ep}")
        argv = ["mcore-to-hf", "--mcore-dir", ckpt, "--hf-config", hf_dir, "--out", hf_out, "--ep", str(ep)]
        out["converted"][ep] = (hf_out, mcore_to_hf_rank(_parser().parse_args(argv)))
    return out
