"""shared.kubeclient: which credentials the Kubernetes clients of bcd load, and the one-line
error when they cannot (the kube_reaper's evictor and the DRA plugin's ClusterApi both use it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.kubeclient import KubeCredentialsError, in_cluster_available, load_api_client, use_in_cluster

POD = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}


@pytest.mark.parametrize(
    ("in_cluster", "kubeconfig", "environ", "expected"),
    [
        ("true", None, {}, True),
        ("true", Path("/k"), {}, True),
        ("false", None, POD, False),
        ("auto", None, POD, True),
        ("auto", Path("/k"), POD, False),
        ("auto", None, {}, False),
        ("auto", None, {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, False),
    ],
)
def test_use_in_cluster(in_cluster: str, kubeconfig: Path | None, environ: dict[str, str], expected: bool) -> None:
    assert use_in_cluster(in_cluster, kubeconfig, environ) is expected
    assert in_cluster_available(POD) and not in_cluster_available({})


async def test_a_kubeconfig_loads_and_says_where_from(tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:6443', insecure-skip-tls-verify: true}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    client, source = await load_api_client(path, "auto")
    try:
        assert source == f"kubeconfig {path} (https://127.0.0.1:6443)"
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("kubeconfig", "in_cluster", "says"),
    [
        ("missing", "false", "Kubernetes credentials: "),
        ("garbage", "false", "Kubernetes credentials: "),
        (None, "true", "Kubernetes credentials: ConfigException"),
    ],
)
async def test_credentials_that_do_not_load_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kubeconfig: str | None, in_cluster: str, says: str) -> None:
    for var in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        monkeypatch.delenv(var, raising=False)
    path = None
    if kubeconfig is not None:
        path = tmp_path / kubeconfig
        if kubeconfig == "garbage":
            path.write_text("{not: [yaml")
    with pytest.raises(KubeCredentialsError) as err:
        await load_api_client(path, in_cluster)
    assert str(err.value).startswith(says) and "\n" not in str(err.value), str(err.value)
