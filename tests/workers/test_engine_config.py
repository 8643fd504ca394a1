"""Every key the planner reads reaches the object it describes (issue 14): a MegatronEngine built at
TP=2 on gloo for each planner-affecting key, and what its TransformerConfig / optimizer / HF config
hold. Numbers that the setting must not change (sequence parallelism, recompute) are compared with
the baseline engine on the same weights and batch (fp32: log-probs 1e-5, loss and grad norm 1e-4)."""

from __future__ import annotations

import pytest
import torch
from engine_config_jobs import engine_config_job

from megatron_rl.distributed import run_multiprocess

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    model = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("engine_config") / "qwen2", "qwen2",
                                    with_tokenizer=False)
    return run_multiprocess(engine_config_job, 2, str(model), timeout_s=500)


def section(results, name: str, rank: int = 0) -> dict:
    out = results[rank]
    assert f"{name}/crash" not in out, out[f"{name}/crash"]
    return {key.split("/", 1)[1]: value for key, value in out.items() if key.startswith(f"{name}/")}


def test_sequence_parallel_reaches_the_model_and_keeps_the_numbers(results):
    for rank in range(2):
        assert section(results, "baseline", rank)["facts"]["sequence_parallel"] is False
        facts = section(results, "sp", rank)["facts"]
        assert facts["sequence_parallel"] is True and facts["tensor_model_parallel_size"] == 2
    base, sp = section(results, "baseline"), section(results, "sp")
    torch.testing.assert_close(sp["log_probs"], base["log_probs"], atol=1e-5, rtol=0)
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert sp["metrics"][key] == pytest.approx(base["metrics"][key], rel=1e-4)


def test_override_transformer_config_reaches_the_transformer_config(results):
    assert section(results, "baseline")["facts"]["recompute_granularity"] is None
    full = section(results, "full")
    facts = full["facts"]
    assert (facts["recompute_granularity"], facts["recompute_method"], facts["recompute_num_layers"]) == (
        "full", "uniform", 1)
    other = section(results, "recompute")
    block = other["block"]
    assert (block["recompute_granularity"], block["recompute_method"], block["recompute_num_layers"]) == (
        "full", "block", 2)
    assert other["selective"]["recompute_granularity"] == "selective"
    assert other["selective"]["recompute_modules"] == ["core_attn", "mlp"]
    # Full recompute changes memory, not the gradient.
    base = section(results, "baseline")
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert full["metrics"][key] == pytest.approx(base["metrics"][key], rel=1e-4)


def test_unknown_or_derived_transformer_config_fields_are_refused_by_name(results):
    refused = section(results, "refused")
    assert "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granulrity" in refused["typo"]
    assert "nearest: recompute_granularity" in refused["typo"]
    # a field set from config.json: another value is refused (the same one, as verl's scripts repeat, is accepted)
    assert "override_transformer_config.num_layers=4 contradicts" in refused["derived"]
    assert "override_config" in refused["derived"]


def test_model_override_config_reaches_the_megatron_model(results):
    base, over = section(results, "baseline"), section(results, "override_config")
    assert base["facts"]["layernorm_epsilon"] != pytest.approx(1e-3)
    assert over["facts"]["layernorm_epsilon"] == pytest.approx(1e-3)
    assert over["hf_eps"] == pytest.approx(1e-3)
    # The model really computes with it: the log-probs move.
    assert (over["log_probs"] - base["log_probs"]).abs().max() > 1e-6


def test_distributed_optimizer_is_built_or_refused_with_the_reason(results):
    from megatron_rl.models.capabilities import distributed_optimizer_blocker

    optim = section(results, "optim")
    if distributed_optimizer_blocker() is None:
        assert optim["facts"]["use_distributed_optimizer"] is True
        assert optim["built"] == "DistributedOptimizer"
    else:
        assert "built" not in optim, "use_distributed_optimizer=true was dropped instead of refused"
        assert "actor_rollout_ref.actor.megatron.use_distributed_optimizer=true needs Transformer Engine" in (
            optim["error"])
        assert "use_distributed_optimizer=false" in optim["error"]
    config = optim["plain_config"]
    assert config["use_distributed_optimizer"] is False
    assert (config["lr"], config["weight_decay"], config["clip_grad"]) == (1e-2, 0.0, 1.0)


def test_params_dtype_reaches_the_transformer_config(results):
    assert section(results, "baseline")["facts"]["params_dtype"] == torch.float32  # auto on CPU
    bf16 = section(results, "bf16")
    assert bf16["facts"]["params_dtype"] == torch.bfloat16
    assert bf16["param_dtype"] == torch.bfloat16


def test_offload_flags_reach_the_engine(results):
    offload = section(results, "offload")
    for key, kind in (("param_offload", "params"), ("optimizer_offload", "optimizer")):
        assert offload[key] == {"params": kind == "params", "optimizer": kind == "optimizer"}
