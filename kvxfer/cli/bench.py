"""``kvxfer-bench``: bandwidth and latency of kvxfer between two processes, data checked.

``kvxfer-bench bw`` starts a target process on 127.0.0.1 (or serves/joins another host with
``--listen`` / ``--connect``), writes single buffers and scattered pages into it, has the
target check every byte, and prints GB/s, writes/s and p50/p99 per transfer next to a
memmove baseline. ``kvxfer-bench lat`` ping-pongs a small write with immediate.
``kvxfer-bench topo`` (when installed) prints the NIC/CPU placement per GPU.

The method is written up in docs/benchmarks.md ("Method of kvxfer-bench"). Uses the public API
plus ``kvxfer.wire`` (``Address.decode``, ``split_write``, ``count_writes``); no private name
from outside ``kvxfer.cli``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
from typing import Any, Callable, Optional, Sequence

from kvxfer.cli._args import positive_int, writable_file, write_json
from kvxfer.cli._cases import DEFAULT_CASES, TARGET_MEMORY, Case, parse_case, parse_size
from kvxfer.cli._compare import compare, median_round
from kvxfer.cli._run import LOOPBACK, _Run
from kvxfer.cli._table import BW_COLUMNS, BW_WIDTHS, LAT_COLUMNS, LAT_WIDTHS, Bar, _header, bw_row, lat_row
from kvxfer.errors import KvxferError

__all__ = ["main", "build_parser", "DEFAULT_PROVIDERS"]

#: What a plain ``kvxfer-bench bw`` measures, one after the other.
DEFAULT_PROVIDERS = ("tcp;ofi_rxm", "shm")


# --------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------
def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except KvxferError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _case_arg(text: str) -> Case:
    try:
        return parse_case(text)
    except KvxferError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("where")
    g.add_argument("--provider", action="append", metavar="P",
                   help="libfabric provider; repeat for several (default: %s, one after the other)"
                        % " then ".join(DEFAULT_PROVIDERS))
    g.add_argument("--node", metavar="ADDR",
                   help=f"local address to bind (default {LOOPBACK} when the target runs here)")
    where = g.add_mutually_exclusive_group()
    where.add_argument("--listen", action="store_true",
                       help="be the target for an initiator on another host; prints the --connect address")
    where.add_argument("--connect", metavar="ADDR", help="run against a target started with --listen (hex address)")
    g.add_argument("--listen-timeout", type=float, metavar="S",
                   help="with --listen: give up if no initiator arrives within S seconds (default: wait)")
    g.add_argument("--pin", action="store_true",
                   help="pin this process (the initiator) to the first half of the CPUs it may use and the "
                        "target processes (kvxfer's, the --vs peers', the C floor's) to the second half, as a "
                        "deployment pins its engines; local runs only, at least 2 CPUs (default: the "
                        "scheduler places them)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", type=writable_file, help="write every result, the command line, provider and machine facts")
    o.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    e = p.add_argument_group("engine")
    e.add_argument("--progress", choices=("block", "spin"), default="block",
                   help="engine progress mode, both processes (default: block)")
    e.add_argument("--rails", type=positive_int, default=1, metavar="N",
                   help="endpoints per engine on the provider's domain, pages striped over them (default: 1)")
    e.add_argument("--iov", type=positive_int, metavar="N",
                   help="pieces per RMA message on the initiator (default: the provider's limit)")
    e.add_argument("--max-write", type=_size_arg, metavar="SIZE",
                   help="bytes per RMA message on the initiator; larger writes are split (default: 1G)")
    e.add_argument("--no-delivery-complete", action="store_true",
                   help="the initiator's writes complete on transmit, not once placed (tcp;ofi_rxm asks for "
                        "delivery-complete by default, so a refused write fails its transfer); NIXL's UCX "
                        "completions over tcp are local too")
    e.add_argument("--timeout", type=float, default=30.0, metavar="S",
                   help="give up on any single wait after S seconds (default: 30)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvxfer-bench",
        description="Bandwidth and latency of kvxfer writes between two processes, every byte checked at the target.",
    )
    sub = parser.add_subparsers(dest="cmd", metavar="{bw,lat,msg,kv,cluster,topo}")
    sub.required = True

    bw = sub.add_parser(
        "bw", help="bandwidth: single writes and scattered paged writes, checked at the target",
        description="Single writes of several sizes and paged writes into randomly scattered destination "
                    "pages; the target checks the data. Reports GB/s (10^9 B/s, from the p50 transfer time), "
                    "writes/s, p50/p99 per transfer (write call to the target's counter), posting cost per page, "
                    "and a same-run memmove baseline.",
        epilog="Cases: a = write:64M, b = pages:16Kx4096, c = pages:2Kx32768, memmove = memmove:64M; "
               "or write:SIZE, pages:PAGExCOUNT, memmove:SIZE. Default: " + " ".join(DEFAULT_CASES) + ".",
    )
    bw.add_argument("--case", action="append", type=_case_arg, metavar="CASE",
                    help="a case to run; repeat for several (default: all of the list below)")
    bw.add_argument("--op", action="append", choices=("write", "read"), metavar="OP",
                    help="write (default) or read (the initiator pulls each case with Engine.read_pages from a "
                         "readable target region, checked at the reader); repeat for both, each case both ways "
                         "back to back in the same run")
    bw.add_argument("--seconds", type=float, default=3.0, metavar="S",
                    help="time to spend on each case after warm-up, checks included (default: 3)")
    bw.add_argument("--iters", type=int, metavar="N", help="exactly N timed iterations per case (overrides --seconds)")
    bw.add_argument("--warmup", type=int, default=2, metavar="N", help="untimed iterations first (default: 2)")
    bw.add_argument("--min-iters", type=int, default=10, metavar="N", help="at least N timed iterations (default: 10)")
    bw.add_argument("--max-iters", type=int, default=5000, metavar="N",
                    help="at most N timed iterations (default: 5000)")
    bw.add_argument("--seed", type=int, default=0, help="seed of the data and the page scatter (default: 0)")
    bw.add_argument("--target-memory", choices=TARGET_MEMORY, default=TARGET_MEMORY[0],
                    help="the target's destination buffer: memfd (a host KVBuffer, as kvxfer's KV buffers are; "
                         "on shm kvxfer then writes directly unless KVXFER_SHM_DIRECT=0), memfd-huge (the same "
                         "on hugetlb pages: needs /proc/sys/vm/nr_hugepages) or anon (numpy memory); "
                         "--vs peers get the same (default: memfd)")
    bw.add_argument("--target-wait", choices=("block", "hot"), default="block",
                    help="how kvxfer's target waits for a case's writes: block (its progress threads sleep "
                         "when idle, the library's default) or hot (they poll, yielding, while writes are due: "
                         "Engine.hold_awake, as the NIXL target polls its notifications) (default: block)")
    bw.add_argument("--vs", action="append", choices=("nixl", "mooncake"), metavar="PEER",
                    help="also run the cases through PEER (nixl: NIXL's UCX backend, `pip install nixl`; mooncake: "
                         "Mooncake's transfer engine over TCP, `pip install mooncake-transfer-engine-non-cuda`, "
                         "tcp rows only) in the same run, same checks, and print kvxfer/PEER ratios (local runs "
                         "only; repeat --vs for both)")
    bw.add_argument("--rounds", type=positive_int, default=1, metavar="N",
                    help="run each case N times, kvxfer and every --vs peer back to back in each round: each "
                         "library's row is its median-GB/s round, and the comparison takes each figure's "
                         "median over the rounds with the range of the per-round ratios; on a machine whose "
                         "pace changes from second to second, pairs measured seconds apart are what a ratio "
                         "should compare (odd N gives one middle round; default: 1)")
    bw.add_argument("--floor", action="store_true",
                    help="after each provider's paged cases, the same pages through bench/fi_pingpong.c "
                         "(plain libfabric, one thread per rail, same iov): what the provider itself allows; "
                         "on tcp also the same bytes over plain TCP sockets, one per rail: what the "
                         "kernel's loopback allows")
    bw.add_argument("--chart", metavar="PNG",
                    help="with --vs: a bar chart of GB/s per case (default: next to --json, else none)")
    _common(bw)
    bw.set_defaults(func=run_bw)

    lat = sub.add_parser(
        "lat", help="latency: round trip of a small write with immediate",
        description="Ping-pong: A writes SIZE bytes with imm to B; when B's counter completes it writes them back "
                    "with imm; A's counter completing ends the round trip. Reports p50/p99 in microseconds.",
    )
    lat.add_argument("--size", type=_size_arg, default=8, metavar="BYTES", help="bytes per write (default: 8)")
    lat.add_argument("--iters", type=int, default=10000, metavar="N", help="timed round trips (default: 10000)")
    lat.add_argument("--warmup", type=int, default=500, metavar="N", help="untimed round trips first (default: 500)")
    lat.add_argument("--gap", type=float, default=0.0, metavar="MS",
                     help="idle time before each round trip, so progress threads fall asleep (default: 0)")
    lat.add_argument("--no-floor", action="store_true",
                     help="skip the floor: bench/fi_pingpong.c, the same round trip in plain libfabric, "
                          "run right after kvxfer's on each provider (local runs only)")
    _common(lat)
    lat.set_defaults(func=run_lat)

    from kvxfer.cli import msg

    msg.add_parser(sub)
    from kvxfer.cli import kv

    kv.add_parser(sub)
    from kvxfer.cli import cluster

    cluster.add_parser(sub)
    try:  # the topology subcommand lands separately; the benchmarks work without it
        from kvxfer.cli import topo
    except ImportError:
        pass
    else:
        topo.add_parser(sub)
    return parser


def _target_parser() -> argparse.ArgumentParser:
    """The hidden ``_target`` subcommand the initiator spawns."""
    p = argparse.ArgumentParser(prog="kvxfer-bench _target")
    p.add_argument("--provider", required=True)
    p.add_argument("--node")
    p.add_argument("--progress", choices=("block", "spin"), default="block")
    p.add_argument("--parent-pid", type=int)
    p.add_argument("--idle-timeout", type=float, default=60.0)
    p.add_argument("--deadline", type=float, default=1800.0)
    p.add_argument("--rails", type=int, default=1)
    return p


def _check_usage(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What a command line can get wrong across options, refused before anything runs (exit
    status 2; single values are refused by their argparse types, kvxfer.cli._args)."""
    if getattr(args, "vs", None) and getattr(args, "connect", None):
        parser.error("--vs runs both libraries on this host; it does not combine with --connect")
    if getattr(args, "listen", None) and getattr(args, "provider", None) and len(args.provider) > 1:
        parser.error("--listen serves one provider")
    if getattr(args, "connect", None):
        try:
            _providers(args)
        except ValueError as exc:
            parser.error(str(exc))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point; returns the exit status (0 all checks passed, 1 a check or a
    provider failed, 2 bad usage, 130 interrupted)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_target"]:
        from kvxfer.cli._machine import pin_from_env
        from kvxfer.cli._target import target_main

        pin_from_env()

        a = _target_parser().parse_args(argv[1:])
        return target_main(a.provider, a.node, progress=a.progress, parent_pid=a.parent_pid,
                           idle_timeout=a.idle_timeout, deadline=a.deadline, rails=a.rails)
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("iters", "warmup", "min_iters", "max_iters"):
        v = getattr(args, name, None)
        if v is not None and v < (1 if name in ("iters", "min_iters", "max_iters") else 0):
            parser.error(f"--{name.replace('_', '-')} must be {'positive' if name != 'warmup' else 'non-negative'}")
    if getattr(args, "timeout", 1) <= 0:
        parser.error("--timeout must be positive")
    _check_usage(parser, args)
    args.argv = argv
    pinned = None
    if getattr(args, "pin", False):
        if args.listen or args.connect:
            parser.error("--pin places the two processes of a local run; pin a remote one with taskset")
        from kvxfer.cli._machine import pin_halves

        try:
            pinned = pin_halves()
        except SystemExit as exc:          # too few CPUs: a usage error, said as one
            parser.error(str(exc).removeprefix("kvxfer-bench: "))
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("\nkvxfer-bench: interrupted", file=sys.stderr)
        return 130
    finally:
        if pinned is not None:
            from kvxfer.cli._machine import unpin

            unpin(pinned)


