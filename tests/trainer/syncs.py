"""Counting the host synchronisations a piece of trainer code would make on a GPU, on the
CPU: every read of a tensor's value into Python (a ``scalar read``: ``item``, ``bool``/
``int``/``float`` of a tensor, seen as the op they all dispatch to, also inside an autograd
function's forward and backward, which torch-function modes do not see; ``tolist``,
``numpy``, ``cpu``) and every op whose output size depends on its input's values
(``nonzero``, ``unique``, ``masked_select``, ``repeat_interleave`` without
``output_size``, boolean-mask indexing), each recorded with the library function it came
from."""

from __future__ import annotations

import collections
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
_READS = {"tolist", "numpy", "cpu"}
_DATA_DEPENDENT = {"nonzero", "unique", "unique_consecutive", "masked_select", "_unique2", "unique_dim"}


def _site() -> str:
    """``path function`` of the innermost frame in the project's library code (not tests)."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(ROOT) and not any(path.is_relative_to(ROOT / d) for d in ("tests", ".venv")):
            return f"{path.relative_to(ROOT)} {frame.name}"
    return "<outside the project>"


class _Reads(TorchFunctionMode):
    def __init__(self, found: collections.Counter) -> None:
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _READS:
            self.found[(name, _site())] += 1
        return func(*args, **(kwargs or {}))


class _Ops(TorchDispatchMode):
    def __init__(self, found: collections.Counter) -> None:
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            self.found[("scalar read", _site())] += 1
        elif name in _DATA_DEPENDENT:
            self.found[(name, _site())] += 1
        elif name == "repeat_interleave" and kwargs.get("output_size") is None and \
                (len(args) < 3 or args[2] is None) and isinstance(args[0], torch.Tensor) and \
                func is not torch.ops.aten.repeat_interleave.self_int:
            self.found[(name, _site())] += 1
        elif name == "index" and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.found[("boolean index", _site())] += 1
        return func(*args, **kwargs)


class SyncCounter:
    """``with SyncCounter() as syncs: ...``; then ``syncs.found``: Counter of
    ``(what, site)`` on this thread, and :attr:`total`."""

    def __init__(self) -> None:
        self.found: collections.Counter = collections.Counter()
        self._modes = (_Reads(self.found), _Ops(self.found))

    def __enter__(self) -> "SyncCounter":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.found.values())
