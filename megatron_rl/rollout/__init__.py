"""Rollout: generation only (docs/rollout.md). The engine interface (``base``), the HF engine (``hf_engine``),
SGLang's contract, adapter and transports (``sglang``; it never imports sglang itself until an engine is built),
sampling, batch I/O and the rollout mesh (which ranks form which engine). Weights reach engines through
``megatron_rl.weights``; the server fleet is ``megatron_rl.servers``; the multi-turn loop ``megatron_rl.agent``.
"""
from importlib import import_module
from typing import Any

# Imported at first use (PEP 562): a process that needs one light module of the package (the server key's Ray
# actor, rollout/server_key.py) does not pay for torch and transformers through this file.
_EXPORTS = {"RolloutEngine": "base", "WeightUpdateError": "base", "build_rollout_engine": "engines",
            "HFEngine": "hf_engine"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