def _providers(args: argparse.Namespace) -> list[Optional[str]]:
    """The providers to run, in order; with ``--connect`` the target's (ValueError: an
    address that does not decode, or names another provider than ``--provider``)."""
    if args.connect:
        from kvxfer.errors import DescriptorError
        from kvxfer.wire import Address

        try:
            prov = Address.decode(bytes.fromhex(args.connect.strip())).provider
        except (ValueError, DescriptorError) as exc:
            raise ValueError(f"--connect: not a kvxfer address: {exc}") from None
        if args.provider and args.provider != [prov]:
            raise ValueError(f"the target at --connect runs {prov!r}, not {args.provider}")
        return [prov]
    return list(args.provider) if args.provider else list(DEFAULT_PROVIDERS)


def _listen(args: argparse.Namespace) -> int:
    from kvxfer.cli._target import target_main

    prov = args.provider[0] if args.provider else None     # one at most (_check_usage)
    try:
        rc = target_main(prov, args.node, progress=args.progress, parent_pid=None,
                         idle_timeout=max(120.0, 2 * args.timeout), deadline=None, listen=args.cmd,
                         rails=getattr(args, "rails", 1), listen_timeout=args.listen_timeout)
        return 1 if rc else 0      # 3 (no initiator came) is a failure like any other here
    except KvxferError as exc:
        print(f"kvxfer-bench: {exc}", file=sys.stderr)
        return 1


