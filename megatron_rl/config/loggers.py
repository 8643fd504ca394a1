"""``trainer.logger``: the sinks megatron-rl has, verl's names for them, and what is wrong with a value (its
shape, an unknown or refused backend, a package that does not import here). Checked before anything starts
(trainer/preflight.py, the planner CLI); the sinks themselves are trainer/tracking.py."""
from __future__ import annotations

from typing import Any

KNOWN_BACKENDS = ("console", "jsonl", "file", "tensorboard", "wandb", "mlflow", "swanlab", "clearml", "trackio")
# verl's `file` writes one JSON line per step, as our jsonl does (into <default_local_dir>/metrics.jsonl here).
ALIASES = {"file": "jsonl"}
# verl values that do not run here, and what to use instead.
REFUSED_BACKENDS = {
    "vemlp_wandb": "Volcano Engine ML platform's W&B is not supported here; use wandb (WANDB_BASE_URL for a "
                   "self-hosted server) or tensorboard",
    "rl_insight": "rl-insight's monitoring is not supported here; use tensorboard or jsonl (metrics.jsonl)",
    "tracking": "verl's deprecated name of wandb; write wandb",
}
# The package each backend imports when the run starts logging (checked before start-up: backend_problem).
BACKEND_MODULES = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb", "mlflow": "mlflow",
                   "swanlab": "swanlab", "clearml": "clearml", "trackio": "trackio"}


def logger_backends(value: Any) -> list[str]:
    """``trainer.logger`` as a list of names: a list, one name (``console``), or a list written as a string
    (verl's ``'["console","wandb"]'`` when it reaches the config quoted)."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            import yaml

            try:
                value = yaml.safe_load(text)
            except yaml.YAMLError as err:
                raise ValueError(f"trainer.logger={value!r} is not a list of names ({err})") from None
        else:
            value = [text]
    try:
        names = list(value)
    except TypeError:
        raise ValueError(f"trainer.logger={value!r} must be a list of names or one name") from None
    if not all(isinstance(name, str) for name in names):
        raise ValueError(f"trainer.logger={names!r} must hold names (strings)")
    return names


def config_problem(value: Any) -> str | None:
    """What is wrong with ``trainer.logger`` on any machine: its shape, an unknown or refused backend."""
    try:
        backends = logger_backends(value)
    except ValueError as err:
        return str(err)
    refused = [b for b in backends if b in REFUSED_BACKENDS]
    if refused:
        return "; ".join(f"trainer.logger names {b!r}: {REFUSED_BACKENDS[b]}" for b in refused)
    unknown = [b for b in backends if b not in KNOWN_BACKENDS]
    if unknown:
        return f"trainer.logger has unknown backends {unknown}; known: {list(KNOWN_BACKENDS)}"
    return None


def package_problem(value: Any) -> str | None:
    """A chosen backend whose package does not import on this machine (call after ``config_problem``)."""
    import importlib

    backends = logger_backends(value)
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


def backend_problem(value: Any) -> str | None:
    """Why ``trainer.logger`` cannot log here (its shape, an unknown or refused backend, a package that does not
    import), or None."""
    return config_problem(value) or package_problem(value)
