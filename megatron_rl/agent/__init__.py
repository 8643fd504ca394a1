"""Multi-turn, tool-using rollouts (docs/rollout.md, "Agent loop"): the loop, environments, tools; tools as
services in ``agent.tool_service`` and the sandbox served over HTTP in ``agent.sandbox_service``."""

from megatron_rl.agent.env import (
    ENV_REGISTRY,
    AgentEnv,
    SingleTurnEnv,
    StepResult,
    ToolEnv,
    get_env,
    register_env,
)
from megatron_rl.agent.loop import AgentLoop, AgentLoopSettings, observation_token_ids
from megatron_rl.agent.parser import ToolCall, ToolCallError, parse_tool_calls
from megatron_rl.agent.tools import (
    TOOL_REGISTRY,
    CalculatorTool,
    PythonTool,
    Tool,
    ToolError,
    build_tools,
    load_tool_config,
    register_tool,
    safe_arithmetic,
)

__all__ = [
    "ENV_REGISTRY", "TOOL_REGISTRY", "AgentEnv", "AgentLoop", "AgentLoopSettings", "CalculatorTool",
    "PythonTool", "SingleTurnEnv", "StepResult", "Tool", "ToolCall", "ToolError", "ToolCallError", "ToolEnv",
    "build_tools", "get_env", "load_tool_config", "observation_token_ids",
    "parse_tool_calls", "register_env", "register_tool", "safe_arithmetic",
]
