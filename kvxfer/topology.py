"""Which NICs and CPUs should drive each GPU's KV transfers, and why.

hwloc (through pyhwloc) describes the machine; this module turns its objects into plain
frozen dataclasses at once, so the placement rules, the engine and the tests never touch a
pyhwloc object. ``import kvxfer.topology`` works without pyhwloc: it is imported only by
:meth:`Topology.discover` and :meth:`Topology.from_xml`.

Vocabulary (see docs/architecture.md, "Topology and placement" for the reasons):

* A **PCIe switch** of a device is the nearest bridge above it where PCIe links fan out:
  walking up from the device, single-link bridges (root ports, a switch's downstream ports)
  are passed, and the first bridge with two or more links below it (child bridges count one
  each, a multi-function device counts once) is the switch. A host bridge counts only when
  the device sits directly on its root bus (how EC2 presents each physical switch of a p4d);
  reached through a root port, the device has no switch.
* **PCIe hops** between two devices: edges in hwloc's tree between them through their lowest
  common ancestor; bridges count, and so do the CPU-side objects (Group, Package, Machine)
  that a path through the root complex climbs, so crossing a socket costs more.

Never imports the engine.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any, Literal

from kvxfer.errors import InvalidArgumentError, TopologyError, UnsupportedError

__all__ = ["Topology", "Placement", "GPU", "NIC", "NumaNode", "Core", "PciNode", "NicKind"]

NicKind = Literal["efa", "mlx5", "other"]
NIC_KINDS: tuple[str, ...] = ("efa", "mlx5", "other")  # also the tie-break order for the default kind

_NVIDIA = 0x10DE
_AMAZON = 0x1D0F
_MELLANOX = 0x15B3
_GPU_CLASSES = (0x0300, 0x0302)  # VGA, 3D controller
_OSDEV_NETWORK = 1 << 4
_OSDEV_OPENFABRICS = 1 << 5
# names for reports when an export lacks hwloc's PCIDevice string (the EC2 ones)
_GPU_MODELS = {
    0x20B0: "A100 SXM4 40GB",
    0x20B2: "A100 SXM4 80GB",
    0x2330: "H100 SXM5 80GB",
    0x2335: "H200 SXM 141GB",
    0x2901: "B200",
}
_KIND_LABEL = {"efa": "EFA", "mlx5": "ConnectX", "other": "RDMA NIC"}


# --------------------------------------------------------------------------- plain data


@dataclass(frozen=True)
class Core:
    """One physical core: hwloc's logical index and the os indexes of its hyperthreads."""

    index: int
    pus: tuple[int, ...]


@dataclass(frozen=True)
class NumaNode:
    """A NUMA node with the physical cores whose PUs it holds (hyperthreads folded into cores).

    ``cpuset`` is hwloc's cpuset of the node (PU os indexes); it is known even where the XML
    has no Core/PU objects (the EC2 exports), ``cores`` is then empty.
    """

    os_index: int
    cores: tuple[Core, ...]
    cpuset: tuple[int, ...]
    memory: int  # bytes of local memory, 0 when unknown

    @property
    def cpus(self) -> tuple[int, ...]:
        """All PU os indexes of the node's cores."""
        return tuple(pu for core in self.cores for pu in core.pus)


@dataclass(frozen=True)
class PciNode:
    """One node of the I/O tree, linked to its parent: ``parent`` ids lead from every PCI
    device up through bridges to the CPU side (Group/Package/Machine) of the root complex.

    ``id`` is the device's bus id (``0000:53:00.0``) for devices, ``0000:[45-54]`` (the bus
    range behind it) for bridges, and ``Package:0``-style names for CPU-side objects.
    """

    id: str
    kind: Literal["device", "bridge", "host_bridge", "cpu"]
    parent: str | None
    busid: str | None = None  # a bridge's own bus id (None for host bridges and CPU objects)
    numa: int | None = None


