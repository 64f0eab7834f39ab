"""Which job a pod belongs to: its JobSet label, read through the Kubernetes API.

NodePublishVolume only gets the pod's name, namespace and uid (podInfoOnMount);
the label has to be fetched. The lookup is a plain callable so that it can be
replaced: `--pod-labels-file` reads labels from a JSON file instead (tests,
where no API server runs, and clusters where the plugin may not read pods).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

import grpc

JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"

# (namespace, pod name) -> the pod's labels; raises PodLookupError.
PodLabels = Callable[[str, str], Mapping[str, str]]


class PodLookupError(Exception):
    """The labels could not be read; `code` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class KubernetesPodLabels:
    """Reads a pod's labels with the in-cluster service account (needs RBAC `get`
    on pods). The client is made on first use: a plugin whose volumes all name
    their job never needs API access."""

    def __init__(self, timeout: float = 5.0) -> None:
        self.timeout = timeout
        self._api: Any = None
        self._lock = threading.Lock()

    def _core(self) -> Any:
        with self._lock:
            if self._api is None:
                from kubernetes import client, config  # slow import, only when needed

                try:
                    config.load_incluster_config()
                except config.ConfigException as e:
                    raise PodLookupError(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"cannot reach the Kubernetes API to read the pod's {JOBSET_LABEL} "
                        f"label ({e}); give the volume a 'job' attribute instead") from None
                self._api = client.CoreV1Api()
            return self._api

    def __call__(self, namespace: str, name: str) -> Mapping[str, str]:
        from kubernetes.client.exceptions import ApiException

        api = self._core()
        try:
            pod = api.read_namespaced_pod(name, namespace, _request_timeout=self.timeout)
        except ApiException as e:
            code = {404: grpc.StatusCode.NOT_FOUND,
                    403: grpc.StatusCode.PERMISSION_DENIED}.get(e.status,
                                                                grpc.StatusCode.UNAVAILABLE)
            raise PodLookupError(code, f"reading pod {namespace}/{name}: {e.status} "
                                       f"{e.reason}") from None
        except Exception as e:  # connection errors, timeouts: kubelet retries
            raise PodLookupError(grpc.StatusCode.UNAVAILABLE,
                                 f"reading pod {namespace}/{name}: {e}") from None
        return pod.metadata.labels or {}


class FilePodLabels:
    """Labels from a JSON file {"<namespace>/<pod name>": {"label": "value"}}, read
    on every call (so it can change while the plugin runs). A stand-in for the API."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, namespace: str, name: str) -> Mapping[str, str]:
        try:
            with open(self.path) as f:
                pods = json.load(f)
        except (OSError, ValueError) as e:
            raise PodLookupError(grpc.StatusCode.UNAVAILABLE,
                                 f"reading pod labels from {self.path}: {e}") from None
        labels = pods.get(f"{namespace}/{name}")
        if labels is None:
            raise PodLookupError(grpc.StatusCode.NOT_FOUND,
                                 f"pod {namespace}/{name} not found in {self.path}")
        return labels
