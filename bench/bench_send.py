"""bench_send.py: Engine.send of one 80-byte control message, p50 per call, against the form it
had before (the bytes copied into a numpy array first), two shm engines in one process, a
0.2 ms gap between sends (each call runs cold, as the messenger's do), 6 alternating rounds of
400. docs/benchmarks.md, issue 28 item 2."""
import time, numpy as np, kvxfer, statistics as st
from kvxfer.engine.messages import _Messages
old_src = '''
def old_send(self, peer, data, timeout=30.0):
    self._check_open()
    timeout = _timeout(timeout)
    if not isinstance(peer, Peer) or peer.engine is not self:
        raise InvalidArgumentError("x")
    if peer.closed:
        raise PeerError(1, "x")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidArgumentError("x")
    buf = np.frombuffer(bytes(data), dtype=np.uint8)
    if len(buf) > _fabric.MSG_MAX:
        raise InvalidArgumentError("x")
    if not self._rails[0].send(peer.fi_addrs[0], peer.gens[0], buf, timeout):
        raise TimeoutError("x")
'''
import kvxfer.engine.messages as M
ns = dict(vars(M)); ns["np"] = np; exec(old_src, ns); old_send = ns["old_send"]
a = kvxfer.Engine("shm"); b = kvxfer.Engine("shm"); p = a.connect(b.address)
msg = b"K" * 80
res = {"old": [], "new": []}
for rnd in range(6):
    for name, fn in (("old", lambda: old_send(a, p, msg)), ("new", lambda: a.send(p, msg))):
        ts = []
        for i in range(400):
            t0 = time.perf_counter_ns(); fn(); ts.append(time.perf_counter_ns() - t0)
            b.recv(5)
            time.sleep(0.0002)      # cold-ish: a gap between sends
        res[name].append(st.median(ts) / 1e3)
print({k: [round(x, 2) for x in v] for k, v in res.items()})
a.close(); b.close()
