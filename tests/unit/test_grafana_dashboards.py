"""The Grafana dashboards in deploy/grafana: valid dashboard JSON, every query on a registered metric.

bcd-node.json shows one node (a single-valued `node` variable); bcd-fleet.json
every node at once (`node` multi-valued, All included). Both take the
Prometheus data source as a variable, so they import into any Grafana.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from .test_prometheus_rules import ISSUE_7_METRICS, catalogue, selectors

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "deploy" / "grafana"
DASHBOARDS = {"bcd-node": GRAFANA / "bcd-node.json", "bcd-fleet": GRAFANA / "bcd-fleet.json"}
#: the oldest schema these dashboards are written for (Grafana 10).
MIN_SCHEMA_VERSION = 36
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>[a-zA-Z_]\w*)\)$")


def load(name: str) -> dict:
    return json.loads(DASHBOARDS[name].read_text())


def panels(dash: dict) -> list[dict]:
    """Every panel, those inside collapsed rows too."""
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def queries(dash: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in panels(dash) if p["type"] != "row" for t in p["targets"]]


@pytest.fixture(params=sorted(DASHBOARDS))
def dash(request) -> dict:
    return load(request.param)


def test_both_dashboards_exist():
    assert sorted(p.name for p in GRAFANA.glob("*.json")) == ["bcd-fleet.json", "bcd-node.json"]


def test_is_a_dashboard(dash):
    assert dash["uid"] in DASHBOARDS and dash["title"]
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= MIN_SCHEMA_VERSION
    assert dash.get("id") is None, "an exported id would clash on import; leave it out"
    assert "bcd" in dash["tags"]
    assert dash["time"]["from"] and dash["time"]["to"]


def test_templating_has_the_datasource_and_node(dash):
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = variables["datasource"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    node = variables["node"]
    assert node["type"] == "query" and node["datasource"] == DATASOURCE
    query = node["query"]["query"] if isinstance(node["query"], dict) else node["query"]
    m = LABEL_VALUES.match(query)
    assert m and m["label"] == "node", query
    assert not catalogue().problems(selectors(m["selector"]), "variable node")
    fleet = dash["uid"] == "bcd-fleet"
    assert node["multi"] is fleet and node["includeAll"] is fleet


def test_panels_have_titles_ids_and_fit_the_grid(dash):
    ps = panels(dash)
    assert ps
    ids = [p["id"] for p in ps]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    cells: dict[tuple[int, int], str] = {}
    for p in ps:
        assert isinstance(p.get("title"), str) and p["title"].strip(), f"panel {p['id']} has no title"
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["y"] >= 0 and g["x"] + g["w"] <= 24, f"{p['title']}: {g}"
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panels {cells[(x, y)]!r} and {p['title']!r} overlap"
                cells[(x, y)] = p["title"]


def test_every_panel_queries_prometheus_through_the_variable(dash):
    for p in panels(dash):
        if p["type"] == "row":
            assert not p.get("targets"), f"row {p['title']} has queries"
            continue
        assert p["datasource"] == DATASOURCE, p["title"]
        assert p["targets"], f"{p['title']}: no targets"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), f"{p['title']}: refIds repeat"
        for t in p["targets"]:
            assert t.get("datasource", DATASOURCE) == DATASOURCE, p["title"]
            assert isinstance(t.get("expr"), str) and t["expr"].strip(), f"{p['title']}: a target without expr"


def test_every_query_names_registered_metrics_of_the_chosen_nodes(dash):
    """Each selector is a metric some service registers, with labels it has, and filters on $node."""
    problems = []
    for title, expr in queries(dash):
        sels = selectors(expr)
        assert sels, f"{title}: {expr!r} selects nothing"
        problems += catalogue().problems(sels, f"{dash['uid']} panel {title!r}")
        for sel in sels:
            if "node" not in sel.labels:
                problems.append(f"{dash['uid']} panel {title!r}: {sel.name} is not filtered on the node variable")
        if "$node" not in expr:
            problems.append(f"{dash['uid']} panel {title!r}: {expr!r} ignores $node")
    assert not problems, "\n".join(problems)


def test_the_node_dashboard_shows_every_metric_issue_7_asks_for():
    shown = {s.name for _, expr in queries(load("bcd-node")) for s in selectors(expr)}
    missing = {what: name for what, (name, _) in ISSUE_7_METRICS.items() if name not in shown}
    assert not missing, missing


def test_the_dashboards_link_to_each_other():
    assert {link["url"] for link in load("bcd-node")["links"]} == {"/d/bcd-fleet/bcd-fleet"}
    assert {link["url"] for link in load("bcd-fleet")["links"]} == {"/d/bcd-node/bcd-node"}
