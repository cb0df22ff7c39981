"""What crosses between the connector's pieces: the ``kv_transfer_params`` a prefiller returns
and a decoder is given (plain JSON), the scheduler-to-worker step metadata, and the options
read from ``kv_connector_extra_config``."""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from kvxfer.errors import InvalidArgumentError

#: the vLLM release this connector is written and tested against
VLLM_VERSION = "0.32.0"
#: the version of the ``kv_transfer_params`` this connector writes and reads
PARAMS_VERSION = 1


@dataclass
class Options:
    """``kv_connector_extra_config`` keys (all optional).

    ``provider`` (libfabric provider, default ``tcp;ofi_rxm``), ``node`` (the address to bind;
    default ``VLLM_HOST_IP``, else the provider's choice), ``peer_timeout`` (seconds of silence
    before a peer is declared dead, default 10), ``load_timeout`` (a decoder gives up on a
    load after this many seconds, fenced, default 60), ``unclaimed_timeout`` (a prefiller
    frees the blocks of a finished request no decoder asked for after this many seconds,
    default 60), ``secret`` (hex, >= 16 bytes: HMAC on every control message),
    ``metrics_port`` (serve each rank's messenger metrics for Prometheus on this port plus the
    TP rank, on ``metrics_addr``, default 127.0.0.1; needs ``prometheus_client``; vLLM's own
    ``/metrics`` gets the connector's counters without it), ``road`` (``"push"``, the default:
    the prefiller writes into the decoder's blocks; ``"pull"``: on a prefiller, its cache is
    registered readable too and it serves pull requests as well as push ones
    (``Messenger(offer_pull=True)``); on a decoder, every load reads the prefiller's blocks
    itself (``receive(..., pull=True)``), and a prefiller that offers no pull fails the load,
    which the ``kv_load_failure_policy`` then handles), ``progress_rt_priority`` (0, the
    default, or a SCHED_FIFO priority 1..99 for each rank's progress threads,
    ``Engine(progress_rt_priority=)``; refused by the kernel, the engine runs at normal
    scheduling with a ``kvxfer.errors.SchedulingWarning``), ``idle_wait`` (seconds, default
    0.005; 0 turns it off: an engine step that computes nothing while this rank has loads or
    writes in flight waits up to this long in ``get_finished`` for one to end, instead of
    spinning on the engine's loop; it returns the moment one ends, so no transfer is seen
    later, and only an idle engine waits).
    """

    provider: str = "tcp;ofi_rxm"
    node: Optional[str] = None
    peer_timeout: float = 10.0
    load_timeout: float = 60.0
    unclaimed_timeout: float = 60.0
    secret: Optional[bytes] = None
    metrics_port: Optional[int] = None
    metrics_addr: str = "127.0.0.1"
    road: str = "push"
    progress_rt_priority: int = 0
    idle_wait: float = 0.005

    @classmethod
    def from_config(cls, extra: Optional[dict]) -> "Options":
        extra = dict(extra or {})
        o = cls()
        o.provider = str(extra.pop("provider", o.provider))
        o.node = extra.pop("node", None) or os.environ.get("VLLM_HOST_IP") or None
        wait = extra.pop("idle_wait", o.idle_wait)
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 1:
            raise InvalidArgumentError(f"kv_connector_extra_config['idle_wait'] must be seconds in [0, 1], "
                                       f"got {wait!r}")
        o.idle_wait = float(wait)
        for name in ("peer_timeout", "load_timeout", "unclaimed_timeout"):
            v = extra.pop(name, getattr(o, name))
            try:
                v = float(v)
            except (TypeError, ValueError):
                raise InvalidArgumentError(f"kv_connector_extra_config[{name!r}] must be seconds, got {v!r}") from None
            if not 0 < v < 1e6:
                raise InvalidArgumentError(f"kv_connector_extra_config[{name!r}] must be in (0, 1e6), got {v!r}")
            setattr(o, name, v)
        port = extra.pop("metrics_port", None)
        if port is not None:
            if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                raise InvalidArgumentError(f"kv_connector_extra_config['metrics_port'] must be a port, got {port!r}")
            o.metrics_port = port
        o.metrics_addr = str(extra.pop("metrics_addr", o.metrics_addr))
        o.road = str(extra.pop("road", o.road))
        if o.road not in ("push", "pull"):
            raise InvalidArgumentError(f"kv_connector_extra_config['road'] must be 'push' or 'pull', got {o.road!r}")
        prio = extra.pop("progress_rt_priority", 0)
        if isinstance(prio, bool) or not isinstance(prio, int) or not 0 <= prio <= 99:
            raise InvalidArgumentError(f"kv_connector_extra_config['progress_rt_priority'] must be an int in "
                                       f"0..99, got {prio!r}")
        o.progress_rt_priority = prio
        secret = extra.pop("secret", None)
        if secret is not None:
            try:
                o.secret = bytes.fromhex(str(secret))
            except ValueError:
                raise InvalidArgumentError("kv_connector_extra_config['secret'] must be hex") from None
        return o


