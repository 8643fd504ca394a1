"""SFT end to end (`python -m megatron_rl.sft`, trainer/sft.py; docs/sft.md): the demo's random 2-layer model learns the
copy task from conversations alone, its output loads in transformers and trains in the RL trainer, a resumed run is
exactly the uninterrupted one, and bad inputs are refused before any worker starts, naming the key or the row."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from megatron_rl.config import ConfigError, load_config
from megatron_rl.data.tasks import write_sft_task
from megatron_rl.demo import prepare_assets
from megatron_rl.sft import run

REQUIRED_EXACT_MATCH = 0.9


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sft")
    train, val, model = prepare_assets(root, 0, task="copy1", n_train=512, n_val=32)
    sft = write_sft_task("copy1", root / "data", 512, 32, 0)
    return {"model": model, "rl_train": train, "rl_val": val, "train": sft["train"], "val": sft["val"]}


def overrides(assets: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["+experiment=sft_tiny_cpu", f"actor_rollout_ref.model.path={assets['model']}",
            f"data.train_files=[{assets['train']}]", f"data.val_files=[{assets['val']}]",
            f"trainer.default_local_dir={out}", *extra]


def exact_match(model_dir: Path, val_file: Path) -> float:
    """Greedy answers of the transformers model loaded from ``model_dir`` against the conversations' answers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = pq.read_table(val_file).to_pylist()
    right = 0
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["messages"][:-1], add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
        out = model.generate(**prompt, max_new_tokens=4, do_sample=False, eos_token_id=tokenizer.eos_token_id)
        answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        right += answer == row["messages"][-1]["content"]
    return right / len(rows)


def metrics_of(path: Path) -> dict[int, dict]:
    return {record["step"]: record for record in map(json.loads, path.read_text().splitlines())}