def _document(args: argparse.Namespace, runs: list) -> dict:
    from kvxfer.cli._machine import machine_info

    opts = {k: v for k, v in vars(args).items() if k not in ("func", "argv")}
    if opts.get("case"):
        opts["case"] = [c.spec for c in opts["case"]]
    return {
        "command": ["kvxfer-bench", *args.argv],
        "subcommand": args.cmd,
        "options": opts,
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "runs": runs,
    }


def _session(args: argparse.Namespace, body, header: str, extra=None) -> int:
    """Run ``body(run, bar)`` once per provider; print, collect, write JSON; exit status."""
    if args.listen:
        return _listen(args)
    bar = Bar(not args.quiet)
    runs: list[dict] = []
    status = 0
    explicit = bool(args.provider) or bool(args.connect)
    print(header, flush=True)
    for prov in _providers(args):
        run = _Run(args, prov)
        try:
            with run:
                try:
                    body(run, bar)
                finally:
                    bar.clear()
                runs.append(run.record)
                if run.record["error"]:
                    status = 1
                if any(r.get("check") != "ok" for r in run.record["results"]):
                    status = 1
        except KeyboardInterrupt:
            bar.clear()
            raise
        except Exception as exc:  # a provider failing must not hide the others' numbers
            bar.clear()
            missing = isinstance(exc, KvxferError) and "unavailable" in str(exc)
            if missing and not explicit:
                print(f"{prov or 'default':<12}  skipped: provider not available here", flush=True)
                runs.append({"provider": prov, "results": [], "error": None, "skipped": str(exc)})
                continue
            why = f"{type(exc).__name__}: {exc}"
            dead = run.target_death
            if dead and dead not in why:      # why the target went by itself, from its own stderr
                why += f"\n{dead}"
            print(f"{prov or 'default':<12}  FAILED: {why}", flush=True)
            # the rows measured before the failure stay in the JSON, with what failed
            run.record["error"] = why
            runs.append(run.record)
            status = 1
    if not any(r["results"] for r in runs):
        status = 1
    if args.json:
        doc = _document(args, runs)
        if extra is not None:
            extra(doc)
        if write_json(args.json, doc, "kvxfer-bench"):
            print(f"results written to {args.json}", file=sys.stderr)
        else:
            status = 1
    return status


