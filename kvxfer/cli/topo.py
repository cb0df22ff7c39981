"""``kvxfer-bench topo [--xml FILE] [--json]``: which NICs and CPUs each GPU would use, and why.

Uses the public topology API only. ``add_parser`` registers the subcommand on kvxfer-bench's
argparse subparsers; ``main`` runs it standalone (``python -m kvxfer.cli.topo``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

from kvxfer.cli._args import positive_int
from kvxfer.errors import KvxferError
from kvxfer.topology import NIC_KINDS, Placement, Topology

__all__ = ["add_parser", "run", "main", "format_table", "cpu_ranges"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``topo`` on an ``argparse`` subparsers object; sets ``func=run``."""
    p = subparsers.add_parser(
        "topo",
        help="print the NIC/CPU placement table for this machine or an hwloc XML",
        description="Print which RDMA NICs and CPUs kvxfer would use for each GPU, and why.",
    )
    _add_arguments(p)
    p.set_defaults(func=run)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--xml", metavar="FILE", help="an hwloc XML export (lstopo --of xml) instead of this machine")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--nic-kind", choices=NIC_KINDS, default=None, help="NIC kind to use (default: the most numerous)")
    p.add_argument("--nics-per-gpu", type=positive_int, default=None, metavar="N", help="NICs per GPU (default: by the rules)")
    p.add_argument("--host", action="store_true", help="also print host-memory placements, one per NUMA node")


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the subcommand; returns the exit status (0, or 1 with a message on stderr)."""
    out = sys.stdout if out is None else out
    try:
        topo = Topology.from_xml(args.xml) if args.xml else Topology.discover()
        placements = topo.assign(nics_per_gpu=args.nics_per_gpu, nic_kind=args.nic_kind)
        host_all = getattr(args, "host", False) or not topo.gpus
        hosts = [topo.assign_host(n.os_index, nic_kind=args.nic_kind) for n in topo.numa_nodes] if host_all else []
    except KvxferError as e:
        print(f"kvxfer-bench topo: error: {e}", file=sys.stderr)
        return 1
    kind = args.nic_kind or topo.default_nic_kind()
    if args.json:
        json.dump(_as_json(topo, kind, placements, hosts), out, indent=2)
        out.write("\n")
    else:
        out.write(format_table(topo, kind, placements, hosts))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry: ``python -m kvxfer.cli.topo [--xml FILE] [--json]``."""
    p = argparse.ArgumentParser(prog="kvxfer-bench topo", description="Print kvxfer's NIC/CPU placement table.")
    _add_arguments(p)
    return run(p.parse_args(argv))


def cpu_ranges(cpus: Iterable[int]) -> str:
    """``(0, 1, 2, 5, 7, 8)`` -> ``"0-2,5,7-8"``; ``"-"`` when empty."""
    xs = sorted(set(cpus))
    if not xs:
        return "-"
    parts, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:  # type: ignore[list-item]
        if x is not None and x == prev + 1:
            prev = x
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(parts)


def _nics_cell(p: Placement) -> str:
    if not p.nics:
        return "-"
    return " ".join(p.nic_names)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]


def format_table(
    topo: Topology, kind: str | None, placements: dict[int, Placement], hosts: Sequence[Placement] = ()
) -> str:
    """The plain-text placement table: one row per GPU, then its reasons, then host rows."""
    lines = [topo.summary()]
    provider = "" if kind is None else f" (libfabric provider {'efa' if kind == 'efa' else 'verbs'})"
    lines.append(f"NIC kind: {kind or 'none'}{provider}")
    if placements:
        rows = []
        for idx, p in sorted(placements.items()):
            g = p.gpu
            assert g is not None
            hops = sorted({h for h in p.hops if h is not None})
            rows.append(
                [
                    str(idx),
                    g.busid,
                    g.model,
                    "-" if g.cuda_ordinal is None else str(g.cuda_ordinal),
                    "-" if p.numa is None else str(p.numa),
                    _nics_cell(p),
                    "-" if not hops else "/".join(map(str, hops)),
                    "yes" if p.cross_numa else "",
                    cpu_ranges(p.cpus),
                ]
            )
        lines.append("")
        lines += _table(["GPU", "bus id", "model", "cuda", "numa", "NICs", "hops", "x-numa", "CPUs"], rows)
        lines.append("")
        lines.append("why:")
        for idx, p in sorted(placements.items()):
            lines.append(f"  GPU {idx}: {p.nic_reason}")
            lines.append(f"  {' ' * len(f'GPU {idx}')}  {p.cpu_reason}")
    else:
        lines.append("")
        lines.append("no GPU: host-memory placements only")
    if hosts:
        lines.append("")
        rows = [
            [
                "-" if h.numa is None else str(h.numa),
                _nics_cell(h),
                "yes" if h.cross_numa else "",
                cpu_ranges(h.cpus),
                h.reason,
            ]
            for h in hosts
        ]
        lines += _table(["host numa", "NICs", "x-numa", "CPUs", "why"], rows)
    return "\n".join(lines) + "\n"


def _as_json(
    topo: Topology, kind: str | None, placements: dict[int, Placement], hosts: Sequence[Placement]
) -> dict[str, Any]:
    full = topo.to_dict()
    return {
        "source": topo.source,
        "nic_kind": kind,
        "gpus": full["gpus"],
        "nics": full["nics"],
        "numa_nodes": [
            {"os_index": n.os_index, "cores": len(n.cores), "cpus": cpu_ranges(n.cpus), "memory": n.memory}
            for n in topo.numa_nodes
        ],
        "placements": {str(i): p.to_dict() for i, p in sorted(placements.items())},
        "host": [h.to_dict() for h in hosts],
    }


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
