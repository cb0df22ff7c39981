"""The connector's scheduler side: which requests load their prompt's KV from a prefiller
(decoder), which finished requests hold their blocks for a decoder (prefiller), and the
``kv_transfer_params`` that carry the prefiller's handshake to the decoder through the client."""

from __future__ import annotations

import logging
from typing import Any, Optional

from kvxfer.errors import InvalidArgumentError
from kvxfer.integrations.vllm.params import Load, StepMeta, Stream, parse_consumer_params, producer_params

log = logging.getLogger("kvxfer.integrations.vllm")


class ConnectorScheduler:
    """Scheduler-side state (see the module docstring). Holds no network resources."""

    def __init__(self, vllm_config: Any, producer: bool) -> None:
        self.vllm_config = vllm_config
        self.producer = producer
        self.block_size = int(vllm_config.cache_config.block_size)
        self.handshakes: list[bytes] = []           # this instance's worker ranks, by TP rank
        self._loads: dict[str, Load] = {}          # decoder: loads to start next step
        self._loading: set[str] = set()            # decoder: loads started, not finished
        self._aborts: set[str] = set()
        self._sends: dict[str, tuple[str, list[int]]] = {}   # prefiller: (key, held blocks) to tell the worker
        self._held: set[str] = set()               # prefiller: held until finished_sending
        self.external: dict[str, int] = {}         # decoder: tokens loaded per request (tests)
        self._local: dict[str, int] = {}           # decoder: the local prefix hit it was offered
        self._may_stream: dict[str, tuple[str, int]] = {}   # prefiller: id -> (key, prompt length)
        self._streaming: dict[str, Stream] = {}     # prefiller: chunked prompts past their first chunk
        self._stream_ends: dict[str, bool] = {}     # prefiller: streams stopped before their last chunk
        self._given_up: set[str] = set()            # prefiller: preempted mid-stream, not sent again

    def set_handshakes(self, metadata: dict) -> None:
        self.handshakes = [metadata[k].blob for k in sorted(metadata)]

    # -- decoder -----------------------------------------------------------------------
    @staticmethod
    def _remote(request: Any) -> Optional[dict]:
        p = request.kv_transfer_params
        if not p or not p.get("do_remote_prefill") or p.get("kvxfer") is None:
            return None
        return p

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """A decoder loads every prompt token the prefiller computed beyond its own prefix
        hit (block-aligned); vLLM recomputes the last one to sample from it."""
        p = self._remote(request)
        if p is None or self.producer:
            return 0, False
        try:
            _, _, n = parse_consumer_params(p)
        except InvalidArgumentError as exc:
            log.warning("kvxfer: request %s: %s; computing it locally", request.request_id, exc)
            return 0, False
        n = min(n, len(request.prompt_token_ids or ()))
        if num_computed_tokens % self.block_size:     # only whole blocks move (K is transposed)
            log.warning("kvxfer: request %s: a prefix hit of %d tokens is not whole blocks of %d; computing it "
                        "locally", request.request_id, num_computed_tokens, self.block_size)
            return 0, False
        count = n - num_computed_tokens
        # update_state_after_alloc comes before vLLM sets num_computed_tokens: keep the hit
        self._local[request.request_id] = num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self.producer:
            p = request.kv_transfer_params
            if p and p.get("do_remote_decode") and p.get("kvxfer_request_key"):
                # D first: the decoder may have asked already, so this prefill may stream
                self._may_stream[request.request_id] = (str(p["kvxfer_request_key"]),
                                                        len(request.prompt_token_ids or ()))
            return
        p = self._remote(request)
        if p is None or self.producer or num_external_tokens <= 0:
            return
        rid, hs, _ = parse_consumer_params(p)
        (ids,) = blocks.get_block_ids()
        # blocks: every block of the request, the local prefix hit's first; the load covers
        # tokens [computed, computed + external) into the blocks from computed's on (computed is
        # block-aligned: vLLM offers whole blocks), the prefiller writes only those
        computed = self._local.pop(request.request_id, 0)
        end = computed + num_external_tokens
        dst = list(ids[computed // self.block_size:-(-end // self.block_size)])
        self._loads[request.request_id] = Load(hs, rid, dst, end, computed)
        self.external[request.request_id] = num_external_tokens
        p["do_remote_prefill"] = False              # once: a preempted request recomputes

    # -- prefiller ---------------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        p = request.kv_transfer_params
        self._may_stream.pop(rid, None)
        if self._streaming.pop(rid, None) is not None:
            # its prompt stopped before the last chunk (aborted): the worker gives the stream
            # up, and the blocks stay held until its writes are final (finished_sending)
            self._stream_ends[rid] = True
            self._held.add(rid)
            return True, None
        if rid in self._given_up:                   # its decoder's load failed at the preemption
            self._given_up.discard(rid)
            return False, None
        if not self.producer:
            self._local.pop(rid, None)
            if rid in self._loads or rid in self._loading:   # aborted while loading: fence, then free
                self._aborts.add(rid)
            return False, None
        if not p or not p.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED) \
                or not block_ids or not self.handshakes:
            return False, None
        # the REQUEST names it by the proxy's key when it gave one (D first), else by P's id
        key = str(p.get("kvxfer_request_key") or rid)
        self._sends[rid] = (key, list(block_ids))
        self._held.add(rid)
        return True, producer_params(key, self.handshakes, request.num_computed_tokens)

    # -- every step ----------------------------------------------------------------------
    def _streams(self, out: Any) -> dict[str, Stream]:
        """Prefiller: the D-first prompts this step computes, whole or a chunk of (chunked
        prefill), by id: the worker streams each pass's pages layer by layer if the decoder's
        REQUEST is there (a chunk moves the whole blocks it completes; a block a chunk boundary
        splits goes with the next chunk: the CPU cache's K is transposed per block). A prompt
        resumed after a preemption (its blocks replaced) stops streaming (``stream_ends``)."""
        found: dict[str, Stream] = {}
        if out is None or not (self._may_stream or self._streaming):
            return found
        counts = getattr(out, "num_scheduled_tokens", None) or {}
        for nr in getattr(out, "scheduled_new_reqs", None) or ():
            cand = self._may_stream.pop(nr.req_id, None)
            if cand is None:
                continue
            key, n = cand
            st = Stream(key, list(nr.block_ids[0]), n, nr.num_computed_tokens + counts.get(nr.req_id, 0))
            if n > 0 and st.end > 0:
                found[nr.req_id] = st
                if st.end < n:
                    self._streaming[nr.req_id] = st
        cached = getattr(out, "scheduled_cached_reqs", None)
        if cached is not None and self._streaming:
            resumed = getattr(cached, "resumed_req_ids", None) or set()
            for i, rid in enumerate(cached.req_ids):
                st = self._streaming.get(rid)
                if st is None:
                    continue
                if rid in resumed:                       # preempted: its blocks were freed
                    del self._streaming[rid]
                    self._stream_ends[rid] = False
                    self._given_up.add(rid)
                    continue
                new_ids = cached.new_block_ids[i]
                blocks = st.blocks + list(new_ids[0]) if new_ids else list(st.blocks)
                st = Stream(st.key, blocks, st.num_tokens, cached.num_computed_tokens[i] + counts.get(rid, 0))
                found[rid] = st
                if st.end >= st.num_tokens:
                    del self._streaming[rid]
                else:
                    self._streaming[rid] = st
        return found

    def build_meta(self, scheduler_output: Any = None) -> StepMeta:
        streams = self._streams(scheduler_output)
        meta = StepMeta(loads=self._loads, aborts=self._aborts, sends=self._sends, streams=streams,
                        stream_ends=self._stream_ends,
                        idle=getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0)
        self._loading.update(self._loads)
        self._loads, self._aborts, self._sends, self._stream_ends = {}, set(), {}, {}
        return meta

    def update_connector_output(self, output: Any) -> None:
        for rid in output.finished_sending or ():
            self._held.discard(rid)
        for rid in output.finished_recving or ():
            self._loading.discard(rid)

    def has_pending_push_work(self) -> bool:
        return bool(self._held or self._sends)
