"""Counter semantics of streaming passes (kvxfer/messenger/stream.py), without libfabric:
thousands of passes keep exact, monotonic bases; a pass scheduled while the previous runs
starts at its end; a counter that ran ahead moves the base up; bump refuses bad input."""

from __future__ import annotations

import pytest

from kvxfer.errors import InvalidArgumentError
from kvxfer.messenger.stream import LayerCounter


class FakeWatcher:
    """The native watcher's counter word, as a Python int."""

    def __init__(self, start: int = 0) -> None:
        self.value = start
        self.ptr = 0x1000

    def bump(self, n: int) -> int:
        self.value += n
        return self.value

    def advance(self, to: int) -> int:
        self.value = max(self.value, to)
        return self.value


def test_thousands_of_passes():
    w = FakeWatcher()
    lc = LayerCounter(w, 61)
    ends = []
    for i in range(5000):
        base, end = lc._take_pass()
        assert end - base == 61 and (not ends or base == ends[-1])
        if i % 7 == 3:                          # scheduled ahead: the next one is taken before bumping
            b2, e2 = lc._take_pass()
            assert b2 == end
            for _ in range(122):
                lc.bump()
            ends.append(e2)
            continue
        for _ in range(61):
            lc.bump()
        ends.append(end)
    assert lc.value == ends[-1]


def test_counter_ahead_moves_the_base_and_64_bits_do_not_wrap():
    w = FakeWatcher(2**63 - 1000)
    lc = LayerCounter(w, 80)
    base, end = lc._take_pass()
    assert base == 2**63 - 1000 and end == base + 80
    w.advance(end + 500)                        # the model bumped unscheduled layers
    b2, _ = lc._take_pass()
    assert b2 == end + 500
    assert lc.next_base == b2 + 80


def test_bump_refuses_bad_input():
    lc = LayerCounter(FakeWatcher(), 4)
    for bad in (0, -1, True, 1.5, "1"):
        with pytest.raises(InvalidArgumentError):
            lc.bump(bad)
    assert lc.value == 0 and lc.ptr == 0x1000
