"""Shareable KV memory for tensor-parallel ranks, whose parts live in the submodules below.

- :mod:`kvxfer.buffers.kvbuffer`: ``KVBuffer`` (allocate, export, import, views).
- :mod:`kvxfer.buffers.host` / :mod:`kvxfer.buffers.cuda`: each kind's allocation and import.
- :mod:`kvxfer.buffers.handles`: ``SharedHandle``, what crosses a process boundary.
- :mod:`kvxfer.buffers.mappings`: the objects that own a mapping until its last view is gone.
- :mod:`kvxfer.share`: sending handles between processes.
"""

from __future__ import annotations

from kvxfer.buffers.handles import SharedHandle
from kvxfer.buffers.kvbuffer import KVBuffer, cuda_available

__all__ = ["KVBuffer", "SharedHandle", "cuda_available"]
