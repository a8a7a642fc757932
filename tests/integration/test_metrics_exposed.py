"""A running node exposes every metric the alert rules and dashboards use.

`bcd up` on a fake host, one small spec through the control plane, then every
service's /metrics (the address each one gives in its $SRV.PING metadata) is
scraped. Each metric deploy/prometheus/bcd-rules.yml and deploy/grafana name
must be declared by some service; each family a service exposes must be in
the catalogue the unit tests check the rules against (so that catalogue, read
from the source, is the truth); and the values after the spec are the node's.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bcd.client import node_info

from ..unit.test_grafana_dashboards import DASHBOARDS, queries
from ..unit.test_prometheus_rules import RULES, SCRAPE_SERIES, Metric, catalogue, selectors
from .wholenode import GPU, assignment, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def referenced() -> dict[str, set[str]]:
    """Sample name -> where the rules and dashboards use it."""
    out: dict[str, set[str]] = {}
    for rule in yaml.safe_load(RULES.read_text())["groups"]:
        for r in rule["rules"]:
            for s in selectors(r["expr"]):
                out.setdefault(s.name, set()).add(f"rule {r.get('alert') or r.get('record')}")
    for uid, path in DASHBOARDS.items():
        for title, expr in queries(json.loads(path.read_text())):
            for s in selectors(expr):
                out.setdefault(s.name, set()).add(f"{uid}: {title}")
    return out


def scrape(address: str) -> list:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()  # noqa: S310 - loopback
    return list(text_string_to_metric_families(text))


def value(families: list, name: str, **labels: str) -> float | None:
    for fam in families:
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def test_every_metric_the_rules_and_dashboards_use_is_exposed(node):
    services = node_info(node.state).services

    def all_up():
        p = node.ping()
        return p if set(services) <= set(p) else None

    pings = wait_for(all_up, 30, f"{services} to answer $SRV.PING")
    addresses = {name: pings[name]["metadata"]["metrics"] for name in services}
    host_gpus = json.loads(node.host.read_text())["gpus"]

    gen = node.apply({"node_id": "node-1", "devices": [assignment("obs-1", GPU[0])]})
    node.wait_generation(gen)

    def settled():
        got = {name: scrape(addr) for name, addr in addresses.items()}
        conv, inv, bridge, signer = got["converger"], got["inventory"], got["gateway_bridge"], got["signer"]
        ready = (
            value(conv, "bcd_holds", binding="BINDING_HOLD") == 1
            and value(conv, "bcd_section_state", state="CONVERGED") == 1
            and value(bridge, "bcd_outbox_depth") == 0
            and (value(signer, "bcd_signatures_total", purpose="attested-report", outcome="signed") or 0) >= 1
            and value(inv, "bcd_gpu_phase", pci_address=host_gpus[0]["pci_address"]) == 1
        )
        return got if ready else None

    exposed = wait_for(settled, 30, "the spec's hold, signature and drained outbox in the metrics")

    # every service: who it is, and on the bus
    for name, families in exposed.items():
        assert value(families, "bcd_service_info", service=name, node_id="node-1") == 1, name
        assert value(families, "bcd_nats_connected") == 1, name

    # what a service exposes is what the catalogue (read from the source) says: names and labels
    cat = catalogue().series
    declared: dict[str, str] = {}
    problems = []
    for name, families in exposed.items():
        for fam in families:
            # declared: a family with no sample yet (a labelled one never used) still names its series
            for sample in Metric(fam.name, fam.type, frozenset(), name).samples():
                declared.setdefault(sample, name)
                if sample not in cat and not sample.endswith("_created"):
                    problems.append(f"{name} exposes {sample}, which the metric catalogue does not know")
            for s in fam.samples:
                if s.name in cat and not set(s.labels) <= cat[s.name]:
                    problems.append(f"{name} exposes {s.name} with labels {sorted(set(s.labels) - cat[s.name])} the catalogue does not know")
    assert not problems, "\n".join(problems)

    # and every metric the rules and dashboards name is there (those of a
    # service `bcd up` does not run, the root helper, are held to the catalogue only)
    owner = {sample: m.where.split("/")[1] for m in catalogue().metrics if m.where.startswith("services/") for sample in m.samples()}
    not_run = {name for name in referenced() if owner.get(name, "") not in ("", *services)}
    assert {owner[name] for name in not_run} <= {"helper"}, not_run
    missing = {
        name: sorted(where) for name, where in referenced().items() if name not in SCRAPE_SERIES and name not in declared and name not in not_run
    }
    assert not missing, f"used but exposed by no service: {missing}"

    # the values are the node's
    conv, inv = exposed["converger"], exposed["inventory"]
    assert value(conv, "bcd_holds", binding="BINDING_KUBERNETES") == 0
    assert value(conv, "bcd_converger_observed_generation") == gen
    assert value(conv, "bcd_kubernetes_releases_pending") == 0
    assert value(conv, "bcd_kubernetes_release_oldest_age_seconds") == 0
    assert value(conv, "bcd_kubernetes_releases_unreadable") == 0
    assert (value(conv, "bcd_converger_pass_duration_seconds_count") or 0) >= 1
    phases = [s for fam in inv for s in fam.samples if s.name == "bcd_gpu_phase"]
    assert sorted(s.labels["pci_address"] for s in phases) == sorted(g["pci_address"] for g in host_gpus)
    assert {s.labels["phase"] for s in phases} == {"Ready"}
    states = {s.labels["pci_address"]: s.labels["state"] for fam in inv for s in fam.samples if s.name == "bcd_gpu_management_state"}
    assert len(states) == len(host_gpus) and set(states.values()) <= {"Managed", "Unclaimed"}
    conditions = [s.labels for fam in inv for s in fam.samples if s.name == "bcd_gpu_condition"]
    assert {c["pci_address"] for c in conditions} == set(states)
    assert not [c for c in conditions if c["type"] == "Reconfiguring" and c["status"] == "True"]
    # pre-set series: a first switch or signature error is a step from 0, not a new series
    assert value(exposed["vfio_switcher"], "bcd_vfio_switches_total", target="vfio-pci", outcome="DisruptionRequired") == 0
    assert value(exposed["signer"], "bcd_signatures_total", purpose="other", outcome="refused") == 0
