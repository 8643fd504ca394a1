"""verl's CPU Adam (``+<role>.optim.override_optimizer_config.*``, docs/workers.md 'CPU Adam'): the keys map onto
megatron-rl's ``optim.override_optimizer_config`` and reach Megatron-Core's ``OptimizerConfig`` (a real one-rank
MegatronEngine on gloo); bad entries are refused before launch naming the key; the planner's optimizer row holds
only the GPU's share of Adam's state.

Megatron-Core 0.16.1's ``HybridDeviceOptimizer`` (what ``optimizer_cpu_offload=True`` builds) cannot run on a CPU
machine, so no step is trained with it here and its refusal on CPU is tested instead: its constructor takes
``torch.cuda.current_stream()`` (cpu_offloading/hybrid_optimizer.py, ``_init_sub_optimizers``), which a CPU torch
answers with "Torch not compiled with CUDA enabled"; and it offloads only CUDA parameters (``param.is_cuda`` in
``_get_sub_optimizer_param_groups``) and looks each host copy's CUDA original up in ``_set_sub_optimizer_grads``, so
parameters already on the CPU would not be stepped at all. A CPU run keeps Adam's state in host memory and steps it
on the CPU anyway.
"""
from __future__ import annotations

import pytest
import torch
from cpu_adam_jobs import optimizer_job
from test_lora_plan import TINY, plan_for

from megatron_rl.compat.verl.trainer import main_ppo
from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.optimizer_overrides import HostAdam, optimizer_config_fields
from megatron_rl.distributed.spawn import run_multiprocess
from megatron_rl.plan.validate import validate

KEY = "actor_rollout_ref.actor.optim.override_optimizer_config"
GPU = ["trainer.device=cuda", "actor_rollout_ref.actor.megatron.use_distributed_optimizer=true"]
# verl's fully async 30B shells (tests/compat/verl_scripts/experimental/grpo_30b_a3b_base_math_megatron_96_32.args)
VERL_CPU_ADAM = [f"+{KEY}.optimizer_offload_fraction=1.", f"+{KEY}.overlap_cpu_optimizer_d2h_h2d=True",
                 f"+{KEY}.use_precision_aware_optimizer=True", f"+{KEY}.optimizer_cpu_offload=True"]


