"""verl's Megatron SFT scripts (verl-project/verl at 1dda039b9, examples/sft/gsm8k/*megatron*.sh) through
``python3 -m megatron_rl.compat.verl.trainer.sft_trainer`` (issue 55 item 1): every argument each script passes to
``torchrun ... -m verl.trainer.sft_trainer`` (recorded by running it with a stub torchrun that writes its argv, HOME=
/HOME; tests/compat/verl_scripts/sft/*.args, the torchrun line kept as a comment) meets its fate
(compat/verl/sft_keys.py), with torchrun's world (WORLD_SIZE / LOCAL_WORLD_SIZE as its torchrun line gives them):

- run_qwen_megatron_fsdp.sh (Qwen2.5-Math-7B, TP 4 on 8 GPUs): refused for engine.use_megatron_fsdp=True (ZeRO-3 is
  not built here, as the RL entry refuses it); without that key it passes the dry run's checks, its warm-up ratio
  (0.2 of the run's steps) counted from the training rows and its cosine decay to min_lr 1e-6 kept;
- run_mimo_7b_mtp_megatron.sh (MiMo-7B with its MTP layer, 8 GPUs): passes, test_freq=after_each_epoch -> the steps
  of one epoch;
- run_nemotron_nano_v3_megatron.sh, run_qwen3_5_397b_a17b_megatron.sh, run_deepseek_v4_megatron_lite.sh: refused by
  their models' architectures first (Mamba layers; Gated DeltaNet in a VL model; DeepSeek-V4's compressed attention);
  with a buildable stand-in model of their layout the other keys are taken (the DeepSeek-V4 one then meets its
  verl_mlite config search path: another package's engine=mlite).

And one scaled to the demo's tiny model trains two steps in one process through the entry and writes hf_final; bad
inputs (a key verl's SFT does not have, a key refused here, a config name not taken) exit with the config-error
code before anything starts."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.compat.verl.trainer.sft_trainer import translate, translate_with_notes
from megatron_rl.config import ConfigError, load_config
from megatron_rl.trainer.preflight import check_sft_start
from megatron_rl.trainer.signals import EXIT_CONFIG_ERROR

SCRIPTS = Path(__file__).with_name("verl_scripts") / "sft"
REPO = Path(__file__).resolve().parents[2]
QWEN2_5_MATH_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
                   "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 4096,
                   "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
                   "attention_bias": True}
MIMO_7B = {"architectures": ["MiMoForCausalLM"], "model_type": "mimo", "attention_bias": True, "hidden_act": "silu",
           "hidden_size": 4096, "intermediate_size": 11008, "max_position_embeddings": 32768,
           "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
           "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 640000, "tie_word_embeddings": False,
           "use_sliding_window": False, "vocab_size": 151680}
# a buildable MoE of the refused families' layouts (TP 8 x EP 8; TP 2 x PP 4 x EP 32): Qwen3-30B-A3B's config
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                 "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "vocab_size": 151936, "tie_word_embeddings": False, "rope_theta": 1000000.0,
                 "max_position_embeddings": 40960}


def _declared(architecture: str) -> dict:
    return {"architectures": [architecture], "hidden_size": 4096, "num_hidden_layers": 48, "num_attention_heads": 32,
            "vocab_size": 151936}


# script -> (its model's config.json facts, None: it passes | the refusal it meets)
EXPECTED = {
    "qwen_megatron_fsdp": (QWEN2_5_MATH_7B, r"engine.use_megatron_fsdp=True: Megatron-FSDP \(ZeRO-3.*not built here"),
    "mimo_7b_mtp_megatron": (MIMO_7B, None),
    "nemotron_nano_v3_megatron": (_declared("NemotronHForCausalLM"),
                                  r"NemotronHForCausalLM is not supported: hybrid Mamba-2"),
    "qwen3_5_397b_a17b_megatron": (_declared("Qwen3_5MoeForConditionalGeneration"),
                                   r"Qwen3_5MoeForConditionalGeneration is not supported: a vision-language model"),
    "deepseek_v4_megatron_lite": (_declared("DeepseekV4ForCausalLM"),
                                  r"DeepseekV4ForCausalLM is not supported: compressed sparse"),
}
TRAIN_ROWS = 200  # each script's training file here: 200 two-turn conversations


def torchrun_env(name: str) -> dict[str, str]:
    """WORLD_SIZE / LOCAL_WORLD_SIZE of the script's recorded torchrun line."""
    line = next(line for line in (SCRIPTS / f"{name}.args").read_text().splitlines() if line.startswith("# torchrun"))
    nodes = int(re.search(r"--nnodes[= ](\d+)", line).group(1))
    local = int(re.search(r"--nproc_per_node[= ](\d+)", line).group(1))
    return {"WORLD_SIZE": str(nodes * local), "LOCAL_WORLD_SIZE": str(local)}


def conversations(path: Path, rows: int, key: str = "messages") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([{key: [{"role": "user", "content": f"q{i}"},
                                                {"role": "assistant", "content": "a"}]} for i in range(rows)]), path)


