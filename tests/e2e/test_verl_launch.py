"""verl's Megatron GRPO example (examples/grpo_trainer/run_qwen2-7b_math_megatron.sh, verl main) run with only
the entry point changed: every key it sets, scaled down to the tiny CPU model; refused keys named."""
from __future__ import annotations

import pytest

from megatron_rl.compat.verl.trainer.main_ppo import translate
from megatron_rl.config import ConfigError
from megatron_rl.trainer.signals import EXIT_CONFIG_ERROR
from e2e_support import run_module, train_steps

pytestmark = pytest.mark.distributed


def verl_line(assets, out) -> list[str]:
    """The example's arguments in its order; values scaled down (model, files, sizes, 2 CPU ranks, the CPU
    rollout engine) where the 7B/8-GPU numbers cannot run here. The script's trailing $@ gets the step cap."""
    return [
        "--config-path=config", "--config-name=ppo_megatron_trainer.yaml",
        "algorithm.adv_estimator=grpo",
        f"data.train_files=['{assets['train']}']",
        f"data.val_files=['{assets['val']}']",
        "data.return_raw_chat=True",
        "data.train_batch_size=8",
        "data.max_prompt_length=16",
        "data.max_response_length=6",
        "data.filter_overlong_prompts=True",
        "data.truncation=error",
        f"actor_rollout_ref.model.path={assets['model']}",
        "actor_rollout_ref.model.use_fused_kernels=True",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.name=hf",  # verl's line: vllm (taken, see below; this CPU run uses the HF engine)
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.n=5",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=1",
        "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2",
        "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0",
        "trainer.logger=['console','jsonl']",  # verl's line: console, wandb (needs the wandb package and a login)
        "trainer.project_name=verl_grpo_example_gsm8k_math",
        "trainer.experiment_name=qwen2_7b_megatron",
        "trainer.n_gpus_per_node=2",
        "trainer.nnodes=1",
        "trainer.save_freq=20",
        "trainer.test_freq=5",
        "trainer.total_epochs=15",
        # $@
        f"trainer.default_local_dir={out}", "trainer.total_training_steps=1", "trainer.save_hf_at_end=false",
        "ray_init.num_cpus=4", "trainer.device=cpu",  # verl's default device is cuda, here under its entry too
    ]


def test_translation_drops_verl_only_keys_and_maps_the_mode():
    args = translate(["--config-path", "config", "--config-name=ppo_megatron_trainer", "data.return_raw_chat=True",
                      "actor_rollout_ref.rollout.mode=async", "trainer.critic_warmup=0", "data.seed=3"],
                     with_verl_defaults=False)
    assert args == ["actor_rollout_ref.rollout.mode=colocated", "data.seed=3"]
    # vLLM is a rollout engine here (issue 34; it was refused: "megatron-rl has no vLLM adapter"), with verl's keys
    assert translate(["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=False",
                      "+actor_rollout_ref.rollout.engine_kwargs.vllm.block_size=16"], with_verl_defaults=False) == [
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=False",
        "++actor_rollout_ref.rollout.engine_kwargs.vllm.block_size=16"]
    with pytest.raises(ConfigError, match="trainer.critic_warmup=5"):
        translate(["trainer.critic_warmup=5"])
    with pytest.raises(ConfigError, match="--config-name=ppo_trainer_fsdp"):
        translate(["--config-name=ppo_trainer_fsdp"])


def test_verl_launch_line_runs(tiny_assets, tmp_path):
    proc = run_module(["megatron_rl.compat.verl.trainer.main_ppo", *verl_line(tiny_assets, tmp_path)], timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = train_steps(next(tmp_path.rglob("metrics.jsonl")))
    assert sorted(steps) == [0, 1]  # step 0: verl's val_before_train=True (its default, applied by the entry)
    assert any(k.startswith("val-core/") for k in steps[0])
    assert "actor/kl_loss" in steps[1] and "actor/pg_loss" in steps[1]


@pytest.mark.parametrize("replace, named, code", [
    ("actor_rollout_ref.actor.optim.lr_decay_style=cosine", "actor_rollout_ref.actor.optim.lr_decay_style=cosine",
     EXIT_CONFIG_ERROR),
    # a key the schema lacks: Hydra's own refusal (exit 1), naming the key, before anything starts
    ("actor_rollout_ref.actor.use_torch_compile_nonexistent=True", "use_torch_compile_nonexistent", 1),
])
def test_a_key_megatron_rl_cannot_honour_is_refused_before_launch(tiny_assets, tmp_path, replace, named, code):
    args = verl_line(tiny_assets, tmp_path)
    key = replace.split("=")[0]
    args = [a for a in args if not a.startswith(key + "=")] + [replace]
    proc = run_module(["megatron_rl.compat.verl.trainer.main_ppo", *args], timeout=300)
    assert proc.returncode == code, proc.stderr[-3000:]
    assert named in proc.stderr
    assert not list(tmp_path.rglob("metrics.jsonl"))


def test_verls_vllm_line_reaches_preflight_and_the_tiny_models_head_size_is_refused(tiny_assets, tmp_path):
    """rollout.name=vllm is taken (issue 34) and checked before launch: on CPU the tiny model's head size 16 is
    one vLLM's CPU attention refuses, named before Ray or an engine starts."""
    from megatron_rl.rollout.vllm.contract import vllm_missing

    if vllm_missing() is not None:
        pytest.skip(f"vLLM: {vllm_missing()}")
    args = [a for a in verl_line(tiny_assets, tmp_path) if not a.startswith("actor_rollout_ref.rollout.name=")]
    proc = run_module(["megatron_rl.compat.verl.trainer.main_ppo", *args, "actor_rollout_ref.rollout.name=vllm",
                       "trainer.device=cpu"], timeout=300)
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stderr[-3000:]
    assert "rollout.name=vllm on CPU" in proc.stderr and "head size 16" in proc.stderr
    assert not list(tmp_path.rglob("metrics.jsonl"))
