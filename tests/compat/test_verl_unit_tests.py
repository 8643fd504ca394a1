"""verl's own CPU unit tests on megatron_rl.compat.verl (scripts/verl_unit_tests.py), and the compat
modules they import (verl.workers.config.actor, verl.trainer.config.algorithm, verl.utils.metric,
verl.utils.py_functional, verl.utils.tensordict_utils).

verl's test files come from a verl source tree: $MEGATRON_RL_VERL_TESTS (a checkout, an unpacked sdist or
wheel, the sdist .tar.gz, or a git directory read at $MEGATRON_RL_VERL_TESTS_REF, default v0.9.0), else the
verl oracle's directory in $MEGATRON_RL_VERL_PATH (the 0.9.1 wheel ships them; ``make test`` installs it
in .cache/verl-oracle). Without either the run against verl's files skips, saying so.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_rl.compat.verl.trainer.config.algorithm import RolloutCorrectionConfig
from megatron_rl.compat.verl.trainer.ppo import core_algos, rollout_corr_helper
from megatron_rl.compat.verl.utils.metric import AggregationType, Metric, reduce_metrics
from megatron_rl.compat.verl.utils.py_functional import append_to_dict
from megatron_rl.compat.verl.utils.tensordict_utils import get_tensordict
from megatron_rl.compat.verl.workers.config.actor import ActorConfig, PolicyLossConfig
from megatron_rl.config import schema
from megatron_rl.compat.verl.protocol import DataProto
from megatron_rl_testing.scripts import load_script
from megatron_rl_testing.verl_oracle import verl_module

REPO = Path(__file__).resolve().parents[2]


runner = load_script("verl_unit_tests")




# ---------------------------------------------------------------- verl's own tests, through the runner
def test_verls_own_cpu_unit_tests_all_pass_on_the_compat_namespace():
    source = runner.find_source()
    if source is None:
        pytest.skip("no verl test files: set MEGATRON_RL_VERL_TESTS, or MEGATRON_RL_VERL_PATH to the verl oracle "
                    "(`make test` installs it in .cache/verl-oracle when pip reaches an index)")
    ref = os.environ.get("MEGATRON_RL_VERL_TESTS_REF", "v0.9.0")
    counts, output = runner.run_tests(source, ref)
    assert counts.ok, f"{counts}\n{output[-6000:]}"
    assert counts.passed >= 110 and counts.passed == counts.total  # 110 in v0.9.0's files, 111 in 0.9.1's
    assert all(counts.passed_per_file[rel] > 0 for rel in runner.TEST_FILES), counts.passed_per_file


def test_the_script_runs_from_the_command_line_and_reports_counts(tmp_path):
    tree = _fake_verl_tree(tmp_path / "verl", failing=None)
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "verl_unit_tests.py"), str(tree)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "7 passed, 0 failed, 0 errors, 0 skipped (of 7" in proc.stdout
    missing = subprocess.run([sys.executable, str(REPO / "scripts" / "verl_unit_tests.py"), str(tmp_path / "nope")],
                             capture_output=True, text=True, check=False)
    assert missing.returncode == 2 and "nope: verl source not found" in missing.stderr


def test_rewrite_changes_verls_module_paths_only():
    text = (
        "import verl.trainer.ppo.core_algos\nfrom verl import DataProto\nfrom verl.protocol import x\n"
        "import verl\nverl.trainer.ppo.core_algos.ADV_ESTIMATOR_REGISTRY = {}\n"
        "patch('verl.utils.metric.reduce_metrics')\nmy_verl.x = 1\nself.verl.y = 2\nverl_path = 'verl'\n"
    )
    assert runner.rewrite_imports(text) == (
        "import megatron_rl.compat.verl.trainer.ppo.core_algos\nfrom megatron_rl.compat.verl import DataProto\n"
        "from megatron_rl.compat.verl.protocol import x\nimport megatron_rl.compat.verl\n"
        "megatron_rl.compat.verl.trainer.ppo.core_algos.ADV_ESTIMATOR_REGISTRY = {}\n"
        "patch('megatron_rl.compat.verl.utils.metric.reduce_metrics')\nmy_verl.x = 1\nself.verl.y = 2\n"
        "verl_path = 'verl'\n"
    )


def _fake_verl_tree(root: Path, failing: str | None) -> Path:
    """TEST_FILES, each one test importing through verl's paths; ``failing`` names one that fails."""
    for rel in runner.TEST_FILES:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        verdict = "assert False" if rel == failing else "assert DataProto is Ours"
        path.write_text("from verl.protocol import DataProto\n"
                        "from megatron_rl.compat.verl.protocol import DataProto as Ours\n\n\n"
                        f"def test_it():\n    {verdict}\n")
    return root