def test_megatrons_hybrid_optimizer_cannot_run_on_cpu():
    """Why a CPU run refuses optimizer_cpu_offload (module docstring); if a later Megatron-Core or torch runs it,
    this fails and the refusal should become a step compared with the plain optimizer's."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        HybridDeviceOptimizer([torch.nn.Parameter(torch.zeros(4))], offload_fraction=1.0,
                              cpu_optimizer_cls=torch.optim.AdamW, gpu_optimizer_cls=torch.optim.AdamW, lr=1e-3)


def test_the_fields_passed_are_megatrons():
    from megatron_rl.config.optimizer_overrides import NOT_PASSED, OWNED_FIELDS, PASSED_FIELDS

    fields = optimizer_config_fields()
    for name in (*OWNED_FIELDS, *PASSED_FIELDS, *NOT_PASSED):
        assert name in fields, name


def test_verls_keys_map_and_pass_validation_on_a_gpu_run():
    out = main_ppo.translate(["data.train_files=/d.parquet", *VERL_CPU_ADAM])
    for arg in VERL_CPU_ADAM:
        assert "+" + arg in out  # ++: set or add
    cfg = load_config(overrides=[*TINY, *GPU, *VERL_CPU_ADAM])
    validate(cfg)
    assert dict(cfg.actor_rollout_ref.actor.optim.override_optimizer_config) == {
        "optimizer_offload_fraction": 1.0, "overlap_cpu_optimizer_d2h_h2d": True,
        "use_precision_aware_optimizer": True, "optimizer_cpu_offload": True}


@pytest.mark.parametrize("args, message", [
    ([f"+{KEY}.optimizer_offload_fractoin=1"],
     rf"{KEY}.optimizer_offload_fractoin is not a Megatron-Core OptimizerConfig field \(did you mean "
     r"optimizer_offload_fraction\?\)"),
    ([f"+{KEY}.lr=0.1"], rf"{KEY}.lr is set by megatron-rl: use optim.lr"),
    ([f"+{KEY}.adam_beta1=0.5"], rf"{KEY}.adam_beta1 is set by megatron-rl: use optim.betas\[0\]"),
    ([f"+{KEY}.bf16=true"], rf"{KEY}.bf16 is set by megatron-rl: use megatron.params_dtype"),
    ([f"+{KEY}.use_distributed_optimizer=true"],
     rf"{KEY}.use_distributed_optimizer is set by megatron-rl: use megatron.use_distributed_optimizer"),
    ([f"+{KEY}.exp_avg_dtype=bf16"], rf"{KEY}.exp_avg_dtype is not passed to Megatron here: optimizer state below"),
    ([f"+{KEY}.optimizer_cpu_offload=true", f"+{KEY}.optimizer_offload_fraction=1.5"],
     rf"{KEY}.optimizer_offload_fraction=1.5 must be a number in \[0, 1\]"),
    ([f"+{KEY}.optimizer_cpu_offload=true", f"+{KEY}.optimizer_offload_fraction=-0.1"],
     rf"{KEY}.optimizer_offload_fraction=-0.1 must be a number in \[0, 1\]"),
    ([f"+{KEY}.optimizer_cpu_offload=1"], rf"{KEY}.optimizer_cpu_offload=1 must be true or false"),
    ([f"+{KEY}.optimizer_offload_fraction=0.5"],
     rf"{KEY}.optimizer_offload_fraction=0.5 has no effect without {KEY}.optimizer_cpu_offload=true"),
])
def test_bad_entries_are_refused_before_launch_naming_the_key(args, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(overrides=[*TINY, *GPU, *args]))


def test_what_cannot_run_is_refused_where_it_cannot():
    """On CPU (trainer.device=cpu) the hybrid optimizer and its CUDA-stream overlap cannot run; the precision-aware
    optimizer needs the distributed one, which a CPU run does not have."""
    cpu = [*TINY, "trainer.device=cpu"]
    with pytest.raises(ConfigError, match=rf"{KEY}.optimizer_cpu_offload=true cannot run on CPU \(trainer.device=cpu"
                                          r".*: Megatron's HybridDeviceOptimizer takes CUDA streams.*drop "
                                          rf"{KEY}.\{{optimizer_cpu_offload, optimizer_offload_fraction, "
                                          r"overlap_cpu_optimizer_d2h_h2d, use_precision_aware_optimizer\}"):
        validate(load_config(overrides=[*cpu, *VERL_CPU_ADAM]))
    with pytest.raises(ConfigError, match=rf"{KEY}.use_precision_aware_optimizer=true needs actor_rollout_ref.actor."
                                          r"megatron.use_distributed_optimizer=true.*a CPU run does not have"):
        validate(load_config(overrides=[*cpu, f"+{KEY}.use_precision_aware_optimizer=true"]))
    with pytest.raises(ConfigError, match=r"use_precision_aware_optimizer=true needs actor_rollout_ref.actor.megatron."
                                          r"use_distributed_optimizer=true \(Megatron-Core asserts it"):
        validate(load_config(overrides=[*TINY, "trainer.device=cuda", f"+{KEY}.use_precision_aware_optimizer=true"]))
    validate(load_config(overrides=[*cpu, f"+{KEY}.adam_eps=1e-6"]))  # a field that runs anywhere


def _optimizer_row(plan) -> tuple[str, float]:
    (row,) = [r for r in plan.rows if r.label.startswith("actor optimizer")]
    return row.label, row.per_phase["actor update"]


def test_the_planner_row_shrinks_by_the_fraction():
    label, full = _optimizer_row(plan_for(*TINY, *GPU))
    assert label == "actor optimizer (Adam, /1 shards)" and full > 0
    # precision-aware: master weights, m and v (12 B of bf16 training's) all offloaded by the fraction
    for fraction, share in ((1.0, "100%"), (0.25, "25%")):
        label, gpu = _optimizer_row(plan_for(*TINY, *GPU, f"+{KEY}.optimizer_cpu_offload=true",
                                             f"+{KEY}.optimizer_offload_fraction={fraction}",
                                             f"+{KEY}.use_precision_aware_optimizer=true"))
        assert label == f"actor optimizer (Adam, /1 shards; CPU Adam: {share} in host memory)"
        assert gpu == pytest.approx(full * (1 - fraction))
    # without it the fp32 master shard (4 of the 12 B) stays on the GPU; m and v (8 B) move by the fraction
    label, gpu = _optimizer_row(plan_for(*TINY, *GPU, f"+{KEY}.optimizer_cpu_offload=true",
                                         f"+{KEY}.optimizer_offload_fraction=0.5"))
    assert label == "actor optimizer (Adam, /1 shards; CPU Adam: 50% of m, v in host memory, fp32 master weights here)"
    assert gpu == pytest.approx(full * (4 + 8 * 0.5) / 12)
    assert HostAdam(0.5, False).gpu_bytes(12.0, 4.0) == 8.0 and HostAdam(0.5, True).gpu_bytes(12.0, 4.0) == 6.0


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    model = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("cpu_adam") / "qwen2", "qwen2", with_tokenizer=False)
    (out,) = run_multiprocess(optimizer_job, 1, str(model), timeout_s=300)
    return out


def test_the_entries_reach_megatrons_optimizer_config(engines):
    plain, passed = engines["plain"], engines["passed"]
    # optim.* build the config; the entries are set on the same OptimizerConfig and reach torch's Adam
    assert (plain["lr"], plain["adam_beta1"], passed["lr"], passed["adam_beta1"]) == (1e-3, 0.8, 1e-3, 0.8)
    assert (plain["adam_eps"], plain["eps"], plain["log_num_zeros_in_grad"]) == (1e-8, [1e-8], False)
    assert (passed["adam_eps"], passed["eps"], passed["log_num_zeros_in_grad"]) == (1e-6, [1e-6], True)
    assert plain["optimizer_cpu_offload"] is False and passed["adam"] == plain["adam"] == "AdamW"


def test_the_engine_refuses_cpu_adam_on_cpu_and_owned_fields(engines):
    assert engines["cpu_adam"].startswith(f"{KEY}.optimizer_cpu_offload=true cannot run on CPU"), engines["cpu_adam"]
    assert engines["owned"] == f"{KEY}.adam_beta1 is set by megatron-rl: use optim.betas[0]"
