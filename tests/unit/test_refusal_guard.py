"""Every config-derived refusal of worker or engine code has its twin in validation (issue 33 item 11, issue 56 item 6).

A ``raise`` of ``ValueError`` / ``ConfigError`` / ``RuntimeError`` / ``TypeError`` / ``KeyError`` / ``CheckError`` /
``PlanError`` in ``workers/``, ``rollout/``, ``weights/``, ``servers/``, ``algos/``, ``data/``, ``reward/``,
``trainer/``, ``agent/`` or ``models/`` (preflight's own file aside) whose message names a config key comes after
Ray and the model build, minutes to hours into a start (or, in the driver's set-up, after what ``--dry-run``
checks). Each such key must also be refused before start-up:

* by construction: the raise sits in a function that validation or preflight calls itself (imported into
  ``plan/validate.py``, ``config/checks.py`` or ``trainer/preflight.py`` and called there, through a package's
  re-export too, or called by such a function; one rule, two callers), or
* named in a refusal of those files (a string of a ``raise``, ``_require``, ``_positive``, ``ConfigError``/
  ``CheckError``/``PlanError`` call there, or a problem a raise there joins: ``problems.append(...)``; a pattern
  such as ``*.megatron.share_prompts`` counts where it names two fields after its formatted part, or as many
  as the refusal's own pattern does), or
* a closed choice of the schema (refused at compose time), or
* listed in ALLOWED below with the reason it can only be known at run time.

Keys are read from the code (ast), f-strings included: ``f"{role}.megatron.share_prompts"`` is the pattern
``*.megatron.share_prompts``, matched against the schema's keys (a name bound to a string constant of the module or
to a string earlier in the function is read as its value), so a new refusal in worker code fails this test until
validation has its twin.
"""
from __future__ import annotations

import ast
import re
import typing
from fnmatch import fnmatchcase
from functools import lru_cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rl"
SCANNED = ("workers", "rollout", "weights", "servers", "algos", "data", "reward", "trainer", "agent", "models")
# the rules the run's code and validation share: a raise there counts as refused only while validation calls it
SCANNED_FILES = ("config/worker_rules.py",)
VALIDATION = ("plan/validate.py", "config/checks.py", "trainer/preflight.py")
WILDCARD = "*"  # a formatted part of an f-string whose value the scan cannot tell
KEY = re.compile(r"(?:\*|\b(?:actor_rollout_ref|rollout|critic|data|trainer|algorithm|reward_model))"
                 r"\.[A-Za-z_*][\w.*]*[\w*]")
REFUSING_CALLS = {"_require", "require", "_positive", "ConfigError", "CheckError", "PlanError"}
RAISED = {"ValueError", "ConfigError", "RuntimeError", "TypeError", "KeyError", "CheckError", "PlanError"}
SHORT_SECTIONS = ("rollout", "actor", "ref", "model")  # keys written without their actor_rollout_ref. prefix

# (file, key) -> why validation cannot refuse it before start-up.
ALLOWED = {
    **{("data/sft.py", key):
        "a row's own columns decide which it has (messages, or the prompt/response pair); the SFT trainer encodes "
        "every row before any worker starts (trainer/sft.py sft_dataset, the dry run too), refusing such a row "
        "naming its file and row" for key in ("data.prompt_key", "data.messages_key", "data.response_key")},
    ("rollout/sglang/server_transport.py", "actor_rollout_ref.rollout.sglang.master_address"):
        "null means this host's address, resolved on the trainer's rank-0 node when the update group forms; only "
        "there is it known whether it is loopback while the servers are on other hosts",
    ("workers/engine.py", "*.megatron.use_distributed_optimizer"):
        "whether Transformer Engine / Apex import is a fact of the machine, not of the config: a real start refuses "
        "it before launch (plan/planner.py check_launch, the same capabilities.distributed_optimizer_blocker) and a "
        "dry run, which plans for the target cluster, prints it as a note",
    ("algos/dynamic_sampling.py", "algorithm.filter_groups.metric"):
        "besides the batch's own metrics the value may name a column the reward function adds to the batch (a "
        "scorer's dict entries such as acc, a custom reward function's): which columns there are is known only "
        "when the first batch has been scored",
    ("algos/policy_loss_common.py", "actor_rollout_ref.actor.tis_imp_ratio_cap"):
        "a check of compute_policy_loss's arguments (a caller passing no rollout_log_probs), not of the setting: "
        "every rollout engine returns them (rollout/batch_io.py), the actor asks the batch for them when the cap is "
        "set (workers/actor.py _update_fields), and MTP drafting, which spoils them, is refused with the cap before "
        "launch (config/mtp.py)",
    ("reward/model/reward_fn.py", "reward_model.combine"):
        "a check of ModelRewardFn's wiring, not of the setting: trainer/reward_setup.py build_reward_fn gives it "
        "the rule manager whenever the combine plan has a sum or gate rule, and the plan itself is refused before "
        "launch (plan/validate.py builds CombinePlan)",
}


