"""Delete a Helm release's ModelPools before `helm uninstall` removes the operator.

The chart runs this as a pre-delete hook Job (templates/operator-cleanup-hook.yaml). kopf puts a
finalizer on every ModelPool (it has a timer) and only a running operator takes it off; Helm deletes
the custom resources after the operator Deployment and its RBAC, so without this step the pools stay
Terminating forever and block a reinstall. While the hook runs, the operator still does: it sees the
deletions, stops its timers and releases the pools. Pools still present after --wait-seconds (the
operator is down or crash-looping) get their finalizers removed with a patch, which lets the API
server finish the deletion.

    python deploy/operator/release_cleanup.py --namespace NS --selector LABELS [--wait-seconds 60]

Exit status 0 when no selected ModelPool is left, 1 otherwise (Helm then reports the hook as failed
and stops the uninstall, which can be retried).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence

import kubernetes.client
import kubernetes.config
from kubernetes.client.exceptions import ApiException

GROUP = "hosting.gemma.dev"
VERSION = "v1alpha1"
PLURAL = "modelpools"
KUBE_TIMEOUT_SECONDS = 10


class ModelPools:
    """The namespaced ModelPools a label selector picks, through the official client."""

    def __init__(self, api: kubernetes.client.CustomObjectsApi, *, namespace: str, selector: str) -> None:
        self._api = api
        self._namespace = namespace
        self._selector = selector

    def names(self) -> list[str]:
        listing = self._api.list_namespaced_custom_object(
            GROUP,
            VERSION,
            self._namespace,
            PLURAL,
            label_selector=self._selector,
            _request_timeout=KUBE_TIMEOUT_SECONDS,
        )
        return sorted(item["metadata"]["name"] for item in listing.get("items", []))

    def delete(self, name: str) -> None:
        self._ignore_gone(self._api.delete_namespaced_custom_object, name)

    def drop_finalizers(self, name: str) -> None:
        # A merge patch: finalizers is a plain list there, so [] replaces the whole list.
        self._ignore_gone(
            self._api.patch_namespaced_custom_object,
            name,
            {"metadata": {"finalizers": []}},
            _content_type="application/merge-patch+json",
        )

    def _ignore_gone(self, call: Callable[..., object], name: str, *args: object, **kwargs: object) -> None:
        try:
            call(GROUP, VERSION, self._namespace, PLURAL, name, *args, _request_timeout=KUBE_TIMEOUT_SECONDS, **kwargs)
        except ApiException as exc:
            if exc.status != 404:  # already gone: what we want
                raise


def _wait_until_gone(pools: ModelPools, *, seconds: float, poll_seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while True:
        left = pools.names()
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(min(poll_seconds, max(deadline - time.monotonic(), 0.0)))


def cleanup(pools: ModelPools, *, wait_seconds: float, poll_seconds: float = 1.0) -> list[str]:
    """Delete every selected ModelPool, give the operator `wait_seconds` to release them, then
    remove the finalizers of those left. Returns the names still present at the end."""
    names = pools.names()
    print(f"deleting {len(names)} ModelPool(s): {', '.join(names) or '-'}", flush=True)
    for name in names:
        pools.delete(name)
    left = _wait_until_gone(pools, seconds=wait_seconds, poll_seconds=poll_seconds)
    if not left:
        return []
    print(f"still present after {wait_seconds:g}s, removing their finalizers: {', '.join(left)}", flush=True)
    for name in left:
        pools.drop_finalizers(name)
    # Without finalizers the API server deletes them at once; a short grace for slow API servers.
    return _wait_until_gone(pools, seconds=min(wait_seconds, 10.0), poll_seconds=poll_seconds)


def _load_kube_config() -> None:
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--selector", required=True, help="label selector of the release's ModelPools")
    parser.add_argument("--wait-seconds", type=float, default=60.0, help="how long the operator gets")
    args = parser.parse_args(argv)
    _load_kube_config()
    pools = ModelPools(kubernetes.client.CustomObjectsApi(), namespace=args.namespace, selector=args.selector)
    left = cleanup(pools, wait_seconds=args.wait_seconds)
    if left:
        print(f"ModelPools not deleted: {', '.join(left)}", file=sys.stderr, flush=True)
        return 1
    print("no ModelPool of this release is left", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