def script_args(name: str, tmp_path: Path, facts: dict) -> list[str]:
    """The script's arguments with its model a directory holding ``facts`` as config.json, /HOME under tmp_path
    (its data files written there) and its output directory there too."""
    args = [a for a in (SCRIPTS / f"{name}.args").read_text().splitlines() if a and not a.startswith("#")]
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(facts))
    args = [f"model.path={model}" if a.startswith("model.path=") else a.replace("/HOME", str(tmp_path)) for a in args]
    said = dict(a.split("=", 1) for a in args if "=" in a)
    conversations(Path(said["data.train_files"]), TRAIN_ROWS, said.get("data.messages_key", "messages"))
    return [a for a in args if not a.startswith("trainer.default_local_dir=")] + [
        f"trainer.default_local_dir={tmp_path / 'out'}"]


def checked(args: list[str], env: dict[str, str]):
    """What ``--dry-run`` checks before it reads the rows (which need the model's tokenizer): the config composes,
    validates (validate_sft) and passes the file-system checks; wandb is not installed here, so the loggers are
    the console's."""
    cfg = load_config(overrides=translate(args, env) + ["trainer.logger=[console]"])
    return cfg, check_sft_start(cfg)


def test_the_recorded_scripts_are_here():
    assert sorted(p.stem for p in SCRIPTS.glob("*.args")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_script_passes_the_dry_run_checks_or_meets_its_named_refusal(name, tmp_path):
    facts, refusal = EXPECTED[name]
    args, env = script_args(name, tmp_path, facts), torchrun_env(name)
    if refusal is not None:
        with pytest.raises(ConfigError, match=refusal):
            checked(args, env)
        return
    cfg, sizes = checked(args, env)
    assert (cfg.trainer.launcher, sizes.world_size) == ("torchrun", 8)


def test_the_qwen_script_without_megatron_fsdp_keeps_its_schedule_and_layout(tmp_path):
    """The warm-up ratio 0.2 of (200 rows // 8) x 4 epochs = 100 steps: 20 steps; cosine to 1e-6 of 1e-5; TP 4,
    DP 2 of torchrun's 8 processes; packed sequences (verl's engine.use_remove_padding), token budgets of 1024."""
    args = [a for a in script_args("qwen_megatron_fsdp", tmp_path, QWEN2_5_MATH_7B) if "use_megatron_fsdp" not in a]
    cfg, sizes = checked(args, torchrun_env("qwen_megatron_fsdp"))
    actor = cfg.actor_rollout_ref.actor
    assert (actor.optim.lr, actor.optim.lr_warmup_steps, str(actor.optim.lr_scheduler)) == (1e-5, 20, "cosine")
    assert actor.optim.min_lr_ratio == pytest.approx(0.1)
    assert (actor.optim.weight_decay, list(actor.optim.betas)) == (0.1, [0.9, 0.95])
    megatron = actor.megatron
    assert (megatron.tensor_model_parallel_size, megatron.sequence_parallel, megatron.packed_sequences) == (4, True, True)
    assert megatron.use_distributed_optimizer and megatron.override_transformer_config[
        "gradient_accumulation_fusion"] is False
    assert (actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu) == (True, 1024)
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, cfg.trainer.total_epochs) == (1, 8, 4)
    assert (cfg.data.train_batch_size, cfg.data.trust_remote_code) == (8, True)


def test_the_mimo_script_validates_after_each_epoch(tmp_path):
    cfg, _ = checked(script_args("mimo_7b_mtp_megatron", tmp_path, MIMO_7B), torchrun_env("mimo_7b_mtp_megatron"))
    assert cfg.trainer.test_freq == TRAIN_ROWS // 64  # after_each_epoch: rows // data.train_batch_size
    assert (cfg.actor_rollout_ref.model.mtp.enable, cfg.data.messages_key, cfg.data.dataloader_num_workers) == (
        True, "prompt", 0)
    assert cfg.actor_rollout_ref.actor.optim.lr_warmup_steps == 10


@pytest.mark.parametrize(("name", "refusal"), [
    ("nemotron_nano_v3_megatron", None),
    ("qwen3_5_397b_a17b_megatron", None),
    ("deepseek_v4_megatron_lite", r"hydra.searchpath=\[pkg://verl_mlite.config\]: .*not megatron-rl's"),
])
def test_the_refused_families_other_keys_with_a_buildable_stand_in(name, refusal, tmp_path):
    args, env = script_args(name, tmp_path, QWEN3_30B_A3B), torchrun_env(name)
    if refusal is not None:
        with pytest.raises(ConfigError, match=refusal):
            checked(args, env)
        return
    cfg = load_config(overrides=translate(args, env))
    optim = cfg.actor_rollout_ref.actor.optim
    assert str(optim.lr_scheduler) == "cosine" and optim.override_optimizer_config["optimizer_cpu_offload"] is True


# ---------------------------------------------------------------------------------------------- the tiny model

