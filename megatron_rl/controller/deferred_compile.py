"""Import Megatron-Core without importing TorchDynamo (issue 39: start-up).

Megatron-Core decorates its fused kernels (bias-GeLU, SwiGLU, ...) with ``torch.compile`` at import time
(``megatron.core.jit.jit_fuser``). Compiling is lazy anyway, but the decorator itself imports ``torch._dynamo`` (and
sympy with it): 40% of the CPU seconds of ``import megatron.core`` (5.3 -> 3.2 CPU-s measured), for kernels a CPU
run and most small runs never call. Inside ``deferred_compile()`` a function given to ``torch.compile`` gets a
wrapper that calls the real ``torch.compile`` at its first call, so a kernel that runs is compiled exactly as
before (same arguments, first call), and one that never runs costs nothing.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator

__all__ = ["deferred_compile"]


def _deferring(real: Callable[..., Any]) -> Callable[..., Any]:
    def compile_later(model: Any = None, **kwargs: Any) -> Any:
        if model is None:  # used as @torch.compile(**options)
            return lambda fn: compile_later(fn, **kwargs)
        if not inspect.isfunction(model):  # modules and other callables: what torch.compile returns for them
            return real(model, **kwargs)
        compiled: Callable[..., Any] | None = None

        @functools.wraps(model)
        def first_call_compiles(*args: Any, **kw: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **kwargs)
            return compiled(*args, **kw)

        return first_call_compiles

    return compile_later


@contextlib.contextmanager
def deferred_compile() -> Iterator[None]:
    """Within it, ``torch.compile(fn)`` of a plain function defers the real call to ``fn``'s first call."""
    import torch

    real = torch.compile
    torch.compile = _deferring(real)
    try:
        yield
    finally:
        torch.compile = real
