"""verl's async Megatron shells (verl-project/verl at 1dda039b9) through the compat entries of the module paths they
call: ``python3 -m megatron_rl.compat.verl.experimental.one_step_off_policy.main_ppo`` and ``python -m
megatron_rl.compat.verl.experimental.fully_async_policy.fully_async_main`` (docs/configuration.md, "verl's async
entries"). Arguments recorded as in test_verl_current_scripts.py (the shell run with a stub python3/python that
writes its argv, VERL_USE_UV=0, HOME=/HOME; tests/compat/verl_scripts/experimental/*.args, one argument a line):

- one_step_off_policy/shell/dapo_7b_math_megatron_4_12.sh: at its default NNODES=2 the rollout's 2 GPUs per node
  span two nodes, which vLLM servers cannot here (weights through /dev/shm of trainer rank 0's host): refused,
  saying so. Then its ``+actor_rollout_ref.model.override_config`` is refused (servers load model.path; the shell's
  own comment says to edit config.json, which the test's model has). Its layout on one node (trainer 4 GPUs,
  rollout 4 = 2 vLLM servers of TP 2) plans and fits (78.3 GiB).
- one_step_off_policy/shell/dapo_7b_math_megatron_colocate.sh calls verl.trainer.main_ppo (not the one-step-off
  entry): through that entry it plans colocated (67.7 GiB).
- fully_async_policy/shell/grpo_30b_a3b_base_math_megatron_96_32.sh (and _mis): verl's CPU Adam
  (optim.override_optimizer_config: optimizer_cpu_offload, optimizer_offload_fraction=1, overlap_cpu_optimizer_d2h_h2d,
  use_precision_aware_optimizer) maps onto the same keys, set on Megatron's OptimizerConfig as in verl
  (config/optimizer_overrides.py); use_fused_kernels=False and optim.lr_decay_steps with the constant decay style are
  accepted, no effect. Refused first by rollout.nnodes = 12 for vLLM servers, then, on one node, by its
  ``+actor_rollout_ref.model.override_config`` (servers load model.path). With that dropped every async key maps (the
  batch per sync, the staleness bound, the steps, the servers) and the plan fits (75.0 GiB) with Adam's state in host
  memory; without the CPU Adam keys it would not (85.6 GiB).
  The _mis variant's rollout_rs with bypass_mode=True (verl's async config) is refused by our validation.

Two real CPU runs, two steps each, every sync verified: the one-step-off entry on verl's launch line sized down
(one trainer rank, one HF-engine server; staleness 0 then 1), and the fully async shell itself through its entry,
every recorded argument kept but those scaled for a CPU machine (FULLY_ASYNC_SCALED: the tiny task and the demo's
tiny dense model, sizes, one rank, one HF-engine server, Transformer Engine's fusions and DeepEP off, jsonl) and those
a CPU run refuses (FULLY_ASYNC_DROPPED: verl's CPU Adam, model.override_config; the test asserts both refusals):
8 prompts x 16 responses per sync, 2 batches ahead, staleness 0 then 1.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron_rl.compat.verl.experimental import async_keys
from megatron_rl.compat.verl.experimental.fully_async_policy import fully_async_main
from megatron_rl.compat.verl.experimental.one_step_off_policy import main_ppo as one_step_off
from megatron_rl.compat.verl.trainer import main_ppo
from megatron_rl.config import ConfigError, load_config
from megatron_rl.plan import PlanError, build_plan
from megatron_rl.plan.validate import validate
from test_verl_current_scripts import QWEN3_30B_A3B

SHELLS = Path(__file__).with_name("verl_scripts") / "experimental"
QWEN2_5_MATH_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
                   "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "vocab_size": 152064,
                   # the shell: "modify the max_position_embeddings in config.json to 32768 after downloading"
                   "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                   "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": True}
MODELS = {"/HOME/verl/models/Qwen2.5-Math-7B": QWEN2_5_MATH_7B, "/HOME/verl/models/Qwen3-30B-A3B-Base": QWEN3_30B_A3B}
ONE_STEP_OFF = "dapo_7b_math_megatron_4_12"
COLOCATE = "dapo_7b_math_megatron_colocate"
FULLY_ASYNC = "grpo_30b_a3b_base_math_megatron_96_32"
FULLY_ASYNC_MIS = "grpo_30b_a3b_base_math_megatron_96_32_mis"
# the fully async shells' key that vLLM servers cannot honour (validation refuses it), dropped by the tests below
FULLY_ASYNC_REFUSED = ("+actor_rollout_ref.model.override_config.",)
# verl's CPU Adam in the fully async shells
CPU_ADAM = "+actor_rollout_ref.actor.optim.override_optimizer_config."


def test_the_recorded_shells_are_here():
    assert sorted(p.stem for p in SHELLS.glob("*.args")) == sorted([ONE_STEP_OFF, COLOCATE, FULLY_ASYNC,
                                                                   FULLY_ASYNC_MIS])


def shell_args(name: str, tmp_path: Path, set_: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> list[str]:
    """The recorded arguments, the model a config.json of its facts in tmp_path; ``set_`` replaces values as the
    shell's variables would, ``drop`` removes the arguments starting so."""
    args = (SHELLS / f"{name}.args").read_text().splitlines()
    path, facts = next((p, f) for p, f in MODELS.items() if any(p in a for a in args))
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps(facts))
    set_ = set_ or {}
    out = []
    for arg in args:
        key = arg.partition("=")[0]
        if drop and arg.startswith(drop):
            continue
        out.append(f"{key}={set_[key]}" if key in set_ else arg.replace(path, str(tmp_path / "model")))
    return out


