import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.plan.validate import validate

# A valid small set-up: 2 nodes x 4 ranks, actor TP=2 -> DP=4.
BASE = [
    "trainer.nnodes=2",
    "trainer.n_gpus_per_node=4",
    "data.train_batch_size=64",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
]


def cfg_with(*overrides: str):
    return load_config(overrides=[*BASE, *overrides])


def test_derived_sizes():
    sizes = validate(cfg_with())
    assert sizes.world_size == 8
    assert sizes.responses_per_step == 256
    assert sizes.actor.data_parallel_size == 4
    assert sizes.actor.mini_batch_responses == 64
    assert sizes.actor.mini_batches_per_epoch == 4
    assert sizes.actor.mini_batch_responses_per_dp_rank == 16
    assert sizes.actor.grad_accumulation_steps == 8
    assert sizes.critic is None and not sizes.uses_critic
    assert "DP=4" in sizes.summary() and "256 responses per step" in sizes.summary()


def test_gae_turns_the_critic_on():
    sizes = validate(cfg_with("algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=4"))
    assert sizes.uses_critic and sizes.critic.grad_accumulation_steps == 4


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor_rollout_ref.actor.ppo_mini_batch_size=48"], r"ppo_mini_batch_size=48 prompts x rollout.n=4 = 192"),
        (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32"], r"ppo_micro_batch_size_per_gpu=32 is larger than the 16"),
        (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"], r"=3 does not divide the 16"),
        (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=0"], r"must be a positive integer, got 0"),
        # refused only by the workers' init_model before (issue 56 item 6)
        (["actor_rollout_ref.ref.megatron.share_prompts=true", "actor_rollout_ref.ref.megatron.packed_sequences=true"],
         r"actor_rollout_ref.ref.megatron.share_prompts=true and actor_rollout_ref.ref.megatron.packed_sequences=true "
         r"cannot both be on"),
        (["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=3"], r"TP\*PP\*CP = 2\*3\*1 = 6 does not divide the world size 8"),
        (["algorithm.adv_estimator=magic"], r"adv_estimator='magic' is unknown; known: \[.*'grpo'"),
        (["actor_rollout_ref.actor.policy_loss=magic"], r"policy_loss='magic' is unknown"),
        (["actor_rollout_ref.rollout.name=trtllm"], r"rollout.name='trtllm' is unknown; known: \['hf', 'sglang', 'vllm'\]"),
        (["actor_rollout_ref.actor.loss_agg_mode=sum"], r"loss_agg_mode='sum' is unknown"),
        (["algorithm.kl_penalty=k9"], r"kl_penalty='k9' is unknown"),
        (["actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_mini_batch_size=16"], r"needs actor_rollout_ref.rollout.n > 1"),
        (["algorithm.use_kl_in_reward=true", "actor_rollout_ref.actor.use_kl_loss=true"], r"counted twice"),
        (["algorithm.adv_estimator=gae", "critic.enable=false"], r"needs values, but critic.enable=false"),
        (["actor_rollout_ref.rollout.tensor_model_parallel_size=3"], r"rollout.tensor_model_parallel_size=3 does not divide"),
        (["actor_rollout_ref.rollout.tensor_model_parallel_size=2"], r"rollout.name=hf runs one model per process"),
        (["actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.tensor_model_parallel_size=8",
          "trainer.nnodes=2", "trainer.n_gpus_per_node=4"], r"does not divide trainer.n_gpus_per_node=4: a colocated engine cannot span two nodes"),
        (["actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2"], r"needs pipeline_model_parallel_size > 1"),
        (["algorithm.gamma=1.5"], r"gamma=1.5"),
        (["reward.reward_manager=gdpo"], r"reward.reward_manager='gdpo' is unknown"),
        (["reward.reward_manager=batch"], r"needs reward.custom_reward_function.path"),
        (["reward.timeout_s=0"], r"reward.timeout_s must be > 0"),
        (["data.truncation=center"], r"data.truncation='center' is unknown"),
        (["actor_rollout_ref.rollout.mode=server"], r"needs actor_rollout_ref.rollout.server_urls"),
        (["actor_rollout_ref.rollout.name=sglang", "trainer.device=cpu"], r"sglang needs CUDA"),
        (["ray_init.address=10.0.0.1:6379", "ray_init.num_cpus=4"], r"unset one"),
        (["algorithm.adv_estimator=gae", "critic.megatron.tensor_model_parallel_size=1"],
         r"critic.megatron.tensor_model_parallel_size=1 differs"),
        (["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.ref.megatron.context_parallel_size=2"],
         r"ref.megatron.context_parallel_size=2 differs"),
    ],
)
def test_rejections_name_key_and_numbers(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg_with(*overrides))


def test_typo_in_key_is_rejected_at_compose_time():
    with pytest.raises(ConfigError, match="actor_rollout_ref.rollout.nn"):
        load_config(overrides=["actor_rollout_ref.rollout.nn=3"])
    with pytest.raises(ConfigError, match="train_batch_size"):
        load_config(overrides=["data.train_batch_size=lots"])


@pytest.mark.parametrize("overrides, message", [
    (["async_training.staleness_threshold=0.5"],
     r"^async_training.staleness_threshold is a key of verl's async recipes.*async_training.max_staleness"),
    (["async_training.trigger_parameter_sync_step=4", "async_training.require_batches=1"],
     r"^async_training.trigger_parameter_sync_step is a key.*= data.train_batch_size.*; "
     r"async_training.require_batches is a key"),
    (["async_training.use_rollout_log_probs=true"], r"algorithm.rollout_correction.bypass_mode=true"),
    (["async_training.compute_prox_log_prob=true"], r"policy_loss=decoupled_ppo"),
    (["async_training.checkpoint_engine.enable=true"], r"weight_sync.bucket_size_mb"),
    (["rollout.nnodes=1", "rollout.n_gpus_per_node=8"],
     r"^rollout.nnodes, rollout.n_gpus_per_node are keys of verl's async recipes.*rollout.num_servers"),
    (["data.gen_batch_size=1"], r"whole loader batches"),
])
def test_verl_async_recipe_keys_say_where_they_live_here(overrides, message):
    """A user of verl's one_step_off / fully_async recipes passes their keys: each error says what says the same
    here, at compose time (key=value) and at validation (+key=value, which slips past OmegaConf)."""
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)
    first = overrides[0].split("=")[0]
    with pytest.raises(ConfigError, match=rf"{first.split('.')[0]}.* is not a known key \(.*verl's async recipes"):
        validate(load_config(overrides=["+" + o for o in overrides]))
