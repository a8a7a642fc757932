"""An outside review of issue 43's admission policy for kube_reaper's Node changes
(deploy/kubernetes/rbac.yaml, ValidatingAdmissionPolicy bcd-kube-reaper-own-node). Its comment says
that even a stolen token changes on its Node only what the MIG re-layout changes; RBAC grants
`nodes patch`, and the policy holds the labels, the annotations, the other taints, podCIDR(s) and
providerID, but not the rest of the object a patch can reach."""

from __future__ import annotations

from tests.unit.test_kubernetes_manifests import _named


def _validations() -> str:
    return " ".join(v["expression"] for v in _named("ValidatingAdmissionPolicy", "bcd-kube-reaper-own-node")["spec"]["validations"])


def test_the_reaper_node_policy_holds_finalizers_and_owner_references() -> None:
    """A finalizer added to the Node blocks its deletion; an ownerReference makes the garbage
    collector delete the Node with its owner. Neither is the re-layout's, and the policy lets both by."""
    text = _validations()
    assert "finalizers" in text, "a kube_reaper token may add finalizers to its Node"
    assert "ownerReferences" in text, "a kube_reaper token may set ownerReferences on its Node"