def run_bw(args: argparse.Namespace) -> int:
    """``kvxfer-bench bw`` (with ``--vs``: the same cases through the peer right after)."""
    cases: list[Case] = list(args.case) if args.case else [parse_case(c) for c in DEFAULT_CASES]
    # the baseline first, so every row can be held against it
    order = sorted(range(len(cases)), key=lambda i: cases[i].kind != "memmove")
    warmup = args.warmup if args.iters is not None else max(1, args.warmup)
    peers = list(dict.fromkeys(args.vs or ()))     # --vs without --connect, --rounds >= 1: _check_usage
    comparison: list[dict] = []

    def one(rounds: list[dict]) -> dict:
        """A case's row: its only round as it is (the JSON of a run without --rounds), else
        the median round with every round's figures."""
        return rounds[0] if args.rounds == 1 else median_round(rounds)

    def body(run: _Run, bar: Bar) -> None:
        memmove = None
        # case by case, each round kvxfer then every peer back to back, so a change of the
        # machine's pace between two libraries' measurements is as short as it can be
        opened: list[tuple] = []
        try:
            for peer in peers:
                opened.append(_open_peer(peer, run))
            for i in order:
                case = cases[i]
                ours: list[dict] = []
                theirs: dict[str, list[dict]] = {peer: [] for peer, _, _ in opened}
                ops = list(dict.fromkeys(args.op or ("write",))) if case.kind != "memmove" else ["write"]
                if ops == ["read"]:
                    _read_rows(run, case, args, args.seed + i, warmup, bar, one, memmove, opened)
                    continue
                for r in range(args.rounds):
                    label = f"{run.provider} {case.label}" + (f" round {r + 1}" if args.rounds > 1 else "")
                    res = run.ini.bw(case, args.seed + i, warmup=warmup, iters=args.iters, budget=args.seconds,
                                     min_iters=args.min_iters, max_iters=args.max_iters,
                                     progress=lambda d, n, label=label: bar.update(label, d, n),
                                     memory=args.target_memory, target_wait=args.target_wait)
                    ours.append(res.summary())
                    if case.kind == "memmove":
                        continue
                    for j, (peer, p, rec) in enumerate(opened):
                        if p is None:
                            continue
                        s = _peer_case(peer, p, rec, run, case, args.seed + i, warmup, bar, label)
                        if s is None:        # it failed: it runs nothing more, so let it go now
                            p.close()
                            opened[j] = (peer, None, rec)
                        else:
                            theirs[peer].append(s)
                s = one(ours)
                run.record["results"].append(s)
                if case.kind == "memmove" and memmove is None:
                    memmove = s["gbps"]
                bar.clear()
                print(bw_row(run.provider, s, memmove), flush=True)
                for prob in s["problems"]:
                    print(f"    {prob}", flush=True)
                for peer, p, rec in opened:
                    got = theirs[peer]
                    if got and len(got) == args.rounds:
                        t = one(got)
                        rec["results"].append(t)
                        print(bw_row(f"{peer}/{run.provider}"[:11], t, memmove), flush=True)
                if "read" in ops:        # --op write --op read: the same case pulled, right after
                    _read_rows(run, case, args, args.seed + i, warmup, bar, one, memmove, opened)
        finally:
            for _, p, _ in opened:
                if p is not None:
                    p.close()
        if args.floor and not args.connect:
            _run_floor_pages(run, cases, order, memmove)
        for peer, _, rec in opened:
            comparison.extend(compare(run.provider, run.record["results"], rec["results"], peer))

    status = _session(args, body, _header(BW_COLUMNS, BW_WIDTHS), extra=lambda doc: doc.update(comparison=comparison))
    if peers:
        from kvxfer.cli._compare import chart, table

        if comparison:
            print("\n" + table(comparison), flush=True)
            png = args.chart or (os.path.splitext(args.json)[0] + ".png" if args.json else None)
            if png:
                why = chart(comparison, png)
                print(f"chart: {why}" if why else f"chart written to {png}", file=sys.stderr)
            if any(r["peer_check"] != "ok" for r in comparison):
                status = 1
        else:
            print("no comparison: the peer ran no case (see above)", flush=True)
    return status


