"""Hosts for the cluster test: one network namespace per node and one hub namespace (the
store server's), each node joined to the hub's bridge by a veth pair.

Names are ``kvx-rh-<pid>`` (the hub) and ``kvx-r<i>-<pid>``; addresses 10.215.<x>.<i+1> and
.254 (the hub), a private range that exists only inside them. ``destroy`` kills what runs
inside and deletes every namespace (a pytest finalizer, an atexit and SIGTERM guard behind
it); ``sweep_stale`` deletes those of a run that was itself killed. Helpers come from
tests/fabric/_netns.py (the link-down tests' namespaces).
"""

from __future__ import annotations

import atexit
import os
import re
import sys

from kvxfer.cli.cluster import Placement

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fabric"))
import _netns as N  # noqa: E402

_NAME = re.compile(r"^kvx-r(?:h|\d+)-(\d+)$")
unavailable = N.unavailable
NetnsDenied = N.NetnsDenied


def sweep_stale() -> list[str]:
    gone = []
    for name in N.list_netns():
        m = _NAME.match(name)
        if m and not N._pid_alive(int(m.group(1))):
            N._kill_inside(name)
            N._ip("netns", "del", name, check=False)
            gone.append(name)
    return gone


class Star(Placement):
    """``names`` nodes around a hub; ``node(name)`` and ``store()`` say where to run (the
    ``Placement`` of kvxfer.cli.cluster)."""

    def __init__(self, names: list[str], tag: int | None = None) -> None:
        tag = os.getpid() if tag is None else tag
        x = tag % 250 + 1
        self.hub = f"kvx-rh-{tag}"
        self.ns = {n: f"kvx-r{i}-{tag}" for i, n in enumerate(names)}
        self.addr = {n: f"10.215.{x}.{i + 1}" for i, n in enumerate(names)}
        self.hub_addr = f"10.215.{x}.254"
        self._made: list[str] = []

    def create(self) -> "Star":
        atexit.register(self.destroy)
        N.guard_sigterm(self.destroy)
        try:
            for ns in (self.hub, *self.ns.values()):
                N._ip("netns", "add", ns)
                self._made.append(ns)
            N._ip("netns", "exec", self.hub, sys.executable, "-c", "pass")   # may the container remount /sys?
            N._ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            N._ip("-n", self.hub, "addr", "add", f"{self.hub_addr}/24", "dev", "br0")
            N._ip("-n", self.hub, "link", "set", "lo", "up")
            N._ip("-n", self.hub, "link", "set", "br0", "up")
            for i, (name, ns) in enumerate(self.ns.items()):
                hub_end = f"vh{i}"
                N._ip("-n", self.hub, "link", "add", hub_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
                N._ip("-n", self.hub, "link", "set", hub_end, "master", "br0")
                N._ip("-n", self.hub, "link", "set", hub_end, "up")
                N._ip("-n", ns, "addr", "add", f"{self.addr[name]}/24", "dev", "eth0")
                N._ip("-n", ns, "link", "set", "lo", "up")
                N._ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.destroy()
            raise
        return self

    def node(self, name: str) -> tuple[list[str], str]:
        return ["ip", "netns", "exec", self.ns[name]], self.addr[name]

    def store(self) -> tuple[list[str], str]:
        return ["ip", "netns", "exec", self.hub], self.hub_addr

    def destroy(self) -> None:
        for ns in reversed(self._made):
            N._kill_inside(ns)
        for ns in reversed(self._made):
            N._ip("netns", "del", ns, check=False)
        self._made = [ns for ns in self._made if ns in N.list_netns()]

    def left(self) -> list[str]:
        mine = {self.hub, *self.ns.values()}
        return [ns for ns in N.list_netns() if ns in mine]
