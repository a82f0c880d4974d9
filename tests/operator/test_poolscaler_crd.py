"""The ModelPool CRD (helm/gemma-platform/crds/modelpools.yaml) and the operator agree."""

from __future__ import annotations

import dataclasses
import pathlib

import yaml
from poolscaler import GROUP, PLURAL, VERSION
from scaling import PoolSpec, PoolState

CRD = yaml.safe_load(
    (pathlib.Path(__file__).resolve().parents[2] / "helm/gemma-platform/crds/modelpools.yaml").read_text()
)
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
SPEC_FIELDS = SCHEMA["properties"]["spec"]["properties"]


def test_the_crd_serves_the_resource_the_operator_watches():
    assert CRD["spec"]["group"] == GROUP
    assert CRD["spec"]["names"]["plural"] == PLURAL
    assert CRD["spec"]["names"]["kind"] == "ModelPool"
    assert CRD["spec"]["scope"] == "Namespaced"
    assert [v["name"] for v in CRD["spec"]["versions"]] == [VERSION]
    assert CRD["spec"]["versions"][0]["subresources"] == {"status": {}}


def test_the_operator_reads_every_spec_field_of_the_crd_with_the_same_defaults():
    minimal = {name: "x" for name in ("model", "pool", "gpuKind", "workerDeployment")} | {"maxReplicas": 2}
    parsed = PoolSpec.from_spec(minimal)
    camel = {
        field.name: "".join(w.title() if i else w for i, w in enumerate(field.name.split("_")))
        for field in dataclasses.fields(PoolSpec)
    }
    assert set(camel.values()) == set(SPEC_FIELDS)
    for attribute, name in camel.items():
        if "default" in SPEC_FIELDS[name]:
            assert getattr(parsed, attribute) == SPEC_FIELDS[name]["default"], name


def test_the_status_schema_holds_everything_the_operator_records():
    recorded = set(PoolState().to_status()) | {
        "observedGeneration",
        "replicas",
        "desiredReplicas",
        "spareReplicas",
        "lastDemand",
        "conditions",
    }
    assert recorded == set(SCHEMA["properties"]["status"]["properties"])