def _read_rows(run: "_Run", case: Case, args: argparse.Namespace, seed: int, warmup: int, bar: Bar,
               one: Callable, memmove: Optional[float], opened: list) -> None:
    """``--op read``: ``case`` pulled by this process (kvxfer/cli/_bw_read.py), its rounds, its
    row; each round, every ``--vs`` peer that reads (NIXL's READ) pulls it right after."""
    from kvxfer.cli._bw_read import as_read_row, bw_read

    common = dict(warmup=warmup, iters=args.iters, budget=args.seconds, min_iters=args.min_iters,
                  max_iters=args.max_iters)
    rounds = []
    theirs: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        label = f"{run.provider} read {case.label}" + (f" round {r + 1}" if args.rounds > 1 else "")
        res = bw_read(run.ini, case, seed, progress=lambda d, n, label=label: bar.update(label, d, n), **common)
        rounds.append(as_read_row(res.summary()))
        for j, (peer, p, rec) in enumerate(opened):
            if p is None or not hasattr(p, "bw_read"):
                continue
            plabel = f"{peer} {label}"
            try:
                t = p.bw_read(case, seed, progress=lambda d, n, plabel=plabel: bar.update(plabel, d, n), **common)
            except Exception as exc:        # it runs nothing more, as a failed write case
                rec["error"] = f"read {case.spec}: {type(exc).__name__}: {exc}"
                bar.clear()
                print(f"{peer + ' ' + run.provider:<11}  FAILED: {rec['error']}", flush=True)
                p.close()
                opened[j] = (peer, None, rec)
                continue
            theirs.setdefault(peer, []).append(as_read_row(t.summary()))
    s = one(rounds)
    run.record["results"].append(s)
    bar.clear()
    print(bw_row(run.provider, s, memmove), flush=True)
    for prob in s["problems"]:
        print(f"    {prob}", flush=True)
    for peer, p, rec in opened:
        got = theirs.get(peer, [])
        if got and len(got) == args.rounds:
            t = one(got)
            rec["results"].append(t)
            print(bw_row(f"{peer}/{run.provider}"[:11], t, memmove), flush=True)


