"""Issue 56, item 1 (the worker side of the /dev/shm weight path): a vLLM worker maps or writes a segment only
when the run made it. ``mrl_load_weights`` takes a layout whose path names a regular file, not a link, called
as the run names its segments (``shm.new_segment_name``: ``mrl_vllm_...``), owned by the worker's own user with
mode 0600 (``shm.ShmSegment`` creates it so), at least as large as the layout says; ``mrl_read_weights`` takes a
bare segment name. Before: another local user who reached ``/collective_rpc`` had the server load a file it
wrote as the served weights, and an absolute "name" made the worker write a file of its user at a path of the
caller's choosing (``os.path.join`` drops /dev/shm before an absolute path). Each refusal names the segment and
the reason, before anything is mapped or written. No server: the extension's methods on a worker double."""

from __future__ import annotations

import os
import pwd

import pytest
import torch

from megatron_rl.rollout.vllm import worker_extension
from megatron_rl.rollout.vllm.shm import ShmSegment, new_segment_name
from megatron_rl.rollout.vllm.worker_extension import WorkerExtension
from megatron_rl_testing.vllm_support import skip_without_vllm

skip_without_vllm()

WEIGHT = torch.arange(4, dtype=torch.float32)


class Runner:
    def __init__(self) -> None:
        self.model = torch.nn.Linear(2, 2)


class Worker(WorkerExtension):
    """What the extension uses of vLLM's worker: its model runner, and ``reload_weights``, which consumes the
    weights it is given (recorded here)."""

    def __init__(self) -> None:
        self.model_runner = Runner()
        self.loaded: dict[str, torch.Tensor] = {}

    def reload_weights(self, weights_iterator, is_checkpoint_format: bool) -> None:
        self.loaded.update((name, tensor.clone()) for name, tensor in weights_iterator)


@pytest.fixture
def worker(monkeypatch) -> Worker:
    monkeypatch.setattr(worker_extension, "_tp_rank", lambda: 0)
    return Worker()


@pytest.fixture
def segment(tmp_path):
    """A segment as the run stages it."""
    seg = ShmSegment(str(tmp_path), new_segment_name("test"), [("lm_head.weight", WEIGHT)])
    yield seg
    seg.unlink()


def _load(worker: Worker, layout: dict) -> int:
    return worker.mrl_load_weights([[layout]])


def test_a_segment_the_run_staged_loads(worker, segment):
    assert oct(os.stat(segment.path).st_mode & 0o777) == "0o600"  # as ShmSegment creates it
    assert _load(worker, segment.layout) == 1
    assert torch.equal(worker.loaded["lm_head.weight"], WEIGHT)


def test_a_segment_of_another_user_is_refused(worker, segment):
    nobody = pwd.getpwnam("nobody").pw_uid
    os.chown(segment.path, nobody, -1)
    with pytest.raises(PermissionError, match=rf"{segment.path}.* owned by uid {nobody}, not this worker's"):
        _load(worker, segment.layout)
    assert worker.loaded == {}


def test_a_segment_others_can_read_or_write_is_refused(worker, segment):
    os.chmod(segment.path, 0o666)
    with pytest.raises(PermissionError, match=rf"{segment.path}.* mode 0o666, not 0o600"):
        _load(worker, segment.layout)
    assert worker.loaded == {}


def test_a_file_the_run_did_not_name_is_refused(worker, tmp_path):
    """A file of the worker's own user, mode 0600, that is no segment (a key, a config): never mapped."""
    planted = tmp_path / "id_ed25519"
    fd = os.open(planted, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, WEIGHT.numpy().tobytes())
    os.close(fd)
    layout = {"path": str(planted), "size": 16, "tensors": [["lm_head.weight", "float32", [4], 0, 16]]}
    with pytest.raises(PermissionError, match=rf"{planted}.* not a weight segment name"):
        _load(worker, layout)
    assert worker.loaded == {}


@pytest.mark.parametrize("how", ["symlink", "dotdot", "relative"])
def test_a_segment_reached_through_a_link_or_a_path_trick_is_refused(worker, segment, tmp_path, how):
    other = tmp_path / "elsewhere"
    other.mkdir()
    if how == "symlink":
        path = str(other / new_segment_name("link"))
        os.symlink(segment.path, path)
    elif how == "dotdot":
        path = str(other / ".." / os.path.basename(segment.path))
    else:
        path = os.path.relpath(segment.path)
    with pytest.raises(PermissionError, match=rf"segment {path!r}"):
        _load(worker, {**segment.layout, "path": path})
    assert worker.loaded == {}


def test_a_layout_larger_than_its_segment_is_refused(worker, segment):
    """Mapping past the file's end would kill the engine with SIGBUS at the first read."""
    with pytest.raises(PermissionError, match=rf"{segment.path}.* 16 bytes, the layout says 4096"):
        _load(worker, {**segment.layout, "size": 4096})
    assert worker.loaded == {}


@pytest.mark.parametrize("name", ["{tmp}/mrl_vllm_escape", "../mrl_vllm_escape", "mrl_vllm_a/b", "..", "",
                                  "not_a_segment"])
def test_read_weights_takes_a_bare_segment_name_only(worker, tmp_path, name):
    """Before: the absolute name wrote ``{tmp}/mrl_vllm_escape_tp0`` (a file the caller chose the path of)."""
    name = name.format(tmp=tmp_path)
    with pytest.raises(PermissionError, match=rf"segment name {name!r}"):
        worker.mrl_read_weights(name)
    assert sorted(os.listdir(tmp_path)) == []


def test_read_weights_writes_a_0600_segment_of_the_run(worker, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_RL_SHM_DIR", str(tmp_path))
    layout = worker.mrl_read_weights(new_segment_name("read"))
    try:
        assert os.path.dirname(layout["path"]) == str(tmp_path)
        assert oct(os.stat(layout["path"]).st_mode & 0o777) == "0o600"
        assert [entry[0] for entry in layout["tensors"]] == ["weight", "bias"]
    finally:
        os.unlink(layout["path"])