@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    from megatron_rl.data.tasks import write_sft_task
    from megatron_rl.demo import prepare_assets

    root = tmp_path_factory.mktemp("verl_sft")
    _, _, model = prepare_assets(root, 0, task="copy1", n_train=64, n_val=8)
    sft = write_sft_task("copy1", root / "data", 64, 8, 0)
    return {"model": model, "train": sft["train"], "val": sft["val"]}


def tiny_args(tiny: dict[str, Path], out: Path) -> list[str]:
    """The Qwen script scaled to the tiny model: its keys, one process, 2 steps of 8 conversations on the CPU."""
    scaled = {"model.path": str(tiny["model"]), "data.train_files": str(tiny["train"]),
              "data.val_files": str(tiny["val"]), "data.train_batch_size": "8",
              "engine.tensor_model_parallel_size": "1", "trainer.logger": "['console','file']",
              "trainer.default_local_dir": str(out)}
    args = []
    for line in (SCRIPTS / "qwen_megatron_fsdp.args").read_text().splitlines():
        key = line.partition("=")[0]
        if line and not line.startswith("#") and key != "engine.use_megatron_fsdp":
            args.append(f"{key}={scaled[key]}" if key in scaled else line)
    return args + ["data.max_length=32", "trainer.total_training_steps=2", "trainer.device=cpu", "optim.lr=1e-3",
                   "optim.min_lr=1e-4"]


def entry(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK")}
    return subprocess.run([sys.executable, "-m", "megatron_rl.compat.verl.trainer.sft_trainer", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_the_scaled_script_trains_two_steps_in_one_process_and_writes_hf_final(tiny, tmp_path):
    out = tmp_path / "run"
    done = entry(tiny_args(tiny, out))
    assert done.returncode == 0, done.stderr[-4000:]
    assert "verl key optim.lr_warmup_steps_ratio=0.2 -> actor_rollout_ref.actor.optim.lr_warmup_steps=0" in done.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == 2 and any("train/loss" in r for r in records)
    assert (out / "hf_final" / "config.json").is_file() and any((out / "hf_final").glob("*.safetensors"))


def test_the_scaled_script_dry_run_writes_nothing(tiny, tmp_path):
    out = tmp_path / "dry"
    done = entry([*tiny_args(tiny, out), "--dry-run"])
    assert done.returncode == 0, done.stderr[-4000:]
    assert "64 training conversations" in done.stdout and not out.exists()


@pytest.mark.parametrize(("bad", "message"), [
    ("data.micro_batch_size=2", r"data.micro_batch_size=2: not a key of verl's SFT trainer .*nearest: "
                                r"data.micro_batch_size_per_gpu"),
    ("engine.use_megatron_fsdp=True", r"engine.use_megatron_fsdp=True: Megatron-FSDP"),
    ("engine=fsdp", r"engine=fsdp: megatron-rl trains with Megatron-Core, verl's engine=megatron"),
    ("--config-name=ppo_trainer", r"--config-name=ppo_trainer: megatron-rl's SFT composes one config"),
    ("optim.lr_decay_style=linear", r"optim.lr_decay_style=linear: the schedules here are constant, cosine"),
])
def test_bad_inputs_exit_with_the_config_error_code_naming_the_key(tiny, tmp_path, bad, message):
    with pytest.raises(ConfigError, match=message):
        translate_with_notes([*tiny_args(tiny, tmp_path / "out"), bad], env={})
    done = entry([*tiny_args(tiny, tmp_path / "out"), bad], timeout=120)
    assert done.returncode == EXIT_CONFIG_ERROR, done.stderr[-2000:]
    assert re.search(message, done.stderr) and "config error: " in done.stderr
    assert not (tmp_path / "out").exists()  # before anything starts


def test_under_torchrun_the_world_is_torchruns(tiny, tmp_path):
    """verl's SFT takes its world from torchrun whatever trainer.nnodes / n_gpus_per_node say."""
    args = [*tiny_args(tiny, tmp_path), "trainer.n_gpus_per_node=4"]
    translation = translate_with_notes(args, env={"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"})
    assert translation.overrides[-3:] == ["trainer.launcher=torchrun", "trainer.nnodes=2", "trainer.n_gpus_per_node=2"]
    assert any("trainer.n_gpus_per_node=4 accepted, no effect" in note for note in translation.notes)
    cfg = load_config(overrides=translation.overrides)
    assert (cfg.trainer.launcher, cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == ("torchrun", 2, 2)


def test_the_warmup_ratio_without_readable_rows_is_refused_naming_the_key(tiny, tmp_path):
    args = [a if not a.startswith("data.train_files=") else f"data.train_files={tmp_path / 'none.parquet'}"
            for a in tiny_args(tiny, tmp_path) if not a.startswith("trainer.total_training_steps")]
    with pytest.raises(ConfigError, match=r"optim.lr_warmup_steps_ratio=0.2: verl counts it from the training rows.*"
                                          r"give it as a number of steps"):
        translate(args, env={})