def _floor_pin() -> list:
    """``-C`` for the floor under ``--pin``: its two processes on the halves kvxfer's got."""
    from kvxfer.cli._machine import pinned_halves

    halves = pinned_halves()
    return ["-C", halves] if halves else []


def _floor_dc(eng) -> list:
    """The floor's flag for kvxfer's completion semantics: ``-D`` (FI_DELIVERY_COMPLETE)
    when this engine's writes ask for it (tcp;ofi_rxm by default), so both pay the same
    target acknowledgements."""
    return ["-D"] if getattr(eng, "delivery_complete", False) else []


def _run_floor_pages(run: "_Run", cases: list, order: list, memmove) -> None:
    """bench/fi_pingpong.c -m pages for each paged case (the better of its two polling modes,
    over as many endpoints and threads as kvxfer has rails), and on tcp the same bytes through
    plain TCP sockets (-m sock): what the kernel's loopback carries, which no TCP provider beats."""
    from kvxfer.cli._floor import FloorUnavailable, run_floor

    rec = run.record.setdefault("floor", [])
    rails = max(1, int(getattr(run.eng, "rails", 1) or 1))
    tcp = run.provider.split(";")[0] == "tcp"
    for i in order:
        case = cases[i]
        if case.kind != "pages":
            continue
        common = dict(page_bytes=case.page_bytes, pages=case.pages, iters=max(5, run.args.min_iters), warmup=1,
                      timeout=max(120.0, run.args.timeout * 4))
        try:
            runs = [run_floor(run.provider, mode="pages", iov=run.eng.iov,
                              extra=x + _floor_dc(run.eng) + ["-R", str(rails)] + _floor_pin(), **common)
                    for x in ([], ["-y"])]
        except FloorUnavailable as exc:
            print(f"{run.provider:<11}  floor {case.label}: {exc}", flush=True)
            rec.append({"case": case.spec, "error": str(exc)})
            continue
        sock = None
        if tcp:
            try:
                sock = run_floor(run.provider, mode="sock", iov=0, extra=["-R", str(rails)] + _floor_pin(),
                                 **common)
            except FloorUnavailable as exc:
                print(f"{run.provider:<11}  socket {case.label}: {exc}", flush=True)
                rec.append({"case": case.spec, "mode": "sock", "error": str(exc)})
        best = dict(max(runs, key=lambda f: f["gbps"]), case=case.spec, variants=runs)
        rec.append(best)
        s = {"label": case.label, "bytes": case.nbytes, "writes": best["messages"], "kind": "pages",
             "gbps": best["gbps"], "p50_s": best["p50_s"], "p99_s": None, "iterations": best["iterations"],
             "check": "-", "pages": case.pages}
        print(bw_row("floor (C)", s, memmove), flush=True)
        if sock:
            rec.append(dict(sock, case=case.spec))
            s = dict(s, writes="-", gbps=sock["gbps"], p50_s=sock["p50_s"], iterations=sock["iterations"])
            print(bw_row("socket (C)", s, memmove), flush=True)


