"""verl's current Megatron example scripts (verl-project/verl at 1dda039b9) through
megatron_rl.compat.verl.trainer.main_ppo: every argument each script passes (recorded by running it with a stub python3
that writes its argv, VERL_USE_UV=0; tests/compat/verl_scripts/*.args, our own test data) composes and validates with
only the model and data paths replaced, verl's defaults applied (compat/verl/defaults.py), and the planner plans what
would run:

- examples/grpo_trainer/run_qwen3_8b_megatron.sh (INFER_BACKEND=vllm, sglang), examples/ppo_trainer/run_qwen3_8b_
  megatron.sh (vllm, sglang), examples/gpg_trainer/run_qwen3_8b_megatron.sh, examples/gspo_trainer/run_qwen3_30b_a3b_
  megatron.sh, examples/grpo_trainer/run_qwen3_30b_a3b_megatron.sh (vllm, sglang) at NNODES=2: at its default one node
  its layout (TP4 x PP2, EP2 with ETP = TP) does not factor 8 GPUs, which Megatron-Core refuses as we do.

What the plan says (79.6 GiB per H100): the GPG and 30B GRPO scripts fit; the 8B GRPO (83.0 GiB), 8B PPO (102.1) and
30B GSPO (88.1) scripts do not by our count, because verl's Megatron engine recomputes nothing by default
(``model.enable_gradient_checkpointing`` is read by its FSDP engine only) and their 24-30k-token micro-batches keep two
pipeline stages' activations; the refusal names recompute and the other options. The SGLang variant of the 30B script
is refused at compose time: rollout expert parallelism is built for vLLM only.
Before (issue 37) the first script failed on actor_rollout_ref.model.use_remove_padding."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron_rl.compat.verl.trainer.main_ppo import translate
from megatron_rl.config import ConfigError, load_config
from megatron_rl.plan import PlanError, build_plan
from megatron_rl.plan.validate import validate

SCRIPTS = sorted(Path(__file__).with_name("verl_scripts").glob("*.args"))
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000, "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False}
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                 "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "vocab_size": 151936, "tie_word_embeddings": False, "rope_theta": 1000000.0,
                 "max_position_embeddings": 40960}
# script -> peak GiB of the plan (None: refused before planning). vLLM's figures read gpu_memory_utilization as a
# fraction of the GPU's total, with its CUDA graphs kept while it sleeps (rollout/memory.py; issue 49: 79.2,
# 49.4, 83.0, 88.1 and 102.1 GiB when the planner read it as SGLang's fraction of the free memory)
EXPECTED = {
    "gpg_qwen3_8b_megatron_vllm": ("too big", 80.2),
    "grpo_qwen3_30b_a3b_megatron_vllm_2nodes": ("fits", 51.8),
    "grpo_qwen3_30b_a3b_megatron_sglang_2nodes": ("refused", "rollout.name=sglang has no expert parallelism"),
    "grpo_qwen3_8b_megatron_vllm": ("too big", 84.0),
    "grpo_qwen3_8b_megatron_sglang": ("too big", 83.0),
    "gspo_qwen3_30b_a3b_megatron_vllm": ("too big", 89.1),
    # vLLM would refuse to start: 0.6 x 79.6 GiB > the 45.1 GiB free after the actor and the critic
    "ppo_qwen3_8b_megatron_vllm": ("engine refuses", "only 45.1 GiB will be free .* <= 0.56"),
    "ppo_qwen3_8b_megatron_sglang": ("engine refuses", "only 45.1 GiB will be free .* <= 0.56"),
}


def test_the_recorded_scripts_are_here():
    assert sorted(p.stem for p in SCRIPTS) == sorted(EXPECTED)


def script_args(script: Path, tmp_path: Path) -> list[str]:
    models = {"Qwen/Qwen3-8B": QWEN3_8B, "Qwen/Qwen3-30B-A3B-Base": QWEN3_30B_A3B}
    args = script.read_text().splitlines()
    for name, facts in models.items():
        if any(name in a for a in args):
            (tmp_path / "model").mkdir(exist_ok=True)
            (tmp_path / "model" / "config.json").write_text(json.dumps(facts))
    return [a.replace("Qwen/Qwen3-8B", str(tmp_path / "model")).replace("Qwen/Qwen3-30B-A3B-Base", str(tmp_path / "model"))
            .replace("/HOME/data", str(tmp_path / "data")) for a in args]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_every_key_of_the_script_composes_validates_and_plans(script, tmp_path, capsys):
    outcome, figure = EXPECTED[script.stem]
    args = script_args(script, tmp_path)
    if outcome == "refused":
        with pytest.raises(ConfigError, match=figure):
            load_config(overrides=translate(args))
        return
    cfg = load_config(overrides=translate(args))
    validate(cfg)
    actor = cfg.actor_rollout_ref.actor
    assert actor.megatron.packed_sequences and cfg.actor_rollout_ref.ref.megatron.packed_sequences
    assert actor.megatron.use_distributed_optimizer  # verl's default, applied by the compat entry
    assert actor.megatron.sequence_parallel == (actor.megatron.tensor_model_parallel_size > 1)
    assert cfg.trainer.balance_batch and cfg.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz
    if outcome == "engine refuses":
        with pytest.raises(PlanError, match=figure):
            build_plan(cfg)
    elif outcome == "fits":
        plan = build_plan(cfg)
        text = plan.format()
        assert f"{figure} of 79.6 GiB per GPU: fits" in text, text
    else:
        with pytest.raises(PlanError) as err:
            build_plan(cfg)
        assert f"{figure} of 79.6 GiB per GPU: DOES NOT FIT" in str(err.value)
        assert "recompute_granularity=full" in str(err.value)
