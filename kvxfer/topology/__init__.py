"""Which NICs and CPUs should drive each GPU's KV transfers, and why (a package that never imports the engine).

hwloc (through pyhwloc) describes the machine; :mod:`~kvxfer.topology.hwloc` turns its
objects into the plain frozen dataclasses of :mod:`~kvxfer.topology.model` at once, so the
placement rules (:mod:`~kvxfer.topology.rules`), the engine and the tests never touch a
pyhwloc object. ``import kvxfer.topology`` works without pyhwloc: it is imported only by
:meth:`Topology.discover` and :meth:`Topology.from_xml`. CUDA ordinals come from
:mod:`kvxfer._cuda` when cuda-python and a driver answer.

Vocabulary:

* A **PCIe switch** of a device is the nearest bridge above it where PCIe links fan out:
  walking up from the device, single-link bridges (root ports, a switch's downstream ports)
  are passed, and the first bridge with two or more links below it (child bridges count one
  each, a multi-function device counts once) is the switch. A host bridge counts only when
  the device sits directly on its root bus (how EC2 presents each physical switch of a p4d);
  reached through a root port, the device has no switch.
* **PCIe hops** between two devices: edges in hwloc's tree between them through their lowest
  common ancestor; bridges count, and so do the CPU-side objects (Group, Package, Machine)
  that a path through the root complex climbs, so crossing a socket costs more.

Discovery model
---------------

`Topology.discover()` loads this machine, `Topology.from_xml(path)` an hwloc 2.x/3.x XML
export (`lstopo --of xml`). Both load with `set_io_types_filter(KEEP_ALL)`, so every bridge
and PCI function appears (filtering would change the fan-out counts that define a switch),
and both turn the pyhwloc objects into plain frozen dataclasses before returning (and free the
hwloc topology, also when its load failed). Nothing outside `hwloc.py` sees a pyhwloc object;
pyhwloc is imported only when these two methods run, so `import kvxfer.topology` works
without it (`UnsupportedError` if it is missing when needed). A hand-built `Topology` (plain
dataclasses, `pci=()`) places too: its hops are `None` and the switch ids decide.

| dataclass | what | found by |
|---|---|---|
| `GPU` | `index` (bus-id order, as nvidia-smi), `busid`, `vendor_id`, `device_id`, `name`, `numa`, `switch`, `cuda_ordinal` | PCI class 0x0300/0x0302 and vendor 0x10de; not by OS devices, which EC2 exports lack |
| `NIC` | `name` (OpenFabrics device: `rdmap16s27`, `mlx5_0`, `ibp115s0f0`), `busid`, `kind` (`efa` / `mlx5` / `other`), `numa`, `switch`, `link_speed` (PCIe GB/s, None when unknown), `netdevs` | a PCI function with an OpenFabrics OS device below it. Kind by vendor: 0x1d0f → efa, 0x15b3 → mlx5. An Ethernet-only function (the 32 `1d0f:ec20` netdevs of a p5) has no OpenFabrics device and is not a NIC. A dual-port card is two NICs (two functions) |
| `NumaNode` | `os_index`, `cores` (physical `Core`s, each with the os indexes of its hyperthreads), `cpuset`, `memory` | hwloc NUMA nodes; a core belongs to the node whose cpuset holds its PUs |
| `PciNode` | `id`, `kind` (`device`, `bridge`, `host_bridge`, `cpu`), `parent`, `busid`, `numa` | every bridge and PCI function, linked by `parent` up through the host bridge to the CPU-side objects (Group, Package, Machine) and the NUMA nodes |

* **NUMA node of a device**: the nodeset of its first non-I/O ancestor, when that holds
  exactly one node (else `None`).
* **CUDA ordinal**: `cudaN` OS devices in the export give N (the XE8640 export has them). In
  `discover()`, when cuda-python (`cuda.bindings.driver`, or the older `cuda.cuda`) imports and
  `cuInit` succeeds, its bus-id → ordinal map replaces that (a GPU it does not list, hidden by
  `CUDA_VISIBLE_DEVICES`, gets `None`). Every failure leaves ordinals `None`; cuda-python is an
  optional extra, never required.
* **No GPU, no NIC** (this CI machine): `discover()` returns empty `gpus`/`nics`, real NUMA
  nodes and cores; `assign()` returns `{}`.
* **No cores**: the EC2 exports have NUMA cpusets but no Core/PU objects. Cores stay empty and
  placements carry `cpus=()` with the reason "no CPU info: the topology has no Core/PU objects"
  rather than guessing hyperthread pairs from a cpuset.

What the engine consumes
------------------------

`Placement` holds `nics` (NIC objects, best first), `hops` (parallel), `cpus` (PU os indexes to
pin each NIC's progress thread to), `numa`, `cross_numa`, `shared`, and `nic_reason`,
`cpu_reason` (`reason` joins them); `gpu` is `None` for host placements. The NIC's OpenFabrics
name maps to a libfabric domain name by provider:

| kind | provider | `NIC.domain("rdm")` | other endpoint types |
|---|---|---|---|
| efa | `efa` | `rdmap16s27-rdm` | `domain("dgram")` → `rdmap16s27-dgrm` |
| mlx5, other | `verbs` (RDM via `ofi_rxm`) | `mlx5_0` | `domain("msg")` → `mlx5_0`, `domain("dgram")` → `mlx5_0-dgram` |

`Placement.domains` lists the RDM names; the engine matches them against
`fi_info.domain_attr.name` to open one domain and endpoint per NIC:
`Engine(provider, placement=p)` opens one rail per name in `p.domains` and pins every rail's
progress thread to `p.cpus` (`Engine(nics=[...], cpus=[...])` says the same by hand); see
"Writes: the message rule" for how pages are striped over the rails.

Errors
------

`from_xml` raises `TopologyError` for a missing or unreadable file, an empty, non-well-formed
or non-`<topology>` document, hwloc 1.x XML (no `version`), or a document hwloc rejects.
Well-formedness is checked with Python's parser first: hwloc's minimal XML parser, the one
pyhwloc 3.0.1 bundles, crashes the process (SIGSEGV) on some truncated files, and it refuses
XML comments, which are stripped (the EC2 exports carry an SPDX comment header), and a UTF-8
byte order mark, which is dropped when the file is read. Unknown GPU,
NIC kind, NUMA node or a non-positive `nics_per_gpu` raise `InvalidArgumentError`; a value
of the wrong type (one GPU key where `assign` takes a list of them, a bool or float NUMA
node, an int given to `pcie_hops`) raises `ArgumentTypeError`, which is both that and a
`TypeError`. A NIC kind the node lacks is a `TopologyError`.

Not done (yet)
--------------

* NIC line rate (100/200/400 Gb/s) is not in hwloc exports; `link_speed` is the PCIe link.
* The NUMA latency matrix (present in the XE8640 export) is not used; tree hops already prefer
  the same socket there.
* NVLink/NVSwitch topology does not enter NIC choice (it matters for GPU-to-GPU, not GPU-to-NIC).
* `assign_host()` takes the buffer's NUMA node as an argument; finding it from an address
  (`get_area_membind`) is left to the buffers layer.
"""

from __future__ import annotations

from kvxfer.topology.machine import Topology
from kvxfer.topology.model import GPU, NIC, NIC_KINDS, Core, NicKind, NumaNode, PciNode, Placement

__all__ = ["Topology", "Placement", "GPU", "NIC", "NumaNode", "Core", "PciNode", "NicKind", "NIC_KINDS"]
