"""What a cluster admin applies (deploy/kubernetes/) agrees with the code: the RBAC grants exactly
the requests the services make, every DeviceClass has its example, and the extended resource names
DRA offers are never ones bcd's device plugin may offer on the same node (KEP-5004)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from services.device_plugin.advertise import DRA_RESOURCE_DOMAIN, BadResourceName, ResourceNames, check_resource_name
from services.dra_plugin import devices as dev
from services.dra_plugin import kubeapi
from services.kube_reaper import evictor, nodeapi

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _named(kind: str, name: str) -> dict:
    (doc,) = [d for d in _docs(KUBE / "rbac.yaml") if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _rules(role: str) -> set[tuple[str, str, str, tuple[str, ...]]]:
    return {
        (group, resource, verb, tuple(r.get("resourceNames", ())))
        for r in _named("ClusterRole", role)["rules"]
        for group in r["apiGroups"]
        for resource in r["resources"]
        for verb in r["verbs"]
    }


def _called(module: object, pattern: str) -> set[str]:
    return set(re.findall(pattern, Path(module.__file__).read_text()))


def test_the_request_tables_name_every_request_the_code_makes() -> None:
    # ClusterApi reaches the API through _call(what, "<generated method>", ...) only; the evictor through self.api.core
    assert _called(kubeapi, r'_call\(\s*\w+,\s*"(\w+)"') == set(kubeapi.API_REQUESTS)
    assert _called(evictor, r"self\.api\.core\.(\w+)\(") == set(evictor.API_REQUESTS)
    # the reaper's Node API through _call(what, "<generated method>", ...) only, and never self._core directly
    assert _called(nodeapi, r'_call\(\s*\w+,\s*"(\w+)"') == set(nodeapi.API_REQUESTS)
    assert _called(nodeapi, r"self\.api\.core\.(\w+)\(") == set()


def test_the_dra_plugin_role_grants_exactly_what_the_plugin_calls() -> None:
    want = {(g, r, v, ()) for g, r, v, when in kubeapi.API_REQUESTS.values() if when == "always"}
    assert _rules("bcd-dra-plugin") == want
    binding = {(g, r, v, ()) for g, r, v, when in kubeapi.API_REQUESTS.values() if when == "binding-conditions"}
    binding.add((*kubeapi.DEVICE_STATUS_PERMISSION, (dev.DEFAULT_DRIVER,)))
    assert _rules("bcd-dra-plugin-binding-conditions") == binding
    assert {when for *_, when in kubeapi.API_REQUESTS.values()} == {"always", "binding-conditions"}


def test_the_reaper_role_grants_exactly_what_the_evictor_and_the_node_api_call() -> None:
    calls = [*evictor.API_REQUESTS.values(), *nodeapi.API_REQUESTS.values()]
    assert _rules("bcd-kube-reaper") == {(g, r, v, ()) for g, r, v in calls}


def test_each_role_is_bound_to_its_own_service_account_and_nothing_else_is_granted() -> None:
    docs = _docs(KUBE / "rbac.yaml")
    accounts = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in docs if d["kind"] == "ServiceAccount"}
    bindings = {d["roleRef"]["name"]: [(s["namespace"], s["name"]) for s in d["subjects"]] for d in docs if d["kind"] == "ClusterRoleBinding"}
    assert bindings == {
        "bcd-dra-plugin": [("bcd-system", "bcd-dra-plugin")],
        "bcd-dra-plugin-binding-conditions": [("bcd-system", "bcd-dra-plugin")],
        "bcd-kube-reaper": [("bcd-system", "bcd-kube-reaper")],
    }
    assert accounts == {("bcd-system", "bcd-dra-plugin"), ("bcd-system", "bcd-kube-reaper")}
    assert {d["kind"] for d in docs} <= {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    policy = _named("ValidatingAdmissionPolicy", "bcd-dra-plugin-own-slices")
    assert policy["spec"]["matchConditions"][0]["expression"].endswith('"system:serviceaccount:bcd-system:bcd-dra-plugin"')
    reaper = _named("ValidatingAdmissionPolicy", "bcd-kube-reaper-own-node")
    assert reaper["spec"]["matchConditions"][0]["expression"].endswith('"system:serviceaccount:bcd-system:bcd-kube-reaper"')
    bound = {d["spec"]["policyName"]: d["spec"]["validationActions"] for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"}
    assert bound == {"bcd-dra-plugin-own-slices": ["Deny"], "bcd-kube-reaper-own-node": ["Deny"]}


def test_the_reaper_node_policy_names_the_keys_kube_reaper_checks() -> None:
    """The admission policy and kube_reaper's own check (nodeapi.py) allow the same keys and taint."""
    from shared.schemas.kubenode import GPU_DEPLOY_PREFIX, MIG_CONFIG_LABEL, MIG_STATE_LABEL, RELAYOUT_MESSAGE_ANNOTATION, RELAYOUT_TAINT_KEY

    text = " ".join(v["expression"] for v in _named("ValidatingAdmissionPolicy", "bcd-kube-reaper-own-node")["spec"]["validations"])
    for key in (MIG_CONFIG_LABEL, MIG_STATE_LABEL, GPU_DEPLOY_PREFIX, RELAYOUT_MESSAGE_ANNOTATION, RELAYOUT_TAINT_KEY):
        assert f"'{key}'" in text, key
    assert {r["resources"][0] for r in _named("ValidatingAdmissionPolicy", "bcd-kube-reaper-own-node")["spec"]["matchConstraints"]["resourceRules"]} == {"nodes"}