@pytest.fixture(scope="module")
def trained(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft_run")
    return run(load_config(overrides=overrides(assets, out))), out


def test_the_demo_model_learns_the_copy_task_by_sft_alone(assets, trained):
    result, out = trained
    metrics = metrics_of(result.metrics_path)
    assert metrics[60]["val/loss"] < 0.1 < metrics[20]["val/loss"]
    assert metrics[60]["train/loss"] < metrics[1]["train/loss"] / 10
    assert exact_match(assets["model"], assets["val"]) < 0.2  # the random model could not
    assert exact_match(result.hf_dir, assets["val"]) >= REQUIRED_EXACT_MATCH


def test_the_sft_output_trains_in_the_rl_trainer(assets, trained, tmp_path):
    from megatron_rl.train import run as run_rl

    result, _ = trained
    rl = run_rl(load_config(overrides=[
        "+experiment=grpo_tiny_cpu", f"actor_rollout_ref.model.path={result.hf_dir}",
        f"data.train_files=[{assets['rl_train']}]", f"data.val_files=[{assets['rl_val']}]",
        f"trainer.default_local_dir={tmp_path}", "trainer.total_training_steps=2", "trainer.test_freq=-1",
        "trainer.val_before_train=true", "data.max_response_length=4", "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8"]))
    metrics = metrics_of(rl.metrics_path)
    # the SFT model already answers: the RL run's first validation is as good as the SFT model's exact match
    assert metrics[0]["val-core/synthetic/copy/acc/mean@1"] >= REQUIRED_EXACT_MATCH
    assert metrics[2]["critic/score/mean"] > 0.5


def test_a_resumed_run_is_the_uninterrupted_one(assets, tmp_path):
    short = ["trainer.total_training_steps=6", "trainer.save_freq=3", "trainer.test_freq=3",
             "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
             "trainer.save_hf_at_end=false"]
    whole = run(load_config(overrides=overrides(assets, tmp_path / "whole", *short)))
    first = run(load_config(overrides=overrides(assets, tmp_path / "parts", *short[1:],
                                                "trainer.total_training_steps=3")))
    assert first.last_step == 3
    resumed = run(load_config(overrides=overrides(assets, tmp_path / "parts", *short)))
    assert resumed.last_step == 6
    a, b = metrics_of(whole.metrics_path), metrics_of(resumed.metrics_path)
    for step in (4, 5, 6):
        assert b[step]["train/loss"] == a[step]["train/loss"], step
    assert b[6]["val/loss"] == a[6]["val/loss"]


def test_rows_without_an_assistant_turn_are_refused_naming_the_row(assets, tmp_path):
    bad = tmp_path / "bad.parquet"
    rows = [{"messages": [{"role": "user", "content": "copy: 1"}, {"role": "assistant", "content": "1"}]},
            {"messages": [{"role": "user", "content": "copy: 2"}]}]
    pq.write_table(pa.Table.from_pylist(rows), bad)
    cfg = load_config(overrides=overrides(assets, tmp_path / "out", f"data.train_files=[{bad}]"))
    with pytest.raises(ConfigError, match=r"data.train_files: .*bad.parquet.*row 1.*no assistant message"):
        run(cfg)
    assert not torch.distributed.is_initialized()  # refused before any worker started


@pytest.mark.parametrize(("setting", "message"), [
    ("data.truncation=middle", r"data.truncation=middle: SFT rows are cut error/left/right"),
    ("data.max_length=1", r"data.max_length=1"),
    ("trainer.n_gpus_per_node=2", r"trainer.launcher=ray with 2 ranks: SFT runs under torchrun"),
    ("data.train_batch_size=3", r"data.train_batch_size=3 conversations do not split over data-parallel size 2"),
])
def test_bad_settings_are_refused_naming_the_key(assets, tmp_path, setting, message):
    extra = [setting] if setting != "data.train_batch_size=3" else [
        setting, "trainer.n_gpus_per_node=2", "trainer.launcher=torchrun"]
    with pytest.raises(ConfigError, match=message):
        run(load_config(overrides=overrides(assets, tmp_path, *extra)))


def test_a_dry_run_checks_the_rows_and_prints_the_sizes(assets, tmp_path, capsys):
    assert run(load_config(overrides=overrides(assets, tmp_path / "dry")), dry_run=True) is None
    assert "512 training conversations" in capsys.readouterr().out
    assert not (tmp_path / "dry").exists()


def test_torchrun_at_tp2_trains_as_one_process_at_tp1(assets, tmp_path):
    """`torchrun -m megatron_rl.sft` on 2 ranks (TP=2) against the in-process TP=1 run: the same losses, step by step,
    and an HF export that transformers loads."""
    import os
    import subprocess
    import sys

    from megatron_rl.distributed import free_port

    same = ["trainer.total_training_steps=4", "trainer.test_freq=2", "trainer.save_freq=-1"]
    one = run(load_config(overrides=overrides(assets, tmp_path / "one", *same)))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
               "-m", "megatron_rl.sft", *overrides(assets, tmp_path / "two", *same, "trainer.launcher=torchrun",
                                                   "trainer.n_gpus_per_node=2",
                                                   "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2")]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    a, b = metrics_of(one.metrics_path), metrics_of(tmp_path / "two" / "metrics.jsonl")
    for step in (1, 2, 3, 4):
        assert b[step]["train/loss"] == pytest.approx(a[step]["train/loss"], rel=1e-4), step
    assert b[4]["val/loss"] == pytest.approx(a[4]["val/loss"], rel=1e-4)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "hf_final")


def test_sft_with_lora_trains_the_adapters_only(assets, tmp_path):
    """actor_rollout_ref.model.lora: the adapters train (the loss falls), the base weights do not; the export merges
    them into the linears (the embeddings and norms, which carry no adapter, are the base model's)."""
    from safetensors.torch import load_file

    result = run(load_config(overrides=overrides(
        assets, tmp_path, "actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.alpha=16",
        "actor_rollout_ref.actor.optim.lr=1e-2", "trainer.total_training_steps=20", "trainer.test_freq=-1")))
    metrics = metrics_of(result.metrics_path)
    assert metrics[20]["train/loss"] < metrics[1]["train/loss"] - 0.1
    base, tuned = load_file(assets["model"] / "model.safetensors"), load_file(result.hf_dir / "model.safetensors")
    assert torch.equal(base["model.embed_tokens.weight"], tuned["model.embed_tokens.weight"])
    assert torch.equal(base["model.norm.weight"], tuned["model.norm.weight"])
    assert not torch.equal(base["model.layers.0.self_attn.q_proj.weight"], tuned["model.layers.0.self_attn.q_proj.weight"])
