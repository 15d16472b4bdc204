"""The doctor's judgement on made-up facts, including what a test box cannot produce."""

from dataclasses import replace

import pytest

from profiler.doctor import link_schedule
from profiler.doctor_checks import (
    ComputeTime,
    GroupResult,
    LinkTime,
    RankFacts,
    check_backend,
    check_collectives_stopped,
    check_environment,
    check_groups,
    check_join,
    check_process_group,
    check_settings,
    check_speed,
    check_versions,
    plan_groups,
    ranks_text,
)


def facts(rank, *, node="n0", local_world=4, **kw):
    base = dict(
        rank=rank,
        local_rank=rank % local_world,
        local_world_size=local_world,
        node=node,
        host=node,
        pid=100 + rank,
        versions={"python": "3.11.7", "torch": "2.13.0", "numpy": "2.4.6"},
        backends=("gloo", "nccl"),
        env={"MASTER_ADDR": "10.0.0.1"},
        interfaces=("lo", "eth0", "ib0"),
        cpu_count=64,
        threads=1,
        gpus=8,
    )
    base.update(kw)
    return RankFacts(**base)


def cluster(n=8, per_node=4):
    return [facts(r, node=f"n{r // per_node}", local_world=per_node) for r in range(n)]


def test_ranks_text():
    assert ranks_text([0, 1, 2, 3, 6]) == "0-3, 6"
    assert ranks_text([5, 1]) == "1, 5"
    assert ranks_text([]) == ""


def test_join_all_present_and_missing_ranks():
    fs = {f.rank: f for f in cluster()}
    assert check_join(8, fs, 0.5, "m:1")[0].severity == "ok"
    partial = {r: f for r, f in fs.items() if r != 5}
    (f,) = check_join(8, partial, 60, "m:1")
    assert f.severity == "error" and f.ranks == (5,)
    assert "same node did" in f.message and "n1" in f.message and "log" in f.fix
    node_gone = {r: f for r, f in fs.items() if r < 4}
    (g,) = check_join(8, node_gone, 60, "m:1")
    assert g.ranks == (4, 5, 6, 7) and "all of node #1" in g.message and "m:1" in g.fix


def test_versions_name_the_odd_ranks():
    fs = cluster()
    fs[6] = replace(fs[6], versions={**fs[6].versions, "torch": "2.12.0"})
    fs[2] = replace(fs[2], versions={**fs[2].versions, "numpy": "1.26.0"})
    found = {f.message.split(" ")[0]: f for f in check_versions(fs)}
    assert found["torch"].severity == "error" and found["torch"].ranks == (6,)
    assert "install torch 2.13.0 on n1" in found["torch"].fix
    assert found["numpy"].severity == "warning" and found["numpy"].ranks == (2,)
    assert check_versions(cluster())[0].severity == "ok"


