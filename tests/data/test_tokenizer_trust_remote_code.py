"""data.trust_remote_code (issue 51): the tokenizer loads with the user's trust in their directory and warns that
the directory's code runs; false (the default) warns nothing."""
from __future__ import annotations

import logging

from megatron_rl.data.tokenizer import build_tiny_tokenizer, load_tokenizer


def test_trusting_the_directory_warns_naming_the_key_and_the_directory(tmp_path, caplog):
    build_tiny_tokenizer(tmp_path / "tok", ["hello world"] * 4)
    with caplog.at_level(logging.WARNING, logger="megatron_rl.data.tokenizer"):
        load_tokenizer(tmp_path / "tok", trust_remote_code=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("data.trust_remote_code=true" in w and str(tmp_path / "tok") in w and "runs the Python code" in w
               for w in warnings), warnings


def test_the_default_warns_nothing(tmp_path, caplog):
    build_tiny_tokenizer(tmp_path / "tok", ["hello world"] * 4)
    with caplog.at_level(logging.WARNING, logger="megatron_rl.data.tokenizer"):
        load_tokenizer(tmp_path / "tok")
    assert not [r for r in caplog.records if "trust_remote_code" in r.getMessage()]
