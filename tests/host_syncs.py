"""Counting, on the CPU, the operations that would make the host wait for a CUDA device.

On a CPU every tensor is already on the host, so CUDA's sync debug mode sees nothing; these ops
are what forces a transfer (and so a synchronization) when the tensors live on a GPU:
- reading a value on the host: `aten._local_scalar_dense` (`.item()`, `int(t)`, `bool(t)`, and
  indexing or slicing with a 0-d tensor, which reads it inside C++), `aten.equal`, `aten.is_nonzero`;
- ops whose output size depends on the data: `aten.nonzero`, `aten.masked_select`, `aten.unique*`,
  `aten.repeat_interleave` without its output size, boolean-mask indexing (`aten.index` /
  `aten.index_put` with a bool index);
- whole copies to the host: `Tensor.tolist()`, `.cpu()`, `.numpy()` (no aten op on a CPU tensor,
  so the Tensor methods are wrapped while counting).

    with HostSyncs() as syncs:
        decode(...)
    assert syncs.count <= steps + 2, syncs.where
"""
from __future__ import annotations

import traceback
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_READS = {"_local_scalar_dense", "equal", "is_nonzero", "nonzero", "masked_select", "_unique", "_unique2",
          "unique_dim", "unique_consecutive"}
_METHODS = ("tolist", "cpu", "numpy")


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class HostSyncs(TorchDispatchMode):
    """Counts host reads of tensor data inside the `with` block; `where` names the caller of each
    (the first frame outside torch and this file), `kinds` counts them by op."""

    def __init__(self, *, within: str = "asr/") -> None:
        super().__init__()
        self.within = within
        self.where: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self._saved: dict[str, Any] = {}

    @property
    def count(self) -> int:
        return sum(self.kinds.values())

    def _record(self, kind: str) -> None:
        frames = [f for f in traceback.extract_stack()[:-2] if self.within in f.filename.replace("\\", "/")]
        site = f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"
        self.kinds[kind] += 1
        self.where[site] += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        if name in _READS or (name in ("index", "index_put", "index_put_") and _bool_index(args)) or (
                name == "repeat_interleave" and (kwargs or {}).get("output_size") is None and len(args) == 1):
            self._record(name)
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> HostSyncs:
        for method in _METHODS:
            original = getattr(torch.Tensor, method)
            self._saved[method] = original

            def counted(tensor: torch.Tensor, *a: Any, _original: Any = original, _method: str = method,
                        **k: Any) -> Any:
                self._record(_method)
                return _original(tensor, *a, **k)

            setattr(torch.Tensor, method, counted)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for method, original in self._saved.items():
            setattr(torch.Tensor, method, original)
        self._saved.clear()
        return super().__exit__(*exc)