# ---------------------------------------------------------------------------- reading strings out of the code
def _name(func: ast.AST) -> str:
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


def render(node: ast.AST, names: dict[str, str]) -> str:
    """The text ``node`` builds: constants as they are, an f-string's formatted parts as their value where ``names``
    holds it (a string constant of the module or the function), else ``*``."""
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else ""
    if isinstance(node, ast.JoinedStr):
        return "".join(render(value, names) for value in node.values)
    if isinstance(node, ast.FormattedValue):
        inner = node.value
        return names[inner.id] if isinstance(inner, ast.Name) and inner.id in names else WILDCARD
    if isinstance(node, ast.Name):
        return names.get(node.id, "")
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return render(node.left, names) + render(node.right, names)
    return " ".join(render(child, names) for child in ast.iter_child_nodes(node))


def _string_assignments(body: list[ast.stmt] | ast.AST, names: dict[str, str]) -> dict[str, str]:
    """``names`` and the names bound (first binding) to a string or f-string in ``body``."""
    names = dict(names)
    nodes = body if isinstance(body, list) else [body]
    for top in nodes:
        for node in ([top] if isinstance(body, list) else ast.walk(top)):
            if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                    and isinstance(node.value, (ast.JoinedStr, ast.Constant))
                    and (not isinstance(node.value, ast.Constant) or isinstance(node.value.value, str))):
                names.setdefault(node.targets[0].id, render(node.value, names))
    return names


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """Every function of a module by its name, a method by ``Class.method``."""
    found: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            found.update({f"{node.name}.{item.name}": item for item in node.body
                          if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))})
    methods = {id(fn) for fn in found.values()}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and id(node) not in methods:
            found.setdefault(node.name, node)
    return found


@lru_cache(maxsize=None)
def _parsed(path: Path) -> tuple[ast.Module, dict[str, str]]:
    tree = ast.parse(path.read_text())
    return tree, _string_assignments(tree.body, {})


# ---------------------------------------------------------------------------- the schema's keys
@lru_cache(maxsize=1)
def schema_paths() -> dict[str, bool]:
    """Every key of the schema -> whether it is free-form (a dict / Any field that takes keys of its own)."""
    from megatron_rl.config.checks import _dataclass_of, _is_free_form
    from megatron_rl.config.schema import PPOTrainerConfig

    paths: dict[str, bool] = {}

    def walk(cls: type, prefix: str) -> None:
        for name, hint in typing.get_type_hints(cls).items():
            paths[prefix + name] = _is_free_form(hint)
            inner = _dataclass_of(hint)
            if inner is not None:
                walk(inner, f"{prefix}{name}.")

    walk(PPOTrainerConfig, "")
    return paths


def _literal_tail(key: str) -> bool:
    """A key that ends in a named field (``*.megatron.share_prompts``), not in a part the scan cannot tell."""
    return re.fullmatch(r"[A-Za-z_]\w*", key.rsplit(".", 1)[-1]) is not None


def config_keys(key: str) -> list[str]:
    """The schema keys a key named in a message stands for: itself (``rollout.x`` -> ``actor_rollout_ref.rollout.x``)
    or, for a pattern, every schema key it matches; a key below a free-form field as it is; [] for text that only
    looks like a key (a module path, a file name)."""
    paths = schema_paths()
    if key.split(".", 1)[0] in SHORT_SECTIONS:
        key = f"actor_rollout_ref.{key}"
    if WILDCARD in key:
        if not _literal_tail(key):
            return []
        return sorted(path for path in paths if fnmatchcase(path, key))
    if key in paths:
        return [key]
    parts = key.split(".")
    for end in range(len(parts) - 1, 0, -1):
        above = ".".join(parts[:end])
        if above in paths:
            return [key] if paths[above] else []
    return []


def _short(key: str) -> str:
    return key.removeprefix("actor_rollout_ref.")


# ---------------------------------------------------------------------------- the worker side and the validation side
def _module_file(module: str) -> str | None:
    """``megatron_rl.workers.lr_schedule`` -> ``workers/lr_schedule.py`` (or its package's __init__.py)."""
    if not module.startswith("megatron_rl."):
        return None
    rel = Path(*module.split(".")[1:])
    for candidate in (rel.with_suffix(".py"), rel / "__init__.py"):
        if (PACKAGE / candidate).is_file():
            return str(candidate)
    return None


