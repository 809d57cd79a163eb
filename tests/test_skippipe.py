"""SkipPipe scheduler and iteration-time simulator (noloco_jax.skippipe)."""

import collections
import warnings

import numpy as np
import pytest

from noloco_jax import skippipe as sp

W = 1.76  # forward seconds per microbatch and stage (SkipPipe's HEAD setting)
MSG = 33.5e6  # activation bytes per message
FACTORIES = {"geo": sp.geo_distributed, "single": sp.single_cluster, "five": sp.five_clusters}


def _net3() -> sp.Network:
    lat = np.full((3, 3), 0.5)
    return sp.Network(("a", "b", "c"), lat, np.full((3, 3), 1e6), np.array([1.0, 2.0, 4.0]))


def _setting(net_name="geo", n=18, s=4, length=3, swaps=True, seed=0):
    net = FACTORIES[net_name](n, forward_s=W, overhead_s=0.35)
    part = sp.partition_nodes(net, sp.default_stage_sizes(n, s), message_bytes=MSG, seed=seed)
    return net, part, sp.PathRules(s, length, allow_swaps=swaps)


# --------------------------------------------------------------------------- simulator


def test_hand_computed_chain():
    # One microbatch 0 -> 1 -> 2 -> 0; every link is 0.5 s latency + 1e6 B / 1e6 B/s.
    link = 0.5 + 1.0
    fwd = 1.0 + link + 2.0 + link + 4.0 + link  # forwards, then back to the head
    loss = 1.0 / 4
    bwd = link + 1.5 * 4.0 + link + 1.5 * 2.0 + link + 1.5 * 1.0  # retrace in reverse
    res = sp.simulate(_net3(), [(0, 1, 2, 0)], memory=1, message_bytes=1e6)
    assert res.makespan_s == pytest.approx(fwd + loss + bwd)  # 26.75 s
    assert [(e.node, e.kind) for e in res.trace] == [
        (0, "forward"), (1, "forward"), (2, "forward"), (0, "loss"),
        (2, "backward"), (1, "backward"), (0, "backward")]  # fmt: skip
    assert res.trace[3].start == pytest.approx(1.0 + link + 2.0 + link + 4.0 + link)


def test_memory_slots_delay_the_next_forward():
    one = sp.simulate(_net3(), [(0, 1, 2, 0)], memory=1, message_bytes=1e6).makespan_s
    two = [(0, 1, 2, 0), (0, 2, 1, 0)]
    serial = sp.simulate(_net3(), two, memory=1, message_bytes=1e6)
    assert serial.makespan_s == pytest.approx(2 * one)  # the head holds one microbatch at a time
    assert serial.max_memory.tolist() == [1, 1, 1]
    overlap = sp.simulate(_net3(), two, memory=2, message_bytes=1e6)
    assert overlap.makespan_s < serial.makespan_s and overlap.max_memory[0] == 2


def test_deadlock_is_reported():
    # Both microbatches hold node 1 / node 2 and wait for the other one's only slot.
    net = sp.Network(("a", "b", "c", "d"), np.zeros((4, 4)), np.full((4, 4), 1e9), np.ones(4))
    with pytest.raises(RuntimeError, match="deadlock"):
        sp.simulate(net, [(0, 1, 2, 0), (3, 2, 1, 3)], memory=1, message_bytes=0.0)


# --------------------------------------------------------------------------- path rules


def test_check_stage_path_rules():
    rules = sp.PathRules(6, 4)
    assert sp.check_stage_path((0, 1, 3, 2), rules) == []  # adjacent swap
    assert sp.check_stage_path((0, 2, 1, 3), rules) == []
    assert any("distance" in v for v in sp.check_stage_path((0, 1, 4, 2), rules))
    assert any("more than once" in v for v in sp.check_stage_path((0, 1, 1, 2), rules))
    assert any("path_length" in v for v in sp.check_stage_path((0, 1, 2), rules))
    assert any("stage 0" in v for v in sp.check_stage_path((1, 0, 2, 3), rules))
    no_swaps = sp.PathRules(6, 4, allow_swaps=False)
    assert any("allow_swaps" in v for v in sp.check_stage_path((0, 1, 3, 2), no_swaps))
    jumpy = sp.PathRules(8, 3, max_jump=3)
    assert any("max_jump" in v for v in sp.check_stage_path((0, 1, 5), jumpy))
    few = sp.PathRules(8, 7, max_swaps=1)
    assert any("max_swaps" in v for v in sp.check_stage_path((0, 2, 1, 4, 3, 5, 6), few))


