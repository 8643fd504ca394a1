"""Built-in tools (calculator, sandboxed python), Hermes parsing, verl's tool config."""

from __future__ import annotations

import socket
import time

import pytest

from megatron_rl.agent import (
    CalculatorTool,
    PythonTool,
    ToolCall,
    ToolCallError,
    load_tool_config,
    parse_tool_calls,
    safe_arithmetic,
)


def test_parse_hermes_tool_calls():
    text = ('think <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call> and '
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call> '
            '<tool_call>not json</tool_call><tool_call>[1]</tool_call><tool_call>{"name": "x", "arguments": 3}</tool_call>')
    calls, rest = parse_tool_calls(text)
    assert calls[0] == ToolCall("calculator", {"expression": "1+2"})
    assert calls[1] == ToolCall("python", {"code": "print(1)"})
    assert all(isinstance(c, ToolCallError) for c in calls[2:]) and len(calls) == 5
    assert "not valid JSON" in calls[2].message and "JSON object" in calls[3].message
    assert rest.startswith("think") and "<tool_call>" not in rest
    assert parse_tool_calls("#### 42") == ([], "#### 42")
    calls, _ = parse_tool_calls('<tool_call>{"name": "a"')
    assert isinstance(calls[0], ToolCallError) and "never closed" in calls[0].message


def test_calculator_is_exact_and_refuses_code():
    calc = CalculatorTool()
    assert calc.execute({"expression": "123456 * 654321"}) == str(123456 * 654321)
    assert calc.execute({"expression": "(2 + 3) ** 2 - 7 // 2"}) == "22"
    assert calc.execute({"expression": "10 / 4"}) == "2.5"
    for bad in ("__import__('os').system('true')", "open('/etc/passwd')", "(1).__class__", "x + 1", "[1]*9"):
        assert calc.execute({"expression": bad}).startswith("Error"), bad
    start = time.monotonic()
    assert "exponent" in calc.execute({"expression": "9 ** 9 ** 9"})
    assert calc.execute({"expression": "2 ** 999 * 2 ** 999 * 2 ** 999 * 2 ** 999 * 2 ** 999 * 2 ** 999 * 2 ** 999 * 2 ** 999 * 2 ** 999 * 2 ** 999 * 2 ** 999 * 2 ** 999 * 2 ** 999 * 2 ** 999"}).startswith("Error")
    assert time.monotonic() - start < 1.0
    assert calc.execute({"expression": "1/0"}) == "Error: division by zero."
    assert calc.execute({}).startswith("Error")
    assert calc.schema["function"]["name"] == "calculator"
    assert safe_arithmetic("-3 + 4") == 1


def test_python_tool_runs_code_and_truncates_output():
    py = PythonTool({"timeout_s": 5, "max_output_chars": 100})
    assert py.execute({"code": "print(6 * 7)"}).strip() == "42"
    long = py.execute({"code": "print('x' * 10000)"})
    assert len(long) <= 100 and "truncated" in long
    err = py.execute({"code": "raise ValueError('no')"})
    assert "ValueError: no" in err and "exit status 1" in err
    assert py.execute({"code": 3}).startswith("Error")


def test_python_tool_time_and_memory_limits():
    py = PythonTool({"timeout_s": 1, "memory_mb": 256})
    start = time.monotonic()
    out = py.execute({"code": "while True: pass"})
    assert time.monotonic() - start < 4 and ("longer than" in out or "signal" in out)
    out = PythonTool({"timeout_s": 10, "memory_mb": 256}).execute(
        {"code": "x = bytearray(1024 * 1024 * 1024); print('alloc' + 'ated')"})
    assert "MemoryError" in out and "allocated" not in out.replace("'alloc' + 'ated'", "")


def test_python_tool_environment_and_network():
    py = PythonTool({"timeout_s": 5})
    # no inherited secrets / proxies; runs in an empty temporary directory
    assert py.execute({"code": "import os; print(sorted(os.environ))"}).strip() in (
        "['PATH', 'PYTHONIOENCODING']", "['LC_CTYPE', 'PATH', 'PYTHONIOENCODING']")
    assert py.execute({"code": "import os; print(os.listdir('.'))"}).strip() == "['main.py']"
    if not py.network_isolated:
        pytest.skip("no unprivileged network namespace here (unshare -rn): network isolation not enforced")
    out = py.execute({"code": "import socket; socket.create_connection(('1.1.1.1', 53), timeout=1); print('conn' + 'ected')"})
    assert "connected" not in out.replace("'conn' + 'ected'", "") and ("OSError" in out or "Errno" in out)


def test_verl_tool_config(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n"
        "  - class_name: megatron_rl.agent.tools.CalculatorTool\n"
        "    config: {}\n"
        "    tool_schema:\n"
        "      type: function\n"
        "      function:\n"
        "        name: calc\n"
        "        description: arithmetic\n"
        "        parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}\n"
        "  - class_name: python\n"
        "    config: {timeout_s: 2}\n"
    )
    tools = load_tool_config(path)
    assert sorted(tools) == ["calc", "python"]
    assert tools["calc"].execute({"expression": "2*3"}) == "6"
    assert tools["python"].timeout_s == 2.0
    assert tools["calc"].schema["function"]["parameters"]["required"] == ["expression"]