def _imports(scope: ast.AST) -> dict[str, tuple[str, str | None]]:
    """Names ``scope`` imports from megatron_rl (lazy imports inside functions too): local name -> (file, function),
    or (file, None) for a module."""
    found: dict[str, tuple[str, str | None]] = {}
    for node in ast.walk(scope):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                local = alias.asname or alias.name
                if (module := _module_file(f"{node.module}.{alias.name}")) is not None:
                    found[local] = (module, None)
                elif (source := _module_file(node.module)) is not None:
                    found[local] = (source, alias.name)
    return found


def _calls(scope: ast.AST, imported: dict[str, tuple[str, str | None]], source: str, defined: set[str],
           owner: str | None = None) -> set[tuple[str, str]]:
    """(file, function) of megatron_rl that ``scope`` (a method of class ``owner``, if one) calls: imported functions,
    what building an imported class runs (its ``__init__`` / ``__post_init__``), ``module.function`` of an imported
    module, ``Class.method`` of an imported class, and functions and methods of its own module."""
    def built(file: str, cls: str) -> set[tuple[str, str]]:
        return {(file, f"{cls}.{init}") for init in ("__init__", "__post_init__")}

    called = set()
    for node in ast.walk(scope):
        if not isinstance(node, ast.Call):
            continue
        for func in (node.func, *node.args):  # a function called, or handed to a call (``refused(rule, ...)``)
            if isinstance(func, ast.Name) and func.id in imported and imported[func.id][1] is not None:
                file, name = imported[func.id]
                called |= {(file, name), *built(file, name)}
            elif isinstance(func, ast.Name) and func.id in defined:
                called.add((source, func.id))
            elif isinstance(func, ast.Name) and (func.id == "cls" and owner or f"{func.id}.__init__" in defined):
                called |= built(source, owner if func.id == "cls" else func.id)
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                base = func.value.id
                if base in imported:  # module.function, or Class.method (a classmethod such as from_config)
                    file, name = imported[base]
                    called.add((file, func.attr if name is None else f"{name}.{func.attr}"))
                elif base in ("self", "cls") and owner:
                    called.add((source, f"{owner}.{func.attr}"))
                elif f"{base}.{func.attr}" in defined:  # Class.method of a class of its own module
                    called.add((source, f"{base}.{func.attr}"))
    return called


def _engine_hooks() -> set[tuple[str, str]]:
    """The EngineSpec hooks of rollout/engines.py (check_config: validation calls it; check_here: preflight)."""
    source = "rollout/engines.py"
    tree, _ = _parsed(PACKAGE / source)
    return {(source, keyword.value.id) for node in ast.walk(tree) if isinstance(node, ast.Call)
            and _name(node.func) == "EngineSpec" for keyword in node.keywords
            if keyword.arg in ("check_config", "check_here") and isinstance(keyword.value, ast.Name)}


def _reexported(tree: ast.Module, function: str) -> set[tuple[str, str]]:
    """Where a function (``name`` or ``Class.method``) that a module imports rather than defines is defined:
    ``from megatron_rl.algos import get_kl_controller`` is algos/kl.py's."""
    head, _, rest = function.partition(".")
    file, name = _imports(tree).get(head, (None, None))
    if file is None or name is None:
        return set()
    if rest:
        return {(file, f"{name}.{rest}")}
    return {(file, name), *((file, f"{name}.{init}") for init in ("__init__", "__post_init__"))}


@lru_cache(maxsize=1)
def shared_rules() -> frozenset[tuple[str, str]]:
    """(file, function) of megatron_rl that validation or preflight calls, and all they call in turn: a refusal
    there runs before start-up by construction (one rule, called by the worker and by validation)."""
    shared: set[tuple[str, str]] = set(_engine_hooks())
    for name in VALIDATION:
        tree, _ = _parsed(PACKAGE / name)
        shared |= _calls(tree, _imports(tree), name, set())
    pending = list(shared)
    while pending:
        source, function = pending.pop()
        tree, _ = _parsed(PACKAGE / source)
        defined = _functions(tree)
        if function not in defined:  # a name the module imports (a package's __init__.py re-exporting it)
            for call in _reexported(tree, function) - shared:
                shared.add(call)
                pending.append(call)
            continue
        imported = _imports(tree) | _imports(defined[function])
        owner = function.split(".")[0] if "." in function else None
        for call in _calls(defined[function], imported, source, set(defined), owner) - shared:
            shared.add(call)
            pending.append(call)
    return frozenset(shared)


