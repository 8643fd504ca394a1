"""Tools an environment lets the model call, described in OpenAI function-call JSON schema form (verl's
tool config), with two built-ins: ``calculator`` (safe arithmetic) and ``python`` (a sandboxed executor).

A tool's ``execute(arguments)`` returns the text the model sees. It must not raise for bad input: errors
are returned as text. The agent loop additionally bounds every tool call in time
(``multi_turn.tool_timeout_s``), so a hanging tool costs its sample a timeout observation, never the batch.

Tool config file (``multi_turn.tool_config_path``, verl's format)::

    tools:
      - class_name: megatron_rl.agent.tools.CalculatorTool   # or a built-in name: calculator, python
        config: {}
        tool_schema: {type: function, function: {name: calculator, description: ..., parameters: {...}}}
"""

from __future__ import annotations

import ast
import importlib
import operator
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

__all__ = [
    "CalculatorTool",
    "PythonTool",
    "Tool",
    "TOOL_REGISTRY",
    "build_tools",
    "load_tool_config",
    "register_tool",
    "safe_arithmetic",
    "truncate",
]


class Tool:
    """Base class. ``name`` and ``schema`` (OpenAI ``{"type": "function", "function": {...}}``)."""

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}

    def __init__(self, config: Mapping[str, Any] | None = None, tool_schema: Mapping[str, Any] | None = None):
        self.config = dict(config or {})
        if tool_schema is not None:
            function = dict(tool_schema).get("function", tool_schema)
            self.name = function.get("name", self.name)
            self.description = function.get("description", self.description)
            self.parameters = function.get("parameters", self.parameters)
        if not self.name:
            raise ValueError(f"{type(self).__name__} has no name (set it or give a tool_schema)")

    @property
    def schema(self) -> dict[str, Any]:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def execute(self, arguments: dict[str, Any], **kwargs: Any) -> str:  # pragma: no cover - abstract
        raise NotImplementedError


def truncate(text: str, limit: int, side: str = "middle") -> str:
    """Cut ``text`` to ``limit`` characters (verl's tool_response_truncate_side: left | right | middle)."""
    if limit <= 0 or len(text) <= limit:
        return text
    marker = "...(truncated)..."
    keep = max(limit - len(marker), 0)
    if side == "left":
        return marker + text[len(text) - keep:]
    if side == "right":
        return text[:keep] + marker
    head = keep // 2
    return text[:head] + marker + text[len(text) - (keep - head):]


# ---------------------------------------------------------------------------------------------- calculator
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 1000
_MAX_DIGITS = 4000
_MAX_EXPRESSION = 1000


def safe_arithmetic(expression: str) -> int | float:
    """Evaluate + - * / // % ** and parentheses on numbers; nothing else is accepted (no names, calls,
    attributes), exponents are capped and results bounded, so no input can run code or hang."""
    if len(expression) > _MAX_EXPRESSION:
        raise ValueError(f"expression longer than {_MAX_EXPRESSION} characters")
    tree = ast.parse(expression.strip(), mode="eval")

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
                raise ValueError(f"exponent {right} is larger than {_MAX_EXPONENT}")
            value = _BINARY[type(node.op)](left, right)
            if isinstance(value, int) and value.bit_length() > _MAX_DIGITS * 3.33:
                raise ValueError("result too large")
            return value
        raise ValueError(f"unsupported element {type(node).__name__} (only numbers and + - * / // % ** ( ))")

    return ev(tree)


class CalculatorTool(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression with + - * / // % ** and parentheses; returns the exact result."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 123456 * 654321"}},
        "required": ["expression"],
    }

    def execute(self, arguments: dict[str, Any], **kwargs: Any) -> str:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            return 'Error: calculator needs {"expression": "<arithmetic expression>"}.'
        try:
            value = safe_arithmetic(expression)
        except ZeroDivisionError:
            return "Error: division by zero."
        except (SyntaxError, ValueError, TypeError, OverflowError) as exc:
            return f"Error: cannot evaluate {expression!r}: {exc}"
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            value = int(value)
        return str(value)


# ---------------------------------------------------------------------------------------------- python
@lru_cache(maxsize=1)
def _unshare_prefix() -> tuple[str, ...]:
    """``unshare -rn`` (a new, empty network namespace) when this machine allows unprivileged user
    namespaces; () otherwise (then the network is NOT isolated, only proxies are cleared)."""
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    try:
        ok = subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return (exe, "-rn") if ok else ()


