"""Tools an environment lets the model call, described in OpenAI function-call JSON schema form (verl's
tool config), with two built-ins: ``calculator`` (safe arithmetic) and ``python`` (a sandboxed executor).

A tool's ``execute(arguments)`` returns the text the model sees. It must not raise for bad input: errors
are returned as text, and a call that failed on the tool's side (a service that timed out, refused or answered
nonsense; agent/tool_service.py) returns a ``ToolError``, text with a ``reason`` that the agent loop counts in
the sample's ``tool_error_counts``. The agent loop additionally bounds every tool call in time
(``multi_turn.tool_timeout_s``), so a hanging tool costs its sample a timeout observation, never the batch.

Tool config file (``multi_turn.tool_config_path``, verl's format)::

    tools:
      - class_name: megatron_rl.agent.tools.CalculatorTool   # or a built-in name: calculator, python, http,
                                                           # sandbox_fusion (verl's SandboxFusionTool)
        config: {}
        tool_schema: {type: function, function: {name: calculator, description: ..., parameters: {...}}}
"""

from __future__ import annotations

import ast
import importlib
import operator
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from megatron_rl.agent.sandbox import (
    FILESYSTEMS,
    Sandbox,
    SandboxLimits,
    SandboxReport,
    sandbox_for,
    sandbox_report,
)

__all__ = [
    "CalculatorTool",
    "PythonTool",
    "SandboxReport",
    "Tool",
    "ToolError",
    "TOOL_REGISTRY",
    "build_tools",
    "load_tool_config",
    "program_text",
    "register_tool",
    "safe_arithmetic",
    "sandbox_report",
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


class ToolError(str):
    """The text of a failed call, as the model sees it, with ``reason`` (a short tag: timeout, connection,
    unauthorized, http_503, bad_json, ...) that the sample's metrics count."""

    reason: str

    def __new__(cls, text: str, reason: str) -> ToolError:
        error = super().__new__(cls, text)
        error.reason = reason
        return error


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
class PythonTool(Tool):
    """Runs code in a fresh ``python -I`` subprocess, contained as ``sandbox`` reports (``SandboxReport``;
    agent/sandbox.py builds it).

    ``filesystem`` (config): ``empty_root`` (default) or ``host``. ``empty_root``: a PID namespace per call
    (it sees no other process; every process it starts, daemons included, dies with the call), a mount
    namespace whose root is an empty tmpfs holding only ``sandbox.interpreter_paths()`` read-only, its own
    ``/proc`` and a private size-bounded ``/tmp`` (its cwd, HOME and TMPDIR): the training data, model,
    checkpoints, outputs and every other host file do not exist for it. A new empty network, IPC and UTS
    namespace, and no privileges: as ``nobody`` (65534, no supplementary groups) when the trainer is root, in
    a user namespace of its own otherwise. Where namespaces are not allowed the tool refuses to be built,
    naming ``filesystem: host``. ``host``, the user's explicit choice: the same namespaces with the host's whole
    filesystem read-only (every world-readable file visible), else a session of its own killed as a group, as
    ``nobody`` when the trainer is root. Always: wall-clock limit (``timeout_s``; output is read with a
    deadline, so a process holding the pipe cannot extend the call), CPU seconds, address space
    (``memory_mb``), file size, open files, processes (RLIMIT_NPROC, ``max_processes``; counted per call where
    a user namespace can be made), no core dumps; an environment with only PATH (no proxies or secrets);
    output truncated to ``max_output_chars``."""

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
        self.max_processes = int(self.config.get("max_processes", 32))
        self.tmp_mb = int(self.config.get("tmp_mb", 64))
        self.filesystem = str(self.config.get("filesystem", "empty_root"))
        if self.filesystem not in FILESYSTEMS:
            raise ValueError(f"the python tool's config filesystem={self.filesystem!r}: choose one of "
                             f"{', '.join(FILESYSTEMS)}")
        if self.filesystem == "empty_root":
            self._sandbox()  # refused here, when the tools are built, not at the model's first call
        self._limits = SandboxLimits(self.timeout_s, self.memory_mb, self.max_processes, self.tmp_mb,
                                     max(4 * self.max_output_chars, 1 << 16))

    def _sandbox(self) -> Sandbox:
        return sandbox_for(self.isolate_network, self.filesystem)

    @property
    def sandbox(self) -> SandboxReport:
        return self._sandbox().report

    @property
    def network_isolated(self) -> bool:
        return self.sandbox.network_isolated

    def execute(self, arguments: dict[str, Any], **kwargs: Any) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            return 'Error: python needs {"code": "<program>"}.'
        timed_out, returncode, text = self._sandbox().run(code, self._limits)
        return program_text(timed_out, returncode, text, self.timeout_s, self.max_output_chars)


def program_text(timed_out: bool, returncode: int, text: str, timeout_s: float, max_chars: int) -> str:
    """What the python tool shows the model of a run (here, and served: agent/sandbox_service.py's /execute)."""
    if timed_out:
        return f"Error: the program ran longer than {timeout_s:g}s and was killed."
    if returncode == -1 and text.startswith("Error: could not start"):
        return text
    if returncode != 0:
        reason = (f"killed by signal {-returncode}" if returncode < 0
                  else f"killed by signal {returncode - 128}" if returncode > 128
                  else f"exit status {returncode}")
        text = f"{text}\n[{reason}]".strip()
    return truncate(text, max_chars, "middle") if text else "(no output)"


# ---------------------------------------------------------------------------------------------- registry
TOOL_REGISTRY: dict[str, type[Tool]] = {"calculator": CalculatorTool, "python": PythonTool}
# built-ins that live in modules of their own, imported when a config names them (they import this one)
_SERVICE_TOOLS = {
    "http": "megatron_rl.agent.tool_service.HTTPTool",
    "sandbox_fusion": "megatron_rl.agent.tool_service.SandboxFusionTool",
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": "megatron_rl.agent.tool_service.SandboxFusionTool",
}


def register_tool(name: str) -> Callable[[type[Tool]], type[Tool]]:
    def wrap(cls: type[Tool]) -> type[Tool]:
        TOOL_REGISTRY[name] = cls
        return cls

    return wrap


def _resolve_class(class_name: str) -> type[Tool]:
    if class_name in TOOL_REGISTRY:
        return TOOL_REGISTRY[class_name]
    module, _, attr = _SERVICE_TOOLS.get(class_name, class_name).rpartition(".")
    if not module:
        raise ValueError(f"unknown tool {class_name!r}; built-in: {sorted({*TOOL_REGISTRY, 'http', 'sandbox_fusion'})}"
                         ", or give module.Class")
    return getattr(importlib.import_module(module), attr)


def build_tools(specs: Iterable[str | Mapping[str, Any]] | None) -> dict[str, Tool]:
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

    loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(loaded, dict) or "tools" not in loaded:
        raise ValueError(f"{path}: a tool config needs a top-level 'tools' list")
    return build_tools(loaded["tools"])
