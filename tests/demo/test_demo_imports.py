"""The demo's modules import top-down: ``nodes`` (the messenger transport) never imports
``flow`` (the run) at import time; both build on ``config`` (issue 22: the cycle broken)."""

import subprocess
import sys


def test_nodes_imports_without_flow_and_flow_keeps_its_names():
    code = ("import sys, kvxfer.demo.nodes\n"
            "assert 'kvxfer.demo.flow' not in sys.modules, 'nodes imported flow'\n"
            "from kvxfer.demo.flow import DemoConfig, Handoff\n"
            "from kvxfer.demo.config import DemoConfig as C, Handoff as H\n"
            "assert DemoConfig is C and Handoff is H\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
