"""trainer.logger takes verl's values: each either logs here (swanlab, clearml, trackio as sinks when their package
imports; file = our jsonl) or is refused before start-up naming the value and what to use; a missing package is
refused by preflight (the launch machine) and a warning in the planner (`python -m megatron_rl.plan`, which may
run elsewhere). Validation samples (trainer.log_val_generations) reach the console, jsonl and TensorBoard. wandb logs
for real (offline), from where `make install` puts it (beside the venv, off the path of other tests)."""
from __future__ import annotations

import json
import sys
from types import ModuleType

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.trainer.preflight import check_loggers
from megatron_rl.config.loggers import backend_problem, logger_backends
from megatron_rl.trainer.tracking import GENERATIONS_FILE, JsonlSink, Tracking, read_metrics
from megatron_rl_testing.wandb_offline import read_offline_run, use_wandb

VERL_VALUES = ("wandb", "mlflow", "swanlab", "vemlp_wandb", "tensorboard", "console", "clearml", "trackio", "file")


def _cfg(logger: str, *overrides: str):
    return load_config(overrides=[f"trainer.logger={logger}", *overrides])


def _missing(monkeypatch, *modules: str) -> None:
    for name in modules:  # `import name` raises ImportError while sys.modules holds None for it
        monkeypatch.setitem(sys.modules, name, None)


class Recorder:
    """Stands in for a tracking package: records every call made on it or on what its calls return
    (``clearml.Task.init(...)`` records ``init``)."""

    def __init__(self, name: str) -> None:
        self.name, self.calls, self.pending = name, [], None

    def __getattr__(self, attr):
        self.pending = attr
        return self

    def __call__(self, *args, **kwargs):
        self.calls.append((self.pending, args, kwargs))
        return self


def _fake(monkeypatch, name: str) -> Recorder:
    recorder = Recorder(name)
    module = ModuleType(name)

    def attribute(attr: str):
        if attr.startswith("__"):  # what importers probe (__file__, __path__): a plain module's answer
            raise AttributeError(attr)
        return getattr(recorder, attr)

    module.__getattr__ = attribute
    monkeypatch.setitem(sys.modules, name, module)
    return recorder


# ---------------------------------------------------------------------- what trainer.logger may say
def test_verls_spellings_of_the_list():
    # verl's scripts: trainer.logger='["console","wandb"]' reaches Hydra unquoted by the shell
    assert list(_cfg('["console","wandb"]').trainer.logger) == ["console", "wandb"]
    assert list(_cfg("['console','tensorboard']").trainer.logger) == ["console", "tensorboard"]
    assert list(_cfg("[console,file]").trainer.logger) == ["console", "file"]
    # a bare name is a list of one to Tracking (verl's Tracking(default_backend="console")), and so is a list
    # written as a string; the config itself holds a list: trainer.logger=console is refused naming the key
    assert logger_backends("console") == ["console"]
    assert logger_backends('["console","wandb"]') == ["console", "wandb"]
    with pytest.raises(ConfigError, match=r"full_key: trainer.logger"):
        _cfg("console")


def test_every_verl_value_either_logs_or_is_refused_with_what_to_use(monkeypatch):
    for name in ("wandb", "mlflow", "swanlab", "clearml", "trackio"):
        _fake(monkeypatch, name)
    for value in VERL_VALUES:
        problem = backend_problem([value])
        if value == "vemlp_wandb":
            assert problem == ("trainer.logger names 'vemlp_wandb': Volcano Engine ML platform's W&B is not "
                               "supported here; use wandb (WANDB_BASE_URL for a self-hosted server) or tensorboard")
        else:
            assert problem is None, value
    assert "use tensorboard or jsonl" in backend_problem(["console", "rl_insight"])
    assert "verl's deprecated name of wandb; write wandb" in backend_problem(["tracking"])


def test_an_unknown_value_is_refused_naming_it(monkeypatch):
    with pytest.raises(ConfigError, match=r"trainer.logger has unknown backends \['neptune'\]; known: \['console', "):
        check_loggers(_cfg("[console,neptune]"))
    assert backend_problem([1, 2]) == "trainer.logger=[1, 2] must hold names (strings)"
    assert backend_problem("[console").startswith("trainer.logger='[console' is not a list of names")


@pytest.mark.parametrize("backend", ["swanlab", "clearml", "trackio", "wandb", "mlflow"])
def test_a_missing_package_is_refused_before_start_up(monkeypatch, backend):
    _missing(monkeypatch, backend)
    with pytest.raises(ConfigError, match=rf"names '{backend}', but {backend} does not import here \(.*\); "
                                          rf"install {backend} \(pip install {backend}\)"):
        check_loggers(_cfg(f'["console","{backend}"]'))


def test_the_check_start_runs_refuses_a_missing_package_of_verls_line(monkeypatch, tmp_path):
    """train.py (and --dry-run) calls preflight.check_start before the run lock, Ray or any worker."""
    import megatron_rl.trainer.preflight as preflight

    _missing(monkeypatch, "wandb")
    reached = []
    monkeypatch.setattr(preflight, "check_rollout_engine", lambda cfg: reached.append("after the loggers"))
    with pytest.raises(ConfigError, match="names 'wandb', but wandb does not import here"):
        preflight.preflight(_cfg('["console","wandb"]', f"trainer.default_local_dir={tmp_path / 'run'}"))
    assert reached == []


