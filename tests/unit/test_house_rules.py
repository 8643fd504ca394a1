"""The house's size and shape rules (docs/architecture.md, "House rules"), measured on the package's source: one
typed config (no config read by string outside config/ and compat/), no giant module or function, our own imports
at module top unless a heavy dependency or a cycle needs them late (said on the line), few module globals, and
tests/ laid out like megatron_rl/. Each rule reports every offender with its file and line."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_rl"
TESTS = ROOT / "tests"
STRING_CONFIG_HOMES = ("config", "compat")  # the only packages that read the config by its keys' strings
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80
MAX_DATAPROTO_METHODS = 25
MAX_ANY_CONFIG_PARAMETERS = 10
MAX_LATE_IMPORT_SHARE = 0.10
MAX_GLOBAL_STATEMENTS = 3
CONFIG_NAME = re.compile(r"(^|_)(cfg|config)$")


def modules(root: Path = PACKAGE) -> list[tuple[Path, str, ast.Module]]:
    return [(p, p.read_text(), ast.parse(p.read_text(), filename=str(p))) for p in sorted(root.rglob("*.py"))]


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def package_of(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def string_config_reads(path: Path, tree: ast.Module) -> list[str]:
    """``OmegaConf.select(...)`` and ``cfg.get(...)`` / ``config.get(...)``: a key read by its string."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value
        if node.func.attr == "select" and isinstance(owner, ast.Name) and owner.id == "OmegaConf":
            found.append(f"{where(path, node.lineno)} OmegaConf.select")
        elif node.func.attr == "get" and isinstance(owner, ast.Name) and owner.id in ("cfg", "config"):
            found.append(f"{where(path, node.lineno)} {owner.id}.get")
    return found


def functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def is_own_import(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "megatron_rl"
    return isinstance(node, ast.Import) and any(a.name.split(".")[0] == "megatron_rl" for a in node.names)


def late_import_blocks(tree: ast.Module) -> list[list[ast.stmt]]:
    """Our own imports inside functions, as blocks of consecutive import statements (any import in a block counts
    the block's own imports; TYPE_CHECKING blocks are at module level and not counted)."""
    blocks: dict[int, list[ast.stmt]] = {}
    for fn in functions(tree):
        statement_lists = [getattr(node, field) for node in ast.walk(fn) for field in ("body", "orelse", "finalbody")
                           if isinstance(getattr(node, field, None), list)]
        for statements in statement_lists:
            block: list[ast.stmt] = []
            for stmt in [*statements, None]:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    block.append(stmt)
                    continue
                own = [node for node in block if is_own_import(node)]
                if own:
                    blocks[block[0].lineno] = block
                block = []
    return list(blocks.values())


def says_why(text: str, block: list[ast.stmt]) -> bool:
    """A block of late imports carries its reason: a comment on its lines or on the line just above it."""
    lines = text.splitlines()
    return any("#" in line for line in lines[max(block[0].lineno - 2, 0): block[-1].end_lineno])


def test_no_config_key_is_read_by_its_string_outside_config_and_compat():
    found = [hit for path, _, tree in modules() if package_of(path) not in STRING_CONFIG_HOMES
             for hit in string_config_reads(path, tree)]
    assert not found, ("read the typed config by attribute (megatron_rl.config.typed_config; the schema DictConfig "
                       "reads the same way):\n" + "\n".join(found))


def test_config_parameters_carry_their_schema_type():
    untyped = []
    for path, _, tree in modules():
        for fn in functions(tree):
            args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
            untyped += [f"{where(path, fn.lineno)} {fn.name}({a.arg})" for a in args if CONFIG_NAME.search(a.arg)
                        and a.annotation is not None and ast.unparse(a.annotation) == "Any"]
    assert len(untyped) <= MAX_ANY_CONFIG_PARAMETERS, (
        f"{len(untyped)} config parameters typed Any (at most {MAX_ANY_CONFIG_PARAMETERS}); give them their schema "
        f"type (megatron_rl.config.schema):\n" + "\n".join(untyped))


def test_no_module_outgrows_one_job():
    big = [f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines" for path, text, _ in modules()
           if len(text.splitlines()) > MAX_MODULE_LINES]
    assert not big, f"modules over {MAX_MODULE_LINES} lines: split them by what they hold:\n" + "\n".join(big)


def test_no_function_outgrows_a_screen():
    long = [f"{where(path, fn.lineno)} {fn.name}: {fn.end_lineno - fn.lineno + 1} lines"
            for path, _, tree in modules() for fn in functions(tree)
            if fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_dataproto_keeps_the_trainers_surface_only():
    tree = ast.parse((PACKAGE / "protocol.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DataProto")
    methods = [n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert len(methods) <= MAX_DATAPROTO_METHODS, (
        f"DataProto has {len(methods)} methods (at most {MAX_DATAPROTO_METHODS}; verl's parity surface lives in "
        f"compat/verl/): {methods}")


def test_our_imports_stand_at_module_top_unless_they_say_why():
    own, late, silent = 0, 0, []
    for path, text, tree in modules():
        own += sum(1 for node in ast.walk(tree) if is_own_import(node))
        for block in late_import_blocks(tree):
            late += sum(1 for node in block if is_own_import(node))
            if not says_why(text, block):
                silent.append(where(path, block[0].lineno))
    assert not silent, "imports inside functions without a comment saying which dependency or cycle needs them:\n" + \
        "\n".join(silent)
    assert late <= MAX_LATE_IMPORT_SHARE * own, (
        f"{late} of our {own} imports are inside functions ({late / own:.0%}, at most {MAX_LATE_IMPORT_SHARE:.0%})")


def test_few_module_globals():
    rebound = [where(path, node.lineno) for path, _, tree in modules() for node in ast.walk(tree)
               if isinstance(node, ast.Global)]
    assert len(rebound) <= MAX_GLOBAL_STATEMENTS, (
        f"{len(rebound)} `global` statements (at most {MAX_GLOBAL_STATEMENTS}): {rebound}")


# what every test stands on rather than tests: a file importing only these besides one package tests that package
INFRASTRUCTURE = {"config", "data", "protocol", "demo", "train", "trainer", "distributed", "controller"}


def packages_imported(path: Path, follow: bool = True) -> set[str]:
    """The megatron_rl packages a test file imports (inside functions too; ``from megatron_rl import algos``
    names ``algos``), and those of the job modules beside it that it imports (what its spawned ranks run)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else (
            [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        for name in names:
            parts = name.split(".")
            if parts[0] == "megatron_rl":
                found |= {parts[1]} if len(parts) > 1 else {alias.name for alias in node.names}
            elif follow and (path.parent / f"{parts[0]}.py").is_file():
                found |= packages_imported(path.parent / f"{parts[0]}.py", follow=False)
    return found


def test_each_test_file_lives_in_the_folder_of_its_package():
    """A test file whose subject is one package (it imports that package and otherwise only the infrastructure)
    lives in tests/<package>/: the tests of weights/, servers/, agent/ and plan/ are not in tests/rollout."""
    folders = {p.name for p in TESTS.iterdir() if p.is_dir()}
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    strays = []
    for folder in sorted(TESTS.iterdir()):
        if not folder.is_dir() or folder.name not in packages:
            continue
        for path in sorted(folder.rglob("test_*.py")):
            subjects = packages_imported(path) - (INFRASTRUCTURE - {folder.name})
            if len(subjects) == 1 and folder.name not in subjects and (subject := subjects.pop()) in folders:
                strays.append(f"{path.relative_to(ROOT)}: tests {subject}/ only (tests/{subject}/)")
    assert not strays, "test files outside the folder of the package they test:\n" + "\n".join(strays)


@pytest.mark.parametrize("source, expected", [
    ("from omegaconf import OmegaConf\ndef f(cfg):\n    return OmegaConf.select(cfg, 'a.b', default=1)\n", 1),
    ("def f(cfg):\n    return cfg.get('a', 0)\n", 1),
    ("def f(cfg):\n    return cfg.a.b\n", 0),
    ("def f(row):\n    return row.get('a')\n", 0),
])
def test_the_string_read_check_itself(tmp_path, source, expected):
    path = PACKAGE / "probe.py"  # named inside the package for `where`; never written
    assert len(string_config_reads(path, ast.parse(source))) == expected


def test_the_late_import_check_itself():
    quiet = "def f():\n    import os\n    from megatron_rl.plan import planner\n    return planner\n"
    told = ("def f():\n    # megatron-core: compiled at first use\n    import os\n    from megatron_rl.plan import (\n"
            "        planner,\n    )\n    from megatron_rl.workers import hybrid\n    return planner\n")
    blocks = late_import_blocks(ast.parse(quiet))
    assert len(blocks) == 1 and len(blocks[0]) == 2 and not says_why(quiet, blocks[0])
    blocks = late_import_blocks(ast.parse(told))
    assert len(blocks) == 1 and len(blocks[0]) == 3 and says_why(told, blocks[0])
    assert late_import_blocks(ast.parse("def f():\n    import os\n")) == []