def raised_keys() -> dict[tuple[str, str], int]:
    """(file, key as the message names it) -> line of each config key named by an exception of RAISED raised in the
    scanned packages outside the shared rules. A key may be a pattern (``*.megatron.share_prompts``)."""
    found: dict[tuple[str, str], int] = {}
    shared = shared_rules()
    paths = [path for package in SCANNED for path in sorted((PACKAGE / package).rglob("*.py"))]
    for path in paths + [PACKAGE / name for name in SCANNED_FILES]:
        source = str(path.relative_to(PACKAGE))
        if source in VALIDATION:  # the refusals before launch themselves (trainer/preflight.py)
            continue
        tree, constants = _parsed(path)
        for qualname, function in _functions(tree).items():
            if (source, qualname) in shared:
                continue
            names = _string_assignments(function, constants)
            for node in ast.walk(function):
                raised = isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                if raised and _name(node.exc.func) in RAISED:
                    for key in KEY.findall(render(node.exc, names)):
                        if config_keys(key):
                            found.setdefault((source, key), node.lineno)
    return found


def validation_messages() -> str:
    """The refusals of validation and preflight: their files' and those of every function they call."""
    texts = []
    shared = shared_rules()
    sources = {*VALIDATION, *(source for source, _ in shared)}
    for name in sorted(sources):
        tree, constants = _parsed(PACKAGE / name)
        for qualname, function in _functions(tree).items():
            if name not in VALIDATION and (name, qualname) not in shared:
                continue
            names = _string_assignments(function, constants)
            gathered = _gathered_problems(function, names)
            for node in ast.walk(function):
                if isinstance(node, ast.Raise) and node.exc is not None:
                    texts.append(render(node.exc, names))
                    texts += [text for inner in ast.walk(node.exc) if isinstance(inner, ast.Name)
                              for text in gathered.get(inner.id, [])]
                elif isinstance(node, ast.Call) and _name(node.func) in REFUSING_CALLS:
                    texts.append(render(node, names))
    return "\n".join(texts)


def _gathered_problems(function: ast.AST, names: dict[str, str]) -> dict[str, list[str]]:
    """The texts appended to each list of a function (``problems.append(f"...")``): a refusal that gathers its
    problems and raises them joined (``raise ConfigError("; ".join(problems))``) names the keys there."""
    gathered: dict[str, list[str]] = {}
    for node in ast.walk(function):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append"
                and isinstance(node.func.value, ast.Name) and len(node.args) == 1):
            gathered.setdefault(node.func.value.id, []).append(render(node.args[0], names))
    return gathered


def schema_choices() -> set[str]:
    from megatron_rl.config.checks import _choice_fields
    from megatron_rl.config.schema import PPOTrainerConfig

    return {_short(key) for key, _ in _choice_fields(PPOTrainerConfig)}


def _named_tail(pattern: str) -> int:
    """How many named fields follow a pattern's last formatted part (``*.megatron.share_prompts``: 2)."""
    tail = pattern.rsplit(WILDCARD, 1)[-1].strip(".").split(".")
    return len(tail) if all(re.fullmatch(r"[A-Za-z_]\w*", part) for part in tail) else 0


def _covers(pattern: str, key: str) -> bool:
    """Whether a validation pattern may stand for the keys of ``key``: it names two fields after its formatted part
    (``*.megatron.share_prompts``), or no fewer than ``key``, itself a pattern, does (``*.ppo_mini_batch_size`` for
    ``*.ppo_mini_batch_size``). ``*.mode`` (CombineRule.parse's ``f"{where}.mode"``) would else stand for every
    ``mode`` of the schema."""
    named = _named_tail(pattern)
    return named >= 2 or (named >= 1 and WILDCARD in key and named >= _named_tail(key))


def refused_by_validation(key: str, messages: str, choices: set[str]) -> bool:
    """Every schema key ``key`` stands for is named by a validation message (its text, or an f-string pattern of it
    there that ends in named fields, ``_covers``) or is a closed choice."""
    patterns = [p for p in set(KEY.findall(messages)) if WILDCARD in p and _covers(p, key)]
    return all(_short(full) in messages or _short(full) in choices
               or any(fnmatchcase(full, pattern) for pattern in patterns) for full in config_keys(key))


