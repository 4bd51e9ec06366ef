"""Host syncs: the calls that make the host wait for the device, counted where they are made.

On a GPU the host queues kernels ahead of the device, and a call that needs a value back (``item``,
``int(t)``, ``tolist``, ``nonzero``, boolean indexing, ``bincount``, ``unique``...) stops it there until
the device has caught up: the queue drains, and every launch after it is paid in full. A blend should
make a few such calls per request, none per layer.

torch's profiler sees some of them on a CPU (``aten::_local_scalar_dense``, ``aten::nonzero``) but not
``tolist`` or ``bincount``, which a CPU tensor answers without an operation that would sync on a GPU. So
they are counted one level up, where Python calls torch (a :class:`~torch.overrides.TorchFunctionMode`),
which sees them on any device. Each is recorded with the first line of this package that made it.
"""

from __future__ import annotations

import collections
import os
import sys
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode

# Calls that read a device value back on the host, whatever their arguments.
SYNCING = frozenset({
    "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere", "bincount",
    "unique", "unique_consecutive", "masked_select", "cpu", "numpy", "equal", "allclose",
})
# Calls that sync only with a boolean index among their arguments (its count sizes the output).
INDEXING = frozenset({"__getitem__", "__setitem__", "index_put_", "index_put"})
PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _holds_bool_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.bool
    if isinstance(value, (tuple, list)):
        return any(_holds_bool_tensor(v) for v in value)
    return False


def _call_site() -> str:
    """``file:line`` of the innermost frame of this package below the counter (else the innermost caller)."""
    frame: Optional[FrameType] = sys._getframe(2)
    first = None
    while frame is not None:
        name = frame.f_code.co_filename
        if name != __file__ and "torch" not in name.split(os.sep)[-3:-1]:
            first = first or frame
            if name.startswith(PACKAGE):
                return f"{os.path.relpath(name, os.path.dirname(PACKAGE))}:{frame.f_lineno}"
        frame = frame.f_back
    return "?" if first is None else f"{first.f_code.co_filename}:{first.f_lineno}"


def is_sync(name: str, args: tuple, kwargs: dict) -> bool:
    if name in SYNCING:
        return True
    if name in INDEXING:
        return _holds_bool_tensor(args[1:]) or _holds_bool_tensor(list(kwargs.values()))
    if name == "repeat_interleave":  # tensor repeats size the output unless output_size says it
        return isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor) \
            and kwargs.get("output_size") is None
    return False


@dataclass
class HostSyncs(TorchFunctionMode):
    """Inside ``with HostSyncs() as syncs:``, every syncing call: ``syncs.sites`` (call, ``file:line``)."""

    sites: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if is_sync(name, args, kwargs):
            self.sites.append((name, _call_site()))
        return func(*args, **kwargs)

    @property
    def count(self) -> int:
        return len(self.sites)

    def by_site(self) -> dict[str, int]:
        """How many syncs each call site made, commonest first."""
        return dict(collections.Counter(f"{name} at {where}" for name, where in self.sites).most_common())


def count_host_syncs(run: Callable[[], Any]) -> HostSyncs:
    """The host syncs of one call of ``run``."""
    with HostSyncs() as syncs:
        run()
    return syncs
