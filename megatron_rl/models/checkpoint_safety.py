"""Refuse a checkpoint whose pickles would run code (issue 33).

torch.distributed.checkpoint unpickles two things of a checkpoint with plain pickle: each ``.metadata``
(``FileSystemReader.read_metadata``: ``pickle.load``) and each non-tensor object stored in the ``.distcp``
shards (``DefaultLoadPlanner.load_bytes``: ``torch.load(weights_only=False)``; our RNG states, Megatron's
``_extra_state``s). A file planted in a run directory would run code on resume. Before megatron-core reads
a checkpoint, every ``.metadata`` under it is unpickled here with an unpickler that resolves only the globals
a real DCP metadata holds (recorded from torch_dist checkpoints written by megatron-core 0.16.1 on torch 2.13),
and every stored object's pickle is scanned (``torch.serialization.get_unsafe_globals_in_checkpoint``, which
runs nothing) for globals beyond torch's weights-only set and the numpy arrays an RNG state holds. Anything
else is refused, naming the file and the global.
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


# What a stored object may ask for beyond torch's weights-only set: numpy arrays (numpy's RNG state).
_OBJECT_GLOBALS = {
    "numpy.ndarray", "numpy.dtype", "numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct",
}


def _allowed_object_global(name: str) -> bool:
    return name in _OBJECT_GLOBALS or (name.startswith("numpy.dtypes.") and name.endswith("DType"))


def check_stored_objects(metadata_path: Path) -> None:
    """Scan each non-tensor object the checkpoint beside ``metadata_path`` stores, without unpickling it."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    with open(metadata_path, "rb") as file:
        metadata = _MetadataUnpickler(file, metadata_path).load()  # checked above: only DCP classes
    for index, info in (metadata.storage_data or {}).items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        shard = metadata_path.parent / info.relative_path
        where = f"{shard}: the stored object {index.fqn!r}"
        if getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpointError(f"{where} is stored transformed ({info.transform_descriptors}), which this "
                                        "trainer never writes; nothing was run")
        with open(shard, "rb") as file:
            file.seek(info.offset)
            data = file.read(info.length)
        try:
            found = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
        except Exception as err:
            raise UnsafeCheckpointError(f"{where} is not a torch-saved object ({err}); nothing was run") from err
        unsafe = [name for name in found if not _allowed_object_global(name)]
        if unsafe:
            raise UnsafeCheckpointError(
                f"{where} asks for {unsafe}, which no checkpoint of this trainer holds (a file planted to run "
                "code on resume?); nothing was run")


def check_checkpoint_metadata(checkpoint_dir: str | Path) -> None:
    """Check every ``.metadata`` under ``checkpoint_dir``, and the objects its shards store, before anything
    unpickles them for real."""
    for path in sorted(Path(checkpoint_dir).rglob("*.metadata")):
        if path.is_file():
            check_metadata_file(path)
            check_stored_objects(path)