def test_check_path_closes_at_own_head():
    stage_of = (0, 0, 1, 2)
    rules = sp.PathRules(3, 3)
    assert sp.check_path((0, 2, 3, 0), stage_of, rules, head=0) == []
    assert sp.check_path((0, 2, 3, 1), stage_of, rules)  # ends at another stage-0 node
    assert sp.check_path((1, 2, 3, 1), stage_of, rules, head=0)  # not its own head
    assert sp.check_path((2, 0, 3, 2), stage_of, rules)


def test_check_path_reports_nodes_without_a_stage():
    """A node outside stage_of was a KeyError (mapping) or, as -1 in a sequence, read the last
    node's stage: (0, 2, -1, 0) passed as valid."""
    rules = sp.PathRules(3, 3)
    assert sp.check_path((0, 2, -1, 0), (0, 0, 1, 2), rules) == ["nodes [-1] have no stage in "
                                                                  "stage_of"]  # fmt: skip
    assert sp.check_path((0, 2, 7, 0), {0: 0, 2: 1, 3: 2}, rules) == [
        "nodes [7] have no stage in stage_of"]  # fmt: skip


def test_valid_stage_paths_enumeration():
    assert sp.valid_stage_paths(sp.PathRules(4, 3, allow_swaps=False)) == (
        (0, 1, 2), (0, 1, 3), (0, 2, 3))  # fmt: skip
    assert sp.valid_stage_paths(sp.PathRules(4, 3)) == (
        (0, 1, 2), (0, 1, 3), (0, 2, 1), (0, 2, 3), (0, 3, 2))  # fmt: skip
    assert sp.PathRules(4, 3).skip_ratio == 0.25


# --------------------------------------------------------------------------- schedules

SETTINGS = [("geo", 18, 4, 3, True), ("geo", 18, 4, 2, False), ("single", 20, 6, 4, True),
            ("five", 20, 6, 3, False), ("geo", 24, 8, 6, True)]  # fmt: skip


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(map(str, s)))
def test_every_schedule_obeys_rules_caps_and_memory(setting):
    net, part, rules = _setting(*setting)
    stage_of = sp.stage_of_nodes(part)
    for kind in sp.SCHEDULES:
        sched = sp.make_schedule(kind, net, part, rules, message_bytes=MSG, max_restarts=2)
        check = sp.PathRules(rules.num_stages, rules.num_stages) if kind == "full" else rules
        assert len(sched.paths) == len(part[0]) * 3  # equal work: same microbatches
        heads = collections.Counter(p[0] for p in sched.paths)
        for path in sched.paths:
            assert sp.check_path(path, stage_of, check, head=path[0]) == [], (kind, path)
        if kind != "full":
            assert heads == {h: 3 for h in part[0]}
            visits = collections.Counter(n for p in sched.paths for n in p[1:-1])
            assert max(visits.values()) <= sched.node_cap
            stage_load = collections.Counter(stage_of[n] for p in sched.paths for n in p[1:-1])
            assert max(stage_load.values()) <= sched.stage_cap
        res = sp.simulate(net, sched.paths, memory=3, message_bytes=MSG)
        assert res.max_memory.max() <= 3
        assert sp.memory_from_trace(res.trace, net.num_nodes).max() <= 3
        by_node = collections.defaultdict(list)
        for e in res.trace:
            by_node[e.node].append((e.start, e.end))
        for spans in by_node.values():  # one task at a time per node
            spans.sort()
            assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("kind", sp.SCHEDULES)
def test_schedules_are_deterministic(kind):
    runs = []
    for _ in range(2):
        net, part, rules = _setting("geo", 20, 6, 4, seed=3)
        sched = sp.make_schedule(kind, net, part, rules, message_bytes=MSG, seed=5,
                                 max_restarts=3, time_limit_s=100.0)  # fmt: skip
        res = sp.simulate(net, sched.paths, memory=3, message_bytes=MSG)
        runs.append((part, sched.paths, sched.planned, res.makespan_s, res.trace))
    assert runs[0] == runs[1]


def test_tc2_plans_no_overlapping_tasks_on_a_node():
    net, part, rules = _setting("geo", 20, 6, 4)
    overlaps = {}
    for kind in ("skippipe", "skippipe_no_tc2"):
        sched = sp.make_schedule(kind, net, part, rules, message_bytes=MSG, max_restarts=2)
        by_node = collections.defaultdict(list)
        for iv in sched.planned:
            by_node[iv.node].append(iv)
        overlaps[kind] = 0
        for ivs in by_node.values():
            ivs.sort(key=lambda v: v.start)
            overlaps[kind] += sum(a.end > b.start + 1e-9 and "forward" in (a.kind, b.kind)
                                  for a, b in zip(ivs, ivs[1:]))  # fmt: skip
    assert overlaps["skippipe"] == 0
    assert overlaps["skippipe_no_tc2"] > 0  # without TC2 the plan collides