def composed(translate, args: list[str]):
    cfg = load_config(overrides=translate(args))
    validate(cfg)
    return cfg


# ---------------------------------------------------------------------------------------------- one step off

ONE_NODE = {"trainer.nnodes": "1", "trainer.n_gpus_per_node": "4",
            "rollout.nnodes": "1", "rollout.n_gpus_per_node": "4"}


def test_one_step_off_shell_at_two_nodes_is_refused_for_vllm_servers_across_nodes(tmp_path):
    with pytest.raises(ConfigError, match=r"^rollout.nnodes=2: rollout.name=vllm servers here take their weights "
                                          r"through /dev/shm of trainer rank 0's host.*set rollout.nnodes=1"):
        one_step_off.translate(shell_args(ONE_STEP_OFF, tmp_path))


def test_one_step_off_shell_override_config_is_refused_for_servers(tmp_path):
    cfg = load_config(overrides=one_step_off.translate(shell_args(ONE_STEP_OFF, tmp_path, ONE_NODE)))
    with pytest.raises(ConfigError, match=r"override_config=.*vllm rollout servers never see it.*config.json"):
        validate(cfg)


def test_one_step_off_shell_on_one_node_composes_maps_and_plans(tmp_path):
    args = shell_args(ONE_STEP_OFF, tmp_path, ONE_NODE, drop=("+actor_rollout_ref.model.override_config.",))
    translation = one_step_off.translate_with_notes(args)
    cfg = composed(one_step_off.translate, args)
    assert cfg.async_training.mode == "one_step_off" and cfg.async_training.max_staleness == 1
    rollout = cfg.actor_rollout_ref.rollout
    assert (rollout.mode, rollout.name, rollout.num_servers, rollout.tensor_model_parallel_size) == ("server", "vllm",
                                                                                                      2, 2)
    assert rollout.servers_per_node is None  # one node
    assert cfg.algorithm.rollout_correction.bypass_mode  # verl's one-step-off config
    assert cfg.data.train_batch_size == 512 and cfg.trainer.n_gpus_per_node == 4
    notes = "\n".join(translation.notes)
    assert "verl key rollout.n_gpus_per_node=4 -> actor_rollout_ref.rollout.num_servers=2" in notes
    assert "verl key actor_rollout_ref.hybrid_engine=False -> (nothing)" in notes
    assert ("verl one_step_off entry sets actor_rollout_ref.rollout.mode=async -> actor_rollout_ref.rollout.mode=server"
            in notes)
    assert "verl one_step_off config algorithm.rollout_correction.bypass_mode=True" in notes
    text = build_plan(cfg).format()
    assert "2 vllm engines of TP 2" in text and "78.3 of 79.6 GiB per GPU: fits" in text, text


