"""Every config-derived refusal of worker or engine code has its twin in validation (issue 33 item 11).

A ``raise ValueError(...)`` / ``raise ConfigError(...)`` in ``workers/``, ``rollout/``, ``weights/`` or ``servers/``
whose message names a config key comes after Ray and the model build, minutes to hours into a start. Each such
key must also be refused before start-up: named in a refusal of ``plan/validate.py``, ``config/checks.py`` or
``trainer/preflight.py`` (a string of a ``raise``, ``_require``, ``_positive``, ``ConfigError``/``CheckError``/
``PlanError`` call there), or a closed choice of the schema (refused at compose time), or listed in ALLOWED
below with the reason it can only be known at run time. Found by reading the code (ast), so a new refusal in
worker code fails this test until validation has its twin.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rl"
SCANNED = ("workers", "rollout", "weights", "servers")
VALIDATION = ("plan/validate.py", "config/checks.py", "trainer/preflight.py")
KEY = re.compile(r"\b(?:actor_rollout_ref|rollout|critic|data|trainer|algorithm|reward_model)\.[A-Za-z_][\w.]*\w")
REFUSING_CALLS = {"_require", "_positive", "ConfigError", "CheckError", "PlanError"}
RAISED = {"ValueError", "ConfigError"}

# (file, key) -> why validation cannot refuse it before start-up.
ALLOWED = {
    ("rollout/sglang/server_transport.py", "actor_rollout_ref.rollout.sglang.master_address"):
        "null means this host's address, resolved on the trainer's rank-0 node when the update group forms; only "
        "there is it known whether it is loopback while the servers are on other hosts",
}


def _strings(node: ast.AST) -> str:
    return " ".join(n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str))


def _name(func: ast.AST) -> str:
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


def _short(key: str) -> str:
    return key.removeprefix("actor_rollout_ref.")


def raised_keys() -> dict[tuple[str, str], int]:
    """(file, key) -> line of each config key named by a ValueError / ConfigError raised in the scanned packages."""
    found: dict[tuple[str, str], int] = {}
    for package in SCANNED:
        for path in sorted((PACKAGE / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and _name(node.exc.func) in RAISED:
                    for key in KEY.findall(_strings(node.exc)):
                        found.setdefault((str(path.relative_to(PACKAGE)), key), node.lineno)
    return found


def validation_messages() -> str:
    texts = []
    for name in VALIDATION:
        for node in ast.walk(ast.parse((PACKAGE / name).read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                texts.append(_strings(node.exc))
            elif isinstance(node, ast.Call) and _name(node.func) in REFUSING_CALLS:
                texts.append(_strings(node))
    return "\n".join(texts)


def schema_choices() -> set[str]:
    from megatron_rl.config.checks import _choice_fields
    from megatron_rl.config.schema import PPOTrainerConfig

    return {_short(key) for key, _ in _choice_fields(PPOTrainerConfig)}


def test_the_scan_finds_the_refusals_it_is_about():
    keys = raised_keys()
    assert ("weights/replica.py", "rollout.weight_sync.verify_freq") in keys
    assert ("rollout/hf_engine.py", "rollout.response_length") in keys
    assert len(keys) >= 10


def test_every_config_refusal_in_worker_code_is_refused_by_validation_first():
    messages, choices = validation_messages(), schema_choices()
    missing = []
    for (path, key), line in sorted(raised_keys().items()):
        if (path, key) in ALLOWED or _short(key) in messages or _short(key) in choices:
            continue
        missing.append(f"megatron_rl/{path}:{line} refuses {key}")
    assert not missing, ("refused only after start-up; add the check to plan/validate.py (or preflight) naming the "
                         "key, or an ALLOWED entry with the reason it can only be known at run time:\n  "
                         + "\n  ".join(missing))


def test_allowed_entries_are_still_needed():
    raised = raised_keys()
    stale = [entry for entry in ALLOWED if entry not in raised]
    assert not stale, f"ALLOWED entries whose refusal is gone: {stale}"
    assert all(reason.strip() for reason in ALLOWED.values())