def test_settings_that_differ_between_nodes():
    fs = cluster()
    for r in (4, 5, 6, 7):
        fs[r] = replace(fs[r], env={**fs[r].env, "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "ib"})
    (f,) = check_settings(fs)
    assert f.severity == "warning" and f.ranks == (4, 5, 6, 7)
    assert "NCCL_IB_DISABLE differs" in f.message and "'1' on ranks 4-7 (n1)" in f.message
    assert check_settings(cluster())[0].severity == "ok"


def test_environment_sanity():
    fs = cluster()
    fs[5] = replace(fs[5], env={**fs[5].env, "NCCL_SOCKET_IFNAME": "=eth1"})
    fs[1] = replace(fs[1], env={**fs[1].env, "GLOO_SOCKET_IFNAME": "eth", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    fs[2] = replace(fs[2], env={**fs[2].env, "NCCL_SOCKET_IFNAME": "^docker,lo"})
    found = check_environment(fs, "nccl")
    bad_if = [f for f in found if "matches none" in f.message]
    assert [f.ranks for f in bad_if] == [(5,)] and "eth0" in bad_if[0].fix
    assert any("DETAIL" in f.message and f.ranks == (1,) for f in found)
    loop = [replace(f, env={"MASTER_ADDR": "127.0.0.1"}) for f in cluster()]
    assert any("loopback" in f.message and f.severity == "error" for f in check_environment(loop, "nccl"))
    few_gpus = [replace(f, gpus=2) if f.node == "n1" else f for f in cluster()]
    assert any("sees 2 GPU(s)" in f.message for f in check_environment(few_gpus, "nccl"))
    crowded = [replace(f, cpu_count=2, threads=2) for f in cluster(4, 4)]
    (w,) = check_environment(crowded, "gloo")
    assert "8 compute threads on 2 CPUs" in w.message and "OMP_NUM_THREADS=1" in w.fix
    assert check_environment(cluster(), "nccl")[0].severity == "ok"
    assert check_backend([replace(f, backends=("gloo",)) if f.rank == 3 else f for f in cluster()], "nccl")[
        0
    ].ranks == (3,)


def test_process_group_causes_before_victims():
    found = check_process_group(
        {
            2: "RuntimeError: no such device",
            0: "DistStoreError: wait timeout after 5000ms",
            1: "RuntimeError: Timed out waiting 5000ms",
        },
        False,
        "gloo",
    )
    assert [(f.severity, f.ranks) for f in found] == [("error", (2,)), ("warning", (0, 1))]
    assert "no such device" in found[0].message
    (only,) = check_process_group({0: "timed out"}, False, "gloo")
    assert only.severity == "error" and "no rank reported a cause" in only.message
    assert check_process_group({}, True, "nccl")[0].severity == "ok"


def test_wrong_sums_are_errors():
    ok = GroupResult(name="tp group 0", ranks=(0, 1), wrong_ranks=(), max_error=0.0)
    bad = GroupResult(name="dp group 1", ranks=(1, 3), wrong_ranks=(3,), max_error=2.0)
    assert check_groups([ok])[0].severity == "ok"
    (f,) = check_groups([ok, bad])
    assert f.severity == "error" and f.ranks == (3,) and "dp group 1" in f.message


def test_a_slow_node_and_a_slow_link_are_told_apart():
    fs = {f.rank: f for f in cluster(4, 1)}
    fast, slow = 1e9, 2e7
    links = [
        LinkTime(a=a, b=b, kind="inter", nbytes=1e6, time_s=1e6 / bw)
        for a, b, bw in ((0, 1, fast), (1, 2, fast), (2, 3, slow), (0, 3, slow), (0, 2, fast), (1, 3, slow))
    ]
    (node,) = check_speed(links, [], fs, 0.5)
    assert node.ranks == (3,) and "every inter-node link of rank 3" in node.message
    one = [
        LinkTime(a=a, b=b, kind="intra", nbytes=1e6, time_s=1e6 / bw)
        for a, b, bw in ((0, 1, fast), (1, 2, fast), (2, 3, slow), (0, 3, fast))
    ]
    (link,) = check_speed(one, [], fs, 0.5)
    assert link.ranks == (2, 3) and "link 2<->3" in link.message
    compute = [ComputeTime(rank=r, flops=1e12, time_s=1.0 if r != 2 else 5.0) for r in range(4)]
    (c,) = check_speed([], compute, fs, 0.5)
    assert c.ranks == (2,) and "0.20x the median 1000" in c.message
    even = [LinkTime(a=0, b=1, kind="intra", nbytes=1e6, time_s=1e-3)] * 3
    (ok,) = check_speed(even, compute[:1], fs, 0.5)
    assert ok.severity == "ok" and ok.message == (
        "measured (medians): intra-node links 1 GB/s, compute 1000 GFLOP/s; 3 intra-node links within 0.5x of "
        "their peers; 1 rank not compared (fewer than 3 to compare)"
    )
    (alone,) = check_speed(even[:1], compute[:2], fs, 0.5)
    assert "not compared" in alone.message and "within" not in alone.message


def test_plan_groups_follow_the_mesh_layout():
    g = plan_groups(dp=2, tp=2, pp=2)
    assert g["tp group 0"] == (0, 1) and g["tp group 3"] == (6, 7)
    assert g["dp group 0"] == (0, 2) and g["dp group 1"] == (1, 3)
    assert g["pp group 0"] == (0, 4) and g["pp group 3"] == (3, 7)
    assert len(g) == 4 + 4 + 4
    assert plan_groups(dp=4, tp=1, pp=1) == {"dp group 0": (0, 1, 2, 3)}
    # the mesh is (pp, dp, cp, tp): cp groups are tp apart, dp groups cp x tp apart
    g = plan_groups(dp=2, tp=2, pp=1, cp=2)
    assert g["tp group 0"] == (0, 1) and g["cp group 0"] == (0, 2) and g["dp group 0"] == (0, 4)
    assert len(g) == 4 + 4 + 4


def test_a_collective_that_stops_names_the_ranks_behind_it():
    """Rank 0 failed in the link timing: ranks still in an earlier check, or that never
    recorded one, are where to look."""
    phases = {0: "link timing", 1: "link timing", 2: "matmul timing"}
    (f,) = check_collectives_stopped(phases | {4: "link timing"}, 6, "Timed out", 60)
    assert f.severity == "error" and f.ranks == (2, 3, 5)
    assert f.message == "the link timing failed on rank 0 (Timed out); rank(s) 2, 3, 5 never reached it"
    (f,) = check_collectives_stopped(phases | {2: "link timing"}, 3, "Timed out", 60)
    assert f.ranks == () and "every rank had entered it" in f.message


@pytest.mark.parametrize(
    "nodes",
    [
        ("a",) * 4,
        ("a",) * 3,
        ("a", "a", "b", "b"),
        ("a", "b", "c", "d"),
        ("a", "b"),
        ("a", "a", "a", "a", "b", "b", "b", "b"),
    ],
)
def test_link_schedule_phases_never_share_a_rank(nodes):
    phases = link_schedule(nodes)
    links = [lk for p in phases for lk in p]
    assert len(links) == len(set(links))
    for phase in phases:
        ranks = [r for lk in phase for r in lk]
        assert len(ranks) == len(set(ranks))
    n = len(nodes)
    order = sorted(range(n), key=lambda r: (nodes.index(nodes[r]), r))
    ring = {tuple(sorted((order[i], order[(i + 1) % n]))) for i in range(n)} if n > 2 else {(0, 1)}
    assert ring <= set(links)
    if len(set(nodes)) > 1 and nodes.count("a") == 4:
        assert {(0, 4), (1, 5), (2, 6), (3, 7)} <= set(links)  # every local rank's NIC