def test_the_colocate_shell_runs_through_verls_own_main_ppo_entry(tmp_path):
    """dapo_7b_math_megatron_colocate.sh calls `python3 -m verl.trainer.main_ppo --config-name=ppo_megatron_trainer`:
    colocated and synchronous, through the trainer entry; the one-step-off entry refuses its config name."""
    args = shell_args(COLOCATE, tmp_path)
    cfg = composed(main_ppo.translate, args)
    assert cfg.async_training.mode == "sync" and cfg.actor_rollout_ref.rollout.mode == "colocated"
    assert "67.7 of 79.6 GiB per GPU: fits" in build_plan(cfg).format()
    with pytest.raises(ConfigError, match=r"--config-name=ppo_megatron_trainer.yaml: .*one_step_off_ppo_megatron_"
                                          r"trainer.*megatron_rl.compat.verl.trainer.main_ppo"):
        one_step_off.translate(args)


@pytest.mark.parametrize("translate, name", [(one_step_off.translate, "one_step_off_ppo_megatron_trainer"),
                                             (one_step_off.translate, "'one_step_off_ppo_trainer.yaml'"),
                                             (fully_async_main.translate, "fully_async_ppo_megatron_trainer.yaml")])
def test_each_entry_takes_its_own_config_names(translate, name):
    out = translate(["--config-path=config", "--config-name", name, "rollout.total_rollout_steps=4096"])
    assert not [a for a in out if a.startswith("--config")]
    with pytest.raises(ConfigError, match="config-name"):
        (fully_async_main if translate is one_step_off.translate else one_step_off).translate([f"--config-name={name}"])
    with pytest.raises(ConfigError, match="config-name"):
        main_ppo.translate([f"--config-name={name}"])  # verl's core entry does not take the async configs


def test_the_entry_mode_and_placement_cannot_be_overridden():
    with pytest.raises(ConfigError, match=r"^async_training.mode=fully_async: this entry runs "
                                          r"async_training.mode=one_step_off"):
        one_step_off.translate(["async_training.mode=fully_async"])
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.hybrid_engine=True: verl's async trainers run the "
                                          r"rollout on GPUs of its own.*compat.verl.trainer.main_ppo"):
        one_step_off.translate(["actor_rollout_ref.hybrid_engine=True"])
    with pytest.raises(ConfigError, match=r"^rollout.n_gpus_per_node=8: the run does not start rollout.name=sglang "
                                          r"servers here.*server_urls"):
        one_step_off.translate(["actor_rollout_ref.rollout.name=sglang"])  # verl's default: 8 rollout GPUs
    with pytest.raises(ConfigError, match=r"^rollout.n_gpus_per_node=3 is not a multiple of "
                                          r"actor_rollout_ref.rollout.tensor_model_parallel_size=2"):
        one_step_off.translate(["actor_rollout_ref.rollout.name=vllm", "rollout.n_gpus_per_node=3"])


def test_hf_servers_over_nodes_get_servers_per_node():
    out = one_step_off.translate(["actor_rollout_ref.rollout.name=hf", "rollout.nnodes=2", "rollout.n_gpus_per_node=3"])
    assert out[-2:] == ["actor_rollout_ref.rollout.num_servers=6", "actor_rollout_ref.rollout.servers_per_node=3"]


# ---------------------------------------------------------------------------------------------- fully async

