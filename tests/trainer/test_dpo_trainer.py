"""The DPO loop end to end (`python -m megatron_rl.dpo +experiment=dpo_tiny_cpu`, trainer/dpo.py; one CPU rank): the
demo's random tiny model learns to prefer the right copy of a digit over a wrong one (data/preference.py
``synthetic_pairs`` of the copy1 task) against a frozen copy of itself.

- The implicit reward margin rises over 60 steps and the validation reward accuracy ends high; the final HF
  checkpoint is written.
- A run stopped at step 30 and started again resumes from its checkpoint (the trainer state; the reference is
  rebuilt from model.path, not saved) and logs steps 31-60 as the uninterrupted run did.
- Bad settings and bad rows are refused before start, naming the key or the file and row.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.config.loader import load_config

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    from megatron_rl.data.preference import synthetic_pairs
    from megatron_rl.data.tasks import make_rows
    from megatron_rl.demo import prepare_assets

    root = tmp_path_factory.mktemp("dpo")
    _, _, model = prepare_assets(root, 0, task="copy1", n_train=16, n_val=8)
    out = {"root": root, "model": model}
    for split, n in (("train", 512), ("val", 64)):
        out[split] = root / f"pairs_{split}.jsonl"
        out[split].write_text("".join(json.dumps(r) + "\n" for r in synthetic_pairs(make_rows("copy1", n, 0, split))))
    return out


def overrides(assets: dict[str, Path], out: str, *extra: str) -> list[str]:
    return ["+experiment=dpo_tiny_cpu", f"actor_rollout_ref.model.path={assets['model']}",
            f"data.train_files=[{assets['train']}]", f"data.val_files=[{assets['val']}]",
            f"trainer.default_local_dir={assets['root'] / out}", *extra]


def dpo(assets: dict[str, Path], out: str, *extra: str) -> list[dict]:
    """Run the entry point; the metrics it logged."""
    done = subprocess.run([sys.executable, "-m", "megatron_rl.dpo", *overrides(assets, out, *extra)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (assets["root"] / out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(assets) -> list[dict]:
    return dpo(assets, "uninterrupted")


def test_the_reward_margin_rises_and_the_accuracy_ends_high(uninterrupted, assets):
    steps = [m for m in uninterrupted if "train/loss" in m]
    assert [m["step"] for m in steps] == list(range(1, 61))
    margins = [m["train/rewards/margins"] for m in steps]
    first, last = sum(margins[:5]) / 5, sum(margins[-5:]) / 5
    assert abs(first) < 0.05 and last > 0.5, (first, last)  # the policy starts as the reference: margin 0
    val = {m["step"]: m for m in uninterrupted if "val/loss" in m}
    assert val[60]["val/rewards/accuracies"] >= 0.85, val[60]
    assert val[60]["val/loss"] < val[20]["val/loss"] < 0.7
    assert (assets["root"] / "uninterrupted" / "hf_final" / "config.json").is_file()


def test_a_stopped_run_resumes_where_it_stopped(uninterrupted, assets):
    first = dpo(assets, "resumed", "trainer.total_training_steps=30")
    assert [m["step"] for m in first if "train/loss" in m] == list(range(1, 31))
    checkpoint = assets["root"] / "resumed" / "global_step_30"
    assert sorted(p.name for p in checkpoint.iterdir() if p.is_dir()) == ["actor"]  # no reference in it
    second = dpo(assets, "resumed")
    assert f"resuming from {checkpoint}" in (assets["root"] / "resumed" / "train.log").read_text()
    resumed = [m for m in second if "train/loss" in m and m["step"] > 30]
    assert [m["step"] for m in resumed] == list(range(31, 61))
    expected = {m["step"]: m for m in uninterrupted}
    for m in resumed:
        for key in ("train/loss", "train/rewards/margins", "train/grad_norm"):
            assert m[key] == pytest.approx(expected[m["step"]][key], rel=1e-5, abs=1e-7), (m["step"], key)


@pytest.mark.parametrize("setting, message", [
    ("dpo.beta=0", r"dpo.beta=0.0 must be > 0"),
    ("dpo.label_smoothing=0.6", r"dpo.label_smoothing=0.6 must be in \[0, 0.5\)"),
    ("dpo.reference=adapters_off", r"dpo.reference=adapters_off .* actor_rollout_ref.model.lora is off"),
    ("dpo.rejected_key=chosen", r"dpo.rejected_key must name three different columns"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64", r"larger than the 32 responses .*a DPO step of "
                                                               r"data.train_batch_size=16 pairs trains 32 rows"),
])
def test_bad_settings_are_refused_before_start(assets, setting, message):
    from megatron_rl.trainer.preflight import check_dpo_start

    cfg = load_config(overrides=overrides(assets, "refused", setting))
    with pytest.raises(ConfigError, match=message):
        check_dpo_start(cfg)


def test_a_bad_choice_is_refused_when_the_config_is_composed(assets):
    with pytest.raises(ConfigError, match=r"dpo.loss_type.*sigmoid.*ipo.*simpo"):
        load_config(overrides=overrides(assets, "refused", "dpo.loss_type=orpo"))


def test_bad_rows_are_refused_before_a_worker_starts(assets, tmp_path):
    from megatron_rl.data import load_tokenizer
    from megatron_rl.trainer.dpo import preference_dataset
    from megatron_rl.config import typed_config

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "copy: 1", "chosen": "1", "rejected": "2"}) + "\n"
                   + json.dumps({"prompt": "copy: 2", "chosen": "2"}) + "\n")
    cfg = typed_config(load_config(overrides=overrides(assets, "refused", f"data.train_files=[{bad}]")))
    with pytest.raises(ConfigError, match=r"data.train_files: .*bad.jsonl line 2: has no 'rejected' column"):
        preference_dataset(cfg, load_tokenizer(str(assets["model"])), "train_files")
