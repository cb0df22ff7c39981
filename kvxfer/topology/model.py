"""The plain frozen dataclasses a topology is made of: cores, NUMA nodes, PCIe tree nodes, GPUs, NICs, placements.

Nothing here touches pyhwloc; :mod:`kvxfer.topology.hwloc` builds these, and the engine
consumes ``Placement``.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Literal

from kvxfer.errors import InvalidArgumentError

__all__ = ["Core", "NumaNode", "PciNode", "GPU", "NIC", "Placement", "NicKind", "NIC_KINDS", "KIND_LABEL",
           "busid", "norm_busid", "maybe_busid"]

NicKind = Literal["efa", "mlx5", "other"]
NIC_KINDS: tuple[str, ...] = ("efa", "mlx5", "other")  # also the tie-break order for the default kind
# how reasons name a kind
KIND_LABEL = {"efa": "EFA", "mlx5": "ConnectX", "other": "RDMA NIC"}
# names for reports when an export lacks hwloc's PCIDevice string (the EC2 ones)
_GPU_MODELS = {
    0x20B0: "A100 SXM4 40GB",
    0x20B2: "A100 SXM4 80GB",
    0x2330: "H100 SXM5 80GB",
    0x2335: "H200 SXM 141GB",
    0x2901: "B200",
}


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


def busid(domain: int, bus: int, dev: int, func: int) -> str:
    """The canonical spelling of a PCI bus id: ``0000:53:00.0``."""
    return f"{domain:04x}:{bus:02x}:{dev:02x}.{func:x}"


_BUSID = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")


def norm_busid(text: str) -> str:
    """``0000:53:00.0``, ``00000000:53:00.0`` and ``53:00.0`` all become ``0000:53:00.0``."""
    m = _BUSID.match(text.strip())
    if not m:
        raise InvalidArgumentError(f"{text!r} is not a PCI bus id (like 0000:53:00.0)")
    dom, bus, dev, fn = m.groups()
    return busid(int(dom or "0", 16), int(bus, 16), int(dev, 16), int(fn, 16))


def maybe_busid(text: str) -> str:
    """A bus id normalised, or any other tree node id unchanged."""
    return norm_busid(text) if _BUSID.match(text.strip()) else text
