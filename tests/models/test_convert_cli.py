"""megatron-rl-convert: HF -> Megatron dist checkpoint at TP=2 -> HF at PP=2, verified and exact."""

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.weights.convert_cli import main
from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in directory.glob("*.safetensors"):
        out.update(load_file(file))
    return out


def reported_diff(output: str) -> float:
    match = re.search(r"verify: max \|logit diff\| = (\S+) \(ok", output)
    assert match, output
    return float(match.group(1))


@pytest.mark.distributed
@pytest.mark.slow  # two CLI runs, each starting two ranks
def test_round_trip_through_megatron_checkpoint(tmp_path, capsys):
    hf_dir = make_tiny_hf_checkpoint(tmp_path / "hf", "llama", tie_word_embeddings=True)
    mcore_dir, back_dir = tmp_path / "mcore", tmp_path / "back"

    assert (
        main(["hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(mcore_dir), "--tp", "2", "--verify"]) == 0
    )
    assert reported_diff(capsys.readouterr().out) <= 1e-4
    assert (mcore_dir / "weights" / "metadata.json").is_file()
    assert (mcore_dir / "config.json").is_file() and (mcore_dir / "tokenizer.json").is_file()

    # The way back is checked tensor by tensor (stronger than logits), so it skips --verify.
    assert main(["mcore-to-hf", "--mcore-dir", str(mcore_dir), "--out", str(back_dir), "--pp", "2"]) == 0
    assert f"wrote {back_dir}" in capsys.readouterr().out
    original, converted = tensors(hf_dir), tensors(back_dir)
    assert converted.keys() == original.keys()
    assert all(torch.equal(converted[name], tensor) for name, tensor in original.items())
    assert (back_dir / "tokenizer.json").is_file()


def test_sizes_that_do_not_fit_fail_before_any_process_starts(tmp_path):
    hf_dir = make_tiny_hf_checkpoint(tmp_path / "hf", "qwen2", with_tokenizer=False)
    with pytest.raises(SystemExit, match="num_attention_heads=4 is not divisible by TP=3"):
        main(["hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "o"), "--tp", "3"])
    with pytest.raises(SystemExit, match="missing is not a Megatron distributed checkpoint: expected"):
        main(["mcore-to-hf", "--mcore-dir", str(tmp_path / "missing"), "--out", str(tmp_path / "o")])


@pytest.mark.distributed
def test_verify_puts_every_collective_tensor_on_the_backend_device(tmp_path):
    """--verify all-reduced a CPU tensor, which NCCL refuses on a GPU cluster. Under the CPU stand-in of
    NCCL's device rule (megatron_rl_testing.nccl_like) every collective of the verification gets
    tensors on the backend's device, and the check itself catches a CPU tensor."""
    from convert_jobs import verify_under_nccl_like_job

    from megatron_rl.distributed import run_multiprocess

    hf_dir = make_tiny_hf_checkpoint(tmp_path / "hf", "qwen2", with_tokenizer=False)
    (out,) = run_multiprocess(verify_under_nccl_like_job, 1, str(hf_dir), timeout_s=300)
    assert "torch.distributed.all_reduce: tensor of shape (1,)" in out["self_check"]
    assert out["device_tensor_ok"] == 1.0
    assert "error" not in out, out.get("error")
    assert out["diff"] <= 1e-4


def _save_trainer_checkpoint(hf_dir: str, path: str) -> None:
    """What the trainer writes at global_step_N/actor: model, optimizer, scheduler (one rank, TP 1)."""
    from megatron_rl.config.schema import ActorConfig
    from megatron_rl.distributed import init_model_parallel
    from megatron_rl.workers.checkpoint import save_checkpoint
    from megatron_rl.workers.engine import MegatronEngine

    actor = ActorConfig()
    init_model_parallel(tp=1, pp=1)
    save_checkpoint(MegatronEngine(hf_dir, actor.megatron, actor.optim), path)


@pytest.mark.distributed
def test_trainer_checkpoints_convert_with_the_models_hf_config(tmp_path, capsys):
    from megatron_rl.distributed.spawn import run_multiprocess

    hf_dir = make_tiny_hf_checkpoint(tmp_path / "hf", "qwen2")
    actor_dir = tmp_path / "run" / "global_step_3" / "actor"
    run_multiprocess(_save_trainer_checkpoint, 1, str(hf_dir), str(actor_dir), timeout_s=300)
    with pytest.raises(SystemExit, match=r"is a trainer checkpoint \(global_step_N/actor\).*--hf-config"):
        main(["mcore-to-hf", "--mcore-dir", str(actor_dir), "--out", str(tmp_path / "nope")])
    back = tmp_path / "back"
    assert main(["mcore-to-hf", "--mcore-dir", str(actor_dir), "--hf-config", str(hf_dir), "--out", str(back)]) == 0
    original, converted = tensors(hf_dir), tensors(back)
    assert converted.keys() == original.keys()
    assert all(torch.equal(converted[name], tensor) for name, tensor in original.items())
    with pytest.raises(SystemExit, match="not a Megatron distributed checkpoint: expected .*metadata.json"):
        main(["mcore-to-hf", "--mcore-dir", str(tmp_path / "run"), "--out", str(tmp_path / "nope2")])
