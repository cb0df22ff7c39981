"""The shared child-process helper (tests/_procs.py): results, forwarded tracebacks, crashes told apart."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from _procs import ChildFailed, ChildSkipped, crash_reason, run_in_child, spawn


def answer(x: int) -> int:
    return x * 2


def fail() -> None:
    raise ValueError("broken in the child")


def segfault() -> None:
    os.kill(os.getpid(), signal.SIGSEGV)


def psm2_style_crash() -> None:
    """What libfabric's psm2 handler does with a SIGSEGV: a line on stderr, then exit status 1."""
    sys.stderr.write("python.80s-1234,vm: terminated with signal 11 at PC=0x0\n")
    sys.stderr.flush()
    os._exit(1)


def notes(conn) -> str:
    conn.send(("progress", 1))
    assert conn.recv() == "go on"
    return "done"


class Unavailable(Exception):
    pass


def skips() -> None:
    raise Unavailable("no such device")


def test_value_comes_back():
    assert run_in_child(answer, 21) == 42


def test_traceback_comes_back():
    with pytest.raises(ChildFailed, match="(?s)ValueError: broken in the child"):
        run_in_child(fail)


@pytest.mark.parametrize("fn, why", [(segfault, "killed by SIGSEGV"), (psm2_style_crash, "crashed: terminated with signal 11 (SIGSEGV)")])
def test_crash_is_named_by_status_and_stderr(fn, why):
    with pytest.raises(ChildFailed, match=r"died without an answer \(exit status -?\d+, " + why.replace("(", r"\(").replace(")", r"\)")):
        run_in_child(fn)


def test_notes_and_messages_both_ways():
    child = spawn(notes, with_conn=True)
    try:
        assert child.result() == 1
        child.send("go on")
        assert child.result() == "done"
        assert child.join() == 0
    finally:
        child.close()


def test_skip_is_reported_as_a_skip():
    with pytest.raises(ChildSkipped, match="Unavailable: no such device"):
        run_in_child(skips, skip=(Unavailable,))


def test_crash_reason_reads_both_sources():
    assert crash_reason(0, "") is None
    assert crash_reason(1, "Traceback ... ConnectionAbortedError") is None
    assert crash_reason(-9, "") == "killed by SIGKILL"
    assert crash_reason(1, "x: terminated with signal 6 at PC") == "crashed: terminated with signal 6 (SIGABRT)"