@dataclass(frozen=True)
class GPU:
    """A GPU found by PCI class (VGA / 3D controller) and NVIDIA's vendor id."""

    index: int  # position in Topology.gpus (PCI bus id order, as nvidia-smi)
    busid: str
    vendor_id: int
    device_id: int
    name: str  # hwloc's PCIDevice string, e.g. "GH100 [H100 SXM5 80GB]"; "" when absent
    numa: int | None
    switch: str | None  # id of the PciNode that is its PCIe switch, None when it has none
    cuda_ordinal: int | None = None

    @property
    def model(self) -> str:
        """The marketing name inside the brackets of ``name`` ("H100 SXM5 80GB"), else ``name``."""
        m = re.search(r"\[(.+)\]", self.name)
        if m:
            return m.group(1)
        return self.name or _GPU_MODELS.get(self.device_id, f"{self.vendor_id:04x}:{self.device_id:04x}")


@dataclass(frozen=True)
class NIC:
    """An RDMA NIC: a PCI device (function) with an OpenFabrics OS device below it.

    ``name`` is the OpenFabrics device name (``rdmap16s27``, ``mlx5_0``); :meth:`domain` gives
    the libfabric domain name built from it.
    """

    name: str
    busid: str
    vendor_id: int
    device_id: int
    kind: NicKind
    numa: int | None
    switch: str | None
    link_speed: float | None = None  # PCIe link bandwidth in GB/s as hwloc reports it; None if unknown
    netdevs: tuple[str, ...] = ()  # Ethernet/IPoIB interfaces on the same function

    @property
    def provider(self) -> str:
        """The libfabric provider that drives this NIC: ``efa`` or ``verbs``."""
        return "efa" if self.kind == "efa" else "verbs"

    def domain(self, ep_type: Literal["rdm", "dgram", "msg"] = "rdm") -> str:
        """libfabric ``fi_info.domain_attr.name`` for this NIC.

        efa names a domain per endpoint type (``rdmap16s27-rdm``, ``rdmap16s27-dgrm``);
        verbs names it after the device (``mlx5_0``; ``mlx5_0-dgram`` for datagram), and
        ``verbs;ofi_rxm`` RDM endpoints use the plain device name.
        """
        if ep_type not in ("rdm", "dgram", "msg"):
            raise InvalidArgumentError(f"ep_type must be 'rdm', 'dgram' or 'msg', not {ep_type!r}")
        if self.kind == "efa":
            if ep_type == "msg":
                raise InvalidArgumentError("efa has no FI_EP_MSG domain")
            return f"{self.name}-{'rdm' if ep_type == 'rdm' else 'dgrm'}"
        return f"{self.name}-dgram" if ep_type == "dgram" else self.name


