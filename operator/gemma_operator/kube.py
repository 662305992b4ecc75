"""The operator's Kubernetes API edge: a small JSON client over the official `kubernetes` package.

Everything the operator reads or writes outside kopf's own watch goes through `Kube`: server-side apply of
children (one field manager, conflicts forced so a hand edit is put back), reading pods and their Events,
API discovery for the optional kinds' CRDs (builders.optional.OPTIONAL_KINDS), reading the HPA that scales a
server, and merge patches of the custom resource's status. It never reads Secrets.

It talks raw JSON through the generated client's configured connection (auth, TLS, proxy) instead of the
typed models, because the builders produce plain dicts for any kind, custom ones included.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import kubernetes
import urllib3
from kubernetes.client import ApiClient

from .builders.optional import OPTIONAL_KINDS
from .builders.ownership import FIELD_MANAGER
from .spec import API_GROUP, API_VERSION, KIND, PLURAL

GRS_API_VERSION = f"{API_GROUP}/{API_VERSION}"

# (apiVersion, kind) -> plural resource name, for the kinds the operator touches.
RESOURCES = {
    ("apps/v1", "Deployment"): "deployments",
    ("v1", "Service"): "services",
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaims",
    ("v1", "Pod"): "pods",
    ("v1", "Event"): "events",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("v1", "ConfigMap"): "configmaps",
    (GRS_API_VERSION, KIND): PLURAL,
    **{(row.api_version, row.kind): row.plural for row in OPTIONAL_KINDS},
}


# ApiError.status when no HTTP answer came at all (connection refused or dropped, read timeout).
UNREACHABLE = 0


class ApiError(Exception):
    """A non-2xx answer from the API server, or none (status UNREACHABLE): callers treat both alike, so an
    API server that restarts or loses etcd is the transient trouble that kopf retries soon, not a crash."""

    def __init__(self, status: int, body: str, what: str):
        self.status = status
        self.body = body
        try:
            self.message = json.loads(body).get("message", body)
        except (ValueError, AttributeError):
            self.message = body
        super().__init__(f"{what}: HTTP {status}: {self.message}" if status != UNREACHABLE
                         else f"{what}: {self.message}")


def collection_path(api_version: str, kind: str, namespace: str) -> str:
    """URL path of a namespaced collection (pure)."""
    plural = RESOURCES[(api_version, kind)]
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{namespace}/{plural}"


def load_api_client() -> ApiClient:
    """In-cluster credentials when running in a pod, else the kubeconfig ($KUBECONFIG or ~/.kube/config)."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    return ApiClient()


class Kube:
    """Raw JSON access to the API server (thread-safe: the generated client uses a urllib3 pool)."""

    def __init__(self, api_client: ApiClient | None = None, timeout: float = 20.0, discovery_ttl: float = 60.0):
        self.api = api_client or load_api_client()
        self.timeout = timeout
        self.discovery_ttl = discovery_ttl
        self._discovery: dict[str, tuple[float, bool]] = {}
        self._lock = threading.Lock()

    def request(self, method: str, path: str, body: Any = None, *, query: dict[str, str] | None = None,
                content_type: str = "application/json", accept: str = "application/json") -> dict[str, Any]:
        """One API call; returns the decoded JSON body.

        Raises:
            ApiError: the API server answered outside 2xx, or could not be reached (status UNREACHABLE).
        """
        _, url, headers, _, _ = self.api.param_serialize(
            method=method, resource_path=path, query_params=list((query or {}).items()),
            header_params={"Content-Type": content_type, "Accept": accept}, auth_settings=["BearerToken"])
        try:
            # The generated REST client serialises a dict body itself, for +json and +yaml content types alike.
            resp = self.api.call_api(method, url, header_params=headers, body=body, _request_timeout=self.timeout)
            raw = resp.read()
        except (urllib3.exceptions.HTTPError, OSError) as e:
            # urllib3 has already retried (the client's default Retry); the API server is down or restarting.
            raise ApiError(UNREACHABLE, f"could not reach the API server: {e}", f"{method} {path}") from e
        text = raw.decode() if isinstance(raw, bytes) else (raw or "")
        if not 200 <= resp.status < 300:
            raise ApiError(resp.status, text, f"{method} {path}")
        return json.loads(text) if text else {}

    # -- children --------------------------------------------------------------------------------------

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply `obj` as the operator's field manager, taking over conflicting fields."""
        meta = obj["metadata"]
        path = f"{collection_path(obj['apiVersion'], obj['kind'], meta['namespace'])}/{meta['name']}"
        return self.request("PATCH", path, obj, query={"fieldManager": FIELD_MANAGER, "force": "true"},
                            content_type="application/apply-patch+yaml")

    def delete_if_present(self, api_version: str, kind: str, namespace: str, name: str, *,
                          uid: str | None = None) -> bool:
        """Delete one object (only if its uid is still `uid`, when given); returns False when it did not exist
        (or, with `uid`, was replaced since)."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": uid}} if uid else None
        try:
            self.request("DELETE", f"{collection_path(api_version, kind, namespace)}/{name}", body)
            return True
        except ApiError as e:
            if e.status == 404 or (uid and e.status == 409):
                return False
            raise

    def get_if_present(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """One object, or None when it does not exist."""
        try:
            return self.request("GET", f"{collection_path(api_version, kind, namespace)}/{name}")
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def list_objects(self, api_version: str, kind: str, namespace: str,
                     query: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """The objects of a kind in a namespace (all, or those a label or field selector in `query` picks)."""
        return self.request("GET", collection_path(api_version, kind, namespace), query=query).get("items", [])

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return self.list_objects("v1", "Pod", namespace, {"labelSelector": selector})

    def pod_events(self, namespace: str, uid: str) -> list[dict[str, Any]]:
        """The Events about one pod (field selector on its uid: Events of an older pod of the same name are
        not its own)."""
        return self.list_objects("v1", "Event", namespace, {"fieldSelector": f"involvedObject.uid={uid}"})

    def serves(self, api_version: str) -> bool:
        """Whether the cluster serves `api_version` (discovery, cached for `discovery_ttl` seconds)."""
        now = time.monotonic()
        with self._lock:
            hit = self._discovery.get(api_version)
            if hit and now - hit[0] < self.discovery_ttl:
                return hit[1]
        try:
            self.request("GET", f"/apis/{api_version}")
            ok = True
        except ApiError as e:
            if e.status not in (404, 503):
                raise
            ok = False
        with self._lock:
            self._discovery[api_version] = (now, ok)
        return ok

    def forget(self, api_version: str) -> None:
        """Drop the cached discovery answer for `api_version` (e.g. after a 404 from its endpoint)."""
        with self._lock:
            self._discovery.pop(api_version, None)

    # -- the custom resource ---------------------------------------------------------------------------

    def get_server(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", f"{collection_path(GRS_API_VERSION, KIND, namespace)}/{name}")
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        """JSON merge patch of the status subresource (lists such as conditions are replaced whole)."""
        path = f"{collection_path(GRS_API_VERSION, KIND, namespace)}/{name}/status"
        return self.request("PATCH", path, {"status": status}, content_type="application/merge-patch+json")