def test_export_reads_a_tree_a_tarball_and_a_git_directory(tmp_path):
    tree = _fake_verl_tree(tmp_path / "verl-0.9.0", failing=None)
    tar_path = tmp_path / "verl-0.9.0.tar.gz"
    with tarfile.open(tar_path, "w:gz") as tar:
        tar.add(tree, arcname="verl-0.9.0")
    git = ["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    subprocess.run([*git, "tag", "v0.9.0"], check=True)
    bare = tmp_path / "bare.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(tree), str(bare)], check=True)
    for i, source in enumerate((tree, tar_path, bare)):
        written = runner.export_tests(source, tmp_path / f"out{i}")
        assert [p.relative_to(tmp_path / f"out{i}").as_posix() for p in written] == list(runner.TEST_FILES)
        assert written[0].read_text().startswith("from megatron_rl.compat.verl.protocol import DataProto\n")
    with pytest.raises(runner.SourceError, match="cannot read tests/test_protocol_on_cpu.py"):
        runner.export_tests(bare, tmp_path / "x", ref="v9")
    (tree / runner.TEST_FILES[-1]).unlink()
    with pytest.raises(runner.SourceError, match="test_rollout_corr_integration.py: verl test file not found"):
        runner.export_tests(tree, tmp_path / "y")


def test_the_runner_counts_a_failure_an_import_error_and_a_file_without_tests(tmp_path):
    tree = _fake_verl_tree(tmp_path / "verl", failing=runner.TEST_FILES[1])
    (tree / runner.TEST_FILES[2]).write_text("from verl.protocol import DataProto\n")  # imports, holds no test
    (tree / runner.TEST_FILES[3]).write_text("from verl.no_such_module import x\n")
    counts, output = runner.run_tests(tree)
    # one import error does not hide the other files' results
    assert (counts.passed, counts.failed, counts.errors, counts.skipped) == (4, 1, 1, 0), output
    assert [counts.passed_per_file[rel] for rel in runner.TEST_FILES] == [1, 0, 0, 0, 1, 1, 1]
    assert not counts.ok
    assert not runner.Counts(7, 0, 0, 0, {rel: 1 for rel in runner.TEST_FILES[1:]}).ok  # a file that ran nothing


# ---------------------------------------------------------------- verl.workers.config.actor
def test_actor_config_feeds_verls_keys_to_the_losses():
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_high=0.28,
                         policy_loss=PolicyLossConfig(loss_mode="dro", dro_beta=0.1))
    assert config["clip_ratio_high"] == 0.28 and config.get("policy_loss").dro_beta == 0.1
    assert config.get("no_such_key", 7) == 7 and "loss_agg_mode" in dict(config)
    old, new = torch.tensor([[-1.0, -0.5]]), torch.tensor([[-0.8, -0.7]])
    adv, mask = torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    loss, _ = core_algos.compute_policy_loss_dro(old, new, adv, mask, "token-mean", config)
    want = (-(new * adv - 0.05 * (new - old) ** 2)).mean()
    torch.testing.assert_close(loss, want)
    nested = ActorConfig(strategy="megatron", rollout_n=2, ppo_micro_batch_size_per_gpu=1,
                         policy_loss={"loss_mode": "dro", "dro_beta": 0.2})
    assert isinstance(nested.policy_loss, PolicyLossConfig) and nested.policy_loss.dro_beta == 0.2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rollout_n=1, ppo_micro_batch_size_per_gpu=1), r"actor_rollout_ref.actor.strategy must be set"),
        (dict(strategy="fsdp", ppo_micro_batch_size_per_gpu=1), r"actor_rollout_ref.actor.rollout_n must be set"),
        (dict(strategy="fsdp", rollout_n=1), r"set ppo_micro_batch_size_per_gpu \(or the deprecated"),
        (dict(strategy="fsdp", rollout_n=1, ppo_micro_batch_size=2, ppo_micro_batch_size_per_gpu=1), r"not both"),
        (dict(strategy="fsdp", rollout_n=1, ppo_micro_batch_size=2, loss_agg_mode="mean"),
         r"actor_rollout_ref.actor.loss_agg_mode: 'mean' is not one of"),
    ],
)
def test_actor_config_refuses_bad_keys_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ActorConfig(**kwargs)


