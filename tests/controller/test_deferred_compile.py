"""deferred_compile (issue 39, start-up): torch.compile of a function inside it runs at the function's first call,
with the same arguments; modules go to torch.compile at once; torch.compile is restored on the way out."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.controller.deferred_compile import deferred_compile


@pytest.fixture
def recorded(monkeypatch):
    calls = []

    def fake_compile(model=None, **kwargs):
        calls.append((model, kwargs))
        return model if model is not None else (lambda fn: fn)

    monkeypatch.setattr(torch, "compile", fake_compile)
    return calls


def test_a_function_is_compiled_at_its_first_call_with_the_same_options(recorded):
    with deferred_compile():
        def double(x):
            return 2 * x

        plain = torch.compile(double)
        with_options = torch.compile(dynamic=False)(double)
    assert recorded == []  # nothing compiled (nor TorchDynamo imported) at decoration time
    assert plain(3) == 6 and plain(4) == 8 and with_options(5) == 10
    assert recorded == [(double, {}), (double, {"dynamic": False})]  # once each, at the first call
    assert plain.__name__ == "double"


def test_modules_are_compiled_at_once_and_torch_compile_is_restored(recorded):
    fake = torch.compile
    module = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="boom"):
        with deferred_compile():
            assert torch.compile(module) is module and recorded == [(module, {})]
            raise RuntimeError("boom")
    assert torch.compile is fake
