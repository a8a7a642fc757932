"""Real protocol peers for kube_reaper tests: a kubelet pod-resources gRPC server and an Eviction API.

`FakeCluster` holds the pods on the node. `KubeletServer` serves them with the
generated `PodResourcesListerServicer` (pod-resources v1) on a unix socket; it
serves any `PodSource` (an object with `list_response()`), so it also serves
one node's pods of the API server stand-in (`KubeApiStandIn.kubelet_pods(node)`,
whose evictions then take the pods off the kubelet's list);
`ApiServer` is an HTTP server (http.server, in a thread) answering
`POST /api/v1/namespaces/{ns}/pods/{name}/eviction` the way the API server
does: 201 and the pod leaves the node, 404 for a pod it does not know, or what
the test scripted first (429 with Retry-After, 500). Both run in threads, so
the test's event loop only runs the test.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Protocol

import grpc

from services.kube_reaper.proto import podresources_v1_pb2 as pb
from services.kube_reaper.proto import podresources_v1_pb2_grpc as pb_grpc

TOKEN = "reaper-test-token"
_EVICTION_PATH = re.compile(r"^/api/v1/namespaces/([a-z0-9-]+)/pods/([a-z0-9.-]+)/eviction$")


@dataclass
class Container:
    name: str
    #: resource name -> device ids
    devices: dict[str, list[str]]


@dataclass
class EvictionRequest:
    namespace: str
    pod: str
    at: float
    status: int
    body: dict
    authorization: str


class PodSource(Protocol):
    """What the kubelet's pod-resources List answers from: FakeCluster, or a stand-in node's pods."""

    def list_response(self) -> pb.ListPodResourcesResponse: ...


@dataclass
class FakeCluster:
    """Pods on one node, shared by the kubelet and the API server (thread-safe)."""

    pods: dict[tuple[str, str], list[Container]] = field(default_factory=dict)
    #: statuses answered to the next eviction requests before they succeed (e.g. [429, 429, 500]).
    script: list[int] = field(default_factory=list)
    requests: list[EvictionRequest] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, namespace: str, pod: str, resource: str, *device_ids: str, container: str = "main") -> None:
        with self.lock:
            self.pods.setdefault((namespace, pod), []).append(Container(container, {resource: list(device_ids)}))

    def remove(self, namespace: str, pod: str) -> bool:
        with self.lock:
            return self.pods.pop((namespace, pod), None) is not None

    def list_response(self) -> pb.ListPodResourcesResponse:
        with self.lock:
            return pb.ListPodResourcesResponse(
                pod_resources=[
                    pb.PodResources(
                        name=name,
                        namespace=ns,
                        containers=[
                            pb.ContainerResources(
                                name=c.name,
                                devices=[pb.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in c.devices.items()],
                                cpu_ids=[2, 3],
                            )
                            for c in containers
                        ],
                    )
                    for (ns, name), containers in sorted(self.pods.items())
                ]
            )

    def evictions_of(self, namespace: str, pod: str) -> list[EvictionRequest]:
        with self.lock:
            return [r for r in self.requests if (r.namespace, r.pod) == (namespace, pod)]


class _Lister(pb_grpc.PodResourcesListerServicer):
    def __init__(self, cluster: PodSource) -> None:
        self.cluster = cluster
        self.calls = 0

    def List(self, request, context):  # noqa: N802 - the generated servicer's name
        self.calls += 1
        return self.cluster.list_response()


class KubeletServer:
    """The pod-resources v1 service on a unix socket, as the kubelet serves it."""

    def __init__(self, cluster: PodSource, socket: Path) -> None:
        assert len(str(socket)) < 100, f"unix socket path too long: {socket}"
        self.socket = socket
        self.lister = _Lister(cluster)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_PodResourcesListerServicer_to_server(self.lister, self.server)
        self.server.add_insecure_port(f"unix://{socket}")

    def start(self) -> "KubeletServer":
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(grace=None).wait(5)
        self.socket.unlink(missing_ok=True)


class ApiServer:
    """The Eviction subresource of the Kubernetes API, over plain HTTP on loopback."""

    def __init__(self, cluster: FakeCluster) -> None:
        cluster_ref = cluster

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _send(self, code: int, body: dict, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                m = _EVICTION_PATH.match(self.path.split("?")[0])
                if not m:
                    self._send(404, _status(404, "NotFound", f"no route {self.path}"))
                    return
                ns, name = m.group(1), m.group(2)
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    body = {}
                with cluster_ref.lock:
                    if cluster_ref.script:
                        code = cluster_ref.script.pop(0)
                    elif (ns, name) in cluster_ref.pods:
                        code = 201
                    else:
                        code = 404
                    cluster_ref.requests.append(
                        EvictionRequest(ns, name, time.monotonic(), code, body, self.headers.get("Authorization", ""))
                    )
                    if code == 201:
                        cluster_ref.pods.pop((ns, name), None)
                if code == 201:
                    self._send(201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201})
                elif code == 429:
                    self._send(
                        429,
                        _status(429, "TooManyRequests", "Cannot evict pod as it would violate the pod's disruption budget."),
                        {"Retry-After": "1"},
                    )
                elif code == 404:
                    self._send(404, _status(404, "NotFound", f'pods "{name}" not found'))
                else:
                    self._send(code, _status(code, "InternalError", "etcdserver: request timed out"))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="fake-apiserver", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_port}"

    def start(self) -> "ApiServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)

    def write_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig (JSON is YAML) pointing at this server with a bearer token."""
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "test", "cluster": {"server": self.url}}],
                    "users": [{"name": "kube-reaper", "user": {"token": TOKEN}}],
                    "contexts": [{"name": "test", "context": {"cluster": "test", "user": "kube-reaper"}}],
                    "current-context": "test",
                }
            )
        )
        return path


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message, "reason": reason, "code": code}