def _open_peer(peer: str, run: "_Run") -> tuple:
    """(peer, its process or None, its record in this provider's JSON): NIXL's or Mooncake's
    target and initiator for this provider, or the reason it cannot run here."""
    if peer == "mooncake":
        from kvxfer.cli._mooncake import MooncakePeer as Peer, available, supports
    else:
        from kvxfer.cli._nixl import NixlPeer as Peer, available

        def supports(provider: str) -> Optional[str]:
            return None

    rec: dict[str, Any] = {"results": [], "error": None}
    run.record.setdefault("vs", {})[peer] = rec
    why = available()
    if why:
        rec["error"] = f"{peer} is not importable: {why}"
    elif supports(run.provider):
        rec["error"] = supports(run.provider)
    if rec["error"]:
        print(f"{run.provider:<11}  {peer}: skipped ({rec['error']})", flush=True)
        return peer, None, rec
    try:
        return peer, Peer(run.provider, timeout=run.args.timeout), rec
    except Exception as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
        print(f"{run.provider:<11}  {peer}: FAILED to start: {rec['error']}", flush=True)
        return peer, None, rec


def _peer_case(peer: str, p: Any, rec: dict, run: "_Run", case: Case, seed: int, warmup: int, bar: "Bar",
               label: str) -> Optional[dict]:
    """One case through the peer: its summary, or None with the failure in ``rec`` (the peer
    then runs no further case)."""
    args = run.args
    label = f"{peer} {label}"
    try:
        res = p.bw(case, seed, warmup=warmup, iters=args.iters, budget=args.seconds, min_iters=args.min_iters,
                   max_iters=args.max_iters, progress=lambda d, n: bar.update(label, d, n), memory=args.target_memory)
    except Exception as exc:
        rec["error"] = f"{case.spec}: {type(exc).__name__}: {exc}"
        bar.clear()
        print(f"{peer + ' ' + run.provider:<11}  FAILED: {rec['error']}", flush=True)
        return None
    return res.summary()


def run_lat(args: argparse.Namespace) -> int:
    """``kvxfer-bench lat``: kvxfer's round trip, then the floor's in the same run."""

    def body(run: _Run, bar: Bar) -> None:
        label = f"{run.provider} lat {args.size} B"
        res = run.ini.lat(args.size, warmup=args.warmup, iters=args.iters, gap=args.gap / 1e3,
                          progress=lambda d, n: bar.update(label, d, n))
        s = res.summary()
        floor = None
        if not args.no_floor and not args.connect:
            from kvxfer.cli._floor import FloorUnavailable, run_floor

            bar.update(f"{run.provider} floor {args.size} B", 0, 1)
            # the better of pure polling and polling that yields between empty reads: on a
            # loaded 2-core machine two pure spinners can starve each other's peer
            # with kvxfer's completion semantics (-D where its writes ask for delivery-complete);
            # the plain floor too, in the JSON, where they differ
            dc = _floor_dc(run.eng)

            def best(flags: list) -> dict:
                runs = [run_floor(run.provider, size=args.size, iters=args.iters, warmup=args.warmup,
                                  timeout=max(60.0, args.timeout * 4), extra=x + flags + _floor_pin())
                        for x in ([], ["-y"])]
                return dict(min(runs, key=lambda f: f["p50_us"]), variants=runs)

            try:
                floor = best(dc)
                if dc:
                    floor["plain"] = best([])
            except FloorUnavailable as exc:
                floor = {"error": str(exc)}
            s["floor"] = floor
        run.record["results"].append(s)
        bar.clear()
        print(lat_row(run.provider, s, floor), flush=True)
        if floor and floor.get("error"):
            print(f"    floor: {floor['error']}", flush=True)
        elif floor and floor.get("plain"):
            p50 = floor["plain"]["p50_us"]
            print(f"    floor with delivery-complete, as kvxfer's writes here; without it: p50 {p50:.1f} us "
                  f"(x {s['p50_us'] / p50:.1f})", flush=True)

    return _session(args, body, _header(LAT_COLUMNS, LAT_WIDTHS))


if __name__ == "__main__":
    sys.exit(main())