def test_policy_loss_config_refuses_a_bad_loss_mode_and_configs_are_frozen():
    with pytest.raises(ValueError, match="actor_rollout_ref.actor.policy_loss.loss_mode must be a loss name"):
        PolicyLossConfig(loss_mode="")
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    config.ppo_micro_batch_size_per_gpu = 2  # verl lets the trainer rescale the batch sizes
    with pytest.raises(dataclasses.FrozenInstanceError, match="clip_ratio"):
        config.clip_ratio = 0.3


def test_actor_config_matches_verls_defaults():
    verl_actor = verl_module("verl.workers.config.actor")
    ours = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    theirs = verl_actor.ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    for f in dataclasses.fields(ours):
        if f.name != "policy_loss":
            assert getattr(ours, f.name) == getattr(theirs, f.name), f.name
    for f in dataclasses.fields(PolicyLossConfig):
        if f.name != "rollout_correction":
            assert getattr(ours.policy_loss, f.name) == getattr(theirs.policy_loss, f.name), f.name


# ---------------------------------------------------------------- verl.trainer.config.algorithm
def _presets(cls: type) -> list[str]:
    return sorted(name for name, member in vars(cls).items() if isinstance(member, classmethod))


def test_rollout_correction_config_is_ours_with_verls_presets():
    assert issubclass(RolloutCorrectionConfig, schema.RolloutCorrectionConfig)
    assert RolloutCorrectionConfig().rollout_is == "sequence"  # verl's class default (YAML's is null)
    icepop = RolloutCorrectionConfig.decoupled_token_icepop(threshold=4.0)
    assert (icepop.rollout_is, icepop.rollout_is_threshold, icepop.rollout_rs) == ("token", "0.5_4.0", None)
    bypass = RolloutCorrectionConfig.bypass_pg_geo_rs_token_tis()
    assert (bypass.bypass_mode, bypass.loss_type, bypass.rollout_rs_threshold) == (True, "reinforce", "0.999_1.001")
    assert len(_presets(RolloutCorrectionConfig)) == 19


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_rollout_correction_presets_match_verl():
    verl_algorithm = verl_module("verl.trainer.config.algorithm")
    theirs_cls = verl_algorithm.RolloutCorrectionConfig
    assert _presets(RolloutCorrectionConfig) == _presets(theirs_cls)
    keys = [f.name for f in dataclasses.fields(theirs_cls) if not f.name.startswith("_")]  # not hydra's _target_
    assert sorted(keys) == sorted(f.name for f in dataclasses.fields(RolloutCorrectionConfig))
    for name in _presets(theirs_cls):
        assert _params(getattr(RolloutCorrectionConfig, name)) == _params(getattr(theirs_cls, name)), name
        ours, theirs = getattr(RolloutCorrectionConfig, name)(), getattr(theirs_cls, name)()
        assert {k: getattr(ours, k) for k in keys} == {k: getattr(theirs, k) for k in keys}, name
    assert {k: getattr(RolloutCorrectionConfig(), k) for k in keys} == {k: getattr(theirs_cls(), k) for k in keys}


def test_a_rollout_correction_config_drives_the_helper():
    old = torch.zeros(2, 3)
    rollout = torch.tensor([[0.0, -2.0, 0.0], [0.0, 0.0, 0.0]])
    batch = DataProto.from_dict({"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": torch.ones(2, 3)})
    batch, metrics = rollout_corr_helper.compute_rollout_correction_and_add_to_batch(
        batch, RolloutCorrectionConfig.decoupled_token_is(threshold=2.0))
    assert batch.batch["rollout_is_weights"][0, 1] == 2.0  # exp(2) truncated at the threshold
    assert any(k.startswith("rollout_corr/") for k in metrics)


