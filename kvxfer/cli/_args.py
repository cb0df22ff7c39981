"""Command-line values every kvxfer-bench subcommand shares: refused by the parser (exit
status 2, one line) rather than mid-run, and the JSON results written whole."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

__all__ = ["positive_int", "nonnegative_int", "positive_float", "nonnegative_float", "writable_file", "write_json"]


def _number(kind: type, text: str, ok, what: str):
    try:
        v = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} expected, got {text!r}") from None
    if not ok(v) or v != v:  # v != v: nan
        raise argparse.ArgumentTypeError(f"{what} expected, got {text!r}")
    return v


def positive_int(text: str) -> int:
    return _number(int, text, lambda v: v >= 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    return _number(int, text, lambda v: v >= 0, "a non-negative integer")


def positive_float(text: str) -> float:
    return _number(float, text, lambda v: 0 < v < float("inf"), "a positive number")


def nonnegative_float(text: str) -> float:
    return _number(float, text, lambda v: 0 <= v < float("inf"), "a non-negative number")


def writable_file(path: str) -> str:
    """``--json FILE``: found unwritable now, not after the whole run."""
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path!r} is a directory")
    d = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(d, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".kvxfer-bench-"):
            pass
        if os.path.exists(path) and not os.access(path, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write {path!r} ({exc.strerror or exc})") from None
    return path


def write_json(path: str, doc: dict, prog: str) -> bool:
    """Write the results whole (a temporary file renamed over ``path``, so a reader never
    sees half of it); a failure (disk full, the path gone meanwhile) is one line on stderr."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, default=str)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as exc:
        print(f"{prog}: cannot write {path!r}: {exc.strerror or exc}", file=sys.stderr)
        return False
    return True
