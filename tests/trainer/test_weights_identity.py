"""The run identity includes the base weights (issue 56): a fingerprint of the model directory's safetensors files
(name, size, JSON header, the first and last bytes of every tensor and a few fixed samples of each file), so that a
LoRA resume on other base weights of the same config.json and tokenizer (two fine-tunes of one base) is refused
before start-up naming both, where before it trained the checkpoint's adapters on the new base with the log line
"the model moved". Fast: fake workers, no Ray, no Megatron; one `--dry-run` subprocess."""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.config import ConfigError, load_config

from test_run_safety import LoaderWithOrder, tiny_assets  # noqa: F401 (a fixture)
from test_trainer_loop import make_trainer

WEIGHTS = "model.safetensors"
# make_trainer's batch (test_trainer_loop.py), which the checkpoint's data loader ran with
SMALL_BATCH = ("data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
               "actor_rollout_ref.actor.ppo_mini_batch_size=2",
               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2")


def _write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def _middle_tensor_name(path: Path) -> str:
    """The tensor whose data sits in the middle of the file (safetensors orders data by its own rule)."""
    with open(path, "rb") as handle:
        header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
    by_offset = sorted((entry["data_offsets"][0], name) for name, entry in header.items() if name != "__metadata__")
    return by_offset[len(by_offset) // 2][1]


def _other_fine_tune(source: Path, target: Path) -> str:
    """A copy of the model directory whose weights differ in one tensor only, the one in the middle of the file:
    the same config.json and tokenizer, as two fine-tunes of one base."""
    shutil.copytree(source, target)
    name = _middle_tensor_name(target / WEIGHTS)
    tensors = load_file(str(target / WEIGHTS))
    generator = torch.Generator().manual_seed(56)
    tensors[name] = tensors[name] + 0.01 * torch.randn(tensors[name].shape, generator=generator)
    _write_shard(target / WEIGHTS, tensors)
    return name


# ---------------------------------------------------------------------------- the fingerprint
def test_the_fingerprint_catches_one_changed_tensor_in_the_middle_of_a_file(tmp_path):
    """64 tensors of 256 KiB with a non-trivial init; a copy whose middle tensor is another draw. The fingerprint
    reads every tensor's first and last bytes, so the one changed tensor is caught whatever the sampling's
    positions; an identical copy elsewhere has the same fingerprint; a renamed tensor changes the header."""
    from megatron_rl.trainer.weights_fingerprint import fingerprint_differences, weights_fingerprint

    generator = torch.Generator().manual_seed(0)
    tensors = {f"layers.{i:02d}.weight": torch.randn(64, 1024, generator=generator) for i in range(64)}
    base = _write_shard(tmp_path / "base" / WEIGHTS, tensors)
    shutil.copytree(base.parent, tmp_path / "copy")
    middle = _middle_tensor_name(base)
    _write_shard(tmp_path / "tuned" / WEIGHTS, {**tensors, middle: torch.randn(64, 1024, generator=generator)})
    renamed = dict(tensors)
    renamed["layers.99.weight"] = renamed.pop("layers.63.weight")
    _write_shard(tmp_path / "renamed" / WEIGHTS, renamed)

    fingerprint = weights_fingerprint(tmp_path / "base")
    assert fingerprint is not None and fingerprint["files"][WEIGHTS]["size"] == base.stat().st_size
    assert weights_fingerprint(tmp_path / "copy") == fingerprint
    tuned = weights_fingerprint(tmp_path / "tuned")
    assert tuned["sha256"] != fingerprint["sha256"]
    assert fingerprint_differences(fingerprint, tuned) == [f"{WEIGHTS}: other tensor data (same header)"]
    assert fingerprint_differences(fingerprint, weights_fingerprint(tmp_path / "renamed")) == [
        f"{WEIGHTS}: other header (tensor names, dtypes, shapes or offsets)"]
    # a file reads at most two windows per tensor and a bounded number of samples, never the whole tensor
    assert fingerprint["files"][WEIGHTS]["sampled_bytes"] < base.stat().st_size // 4


def test_the_fingerprint_of_a_1gb_sparse_file_reads_a_bounded_few_megabytes(tmp_path):
    """A 1 GiB safetensors file (256 tensors of 4 MiB, sparse: the header written, the data a hole) is
    fingerprinted from its header and a few MB of samples, not its GiB: what makes it cheap at 70B."""
    from megatron_rl.trainer.weights_fingerprint import weights_fingerprint

    path = tmp_path / "big" / WEIGHTS
    path.parent.mkdir()
    tensor_bytes = 4 << 20
    header = {f"layers.{i:03d}.weight": {"dtype": "F32", "shape": [1024, 1024],
                                          "data_offsets": [i * tensor_bytes, (i + 1) * tensor_bytes]}
              for i in range(256)}
    encoded = json.dumps(header).encode()
    with open(path, "wb") as handle:
        handle.write(len(encoded).to_bytes(8, "little") + encoded)
        handle.truncate(8 + len(encoded) + 256 * tensor_bytes)
    fingerprint = weights_fingerprint(path.parent)
    entry = fingerprint["files"][WEIGHTS]
    assert entry["size"] == path.stat().st_size > 1 << 30
    assert entry["sampled_bytes"] <= 4 << 20  # 2 x 4 KiB per tensor + 8 x 64 KiB per file: 2.5 MiB here


# ---------------------------------------------------------------------------- resume
def _checkpointed_run(out: Path, model: Path, data: list[str], *overrides: str) -> None:
    trainer, _ = make_trainer(out, f"actor_rollout_ref.model.path={model}", *data, "trainer.total_training_steps=1",
                              *overrides, loader=LoaderWithOrder(16, 2))
    trainer.fit()


def _starter(out: Path, data: list[str], *fixed: str):
    from megatron_rl.trainer.preflight import preflight

    def start(*overrides: str) -> None:
        preflight(load_config(overrides=[f"trainer.default_local_dir={out}", "trainer.nnodes=1",
                                         "trainer.n_gpus_per_node=1", "data.seed=1", *SMALL_BATCH, *data, *fixed,
                                         "data.max_prompt_length=16", "data.max_response_length=6",  # 64 positions
                                         *overrides]))

    return start


def _data(tiny_assets) -> list[str]:
    train, val, _ = tiny_assets
    return [f"data.train_files=[{train}]", f"data.val_files=[{val}]", "trainer.save_freq=1",
            "trainer.save_hf_at_end=false"]


def test_a_lora_resume_on_other_base_weights_is_refused_naming_both(tmp_path, tiny_assets, caplog):
    """The checkpoint of a LoRA run holds its adapters only; the base comes from actor_rollout_ref.model.path at
    start-up. Another base of the same config.json and tokenizer (one tensor in the middle of the file differs) is
    refused by preflight naming the key, both paths and both fingerprints; the same bytes moved elsewhere resume.
    Before issue 56 both resumed, the first with "the model moved"."""
    _, _, model = tiny_assets
    out, data, lora = tmp_path / "run", _data(tiny_assets), "actor_rollout_ref.model.lora.rank=4"
    _checkpointed_run(out, model, data, lora)
    start = _starter(out, data, lora)
    other = tmp_path / "other_fine_tune"
    changed = _other_fine_tune(model, other)
    with pytest.raises(ConfigError) as err:
        start(f"actor_rollout_ref.model.path={other}")
    message = str(err.value)
    from megatron_rl.trainer.weights_fingerprint import weights_fingerprint

    saved = json.loads((out / "global_step_1" / "run_identity.json").read_text())
    assert saved["weights"]["files"][WEIGHTS]["size"] == (model / WEIGHTS).stat().st_size
    assert "LoRA" in message and f"actor_rollout_ref.model.path={model.resolve()}" in message
    assert str(other.resolve()) in message and f"{WEIGHTS}: other tensor data" in message
    assert saved["weights"]["sha256"][:16] in message and weights_fingerprint(other)["sha256"][:16] in message
    assert "trainer.resume_mode=disable" in message and changed  # the way out is named

    start(f"actor_rollout_ref.model.path={model}")  # the same base: resumes
    moved = shutil.copytree(model, tmp_path / "moved")
    with caplog.at_level(logging.INFO, logger="megatron_rl.trainer.run_identity"):
        start(f"actor_rollout_ref.model.path={moved}")  # the same bytes elsewhere: resumes, and says so
    assert "same config.json, tokenizer and weights" in caplog.text
    start(f"actor_rollout_ref.model.path={other}", "trainer.resume_mode=disable", "trainer.overwrite=true")


def test_a_full_fine_tuning_resume_on_other_base_weights_warns_and_resumes(tmp_path, tiny_assets, caplog):
    """Full fine-tuning restores the actor's weights from the checkpoint, so other base weights at model.path
    resume as before, with a warning naming both (the reference policy, with a KL term, is built from the new
    base). A checkpoint whose run_identity.json predates the fingerprint resumes with a warning."""
    _, _, model = tiny_assets
    out, data = tmp_path / "run", _data(tiny_assets)
    _checkpointed_run(out, model, data, "actor_rollout_ref.actor.use_kl_loss=true")
    other = tmp_path / "other_fine_tune"
    _other_fine_tune(model, other)
    start = _starter(out, data, "actor_rollout_ref.actor.use_kl_loss=true")
    with caplog.at_level(logging.WARNING, logger="megatron_rl.trainer.run_identity"):
        start(f"actor_rollout_ref.model.path={other}")
    assert "other base weights" in caplog.text and str(other.resolve()) in caplog.text
    assert str(model.resolve()) in caplog.text and "reference policy" in caplog.text

    step = out / "global_step_1"  # as saved before issue 56: no "weights" (its manifest hashes what is there)
    identity = json.loads((step / "run_identity.json").read_text())
    del identity["weights"]
    (step / "run_identity.json").write_text(json.dumps(identity))
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"]["run_identity.json"] = (step / "run_identity.json").stat().st_size
    manifest["sha256"]["run_identity.json"] = hashlib.sha256((step / "run_identity.json").read_bytes()).hexdigest()
    (step / "manifest.json").write_text(json.dumps(manifest))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_rl.trainer.run_identity"):
        _starter(out, data, "actor_rollout_ref.model.lora.rank=4")(f"actor_rollout_ref.model.path={other}")
    assert "no weights fingerprint" in caplog.text and "cannot be compared" in caplog.text


def test_the_dry_run_refuses_a_lora_resume_on_other_base_weights(tmp_path, tiny_assets):
    """End to end through the entry point: `--dry-run` (the same preflight as a real start) exits non-zero
    naming actor_rollout_ref.model.path, before Ray or any worker."""
    train, val, model = tiny_assets
    out, data, lora = tmp_path / "run", _data(tiny_assets), "actor_rollout_ref.model.lora.rank=4"
    _checkpointed_run(out, model, data, lora, "data.seed=1")
    other = tmp_path / "other_fine_tune"
    _other_fine_tune(model, other)
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.train", "--dry-run", "+experiment=grpo_tiny_cpu",
                           f"data.train_files=[{train}]", f"data.val_files=[{val}]", lora, "data.seed=1", *SMALL_BATCH,
                           f"actor_rollout_ref.model.path={other}", f"trainer.default_local_dir={out}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "other base weights" in proc.stderr and f"actor_rollout_ref.model.path={model.resolve()}" in proc.stderr
