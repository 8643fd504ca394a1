"""DataProto rows on disk (``save_to_disk`` / ``load_from_disk``, verl's ``serialize``): tensors + JSON,
nothing pickled, so a planted file runs no code when read back.

``ProtocolError`` lives here, below megatron_rl.protocol in the import order, so the codec raises the same
error as every DataProto operation; megatron_rl.protocol re-exports it.
"""
from __future__ import annotations

import base64
import io
import json
import math
from typing import Any, Callable, Mapping, TypeVar

import numpy as np
import torch
from tensordict import TensorDict

__all__ = ["ProtocolError", "ROWS_FORMAT", "decode_rows", "encode_rows"]

Rows = TypeVar("Rows")


class ProtocolError(ValueError, AssertionError):
    """A DataProto operation refused: a ValueError (megatron-rl) that is also what verl raises (AssertionError)."""


# The format: one torch.save (zip) file holding only what torch.load(weights_only=True) reads: {"format": ROWS_FORMAT,
# "tensors": [tensor, ...], "json": uint8 tensor}. The JSON holds the batch's keys (each with its index into
# "tensors"), the non-tensor columns and meta_info. Every JSON object in it is a tag, so values come back with
# their types: {"d": [[key, value], ...]} a dict (any key type, order kept), {"t": [...]} a tuple, {"f": "nan"}
# a non-finite float, {"a": dtype, "s": shape, "v": [...]} a numpy array, {"n": dtype, "v": x} a numpy scalar,
# {"b": base64} bytes, {"T": i} a tensor in meta_info or a column; lists, str, int, float, bool and None as is.
ROWS_FORMAT = "megatron_rl.DataProto/rows-v1"
_ARRAY_KINDS = "biufU"  # numpy dtypes JSON holds exactly (plus object arrays, element by element)


def _encode_value(value: Any, where: str, tensors: list[torch.Tensor]) -> Any:
    if value is None or isinstance(value, (bool, str)) and not isinstance(value, np.generic):
        return value
    if isinstance(value, np.ndarray):
        if value.dtype != object and value.dtype.kind not in _ARRAY_KINDS:
            raise ProtocolError(f"{where}: numpy dtype {value.dtype} cannot be stored (bool, int, float, str, object)")
        return {"a": value.dtype.str if value.dtype != object else "O", "s": list(value.shape),
                "v": [_encode_value(x, where, tensors) for x in value.ravel().tolist()]
                if value.dtype != object else [_encode_value(x, where, tensors) for x in value.ravel()]}
    if isinstance(value, np.generic):
        if value.dtype.kind not in _ARRAY_KINDS:
            raise ProtocolError(f"{where}: numpy scalar of dtype {value.dtype} cannot be stored")
        return {"n": value.dtype.str, "v": _encode_value(value.item(), where, tensors)}
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"f": repr(float(value))}
    if isinstance(value, list):
        return [_encode_value(x, where, tensors) for x in value]
    if isinstance(value, tuple):
        return {"t": [_encode_value(x, where, tensors) for x in value]}
    if isinstance(value, dict):
        return {"d": [[_encode_value(k, where, tensors), _encode_value(v, f"{where}[{k!r}]", tensors)]
                      for k, v in value.items()]}
    if isinstance(value, bytes):
        return {"b": base64.b64encode(value).decode("ascii")}
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        return {"T": len(tensors) - 1}
    raise ProtocolError(f"{where}: a {type(value).__module__}.{type(value).__qualname__} cannot be stored on disk "
                        f"(str, int, float, bool, None, list, tuple, dict, bytes, numpy arrays/scalars, tensors)")


def _decode_value(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode_value(x, tensors) for x in value]
    if not isinstance(value, dict):
        return value
    (tag, body), *rest = value.items() if value else ((None, None),)
    if tag == "d":
        return {_decode_value(k, tensors): _decode_value(v, tensors) for k, v in body}
    if tag == "t":
        return tuple(_decode_value(x, tensors) for x in body)
    if tag == "f":
        return float(body)
    if tag == "b":
        return base64.b64decode(body)
    if tag == "T":
        return tensors[body]
    if tag == "n":
        return np.array(_decode_value(value["v"], tensors), dtype=np.dtype(body))[()]
    if tag == "a":
        items = [_decode_value(x, tensors) for x in value["v"]]
        if body != "O":
            return np.array(items, dtype=np.dtype(body)).reshape(value["s"])
        out = np.empty(len(items), dtype=object)
        for i, item in enumerate(items):
            out[i] = item
        return out.reshape(value["s"])
    raise ValueError(f"unknown tag {tag!r}")


def encode_rows(batch: TensorDict, non_tensor_batch: Mapping[str, np.ndarray], meta_info: Mapping[str, Any]) -> bytes:
    """A DataProto's three parts as the bytes ``decode_rows`` reads back; a value JSON cannot hold exactly is
    refused (ProtocolError naming where it is)."""
    tensors: list[torch.Tensor] = []
    keys = []
    for key in batch.keys(include_nested=True, leaves_only=True):
        tensors.append(batch.get(key))
        keys.append([list(key) if isinstance(key, tuple) else [key], len(tensors) - 1])
    doc = {"batch_size": list(batch.batch_size), "batch": keys,
           "non_tensor_batch": [[k, _encode_value(v, f"non_tensor_batch[{k!r}]", tensors)]
                                for k, v in non_tensor_batch.items()],
           "meta_info": _encode_value(meta_info, "meta_info", tensors)}
    text = json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()
    buffer = io.BytesIO()
    torch.save({"format": ROWS_FORMAT, "tensors": tensors,
                "json": torch.frombuffer(bytearray(text), dtype=torch.uint8)}, buffer)
    return buffer.getvalue()


def decode_rows(make: Callable[[TensorDict, dict, dict], Rows], raw: bytes, name: str) -> Rows:
    """``make(batch, non_tensor_batch, meta_info)`` (a DataProto class) on ``encode_rows``'s bytes, read with
    ``torch.load(weights_only=True)``: no code runs whatever they hold; anything else is refused
    (ProtocolError naming ``name``)."""
    try:
        state = torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as err:  # pickled objects (a file from before issue 33 or a planted one), not a torch file
        raise ProtocolError(f"{name} is refused: it is not the tensors + JSON that DataProto.save_to_disk writes "
                            f"(files that hold pickled objects are never loaded: that could run code). "
                            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None
    try:
        if not isinstance(state, dict) or state.get("format") != ROWS_FORMAT:
            raise ValueError(f"no format {ROWS_FORMAT!r}")
        tensors = state["tensors"]
        doc = json.loads(state["json"].numpy().tobytes().decode())
        batch = TensorDict({}, batch_size=doc["batch_size"])
        for key, index in doc["batch"]:
            batch.set(tuple(key) if len(key) > 1 else key[0], tensors[index])
        non_tensor = {k: _decode_value(v, tensors) for k, v in doc["non_tensor_batch"]}
        meta = _decode_value(doc["meta_info"], tensors)
    except Exception as err:
        raise ProtocolError(f"{name} is refused: it does not parse as DataProto rows ({type(err).__name__}: {err})"
                            ) from None
    out = make(batch, non_tensor, meta)
    out.non_tensor_batch.update(non_tensor)  # as saved: the constructor would make a numeric column an object one
    return out

