"""The engine seam (rollout/engines.py): every decision that depends on ``rollout.name`` reads the engine's
``EngineSpec``; the choice is compared in one file, each engine declares every part, and a new engine is one spec."""
from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

import megatron_rl
from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.schema import RolloutEngineName
from megatron_rl.plan.validate import validate
from megatron_rl.rollout import engines
from megatron_rl.rollout.engines import ENGINES, build_rollout_engine, engine_of

PACKAGE = Path(megatron_rl.__file__).parent
# verl's keys are translated before our config exists (compat/verl/keys.py reads verl's rollout.name there)
READERS = {"rollout/engines.py"}
EXEMPT = ("compat/",)


def engine_comparisons(path: Path) -> list[str]:
    """Each comparison of a value with an engine's name (``x == "vllm"``, ``x in ("hf", "vllm")``) in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        names = [e for o in operands for e in ([o] if isinstance(o, ast.Constant) else getattr(o, "elts", []))
                 if isinstance(e, ast.Constant) and e.value in ENGINES]
        if names:
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_engine_choice_is_compared_in_one_file():
    found = [hit for path in sorted(PACKAGE.rglob("*.py"))
             if str(path.relative_to(PACKAGE)) not in READERS and not str(path.relative_to(PACKAGE)).startswith(EXEMPT)
             for hit in engine_comparisons(path)]
    assert not found, "compare rollout.name through rollout/engines.py (EngineSpec), not here:\n" + "\n".join(found)


def test_the_guard_finds_a_comparison(tmp_path):
    probe = PACKAGE / "_probe_engine_seam.py"  # under the package, so the relative name resolves
    try:
        probe.write_text('def f(rollout):\n    return rollout.name in ("hf", "vllm") or rollout.mode == "x"\n')
        assert engine_comparisons(probe) == ['_probe_engine_seam.py:2: rollout.name in (\'hf\', \'vllm\')']
    finally:
        probe.unlink()


def test_every_engine_is_declared_whole():
    from megatron_rl.trainer.disaggregated import ASYNC_CLIENTS, SERVER_LAUNCHERS

    assert set(ENGINES) == {e.value for e in RolloutEngineName}  # the schema's choices are the registry's
    assert set(SERVER_LAUNCHERS) == {name for name, spec in ENGINES.items() if spec.run_starts_servers}
    assert set(ASYNC_CLIENTS) == set(ENGINES)
    for name, spec in ENGINES.items():
        assert spec.name == name
        for part in ("memory", "build", "placement", "check_config", "check_here", "serve_checkpoint"):
            assert callable(getattr(spec, part)), (name, part)


def test_an_unknown_engine_is_refused_naming_the_key_and_the_choices():
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.rollout.name must be one of hf, sglang, vllm, got 'trt'"):
        engine_of(SimpleNamespace(name="trt"))


def test_a_new_engine_is_one_spec(monkeypatch):
    """A spec added to the registry is built, placed and checked through it alone."""
    built, checked = [], []

    def build(config, model_path, **kwargs):
        built.append((config.name, model_path, kwargs))
        return "engine"

    spec = replace(ENGINES["hf"], name="trt", tensor_parallel=True, build=build,
                   placement=lambda replica, cfg, on_gpu: {"gpu": replica.index},
                   check_config=lambda cfg: checked.append(cfg))
    monkeypatch.setitem(engines.ENGINES, "trt", spec)
    rollout = SimpleNamespace(name="trt", mode="colocated")
    replica = SimpleNamespace(index=3)
    assert build_rollout_engine(rollout, "/m", response_length=4,
                                **engine_of(rollout).placement(replica, None, True)) == "engine"
    assert built == [("trt", "/m", {"response_length": 4, "eos_token_id": None, "pad_token_id": None,
                                    "override_config": None, "gpu": 3})]


def test_rollout_servers_never_see_override_config_whatever_the_engine():
    """Refused in validation for every engine's servers (before: the HF and vLLM servers' refusal came when the
    engine was built, after Ray and the trainer's workers had started)."""
    override = "+actor_rollout_ref.model.override_config.rope_theta=1e6"
    for engine, servers in (("hf", "actor_rollout_ref.rollout.num_servers=1"),
                            ("vllm", "actor_rollout_ref.rollout.num_servers=1"),
                            ("sglang", "actor_rollout_ref.rollout.server_urls=[http://x:1]")):
        cfg = load_config(overrides=["+experiment=grpo_tiny_cpu", override, f"actor_rollout_ref.rollout.name={engine}",
                                     "actor_rollout_ref.rollout.mode=server", servers,
                                     *(["trainer.device=cuda"] if engine == "sglang" else [])])
        with pytest.raises(ConfigError, match=f"override_config=.*rope_theta.*{engine} rollout servers never see it"):
            validate(cfg)


def test_a_tensor_parallel_rollout_needs_an_engine_that_has_it():
    cfg = load_config(overrides=["+experiment=grpo_tiny_cpu", "trainer.n_gpus_per_node=2",
                                 "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    with pytest.raises(ConfigError, match="rollout.name=hf runs one model per process.*use rollout.name=sglang or vllm"):
        validate(cfg)
