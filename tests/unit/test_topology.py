"""kvxfer.topology against five real hwloc exports: the placements a person who knows each
machine expects, CPU sets disjoint and NUMA-local, and clear errors for bad XML."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.errors import InvalidArgumentError, TopologyError, UnsupportedError
from kvxfer.topology import NIC, Core, NumaNode, Placement, Topology
from kvxfer.topology.model import norm_busid as _norm_busid
from kvxfer.topology.rules import _deal

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "topologies"
P4D = DATA / "aws-p4d.24xlarge.xml"
P5 = DATA / "aws-p5.48xlarge.xml"
P5EN = DATA / "aws-p5en.48xlarge.xml"
P6 = DATA / "aws-p6-b200.48xlarge.xml"
XE8640 = DATA / "dell-xe8640-4xH100-cx7.xml"
ALL = [P4D, P5, P5EN, P6, XE8640]

pytest.importorskip("pyhwloc")


# one parse per file per module: the XE8640 export is 226 KB
@pytest.fixture(scope="module")
def topos() -> dict[str, Topology]:
    return {p.name: Topology.from_xml(p) for p in ALL}


@pytest.fixture(scope="module")
def p4d(topos):
    return topos[P4D.name]


@pytest.fixture(scope="module")
def p5(topos):
    return topos[P5.name]


@pytest.fixture(scope="module")
def p5en(topos):
    return topos[P5EN.name]


@pytest.fixture(scope="module")
def p6(topos):
    return topos[P6.name]


@pytest.fixture(scope="module")
def xe(topos):
    return topos[XE8640.name]


def nic_users(placements: dict[int, Placement]) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for i, p in placements.items():
        for n in p.nics:
            out.setdefault(n.name, set()).add(i)
    return out


# --------------------------------------------------------------------------- the test data


def test_data_files_and_notices_are_present():
    for p in ALL:
        assert p.stat().st_size > 10_000
    for p in (P4D, P5, P5EN, P6):  # Apache-2.0 header kept inside each aws-* file
        head = p.read_text()[:600]
        assert "SPDX-License-Identifier: Apache-2.0" in head
    notes = (DATA / "LICENSES.md").read_text()
    assert "LGPL-3.0" in notes and "lgpl-3.0.txt" in notes and "Apache" in notes
    assert "dell-xe8640-4xH100-cx7.xml" in (DATA / "README.md").read_text()


# --------------------------------------------------------------------------- discovery model


@pytest.mark.parametrize(
    "name, n_gpu, n_nic, kinds, n_numa",
    [
        (P4D.name, 8, 4, {"efa"}, 2),
        (P5.name, 8, 32, {"efa"}, 2),
        (P5EN.name, 8, 16, {"efa"}, 2),
        (P6.name, 8, 10, {"efa", "mlx5"}, 2),
        (XE8640.name, 4, 4, {"mlx5"}, 8),
    ],
)
def test_inventory(topos, name, n_gpu, n_nic, kinds, n_numa):
    t = topos[name]
    assert len(t.gpus) == n_gpu
    assert len(t.nics) == n_nic
    assert {n.kind for n in t.nics} == kinds
    assert len(t.numa_nodes) == n_numa
    assert [g.index for g in t.gpus] == list(range(n_gpu))
    assert [g.busid for g in t.gpus] == sorted(g.busid for g in t.gpus)
    for g in t.gpus:
        assert g.vendor_id == 0x10DE and g.numa is not None and g.switch is not None
    for n in t.nics:
        assert n.numa is not None
        assert n.domain() == (f"{n.name}-rdm" if n.kind == "efa" else n.name)
        assert n.provider == ("efa" if n.kind == "efa" else "verbs")


def test_p5_ethernet_only_functions_are_not_rdma_nics(p5):
    # 32 EFA (1d0f:efa1) plus 32 ENA-style netdevs (1d0f:ec20) without an OpenFabrics device
    assert all(n.device_id == 0xEFA1 and n.name.startswith("rdmap") for n in p5.nics)
    assert not any(n.device_id == 0xEC20 for n in p5.nics)


def test_ec2_exports_have_no_cores_but_numa_cpusets(p4d, p5, p5en, p6):
    for t in (p4d, p5, p5en, p6):
        assert not t.has_cpu_info
        assert all(node.cores == () and node.cpuset for node in t.numa_nodes)


def test_xe8640_cores_fold_hyperthreads(xe):
    assert xe.has_cpu_info
    cores = [c for node in xe.numa_nodes for c in node.cores]
    assert len(cores) == 112
    assert all(len(c.pus) == 2 for c in cores)
    pus = [pu for c in cores for pu in c.pus]
    assert sorted(pus) == list(range(224))
    for node in xe.numa_nodes:
        assert len(node.cores) == 14
        assert set(node.cpus) <= set(node.cpuset)


def test_xe8640_cuda_ordinals_come_from_the_export(xe):
    assert {g.busid: g.cuda_ordinal for g in xe.gpus} == {
        "0000:4e:00.0": 0,
        "0000:5f:00.0": 1,
        "0000:cb:00.0": 2,
        "0000:db:00.0": 3,
    }
    assert xe.gpu("0000:cb:00.0").numa == 7
    assert {n.name: n.numa for n in xe.nics} == {"mlx5_0": 3, "mlx5_1": 3, "mlx5_2": 1, "mlx5_3": 5}


def test_pcie_tree_and_hops(p4d, p5, xe):
    g = p5.gpu(0)
    own = [n for n in p5.nics if n.switch == g.switch]
    assert len(own) == 4
    assert {p5.pcie_hops(g, n) for n in own} == {4}  # GPU - port - switch - port - NIC
    other = next(n for n in p5.nics if n.numa == g.numa and n.switch != g.switch)
    assert p5.pcie_hops(g, other) > 4
    assert p5.pcie_hops(g, other) == p5.pcie_hops(other, g)
    assert p4d.pcie_hops(p4d.gpu(0), p4d.nic("rdmap16s27")) == 2  # both on one root bus
    # on the XE8640 the same socket is nearer than the other socket
    cb = xe.gpu("cb:00.0")
    assert xe.pcie_hops(cb, xe.nic("mlx5_3")) < xe.pcie_hops(cb, xe.nic("mlx5_2"))
    # parent links lead from every device to the CPU side
    nodes = {n.id: n for n in xe.pci}
    cur = nodes[cb.busid]
    while cur.parent is not None:
        cur = nodes[cur.parent]
    assert cur.kind == "cpu" and cur.id.startswith("Machine")
    with pytest.raises(InvalidArgumentError):
        xe.pcie_hops("0000:ff:1f.7", cb)


def test_dual_port_functions_count_as_one_link(xe):
    # mlx5_0 / mlx5_1 are functions .0 and .1 behind one switch port: same switch as the GPU
    assert xe.nic("mlx5_0").busid == "0000:4d:00.0" and xe.nic("mlx5_1").busid == "0000:4d:00.1"
    assert xe.nic("mlx5_0").switch == xe.nic("mlx5_1").switch == xe.gpu("4e:00.0").switch


# --------------------------------------------------------------------------- placements per machine


def test_p5_four_efa_under_each_h100_switch(p5):
    pl = p5.assign()
    assert sorted(pl) == list(range(8))
    for i, p in pl.items():
        g = p5.gpu(i)
        assert len(p.nics) == 4
        assert all(n.switch == g.switch and n.numa == g.numa for n in p.nics)
        assert not p.cross_numa and not p.shared
        assert p.numa == g.numa
        assert f"4 EFA under the GPU's PCIe switch {p5.switch_name(g.switch)}" in p.reason
        assert p.domains == tuple(f"{n}-rdm" for n in p.nic_names)
    users = nic_users(pl)
    assert len(users) == 32 and all(len(u) == 1 for u in users.values())


def test_p4d_each_efa_shared_by_the_two_a100s_under_its_switch(p4d):
    pl = p4d.assign()
    users = nic_users(pl)
    assert len(users) == 4
    for name, gpus in users.items():
        nic = p4d.nic(name)
        assert len(gpus) == 2
        assert {p4d.gpu(i).switch for i in gpus} == {nic.switch}
    for p in pl.values():
        assert len(p.nics) == 1 and p.shared and not p.cross_numa
        assert "under the GPU's PCIe switch" in p.nic_reason
        assert p.hops == (2,)


def test_p5en_two_efa_per_h200(p5en):
    pl = p5en.assign()
    for i, p in pl.items():
        g = p5en.gpu(i)
        assert len(p.nics) == 2 and not p.shared and not p.cross_numa
        assert all(n.switch == g.switch for n in p.nics)
    users = nic_users(pl)
    assert len(users) == 16 and all(len(u) == 1 for u in users.values())


def test_p6_one_efa_per_b200_by_default(p6):
    assert p6.default_nic_kind() == "efa"
    pl = p6.assign()
    for i, p in pl.items():
        assert len(p.nics) == 1 and p.nics[0].kind == "efa"
        assert p.nics[0].switch == p6.gpu(i).switch and not p.cross_numa
    users = nic_users(pl)
    assert len(users) == 8 and all(len(u) == 1 for u in users.values())
    assert not any(n.kind == "mlx5" for p in pl.values() for n in p.nics)


def test_p6_connectx_only_on_request(p6):
    pl = p6.assign(nic_kind="mlx5")
    cx = {n.name for n in p6.nics if n.kind == "mlx5"}
    assert cx == {"ibp115s0f0", "ibp116s0f0"}
    assert all(set(p.nic_names) <= cx and len(p.nics) == 1 for p in pl.values())
    cx_switch = p6.nic("ibp115s0f0").switch
    for i, p in pl.items():
        g = p6.gpu(i)
        if g.switch == cx_switch:  # the two B200s beside the ConnectX-7s get one each
            assert "under the GPU's PCIe switch" in p.nic_reason and not p.cross_numa
        elif g.numa == 1:
            assert "nearest ConnectX on NUMA node 1" in p.nic_reason and not p.cross_numa
        else:
            assert p.cross_numa and "cross-NUMA" in p.nic_reason
    under = [p.nics[0].name for i, p in pl.items() if p6.gpu(i).switch == cx_switch]
    assert sorted(under) == sorted(cx)
    assert sorted(len(u) for u in nic_users(pl).values()) == [4, 4]  # balanced


def test_xe8640_gpu_without_local_nic_gets_nearest_remote_one(xe):
    pl = xe.assign()
    cb = xe.gpu("0000:cb:00.0")
    p = pl[cb.index]
    assert p.nic_names == ("mlx5_3",)  # NUMA 5, same socket as NUMA 7
    assert p.cross_numa and p.numa == 7
    assert "another NUMA node (numa 7 → 5)" in p.nic_reason and "cross-NUMA" in p.nic_reason
    assert p.shared  # mlx5_3 is also the NIC of the H100 at db:00.0
    assert pl[xe.gpu("4e:00.0").index].nic_names == ("mlx5_0", "mlx5_1")
    assert pl[xe.gpu("5f:00.0").index].nic_names == ("mlx5_2",)
    assert pl[xe.gpu("db:00.0").index].nic_names == ("mlx5_3",)
    for i, q in pl.items():
        if i != cb.index:
            assert not q.cross_numa and all(n.numa == q.numa for n in q.nics)


def test_xe8640_cpus_disjoint_and_numa_local(xe):
    pl = xe.assign()
    seen: set[int] = set()
    for p in pl.values():
        node = xe.numa(p.numa)
        assert p.cpus and set(p.cpus) <= set(node.cpuset)
        assert len(p.cpus) == 28  # 14 physical cores with both hyperthreads
        assert not seen & set(p.cpus)
        seen |= set(p.cpus)
        assert "cores on NUMA node" in p.cpu_reason


def test_ec2_placements_say_there_is_no_cpu_info(p5):
    for p in p5.assign().values():
        assert p.cpus == ()
        assert "no CPU info" in p.cpu_reason


def test_cpu_split_among_gpus_of_a_node_is_disjoint():
    # the p5 tree with cores grafted on: 4 GPUs per NUMA node share 48 cores x 2 threads
    t = Topology.from_xml(P5)
    nodes = []
    for node in t.numa_nodes:
        base = node.os_index * 48
        cores = tuple(Core(index=base + c, pus=(base + c, base + c + 96)) for c in range(48))
        nodes.append(dataclasses.replace(node, cores=cores))
    t = dataclasses.replace(t, numa_nodes=tuple(nodes))
    pl = t.assign()
    for numa in (0, 1):
        ps = [p for p in pl.values() if p.numa == numa]
        assert len(ps) == 4
        sets = [set(p.cpus) for p in ps]
        assert all(len(s) == 24 for s in sets)  # 12 cores each, both threads
        assert set().union(*sets) == set(t.numa(numa).cpus)
        assert sum(len(s) for s in sets) == len(set().union(*sets))
        assert all("split among 4 GPUs" in p.cpu_reason for p in ps)


# --------------------------------------------------------------------------- arguments


def test_one_gpu_at_a_time_gives_the_same_split(p5en, p4d):
    whole = p5en.assign()
    for i in range(8):
        assert p5en.assign(gpus=[i]) == {i: whole[i]}
    g = p5en.gpu(3)
    assert p5en.assign(gpus=[g.busid])[3] == whole[3]
    assert p5en.assign(gpus=[g])[3] == whole[3]
    assert p4d.assign(gpus=["10:1d.0"]).keys() == {1}


def test_nics_per_gpu(p5, p4d, xe):
    for p in p5.assign(nics_per_gpu=2).values():
        assert len(p.nics) == 2 and all(n.switch == p.gpu.switch for n in p.nics)
    pl = p4d.assign(nics_per_gpu=2)
    for i, p in pl.items():
        g = p4d.gpu(i)
        assert p.nics[0].switch == g.switch  # its own switch first
        assert p.nics[1].numa == g.numa and p.nics[1].switch != g.switch  # then the nearest on its node
        assert not p.cross_numa
    p = xe.assign(nics_per_gpu=8)[0]
    assert len(p.nics) == 4 and "the node has 4" in p.nic_reason


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_nics_per_gpu(p5, bad):
    with pytest.raises(InvalidArgumentError):
        p5.assign(nics_per_gpu=bad)


def test_bad_kind_and_gpu(p5):
    with pytest.raises(InvalidArgumentError):
        p5.assign(nic_kind="ib")  # type: ignore[arg-type]
    with pytest.raises(TopologyError, match="no mlx5 NIC"):
        p5.assign(nic_kind="mlx5")
    with pytest.raises(InvalidArgumentError):
        p5.assign(gpus=[8])
    with pytest.raises(InvalidArgumentError):
        p5.assign(gpus=["0000:ff:00.0"])
    with pytest.raises(InvalidArgumentError):
        p5.assign(gpus=["not-a-bus-id"])
    assert p5.assign(gpus=[]) == {}


def test_busid_forms():
    assert _norm_busid("00000000:53:00.0") == "0000:53:00.0"
    assert _norm_busid("53:00.0") == "0000:53:00.0"
    assert _norm_busid("0001:A8:1F.7") == "0001:a8:1f.7"


# --------------------------------------------------------------------------- host memory


def test_host_placement(xe, p6):
    h = xe.assign_host(3)
    assert h.gpu is None and h.numa == 3 and not h.cross_numa
    assert h.nic_names == ("mlx5_0", "mlx5_1")
    assert h.cpus == xe.numa(3).cpus and len(h.cpus) == 28
    h7 = xe.assign_host(7)
    assert h7.nic_names == ("mlx5_3",) and h7.cross_numa and "cross-NUMA" in h7.nic_reason
    assert set(h7.cpus) <= set(xe.numa(7).cpuset)
    assert xe.assign_host().numa == 3  # the node with the most NICs
    assert xe.assign_host(3, max_nics=1).nic_names == ("mlx5_0",)
    assert p6.assign_host(nic_kind="mlx5").numa == 1
    h0 = p6.assign_host(0)
    assert {n.kind for n in h0.nics} == {"efa"} and all(n.numa == 0 for n in h0.nics)
    assert h0.cpus == () and "no CPU info" in h0.cpu_reason
    with pytest.raises(InvalidArgumentError):
        xe.assign_host(8)
    with pytest.raises(InvalidArgumentError):
        xe.assign_host(0, max_nics=0)


# --------------------------------------------------------------------------- this machine


def test_discover_this_machine():
    t = Topology.discover()
    assert t.numa_nodes and t.source == "this machine"
    assert sum(len(n.cores) for n in t.numa_nodes) >= 1
    assert all(c.pus for n in t.numa_nodes for c in n.cores)
    pl = t.assign()
    assert sorted(pl) == [g.index for g in t.gpus]
    if not t.gpus:
        assert pl == {}
    h = t.assign_host()
    assert h.numa in {n.os_index for n in t.numa_nodes} and h.cpus
    if not t.nics:
        assert h.nics == () and "no RDMA NIC" in h.nic_reason


# --------------------------------------------------------------------------- errors


def test_missing_file(tmp_path):
    with pytest.raises(TopologyError, match="no such file"):
        Topology.from_xml(tmp_path / "absent.xml")
    with pytest.raises(TopologyError, match="cannot read"):
        Topology.from_xml(tmp_path)  # a directory


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "empty"),
        ("garbage", "malformed"),
        ('<topology version="2.0">', "malformed"),  # hwloc's own parser segfaults on this one
        ("<?xml version='1.0'?><html></html>", "root element"),
        ("<?xml version='1.0'?><topology></topology>", "version"),  # hwloc 1.x style
        ("<?xml version='1.0'?><topology version='2.0'></topology>", "no objects"),
        (
            "<?xml version='1.0'?>\n<topology version='2.0'>\n  <object type='Machine' os_index='0' cpuset='0x1'"
            " complete_cpuset='0x1' allowed_cpuset='0x1' nodeset='0x1' complete_nodeset='0x1'"
            " allowed_nodeset='0x1'>\n  </object>\n</topology>\n",
            "hwloc rejected",
        ),
    ],
)
def test_malformed_xml(tmp_path, text, match):
    f = tmp_path / "bad.xml"
    f.write_text(text)
    with pytest.raises(TopologyError, match=match):
        Topology.from_xml(f)


def test_truncated_real_export_is_an_error_not_a_crash(tmp_path):
    f = tmp_path / "cut.xml"
    f.write_bytes(XE8640.read_bytes()[:60_000])
    with pytest.raises(TopologyError):
        Topology.from_xml(f)
    f.write_bytes(b"\xff\xfe" + b"\x00garbage")
    with pytest.raises(TopologyError):
        Topology.from_xml(f)


def test_without_pyhwloc(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyhwloc", None)
    monkeypatch.setitem(sys.modules, "pyhwloc.topology", None)
    with pytest.raises(UnsupportedError, match="pyhwloc"):
        Topology.from_xml(P4D)
    with pytest.raises(UnsupportedError):
        Topology.discover()


def test_import_needs_neither_pyhwloc_nor_the_engine():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["pyhwloc"] = None
        import kvxfer.topology, kvxfer.cli.topo
        assert "kvxfer.engine" not in sys.modules and "kvxfer._fabric" not in sys.modules
        print("ok")
        """
    )
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