def test_fully_async_shells_take_verls_cpu_adam_and_are_refused_for_vllm_servers(tmp_path):
    """verl's CPU Adam keys (override_optimizer_config, refused before) map onto megatron-rl's same keys;
    use_fused_kernels=False (verl's default) and optim.lr_decay_steps with lr_decay_style=constant do nothing here
    and are accepted. The shells stop at rollout.nnodes=12 (vLLM servers on one node here), then, on one node, at
    model.override_config, which servers never see."""
    for name in (FULLY_ASYNC, FULLY_ASYNC_MIS):
        with pytest.raises(ConfigError, match=r"^rollout.nnodes=12: rollout.name=vllm servers here"):
            fully_async_main.translate(shell_args(name, tmp_path))
    args = shell_args(FULLY_ASYNC, tmp_path, {"rollout.nnodes": "1"})
    translation = fully_async_main.translate_with_notes(args)
    notes = "\n".join(translation.notes)
    assert "actor_rollout_ref.model.use_fused_kernels=False accepted, no effect" in notes, notes
    assert "actor_rollout_ref.actor.optim.lr_decay_steps=204800 accepted, no effect" in notes, notes
    optim = "actor_rollout_ref.actor.optim.override_optimizer_config"
    for name, value in (("optimizer_offload_fraction", "1."), ("overlap_cpu_optimizer_d2h_h2d", "True"),
                        ("use_precision_aware_optimizer", "True"), ("optimizer_cpu_offload", "True")):
        assert f"verl key {optim}.{name}={value} -> ++{optim}.{name}={value}: Megatron-Core OptimizerConfig" in notes
        assert f"++{optim}.{name}={value}" in translation.overrides
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.model.override_config=.*vllm rollout servers never "
                                          r"see it"):
        composed(fully_async_main.translate, args)


def test_fully_async_shell_maps_every_async_key_and_plans(tmp_path):
    args = shell_args(FULLY_ASYNC, tmp_path, {"rollout.nnodes": "1"}, drop=FULLY_ASYNC_REFUSED)
    translation = fully_async_main.translate_with_notes(args)
    cfg = composed(fully_async_main.translate, args)
    run = cfg.async_training
    assert (run.mode, run.partial_rollout) == ("fully_async", True)
    # staleness_threshold=0.5: up to 1.5 syncs' worth of prompts ahead in verl -> 2 whole batches, 2 versions
    assert (run.buffer_batches, run.max_staleness) == (2, 2)
    # ppo_mini_batch_size 128 x require_batches 1 x trigger_parameter_sync_step 4 = 512 prompts per sync
    assert cfg.data.train_batch_size == 512
    assert cfg.trainer.total_training_steps == 204800 // 512
    rollout = cfg.actor_rollout_ref.rollout
    assert (rollout.mode, rollout.num_servers, rollout.tensor_model_parallel_size) == ("server", 2, 4)
    assert cfg.algorithm.rollout_correction.bypass_mode
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (4, 8)
    notes = "\n".join(translation.notes)
    for line in ("verl key async_training.staleness_threshold=0.5 -> async_training.buffer_batches=2 "
                 "async_training.max_staleness=2: verl lets the rollouter run up to 1 + threshold syncs' worth",
                 "verl key data.train_batch_size=0 -> data.train_batch_size=512",
                 "verl key rollout.total_rollout_steps=204800 -> trainer.total_training_steps=400",
                 "verl key rollout.n_gpus_per_node=8 -> actor_rollout_ref.rollout.num_servers=2",
                 "verl key async_training.trigger_parameter_sync_step=4 -> (nothing)",
                 "verl key actor_rollout_ref.rollout.mode=async -> actor_rollout_ref.rollout.mode=server"):
        assert line in notes, notes
    # verl's CPU Adam: Adam's state (master weights, m, v: use_precision_aware_optimizer) all in host memory
    assert dict(cfg.actor_rollout_ref.actor.optim.override_optimizer_config) == {
        "optimizer_offload_fraction": 1.0, "overlap_cpu_optimizer_d2h_h2d": True,
        "use_precision_aware_optimizer": True, "optimizer_cpu_offload": True}
    plan = build_plan(cfg).format()
    assert "75.0 of 79.6 GiB per GPU: fits" in plan, plan
    row = next(line for line in plan.splitlines() if "actor optimizer" in line)
    assert "(Adam, /16 shards, experts /4; CPU Adam: 100% in host memory)" in row and row.split()[-2:] == [
        "0.0", "0.0"], row
    # without it Adam's state would be on the GPUs (sharded) and the step would not fit
    without = composed(fully_async_main.translate, shell_args(FULLY_ASYNC, tmp_path, {"rollout.nnodes": "1"},
                                                              drop=FULLY_ASYNC_REFUSED + (CPU_ADAM,)))
    with pytest.raises(PlanError) as err:
        build_plan(without)
    assert "85.6 of 79.6 GiB per GPU: DOES NOT FIT" in str(err.value)
    assert "recompute_granularity=full" in str(err.value)


