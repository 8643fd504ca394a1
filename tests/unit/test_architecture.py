"""The package's structure, as docs/architecture.md states it: imports flow one way along the documented order
(imports inside functions and under TYPE_CHECKING included), no private names cross packages, the product never
imports the test tools, no package outgrows the others, and nothing on the weight path rebinds a module global."""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_rl"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAX_PACKAGE_SHARE = 0.15
WEIGHT_PATH = ("weights", "bucket", "rollout")


@dataclass(frozen=True)
class Import:
    where: str  # file:line, from the package's folder on
    source: str  # top-level package (or module) of the importing file
    target: str  # dotted module imported from
    names: tuple[str, ...]


def read_order(text: str) -> list[list[str]]:
    """The layers of the ```import-order block, top first: the names before the two-space gap of each line."""
    match = re.search(r"```import-order\n(.*?)```", text, re.S)
    if match is None:
        raise AssertionError(f"{ARCHITECTURE} has no ```import-order block")
    return [re.split(r"\s{2,}", line.strip())[0].split() for line in match.group(1).splitlines() if line.strip()]


def top_level(package_root: Path, path: Path) -> str:
    rel = path.relative_to(package_root)
    return rel.parts[0].removesuffix(".py")


def imports_of(package_root: Path) -> list[Import]:
    """Every import of ``<package>.*`` in every module, wherever it stands in the file."""
    name = package_root.name
    found = []
    for path in sorted(package_root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        module = ".".join(path.relative_to(package_root.parent).with_suffix("").parts)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        package = package.removesuffix(".__init__")
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [(alias.name, ()) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = tuple(alias.name for alias in node.names)
                targets = [(base, names)] if node.module else [(f"{base}.{n}", ()) for n in names]
            else:
                continue
            for target, names in targets:
                if target == name or target.startswith(name + "."):
                    where = f"{path.relative_to(package_root.parent)}:{node.lineno}"
                    found.append(Import(where, top_level(package_root, path), target, names))
    return found


def target_package(imp: Import) -> str:
    parts = imp.target.split(".")
    if len(parts) > 1:
        return parts[1]
    # ``from megatron_rl import ops``: the names are the packages
    return imp.names[0] if len(imp.names) == 1 else "megatron_rl"


def edges_against(order: list[list[str]], imports: list[Import]) -> list[str]:
    layer = {pkg: i for i, names in enumerate(order) for pkg in names}
    problems = []
    for imp in imports:
        targets = [target_package(imp)] if len(imp.target.split(".")) > 1 else list(imp.names)
        for target in targets:
            if target == imp.source or target == "__init__":
                continue
            where = imp.where
            if imp.source not in layer:
                problems.append(f"{where}: package {imp.source!r} has no place in the import order")
            elif target not in layer:
                problems.append(f"{where}: imports {target!r}, which has no place in the import order")
            elif layer[target] <= layer[imp.source]:
                side = "the same layer as" if layer[target] == layer[imp.source] else "a layer above"
                problems.append(f"{where}: {imp.source} -> {target} ({imp.target}) goes to {side} {imp.source}")
    return problems


def test_every_import_follows_the_documented_order():
    order = read_order(ARCHITECTURE.read_text())
    documented = {pkg for names in order for pkg in names}
    present = {p.name.removesuffix(".py") for p in PACKAGE.iterdir()
               if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").exists())}
    present.add("_C")
    assert present - documented == set(), f"packages without a place in {ARCHITECTURE.name}: {present - documented}"
    assert documented - present == set(), f"{ARCHITECTURE.name} orders packages that do not exist: {documented - present}"
    problems = edges_against(order, imports_of(PACKAGE))
    assert not problems, "imports against the order of docs/architecture.md:\n" + "\n".join(problems)


def test_a_back_edge_is_caught_with_its_file_and_line(tmp_path):
    """The check itself: a kernel module that imports the trainer (inside a function) is reported."""
    tree = tmp_path / "megatron_rl"
    (tree / "ops").mkdir(parents=True)
    (tree / "trainer").mkdir()
    for pkg in ("", "ops", "trainer"):
        (tree / pkg / "__init__.py").write_text("")
    (tree / "ops" / "gae.py").write_text("import torch\n\n\ndef f():\n    from megatron_rl.trainer import runner\n")
    (tree / "trainer" / "runner.py").write_text("from megatron_rl.ops import gae\n")
    order = read_order("```import-order\ntrainer  loops\nops  kernels\n```")
    problems = edges_against(order, imports_of(tree))
    assert len(problems) == 1 and problems[0].startswith("megatron_rl/ops/gae.py:5: ops -> trainer"), problems
    same_layer = read_order("```import-order\ntrainer ops  both\n```")
    assert len(edges_against(same_layer, imports_of(tree))) == 2


def test_no_private_names_cross_packages():
    problems = []
    for imp in imports_of(PACKAGE):
        if target_package(imp) == imp.source:
            continue
        private = [n for n in imp.names if n.startswith("_") and not n.startswith("__")]
        private = [n for n in private if n != "_C"]  # the compiled kernels: a package, not a private name
        private += [part for part in imp.target.split(".")[1:] if part.startswith("_") and part != "_C"]
        if private:
            problems.append(f"{imp.where}: takes {private} from {imp.target}")
    assert not problems, "\n".join(problems)


def test_the_product_never_imports_the_test_tools():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] in ("megatron_rl_testing", "tests") for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


def test_no_package_holds_more_than_its_share():
    sizes = {}
    for path in PACKAGE.rglob("*.py"):
        pkg = top_level(PACKAGE, path)
        sizes[pkg] = sizes.get(pkg, 0) + len(path.read_text().splitlines())
    total = sum(sizes.values())
    largest = max(sizes, key=sizes.get)
    assert sizes[largest] <= MAX_PACKAGE_SHARE * total, (
        f"megatron_rl/{largest} holds {sizes[largest] / total:.0%} of the package's {total} lines "
        f"(at most {MAX_PACKAGE_SHARE:.0%}): split it along the lifeline")


@pytest.mark.parametrize("place", WEIGHT_PATH)
def test_nothing_on_the_weight_path_rebinds_a_module_global(place):
    paths = [PACKAGE / f"{place}.py"] if (PACKAGE / f"{place}.py").exists() else sorted((PACKAGE / place).rglob("*.py"))
    rebinding = [f"{p.relative_to(ROOT)}:{node.lineno}" for p in paths for node in ast.walk(ast.parse(p.read_text()))
                 if isinstance(node, ast.Global)]
    assert not rebinding, f"module globals rebound at run time (pass the value as an argument): {rebinding}"