def test_the_planner_warns_about_a_missing_package_and_still_plans(monkeypatch, capsys):
    from megatron_rl.plan.cli import main

    _missing(monkeypatch, "swanlab")
    assert main(["+experiment=grpo_70b", "trainer.logger=[console,swanlab]"]) == 0
    out, err = capsys.readouterr()
    assert "warning: trainer.logger=['console', 'swanlab'] names 'swanlab', but swanlab does not import" in err
    assert "GPUs: 64" in out
    assert main(["+experiment=grpo_70b", "trainer.logger=[console,vemlp_wandb]"]) == 1
    assert "rejected: trainer.logger names 'vemlp_wandb'" in capsys.readouterr().err


# ---------------------------------------------------------------------- the sinks
def test_swanlab_trackio_clearml_sinks_log_through_their_packages(monkeypatch, tmp_path):
    fakes = {name: _fake(monkeypatch, name) for name in ("swanlab", "trackio", "clearml")}
    tracking = Tracking(["swanlab", "trackio", "clearml"], tmp_path, "proj", "exp", total_steps=2,
                        config={"a": 1})
    tracking.log({"critic/score/mean": 0.5, "val-core/x/acc/mean@4": 1.0}, step=3)
    tracking.close()
    calls = {name: [c[0] for c in fake.calls] for name, fake in fakes.items()}
    assert calls["swanlab"] == ["init", "log", "finish"]
    assert fakes["swanlab"].calls[0][2] == {"project": "proj", "experiment_name": "exp", "config": {"a": 1}}
    assert fakes["swanlab"].calls[1][1:] == (({"critic/score/mean": 0.5, "val-core/x/acc/mean@4": 1.0},),
                                             {"step": 3})
    assert calls["trackio"] == ["init", "log", "finish"]
    assert ("report_scalar", (), {"title": "val-core", "series": "x/acc/mean@4", "value": 1.0, "iteration": 3}) \
        in fakes["clearml"].calls
    assert calls["clearml"][-1] == "close"


def test_file_is_our_jsonl_and_one_sink_with_jsonl(tmp_path):
    tracking = Tracking(["file", "jsonl"], tmp_path, "p", "e", total_steps=1)
    assert len(tracking.sinks) == 1 and isinstance(tracking.sinks[0], JsonlSink)
    tracking.log({"a": 1.0}, step=1)
    tracking.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "a": 1.0}]


def test_validation_samples_reach_console_jsonl_tensorboard_and_wandb(monkeypatch, tmp_path, capsys):
    wandb = _fake(monkeypatch, "wandb")
    samples = [("what is 1+1?", "2", 1.0), ("and 2+2?", "5", 0.0)]
    tracking = Tracking(["console", "jsonl", "tensorboard", "wandb"], tmp_path, "p", "e", total_steps=4)
    tracking.log_generations(samples, step=2)
    tracking.close()
    assert "step 2 validation sample 1/2 (score 1.0000)\n[input] what is 1+1?\n[output] 2" in capsys.readouterr().out
    lines = [json.loads(line) for line in (tmp_path / GENERATIONS_FILE).read_text().splitlines()]
    assert lines == [{"step": 2, "input": "what is 1+1?", "output": "2", "score": 1.0},
                     {"step": 2, "input": "and 2+2?", "output": "5", "score": 0.0}]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    [text] = events.Tensors("val/generations/text_summary")
    assert b"**Input:** what is 1+1?" in text.tensor_proto.string_val[0]
    assert ("Table", (), {"columns": ["step", "input", "output", "score"],
                          "data": [[2, "what is 1+1?", "2", 1.0], [2, "and 2+2?", "5", 0.0]]}) in wandb.calls


def test_jsonl_samples_past_a_resumed_step_are_dropped_and_a_fresh_start_forgets_them(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl", initial_step=0)
    sink.log_generations([("a", "b", 1.0)], step=2)
    sink.log_generations([("c", "d", 0.0)], step=4)
    sink.close()
    resumed = JsonlSink(tmp_path / "metrics.jsonl", initial_step=2)
    resumed.log_generations([("e", "f", 1.0)], step=4)
    resumed.close()
    assert [(r["step"], r["input"]) for r in read_metrics(tmp_path / GENERATIONS_FILE)] == [(2, "a"), (4, "e")]
    JsonlSink(tmp_path / "metrics.jsonl", initial_step=0).close()
    assert not (tmp_path / GENERATIONS_FILE).exists()


def test_file_with_verls_file_logger_variables_warns_they_are_not_read(monkeypatch, caplog):
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", "/tmp/x.jsonl")
    check_loggers(_cfg("[console,file]"))
    assert "VERL_FILE_LOGGER_PATH is not read" in caplog.text


def test_wandb_logs_for_real_offline_with_verls_metric_names(monkeypatch, tmp_path):
    """The real wandb package (`make install` puts it beside the venv), as verl's scripts log (trainer.logger=[console,wandb])
    with WANDB_MODE=offline: the run's project and experiment name and every step's metrics, under the names
    metrics.jsonl gives them, land in the offline run file; the validation samples as a table."""
    use_wandb(monkeypatch)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    tracking = Tracking(["console", "jsonl", "wandb"], tmp_path / "run", "gsm8k_grpo", "qwen3_8b", total_steps=2,
                        config={"actor_rollout_ref": {"rollout": {"n": 5}}})
    for step in (1, 2):
        tracking.log({"actor/pg_loss": -0.25 * step, "critic/score/mean": 0.5 + step / 10, "timing_s/step": 1.5}, step)
    tracking.log_generations([("what is 1+1?", "2", 1.0)], 2)
    tracking.close()
    run = read_offline_run(tmp_path)
    assert (run.project, run.name) == ("gsm8k_grpo", "qwen3_8b")
    logged = {row["_step"]: row for row in run.history}
    for record in read_metrics(tmp_path / "run" / "metrics.jsonl"):
        step = record.pop("step")
        assert {k: logged[step][k] for k in record} == record
    assert logged[2]["val/generations/_type"] == "table-file"