def test_fully_async_mis_shell_bypass_with_rollout_rs_is_refused(tmp_path):
    args = shell_args(FULLY_ASYNC_MIS, tmp_path, {"rollout.nnodes": "1"}, drop=FULLY_ASYNC_REFUSED)
    cfg = load_config(overrides=fully_async_main.translate(args))
    assert cfg.algorithm.rollout_correction.rollout_rs == "seq_mean_k1" and cfg.algorithm.rollout_correction.bypass_mode
    with pytest.raises(ConfigError, match=r"bypass_mode=true with rollout_is/rollout_rs set"):
        validate(cfg)


def test_fully_async_defaults_are_verls_config_file():
    """Unset, the entry's keys take verl's fully_async_ppo_megatron_trainer.yaml values: threshold 0.1 -> 2 batches
    ahead, 256 x 1 x 4 = 1024 prompts per sync, and its total_rollout_steps=100 is fewer: refused as verl would
    train 0 steps."""
    with pytest.raises(ConfigError, match=r"^rollout.total_rollout_steps=100: fewer prompts than one sync's 1024"):
        fully_async_main.translate([])
    out = fully_async_main.translate(["rollout.total_rollout_steps=4096", "actor_rollout_ref.rollout.name=hf"])
    cfg = load_config(overrides=out)
    assert (cfg.async_training.mode, cfg.async_training.buffer_batches, cfg.async_training.max_staleness) == (
        "fully_async", 2, 2)
    assert (cfg.data.train_batch_size, cfg.trainer.total_training_steps) == (1024, 4)
    assert cfg.actor_rollout_ref.rollout.num_servers == 8  # rollout.n_gpus_per_node 8, the HF engine has no TP


@pytest.mark.parametrize("arg, message", [
    ("data.train_batch_size=64", r"requires data.train_batch_size=0 .*= 1024 prompts per sync"),
    ("data.gen_batch_size=4", r"requires data.gen_batch_size=1"),
    ("async_training.staleness_threshold=-1", r"must be >= 0"),
    ("async_training.trigger_parameter_sync_step=0", r"must be an integer >= 1"),
    ("async_training.use_trainer_do_validate=True", r"runs on the rollout servers"),
    ("async_training.use_dynamic_resource_scheduling=True", r"dynamic resource scheduling\) are not built here"),
    ("async_training.concurrent_samples_per_replica=32", r"actor_rollout_ref.rollout.max_num_seqs"),
])
def test_fully_async_refusals_say_what_to_use(arg, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(arg)}:? .*{message}"):
        fully_async_main.translate([arg, "rollout.total_rollout_steps=4096"])


def test_fully_async_accepted_keys_and_their_mappings():
    t = fully_async_main.translate_with_notes([
        "rollout.total_rollout_steps=4096", "actor_rollout_ref.rollout.name=hf", "data.gen_batch_size=1",
        "async_training.staleness_threshold=0", "async_training.require_batches=2", "rollout.n=4",
        "async_training.use_trainer_do_validate=False", "async_training.dynamic_schedule_policy=default",
        "actor_rollout_ref.rollout.standalone_gpu_memory_utilization=0.6",
        "actor_rollout_ref.actor.use_rollout_log_probs=False", "async_training.partial_rollout=False"])
    cfg = load_config(overrides=t.overrides)
    assert (cfg.async_training.buffer_batches, cfg.async_training.max_staleness) == (1, 1)
    assert cfg.data.train_batch_size == 256 * 2 * 4 and cfg.trainer.total_training_steps == 2
    assert cfg.actor_rollout_ref.rollout.gpu_memory_utilization == 0.6
    assert not cfg.algorithm.rollout_correction.bypass_mode and not cfg.async_training.partial_rollout
    notes = "\n".join(t.notes)
    assert "verl key data.gen_batch_size=1 -> (nothing)" in notes
    assert "verl key rollout.n=4 accepted, no effect" in notes


