"""Metric sinks: console (tqdm), metrics.jsonl, TensorBoard, and W&B / MLflow when installed and chosen."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Protocol, Sequence

from tqdm import tqdm

logger = logging.getLogger(__name__)

KNOWN_BACKENDS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
# The package each backend imports when the run starts logging (checked before start-up: backend_problem).
BACKEND_MODULES = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def backend_problem(backends: Sequence[str] | str) -> str | None:
    """Why ``trainer.logger`` cannot log here (an unknown backend, a package that does not import), or None."""
    backends = [backends] if isinstance(backends, str) else [str(b) for b in backends]
    unknown = [b for b in backends if b not in KNOWN_BACKENDS]
    if unknown:
        return f"trainer.logger has unknown backends {unknown}; known: {list(KNOWN_BACKENDS)}"
    import importlib

    for backend in backends:
        module = BACKEND_MODULES.get(backend)
        if module is None:
            continue
        try:
            importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - ImportError, or a package that fails while importing
            package = module.split(".")[0] if backend != "tensorboard" else "tensorboard"
            return (f"trainer.logger={backends} names {backend!r}, but {module} does not import here "
                    f"({type(err).__name__}: {err}); install {package} (pip install {package}) or remove "
                    f"{backend!r} from trainer.logger")
    return None
# What the console line shows each step: the numbers a person watches.
CONSOLE_KEYS = ("critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "response_length/mean", "timing_s/step")


class Sink(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


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

    def close(self) -> None:
        self.bar.close()


class JsonlSink:
    """Appends one JSON record per step. Records after ``initial_step`` are dropped on open: they belong
    to an earlier run (a fresh start) or to steps past the checkpoint a resumed run restarts from."""

    def __init__(self, path: Path, initial_step: int) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # A fresh start keeps nothing, so an old (even damaged) file is not read at all. A resumed one
            # tolerates a torn last record (what a full disk or a kill mid-write leaves): dropped, with a warning.
            kept = [r for r in read_metrics(path, tolerate_torn_tail=True) if r["step"] <= initial_step] \
                if initial_step > 0 and path.exists() else []
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            tmp.replace(path)
            self.file = path.open("a", buffering=1)  # line-buffered: a crash loses at most the current line
        except OSError as err:
            raise OSError(err.errno, f"writing {path} failed: {err.strerror or err}") from err

    def log(self, metrics: dict[str, float], step: int) -> None:
        record = {"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()}}
        try:
            self.file.write(json.dumps(record) + "\n")
        except OSError as err:
            raise OSError(err.errno, f"writing step {step} to {self.path} failed: {err.strerror or err}") from err

    def close(self) -> None:
        self.file.close()


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

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, project: str, name: str, config: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(project=project, name=name, config=config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

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

    def close(self) -> None:
        self.mlflow.end_run()


class Tracking:
    """Fans each step's metrics out to the chosen sinks. Only the driver (or rank 0) builds one."""

    def __init__(self, backends: Sequence[str], output_dir: Path, project: str, experiment: str,
                 total_steps: int, initial_step: int = 0, config: dict[str, Any] | None = None) -> None:
        unknown = [b for b in backends if b not in KNOWN_BACKENDS]
        if unknown:
            raise ValueError(f"trainer.logger has unknown backends {unknown}; known: {list(KNOWN_BACKENDS)}")
        self.metrics_path = output_dir / "metrics.jsonl"
        self.tensorboard_dir = output_dir / "tensorboard"
        self.sinks: list[Sink] = []
        for backend in backends:
            if backend == "console":
                self.sinks.append(ConsoleSink(total_steps, initial_step))
            elif backend == "jsonl":
                self.sinks.append(JsonlSink(self.metrics_path, initial_step))
            elif backend == "tensorboard":
                self.sinks.append(TensorBoardSink(self.tensorboard_dir, initial_step))
            elif backend == "wandb":
                self.sinks.append(WandbSink(project, experiment, config or {}))
            elif backend == "mlflow":
                self.sinks.append(MlflowSink(project, experiment))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

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
