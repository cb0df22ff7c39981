"""The prefix rule: which pages each side names for a request whose first tokens the decoder
already holds (``Messenger.receive(..., first_token=a)``, a local prefix-cache hit), and how
the planner's token path moves exactly tokens ``[a, num_tokens)``.

The decoder's ``dst_pages`` cover tokens ``[a, num_tokens)`` in its own page size: page
``a // page_size`` (holding token ``a``, possibly part of the prefix too) first, so there are
exactly ``ceil(num_tokens / page_size) - a // page_size`` of them. The prefiller's
``src_pages`` cover the whole request ``[0, num_tokens)`` in its page size (it computed every
token): exactly ``ceil(num_tokens / page_size)``. Either list of another length is refused
before anything is sent or posted (num_tokens is checked both ways). Tokens before
``a`` are never written, also the prefix's part of the first destination page: an unaligned
start is exact.

The planner's page lists both start at token 0. Both lists are cut at the largest multiple
``shift`` of both page sizes not past ``a`` (the leading source pages go; the plan's tokens
count from ``shift``); the destination pages between ``shift`` and ``a``'s page, which the
decoder does not name, are stood in for by pages of its pool the request does not name: the
plan writes no byte of them (all their tokens lie before ``a``). With equal page sizes there
are none.
"""

from __future__ import annotations

import math

import numpy as np

from kvxfer.errors import PlanError

__all__ = ["dst_page_count", "src_page_count", "shift", "source_pages", "plan_lists", "request_plan"]


def dst_page_count(num_tokens: int, first_token: int, page_size: int) -> int:
    """The destination pages a request of tokens ``[first_token, num_tokens)`` names: exactly
    these, never more (both sides refuse another count)."""
    return -(-num_tokens // page_size) - first_token // page_size


def src_page_count(num_tokens: int, page_size: int) -> int:
    """The source pages a request of ``num_tokens`` names (it computed every token): exactly
    ``ceil(num_tokens / page_size)``."""
    return -(-num_tokens // page_size)


def shift(first_token: int, src_page_size: int, dst_page_size: int) -> int:
    """The token both page lists start at: the largest multiple of both page sizes <= ``first_token``."""
    step = math.lcm(src_page_size, dst_page_size)
    return first_token // step * step


def source_pages(num_tokens: int, first_token: int, src_page_size: int, dst_page_size: int) -> int:
    """The source pages the plan of the whole request gets (its writing ranks are drawn over them)."""
    return -(-num_tokens // src_page_size) - shift(first_token, src_page_size, dst_page_size) // src_page_size


def plan_lists(src_pages: np.ndarray, dst_pages: np.ndarray, first_token: int, start: int, end: int,
               src_page_size: int, dst_page_size: int, dst_num_pages: int) -> tuple:
    """``(sp, dp, num_tokens, first_token)`` for ``plan``: tokens ``[max(start, first_token),
    end)`` of a request whose destination pages begin at ``first_token``'s page."""
    s = shift(first_token, src_page_size, dst_page_size)
    first = max(start, first_token)
    sp = np.asarray(src_pages)[s // src_page_size:-(-end // src_page_size)]
    stand_in = first_token // dst_page_size - s // dst_page_size
    dp = np.asarray(dst_pages, np.int64)
    if stand_in:
        free = np.setdiff1d(np.arange(dst_num_pages, dtype=np.int64), dp)[:stand_in]
        if len(free) < stand_in:
            raise PlanError(f"first_token {first_token} needs {stand_in} page(s) of the decoder's pool outside the "
                            "request to stand in for its prefix")
        dp = np.concatenate([free, dp])
    dp = dp[:-(-(end - s) // dst_page_size)]
    return sp, dp, end - s, first - s


def request_plan(src_layout, src_sharding, dst_layout, dst_sharding, src_pages: np.ndarray, dst_pages: np.ndarray,
                 first_token: int, num_tokens: int, seed: int, start: int = 0, end: int = -1):
    """The planner's plan of a request (both roads: the prefiller's writes, the decoder's
    reads): tokens ``[start, end)`` (``end`` -1: ``num_tokens``) where the page sizes differ
    or the decoder holds a prefix, each side's pages in its own size; the pages whole
    otherwise; the replica owners drawn with ``seed`` over the whole request's source pages."""
    from kvxfer.planner import plan

    end = num_tokens if end < 0 else end
    sps, dps = src_layout.page_size, dst_layout.page_size
    if sps == dps and not first_token:
        return plan(src_layout, src_sharding, dst_layout, dst_sharding, src_pages, dst_pages, seed=seed)
    sp, dp, n, a = plan_lists(src_pages, dst_pages, first_token, start, end, sps, dps, dst_layout.num_pages)
    s = shift(first_token, sps, dps)
    hi = source_pages(num_tokens, first_token, sps, dps)
    lo = (first_token - s) // sps if first_token < num_tokens else hi
    return plan(src_layout, src_sharding, dst_layout, dst_sharding, sp, dp, seed=seed, num_tokens=n, first_token=a,
                replica_span=(lo, hi))