def test_the_docs_name_every_rule_of_the_async_entries():
    text = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    section = text.split("### verl's async entries", 1)[1].split("\n## ", 1)[0]
    for rule in (*async_keys.FULLY_ASYNC_RULES, *async_keys.ONE_STEP_OFF_RULES):
        assert f"`{rule.pattern}`" in section, rule.pattern


# ---------------------------------------------------------------------------------------------- a real run

@pytest.mark.distributed
@pytest.mark.slow
def test_the_one_step_off_entry_trains_two_steps_on_an_hf_server(tmp_path_factory, tmp_path):
    """verl's one-step-off launch line, sized for CPU: one trainer rank, rollout.n_gpus_per_node=1 -> one HF-engine
    server the run starts, one step off (staleness 0 then 1), every sync verified."""
    import math
    import os
    import subprocess
    import sys

    from megatron_rl.demo import prepare_assets
    from megatron_rl.trainer.tracking import read_metrics

    train, val, model = prepare_assets(tmp_path_factory.mktemp("assets"))
    args = ["--config-path=config", "--config-name=one_step_off_ppo_megatron_trainer.yaml", "+experiment=grpo_tiny_cpu",
            f"data.train_files=[{train}]", f"data.val_files=[{val}]", f"actor_rollout_ref.model.path={model}",
            "trainer.device=cpu", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
            "trainer.val_before_train=False", "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.actor.megatron.share_prompts=false",  # verl's packed sequences take no shared prompts
            "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.logger=[jsonl]",
            "trainer.save_hf_at_end=false", "trainer.save_freq=-1", "actor_rollout_ref.rollout.name=hf",
            "actor_rollout_ref.hybrid_engine=False", "rollout.nnodes=1", "rollout.n_gpus_per_node=1",
            "trainer.nnodes=1", "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.weight_sync.verify_freq=1",
            f"trainer.default_local_dir={tmp_path}"]
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.compat.verl.experimental.one_step_off_policy.main_ppo",
                           *args], cwd=Path(__file__).parents[2], env={**os.environ, "PYTHONUNBUFFERED": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "verl key rollout.n_gpus_per_node=1 -> actor_rollout_ref.rollout.num_servers=1" in proc.stderr
    steps = {r["step"]: r for r in read_metrics(tmp_path / "metrics.jsonl") if "actor/pg_loss" in r}
    assert sorted(steps) == [1, 2]
    assert [steps[s]["async/staleness_max"] for s in (1, 2)] == [0.0, 1.0]
    for record in steps.values():
        assert all(math.isfinite(v) for v in record.values() if isinstance(v, float))
        assert record["rollout/logprob_diff_max"] < 1e-4  # the server serves the synced weights


# The fully async shell (grpo_30b_a3b_base_math_megatron_96_32) scaled to a CPU machine: every recorded argument is
# kept but these. key -> (value, why); "{train}", "{val}", "{model}" are the tiny task's files and the demo's model.
_ONE_RANK = "the layout on one CPU rank (the tiny model has no experts: EP 1)"
_NO_TE = "a fused kernel of Transformer Engine, which does not import on CPU (the launch refuses True, naming it)"
FULLY_ASYNC_SCALED: dict[str, tuple[str, str]] = {
    "data.train_files": ("{train}", "the tiny task (copy 3-5 digits, synthetic/copy scorer): no downloads"),
    "data.val_files": ("{val}", "the tiny task's validation prompts"),
    "actor_rollout_ref.model.path": ("{model}", "the demo's tiny dense model (2 layers, 64 wide, 64 positions): the "
                                                "30B MoE does not run on CPU"),
    "data.max_prompt_length": ("16", "the tiny task's prompts (the model has 64 positions)"),
    "data.max_response_length": ("6", "the tiny task's answers (3-5 digits + EOS)"),
    "+reward.reward_kwargs.overlong_buffer_cfg.len": ("3", "half the response length, as the shell's 4096 of 8192"),
    "+reward.reward_kwargs.max_resp_len": ("6", "data.max_response_length, as in the shell"),
    "actor_rollout_ref.actor.ppo_mini_batch_size": ("2", "x require_batches 1 x trigger_parameter_sync_step 4 = 8 "
                                                         "prompts per sync (one step here) instead of 512"),
    "rollout.total_rollout_steps": ("16", "two syncs' worth of prompts: trainer.total_training_steps=2"),
    "actor_rollout_ref.actor.optim.lr_warmup_steps": ("1", "validation refuses a warmup longer than the 2 steps"),
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": ("1", _ONE_RANK),
    "actor_rollout_ref.actor.megatron.context_parallel_size": ("1", _ONE_RANK),
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size": ("1", _ONE_RANK),
    "actor_rollout_ref.ref.megatron.tensor_model_parallel_size": ("1", _ONE_RANK),
    "actor_rollout_ref.ref.megatron.context_parallel_size": ("1", _ONE_RANK),
    "actor_rollout_ref.ref.megatron.expert_model_parallel_size": ("1", _ONE_RANK),
    "trainer.nnodes": ("1", _ONE_RANK),
    "trainer.n_gpus_per_node": ("1", _ONE_RANK),
    **{f"+actor_rollout_ref.actor.megatron.override_transformer_config.{name}": ("False", _NO_TE) for name in (
        "apply_rope_fusion", "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
        "gradient_accumulation_fusion", "persist_layer_norm", "moe_grouped_gemm", "moe_permute_fusion")},
    "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_enable_deepep": (
        "False", "DeepEP is CUDA only (the launch refuses it)"),
    "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_token_dispatcher_type": (
        "alltoall", "flex runs on DeepEP; alltoall gives the same numbers"),
    "actor_rollout_ref.rollout.name": ("hf", "vLLM does not run on this machine: the HF engine's server"),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": ("1", "one rollout rank (validation: TP divides the "
                                                                  "world)"),
    "rollout.nnodes": ("1", "one machine"),
    "rollout.n_gpus_per_node": ("1", "one rollout server (the HF engine has no TP)"),
    "trainer.logger": ("[console,jsonl]", "the metrics read back here instead of tensorboard"),
}
# prefixes of the recorded arguments left out, and why
FULLY_ASYNC_DROPPED: dict[str, str] = {
    CPU_ADAM: "verl's CPU Adam: Megatron's HybridDeviceOptimizer takes CUDA streams; validation refuses it on a CPU "
              "run (on CPU Adam's state is in host memory already)",
    FULLY_ASYNC_REFUSED[0]: "rollout servers load model.path and never see it (validation refuses it); the tiny "
                            "model's config.json is its own",
}
# added: the CPU device and a weight-sync check every step (every sync verified). The final HF export stays on: with
# the shell's megatron.param_offload=True it crashed (workers/hybrid.py save_hf read the weights while they were
# offloaded to the host: SIGSEGV on CPU); the test checks the exported weights
FULLY_ASYNC_ADDED = ("trainer.device=cpu", "actor_rollout_ref.rollout.weight_sync.verify_freq=1")


def scaled_fully_async_args(out: Path, keep: tuple[str, ...] = (), **paths: Path) -> list[str]:
    """The recorded fully async shell, scaled (FULLY_ASYNC_SCALED), FULLY_ASYNC_DROPPED left out but for ``keep``."""
    dropped = tuple(p for p in FULLY_ASYNC_DROPPED if p not in keep)
    args = []
    for arg in (SHELLS / f"{FULLY_ASYNC}.args").read_text().splitlines():
        key = arg.partition("=")[0]
        if not arg.startswith(dropped):
            args.append(f"{key}={FULLY_ASYNC_SCALED[key][0].format(**paths)}" if key in FULLY_ASYNC_SCALED else arg)
    assert set(FULLY_ASYNC_SCALED) <= {a.partition("=")[0] for a in args}  # each scaled key is one the shell sets
    return [*args, *FULLY_ASYNC_ADDED, f"trainer.default_local_dir={out}"]


@pytest.mark.distributed
@pytest.mark.slow
def test_the_fully_async_entry_trains_two_steps(tmp_path_factory, tmp_path):
    """verl's fully async shell through its compat entry, scaled to CPU (FULLY_ASYNC_SCALED / _DROPPED): one
    trainer rank and rollout.n_gpus_per_node=1 -> one HF-engine server the run starts, staleness_threshold 0.5 ->
    2 batches ahead, 8 prompts x 16 responses per sync, validation before training, two steps, every sync verified."""
    import math
    import os
    import subprocess
    import sys

    from megatron_rl.demo import prepare_assets
    from megatron_rl.trainer.tracking import read_metrics

    train, val, model = prepare_assets(tmp_path_factory.mktemp("assets"))
    paths = {"train": train, "val": val, "model": model}
    # what is dropped is what a CPU run refuses
    with pytest.raises(ConfigError, match=r"override_optimizer_config.optimizer_cpu_offload=true cannot run on CPU "
                                          r"\(trainer.device=cpu.*HybridDeviceOptimizer takes CUDA streams"):
        composed(fully_async_main.translate, scaled_fully_async_args(tmp_path, keep=(CPU_ADAM,), **paths))
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.model.override_config=.*hf rollout servers never see "
                                          r"it \(they load model.path\)"):
        composed(fully_async_main.translate, scaled_fully_async_args(tmp_path, keep=FULLY_ASYNC_REFUSED, **paths))

    args = scaled_fully_async_args(tmp_path, **paths)
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.compat.verl.experimental.fully_async_policy."
                           "fully_async_main", *args], cwd=Path(__file__).parents[2],
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for line in ("verl fully_async entry sets async_training.mode=fully_async",
                 "verl key actor_rollout_ref.rollout.mode=async -> actor_rollout_ref.rollout.mode=server",
                 "verl key rollout.n_gpus_per_node=1 -> actor_rollout_ref.rollout.num_servers=1",
                 "verl key data.train_batch_size=0 -> data.train_batch_size=8",
                 "verl key rollout.total_rollout_steps=16 -> trainer.total_training_steps=2",
                 "verl key async_training.staleness_threshold=0.5 -> async_training.buffer_batches=2 "
                 "async_training.max_staleness=2",
                 "verl key async_training.trigger_parameter_sync_step=4 -> (nothing)",
                 "verl key async_training.require_batches=1 -> (nothing)",
                 "verl fully_async config algorithm.rollout_correction.bypass_mode=True"):
        assert line in proc.stderr, line
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert any("val-core/synthetic/copy/acc/mean@1" in r for r in records if r["step"] == 0)  # val_before_train
    steps = {r["step"]: r for r in records if "actor/pg_loss" in r}
    assert sorted(steps) == [1, 2]
    # the first batch was generated by the initial weights and trained by them; the second, generated ahead while
    # step 1 trained, is one version old (within max_staleness 2: nothing dropped)
    assert [steps[s]["async/staleness_max"] for s in (1, 2)] == [0.0, 1.0]
    assert [steps[s]["weight_sync/version"] for s in (1, 2)] == [1.0, 2.0]  # a sync after each step
    for record in steps.values():
        assert all(math.isfinite(v) for v in record.values() if isinstance(v, float)), record
        assert record["async/dropped_samples_total"] == 0.0
        assert record["rollout/logprob_diff_max"] < 1e-4  # each sync verified: the server serves the synced weights
    # the final HF export, with the weights offloaded between syncs (megatron.param_offload=True): it crashed before
    assert list((tmp_path / "hf_final").glob("*.safetensors")), sorted(p.name for p in tmp_path.iterdir())