def test_skipping_beats_the_full_pipeline_geo_smoke():
    net, part, rules = _setting("geo", 18, 4, 3)
    span = {k: sp.simulate(net, sp.make_schedule(k, net, part, rules, message_bytes=MSG,
                                                 max_restarts=3).paths,
                           memory=3, message_bytes=MSG).makespan_s
            for k in sp.SCHEDULES}  # fmt: skip
    assert span["skippipe"] < span["full"] and span["skippipe_no_tc2"] < span["full"]
    assert span["skippipe"] <= span["skippipe_no_tc2"] + 1e-9


def test_partition_and_chains():
    assert sp.default_stage_sizes(18, 4) == (6, 4, 4, 4)
    assert sp.default_stage_sizes(20, 6) == (5, 3, 3, 3, 3, 3)
    assert sp.default_stage_sizes(42, 8) == (7,) + (5,) * 7
    net = sp.geo_distributed(18, forward_s=W)
    part = sp.partition_nodes(net, (6, 4, 4, 4), message_bytes=MSG, seed=1)
    assert part == sp.partition_nodes(net, (6, 4, 4, 4), message_bytes=MSG, seed=1)
    assert sorted(n for p in part for n in p) == list(range(18))
    assert [len(p) for p in part] == [6, 4, 4, 4]
    chains = sp.full_pipeline_chains(net, part, MSG)
    stage_of = sp.stage_of_nodes(part)
    assert len(chains) == 4 and all([stage_of[n] for n in c] == [0, 1, 2, 3] for c in chains)
    assert len({n for c in chains for n in c}) == 16


def test_network_link_costs():
    net = sp.geo_distributed(12, overhead_s=0.1)
    i, j = net.locations.index("australia"), net.locations.index("london")
    far = sp.region_link("australia", "london")
    lat, bw = far.latency_s, far.bytes_per_second
    assert net.link_time(i, j, 1e6) == pytest.approx(lat + 1e6 / bw + 0.1)
    assert net.link_time(i, i, 1e6) == 0.0
    assert net.link(i, j) == far  # one link type with netsim: SI units
    assert 0.08 < lat < 0.2 and bw < 1e8  # far apart: slow
    near = sp.region_link("belgium", "nl")
    assert near.latency_s < 0.01 and near.bytes_per_second > 5e8
    assert np.allclose(net.cost_matrix(1e6), net.cost_matrix(1e6).T)
    assert sp.single_cluster(4).cost_matrix(0.0).max() == pytest.approx(1e-4)
    zero_diagonal = sp.Network(("a", "b"), np.zeros((2, 2)), 1e6 * (1 - np.eye(2)), np.ones(2))
    with warnings.catch_warnings():  # 'divide by zero' on every call, for the unused diagonal
        warnings.simplefilter("error")
        for size in (0.0, 1e6):
            assert np.array_equal(zero_diagonal.cost_matrix(size), size * (1 - np.eye(2)) / 1e6)
    assert set(sp.five_clusters(10).locations) == {"iowa", "germany", "japan", "oregon",
                                                   "singapore"}  # fmt: skip


# --------------------------------------------------------------------------- bad input


def _sched(**kw):
    net, part, rules = _setting("geo", 18, 4, 3)
    args = dict(kind="skippipe", network=net, partition=part, rules=rules, message_bytes=MSG)
    args.update(kw)
    return sp.make_schedule(**args)


def _part_edit(edit):
    """The test setting's partition, changed by ``edit`` (a list of node tuples per stage)."""
    return [tuple(int(n) for n in nodes) for nodes in edit(list(_setting("geo", 18, 4, 3)[1]))]