@dataclass(frozen=True)
class Placement:
    """Where one GPU's (or one host buffer's) transfers should run.

    The engine opens one libfabric domain per entry of ``nics`` (see :meth:`NIC.domain`) and
    pins each NIC's progress thread to ``cpus``. ``hops`` is parallel to ``nics``.
    """

    gpu: GPU | None  # None for a host-memory placement
    nics: tuple[NIC, ...]
    cpus: tuple[int, ...]  # PU os indexes: every hyperthread of the chosen physical cores
    numa: int | None
    cross_numa: bool  # some NIC is on another NUMA node than the GPU/buffer
    nic_reason: str
    cpu_reason: str
    hops: tuple[int | None, ...] = ()
    shared: bool = False  # some NIC also serves another GPU

    @property
    def nic_names(self) -> tuple[str, ...]:
        """The OpenFabrics device names of ``nics``."""
        return tuple(n.name for n in self.nics)

    @property
    def domains(self) -> tuple[str, ...]:
        """libfabric RDM domain names of ``nics``, in order."""
        return tuple(n.domain("rdm") for n in self.nics)

    @property
    def reason(self) -> str:
        """Why these NICs and CPUs, in one line."""
        return f"{self.nic_reason}; {self.cpu_reason}"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form (what ``kvxfer-bench topo --json`` prints)."""
        return {
            "gpu": None if self.gpu is None else asdict(self.gpu),
            "nics": list(self.nic_names),
            "domains": list(self.domains),
            "hops": list(self.hops),
            "cpus": list(self.cpus),
            "numa": self.numa,
            "cross_numa": self.cross_numa,
            "shared": self.shared,
            "nic_reason": self.nic_reason,
            "cpu_reason": self.cpu_reason,
        }


# --------------------------------------------------------------------------- the topology


@dataclass(frozen=True)
class Topology:
    """GPUs, RDMA NICs, NUMA nodes and the PCIe tree between them, as plain data.

    Build one with :meth:`discover` (this machine) or :meth:`from_xml` (an hwloc XML export),
    then ask :meth:`assign` for per-GPU placements or :meth:`assign_host` for host memory.
    """

    gpus: tuple[GPU, ...]
    nics: tuple[NIC, ...]
    numa_nodes: tuple[NumaNode, ...]
    pci: tuple[PciNode, ...] = field(repr=False)
    source: str = "this machine"

    # ---- construction

    @classmethod
    def discover(cls) -> Topology:
        """This machine's topology. A machine without GPU or RDMA NIC gives empty ``gpus`` /
        ``nics``, not an error. CUDA ordinals come from cuda-python when its driver answers."""
        hwloc, type_filter = _import_pyhwloc()
        try:
            hw = hwloc.Topology.from_this_system()
            hw.set_io_types_filter(type_filter.KEEP_ALL)
            hw.load()
        except Exception as e:  # pyhwloc raises ValueError / HwLocError
            raise TopologyError(f"hwloc could not load this machine's topology: {e}") from e
        try:
            topo = _convert_checked(hw, "this machine")
        finally:
            hw.destroy()
        ordinals = _cuda_ordinals()
        if ordinals:
            topo = topo._with_cuda_ordinals(ordinals)
        return topo

    @classmethod
    def from_xml(cls, path: str | os.PathLike[str]) -> Topology:
        """The topology in an hwloc XML export (``lstopo --of xml``, hwloc 2.x format).

        Raises TopologyError when the file is missing, unreadable or malformed. The XML is
        checked for well-formedness first: hwloc's own minimal parser crashes the process on
        some truncated files instead of failing.
        """
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError as e:
            raise TopologyError(f"topology XML {path!r}: no such file") from e
        except (OSError, UnicodeDecodeError) as e:
            raise TopologyError(f"topology XML {path!r}: cannot read: {e}") from e
        return cls._from_xml_text(text, os.path.basename(path))

    @classmethod
    def _from_xml_text(cls, text: str, source: str) -> Topology:
        text = _check_xml(text, source)
        hwloc, type_filter = _import_pyhwloc()
        try:
            hw = hwloc.Topology.from_xml_buffer(text)
            hw.set_io_types_filter(type_filter.KEEP_ALL)
            hw.load()
        except Exception as e:
            raise TopologyError(f"topology XML {source!r}: hwloc rejected it: {e}") from e
        try:
            return _convert_checked(hw, source)
        finally:
            hw.destroy()

    # ---- lookups

    @cached_property
    def _nodes(self) -> dict[str, PciNode]:
        return {n.id: n for n in self.pci}

    @property
    def has_cpu_info(self) -> bool:
        """Whether the topology lists physical cores (EC2 exports do not)."""
        return any(node.cores for node in self.numa_nodes)

    def gpu(self, key: int | str | GPU) -> GPU:
        """A GPU by index, bus id (``0000:53:00.0`` or ``53:00.0``) or GPU object."""
        if isinstance(key, GPU):
            key = key.busid
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise InvalidArgumentError(f"a GPU is named by index, bus id or GPU, not {key!r}")
        if isinstance(key, int):
            if not 0 <= key < len(self.gpus):
                raise InvalidArgumentError(f"GPU index {key} out of range: {len(self.gpus)} GPUs in {self.source}")
            return self.gpus[key]
        bus = _norm_busid(key)
        for g in self.gpus:
            if g.busid == bus:
                return g
        raise InvalidArgumentError(f"no GPU at PCI bus id {key!r} in {self.source}")

    def nic(self, name: str) -> NIC:
        """A NIC by OpenFabrics device name."""
        for n in self.nics:
            if n.name == name:
                return n
        raise InvalidArgumentError(f"no RDMA NIC named {name!r} in {self.source}")

    def numa(self, os_index: int) -> NumaNode:
        """A NUMA node by os index."""
        for node in self.numa_nodes:
            if node.os_index == os_index:
                return node
        have = [n.os_index for n in self.numa_nodes]
        raise InvalidArgumentError(f"no NUMA node {os_index} in {self.source} (nodes: {have})")

    def switch_name(self, switch: str | None) -> str:
        """How reasons name a switch: its upstream port's bus id, or the root bus of a host bridge."""
        if switch is None:
            return "none"
        node = self._nodes.get(switch)
        if node is not None and node.busid:
            return node.busid
        m = re.fullmatch(r"([0-9a-f]{4}):\[([0-9a-f]{2})-[0-9a-f]{2}\]", switch)
        return f"root bus {m.group(1)}:{m.group(2)}" if m else switch

    def pcie_hops(self, a: str | GPU | NIC, b: str | GPU | NIC) -> int | None:
        """Edges in the I/O tree between two devices (or tree node ids) through their lowest
        common ancestor; None when they share no ancestor in the recorded tree."""
        ida = a.busid if isinstance(a, (GPU, NIC)) else _maybe_busid(a)
        idb = b.busid if isinstance(b, (GPU, NIC)) else _maybe_busid(b)
        up_a = self._path_up(ida)
        depth_b = {nid: i for i, nid in enumerate(self._path_up(idb))}
        for i, nid in enumerate(up_a):
            j = depth_b.get(nid)
            if j is not None:
                return i + j
        return None

    def _path_up(self, nid: str) -> list[str]:
        if nid not in self._nodes:
            raise InvalidArgumentError(f"{nid!r} is not a node of the PCIe tree of {self.source}")
        out = []
        cur: str | None = nid
        while cur is not None:
            out.append(cur)
            cur = self._nodes[cur].parent
        return out

    # ---- placement

    def default_nic_kind(self) -> NicKind | None:
        """The NIC kind placements use unless told: the most numerous kind on the node (the
        data fabric; the few others are front-end or storage NICs), ties going efa, mlx5, other."""
        counts = {k: sum(1 for n in self.nics if n.kind == k) for k in NIC_KINDS}
        best = max(NIC_KINDS, key=lambda k: (counts[k], -NIC_KINDS.index(k)))
        return best if counts[best] else None  # type: ignore[return-value]

    def _pool(self, nic_kind: str | None) -> tuple[str | None, list[NIC]]:
        kind: str | None
        if nic_kind is None:
            kind = self.default_nic_kind()
        elif nic_kind in NIC_KINDS:
            kind = nic_kind
        else:
            raise InvalidArgumentError(f"nic_kind must be one of {NIC_KINDS} or None, not {nic_kind!r}")
        pool = sorted((n for n in self.nics if n.kind == kind), key=lambda n: (n.busid, n.name))
        if nic_kind is not None and not pool:
            have: list[str] = sorted({n.kind for n in self.nics}) or ["none"]
            raise TopologyError(f"no {nic_kind} NIC in {self.source} (NIC kinds present: {', '.join(have)})")
        return kind, pool

    def assign(
        self,
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
        if nics_per_gpu is not None and (
            isinstance(nics_per_gpu, bool) or not isinstance(nics_per_gpu, int) or nics_per_gpu < 1
        ):
            raise InvalidArgumentError(f"nics_per_gpu must be a positive int or None, not {nics_per_gpu!r}")
        kind, pool = self._pool(nic_kind)
        chosen = list(self.gpus) if gpus is None else [self.gpu(k) for k in gpus]
        if not chosen:
            return {}
        firsts = {g.busid: self._first_band(g, pool) for g in self.gpus}
        # every GPU's pick, so that "shared" and "also used by" see the whole machine
        picks = {g.busid: self._pick_nics(g, kind, pool, firsts, nics_per_gpu) for g in self.gpus}
        users: dict[str, list[int]] = {}
        for g in self.gpus:
            for n in picks[g.busid][0]:
                users.setdefault(n.name, []).append(g.index)
        out: dict[int, Placement] = {}
        for g in chosen:
            nics, hops, nic_reason = picks[g.busid]
            others = sorted({i for n in nics for i in users[n.name] if i != g.index})
            if others:
                nic_reason += f"; shared with GPU {','.join(map(str, others))}"
            cpus, cpu_reason = self._pick_cpus(g)
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

    def _first_band(self, g: GPU, pool: list[NIC]) -> tuple[str, tuple[NIC, ...]]:
        """The NICs rule 1, 2 or 3 hands to ``g`` before sharing: ("switch"|"near"|"remote", nics)."""
        if not pool:
            return ("none", ())
        if g.switch is not None:
            under = tuple(n for n in pool if n.switch == g.switch)
            if under:
                return ("switch", under)
        same = [n for n in pool if g.numa is not None and n.numa == g.numa]
        cands = same or pool
        hops = {n.name: self.pcie_hops(g, n) for n in cands}
        best = min((h for h in hops.values() if h is not None), default=None)
        group = tuple(n for n in cands if hops[n.name] == best)
        return ("near" if same else "remote", group)

    def _pick_nics(
        self,
        g: GPU,
        kind: str | None,
        pool: list[NIC],
        firsts: Mapping[str, tuple[str, tuple[NIC, ...]]],
        nics_per_gpu: int | None,
    ) -> tuple[tuple[NIC, ...], tuple[int | None, ...], str]:
        if not pool:
            return (), (), "no RDMA NIC in the topology"
        label = _KIND_LABEL[kind or "other"]
        band, group = firsts[g.busid]
        holders = [b for b, f in firsts.items() if f == (band, group)]  # busids, already in index order
        share = _deal(group, holders, g.busid)
        parts: list[str] = []
        if band == "switch":
            part = f"{len(share)} {label} under the GPU's PCIe switch {self.switch_name(g.switch)}"
            if len(holders) > 1:
                part += f" (its {len(group)} {label} split among its {len(holders)} GPUs)"
        else:
            split = ""
            if len(holders) > 1:
                split = f", {len(group)} {label} split among the {len(holders)} GPUs that fall back to them"
            hops = self.pcie_hops(g, share[0])
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
                rest = sorted(
                    (n for n in pool if n not in picked),
                    key=lambda n: (
                        0 if (g.switch is not None and n.switch == g.switch) else 1 if n.numa == g.numa else 2,
                        _h(self.pcie_hops(g, n)),
                        n.busid,
                        n.name,
                    ),
                )
                extra = rest[: nics_per_gpu - len(picked)]
                if extra:
                    picked += extra
                    far = [n for n in extra if n.numa != g.numa]
                    hs = sorted({_h(self.pcie_hops(g, n)) for n in extra})
                    span = f"{hs[0]}" if len(hs) == 1 else f"{hs[0]}-{hs[-1]}"
                    cross = f", {len(far)} cross-NUMA" if far else ""
                    parts.append(f"+{len(extra)} next nearest {label} ({span} PCIe hops{cross})")
                if len(picked) < nics_per_gpu:
                    parts.append(f"asked for {nics_per_gpu}, the node has {len(pool)} {label}")
        nics = tuple(picked)
        return nics, tuple(self.pcie_hops(g, n) for n in nics), "; ".join(parts)

    def _pick_cpus(self, g: GPU) -> tuple[tuple[int, ...], str]:
        if not self.has_cpu_info:
            return (), "no CPU info: the topology has no Core/PU objects"
        if g.numa is None:
            return (), "the GPU's NUMA node is unknown"
        node = self.numa(g.numa)
        if not node.cores:
            return (), f"NUMA node {g.numa} has no cores"
        holders = [x.busid for x in self.gpus if x.numa == g.numa]
        cores = _deal(node.cores, holders, g.busid)
        cpus = tuple(sorted(pu for c in cores for pu in c.pus))
        why = f"{len(cores)} of {len(node.cores)} cores on NUMA node {g.numa} ({len(cpus)} CPUs)"
        if len(holders) > 1:
            why += f", split among {len(holders)} GPUs"
            if len(node.cores) < len(holders):
                why += " (fewer cores than GPUs: shared)"
        return cpus, why

    def assign_host(
        self, numa: int | None = None, nic_kind: NicKind | None = None, max_nics: int | None = None
    ) -> Placement:
        """Placement for host memory on NUMA node ``numa``: the NICs of that node (else the
        nearest on another node, flagged ``cross_numa``) and all its cores.

        ``numa=None`` picks the node with the most NICs of the kind (lowest index on a tie):
        where a GPU-less server should keep the buffers it serves.
        """
        if max_nics is not None and (isinstance(max_nics, bool) or not isinstance(max_nics, int) or max_nics < 1):
            raise InvalidArgumentError(f"max_nics must be a positive int or None, not {max_nics!r}")
        kind, pool = self._pool(nic_kind)
        if not self.numa_nodes:
            raise TopologyError(f"no NUMA node in {self.source}")
        if numa is None:
            node = max(self.numa_nodes, key=lambda nd: (sum(1 for n in pool if n.numa == nd.os_index), -nd.os_index))
        else:
            node = self.numa(numa)
        label = _KIND_LABEL[kind or "other"]
        local = [n for n in pool if n.numa == node.os_index]
        anchor = self._numa_anchor(node.os_index)
        if not pool:
            nics: list[NIC] = []
            nic_reason = "no RDMA NIC in the topology"
        elif local:
            nics = local
            nic_reason = f"{len(local)} {label} on NUMA node {node.os_index}"
        else:
            hops = {n.name: (_h(self.pcie_hops(anchor, n.busid)) if anchor else 0) for n in pool}
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
        elif not self.has_cpu_info:
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
            hops=tuple((self.pcie_hops(anchor, n.busid) if anchor else None) for n in nics),
        )

    def _numa_anchor(self, os_index: int) -> str | None:
        """The tree node of a NUMA node (for host-side hop counts); None in hand-built topologies."""
        nid = f"NUMANode:{os_index}"
        return nid if nid in self._nodes else None

    # ---- output

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form of the whole topology."""
        return {
            "source": self.source,
            "gpus": [asdict(g) for g in self.gpus],
            "nics": [asdict(n) for n in self.nics],
            "numa_nodes": [
                {
                    "os_index": n.os_index,
                    "memory": n.memory,
                    "cpuset": list(n.cpuset),
                    "cores": [list(c.pus) for c in n.cores],
                }
                for n in self.numa_nodes
            ],
            "pci": [asdict(n) for n in self.pci],
        }

    def summary(self) -> str:
        """One line: what the topology holds."""
        counts = {k: sum(1 for n in self.nics if n.kind == k) for k in NIC_KINDS}
        kinds = ", ".join(f"{c} {k}" for k, c in counts.items() if c)
        cores = sum(len(n.cores) for n in self.numa_nodes)
        return (
            f"{self.source}: {len(self.gpus)} GPU, {len(self.nics)} RDMA NIC{f' ({kinds})' if kinds else ''},"
            f" {len(self.numa_nodes)} NUMA node(s), {cores} cores"
        )

    def _with_cuda_ordinals(self, ordinals: Mapping[str, int]) -> Topology:
        """The driver's answer is authoritative: a GPU it does not list (hidden by
        CUDA_VISIBLE_DEVICES) has no ordinal in this process."""
        gpus = tuple(dataclasses.replace(g, cuda_ordinal=ordinals.get(g.busid)) for g in self.gpus)
        return Topology(gpus=gpus, nics=self.nics, numa_nodes=self.numa_nodes, pci=self.pci, source=self.source)


# --------------------------------------------------------------------------- helpers


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


def _h(h: int | None) -> int:
    return 1 << 30 if h is None else h


def _busid(domain: int, bus: int, dev: int, func: int) -> str:
    return f"{domain:04x}:{bus:02x}:{dev:02x}.{func:x}"


_BUSID = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")


def _norm_busid(text: str) -> str:
    """``0000:53:00.0``, ``00000000:53:00.0`` and ``53:00.0`` all become ``0000:53:00.0``."""
    m = _BUSID.match(text.strip())
    if not m:
        raise InvalidArgumentError(f"{text!r} is not a PCI bus id (like 0000:53:00.0)")
    dom, bus, dev, fn = m.groups()
    return _busid(int(dom or "0", 16), int(bus, 16), int(dev, 16), int(fn, 16))


def _maybe_busid(text: str) -> str:
    return _norm_busid(text) if _BUSID.match(text.strip()) else text


def _import_pyhwloc() -> tuple[Any, Any]:
    try:
        import pyhwloc
        from pyhwloc.topology import TypeFilter
    except ImportError as e:  # pragma: no cover - pyhwloc is a dependency, but may be absent
        raise UnsupportedError("topology discovery needs pyhwloc (pip install pyhwloc)") from e
    return pyhwloc, TypeFilter


def _check_xml(text: str, source: str) -> str:
    """Reject what hwloc would choke on, with a clear message, and strip XML comments (which
    pyhwloc's bundled minimal XML parser refuses)."""
    import xml.etree.ElementTree as ET

    if not text.strip():
        raise TopologyError(f"topology XML {source!r} is empty")
    try:
        root = ET.fromstring(text)
    except ET.ParseError as e:
        raise TopologyError(f"topology XML {source!r} is malformed: {e}") from e
    if root.tag != "topology":
        raise TopologyError(f"topology XML {source!r}: root element is <{root.tag}>, not <topology>")
    version = root.get("version")
    if version is None or not version.startswith(("2.", "3.")):
        raise TopologyError(
            f"topology XML {source!r}: version {version!r} unsupported (hwloc 2.x/3.x XML needed; "
            "re-export hwloc 1.x files with lstopo 2.x)"
        )
    if root.find("object") is None:
        raise TopologyError(f"topology XML {source!r} holds no objects")
    return re.sub(r"<!--.*?-->\s*", "", text, flags=re.S)


def _cuda_ordinals() -> dict[str, int]:
    """Bus id -> CUDA ordinal from cuda-python's driver API; {} without cuda-python or a GPU."""
    try:
        from cuda.bindings import driver as cu  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cuda as cu  # older cuda-python
        except ImportError:
            return {}
    try:
        (err,) = cu.cuInit(0)
        if int(err) != 0:
            return {}
        err, count = cu.cuDeviceGetCount()
        if int(err) != 0:
            return {}
        out: dict[str, int] = {}
        for i in range(count):
            err, dev = cu.cuDeviceGet(i)
            if int(err) != 0:
                continue
            err, raw = cu.cuDeviceGetPCIBusId(32, dev)
            if int(err) != 0:
                continue
            text = raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)
            out[_norm_busid(text.split("\x00", 1)[0])] = i
        return out
    except Exception:  # a driver without a device raises from every call; ordinals stay None
        return {}


