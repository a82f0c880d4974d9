"""The pool scaler's configuration and its small Kubernetes adapters (deploy/operator/poolscaler.py)."""

from __future__ import annotations

import kubernetes.client as k8s
import pytest
from poolscaler import Config, ConfigError, label_selector, pod_view, set_condition

ENV = {"CONTROL_PLANE_URL": "http://gemma-web:8000/", "OPERATOR_TOKEN": "s3cret"}


def test_the_configuration_comes_from_the_environment():
    config = Config.from_env({**ENV, "POOLSCALER_DEMAND_TIMEOUT_SECONDS": "2.5"})
    assert config.control_plane_url == "http://gemma-web:8000"
    assert config.token == "s3cret"
    assert config.demand_timeout_seconds == 2.5
    assert config.stale_drain_grace_seconds == 60.0


def test_the_token_can_come_from_a_mounted_secret_file(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("from-the-secret\n")
    config = Config.from_env({"CONTROL_PLANE_URL": ENV["CONTROL_PLANE_URL"], "OPERATOR_TOKEN_FILE": str(token_file)})
    assert config.token == "from-the-secret"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OPERATOR_TOKEN": "s3cret"}, "CONTROL_PLANE_URL must be an http"),
        ({**ENV, "CONTROL_PLANE_URL": "gemma-web:8000"}, "CONTROL_PLANE_URL must be an http"),
        ({"CONTROL_PLANE_URL": "http://gemma-web"}, "OPERATOR_TOKEN"),
        ({**ENV, "OPERATOR_TOKEN": "", "OPERATOR_TOKEN_FILE": "/nonexistent/token"}, "cannot be read"),
        ({**ENV, "POOLSCALER_DEMAND_TIMEOUT_SECONDS": "soon"}, "must be a number of seconds"),
        ({**ENV, "POOLSCALER_RETRY_SECONDS": "0"}, "must be > 0"),
    ],
)
def test_a_bad_setting_is_named_at_start(env, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_env(env)


def test_a_deployment_selector_becomes_a_label_selector_string():
    selector = k8s.V1LabelSelector(
        match_labels={"b": "2", "a": "1"},
        match_expressions=[
            k8s.V1LabelSelectorRequirement(key="tier", operator="In", values=["gpu", "big"]),
            k8s.V1LabelSelectorRequirement(key="canary", operator="DoesNotExist"),
        ],
    )
    assert label_selector(selector) == "a=1,b=2,tier in (gpu,big),!canary"


def test_a_pod_view_reads_readiness_termination_and_the_drain_mark():
    pod = k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(
            name="w-a", annotations={"hosting.gemma.dev/drain-requested-at": "1970-01-01T00:01:40.000Z"}
        ),
        status=k8s.V1PodStatus(phase="Running", conditions=[k8s.V1PodCondition(type="Ready", status="True")]),
    )
    view = pod_view(pod)
    assert (view.name, view.ready, view.terminating, view.drain_requested_at) == ("w-a", True, False, 100.0)
    finished = k8s.V1Pod(metadata=k8s.V1ObjectMeta(name="w-b"), status=k8s.V1PodStatus(phase="Failed"))
    assert pod_view(finished).terminating and not pod_view(finished).ready


def test_a_pod_view_reads_whether_the_pod_is_on_a_node_and_its_phase():
    waiting = k8s.V1Pod(metadata=k8s.V1ObjectMeta(name="w-c"), status=k8s.V1PodStatus(phase="Pending"))
    assert (pod_view(waiting).scheduled, pod_view(waiting).phase) == (False, "Pending")
    placed = k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name="w-d"),
        spec=k8s.V1PodSpec(node_name="gpu-node-1", containers=[]),
        status=k8s.V1PodStatus(phase="Running"),
    )
    assert (pod_view(placed).scheduled, pod_view(placed).phase) == (True, "Running")


def test_a_condition_keeps_its_transition_time_until_its_status_flips():
    first = set_condition([], "Ready", True, "Reconciled", "steady", now=100.0)
    again = set_condition(first, "Ready", True, "Reconciled", "scale up 1 -> 2", now=200.0)
    flipped = set_condition(again, "Ready", False, "ControlPlaneUnavailable", "down", now=300.0)
    assert again[0]["lastTransitionTime"] == first[0]["lastTransitionTime"]
    assert again[0]["message"] == "scale up 1 -> 2"
    assert flipped[0]["lastTransitionTime"] == "1970-01-01T00:05:00.000Z"
    assert [c["type"] for c in set_condition(flipped, "Draining", False, "Idle", "", now=300.0)] == [
        "Ready",
        "Draining",
    ]