@pytest.mark.parametrize("call, field", [
    (lambda: sp.PathRules(1, 1), "num_stages"),
    (lambda: sp.PathRules(4, 5), "path_length"),
    (lambda: sp.PathRules(4, 1), "path_length"),
    (lambda: sp.PathRules(4, 3, max_jump=0), "max_jump"),
    (lambda: sp.PathRules(4, 3, max_swaps=-1), "max_swaps"),
    (lambda: sp.geo_distributed(1), "num_nodes"),
    (lambda: sp.geo_distributed(4, forward_s=0.0), "forward_s"),
    (lambda: sp.geo_distributed(4, compute_spread=1.0), "compute_spread"),
    (lambda: sp.geo_distributed(4, overhead_s=-1.0), "overhead_s"),
    (lambda: sp.region_link("mars", "nl"), "a"),
    (lambda: sp.from_locations(["iowa", "mars"]), "locations"),  # was "a must be one of"
    (lambda: sp.Network(("a", "b"), np.zeros((3, 3)), np.ones((2, 2)), np.ones(2)), "latency_s"),
    (lambda: sp.Network(("a", "b"), np.zeros((2, 2)), np.zeros((2, 2)), np.ones(2)),
     "bytes_per_second"),
    (lambda: sp.Network(("a", "b"), np.zeros((2, 2)), np.ones((2, 2)), np.zeros(2)), "compute_s"),
    (lambda: sp.default_stage_sizes(3, 4), "num_nodes"),
    (lambda: sp.default_stage_sizes(3, 1), "num_stages"),
    (lambda: sp.partition_nodes(sp.geo_distributed(6), (3, 2), message_bytes=0), "stage_sizes"),
    (lambda: sp.partition_nodes(sp.geo_distributed(6), (3, 3), message_bytes=0, restarts=0),
     "restarts"),
    (lambda: _sched(kind="random"), "kind"),
    (lambda: _sched(microbatches=0), "microbatches"),
    (lambda: _sched(microbatches=9), "microbatches"),  # more stage visits than capacity
    (lambda: _sched(memory=0), "memory"),
    (lambda: _sched(stage_cap=0), "stage_cap"),
    (lambda: _sched(time_limit_s=0.0), "time_limit_s"),
    (lambda: _sched(max_restarts=0), "max_restarts"),
    (lambda: _sched(rules=sp.PathRules(6, 3)), "partition"),
    (lambda: sp.PathRules(4.5, 2), "num_stages"),  # was accepted, then a TypeError
    (lambda: sp.PathRules(4, 2, max_jump=True), "max_jump"),
    (lambda: _sched(partition=_part_edit(lambda p: [p[0], (), *p[2:]])), "partition"),
    (lambda: _sched(partition=_part_edit(lambda p: [p[0][1:], *p[1:]])), "partition"),
    (lambda: _sched(partition=_part_edit(lambda p: [p[0] + (99,), *p[1:]])), "partition"),
    (lambda: _sched(partition=_part_edit(lambda p: [p[0] + p[1][:1], *p[1:]])), "partition"),
    (lambda: _sched(kind="skippipe_no_tc2", message_bytes=-1e12), "message_bytes"),
    (lambda: _sched(kind="full", message_bytes=float("nan")), "message_bytes"),
    (lambda: sp.simulate(_net3(), [(0, 1, 2, 0)], memory=0, message_bytes=1.0), "memory"),
    (lambda: sp.simulate(_net3(), [(0, 1, 2, 0)], memory=1, message_bytes=-1.0),
     "message_bytes"),
    (lambda: sp.simulate(_net3(), [(0, 1, 2)], memory=1, message_bytes=1.0), "paths"),
    (lambda: sp.simulate(_net3(), [], memory=1, message_bytes=1.0), "paths"),
    # non-integer counts: a TypeError deep inside, or used as fractional caps
    (lambda: _sched(microbatches=2.0), "microbatches"),
    (lambda: _sched(microbatches=True), "microbatches"),
    (lambda: _sched(memory=2.5, microbatches=2), "memory"),
    (lambda: _sched(stage_cap=7.5, microbatches=1), "stage_cap"),
    (lambda: _sched(max_restarts=1.5), "max_restarts"),
    (lambda: sp.simulate(_net3(), [(0, 1, 2, 0)], memory=1.5, message_bytes=1.0), "memory"),
    # message sizes: negative link times were optimised, inf gave an inf makespan
    (lambda: sp.partition_nodes(_net3(), (1, 1, 1), message_bytes=-1e12), "message_bytes"),
    (lambda: sp.partition_nodes(_net3(), (1, 1, 1), message_bytes=float("nan")), "message_bytes"),
    (lambda: sp.full_pipeline_chains(_net3(), ((0,), (1,), (2,)), -1e12), "message_bytes"),
    (lambda: sp.simulate(_net3(), [(0, 1, 0)], memory=1, message_bytes=float("inf")),
     "message_bytes"),
    (lambda: _net3().link_time(0, 1, -1e12), "num_bytes"),
    (lambda: _net3().cost_matrix(-1e12), "num_bytes"),
    # infinite network values: accepted, then net.link raised or the makespan was inf
    (lambda: sp.Network(("a", "b"), np.full((2, 2), np.inf), np.ones((2, 2)), np.ones(2)),
     "latency_s"),
    (lambda: sp.Network(("a", "b"), np.zeros((2, 2)), np.full((2, 2), np.inf), np.ones(2)),
     "bytes_per_second"),
    (lambda: sp.Network(("a", "b"), np.zeros((2, 2)), np.ones((2, 2)), np.array([1.0, np.inf])),
     "compute_s"),
    (lambda: sp.geo_distributed(4, overhead_s=float("inf")), "overhead_s"),
    (lambda: sp.geo_distributed(4, forward_s=float("inf")), "forward_s"),
    (lambda: sp.stage_of_nodes(((0, 2), (3,))), "partition"),  # was KeyError: 1
    (lambda: sp.stage_of_nodes(((0, 1), (1, 2))), "partition"),  # was (0, 1, 1)
    # non-integer counts (a TypeError, or float stage sizes) and node ids (-1: the last node)
    (lambda: sp.partition_nodes(_net3(), (1, 1, 1), message_bytes=0, restarts=1.5), "restarts"),
    (lambda: sp.partition_nodes(_net3(), (1, 1, 1), message_bytes=0, max_sweeps=0.5),
     "max_sweeps"),
    (lambda: sp.partition_nodes(_net3(), (1.5, 1, 1.5), message_bytes=0), "stage_sizes"),  # int()
    (lambda: sp.default_stage_sizes(18.0, 4), "num_nodes"),
    (lambda: sp.geo_distributed(4.0), "num_nodes"),
    (lambda: _net3().link_time(-1, 0, 1.0), "src"),
    (lambda: _net3().link(0, 3), "dst"),
    (lambda: sp.PathRules(4, 4, allow_swaps="no"), "allow_swaps"),  # was truthy: swaps allowed
    # seeds: NumPy's "expected non-negative integer" or SeedSequence's TypeError named none
    (lambda: sp.geo_distributed(4, seed=-1), "seed"),
    (lambda: sp.partition_nodes(_net3(), (1, 1, 1), message_bytes=0, seed=1.5), "seed"),
    (lambda: sp.make_schedule("full", _net3(), ((0,), (1,), (2,)), sp.PathRules(3, 3),
                              message_bytes=0, seed=-1), "seed"),
])  # fmt: skip
def test_bad_input_names_the_field(call, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        call()


@pytest.mark.parametrize("kind", ["skip_agnostic", "skippipe_no_tc2", "skippipe"])
def test_capacity_check_counts_one_visit_per_stage_and_microbatch(kind):
    # Stage 1 has one node (3 slots) and every path visits it: 4 microbatches cannot fit,
    # although all later stages together have 3 + 3 + 15 slots for the 12 visits.
    net = sp.single_cluster(8)
    part, rules = ((0,), (1,), (2,), (3, 4, 5, 6, 7)), sp.PathRules(4, 4, allow_swaps=False)
    with pytest.raises(ValueError, match=r"microbatches must be <= 3\b"):
        sp.make_schedule(kind, net, part, rules, microbatches=4, message_bytes=0.0)
    sched = sp.make_schedule(kind, net, part, rules, microbatches=3, message_bytes=0.0)
    assert len(sched.paths) == 3


@pytest.mark.parametrize("kind", ["skip_agnostic", "skippipe_no_tc2", "skippipe"])
def test_capacity_check_leaves_out_stages_no_path_reaches(kind):
    # path_length 2 with max_jump 4: no path reaches stage 5, so its 9 slots serve nobody.
    # Counting them let microbatches=9 through to a RuntimeError in the planner.
    net = sp.geo_distributed(20)
    part = sp.partition_nodes(net, sp.default_stage_sizes(20, 6), message_bytes=0.0,
                              restarts=1, max_sweeps=0)  # fmt: skip
    rules = sp.PathRules(6, 2)
    with pytest.raises(ValueError, match=r"microbatches must be <= 7\b"):
        sp.make_schedule(kind, net, part, rules, microbatches=9, message_bytes=0.0)
    sched = sp.make_schedule(kind, net, part, rules, microbatches=7, message_bytes=0.0,
                             max_restarts=2)  # fmt: skip
    assert len(sched.paths) == 35 and {p[1] for p in sched.stage_paths} <= {1, 2, 3, 4}