# --------------------------------------------------------------------------- plain data


@settings(max_examples=200, deadline=None)
@given(k=st.integers(0, 40), m=st.integers(1, 12))
def test_deal_is_even_and_disjoint(k, m):
    items = list(range(k))
    holders = [f"g{i}" for i in range(m)]
    shares = [_deal(items, holders, h) for h in holders]
    if k >= m:
        assert [x for s in shares for x in s] == items  # contiguous, disjoint, complete
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    elif k:
        assert all(len(s) == 1 for s in shares)
        assert {s[0] for s in shares} == set(items)  # every NIC used, each shared by <= ceil(m/k)
        assert max(sum(1 for s in shares if s[0] == x) for x in items) <= -(-m // k)
    else:
        assert all(s == () for s in shares)


def test_placement_json_roundtrip(xe, p6):
    for t in (xe, p6):
        data = json.loads(json.dumps({i: p.to_dict() for i, p in t.assign().items()}))
        assert all(isinstance(d["nics"], list) and "nic_reason" in d for d in data.values())
        json.dumps(t.to_dict())


def test_dataclasses_are_frozen(xe):
    with pytest.raises(dataclasses.FrozenInstanceError):
        xe.gpus[0].numa = 0  # type: ignore[misc]
    p = xe.assign()[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.cpus = ()  # type: ignore[misc]
    assert hash(p.nics[0]) == hash(dataclasses.replace(p.nics[0]))


def test_nic_domain_names():
    efa = NIC("rdmap16s27", "0000:10:1b.0", 0x1D0F, 0xEFA0, "efa", 0, None)
    cx = NIC("mlx5_0", "0000:4d:00.0", 0x15B3, 0x101B, "mlx5", 3, None)
    assert (efa.domain(), efa.domain("dgram")) == ("rdmap16s27-rdm", "rdmap16s27-dgrm")
    assert (cx.domain(), cx.domain("msg"), cx.domain("dgram")) == ("mlx5_0", "mlx5_0", "mlx5_0-dgram")
    with pytest.raises(InvalidArgumentError):
        efa.domain("msg")


def test_hand_built_topology_without_tree():
    # plain data in, placements out: no pyhwloc object anywhere
    node = NumaNode(os_index=0, cores=(Core(0, (0, 1)), Core(1, (2, 3))), cpuset=(0, 1, 2, 3), memory=0)
    t = Topology(gpus=(), nics=(), numa_nodes=(node,), pci=())
    assert t.assign() == {}
    h = t.assign_host()
    assert h.cpus == (0, 1, 2, 3) and h.nics == () and h.numa == 0


# --------------------------------------------------------------------------- CLI


def test_cli_table_and_json(capsys):
    from kvxfer.cli import topo as cli

    assert cli.main(["--xml", str(XE8640)]) == 0
    out = capsys.readouterr().out
    assert "mlx5_3" in out and "cross-NUMA" in out and "98-111,210-223" in out
    assert cli.main(["--xml", str(P6), "--json", "--nic-kind", "mlx5"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["nic_kind"] == "mlx5" and len(data["placements"]) == 8
    assert {n for p in data["placements"].values() for n in p["nics"]} == {"ibp115s0f0", "ibp116s0f0"}
    assert cli.main(["--xml", str(P5), "--host"]) == 0
    assert "host numa" in capsys.readouterr().out
    assert cli.main(["--xml", "/nonexistent/topo.xml"]) == 1
    assert "no such file" in capsys.readouterr().err


def test_cli_add_parser_and_this_machine():
    import argparse

    from kvxfer.cli import topo as cli

    parser = argparse.ArgumentParser(prog="kvxfer-bench")
    sub = parser.add_subparsers(dest="cmd")
    cli.add_parser(sub)
    args = parser.parse_args(["topo", "--json"])
    assert args.func is cli.run and args.xml is None
    buf = io.StringIO()
    assert args.func(args, out=buf) == 0
    data = json.loads(buf.getvalue())
    assert data["source"] == "this machine"


def test_cpu_ranges():
    from kvxfer.cli.topo import cpu_ranges

    assert cpu_ranges([]) == "-"
    assert cpu_ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert cpu_ranges(range(42, 56)) == "42-55"


# --------------------------------------------------------------------------- CUDA ordinals


def _fake_driver(bus_ids, init_err=0):
    """A stand-in for cuda.bindings.driver with cuda-python's call shapes (tuples of err, value)."""
    import types

    mod = types.ModuleType("cuda.bindings.driver")
    mod.cuInit = lambda flags: (init_err,)
    mod.cuDeviceGetCount = lambda: (0, len(bus_ids))
    mod.cuDeviceGet = lambda i: (0, i)
    mod.cuDeviceGetPCIBusId = lambda n, dev: (0, bus_ids[dev].encode() + b"\x00" * 4)
    return mod


def test_cuda_ordinals_matched_by_bus_id(monkeypatch, xe):
    import types

    from kvxfer.topology.machine import cuda_ordinals as _cuda_ordinals

    pkg, bindings = types.ModuleType("cuda"), types.ModuleType("cuda.bindings")
    # CUDA's own order differs from bus order here: ordinal 0 is the GPU at db:00.0
    drv = _fake_driver(["00000000:DB:00.0", "0000:4e:00.0"])
    bindings.driver = drv
    monkeypatch.setitem(sys.modules, "cuda", pkg)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", drv)
    ords = _cuda_ordinals()
    assert ords == {"0000:db:00.0": 0, "0000:4e:00.0": 1}
    t = xe._with_cuda_ordinals(ords)
    assert t.gpu("db:00.0").cuda_ordinal == 0 and t.gpu("4e:00.0").cuda_ordinal == 1
    assert t.gpu("5f:00.0").cuda_ordinal is None  # hidden from this process (CUDA_VISIBLE_DEVICES)
    # a driver without a device fails cuInit: no ordinals, no error
    drv.cuInit = lambda flags: (100,)
    assert _cuda_ordinals() == {}
    drv.cuInit = lambda flags: (_ for _ in ()).throw(RuntimeError("no CUDA-capable device"))
    assert _cuda_ordinals() == {}
