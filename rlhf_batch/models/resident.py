"""Weights and optimizer states kept in memory by a process that runs many stages.

`run` with `in_process` (and each lane of a `run` with `max_staleness > 0`) runs generate, score
and train of every iteration in one process. The files stay the interface: train still writes
the policy and the optimizer state, and every stage still names the files it reads. But a file
this process wrote or read before is not read again while its fingerprint (below) is the one
recorded with the tensors in memory: the tensors are copied from memory instead (on the device
they live on: no disk, no host round trip). A copy of what the file holds, so a stage gets
exactly what reading the file would give (the same values, in the file's dtype).

Fingerprints, cheap to take: for a model directory, the weights digest train records
(`store.modeldir.WEIGHTS_DIGEST`, sha256 of the files) and, for every weight file, its size,
modification time (ns) and inode; for an optimizer state, its JSON's text and the same stat of
its tensor file. A file rewritten (a re-run with `--force`, a hand edit) has another inode and
mtime, so it is read again. Only local run directories are kept (an object store's files are
read through their local copy, keyed by ETag, store/fs.local_dir).

At most MAX_MODELS model entries (least recently used dropped first: the reference and the
latest two policies; every load gets a copy) and one optimizer state (handed over to the one
load that reads it: no copy) are kept; off unless `keep` switched it on, so a
stage process (one stage, then exit) keeps nothing. `DISK_READS` counts the loads that read
files, by kind ("model", "optimizer").
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter, OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlhf_batch.store.fs import store_of

MAX_MODELS = 3
_ON: dict[str, bool] = {"on": False}
_MODELS: OrderedDict[str, tuple[tuple[Any, ...], dict[str, Any]]] = OrderedDict()
_STATES: OrderedDict[str, tuple[tuple[Any, ...], dict[str, Any]]] = OrderedDict()
DISK_READS: Counter[str] = Counter()


def enabled() -> bool:
    return _ON["on"]


@contextlib.contextmanager
def keep() -> Iterator[None]:
    """Keep weights and optimizer states (and model templates, models/load.py) while the block
    runs; everything kept is dropped at its end."""
    before = _ON["on"]
    _ON["on"] = True
    try:
        yield
    finally:
        _ON["on"] = before
        if not before:
            clear()


def clear() -> None:
    _MODELS.clear()
    _STATES.clear()


def _key(p: Path) -> str | None:
    return os.path.realpath(p) if store_of(p).local else None


def _stat(f: Path) -> tuple[str, int, int, int]:
    st = f.stat()
    return f.name, st.st_size, st.st_mtime_ns, st.st_ino


def model_fingerprint(p: Path) -> tuple[Any, ...]:
    """The weights digest recorded beside `p`'s weights (None when there is none) and the stat of
    each weight file."""
    from rlhf_batch.store.modeldir import weights_digest

    return weights_digest(p), tuple(_stat(f) for f in sorted(p.glob("*.safetensors")))


def weights(p: Path) -> dict[str, Any] | None:
    """A copy of the tensors of `p`'s weight files kept in memory (by name, in the files'
    dtypes), or None: not kept, or the files changed since."""
    key = _key(p) if enabled() else None
    if key is None or key not in _MODELS:
        return None
    fingerprint, kept = _MODELS[key]
    if fingerprint != model_fingerprint(p):
        del _MODELS[key]
        return None
    _MODELS.move_to_end(key)
    if "tensors" in kept:
        return {k: t.clone() for k, t in kept["tensors"].items()}
    return {k: t for blob in kept["files"] for k, t in _unpack(blob).items()}


def put_weights(p: Path, tensors: dict[str, Any]) -> None:
    """Keep `tensors`, which hold the values of the weight files of `p` (every tensor the files
    hold, by name, in the files' dtypes and shapes: checked against their headers; otherwise
    nothing is kept). On the CPU they are packed as the files lay them out, and every copy given
    out puts each tensor at the address (mod 64) that reading the file gives it: CPU matmul
    kernels round differently at another alignment, and a copy must compute as the file does."""
    key = _key(p) if enabled() else None
    files = _headers(p) if key is not None else None
    if key is None or files is None:
        return
    for _, _, header in files:
        for k, (dtype, shape, _, _) in header.items():
            t = tensors.get(k)
            if t is None or t.dtype != dtype or tuple(t.shape) != shape:
                return
    if all(t.device.type == "cpu" for t in tensors.values()):
        kept: dict[str, Any] = {"files": [_pack(start, size, h, tensors) for start, size, h in files]}
    else:
        kept = {"tensors": {k: tensors[k].detach() for _, _, h in files for k in h}}
    _MODELS[key] = (model_fingerprint(p), kept)
    _MODELS.move_to_end(key)
    while len(_MODELS) > MAX_MODELS:
        _MODELS.popitem(last=False)


_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}  # fmt: skip


def _headers(p: Path) -> list[tuple[int, int, dict[str, Any]]] | None:
    """Per weight file of `p`: where its data begins, its data's size and {name: (dtype, shape,
    begin, end)} (offsets in the data), from the safetensors header; None for a dtype not known."""
    import json
    import struct

    import torch

    out = []
    for f in sorted(p.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            raw = json.loads(fh.read(n))
        raw.pop("__metadata__", None)
        if any(v["dtype"] not in _DTYPES for v in raw.values()):
            return None
        header = {
            k: (getattr(torch, _DTYPES[v["dtype"]]), tuple(v["shape"]), *v["data_offsets"])
            for k, v in raw.items()
        }
        out.append((8 + n, max((v[3] for v in header.values()), default=0), header))
    return out


def _pack(start: int, size: int, header: dict[str, Any], tensors: dict[str, Any]) -> tuple[Any, ...]:
    """One file's tensors as its data section: bytes, where the data begins in the file, header."""
    import torch

    blob = torch.empty(size, dtype=torch.uint8)
    for k, (_, _, begin, end) in header.items():
        if end > begin:
            blob[begin:end].copy_(tensors[k].detach().contiguous().reshape(-1).view(torch.uint8))
    return blob, start, header


