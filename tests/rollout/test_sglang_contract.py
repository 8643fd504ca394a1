"""Contract drift: everything SGLangEngine uses (SGLANG_CONTRACT) must exist in the pinned sglang wheel.

The wheel is fetched with ``pip download --no-deps sglang==PIN`` into a cache directory
(``$MEGATRON_RL_TEST_CACHE`` or <tmp>/megatron_rl_test_cache) and read with ``zipfile`` + ``ast``; nothing
is imported or executed from it. Without network access to PyPI the tests skip and say so.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from megatron_rl.rollout.sglang import SGLANG_CONTRACT, SGLANG_PIN, WEIGHT_UPDATE_SESSION_SINCE

CACHE = Path(os.environ.get("MEGATRON_RL_TEST_CACHE", Path(tempfile.gettempdir()) / "megatron_rl_test_cache"))


@pytest.fixture(scope="module")
def wheel() -> zipfile.ZipFile:
    target = CACHE / f"sglang-{SGLANG_PIN}"
    found = sorted(target.glob(f"sglang-{SGLANG_PIN}-*.whl"))
    if not found:
        target.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            f"sglang=={SGLANG_PIN}",
            "-d",
            str(target),
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            pytest.skip(f"cannot download sglang=={SGLANG_PIN} to check the adapter's contract: {exc}")
        found = sorted(target.glob(f"sglang-{SGLANG_PIN}-*.whl"))
        if proc.returncode or not found:
            pytest.skip(
                f"cannot download sglang=={SGLANG_PIN} to check the adapter's contract "
                f"(pip exit {proc.returncode}): {proc.stderr.strip()[-300:]}"
            )
    return zipfile.ZipFile(found[0])


class Source:
    """Parsed files of the wheel, addressed relative to the ``sglang/`` package."""

    def __init__(self, wheel: zipfile.ZipFile) -> None:
        self.wheel = wheel
        self._trees: dict[str, ast.Module] = {}

    def tree(self, path: str) -> ast.Module:
        if path not in self._trees:
            self._trees[path] = ast.parse(self.wheel.read(f"sglang/{path}").decode(), filename=path)
        return self._trees[path]

    def paths(self, folder: str) -> list[str]:
        prefix = f"sglang/{folder}/"
        return [
            n[len("sglang/") :] for n in self.wheel.namelist() if n.startswith(prefix) and n.endswith(".py")
        ]

    def cls(self, path: str, name: str) -> ast.ClassDef:
        for node in ast.walk(self.tree(path)):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        raise AssertionError(f"class {name} not found in sglang/{path}")

    def fields(self, path: str, name: str) -> set[str]:
        """Annotated attributes of a class body (dataclass / msgspec.Struct fields)."""
        return {
            n.target.id
            for n in self.cls(path, name).body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        }

    def method_args(self, path: str, cls: str, method: str) -> tuple[set[str], bool]:
        for node in self.cls(path, cls).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == method:
                args = node.args
                names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
                return names, args.kwarg is not None
        raise AssertionError(f"{cls}.{method} not found in sglang/{path}")

    def strings(self, path: str) -> set[str]:
        return {
            n.value
            for n in ast.walk(self.tree(path))
            if isinstance(n, ast.Constant) and isinstance(n.value, str)
        }

    def top_level_names(self, path: str) -> set[str]:
        names = set()
        for node in self.tree(path).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, (ast.ImportFrom, ast.Import)):
                names |= {a.asname or a.name for a in node.names}
        return names


@pytest.fixture(scope="module")
def src(wheel) -> Source:
    return Source(wheel)


def module_path(module: str) -> str:
    parts = module.split(".")[1:]
    return "/".join(parts) + ".py" if parts else "__init__.py"


def test_wheel_is_the_pinned_version_and_has_the_session(wheel, src):
    metadata = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    assert f"Version: {SGLANG_PIN}" in wheel.read(metadata).decode()
    assert WEIGHT_UPDATE_SESSION_SINCE.public <= SGLANG_PIN
    assert {"begin_weight_update", "end_weight_update"} <= set(SGLANG_CONTRACT["engine_methods"])


@pytest.mark.parametrize("method", sorted(SGLANG_CONTRACT["engine_methods"]))
def test_engine_methods_take_our_keywords(src, method):
    names, _ = src.method_args("srt/entrypoints/engine.py", "Engine", method)
    missing = set(SGLANG_CONTRACT["engine_methods"][method]) - names
    assert not missing, (
        f"sglang.Engine.{method} has no parameters {sorted(missing)} (it takes {sorted(names)})"
    )


def test_engine_constructor_fields_exist(src):
    fields = set().union(
        *(
            src.fields(p, c.name)
            for p in src.paths("srt/arg_groups/fields")
            for c in src.tree(p).body
            if isinstance(c, ast.ClassDef)
        )
    )
    missing = (set(SGLANG_CONTRACT["server_args"]) | set(SGLANG_CONTRACT["server_info_args"])) - fields
    assert not missing, f"ServerArgs has no fields {sorted(missing)}"
    assert "resolved_dict" in ast.unparse(src.tree("srt/utils/common.py")), "/server_info no longer reports ServerArgs"
    assert set(SGLANG_CONTRACT["load_formats"]) <= src.strings("srt/arg_groups/choices.py")


def _routes(src: Source) -> dict[str, ast.AST]:
    """route -> handler function, from @app.get/post/api_route decorators in http_server.py."""
    routes = {}
    for node in src.tree("srt/entrypoints/http_server.py").body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for dec in node.decorator_list:
                if (
                    isinstance(dec, ast.Call)
                    and isinstance(dec.func, ast.Attribute)
                    and dec.func.attr in ("get", "post", "api_route")
                    and dec.args
                    and isinstance(dec.args[0], ast.Constant)
                ):
                    routes[dec.args[0].value] = node
    return routes


@pytest.mark.parametrize("route", sorted(SGLANG_CONTRACT["http_routes"]))
def test_http_routes_and_request_fields_exist(src, route):
    routes = _routes(src)
    assert route in routes, f"sglang {SGLANG_PIN} http_server.py has no route {route}"
    struct, fields = SGLANG_CONTRACT["http_routes"][route]
    if struct is None:
        return
    assert struct in ast.unparse(routes[route].args), f"{route} handler does not take {struct}"
    missing = set(fields) - src.fields("srt/managers/io_struct.py", struct)
    assert not missing, f"{struct} (body of {route}) has no fields {sorted(missing)}"


def test_sampling_params_fields_exist(src):
    missing = set(SGLANG_CONTRACT["sampling_params"]) - src.fields(
        "srt/sampling/sampling_params.py", "SamplingParams"
    )
    assert not missing, f"SamplingParams has no fields {sorted(missing)}"


@pytest.mark.parametrize("path", sorted(SGLANG_CONTRACT["result_keys"]))
def test_result_keys_are_produced(src, path):
    missing = set(SGLANG_CONTRACT["result_keys"][path]) - src.strings(path)
    assert not missing, f"sglang/{path} never mentions result keys {sorted(missing)}"


@pytest.mark.parametrize("module", sorted(SGLANG_CONTRACT["symbols"]))
def test_imported_symbols_exist(src, module):
    missing = set(SGLANG_CONTRACT["symbols"][module]) - src.top_level_names(module_path(module))
    assert not missing, f"{module} defines no {sorted(missing)}"


def test_flattened_bucket_layout_and_serializer(src):
    spec = SGLANG_CONTRACT["flattened_bucket"]
    fields = src.fields("srt/weight_sync/tensor_bucket.py", "FlattenedTensorMetadata")
    assert fields == set(spec["metadata_fields"]), f"FlattenedTensorMetadata fields are {sorted(fields)}"
    updater = "srt/model_executor/model_runner_components/weight_updater.py"
    assert {spec["load_format"], *spec["payload_keys"]} <= src.strings(updater)
    for method, args in SGLANG_CONTRACT["serializer_methods"].items():
        names, _ = src.method_args("srt/utils/common.py", "MultiprocessingSerializer", method)
        assert set(args) <= names, f"MultiprocessingSerializer.{method} takes {sorted(names)}"


def test_memory_tags_exist(src):
    assert set(SGLANG_CONTRACT["memory_tags"]) <= src.strings("srt/constants.py")


def test_environment_variables_are_read_by_sglang(src):
    read = set().union(*(src.strings(p) for p in src.paths("srt")))
    missing = set(SGLANG_CONTRACT["env_vars"]) - read
    assert not missing, f"sglang {SGLANG_PIN} never reads {sorted(missing)}"


def test_agreed_variables_are_the_ones_the_engine_leaves_alone_when_set(src):
    """Every rank sets SGLANG_CONTRACT["agreed_env_vars"] before any communicator (set_agreed_process_env), so a
    leader's engine and its members create communicators alike: that holds only if sglang.Engine rewrites each of
    them only when unset, i.e. behind an ``"VAR" not in os.environ`` guard in _set_envs_and_config."""
    function = next(node for node in ast.walk(src.tree("srt/entrypoints/engine.py"))
                    if isinstance(node, ast.FunctionDef) and node.name == "_set_envs_and_config")
    guarded = {
        node.left.value for node in ast.walk(function)
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and isinstance(node.left.value, str)
        and any(isinstance(op, ast.NotIn) for op in node.ops)
        and any(ast.unparse(c) == "os.environ" for c in node.comparators)
    }
    agreed = set(SGLANG_CONTRACT["agreed_env_vars"])
    assert agreed and agreed <= guarded, (f"sglang {SGLANG_PIN} sets no \"not in os.environ\" guard for "
                                          f"{sorted(agreed - guarded)}: they are not agreed values")


def _server_arg_fields(src: Source) -> dict[str, ast.AST]:
    """ServerArgs field -> its ``A[T, meta]`` annotation, from the namespaces in srt/arg_groups/fields/."""
    return {
        n.target.id: n.annotation
        for p in src.paths("srt/arg_groups/fields")
        for c in src.tree(p).body if isinstance(c, ast.ClassDef)
        for n in c.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }


def test_the_pinned_server_args_are_the_wheels(src):
    """engine_kwargs.sglang is checked against server_args.py's lists: they are the pinned wheel's fields and types."""
    from megatron_rl.rollout.sglang import server_args as pinned

    fields = _server_arg_fields(src)
    assert pinned.SERVER_ARG_NAMES == set(fields), (
        f"missing here: {sorted(set(fields) - pinned.SERVER_ARG_NAMES)}, "
        f"gone from SGLang: {sorted(pinned.SERVER_ARG_NAMES - set(fields))}")
    assert set(pinned.OWNED_SERVER_ARGS) <= set(fields)
    declared = {name: ast.unparse(ann.slice.elts[0] if isinstance(ann, ast.Subscript) and
                                  isinstance(ann.slice, ast.Tuple) else ann) for name, ann in fields.items()}
    for names, kind in ((pinned.BOOL_FIELDS, "bool"), (pinned.INT_FIELDS, "int"), (pinned.FLOAT_FIELDS, "float")):
        wrong = sorted(n for n in names if declared[n] not in (kind, f"Optional[{kind}]"))
        assert not wrong, f"not {kind} in sglang {SGLANG_PIN}: {[(n, declared[n]) for n in wrong]}"
    assert {n for n in fields if declared[n].startswith("Optional[")} == pinned.OPTIONAL_FIELDS
    assert declared["ep_size"] == "int"


def test_the_pinned_moe_backend_choices_are_the_wheels(src):
    from megatron_rl.rollout.sglang import server_args as pinned

    choices = src.tree("srt/arg_groups/choices.py")
    runner = next(n.value for n in choices.body if isinstance(n, ast.Assign)
                  and ast.unparse(n.targets[0]) == "MOE_RUNNER_BACKEND_CHOICES")
    assert pinned.CHOICES["moe_runner_backend"] == tuple(ast.literal_eval(runner))
    a2a = _server_arg_fields(src)["moe_a2a_backend"].slice.elts[0]  # A[Literal[...], Arg(...)]
    assert set(pinned.CHOICES["moe_a2a_backend"]) == set(ast.literal_eval(ast.unparse(a2a.slice)))
