"""Review of the engine's Python layer and its Cython handles (kvxfer/engine.py,
kvxfer/_fabric.pyx; 2026-12-01): each test failed before its fix."""

import numpy as np
import pytest

from kvxfer.errors import InvalidArgumentError


@pytest.fixture
def pairs3(pair):
    """Three (src, dst) region pairs from engine a to engine b, and b's destination buffer."""
    a, b = pair
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, np.uint8)
    ms, md = a.register(src), b.register(dst)
    peer = a.connect(b.address)
    rd = a.remote(md.descriptor())
    return a, b, a.region_pairs(peer, [(ms, rd)] * 3), dst


@pytest.mark.parametrize("counts, n", [
    ([2**63 - 1, 2**63 - 1, 3], 1),      # int64 sum wraps to 1: group 0 walked 2**63 triples
    ([2**62, 2**62, 2**62 * 2 - 1], 0),  # wraps to -1 ... refused, but by the wrong check
    ([2**62] * 2 + [0], 0),              # sum 2**63 wraps to -2**63
    (np.array([2**64 - 1, 1, 0], np.uint64), 0),   # uint64 counts cast to int64: -1, 1
])
def test_write_pairs_counts_that_overflow_are_refused_before_reading(pairs3, counts, n):
    """write_pairs summed ``counts`` in int64: counts whose sum wrapped to the number of
    triples passed, and check_groups (no bounds checks) then read offsets far beyond the
    arrays (an OutOfBoundsError naming garbage bytes, or a crash)."""
    a, b, rp, dst = pairs3
    with pytest.raises(InvalidArgumentError, match="counts"):
        a.write_pairs(rp, [0] * n, [0] * n, [8] * n, counts, imm=7)
    assert not dst.any() and b.banked(7) == 0


def test_check_groups_checks_every_groups_bounds_before_reading():
    """check_groups (compiled without bounds checks) walked group 0's 2**63 - 1 triples
    before it looked at group 1's negative start."""
    from kvxfer import _fabric

    one = np.zeros(1, np.uint64)
    starts = np.array([0, 2**63 - 1, -2, 1], np.int64)
    sizes = np.full(1, 4096, np.uint64)
    with pytest.raises(InvalidArgumentError):
        _fabric.check_groups(one, one, one, starts, np.zeros(3, np.int64), sizes, sizes)


def test_a_callback_raising_system_exit_leaves_later_callbacks_running(pair):
    """The dispatcher caught Exception only: a callback calling sys.exit() ended the
    dispatcher thread, and every later counter's callback never ran."""
    import threading

    a, b = pair
    src = a.register(np.arange(64, dtype=np.uint8))
    md = b.register(np.zeros(64, np.uint8))
    peer, rd = a.connect(b.address), a.remote(md.descriptor())

    def leave(c):
        raise SystemExit(3)

    ran = threading.Event()
    c1 = b.expect(1, 1, leave)
    a.write(src, 0, peer, rd, 0, 8, imm=1).wait(5)
    c1.wait(5)
    c2 = b.expect(2, 1, lambda c: ran.set())
    a.write(src, 0, peer, rd, 0, 8, imm=2).wait(5)
    c2.wait(5)
    assert ran.wait(5)


def test_a_region_closed_by_another_thread_mid_write_raises_closed_error(pair, monkeypatch):
    """write()'s one-triple path read ``src._handles[0]`` after its checks: a region closed
    by another thread in between (here: at the imm check, which runs in between) raised
    IndexError instead of ClosedError."""
    from kvxfer.engine import writes as eng   # write() lives there
    from kvxfer.errors import ClosedError

    a, b = pair
    ms = a.register(np.arange(64, dtype=np.uint8))
    md = b.register(np.zeros(64, np.uint8))
    peer, rd = a.connect(b.address), a.remote(md.descriptor())
    check = eng._check_imm

    def closing(imm):
        ms.close()
        return check(imm)

    monkeypatch.setattr(eng, "_check_imm", closing)
    with pytest.raises(ClosedError):
        a.write(ms, 0, peer, rd, 0, 8, imm=3)
    assert b.banked(3) == 0


class _InterruptOnce:
    """A rail whose next ``drain`` is followed by Ctrl-C, as a signal arriving while
    ``close()`` drains would be (``_thread.interrupt_main``: raised at the next bytecode)."""

    def __init__(self, rail):
        self._rail, self._fired = rail, False

    def __getattr__(self, name):
        return getattr(self._rail, name)

    def drain(self, *args):
        import _thread

        if not self._fired:
            self._fired = True
            _thread.interrupt_main()
        return self._rail.drain(*args)


def test_ctrl_c_during_close_still_closes_everything(pair):
    """A KeyboardInterrupt inside Engine.close() left it half closed for good: ``closed``
    was already True, so a second close() returned at once, with the rails' endpoints,
    progress threads and registrations still alive until the process exited."""
    a, b = pair
    md = b.register(np.zeros(4096, np.uint8))
    rails = list(b._rails)
    b._rails = [_InterruptOnce(r) for r in rails]
    with pytest.raises(KeyboardInterrupt):
        b.close()
    b._rails = rails
    assert b.closed and all(r.closed and r.domain_closed for r in rails) and md.closed
