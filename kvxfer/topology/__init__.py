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
"""

from __future__ import annotations

from kvxfer.topology.machine import Topology
from kvxfer.topology.model import GPU, NIC, NIC_KINDS, Core, NicKind, NumaNode, PciNode, Placement

__all__ = ["Topology", "Placement", "GPU", "NIC", "NumaNode", "Core", "PciNode", "NicKind", "NIC_KINDS"]