@dataclass
class KvxferHandshake(KVConnectorHandshakeMetadata):
    """One worker's messenger handshake, carried by vLLM from the worker to its scheduler."""

    blob: bytes


@dataclass
class Stream:
    """A D-first prompt a prefiller's step computes part or all of: under the transfer
    ``key``, its ``blocks`` so far, its ``num_tokens`` (the prompt's length) and ``end`` (the
    tokens computed once this step's pass is over: ``end >= num_tokens`` is its last chunk)."""

    key: str
    blocks: list[int]
    num_tokens: int
    end: int


@dataclass
class Load:
    """A decoder's load: ask the prefiller ranks for tokens ``[first_token, num_tokens)`` of
    ``remote_request_id`` into ``block_ids`` (from the block holding ``first_token``: the
    decoder's own prefix hit, block-aligned, is not written)."""

    handshakes: list[bytes]
    remote_request_id: str
    block_ids: list[int]
    num_tokens: int
    first_token: int = 0


@dataclass
class StepMeta(KVConnectorMetadata):
    """Scheduler -> worker, one engine step: loads to start and aborts (decoder), finished
    requests whose blocks are held for a decoder (prefiller)."""

    loads: dict[str, Load] = field(default_factory=dict)
    aborts: set[str] = field(default_factory=set)
    sends: dict[str, tuple[str, list[int]]] = field(default_factory=dict)   # id -> (key, blocks)
    #: prefiller, D first: the prompts (or chunks of prompts) this step computes, by id
    streams: dict[str, "Stream"] = field(default_factory=dict)
    #: prefiller, D first: ids whose prompt stopped before its last chunk, their streams given
    #: up: True where vLLM holds the blocks until finished_sending (aborted), False where the
    #: request goes on in other blocks (preempted and resumed) and is not sent again
    stream_ends: dict[str, bool] = field(default_factory=dict)
    #: the step computes no token (vLLM steps on while requests wait for their KV)
    idle: bool = False


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def producer_params(request_id: str, handshakes: list[bytes], num_tokens: int) -> dict[str, Any]:
    """What a prefiller's ``request_finished`` returns: the decoder's ``kv_transfer_params``
    (``request_id`` is the transfer key: the proxy's ``kvxfer_request_key`` or P's id)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "kvxfer": PARAMS_VERSION,
        "remote_request_id": request_id,
        "remote_handshakes": [_b64(h) for h in handshakes],
        "remote_num_tokens": int(num_tokens),
    }


def parse_consumer_params(params: dict[str, Any]) -> tuple[str, list[bytes], int]:
    """(remote request id, the prefiller ranks' handshakes, tokens it computed) from a
    decoder's ``kv_transfer_params``; ``InvalidArgumentError`` if they are not this
    connector's."""
    if params.get("kvxfer") != PARAMS_VERSION:
        raise InvalidArgumentError(f"kv_transfer_params are not kvxfer's version {PARAMS_VERSION}: "
                                   f"kvxfer={params.get('kvxfer')!r}")
    rid = params.get("remote_request_id")
    hs = params.get("remote_handshakes")
    n = params.get("remote_num_tokens")
    if not isinstance(rid, str) or not isinstance(hs, list) or not hs or not isinstance(n, int) or n < 0:
        raise InvalidArgumentError("kv_transfer_params need remote_request_id (str), remote_handshakes "
                                   "(non-empty list) and remote_num_tokens (int >= 0)")
    try:
        blobs = [base64.b64decode(h, validate=True) for h in hs]
    except (binascii.Error, TypeError, ValueError):
        raise InvalidArgumentError("kv_transfer_params['remote_handshakes'] must be base64 strings") from None
    return rid, blobs, n
