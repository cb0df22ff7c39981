"""``Engine(progress_rt_priority=)``: progress threads that put themselves at SCHED_FIFO.

Validated before anything is opened, refused with ``progress="spin"``, reported by ``stats()``
(and by the kernel: each progress thread's own policy), a transfer lands with both sides at
FIFO, and a process without CAP_SYS_NICE gets an engine at normal scheduling with a
``SchedulingWarning`` and ``progress_rt_errno == EPERM``.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
from _data import pattern_array
from _target import Target

import kvxfer
from kvxfer.errors import ArgumentTypeError, InvalidArgumentError, SchedulingWarning

LO, HI = os.sched_get_priority_min(os.SCHED_FIFO), os.sched_get_priority_max(os.SCHED_FIFO)


def _fifo_allowed() -> bool:
    """Whether this process may make a thread SCHED_FIFO (root with CAP_SYS_NICE here)."""
    code = "import os; os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, check=False).returncode == 0


needs_fifo = pytest.mark.skipif(not _fifo_allowed(), reason="SCHED_FIFO is not permitted to this process")


def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


@pytest.mark.parametrize("bad,exc", [(-1, InvalidArgumentError), (HI + 1, InvalidArgumentError),
                                     (1000, InvalidArgumentError), (1.5, ArgumentTypeError), (True, ArgumentTypeError),
                                     ("5", ArgumentTypeError), (None, ArgumentTypeError)])
def test_priority_is_checked_before_anything_opens(provider, bad, exc):
    before = _threads()
    with pytest.raises(exc, match="progress_rt_priority"):
        kvxfer.Engine(provider, "127.0.0.1", progress_rt_priority=bad)
    # checked before the provider: a name that would not open still gets the priority's error
    with pytest.raises(exc, match="progress_rt_priority"):
        kvxfer.Engine("no-such-provider", "127.0.0.1", progress_rt_priority=bad)
    assert _threads() <= before, "a progress thread was started for a refused option"


def test_spin_is_refused(provider):
    before = _threads()
    with pytest.raises(InvalidArgumentError, match="progress='block'"):
        kvxfer.Engine(provider, "127.0.0.1", progress="spin", progress_rt_priority=LO)
    assert _threads() <= before
    with kvxfer.Engine(provider, "127.0.0.1", progress="spin", progress_rt_priority=0) as e:   # 0 is off
        assert e.stats()["progress_rt"] == 0


def test_default_is_normal_scheduling(engine):
    s = engine.stats()
    assert (s["progress_rt"], s["progress_rt_errno"]) == (0, 0)
    assert engine.progress_rt_priority == 0
    for tid in engine.progress_threads():
        assert os.sched_getscheduler(tid) == os.SCHED_OTHER


@needs_fifo
@pytest.mark.parametrize("prio", [LO, 5, HI])
def test_stats_report_the_granted_priority(provider, prio):
    with warnings.catch_warnings():
        warnings.simplefilter("error", SchedulingWarning)
        with kvxfer.Engine(provider, "127.0.0.1", progress_rt_priority=prio, rails=2) as e:
            s = e.stats()
            assert (s["progress_rt"], s["progress_rt_errno"]) == (prio, 0)
            assert e.progress_rt_priority == prio
            tids = e.progress_threads()
            assert len(tids) == 2 and all(tids)
            for tid in tids:        # the kernel agrees, for every rail's thread
                assert os.sched_getscheduler(tid) == os.SCHED_FIFO
                assert os.sched_getparam(tid).sched_priority == prio
            # only the progress threads: this (calling) thread stays at normal scheduling
            assert os.sched_getscheduler(0) == os.SCHED_OTHER


@needs_fifo
def test_a_transfer_lands_with_both_sides_at_fifo(provider):
    n = 6 << 20
    src = pattern_array(n, 7)
    with kvxfer.Engine(provider, "127.0.0.1", progress_rt_priority=5, max_write=1 << 20) as eng, \
            Target(provider, n, options={"progress_rt_priority": 5}) as tgt:
        assert eng.stats()["progress_rt"] == 5
        assert tgt.call("stats")["progress_rt"] == 5
        mr = eng.register(src)
        peer, dst = eng.connect(tgt.address), eng.remote(tgt.descriptor)
        for imm in (21, 22, 23):       # several transfers, so the threads sleep and wake at FIFO
            t = eng.write(mr, 0, peer, dst, 0, n, imm=imm)
            tgt.expect(imm, t.num_writes)
            t.wait(30)
            assert tgt.wait(imm)[0] == "ok"
        assert np.array_equal(tgt.memory(), src)
        small = eng.write(mr, 0, peer, dst, 0, 4096, imm=24)       # and a small one after idling
        tgt.expect(24, small.num_writes)
        small.wait(30)
        assert tgt.wait(24)[0] == "ok"


_NO_NICE_CHILD = r"""
import errno, json, resource, sys, warnings
resource.setrlimit(resource.RLIMIT_RTPRIO, (0, 0))      # no unprivileged FIFO allowance either
import kvxfer
from kvxfer.errors import SchedulingWarning
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    e = kvxfer.Engine(sys.argv[1], "127.0.0.1", progress_rt_priority=5)
s = e.stats()
out = {"rt": s["progress_rt"], "errno": s["progress_rt_errno"], "asked": e.progress_rt_priority,
       "warnings": [(c.category.__name__, str(c.message)) for c in w if issubclass(c.category, SchedulingWarning)]}
e.close()
with warnings.catch_warnings():
    warnings.simplefilter("error", SchedulingWarning)     # the strict form: an error at construction
    try:
        kvxfer.Engine(sys.argv[1], "127.0.0.1", progress_rt_priority=5).close()
        out["strict"] = None
    except SchedulingWarning as exc:
        out["strict"] = type(exc).__name__
print(json.dumps(out))
"""


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is not installed")
def test_without_cap_sys_nice_the_engine_opens_at_normal_scheduling(provider):
    """A child process without CAP_SYS_NICE (dropped from its bounding set, so root's exec gets
    no such capability) and with RLIMIT_RTPRIO 0: EPERM, reported, warned, not raised."""
    cmd = ["setpriv", "--inh-caps=-sys_nice", "--bounding-set=-sys_nice", sys.executable, "-c", _NO_NICE_CHILD,
           provider]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120, env=env)
    if p.returncode != 0 and "setpriv" in p.stderr and "kvxfer" not in p.stderr:
        pytest.skip(f"setpriv cannot drop CAP_SYS_NICE here: {p.stderr.strip()}")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert (out["rt"], out["errno"], out["asked"]) == (0, errno.EPERM, 5)
    assert len(out["warnings"]) == 1
    cat, msg = out["warnings"][0]
    assert cat == "SchedulingWarning" and "EPERM" in msg and "CAP_SYS_NICE" in msg
    assert out["strict"] == "SchedulingWarning"


@needs_fifo
def test_kv_bench_opens_both_nodes_at_fifo(provider, tmp_path, capsys):
    """``kvxfer-bench kv --progress-rt 5``: both nodes' engines opened with the option, and the
    row says what each side was granted."""
    from kvxfer.cli import bench

    out = tmp_path / "kv.json"
    rc = bench.main(["kv", "--preset", "stream-tp2-tp1", "--tokens", "64", "--layer-ms", "2", "--repeat", "1",
                     "--provider", provider, "--progress-rt", "5", "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    (row,) = json.loads(out.read_text())["results"]
    assert (row["progress_rt"], row["prefill_progress_rt"]) == (5, 5)
    assert row["stream_tail_ms"] >= 0
