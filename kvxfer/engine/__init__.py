"""The engine package: kvxfer's validating face over the native ``kvxfer._fabric``.

Everything a caller can get wrong is checked here, before anything is posted; the native
layer then posts whole batches with the GIL released. Its rooms, each one idea:

- ``engine``: ``Engine`` (life cycle, peers, register/remote, control messages);
- ``writes``: its write calls (a base class of ``Engine``);
- ``reads``: its read calls, the mirrors of the writes (a base class; ``ReadTransfer``);
- ``counters``: ``expect``, ``banked``, ``discard`` (a base class);
- ``regions``: ``MemoryRegion``, ``RemoteRegion``, ``RegionPairs``, the buffer door
  (``_resolve_buffer``) and the direct-copy permit slots (``_PermitSlot``);
- ``transfer``: ``Transfer``, ``Counter`` and the callback dispatcher;
- ``watcher``: ``Watcher``, ``WatchEntry`` and ``WatchBatch``;
- ``rails``: opening rails (provider preference, the native module) and ``Peer``;
  ``_args``: the engine's argument checks.

Every name importable from the one-module ``kvxfer.engine`` of before stays importable here.
"""

from kvxfer.engine._args import (
    _U32,
    _MAX_TIMEOUT,
    _as_index,
    _as_offsets,
    _check_cpus,
    _check_imm,
    _check_nics,
    _check_options,
    _check_rail,
    _check_timeout,
    _concat_index,
    _nonneg,
    _timeout,
    _u64,
)
from kvxfer.engine.engine import Engine
from kvxfer.engine.reads import ReadTransfer
from kvxfer.engine.rails import PREFERENCE, Peer, _fabric, _message_limits, _need_native, _open_rails, providers
from kvxfer.engine.regions import (
    PERMIT_SLOTS,
    PERMIT_WAIT,
    MemoryRegion,
    RegionPairs,
    RemoteRegion,
    _PermitSlot,
    _resolve_buffer,
)
from kvxfer.engine.transfer import Counter, Transfer
from kvxfer.engine.watcher import MAX_POLL_US, Watcher, WatchBatch, WatchEntry, _check_watch, _check_word, check_watch

__all__ = ["Engine", "Peer", "MemoryRegion", "RemoteRegion", "RegionPairs", "Transfer", "ReadTransfer", "Counter",
           "Watcher", "WatchBatch", "WatchEntry", "providers"]


# >>> issue 22: deprecated names: FENCE_SLOTS -> PERMIT_SLOTS, FENCE_WAIT -> PERMIT_WAIT.
def __getattr__(name: str) -> object:
    new = {"FENCE_SLOTS": "PERMIT_SLOTS", "FENCE_WAIT": "PERMIT_WAIT"}.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import warnings
    warnings.warn(f"kvxfer.engine.{name} is deprecated, use {new}", DeprecationWarning, stacklevel=2)
    return globals()[new]
# <<< issue 22