class PythonTool(Tool):
    """Runs code in a fresh ``python -I`` subprocess in an empty temporary directory.

    Enforced: wall-clock timeout (``timeout_s``, the process group is killed), CPU seconds
    (RLIMIT_CPU), address space (RLIMIT_AS, ``memory_mb``), file size (RLIMIT_FSIZE), number of open
    files, no core dumps; an environment with only PATH, no proxies; stdout+stderr truncated to
    ``max_output_chars``. Network: a new empty network namespace (``unshare -rn``) where the machine
    allows unprivileged user namespaces (``network_isolated`` says whether it did); elsewhere best-effort
    only. It is not a security boundary against a determined attacker (same user, same filesystem)."""

    name = "python"
    description = "Run a Python 3 program and return what it prints (stdout and stderr)."
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the program; print() the result"}},
        "required": ["code"],
    }

    def __init__(self, config: Mapping[str, Any] | None = None, tool_schema: Mapping[str, Any] | None = None):
        super().__init__(config, tool_schema)
        self.timeout_s = float(self.config.get("timeout_s", 5.0))
        self.memory_mb = int(self.config.get("memory_mb", 512))
        self.max_output_chars = int(self.config.get("max_output_chars", 2000))
        self.isolate_network = bool(self.config.get("isolate_network", True))

    @property
    def network_isolated(self) -> bool:
        return self.isolate_network and bool(_unshare_prefix())

    def _boot(self) -> str:
        """The child's first statements: set its own limits, then run the program (no preexec_fn, which is
        unsafe in a multi-threaded parent such as the agent loop's tool pool)."""
        cpu = max(1, int(self.timeout_s) + 1)
        mem = self.memory_mb * 1024 * 1024
        return (
            "import resource as r\n"
            f"r.setrlimit(r.RLIMIT_CPU, ({cpu}, {cpu}))\n"
            f"r.setrlimit(r.RLIMIT_AS, ({mem}, {mem}))\n"
            "r.setrlimit(r.RLIMIT_FSIZE, (16 << 20, 16 << 20))\n"
            "r.setrlimit(r.RLIMIT_NOFILE, (64, 64))\n"
            "r.setrlimit(r.RLIMIT_CORE, (0, 0))\n"
            "src = open('main.py').read()\n"
            "del r\n"
            "exec(compile(src, 'main.py', 'exec'), {'__name__': '__main__'})\n"
        )

    def execute(self, arguments: dict[str, Any], **kwargs: Any) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            return 'Error: python needs {"code": "<program>"}.'
        prefix = _unshare_prefix() if self.isolate_network else ()
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONIOENCODING": "utf-8"}
        with tempfile.TemporaryDirectory(prefix="mrl-python-tool-") as cwd:
            with open(os.path.join(cwd, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            try:
                proc = subprocess.Popen(
                    [*prefix, sys.executable, "-I", "-c", self._boot()], cwd=cwd, env=env,
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as exc:
                return f"Error: could not start the Python sandbox: {exc}"
            try:
                out, _ = proc.communicate(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, 9)
                except (ProcessLookupError, PermissionError):
                    proc.kill()
                proc.communicate()
                return f"Error: the program ran longer than {self.timeout_s:g}s and was killed."
        text = out.decode("utf-8", errors="replace")
        if proc.returncode != 0:
            reason = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
            text = f"{text}\n[{reason}]".strip()
        return truncate(text, self.max_output_chars, "middle") if text else "(no output)"


# ---------------------------------------------------------------------------------------------- registry
TOOL_REGISTRY: dict[str, type[Tool]] = {"calculator": CalculatorTool, "python": PythonTool}


def register_tool(name: str) -> Callable[[type[Tool]], type[Tool]]:
    def wrap(cls: type[Tool]) -> type[Tool]:
        TOOL_REGISTRY[name] = cls
        return cls

    return wrap


def _resolve_class(class_name: str) -> type[Tool]:
    if class_name in TOOL_REGISTRY:
        return TOOL_REGISTRY[class_name]
    module, _, attr = class_name.rpartition(".")
    if not module:
        raise ValueError(f"unknown tool {class_name!r}; built-in: {sorted(TOOL_REGISTRY)}, or give module.Class")
    return getattr(importlib.import_module(module), attr)


def build_tools(specs: Any) -> dict[str, Tool]:
    """Tools by name from a list of names (``["calculator"]``) or verl tool-config entries."""
    tools: dict[str, Tool] = {}
    for spec in specs or ():
        if isinstance(spec, str):
            tool = _resolve_class(spec)()
        else:
            spec = dict(spec)
            tool = _resolve_class(spec["class_name"])(spec.get("config") or {}, spec.get("tool_schema"))
        if tool.name in tools:
            raise ValueError(f"two tools are named {tool.name!r}")
        tools[tool.name] = tool
    return tools


def load_tool_config(path: str | os.PathLike) -> dict[str, Tool]:
    """Read verl's tool config YAML (``tools: [{class_name, config, tool_schema}]``)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(cfg, dict) or "tools" not in cfg:
        raise ValueError(f"{path}: a tool config needs a top-level 'tools' list")
    return build_tools(cfg["tools"])
