"""Test tools that the product never imports: tiny random checkpoints and tokenizers (``tiny_models``), tiny reward
models (``reward_models``), a strict CPU model of NCCL's device rule (``nccl_like``), a traffic counter
(``traffic_counter``) and scripts/ as modules (``scripts``). pytest finds them through ``pythonpath`` in
pyproject.toml; the processes tests start find them through PYTHONPATH (``export_support_path``)."""
from __future__ import annotations

import os

SUPPORT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def export_support_path() -> None:
    """Put tests/support on PYTHONPATH, so every process a test starts (spawn, torchrun, subprocess) imports us."""
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if SUPPORT not in entries:
        os.environ["PYTHONPATH"] = os.pathsep.join([SUPPORT, *entries])
