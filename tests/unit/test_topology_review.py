"""kvxfer.topology review: argument types, hand-built topologies, the top-up spread, the CLI's
refusals and failed loads, each reproduced on the real exports of tests/data/topologies."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvxfer.errors import ArgumentTypeError, InvalidArgumentError, TopologyError
from kvxfer.topology import GPU, NIC, Core, NumaNode, Topology

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "topologies"
P4D = DATA / "aws-p4d.24xlarge.xml"
P5 = DATA / "aws-p5.48xlarge.xml"
P5EN = DATA / "aws-p5en.48xlarge.xml"
XE8640 = DATA / "dell-xe8640-4xH100-cx7.xml"

pytest.importorskip("pyhwloc")


@pytest.fixture(scope="module")
def xe() -> Topology:
    return Topology.from_xml(XE8640)


@pytest.fixture(scope="module")
def p5() -> Topology:
    return Topology.from_xml(P5)


def users(placements) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for i, p in placements.items():
        for n in p.nics:
            out.setdefault(n.name, set()).add(i)
    return out


# --------------------------------------------------------------------------- argument types


@pytest.mark.parametrize("one", [0, "0000:4e:00.0", "4e:00.0"])
def test_assign_names_a_single_gpu_key_as_a_type_error(xe, one):
    # gpus=0 was a bare TypeError ("'int' object is not iterable"); gpus="4e:00.0" iterated
    # the string and complained that '4' is not a PCI bus id
    with pytest.raises(ArgumentTypeError, match=r"gpus=\["):
        xe.assign(gpus=one)
    with pytest.raises(ArgumentTypeError):
        xe.assign(gpus=xe.gpu(0))
    assert xe.assign(gpus=[one]).keys() == {0}
    assert xe.assign(gpus=(i for i in [0, 1])).keys() == {0, 1}


@pytest.mark.parametrize("bad", [True, False, 3.0, "3", None])
def test_numa_lookup_takes_ints_only(xe, bad):
    # numa(True) was NUMA node 1 and numa(3.0) node 3: bools and floats compared equal to ints
    with pytest.raises(ArgumentTypeError):
        xe.numa(bad)
    if bad is not None:  # assign_host(numa=None) means "pick the node"
        with pytest.raises(ArgumentTypeError):
            xe.assign_host(numa=bad)
    assert xe.numa(np.int64(3)).os_index == 3
    assert xe.assign_host(numa=np.int64(3)).numa == 3


def test_pcie_hops_refuses_non_devices_with_a_kvxfer_error(xe):
    # pcie_hops(0, 1) was an AttributeError ('int' object has no attribute 'strip')
    with pytest.raises(ArgumentTypeError):
        xe.pcie_hops(0, 1)
    with pytest.raises(ArgumentTypeError):
        xe.pcie_hops(xe.gpu(0), None)
    assert xe.pcie_hops(xe.gpu(0), "0000:4d:00.0") == 4


# --------------------------------------------------------------------------- hand-built topologies


def test_hand_built_topology_with_devices_but_no_pcie_tree():
    # plain data in: assign() raised InvalidArgumentError ("not a node of the PCIe tree") where
    # assign_host() on the same topology answers with unknown hops
    node = NumaNode(os_index=0, cores=(Core(0, (0, 1)), Core(1, (2, 3))), cpuset=(0, 1, 2, 3), memory=0)
    gpus = (
        GPU(0, "0000:53:00.0", 0x10DE, 0x2330, "", 0, "sw0"),
        GPU(1, "0000:64:00.0", 0x10DE, 0x2330, "", 0, "sw1"),
    )
    nics = (
        NIC("mlx5_0", "0000:54:00.0", 0x15B3, 0x1021, "mlx5", 0, "sw0"),
        NIC("mlx5_1", "0000:65:00.0", 0x15B3, 0x1021, "mlx5", 0, "sw1"),
    )
    t = Topology(gpus=gpus, nics=nics, numa_nodes=(node,), pci=())
    pl = t.assign()
    assert pl[0].nic_names == ("mlx5_0",) and pl[1].nic_names == ("mlx5_1",)
    assert pl[0].hops == (None,) and "under the GPU's PCIe switch" in pl[0].nic_reason
    assert pl[0].cpus == (0, 1) and pl[1].cpus == (2, 3)
    both = t.assign(nics_per_gpu=2)
    assert both[0].nic_names == ("mlx5_0", "mlx5_1") and both[0].hops == (None, None)
    assert t.assign_host(0).hops == (None, None)


# --------------------------------------------------------------------------- striping


def test_top_up_spreads_extra_nics_instead_of_piling_on_the_lowest_bus_id(p5):
    # p5, 5 NICs per H100: each GPU keeps its own 4 EFA and adds one of the 12 other EFA of its
    # NUMA node (all 10 hops away). Ranked by bus id alone, all four GPUs of a node took
    # the same one (rdmap79s0 served 4 GPUs, rdmap147s0 too) while 11 stayed single.
    pl = p5.assign(nics_per_gpu=5)
    for i, p in pl.items():
        g = p5.gpu(i)
        assert len(p.nics) == 5
        assert [n.switch == g.switch for n in p.nics] == [True] * 4 + [False]
        assert p.nics[4].numa == g.numa and p.hops[4] == 10
    load = sorted(len(u) for u in users(pl).values())
    assert max(load) == 2 and load.count(2) == 8
    # stable: one GPU at a time gives the same slice
    for i in range(8):
        assert p5.assign(gpus=[i], nics_per_gpu=5) == {i: pl[i]}


def test_top_up_still_prefers_nearer_nics_over_less_used_ones():
    p4d = Topology.from_xml(P4D)
    for i, p in p4d.assign(nics_per_gpu=2).items():
        g = p4d.gpu(i)
        assert p.nics[0].switch == g.switch and p.nics[1].numa == g.numa and not p.cross_numa
    p5en = Topology.from_xml(P5EN)
    for i, p in p5en.assign(nics_per_gpu=4).items():  # the other two of its own switch
        assert all(n.switch == p5en.gpu(i).switch for n in p.nics)


# --------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("bad", ["0", "-1", "x"])
def test_cli_refuses_a_bad_nics_per_gpu_before_loading(bad, capsys):
    # was type=int: 0 and -1 loaded the topology, then exited 1 (architecture.md: exit 2)
    from kvxfer.cli import topo as cli

    with pytest.raises(SystemExit) as e:
        cli.main(["--xml", "/nonexistent.xml", "--nics-per-gpu", bad])
    assert e.value.code == 2
    assert "positive integer" in capsys.readouterr().err


# --------------------------------------------------------------------------- loading


def test_a_rejected_document_leaves_no_hwloc_handle_or_root_warning():
    # pyhwloc 3.0.1 cannot destroy a topology whose load() failed: it leaked the handle and its
    # __del__ logged "Topology is not loaded" through the root logger (configuring it)
    code = textwrap.dedent(
        f"""
        import gc, logging
        from kvxfer.topology import Topology
        from kvxfer.errors import TopologyError
        bad = {str(P4D)!r} + ".bad.xml"
        text = ("<?xml version='1.0'?>\\n<topology version='2.0'>\\n  <object type='Machine' os_index='0'"
                " cpuset='0x1' complete_cpuset='0x1' allowed_cpuset='0x1' nodeset='0x1'"
                " complete_nodeset='0x1' allowed_nodeset='0x1'>\\n  </object>\\n</topology>\\n")
        try:
            Topology._from_xml_text(text, "bad.xml")
        except TopologyError as e:
            assert "hwloc rejected" in str(e), e
        else:
            raise SystemExit("loaded")
        gc.collect()
        assert not logging.getLogger().handlers, logging.getLogger().handlers
        print("ok")
        """
    )
    root = pathlib.Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok" and "not loaded" not in r.stderr, r.stderr


def test_utf8_bom_is_accepted(tmp_path):
    # a UTF-8 byte order mark (an export saved by some editors) is well-formed XML: Python's
    # parser took it, hwloc's minimal parser refused it ("hwloc rejected it")
    f = tmp_path / "bom.xml"
    f.write_bytes(b"\xef\xbb\xbf" + P4D.read_bytes())
    t = Topology.from_xml(f)
    assert len(t.gpus) == 8 and len(t.nics) == 4


def test_bad_numa_in_assign_host_is_still_a_value_error(xe):
    with pytest.raises(InvalidArgumentError, match="no NUMA node 8"):
        xe.assign_host(8)
    with pytest.raises(TopologyError):
        xe.assign_host(0, nic_kind="efa")
