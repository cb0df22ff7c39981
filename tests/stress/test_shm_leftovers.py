"""shm files outliving their engines (issue 26.4), counted over many processes: a child that
exits with its engine open, raises with it open, or is SIGKILLed, while its peer (this process)
lives. Outcome per iteration: how many of the child's /dev/shm files are left once it is gone
(exit, raise) or once the next shm engine of this user opened (kill). Figures in
docs/reliability.md. Reduced counts under `make test`; KVXFER_STRESS=1: 50 each."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvxfer
from conftest import STRESS

N = 50 if STRESS else 5

_CHILD = textwrap.dedent("""
    import os, signal, sys, threading, time
    import numpy as np
    import kvxfer
    how, address, desc = sys.argv[1], bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3])
    e = kvxfer.Engine("shm")
    src = e.register(np.ones(4096, np.uint8))
    peer, dst = e.connect(address), e.remote(desc)
    e.write(src, 0, peer, dst, 0, 4096).wait(10)
    # a thread of the program still holds the engine at exit (a server loop, a messenger's
    # threads): no finalizer closes it then, only the interpreter-exit hook
    threading.Thread(target=lambda e=e: time.sleep(600), daemon=True).start()
    print(os.getpid(), flush=True)
    if how == "raise":
        raise RuntimeError("left open")
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
""")


def _left(pid):
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"{pid}:")]


@pytest.mark.timeout(60 + 10 * N)
@pytest.mark.parametrize("how", ["exit", "raise", "kill"])
def test_no_shm_files_outlive_their_processes(how):
    if "shm" not in kvxfer.providers():
        pytest.skip("no shm provider")
    left = 0
    with kvxfer.Engine("shm") as b:
        md = b.register(np.zeros(4096, np.uint8))
        for _ in range(N):
            r = subprocess.run([sys.executable, "-c", _CHILD, how, b.address.hex(), md.descriptor().hex()],
                               capture_output=True, text=True, timeout=60)
            pid = int(r.stdout.split()[0])
            if how == "kill":
                kvxfer.Engine("shm").close()          # the next engine of this user reaps
            left += len(_left(pid))
    print(f"\n{how}: {N} iterations, {left} files left")
    assert left == 0