# ---------------------------------------------------------------------------- the tests
def test_the_scan_finds_the_refusals_it_is_about():
    keys = raised_keys()
    assert ("weights/replica.py", "rollout.weight_sync.verify_freq") in keys
    assert ("rollout/hf_engine.py", "rollout.response_length") in keys
    # f-string keys (the guard missed workers/engine.py's share_prompts refusal while its key was an f-string; its
    # rule is now config/worker_rules.py's, which validation calls)
    assert ("workers/engine.py", "*.megatron.context_parallel_size") in keys
    assert ("workers/update_loop.py", "*.ppo_mini_batch_size") in keys
    # the packages beyond the workers: algos/, reward/, models/ (outside the shared rules)
    assert ("algos/dynamic_sampling.py", "algorithm.filter_groups.metric") in keys
    assert ("reward/model/reward_fn.py", "reward_model.combine") in keys
    assert not any(path in VALIDATION for path, _ in keys)  # preflight's own refusals are the validation side
    # a RuntimeError naming keys
    assert ("workers/hybrid.py", "algorithm.use_kl_in_reward") in keys
    assert len(keys) >= 10


def test_f_string_keys_read_as_patterns_of_schema_keys():
    tree = ast.parse('def f(role):\n    prefix = f"{role}.megatron"\n'
                     '    raise ValueError(f"{prefix}.share_prompts and {WHERE}.x.packed_sequences")\n')
    function = tree.body[0]
    text = render(function.body[1].exc, _string_assignments(function, {"WHERE": "critic.megatron"}))
    assert KEY.findall(text) == ["*.megatron.share_prompts", "critic.megatron.x.packed_sequences"]
    assert "actor_rollout_ref.actor.megatron.share_prompts" in config_keys("*.megatron.share_prompts")
    assert "critic.megatron.share_prompts" in config_keys("*.megatron.share_prompts")
    assert config_keys("rollout.mode") == ["actor_rollout_ref.rollout.mode"]
    assert config_keys("*.tmp") == [] and config_keys("rollout.vllm.server.ServerWorkerExtension") == []
    assert config_keys("actor_rollout_ref.rollout.engine_kwargs.vllm.block_size")  # below a free-form field
    assert config_keys("*.megatron.*") == []  # names no field


def test_a_validation_pattern_covers_the_keys_it_matches():
    messages = "*.megatron.share_prompts=true and *.megatron.packed_sequences=true cannot both be on"
    assert refused_by_validation("*.share_prompts", messages, set())
    assert not refused_by_validation("*.megatron.freeze_router", messages, set())
    # one named field after the formatted part stands for every key of that name: it covers none
    assert not refused_by_validation("*.router_replay.mode", "*.mode=* is unknown", set())
    assert refused_by_validation("*.ppo_mini_batch_size", "*.ppo_mini_batch_size=* does not divide", set())


def test_shared_rules_are_the_functions_validation_calls():
    shared = shared_rules()
    assert ("workers/lr_schedule.py", "check_optim_config") in shared
    assert ("config/worker_rules.py", "check_share_prompts_packing") in shared  # the engine's rule (issue 56 item 6)
    # through a package's re-export (``from megatron_rl.algos import get_kl_controller``; ``megatron_rl.data``'s
    # RLDataset, which preflight builds), and a method of a class of the module (CombinePlan -> CombineRule.parse)
    assert ("algos/kl.py", "AdaptiveKLController.__init__") in shared
    assert ("data/dataset.py", "RLDataset._fit_length") in shared
    assert ("reward/model/combine.py", "CombineRule.parse") in shared
    assert ("models/router_replay.py", "replay_mode") in shared
    assert ("algos/value_loss.py", "check_cliprange_value") in shared


def test_gathered_problems_are_validation_messages():
    """A refusal that gathers its problems and raises them joined (trainer/validation.py check_validation_settings)
    names its keys in what it appends."""
    assert "actor_rollout_ref.rollout.val_kwargs.n=" in validation_messages()


def test_every_config_refusal_in_worker_code_is_refused_by_validation_first():
    messages, choices = validation_messages(), schema_choices()
    missing = []
    for (path, key), line in sorted(raised_keys().items()):
        if (path, key) in ALLOWED or refused_by_validation(key, messages, choices):
            continue
        missing.append(f"megatron_rl/{path}:{line} refuses {key}")
    assert not missing, ("refused only after start-up; add the check to plan/validate.py (or preflight) naming the "
                         "key, or call the worker's own rule from there, or an ALLOWED entry with the reason it can "
                         "only be known at run time:\n  " + "\n  ".join(missing))


def test_allowed_entries_are_still_needed():
    raised = raised_keys()
    stale = [entry for entry in ALLOWED if entry not in raised]
    assert not stale, f"ALLOWED entries whose refusal is gone: {stale}"
    assert all(reason.strip() for reason in ALLOWED.values())