# --------------------------------------------------------------------------- pyhwloc -> plain data


def _convert_checked(hw: Any, source: str) -> Topology:
    try:
        return _convert(hw, source)
    except (AttributeError, TypeError, ValueError, KeyError) as e:
        raise TopologyError(f"topology {source!r}: cannot interpret hwloc's objects: {e}") from e


def _convert(hw: Any, source: str) -> Topology:
    """Walk a loaded pyhwloc topology once and return plain data."""
    # NUMA nodes and cores
    numa_sets: list[tuple[int, set[int], int]] = []
    for nd in hw.iter_numa_nodes():
        cs = nd.cpuset
        numa_sets.append((int(nd.os_index), set(cs) if cs is not None else set(), int(nd.local_memory or 0)))
    cores_by_numa: dict[int, list[Core]] = {os_i: [] for os_i, _, _ in numa_sets}
    for core in hw.iter_cores():
        pus = tuple(sorted(int(p) for p in core.cpuset)) if core.cpuset is not None else ()
        if not pus:
            continue
        for os_i, cs, _ in numa_sets:
            if pus[0] in cs:
                cores_by_numa[os_i].append(Core(index=int(core.logical_index), pus=pus))
                break
    numa_nodes = tuple(
        NumaNode(os_index=os_i, cores=tuple(cores_by_numa[os_i]), cpuset=tuple(sorted(cs)), memory=mem)
        for os_i, cs, mem in sorted(numa_sets)
    )

    # the I/O tree: every bridge and PCI device, plus the CPU-side ancestors of host bridges
    nodes: dict[str, PciNode] = {}
    ids: dict[int, str] = {}  # gp_index -> node id

    def node_numa(obj: Any) -> int | None:
        ns = obj.nodeset
        if ns is None:
            return None
        s = list(ns)
        return int(s[0]) if len(s) == 1 else None

    def id_of(obj: Any) -> str:
        gp = int(obj.gp_index)
        if gp in ids:
            return ids[gp]
        if obj.is_bridge():
            down = obj.downstream_pci
            nid = f"{int(down.domain):04x}:[{int(down.secondary_bus):02x}-{int(down.subordinate_bus):02x}]"
            if obj.upstream_type == 0:
                kind, busid = "host_bridge", None
            else:
                up = obj.upstream_pci.attr
                kind, busid = "bridge", _busid(up.domain, up.bus, up.dev, up.func)
        elif obj.is_pci_device():
            a = obj.attr
            nid, kind, busid = _busid(a.domain, a.bus, a.dev, a.func), "device", None
        else:
            name = obj.type.name
            if name == "NUMANODE":
                nid = f"NUMANode:{obj.os_index}"
            else:
                nid = f"{name.title()}:{obj.logical_index}"
            kind, busid = "cpu", None
        while nid in nodes:  # defensive: some exports repeat a bus id
            nid += "'"
        ids[gp] = nid
        parent = obj.parent
        pid = id_of(parent) if parent is not None else None
        numa = node_numa(obj) if kind == "cpu" else None
        nodes[nid] = PciNode(id=nid, kind=kind, parent=pid, busid=busid, numa=numa)  # type: ignore[arg-type]
        return nid

    def io_numa(obj: Any) -> int | None:
        p = obj.parent
        while p is not None and (p.is_bridge() or p.is_pci_device() or p.is_os_device()):
            p = p.parent
        return node_numa(p) if p is not None else None

    for nd in hw.iter_numa_nodes():  # so host placements can count hops from a NUMA node
        id_of(nd)
    for br in hw.iter_bridges():
        id_of(br)

    gpu_rows: list[dict[str, Any]] = []
    nic_rows: list[dict[str, Any]] = []
    for dev in hw.iter_pci_devices():
        nid = id_of(dev)
        a = dev.attr
        vendor, device = int(a.vendor_id), int(a.device_id)
        cls = (int(a.class_id) if hasattr(a, "class_id") else (dev.base_class << 8 | dev.subclass)) & 0xFFFF
        osdevs = [
            (c.name or "", int(c.attr.types) if c.attr is not None else 0)
            for c in dev.iter_io_children()
            if c.is_os_device()
        ]
        info = dev.info
        speed = float(a.linkspeed or 0.0)
        if vendor == _NVIDIA and cls in _GPU_CLASSES:
            cuda = None
            for name, _t in osdevs:
                m = re.fullmatch(r"cuda(\d+)", name)
                if m:
                    cuda = int(m.group(1))
            gpu_rows.append(
                dict(
                    busid=nid,
                    vendor_id=vendor,
                    device_id=device,
                    name=info.get("PCIDevice", ""),
                    numa=io_numa(dev),
                    cuda_ordinal=cuda,
                )
            )
        rdma = [name for name, t in osdevs if t & _OSDEV_OPENFABRICS]
        if rdma:
            kind = "efa" if vendor == _AMAZON else "mlx5" if vendor == _MELLANOX else "other"
            netdevs = tuple(name for name, t in osdevs if t & _OSDEV_NETWORK and not t & _OSDEV_OPENFABRICS)
            for name in rdma:
                nic_rows.append(
                    dict(
                        name=name,
                        busid=nid,
                        vendor_id=vendor,
                        device_id=device,
                        kind=kind,
                        numa=io_numa(dev),
                        link_speed=speed if speed > 0 else None,
                        netdevs=netdevs,
                    )
                )

    pci = tuple(nodes.values())
    children: dict[str, list[PciNode]] = {}
    for n in pci:
        if n.parent is not None:
            children.setdefault(n.parent, []).append(n)

    def links_below(bridge_id: str) -> int:
        """PCIe links below a bridge: child bridges one each, devices once per slot (bus:dev)."""
        slots = set()
        for c in children.get(bridge_id, ()):
            if c.kind in ("bridge", "host_bridge"):
                slots.add(c.id)
            elif c.kind == "device":
                slots.add(c.id.rsplit(".", 1)[0])
        return len(slots)

    def switch_of(dev_id: str) -> str | None:
        child = nodes[dev_id]
        cur = nodes.get(child.parent) if child.parent else None
        while cur is not None and cur.kind in ("bridge", "host_bridge"):
            if links_below(cur.id) >= 2:
                if cur.kind == "host_bridge" and child.kind != "device":
                    return None  # reached through a root port: the path crosses the root complex
                return cur.id
            child, cur = cur, (nodes.get(cur.parent) if cur.parent else None)
        return None

    gpu_rows.sort(key=lambda r: r["busid"])
    gpus = tuple(GPU(index=i, switch=switch_of(r["busid"]), **r) for i, r in enumerate(gpu_rows))
    nic_rows.sort(key=lambda r: (r["busid"], r["name"]))
    nics = tuple(NIC(switch=switch_of(r["busid"]), **r) for r in nic_rows)
    return Topology(gpus=gpus, nics=nics, numa_nodes=numa_nodes, pci=pci, source=source)
