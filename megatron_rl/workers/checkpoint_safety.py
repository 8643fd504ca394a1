"""Refuse a checkpoint whose ``.metadata`` pickle would run code (issue 33).

torch.distributed.checkpoint's ``FileSystemReader.read_metadata`` loads a checkpoint's ``.metadata``
with plain ``pickle.load``, so a file planted in a run directory would run code on resume. Before
megatron-core reads a checkpoint, every ``.metadata`` under it is unpickled here with an unpickler that
resolves only the globals a real DCP metadata holds (recorded from torch_dist checkpoints written by
megatron-core 0.16.1 on torch 2.13) and refuses any other, naming the file and the global.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.planner": {
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem", "LoadItemType",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
    "pathlib": {"PosixPath", "PurePosixPath"},
}


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file would resolve a global no real checkpoint metadata holds."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path):
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str):
        allowed = name in _DCP_CLASSES.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not allowed:
            raise UnsafeCheckpointError(
                f"{self._path}: refusing to load this checkpoint: its pickle asks for {module}.{name}, which no "
                "torch.distributed.checkpoint metadata holds (a file planted to run code on resume?); "
                "nothing was run"
            )
        return super().find_class(module, name)


def check_metadata_file(path: str | Path) -> None:
    """Unpickle ``path`` with only DCP metadata classes allowed; raise UnsafeCheckpointError otherwise."""
    path = Path(path)
    data = path.read_bytes()
    try:
        _MetadataUnpickler(io.BytesIO(data), path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # a truncated or corrupt file: name it rather than let torch fail later
        raise UnsafeCheckpointError(f"{path}: not a readable checkpoint metadata pickle ({err})") from err


def check_checkpoint_metadata(checkpoint_dir: str | Path) -> None:
    """Check every ``.metadata`` under ``checkpoint_dir`` before anything unpickles it for real."""
    for path in sorted(Path(checkpoint_dir).rglob("*.metadata")):
        if path.is_file():
            check_metadata_file(path)