# ---------------------------------------------------------------- verl.utils.metric / py_functional
def test_metrics_aggregate_by_type_and_append_to_dict_collects_them():
    collected: dict = {}
    for value in (torch.tensor(1.0), 2.0, 3):
        append_to_dict(collected, {"loss": Metric(AggregationType.SUM, value), "kl_max": [value]}, prefix="a/")
    append_to_dict(collected, {"a/grad": 0.5})
    assert isinstance(collected["a/loss"], Metric) and collected["a/loss"].values == [1.0, 2.0, 3]
    reduced = reduce_metrics(collected)
    assert reduced["a/loss"] == 6.0 and reduced["a/kl_max"] == 3 and reduced["a/grad"] == 0.5
    assert Metric.aggregate_dp([Metric("sum", [1.0, 2.0]), Metric("sum", [3.0, 4.0])]) == 5.0
    assert Metric.aggregate_dp([Metric("max", [1.0, 9.0]), Metric("max", [3.0, 4.0])]) == 9.0
    assert {k: m.aggregate() for k, m in Metric.from_dict({"x": 2.0}, "min").items()} == {"x": 2.0}


def test_metric_refuses_bad_input():
    with pytest.raises(ValueError, match=r"Unsupported aggregation type: 'median' \(one of \['mean'"):
        Metric("median")
    with pytest.raises(ValueError, match=r"a tensor of shape \(2,\) is not a scalar"):
        Metric("mean", torch.ones(2))
    with pytest.raises(ValueError, match="unsupported value type str"):
        Metric("mean", "1.0")
    with pytest.raises(ValueError, match="Aggregation type mismatch"):
        Metric("mean", 1.0).extend(Metric("sum", 1.0))
    with pytest.raises(ValueError, match=r"same number of values for dp aggregation: \[1, 2\]"):
        Metric.aggregate_dp([Metric("sum", 1.0), Metric("sum", [1.0, 2.0])])
    with pytest.raises(ValueError, match="empty list"):
        Metric.aggregate_dp([])


def test_metric_matches_verl():
    verl_metric = verl_module("verl.utils.metric")
    verl_py = verl_module("verl.utils.py_functional")
    values = [torch.tensor(0.25), 1.5, 2]
    for aggregation in ("mean", "sum", "min", "max"):
        ours, theirs = {}, {}
        for v in values:
            append_to_dict(ours, {"m": Metric(aggregation, v), "list_max": v if not torch.is_tensor(v) else 0.25})
            verl_py.append_to_dict(theirs, {"m": verl_metric.Metric(aggregation, v),
                                            "list_max": v if not torch.is_tensor(v) else 0.25})
        assert reduce_metrics(ours) == pytest.approx(verl_metric.reduce_metrics(theirs))


# ---------------------------------------------------------------- verl.utils.tensordict_utils
def test_get_tensordict_is_data_protos_layout_and_refuses_bad_columns():
    td = get_tensordict({"obs": torch.arange(3), "labels": ["a", "b", "c"], "scores": [[], [0.5], [1.0, 2.0]]},
                        {"name": "run"})
    back = DataProto.from_tensordict(td)
    assert back.non_tensor_batch["scores"].tolist() == [[], [0.5], [1.0, 2.0]] and back.meta_info == {"name": "run"}
    assert torch.equal(back.batch["obs"], torch.arange(3))
    with pytest.raises(ValueError, match="column 'bad' is a list holding tensors"):
        get_tensordict({"bad": [torch.ones(1)]})
    with pytest.raises(ValueError, match="column 'n' is a int, not a tensor, list or array"):
        get_tensordict({"n": 3})
    with pytest.raises(ValueError, match=r"non_tensor_batch\['labels'\]=2"):
        get_tensordict({"obs": torch.arange(3), "labels": np.array(["a", "b"], dtype=object)})


def test_get_tensordict_matches_verl():
    verl_tu = verl_module("verl.utils.tensordict_utils")
    columns = {"obs": torch.arange(6).view(3, 2), "labels": ["a", "b", "c"], "turns": [[1], [], [2, 3]]}
    ours, theirs = get_tensordict(columns, {"step": 4}), verl_tu.get_tensordict(dict(columns), {"step": 4})
    assert sorted(ours.keys()) == sorted(theirs.keys()) and ours.batch_size == theirs.batch_size
    assert torch.equal(ours["obs"], theirs["obs"])
    assert ours["labels"] == theirs["labels"] and ours["turns"] == theirs["turns"] and ours["step"] == theirs["step"]
