"""The demo's configuration and its transport contract, at the bottom of the demo: ``DemoConfig``
(one run: workload, deployment, transport) and ``Handoff`` (one request's hand-off as the
decoder sees it, what every transport's ``submit`` returns). ``flow`` (the run) and ``nodes``
(the messenger transport) both build on these; neither imports the other at import time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.demo.model import ModelConfig

__all__ = ["DemoConfig", "Handoff"]


@dataclass(frozen=True)
class DemoConfig:
    """One demo run: the workload, the deployment and the transport."""

    prompts: int = 50
    min_len: int = 1
    max_len: int = 400
    max_new: int = 32
    attention: str = "gqa"
    prefill_tp: int = 2
    decode_tp: int = 1
    chunk: int = 64  #: prefill chunk (tokens); smaller than most prompts
    max_batch: int = 8
    arrival_ms: float = 120.0  #: mean gap between arrivals (exponential), so prefills overlap decodes
    decode_pool_pages: int = 0  #: 0: enough for ``max_batch`` of the longest requests
    prefill_pool_pages: int = 0  #: 0: enough for the longest prompt
    transport: str = "shm"  #: shm or tcp;ofi_rxm (messengers), numpy (no fabric)
    prefill_nodes: int = 1  #: prefill nodes (messenger transports); requests go round-robin
    kill_prefiller_after: int = 0  #: >0: SIGKILL prefill node 0 once it has prefilled this many and has another
    peer_timeout: float = 3.0  #: the messenger's dead-peer timeout (s)
    stream: bool = True  #: messenger transports: move each layer as it is computed (False: after the last)
    seed: int = 0

    def model(self) -> ModelConfig:
        return ModelConfig(attention=self.attention)  # type: ignore[arg-type]


class Handoff:
    """One request's hand-off as the decoder sees it (what a transport's ``submit`` returns).

    ``done``: every page and the context landed, or it failed (``error``); ``fenced``: no
    write of it can land any more, so its pages may be reused; ``context()`` the context as
    float32; the prefill node's figures arrive in ``figures`` (``t_prefill_start``,
    ``t_prefill_end``, ``t_last_layer`` on the machine's monotonic clock, ``streamed``,
    ``schedule_s``, ``pages``, ``bytes``, ``writes``).
    """

    def __init__(self) -> None:
        self.figures: dict[str, Any] = {}
        self.error: BaseException | None = None
        self.t_done: float | None = None
        self.node = 0

    @property
    def done(self) -> bool:
        raise NotImplementedError

    @property
    def fenced(self) -> bool:
        return self.done

    def context(self) -> np.ndarray:
        raise NotImplementedError

    def release(self) -> None:
        """The context was read: its slot may be reused."""