def _classes() -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in _docs(KUBE / "dra-deviceclasses.yaml") if d["kind"] == "DeviceClass"}


def test_every_device_class_has_an_example_template_and_pod() -> None:
    classes = _classes()
    assert {p.name for p in (KUBE / "examples").glob("*.yaml")} == {f"{name}.yaml" for name in classes}
    for name, klass in classes.items():
        docs = _docs(KUBE / "examples" / f"{name}.yaml")
        templates = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ResourceClaimTemplate"}
        mine = {t for t, d in templates.items() if any(r["exactly"]["deviceClassName"] == name for r in d["spec"]["spec"]["devices"]["requests"])}
        assert mine, name
        pods = [d for d in docs if d["kind"] == "Pod"]
        claimed = [p for p in pods if {c.get("resourceClaimTemplateName") for c in p["spec"].get("resourceClaims", ())} & mine]
        assert claimed, name
        for p in claimed:  # the container names the pod's claim, or it gets no device
            names = {c["name"] for c in p["spec"]["resourceClaims"]}
            assert all({c["name"] for c in k["resources"]["claims"]} <= names for k in p["spec"]["containers"])
        extended = klass["spec"].get("extendedResourceName")
        plain = [p for p in pods if "resourceClaims" not in p["spec"]]
        if extended:  # a plain pod, a limit and no claim
            assert [p["spec"]["containers"][0]["resources"]["limits"] for p in plain] == [{extended: 1}], name
        else:
            assert not plain, name
        assert {d["kind"] for d in docs} == {"ResourceClaimTemplate", "Pod"}


def test_extended_resource_names_are_the_dra_drivers_and_one_class_each() -> None:
    names = [k["spec"]["extendedResourceName"] for k in _classes().values() if "extendedResourceName" in k["spec"]]
    assert "gpu.bcd.dev/gpu" in names
    assert len(set(names)) == len(names)  # the scheduler picks one class per name; two would be a guess
    assert DRA_RESOURCE_DOMAIN == dev.DEFAULT_DRIVER
    for n in names:
        check_resource_name(n)
        assert n.split("/", 1)[0] == DRA_RESOURCE_DOMAIN
    # the MIG classes' names spell the profile as the device plugin does, and select that profile
    for name, k in _classes().items():
        ext = k["spec"].get("extendedResourceName", "")
        if ext.startswith(f"{DRA_RESOURCE_DOMAIN}/mig-"):
            profile = ext.split("/mig-", 1)[1]
            assert f'migProfile == "{profile}"' in k["spec"]["selectors"][0]["cel"]["expression"], name


def test_the_device_plugin_offers_no_name_in_the_dra_domain() -> None:
    defaults = ResourceNames().check()
    assert defaults.domain != DRA_RESOURCE_DOMAIN
    names = {k["spec"]["extendedResourceName"] for k in _classes().values() if "extendedResourceName" in k["spec"]}
    assert not names & {defaults.gpu_name, defaults.slot_name, defaults.mig_name("1g.18gb"), defaults.mig_name("3g.71gb")}


@pytest.mark.parametrize("domain", ["gpu.bcd.dev", "x.gpu.bcd.dev"])
def test_a_device_plugin_domain_that_is_dras_is_refused(domain: str) -> None:
    with pytest.raises(BadResourceName, match="never both"):
        ResourceNames(domain=domain).check()
    with pytest.raises(BadResourceName, match="never both"):
        ResourceNames(domain="gpu.example.com").check(dra_domain="gpu.example.com")
    assert ResourceNames(domain=domain).check(dra_domain="other.example.com").domain == domain
