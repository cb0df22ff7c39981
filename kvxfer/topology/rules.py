"""The placement rules: which NICs and CPUs each GPU (or host buffer) of a ``Topology`` gets, and why.

``assign(topo, gpus=None, nics_per_gpu=None, nic_kind=None)`` returns ``{gpu index: Placement}``:

1. **One NIC kind per node.** Default: the most numerous kind on the node, ties going
   efa, mlx5, other. The many NICs are the data fabric; the odd ones are front-end or storage
   NICs (a p6-b200 has 8 EFA and 2 ConnectX-7: EFA). Mixing kinds would mean two providers in
   one transfer. `nic_kind="mlx5"` asks for the others; a kind the node lacks is a
   `TopologyError`.
2. **NICs under the GPU's own switch first**, dealt out among *all* GPUs under that switch in
   bus order: contiguous blocks whose sizes differ by at most one (p5en: 4 EFA, 2 H200 → 2
   each), or, with fewer NICs than GPUs, one NIC shared (p4d: the EFA serves both A100s).
   GPU-to-NIC traffic then stays inside the switch and never meets another GPU's.
3. **Otherwise the nearest NICs by PCIe hops on the GPU's NUMA node** (every NIC tied at the
   least hops), dealt out among the GPUs that fall back to the same group.
4. **Otherwise the nearest NICs on another NUMA node**, likewise, with `cross_numa=True` and
   "cross-NUMA" in the reason. The XE8640's H100 at `cb:00.0` (NUMA 7, no NIC) gets `mlx5_3`
   on NUMA 5, same socket.
5. `nics_per_gpu=n` keeps the first n of that share, or tops it up with the next nearest NICs
   ranked by (same switch, same NUMA node, other NUMA node), then hops, then the fewest GPUs
   already using the NIC (shares, and the extras of lower-index GPUs), then bus id: on a p5
   with `nics_per_gpu=5` the four H100s of a NUMA node add four different EFA, not all the
   same one. Asking for more NICs than the node has gives them all and says so.
6. **CPUs**: the GPU's NUMA-local physical cores, dealt out like NICs among *all* GPUs of that
   node: disjoint contiguous blocks; `cpus` lists every hyperthread of the chosen cores (PU os
   indexes). CPUs follow the GPU, not the NIC, also when the NIC is remote: the process that
   owns the GPU and its host staging buffers lives there (as NCCL pins its proxy threads).

Shares are computed over the whole machine, not over the GPUs asked for, so one process per
GPU calling `assign(gpus=[i])` gets exactly its slice of what `assign()` gives: disjoint across
processes without coordination. `shared=True` and "shared with GPU …" mark a NIC that also
serves another GPU.

**Host memory** (`Topology.assign_host(numa=None, nic_kind=None, max_nics=None)`): the NICs of
the buffer's NUMA node, else the nearest on another node (hops from the NUMA node, flagged
`cross_numa`), and all cores of that node. `numa=None` picks the node with the most NICs of the
kind: where a GPU-less server should keep the KV pages it serves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvxfer._check import is_int
from kvxfer.errors import ArgumentTypeError, InvalidArgumentError, TopologyError
from kvxfer.topology.model import GPU, KIND_LABEL, NIC, NIC_KINDS, NicKind, Placement

if TYPE_CHECKING:  # pragma: no cover
    from kvxfer.topology.machine import Topology

__all__ = ["assign", "assign_host", "default_nic_kind"]


def default_nic_kind(topo: Topology) -> NicKind | None:
    """The NIC kind placements use unless told: the most numerous kind on the node (the
    data fabric; the few others are front-end or storage NICs), ties going efa, mlx5, other."""
    counts = {k: sum(1 for n in topo.nics if n.kind == k) for k in NIC_KINDS}
    best = max(NIC_KINDS, key=lambda k: (counts[k], -NIC_KINDS.index(k)))
    return best if counts[best] else None  # type: ignore[return-value]


def nic_pool(topo: Topology, nic_kind: str | None) -> tuple[str | None, list[NIC]]:
    kind: str | None
    if nic_kind is None:
        kind = default_nic_kind(topo, )
    elif nic_kind in NIC_KINDS:
        kind = nic_kind
    else:
        raise InvalidArgumentError(f"nic_kind must be one of {NIC_KINDS} or None, not {nic_kind!r}")
    pool = sorted((n for n in topo.nics if n.kind == kind), key=lambda n: (n.busid, n.name))
    if nic_kind is not None and not pool:
        have: list[str] = sorted({n.kind for n in topo.nics}) or ["none"]
        raise TopologyError(f"no {nic_kind} NIC in {topo.source} (NIC kinds present: {', '.join(have)})")
    return kind, pool


def assign(
    topo: Topology,
    gpus: Iterable[int | str | GPU] | None = None,
    nics_per_gpu: int | None = None,
    nic_kind: NicKind | None = None,
) -> dict[int, Placement]:
    """Placements for ``gpus`` (default: all), keyed by GPU index.

    NICs, one kind per node (:meth:`default_nic_kind` unless ``nic_kind``): those under the
    GPU's own PCIe switch, shared out evenly among every GPU under that switch; else the
    nearest by PCIe hops on the GPU's NUMA node; else the nearest on another NUMA node,
    flagged ``cross_numa``. ``nics_per_gpu`` takes that many, topping up with the next
    nearest. CPUs: the GPU's NUMA-local physical cores split evenly and disjointly among
    every GPU of that node.

    Shares are computed over all GPUs of the machine, not only those asked for, so that
    one process per GPU each calling ``assign(gpus=[i])`` gets the same disjoint split.
    """
    if nics_per_gpu is not None and (not is_int(nics_per_gpu) or nics_per_gpu < 1):
        raise InvalidArgumentError(f"nics_per_gpu must be a positive int or None, not {nics_per_gpu!r}")
    kind, pool = nic_pool(topo, nic_kind)
    if isinstance(gpus, (str, bytes, GPU)) or is_int(gpus) or not (gpus is None or isinstance(gpus, Iterable)):
        raise ArgumentTypeError(f"gpus is a list of GPU indexes, bus ids or GPUs (for one GPU: gpus=[{gpus!r}])")
    chosen = list(topo.gpus) if gpus is None else [topo.gpu(k) for k in gpus]
    if not chosen:
        return {}
    firsts = {g.busid: first_band(topo, g, pool) for g in topo.gpus}
    # every GPU's pick, so that "shared" and "also used by" see the whole machine; the
    # top-up of nics_per_gpu sees the load of the GPUs before it (in index order)
    load: dict[str, int] = {}
    for g in topo.gpus:
        band, group = firsts[g.busid]
        holders = [b for b, f in firsts.items() if f == (band, group)]
        for n in _deal(group, holders, g.busid)[:nics_per_gpu]:  # what it keeps of its share
            load[n.name] = load.get(n.name, 0) + 1
    picks: dict[str, tuple[tuple[NIC, ...], tuple[int | None, ...], str]] = {}
    for g in topo.gpus:
        picks[g.busid] = pick_nics(topo, g, kind, pool, firsts, nics_per_gpu, load)
    users: dict[str, list[int]] = {}
    for g in topo.gpus:
        for n in picks[g.busid][0]:
            users.setdefault(n.name, []).append(g.index)
    out: dict[int, Placement] = {}
    for g in chosen:
        nics, hops, nic_reason = picks[g.busid]
        others = sorted({i for n in nics for i in users[n.name] if i != g.index})
        if others:
            nic_reason += f"; shared with GPU {','.join(map(str, others))}"
        cpus, cpu_reason = pick_cpus(topo, g)
        out[g.index] = Placement(
            gpu=g,
            nics=nics,
            cpus=cpus,
            numa=g.numa,
            cross_numa=g.numa is not None and any(n.numa != g.numa for n in nics),
            nic_reason=nic_reason,
            cpu_reason=cpu_reason,
            hops=hops,
            shared=bool(others),
        )
    return out


def first_band(topo: Topology, g: GPU, pool: list[NIC]) -> tuple[str, tuple[NIC, ...]]:
    """The NICs rule 1, 2 or 3 hands to ``g`` before sharing: ("switch"|"near"|"remote", nics)."""
    if not pool:
        return ("none", ())
    if g.switch is not None:
        under = tuple(n for n in pool if n.switch == g.switch)
        if under:
            return ("switch", under)
    same = [n for n in pool if g.numa is not None and n.numa == g.numa]
    cands = same or pool
    hops = {n.name: _hops(topo, g, n) for n in cands}
    best = min((h for h in hops.values() if h is not None), default=None)
    group = tuple(n for n in cands if hops[n.name] == best)
    return ("near" if same else "remote", group)


def pick_nics(
    topo: Topology,
    g: GPU,
    kind: str | None,
    pool: list[NIC],
    firsts: Mapping[str, tuple[str, tuple[NIC, ...]]],
    nics_per_gpu: int | None,
    load: dict[str, int] | None = None,
) -> tuple[tuple[NIC, ...], tuple[int | None, ...], str]:
    """``g``'s NICs, their hops and the reason. ``load`` (NIC name -> GPUs using it so far) breaks
    ties among equally near top-up NICs towards the least used, and is updated with the
    extras taken."""
    if not pool:
        return (), (), "no RDMA NIC in the topology"
    label = KIND_LABEL[kind or "other"]
    band, group = firsts[g.busid]
    holders = [b for b, f in firsts.items() if f == (band, group)]  # busids, already in index order
    share = _deal(group, holders, g.busid)
    parts: list[str] = []
    if band == "switch":
        part = f"{len(share)} {label} under the GPU's PCIe switch {topo.switch_name(g.switch)}"
        if len(holders) > 1:
            part += f" (its {len(group)} {label} split among its {len(holders)} GPUs)"
    else:
        split = ""
        if len(holders) > 1:
            split = f", {len(group)} {label} split among the {len(holders)} GPUs that fall back to them"
        hops = _hops(topo, g, share[0])
        if band == "near":
            part = (
                f"{len(share)} nearest {label} on NUMA node {g.numa}, {hops} PCIe hops"
                f" (none under the GPU's PCIe switch{split})"
            )
        elif g.numa is None:
            part = f"{len(share)} nearest {label} by PCIe hops ({hops}; the GPU's NUMA node is unknown{split})"
        else:
            to = ",".join(str(x) for x in sorted({n.numa for n in share}, key=lambda x: (x is None, x)))
            part = f"nearest {label} on another NUMA node (numa {g.numa} → {to}), {hops} PCIe hops: cross-NUMA"
            part += f" ({split[2:]})" if split else ""
    parts.append(part)
    picked = list(share)
    if nics_per_gpu is not None:
        if nics_per_gpu < len(picked):
            picked = picked[:nics_per_gpu]
            parts[0] += f", first {nics_per_gpu} kept"
        elif nics_per_gpu > len(picked):
            load = {} if load is None else load

            def rank(n: NIC) -> tuple[int, int]:
                tier = 0 if (g.switch is not None and n.switch == g.switch) else 1 if n.numa == g.numa else 2
                return (tier, _h(_hops(topo, g, n)))

            # nearest first; among equally near NICs, the one fewest GPUs use yet, then bus id
            # (ranking by bus id alone piled every GPU's extras onto the same NIC)
            extra: list[NIC] = []
            rest = [n for n in pool if n not in picked]
            while rest and len(picked) + len(extra) < nics_per_gpu:
                n = min(rest, key=lambda n: (*rank(n), load.get(n.name, 0), n.busid, n.name))
                rest.remove(n)
                extra.append(n)
                load[n.name] = load.get(n.name, 0) + 1
            if extra:
                picked += extra
                far = [n for n in extra if n.numa != g.numa]
                hs = sorted({_h(_hops(topo, g, n)) for n in extra})
                span = f"{hs[0]}" if len(hs) == 1 else f"{hs[0]}-{hs[-1]}"
                cross = f", {len(far)} cross-NUMA" if far else ""
                parts.append(f"+{len(extra)} next nearest {label} ({span} PCIe hops{cross})")
            if len(picked) < nics_per_gpu:
                parts.append(f"asked for {nics_per_gpu}, the node has {len(pool)} {label}")
    nics = tuple(picked)
    return nics, tuple(_hops(topo, g, n) for n in nics), "; ".join(parts)


def pick_cpus(topo: Topology, g: GPU) -> tuple[tuple[int, ...], str]:
    if not topo.has_cpu_info:
        return (), "no CPU info: the topology has no Core/PU objects"
    if g.numa is None:
        return (), "the GPU's NUMA node is unknown"
    node = topo.numa(g.numa)
    if not node.cores:
        return (), f"NUMA node {g.numa} has no cores"
    holders = [x.busid for x in topo.gpus if x.numa == g.numa]
    cores = _deal(node.cores, holders, g.busid)
    cpus = tuple(sorted(pu for c in cores for pu in c.pus))
    why = f"{len(cores)} of {len(node.cores)} cores on NUMA node {g.numa} ({len(cpus)} CPUs)"
    if len(holders) > 1:
        why += f", split among {len(holders)} GPUs"
        if len(node.cores) < len(holders):
            why += " (fewer cores than GPUs: shared)"
    return cpus, why


def assign_host(
    topo: Topology, numa: int | None = None, nic_kind: NicKind | None = None, max_nics: int | None = None
) -> Placement:
    """Placement for host memory on NUMA node ``numa``: the NICs of that node (else the
    nearest on another node, flagged ``cross_numa``) and all its cores.

    ``numa=None`` picks the node with the most NICs of the kind (lowest index on a tie):
    where a GPU-less server should keep the buffers it serves.
    """
    if max_nics is not None and (not is_int(max_nics) or max_nics < 1):
        raise InvalidArgumentError(f"max_nics must be a positive int or None, not {max_nics!r}")
    kind, pool = nic_pool(topo, nic_kind)
    if not topo.numa_nodes:
        raise TopologyError(f"no NUMA node in {topo.source}")
    if numa is None:
        node = max(topo.numa_nodes, key=lambda nd: (sum(1 for n in pool if n.numa == nd.os_index), -nd.os_index))
    else:
        node = topo.numa(numa)
    label = KIND_LABEL[kind or "other"]
    local = [n for n in pool if n.numa == node.os_index]
    anchor = numa_anchor(topo, node.os_index)
    if not pool:
        nics: list[NIC] = []
        nic_reason = "no RDMA NIC in the topology"
    elif local:
        nics = local
        nic_reason = f"{len(local)} {label} on NUMA node {node.os_index}"
    else:
        hops = {n.name: (_h(topo.pcie_hops(anchor, n.busid)) if anchor else 0) for n in pool}
        best = min(hops.values())
        nics = [n for n in pool if hops[n.name] == best]
        numas = sorted({n.numa for n in nics}, key=lambda x: (x is None, x))
        nic_reason = (
            f"nearest {label} on another NUMA node (numa {node.os_index} → {','.join(map(str, numas))}):"
            " cross-NUMA"
        )
    if max_nics is not None and len(nics) > max_nics:
        nics = nics[:max_nics]
        nic_reason += f", first {max_nics} kept"
    cpus = node.cpus
    if cpus:
        cpu_reason = f"all {len(node.cores)} cores of NUMA node {node.os_index} ({len(cpus)} CPUs)"
    elif not topo.has_cpu_info:
        cpu_reason = "no CPU info: the topology has no Core/PU objects"
    else:
        cpu_reason = f"NUMA node {node.os_index} has no cores"
    return Placement(
        gpu=None,
        nics=tuple(nics),
        cpus=cpus,
        numa=node.os_index,
        cross_numa=any(n.numa != node.os_index for n in nics),
        nic_reason=nic_reason,
        cpu_reason=cpu_reason,
        hops=tuple((topo.pcie_hops(anchor, n.busid) if anchor else None) for n in nics),
    )


def numa_anchor(topo: Topology, os_index: int) -> str | None:
    """The tree node of a NUMA node (for host-side hop counts); None in hand-built topologies."""
    nid = f"NUMANode:{os_index}"
    return nid if nid in topo._nodes else None


def _deal(items: Sequence[Any], holders: Sequence[str], who: str) -> tuple[Any, ...]:
    """``who``'s share when ``items`` are dealt among ``holders`` in order: contiguous blocks
    whose sizes differ by at most one, or, with fewer items than holders, one shared item."""
    k, m = len(items), len(holders)
    if k == 0 or m == 0:
        return ()
    i = holders.index(who)
    if k >= m:
        return tuple(items[i * k // m : (i + 1) * k // m])
    return (items[i * k // m],)


def _hops(topo: Topology, a: GPU | NIC, b: GPU | NIC) -> int | None:
    """PCIe hops between two devices, None where either is not in the recorded tree (a
    hand-built topology with ``pci=()``)."""
    nodes = topo._nodes
    if a.busid not in nodes or b.busid not in nodes:
        return None
    return topo.pcie_hops(a, b)


def _h(h: int | None) -> int:
    return 1 << 30 if h is None else h
