"""kvxfer._shm.reap_stale (issue 26.4): a later shm engine of the same user removes the
/dev/shm files of owners that are gone, and never a file whose owner may live. The owner is
the pid in the name; a pid that came round again is told apart by its process's start time
(later than the file's last change: not its maker). Run on a scratch directory."""

import os
import subprocess
import sys
import time

from kvxfer import _shm


def _touch(d, name, age_s=0.0):
    path = os.path.join(d, name)
    with open(path, "wb") as f:
        f.write(b"x" * 64)
    if age_s:
        t = time.time() - age_s
        os.utime(path, (t, t))
    return name


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_files_of_dead_and_reused_pids_go_and_live_owners_files_stay(tmp_path):
    d = str(tmp_path)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        dead = _dead_pid()
        gone = [_touch(d, f"{dead}:0:0"), _touch(d, f"{dead}:0:0.kxbell"),
                # the live process started an hour after this file last changed: a reused pid
                _touch(d, f"{live.pid}:3:1", age_s=3600)]
        kept = [_touch(d, f"{live.pid}:0:0"), _touch(d, f"{live.pid}:0:0.kxbell"),   # made since it started
                _touch(d, f"{os.getpid()}:0:0", age_s=3600),                       # ours: never reaped here
                _touch(d, f"{dead}:0"), _touch(d, "notashm"), _touch(d, f"{dead}:0:0.other")]
        reaped = _shm.reap_stale(d)
        assert sorted(reaped) == sorted(gone)
        assert sorted(os.listdir(d)) == sorted(kept)
        assert _shm.reap_stale(d) == []                  # nothing more to reap
    finally:
        live.kill()
        live.wait()


def test_another_users_files_and_non_files_are_left(tmp_path, monkeypatch):
    d = str(tmp_path)
    dead = _dead_pid()
    os.mkdir(os.path.join(d, f"{dead}:1:1"))                 # a directory of that name
    _touch(d, f"{dead}:0:0")
    monkeypatch.setattr(os, "getuid", lambda: os.stat(d).st_uid + 1)   # as another user sees them
    assert _shm.reap_stale(d) == []
    assert sorted(os.listdir(d)) == sorted([f"{dead}:1:1", f"{dead}:0:0"])


def test_process_start_is_none_for_a_dead_pid_and_before_now_for_ours():
    assert _shm.process_start(_dead_pid()) is None
    start = _shm.process_start(os.getpid())
    assert start is not None and start <= time.time() + 2
