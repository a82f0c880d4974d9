"""The fleet simulator (benchmarks/fleet_sim.py), on a small fleet and a short trace."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from benchmarks import fleet_sim


@pytest.fixture(scope="module")
def report():
    return fleet_sim.simulate(pools=5, hours=1.5, seed=3, warmup_hours=0.25)


def test_it_drives_the_operators_own_decision_module():
    assert fleet_sim.scaling.__file__ == str(fleet_sim.ROOT / "deploy" / "operator" / "scaling.py")
    assert sys.modules["scaling"] is fleet_sim.scaling


def test_every_policy_runs_on_the_same_trace_and_reports_its_figures(report):
    names = [result["policy"] for result in report["results"]]
    # The chart's target alone: the default fleet's derived target is the one the chart ships.
    assert names[0] == "static" and names[-1] == "queue" and sum(n.startswith("operator") for n in names) == 1
    requests = {result["requests"] for result in report["results"]}
    assert len(requests) == 1 and requests.pop() > 0
    for result in report["results"]:
        assert result["gpu_hours"] > 0 and result["p50_wait_s"] is not None
        assert result["p50_wait_s"] <= result["p99_wait_s"]
        assert 0 < result["peak_nodes"] <= report["fleet"]["max_nodes"]
    static = report["results"][0]
    # Sized for its peak minute and never scaled: no start, no drop, no queueing to speak of.
    assert static["pod_starts"] == 0 and static["dropped"] == 0 and static["p99_wait_s"] < 1
    assert static["gpu_hours_vs_static"] == 1.0
    assert set(report["goal"]) == set(names[1:-1])
    assert "| static |" in fleet_sim.table(report)


def test_no_request_is_lost_by_the_simulation():
    fleet = fleet_sim.Fleet()
    rng = np.random.default_rng(5)
    pools = fleet_sim.default_pools(3, fleet, rng)
    arrivals = fleet_sim.demand_trace(pools, fleet, 1800, rng)
    static = fleet_sim.static_replicas(arrivals, fleet)
    sim = fleet_sim.Simulation(pools, arrivals, fleet, fleet_sim.OperatorPolicy(pools), initial=static, warmup=0)
    sim.run()
    accounted = sim.wait_histogram.sum() + sim.dropped.sum() + sim.queue.sum()
    assert accounted == pytest.approx(arrivals.sum(), rel=1e-9)


def test_the_simulated_replicaset_deletes_unscheduled_then_not_ready_then_drained_then_newest_pods():
    def pod(name, created, *, scheduled=True, ready=True, drained=False):
        return fleet_sim.Pod(
            name=name,
            pool=0,
            slot=0,
            created=created,
            scheduled=scheduled,
            ready=ready,
            drain_requested_at=1.0 if drained else None,
        )

    pods = [
        pod("old-drained", 1, drained=True),
        pod("newest", 9),
        pod("loading", 5, ready=False),
        pod("waiting-for-a-node", 8, scheduled=False, ready=False),
        pod("old", 2),
    ]
    order = [p.name for p in sorted(pods, key=fleet_sim._deletion_rank)]
    assert order == ["waiting-for-a-node", "loading", "old-drained", "newest", "old"]


def test_a_worker_that_finds_no_free_node_preempts_a_warm_spare_which_then_gets_a_new_node():
    fleet = fleet_sim.Fleet()
    cluster = fleet_sim.Cluster(fleet, pools=2, slots=4)
    inflight = np.zeros((2, 4))
    cluster.set_spares(1, 1, 0)  # pool 1's spare Deployment asks for one placeholder
    (spare,) = cluster.spare_nodes
    cluster.advance(fleet.node_start_seconds, inflight)  # its node is up: the image pull starts
    assert spare.warm_at == fleet.node_start_seconds + fleet.image_pull_seconds
    now = spare.warm_at + 10
    cluster.advance(now, inflight)

    cluster.scale(0, 1, now, inflight)  # a worker of another pool, and no free node

    (pod,) = cluster.pods[0]
    assert pod.node is spare and cluster.spare_takes == 1
    assert pod.ready_at == now + fleet.spare_eviction_seconds + fleet.warm_load_seconds
    # The evicted placeholder is Pending: the autoscaler adds a node for it; both are charged.
    (replacement,) = cluster.spare_nodes
    assert replacement is not spare and replacement.ready_at == now + fleet.node_start_seconds
    assert len(cluster.nodes) == 2 and cluster.new_nodes == 2

    cluster.scale(0, 2, now, inflight)  # the spare's node is not up yet: no warm start there
    second = cluster.pods[0][1]
    cluster.advance(replacement.ready_at, inflight)
    assert second.node is replacement and cluster.spare_nodes[0] is not replacement and len(cluster.nodes) == 3
    assert second.ready_at == replacement.ready_at + fleet.image_pull_seconds + fleet.cold_load_seconds


def test_a_node_a_worker_leaves_goes_to_a_pending_placeholder_before_it_idles():
    fleet = fleet_sim.Fleet(max_nodes=1)
    cluster = fleet_sim.Cluster(fleet, pools=1, slots=4)
    inflight = np.zeros((1, 4))
    cluster.scale(0, 1, 0, inflight)
    cluster.advance(fleet.node_start_seconds, inflight)
    cluster.set_spares(0, 1, 400)  # at the node cap: the placeholder waits
    assert not cluster.spare_nodes
    (pod,) = cluster.pods[0]
    node = pod.node
    cluster.scale(0, 0, 500, inflight)
    assert cluster.spare_nodes == [node] and node.spare and node.idle_since is None
    cluster.advance(500 + fleet.node_idle_removal_seconds, inflight)
    assert cluster.nodes == [node]  # a spare's node is never removed as idle


def test_only_the_operator_keeps_warm_spares_and_they_count_in_its_gpu_hours(report):
    spares = {result["policy"]: result["spare_gpu_hours"] for result in report["results"]}
    assert spares["static"] == spares["queue"] == 0
    for name, hours in spares.items():
        if name.startswith("operator"):
            assert 0 < hours < next(r["gpu_hours"] for r in report["results"] if r["policy"] == name)


def test_the_simulated_operator_runs_the_target_the_chart_ships_which_is_70_percent_of_the_plateau():
    target = fleet_sim.shipped_tokens_target()
    assert target == fleet_sim.VALUES_A10G_TOKENS_TARGET
    assert target == pytest.approx(fleet_sim.Fleet().replica_tokens_per_second * fleet_sim.Fleet().utilisation_target)
    assert fleet_sim.OperatorPolicy([]).name == f"operator ({target:,.0f} tok/s)"


def test_prompts_served_from_the_prefix_cache_shorten_streams_and_raise_the_plateau():
    decode_only = fleet_sim.Fleet()
    uncached = fleet_sim.Fleet(prompt_tokens=1000)
    cached = fleet_sim.Fleet(prompt_tokens=1000, cached_prompt_share=0.8)
    assert decode_only.prefill_seconds == 0 and decode_only.output_share == 1
    # 0.7 x 64 streams x 1,000 tokens at 4,000 tok/s: 11.2 s of others' prefills in a stream's life.
    assert uncached.prefill_seconds == pytest.approx(11.2)
    assert cached.prefill_seconds == pytest.approx(11.2 * 0.2)
    assert (uncached.service_steps > cached.service_steps).all()
    assert (cached.service_steps > decode_only.service_steps).all()
    assert uncached.replica_tokens_per_second < cached.replica_tokens_per_second < decode_only.replica_tokens_per_second
    # The same requests (the demand is stated without prefill) need more replicas the more they prefill.
    rng = np.random.default_rng(4)
    pools = fleet_sim.default_pools(4, decode_only, rng)
    arrivals = fleet_sim.demand_trace(pools, uncached, 3600, np.random.default_rng(4))
    assert (arrivals == fleet_sim.demand_trace(pools, decode_only, 3600, np.random.default_rng(4))).all()
    replicas = [sum(fleet_sim.static_replicas(arrivals, fleet)) for fleet in (decode_only, cached, uncached)]
    assert replicas == sorted(replicas) and replicas[0] < replicas[2]


def test_a_fleet_with_another_plateau_also_runs_the_operator_at_70_percent_of_it_and_at_the_targets_asked():
    fleet = fleet_sim.Fleet(prompt_tokens=1000)
    report = fleet_sim.simulate(pools=3, hours=0.5, seed=2, warmup_hours=0.1, fleet=fleet, tokens_targets=(1500,))
    names = [result["policy"] for result in report["results"]]
    derived = round(fleet.replica_tokens_per_second * fleet.utilisation_target)
    shipped = round(fleet_sim.VALUES_A10G_TOKENS_TARGET)
    assert names[1:-1] == [f"operator ({shipped:,} tok/s)", f"operator ({derived:,} tok/s)", "operator (1,500 tok/s)"]