def _unpack(kept: tuple[Any, ...]) -> dict[str, Any]:
    """A copy of one packed file's tensors, each at the address mod 64 a (page-aligned) mapping of
    the file gives it."""
    import numpy as np
    import torch

    blob, start, header = kept
    buf = np.empty(blob.numel() + 64, dtype=np.uint8)
    at = (start - buf.ctypes.data) % 64
    data = buf[at : at + blob.numel()]
    data[:] = blob.numpy()
    whole = memoryview(data)  # type: ignore[arg-type]
    # each tensor a storage of its own, exactly its bytes (as a file read gives them): a tensor
    # viewing a larger storage is refused by safetensors' save_model (tied weights, checkpoints)
    return {
        k: torch.frombuffer(whole[begin:end], dtype=dtype).view(shape)
        if end > begin
        else torch.empty(shape, dtype=dtype)
        for k, (dtype, shape, begin, end) in header.items()
    }


def state_fingerprint(out: Path, tensors_file: str, meta_file: str) -> tuple[Any, ...]:
    return (out / meta_file).read_text(), _stat(out / tensors_file)


def take_state(out: Path, tensors_file: str, meta_file: str) -> dict[str, Any] | None:
    """The tensors of the optimizer state in `out` kept in memory (by their names in the file),
    handed over: no longer kept (the next iteration's optimizer updates them in place, and only it
    reads this state; a second read goes to the file). None when not kept or the files changed."""
    key = _key(out) if enabled() else None
    if key is None or key not in _STATES:
        return None
    fingerprint, tensors = _STATES.pop(key)
    if fingerprint != state_fingerprint(out, tensors_file, meta_file):
        return None
    return tensors


def put_state(out: Path, tensors: dict[str, Any], tensors_file: str, meta_file: str) -> None:
    """Keep `tensors`, the optimizer state just written to `out` (the one kept before is dropped)."""
    key = _key(out) if enabled() else None
    if key is None:
        return
    _STATES.clear()
    _STATES[key] = (
        state_fingerprint(out, tensors_file, meta_file),
        {k: t.detach() for k, t in tensors.items()},
    )
