"""Metric sinks: console (tqdm), metrics.jsonl, TensorBoard, and W&B / MLflow / SwanLab / ClearML / Trackio when
installed and chosen. ``trainer.logger`` takes verl's values; ``file`` is our jsonl, and the verl values that do
not run here are refused before start-up with what to use instead (config/loggers.py)."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Protocol, Sequence

from tqdm import tqdm

from megatron_rl.config.loggers import ALIASES, config_problem, logger_backends

logger = logging.getLogger(__name__)

# What the console line shows each step: the numbers a person watches.
CONSOLE_KEYS = ("critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "response_length/mean", "timing_s/step")


class Sink(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...
    # optional: log_generations(samples, step), samples as (input, output, score) (trainer.log_val_generations)


Generation = tuple[str, str, float]  # (input, output, score) of one validation sample


class ConsoleSink:
    def __init__(self, total_steps: int, initial_step: int) -> None:
        self.bar = tqdm(total=total_steps, initial=initial_step, desc="training", unit="step", dynamic_ncols=True)

    def log(self, metrics: dict[str, float], step: int) -> None:
        shown = {k.split("/", 1)[-1] if k != "timing_s/step" else "s/step": round(v, 4)
                 for k, v in metrics.items() if k in CONSOLE_KEYS}
        validation = {k: v for k, v in metrics.items() if k.startswith("val-core/")}
        if validation:
            tqdm.write(f"step {step} validation: " + ", ".join(f"{k}={v:.4f}" for k, v in validation.items()))
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(max(0, step - self.bar.n))

    def log_generations(self, samples: Sequence[Generation], step: int) -> None:
        for i, (text_in, text_out, score) in enumerate(samples, start=1):
            tqdm.write(f"step {step} validation sample {i}/{len(samples)} (score {score:.4f})\n"
                       f"[input] {text_in}\n[output] {text_out}")

    def close(self) -> None:
        self.bar.close()


class JsonlSink:
    """Appends one JSON record per step. Records after ``initial_step`` are dropped on open: they belong
    to an earlier run (a fresh start) or to steps past the checkpoint a resumed run restarts from.
    Validation samples go to ``val_generations.jsonl`` beside it, one record per sample, kept alike."""

    def __init__(self, path: Path, initial_step: int) -> None:
        self.path = path
        self.file = _open_records(path, initial_step)
        self.generations_path = path.with_name(GENERATIONS_FILE)
        self.initial_step = initial_step
        self.generations = None  # opened at the first samples
        if initial_step == 0 and self.generations_path.exists():
            self.generations_path.unlink()  # an earlier run's samples

    def log(self, metrics: dict[str, float], step: int) -> None:
        record = {"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()}}
        _write(self.file, self.path, record, step)

    def log_generations(self, samples: Sequence[Generation], step: int) -> None:
        if self.generations is None:
            self.generations = _open_records(self.generations_path, self.initial_step)
        for text_in, text_out, score in samples:
            record = {"step": step, "input": text_in, "output": text_out, "score": float(score)}
            _write(self.generations, self.generations_path, record, step)

    def close(self) -> None:
        self.file.close()
        if self.generations is not None:
            self.generations.close()


GENERATIONS_FILE = "val_generations.jsonl"


def _open_records(path: Path, initial_step: int):
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # A fresh start keeps nothing, so an old (even damaged) file is not read at all. A resumed one
        # tolerates a torn last record (what a full disk or a kill mid-write leaves): dropped, with a warning.
        kept = [r for r in read_metrics(path, tolerate_torn_tail=True) if r["step"] <= initial_step] \
            if initial_step > 0 and path.exists() else []
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(path)
        return path.open("a", buffering=1)  # line-buffered: a crash loses at most the current line
    except OSError as err:
        raise OSError(err.errno, f"writing {path} failed: {err.strerror or err}") from err


def _write(file: Any, path: Path, record: dict[str, Any], step: int) -> None:
    try:
        file.write(json.dumps(record) + "\n")
    except OSError as err:
        raise OSError(err.errno, f"writing step {step} to {path} failed: {err.strerror or err}") from err


def generations_markdown(samples: Sequence[Generation], step: int) -> str:
    """The samples as one Markdown text (TensorBoard's text tab), as verl writes them."""
    parts = [f"**Generation Results - Step {step}**\n"]
    for i, (text_in, text_out, score) in enumerate(samples, start=1):
        parts.append(f"### Sample {i}\n**Input:** {text_in}\n\n**Output:** {text_out}\n\n**Score:** {score}\n\n---\n")
    return "\n".join(parts)


class TensorBoardSink:
    def __init__(self, log_dir: Path, initial_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if initial_step == 0 and log_dir.is_dir():
            # A fresh start: the events of an earlier run in this directory would mix with the new ones.
            for old in log_dir.glob("events.out.tfevents.*"):
                old.unlink()
        # Resumed: TensorBoard drops every earlier event past the checkpoint's step, as metrics.jsonl does.
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=initial_step + 1 if initial_step > 0 else None)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def log_generations(self, samples: Sequence[Generation], step: int) -> None:
        self.writer.add_text("val/generations", generations_markdown(samples, step), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, project: str, name: str, config: dict[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=project, name=name, config=config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_generations(self, samples: Sequence[Generation], step: int) -> None:
        table = self.wandb.Table(columns=["step", "input", "output", "score"], data=[[step, *s] for s in samples])
        self.run.log({"val/generations": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    def __init__(self, experiment: str, run_name: str) -> None:
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(experiment)
        mlflow.start_run(run_name=run_name)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics({k.replace("@", "_at_"): v for k, v in metrics.items()}, step=step)

    def log_generations(self, samples: Sequence[Generation], step: int) -> None:
        records = [{"input": i, "output": o, "score": s} for i, o, s in samples]
        self.mlflow.log_dict(records, f"val_generations/step_{step}.json")

    def close(self) -> None:
        self.mlflow.end_run()


class SwanlabSink:
    def __init__(self, project: str, experiment: str, config: dict[str, Any]) -> None:
        import swanlab

        self.swanlab = swanlab
        swanlab.init(project=project, experiment_name=experiment, config=config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.swanlab.log(metrics, step=step)

    def close(self) -> None:
        self.swanlab.finish()


class TrackioSink:
    def __init__(self, project: str, name: str, config: dict[str, Any]) -> None:
        import trackio

        self.trackio = trackio
        trackio.init(project=project, name=name, config=config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.trackio.log(metrics, step=step)

    def close(self) -> None:
        self.trackio.finish()


class ClearmlSink:
    """A ClearML task (continued when the last one of this name did not finish, as verl does); a metric
    ``a/b/c`` is plot ``a``, series ``b/c``."""

    def __init__(self, project: str, task: str, config: dict[str, Any]) -> None:
        import clearml

        self.task = clearml.Task.init(project_name=project, task_name=task, continue_last_task=True,
                                      output_uri=False)
        self.task.connect_configuration(config, name="Hyperparameters")

    def log(self, metrics: dict[str, float], step: int) -> None:
        report = self.task.get_logger()
        for key, value in metrics.items():
            title, _, series = key.partition("/")
            report.report_scalar(title=title, series=series or title, value=value, iteration=step)

    def close(self) -> None:
        self.task.close()


class Tracking:
    """Fans each step's metrics out to the chosen sinks. Only the driver (or rank 0) builds one."""

    def __init__(self, backends: Any, output_dir: Path, project: str, experiment: str,
                 total_steps: int, initial_step: int = 0, config: dict[str, Any] | None = None) -> None:
        problem = config_problem(backends)
        if problem is not None:
            raise ValueError(problem)
        self.metrics_path = output_dir / "metrics.jsonl"
        self.tensorboard_dir = output_dir / "tensorboard"
        self.sinks: list[Sink] = []
        config = config or {}
        chosen = dict.fromkeys(ALIASES.get(b, b) for b in logger_backends(backends))  # `file` and `jsonl`: one sink
        for backend in chosen:
            if backend == "console":
                self.sinks.append(ConsoleSink(total_steps, initial_step))
            elif backend == "jsonl":
                self.sinks.append(JsonlSink(self.metrics_path, initial_step))
            elif backend == "tensorboard":
                self.sinks.append(TensorBoardSink(self.tensorboard_dir, initial_step))
            elif backend == "wandb":
                self.sinks.append(WandbSink(project, experiment, config))
            elif backend == "mlflow":
                self.sinks.append(MlflowSink(project, experiment))
            elif backend == "swanlab":
                self.sinks.append(SwanlabSink(project, experiment, config))
            elif backend == "trackio":
                self.sinks.append(TrackioSink(project, experiment, config))
            elif backend == "clearml":
                self.sinks.append(ClearmlSink(project, experiment, config))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def log_generations(self, samples: Sequence[Generation], step: int) -> None:
        """Validation samples (trainer.log_val_generations) to every sink that shows text."""
        for sink in self.sinks:
            if hasattr(sink, "log_generations"):
                sink.log_generations(samples, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def read_metrics(path: Path, tolerate_torn_tail: bool = False) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, in order (used by the plot, the demo, tests and a resumed run).

    A line that is not a JSON record is an error naming the file and line, except, with
    ``tolerate_torn_tail``, the last one: a record cut short by a crash or a full disk, dropped with a warning."""
    path = Path(path)
    with path.open() as f:
        lines = [(i, line) for i, line in enumerate(f, start=1) if line.strip()]
    records = []
    for i, line in lines:
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or "step" not in record:
                raise ValueError("not a record with a 'step'")
        except ValueError as err:
            if tolerate_torn_tail and i == lines[-1][0]:
                logger.warning("%s line %d is a torn record (%s); dropping it", path, i, line.strip()[:60])
                break
            raise ValueError(f"{path} line {i} is not a metrics record ({err}): {line.strip()[:80]!r}; "
                             f"fix or remove the line (or the file)") from err
        records.append(record)
    return records


def plot_curves(metrics_path: Path, out_png: Path,
                keys: Sequence[str] = ("critic/score/mean", "response_length/mean")) -> Path:
    """One PNG with a panel per key, a point per step that logged it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5))
    for ax, key in zip(axes if len(keys) > 1 else [axes], keys):
        points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        if points:
            ax.plot(*zip(*points), marker="o", markersize=3)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
