"""The hwloc reader: a loaded pyhwloc topology, or an XML export, turned into plain data at once.

How a PCIe switch and PCIe hops are defined (see :mod:`kvxfer.topology`) is decided here,
when the tree is read: every bridge and PCI function is kept (``KEEP_ALL``), so fan-out
counts are true. pyhwloc is imported only when a topology is loaded.

Two definitions
---------------

**PCIe switch of a device.** Walk up from the device through bridges. A bridge with a single
PCIe link below it (a root port, or one downstream port of a switch) is passed: it adds a hop
but nothing shares it. The first bridge with two or more links below it is the switch; child
bridges count one link each, the functions of one multi-function device count once (so the
two ports of the XE8640's ConnectX-6, `4d:00.0` and `4d:00.1`, sit under the same switch as
the H100 beside them, not under their own port). A host bridge is a switch only when the
device sits directly on its root bus: EC2 presents each physical PCIe switch of a p4d as its
own root bus (`0000:10`, `0000:20`, …) holding two A100s, one EFA and NVMe. A device reached
through a root port whose host bridge is the first fan-out has no switch: its traffic crosses
the CPU's root complex. Reasons name a switch by its upstream port's bus id
(`0000:45:00.0`) or as `root bus 0000:10`.

**PCIe hops** between two devices: the number of edges in the I/O tree between them through
their lowest common ancestor. Bridges count, and so do the CPU-side objects a path through
the root complex climbs (host bridge → Group/Package → … → host bridge), so another root
complex costs more than the same switch, and another socket more than another SNC domain of
the same socket. Examples: GPU and EFA behind two ports of one p5 switch: 4; GPU and EFA on
one p4d root bus: 2; the XE8640's H100 on NUMA 7 to `mlx5_3` (NUMA 5, same socket): 12; to
`mlx5_2` (other socket): 16.
"""

from __future__ import annotations

import re
from typing import Any

from kvxfer.errors import TopologyError, UnsupportedError
from kvxfer.topology.model import GPU, NIC, Core, NumaNode, PciNode
from kvxfer.topology.model import busid as make_busid

__all__ = ["import_pyhwloc", "check_xml", "convert", "convert_checked", "release", "Parts"]

#: what the reader returns: gpus, nics, numa_nodes, pci (the fields of a Topology)
Parts = tuple[tuple[GPU, ...], tuple[NIC, ...], tuple[NumaNode, ...], tuple[PciNode, ...]]

_NVIDIA = 0x10DE
_AMAZON = 0x1D0F
_MELLANOX = 0x15B3
_GPU_CLASSES = (0x0300, 0x0302)  # VGA, 3D controller
_OSDEV_NETWORK = 1 << 4
_OSDEV_OPENFABRICS = 1 << 5


def import_pyhwloc() -> tuple[Any, Any]:
    try:
        import pyhwloc
        from pyhwloc.topology import TypeFilter
    except ImportError as e:  # pragma: no cover - pyhwloc is a dependency, but may be absent
        raise UnsupportedError("topology discovery needs pyhwloc (pip install pyhwloc)") from e
    return pyhwloc, TypeFilter


def release(hw: Any) -> None:
    """Destroy a pyhwloc topology, loaded or not (``None`` is ignored).

    pyhwloc 3.0.1's ``destroy()`` refuses a topology whose ``load()`` failed ("Topology is not
    loaded"): the hwloc handle leaked and ``__del__`` logged that refusal through the root
    logger, which configures it. Such a handle is freed here with hwloc's own destroy call.
    """
    if hw is None:
        return
    try:
        if hw.is_loaded:
            hw.destroy()
            return
        hdl = hw.__dict__.get("_hdl")
        if hdl is None:
            return
        from pyhwloc.hwloc import core

        core.topology_destroy(hdl)
        del hw._hdl
    except Exception:  # pragma: no cover - a pyhwloc without these internals: leave it to its __del__
        return


def check_xml(text: str, source: str) -> str:
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


def convert_checked(hw: Any, source: str) -> Parts:
    """``convert``, with hwloc objects it cannot read reported as ``TopologyError``."""
    try:
        return convert(hw, source)
    except (AttributeError, TypeError, ValueError, KeyError) as e:
        raise TopologyError(f"topology {source!r}: cannot interpret hwloc's objects: {e}") from e


def convert(hw: Any, source: str) -> Parts:
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
                kind, busid = "bridge", make_busid(up.domain, up.bus, up.dev, up.func)
        elif obj.is_pci_device():
            a = obj.attr
            nid, kind, busid = make_busid(a.domain, a.bus, a.dev, a.func), "device", None
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
    return gpus, nics, numa_nodes, pci
