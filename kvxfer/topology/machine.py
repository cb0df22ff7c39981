"""``Topology``: one machine's GPUs, RDMA NICs, NUMA nodes and PCIe tree, as plain data with lookups.

Built by :meth:`Topology.discover` (this machine) or :meth:`Topology.from_xml` (an hwloc
export); placements come from :mod:`kvxfer.topology.rules` through :meth:`Topology.assign`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

from kvxfer import _cuda
from kvxfer._check import is_int
from kvxfer.errors import ArgumentTypeError, InvalidArgumentError, TopologyError
from kvxfer.topology import rules
from kvxfer.topology.hwloc import Parts, check_xml, convert_checked, import_pyhwloc, release
from kvxfer.topology.model import GPU, NIC, NIC_KINDS, NicKind, NumaNode, PciNode, Placement, maybe_busid, norm_busid

__all__ = ["Topology", "cuda_ordinals"]


def cuda_ordinals() -> dict[str, int]:
    """Bus id -> CUDA ordinal from cuda-python's driver API; {} without cuda-python or a GPU."""
    return {norm_busid(bus): i for bus, i in _cuda.device_bus_ids().items()}


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
        hwloc, type_filter = import_pyhwloc()
        hw = None
        try:
            hw = hwloc.Topology.from_this_system()
            hw.set_io_types_filter(type_filter.KEEP_ALL)
            hw.load()
        except Exception as e:  # pyhwloc raises ValueError / HwLocError
            release(hw)
            raise TopologyError(f"hwloc could not load this machine's topology: {e}") from e
        try:
            topo = cls._from_parts(convert_checked(hw, "this machine"), "this machine")
        finally:
            release(hw)
        ordinals = cuda_ordinals()
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
            with open(path, encoding="utf-8-sig") as f:  # -sig: a byte order mark, which hwloc refuses
                text = f.read()
        except FileNotFoundError as e:
            raise TopologyError(f"topology XML {path!r}: no such file") from e
        except (OSError, UnicodeDecodeError) as e:
            raise TopologyError(f"topology XML {path!r}: cannot read: {e}") from e
        return cls._from_xml_text(text, os.path.basename(path))

    @classmethod
    def _from_parts(cls, parts: Parts, source: str) -> Topology:
        gpus, nics, numa_nodes, pci = parts
        return cls(gpus=gpus, nics=nics, numa_nodes=numa_nodes, pci=pci, source=source)

    @classmethod
    def _from_xml_text(cls, text: str, source: str) -> Topology:
        text = check_xml(text, source)
        hwloc, type_filter = import_pyhwloc()
        hw = None
        try:
            hw = hwloc.Topology.from_xml_buffer(text)
            hw.set_io_types_filter(type_filter.KEEP_ALL)
            hw.load()
        except Exception as e:
            release(hw)
            raise TopologyError(f"topology XML {source!r}: hwloc rejected it: {e}") from e
        try:
            return cls._from_parts(convert_checked(hw, source), source)
        finally:
            release(hw)

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
        if not (is_int(key) or isinstance(key, str)):
            raise InvalidArgumentError(f"a GPU is named by index, bus id or GPU, not {key!r}")
        if not isinstance(key, str):
            key = int(key)
            if not 0 <= key < len(self.gpus):
                raise InvalidArgumentError(f"GPU index {key} out of range: {len(self.gpus)} GPUs in {self.source}")
            return self.gpus[key]
        bus = norm_busid(key)
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
        """A NUMA node by os index (an int or numpy integer, never a bool)."""
        if not is_int(os_index):
            raise ArgumentTypeError(f"a NUMA node is named by its os index, an int, not {os_index!r}")
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
        for x in (a, b):
            if not isinstance(x, (str, GPU, NIC)):
                raise ArgumentTypeError(f"pcie_hops takes GPUs, NICs or PCIe tree node ids, not {x!r}")
        ida = a.busid if isinstance(a, (GPU, NIC)) else maybe_busid(a)
        idb = b.busid if isinstance(b, (GPU, NIC)) else maybe_busid(b)
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

    # ---- placement (the rules live in kvxfer.topology.rules)

    def default_nic_kind(self) -> NicKind | None:
        """The NIC kind placements use unless told: the most numerous kind on the node (the
        data fabric; the few others are front-end or storage NICs), ties going efa, mlx5, other."""
        return rules.default_nic_kind(self)

    def assign(
        self,
        gpus: Iterable[int | str | GPU] | None = None,
        nics_per_gpu: int | None = None,
        nic_kind: NicKind | None = None,
    ) -> dict[int, Placement]:
        """Placements for ``gpus`` (default: all), keyed by GPU index; see :func:`kvxfer.topology.rules.assign`."""
        return rules.assign(self, gpus, nics_per_gpu, nic_kind)

    def assign_host(
        self, numa: int | None = None, nic_kind: NicKind | None = None, max_nics: int | None = None
    ) -> Placement:
        """Placement for host memory on NUMA node ``numa``; see :func:`kvxfer.topology.rules.assign_host`."""
        return rules.assign_host(self, numa, nic_kind, max_nics)

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
