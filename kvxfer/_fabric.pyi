"""Type stub of kvxfer._fabric: the native handles under kvxfer.engine (not public API)."""

from typing import Any, Iterable, Optional

from kvxfer.errors import KvxferError

import numpy as np
import numpy.typing as npt

HMEM_SYSTEM: int
HMEM_CUDA: int
MR_LOCAL: int
MR_VIRT_ADDR: int
MR_ALLOCATED: int
MR_PROV_KEY: int
MR_ENDPOINT: int
MR_RAW: int
CAP_RMA_EVENT: int
CAP_HMEM: int
MSG_MAX: int
MAX_IOV: int
HAVE_DMABUF: bool
RUNTIME_VERSION: tuple[int, int]
BUILD_VERSION: tuple[int, int]
PEER_ERRNOS: frozenset[int]

def error_from(call: str, err: int) -> KvxferError: ...

_U8 = npt.NDArray[np.uint8]
_U64 = npt.NDArray[np.uint64]

class Rail:
    closed: bool
    domain_closed: bool
    started: bool
    join: Optional[Rail]
    provider: str
    fabric_name: str
    domain_name: str
    mr_mode: int
    caps: int
    iov_limit: int
    max_msg_size: int
    inject_size: int
    cq_data_size: int
    has_wait: bool
    need_ctx: bool
    addr_is_str: bool
    thread_id: int
    def __init__(self, provider: Optional[str], node: Optional[str], hmem: bool = ..., spin: bool = ...,
                 domain: Optional[str] = ..., join: Optional[Rail] = ...) -> None: ...
    def start(self, cpus: Iterable[int] = ...) -> None: ...
    def drain(self, timeout: float = ...) -> None: ...
    def quiesce(self) -> None: ...
    def close_endpoint(self) -> None: ...
    def close(self) -> None: ...
    def stats(self) -> dict[str, int]: ...
    def getname(self) -> bytes: ...
    def av_insert(self, addr: _U8) -> int: ...
    def av_remove(self, addr: int) -> None: ...
    def cancel_peer(self, addr: int) -> int: ...
    def wait_peer_idle(self, addr: int, timeout: float) -> tuple[int, int]: ...
    def map_raw(self, base: int, raw: _U8) -> int: ...
    def unmap_key(self, key: int) -> None: ...
    def mr_reg(self, ptr: int, nbytes: int, iface: int = ..., device: int = ..., dmabuf_fd: int = ...,
               remote: bool = ...) -> RegionHandle: ...
    def write(self, peer: int, src_base: int, region: RegionHandle, dst_base: int, key: int, src_off: _U64, dst_off: _U64,
              length: _U64, imm: Optional[int], iov: int, max_write: int, pack_min: int) -> TransferHandle: ...
    def write_one(self, peer: int, src_base: int, region: RegionHandle, dst_base: int, key: int, src_off: int,
                  dst_off: int, length: int, imm: Optional[int], iov: int, max_write: int,
                  pack_min: int) -> TransferHandle: ...
    def prune(self) -> None: ...
    def close_if_idle(self, regions: list[RegionHandle]) -> bool: ...
    def busy_with(self, region: RegionHandle) -> bool: ...
    def expect(self, imm: int, count: int, callback: bool = ...) -> CounterHandle: ...
    def banked(self, imm: int) -> int: ...
    def discard(self, imm: int) -> tuple[int, int]: ...
    def next_done(self, timeout: float) -> Optional[int]: ...
    def dispatch_stop(self) -> None: ...
    def send(self, peer: int, data: _U8, timeout: Optional[float] = ...) -> bool: ...
    def recv(self, timeout: Optional[float]) -> Optional[bytes]: ...

class RegionHandle:
    rail: Rail
    key: int
    raw_key: bytes
    raw_base: int
    ptr: int
    nbytes: int
    busy: int
    keep: Any
    closed: bool
    def close(self) -> None: ...

class TransferHandle:
    rail: Rail
    region: RegionHandle
    planned: int
    posted: int
    completed: int
    posting_done: bool
    done: bool
    errno: int
    def cancel(self) -> None: ...
    def wait(self, timeout: Optional[float] = ...) -> bool: ...

class CounterHandle:
    rail: Rail
    address: int
    imm: int
    count: int
    arrived: int
    done: bool
    errno: int
    def wait(self, timeout: Optional[float] = ...) -> bool: ...

def count_messages(src_off: _U64, dst_off: _U64, length: _U64, iov: int, max_write: int, pack_min: int = ...) -> int: ...
