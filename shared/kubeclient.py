"""Kubernetes API credentials for bcd's services: one way to load them.

The kube_reaper (evictions) and the DRA plugin (claims, nodes, ResourceSlices) both talk
to the API server through kubernetes_asyncio with the same choice of credentials: the
in-cluster service account when asked (`true`) or, with `auto`, when the pod's
environment names an API server and no kubeconfig was given; a kubeconfig otherwise
(the given file, else $KUBECONFIG, else ~/.kube/config). A failure to load them is one
`KubeCredentialsError` whose text says what was wrong, for the caller to report in its
own terms (an unavailable evictor, an API error of status 0).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any


class KubeCredentialsError(Exception):
    """The credentials could not be loaded; the text is one line saying why."""


def in_cluster_available(environ: dict[str, str] | None = None) -> bool:
    """The process runs in a pod: the API server's service host and port are in the environment."""
    env = os.environ if environ is None else environ
    return bool(env.get("KUBERNETES_SERVICE_HOST")) and bool(env.get("KUBERNETES_SERVICE_PORT"))


def use_in_cluster(in_cluster: str, kubeconfig: Path | None, environ: dict[str, str] | None = None) -> bool:
    """`--in-cluster true|false|auto`: auto is the service account in a pod given no kubeconfig."""
    if in_cluster == "true":
        return True
    if in_cluster == "false" or kubeconfig is not None:
        return False
    return in_cluster_available(environ)


async def load_api_client(kubeconfig: Path | None, in_cluster: str) -> tuple[Any, str]:
    """(a kubernetes_asyncio ApiClient, where its credentials came from: "in-cluster service
    account (https://...)" or "kubeconfig PATH (https://...)"); KubeCredentialsError otherwise."""
    import yaml  # kubernetes_asyncio's own dependency: it parses the kubeconfig with it
    from kubernetes_asyncio import client, config

    try:
        if use_in_cluster(in_cluster, kubeconfig):
            configuration = client.Configuration()
            config.load_incluster_config(client_configuration=configuration)
            api_client = client.ApiClient(configuration)
            source = "in-cluster service account"
        else:
            path = str(kubeconfig) if kubeconfig else None
            api_client = await config.new_client_from_config(config_file=path, persist_config=False)
            source = f"kubeconfig {path or os.environ.get('KUBECONFIG') or '~/.kube/config'}"
    except (config.ConfigException, yaml.YAMLError, OSError, ValueError, TypeError, KeyError) as exc:
        # (a kubeconfig that is not YAML raised yaml's ParserError past both services' handlers)
        why = " ".join(str(exc).split())
        raise KubeCredentialsError(f"Kubernetes credentials: {type(exc).__name__}: {why}".strip()) from None
    return api_client, f"{source} ({api_client.configuration.host})"


class LazyCoreApi:
    """A CoreV1Api whose credentials load once, on first use (kubernetes_asyncio imported then), so a
    process that never calls it never loads them. Each caller keeps its own: the ApiClient remembers
    only its last response, which a caller may read right after its request."""

    def __init__(self, kubeconfig: Path | None = None, in_cluster: str = "auto") -> None:
        self.kubeconfig = Path(kubeconfig) if kubeconfig else None
        self.in_cluster = in_cluster
        self.api_client: Any = None
        self.core: Any = None
        #: where the credentials came from, once loaded (for logs).
        self.source = ""
        self._lock = asyncio.Lock()

    async def connect(self) -> Any:
        """The CoreV1Api; KubeCredentialsError says why there is none."""
        async with self._lock:
            if self.core is None:
                from kubernetes_asyncio import client

                self.api_client, self.source = await load_api_client(self.kubeconfig, self.in_cluster)
                self.core = client.CoreV1Api(self.api_client)
            return self.core

    async def close(self) -> None:
        if self.api_client is not None:
            api_client, self.api_client, self.core = self.api_client, None, None
            await api_client.close()


__all__ = ["KubeCredentialsError", "LazyCoreApi", "in_cluster_available", "load_api_client", "use_in_cluster"]
