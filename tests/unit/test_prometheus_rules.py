"""The alert rules in deploy/prometheus, and the metric catalogue they are held to.

promtool (Debian's prometheus package) checks the rules and the example
scrape config and runs the rule unit tests in deploy/prometheus/tests; those
tests skip, naming the package, where promtool is missing. The rest needs no
promtool: every metric a rule (or a dashboard, test_grafana_dashboards.py)
names must be one a bcd service registers, with the labels it matches on.

The catalogue is read from the source: every `Counter`/`Gauge`/`Histogram`/
`Summary` created in services/ and shared/ with a literal name and label
list, plus the process and platform collectors the runtime adds and the
series Prometheus makes itself (`up`, `ALERTS`). tests/integration/
test_metrics_exposed.py scrapes a running node and checks the catalogue
against what the services really expose, both ways.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector

from shared.runtime import METRICS_PORTS

REPO = Path(__file__).resolve().parents[2]
PROM_DIR = REPO / "deploy" / "prometheus"
RULES = PROM_DIR / "bcd-rules.yml"
RULE_TESTS = sorted((PROM_DIR / "tests").glob("*.yml"))
SCRAPE_CONFIG = PROM_DIR / "prometheus.yml"
SOURCES = [REPO / "shared", REPO / "services"]

#: labels every bcd series gets from the scrape (prometheus.yml).
TARGET_LABELS = frozenset({"job", "instance", "node", "service"})
#: series Prometheus itself makes: per target, and for alerts.
SCRAPE_SERIES: dict[str, frozenset[str]] = {
    "up": frozenset(),
    "scrape_duration_seconds": frozenset(),
    "scrape_samples_scraped": frozenset(),
    "scrape_series_added": frozenset(),
    "ALERTS": frozenset({"alertname", "alertstate", "severity"}),
    "ALERTS_FOR_STATE": frozenset({"alertname", "severity"}),
}
SEVERITIES = ("critical", "warning", "info")

#: issue 7 point 5, in its words, and the series that answer each (with labels).
ISSUE_7_METRICS: dict[str, tuple[str, set[str]]] = {
    "holds by binding": ("bcd_holds", {"binding"}),
    "pass duration histogram": ("bcd_converger_pass_duration_seconds_bucket", {"le"}),
    "failures by reason": ("bcd_hold_failures_total", {"reason"}),
    "outbox depth": ("bcd_outbox_depth", set()),
    "outbox oldest age": ("bcd_outbox_oldest_age_seconds", set()),
    "signatures": ("bcd_signatures_total", {"purpose", "outcome"}),
    "switches": ("bcd_vfio_switches_total", {"target", "outcome"}),
    "pending Kubernetes releases": ("bcd_kubernetes_releases_pending", set()),
    "their age": ("bcd_kubernetes_release_oldest_age_seconds", set()),
    "Kubernetes releases unreadable": ("bcd_kubernetes_releases_unreadable", set()),
    "PhysicalGPU phase": ("bcd_gpu_phase", {"pci_address", "phase"}),
    "PhysicalGPU managementState": ("bcd_gpu_management_state", {"pci_address", "state"}),
    "PhysicalGPU conditions (DisruptionRequired)": ("bcd_gpu_condition", {"pci_address", "type", "status", "reason"}),
}

#: issue 30 (GPU health): the series the inventory adds, with the labels the alerts and dashboards read.
ISSUE_30_METRICS: dict[str, tuple[str, set[str]]] = {
    "XIDs by card, number and severity": ("bcd_gpu_xid_events_total", {"pci_address", "xid", "severity"}),
    "ECC events by card and kind": ("bcd_gpu_ecc_events_total", {"pci_address", "kind"}),
    "health checks by outcome": ("bcd_gpu_health_checks_total", {"outcome"}),
    "the Healthy condition": ("bcd_gpu_condition", {"pci_address", "type", "status", "reason"}),
}
#: issue 30's alerts: the series each reads and the matchers it must have.
ISSUE_30_ALERTS: dict[str, tuple[str, set[str]]] = {
    "BcdGpuXidCritical": ("bcd_gpu_xid_events_total", {'severity="critical"'}),
    "BcdGpuUnhealthy": ("bcd_gpu_condition", {'type="Healthy"', 'status="False"'}),
}

_METRIC_CLASSES = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram", "Summary": "summary", "Info": "info", "Enum": "stateset"}


# --------------------------------------------------------------------------- the catalogue


@dataclass(frozen=True)
class Metric:
    """One metric family as its service creates it."""

    name: str
    type: str
    labels: frozenset[str]
    where: str

    def samples(self) -> dict[str, frozenset[str]]:
        """The sample names Prometheus stores for this family, with their labels."""
        n, labels = self.name, self.labels
        if self.type == "counter":
            return {f"{n}_total": labels, f"{n}_created": labels}
        if self.type == "histogram":
            return {f"{n}_bucket": labels | {"le"}, f"{n}_sum": labels, f"{n}_count": labels, f"{n}_created": labels}
        if self.type == "summary":
            return {n: labels | {"quantile"}, f"{n}_sum": labels, f"{n}_count": labels, f"{n}_created": labels}
        if self.type == "info":
            return {f"{n}_info": labels}
        if self.type == "stateset":
            return {n: labels | {n}}
        return {n: labels}


def _literal_strings(node: ast.AST | None) -> list[str] | None:
    if isinstance(node, (ast.List, ast.Tuple)) and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
        return [e.value for e in node.elts]  # type: ignore[union-attr]
    return None


def source_metrics(paths: list[Path] = SOURCES) -> list[Metric]:
    """Every metric created in the source, read with `ast` (no service has to start).

    A metric whose name or label list is not a literal fails here: the
    catalogue would silently miss it otherwise.
    """
    found: list[Metric] = []
    for root in paths:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
            if "proto" in rel.parts:
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            # a bare name counts only where prometheus_client gave it (collections.Counter is no metric)
            other = {
                a.asname or a.name
                for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) and not (n.module or "").startswith("prometheus_client")
                for a in n.names
            }
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                cls = func.id if isinstance(func, ast.Name) and func.id not in other else func.attr if isinstance(func, ast.Attribute) else None
                if cls not in _METRIC_CLASSES or not (node.args or node.keywords):
                    continue
                where = f"{rel}:{node.lineno}"
                kw = {k.arg: k.value for k in node.keywords}
                name_node = node.args[0] if node.args else kw.get("name")
                if not (isinstance(name_node, ast.Constant) and isinstance(name_node.value, str)):
                    raise AssertionError(f"{where}: a {cls} whose name is not a literal string; the metric catalogue cannot read it")
                labels_node = node.args[2] if len(node.args) > 2 else kw.get("labelnames")
                labels = [] if labels_node is None else _literal_strings(labels_node)
                if labels is None:
                    raise AssertionError(f"{where}: {name_node.value}: the label names are not a literal list")
                name = name_node.value
                if cls == "Counter" and name.endswith("_total"):
                    name = name[: -len("_total")]
                found.append(Metric(name, _METRIC_CLASSES[cls], frozenset(labels), where))
    return found


def collector_metrics() -> list[Metric]:
    """What the runtime's ProcessCollector and PlatformCollector add (read from a live registry)."""
    reg = CollectorRegistry()
    ProcessCollector(registry=reg)
    PlatformCollector(registry=reg)
    return [
        Metric(fam.name, fam.type, frozenset(k for s in fam.samples for k in s.labels), "prometheus_client collectors")
        for fam in reg.collect()
    ]


@dataclass
class Catalogue:
    metrics: list[Metric]
    #: sample name -> the labels it may carry (its own and the scrape's).
    series: dict[str, frozenset[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for m in self.metrics:
            for sample, labels in m.samples().items():
                self.series[sample] = self.series.get(sample, frozenset()) | labels | TARGET_LABELS
        for name, labels in SCRAPE_SERIES.items():
            self.series[name] = labels | TARGET_LABELS

    def problems(self, selectors: list[Selector], where: str) -> list[str]:
        out = []
        for sel in selectors:
            if sel.name not in self.series:
                out.append(f"{where}: {sel.name} is not a metric any bcd service registers")
            elif unknown := sel.labels - self.series[sel.name]:
                out.append(f"{where}: {sel.name} has no label {', '.join(sorted(unknown))} (it has {', '.join(sorted(self.series[sel.name]))})")
        return out


@cache
def catalogue() -> Catalogue:
    metrics = source_metrics() + collector_metrics()
    names = [m.name for m in metrics]
    dupes = sorted({n for n in names if names.count(n) > 1})
    # one name, one meaning: two services registering one name would be summed together
    assert not dupes, f"metric names registered twice: {dupes}"
    return Catalogue(metrics)


# --------------------------------------------------------------------------- PromQL selectors


@dataclass(frozen=True)
class Selector:
    name: str
    labels: frozenset[str]


_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<var>\$\{[^}]*\}|\$\w+)
  | (?P<number>\d[\w.]*)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<brace>\{(?:"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`|[^}"'`])*\})
  | (?P<bracket>\[[^\]]*\])
  | (?P<other>.)
    """,
    re.VERBOSE | re.DOTALL,
)
_MATCHER = re.compile(r"""([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*(?:"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)""")
#: keywords followed by a parenthesised label list
_LABEL_LIST_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan", "Inf", "NaN"}
#: aggregation operators (`sum by (l) (x)`: not followed by a parenthesis)
_AGGREGATIONS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk", "quantile", "limitk", "limit_ratio"
}


def selectors(expr: str) -> list[Selector]:
    """The metric selectors of a PromQL expression: names, and the labels each one matches on.

    Functions and aggregations (an identifier before `(`), keywords, label
    lists after by/without/on/ignoring/group_left/group_right, strings,
    numbers, durations, ranges and Grafana variables are skipped.
    """
    tokens = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(expr) if m.lastgroup != "ws"]
    out: list[Selector] = []
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else (None, "")
        if kind == "ident" and text in _LABEL_LIST_KEYWORDS:
            i += 1
            if tokens[i:] and tokens[i][1] == "(":
                while i < len(tokens) and tokens[i][1] != ")":
                    i += 1
            i += 1
            continue
        if kind == "ident" and text not in _KEYWORDS and text not in _AGGREGATIONS and nxt[1] != "(":
            labels: frozenset[str] = frozenset()
            if nxt[0] == "brace":
                labels = frozenset(m.group(1) for m in _MATCHER.finditer(nxt[1]))
                i += 1
            out.append(Selector(text, labels))
        elif kind == "brace":
            raise AssertionError(f"a selector without a metric name in {expr!r}: name the metric, so it can be checked")
        i += 1
    return out


# --------------------------------------------------------------------------- the files


def rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def alerts() -> list[dict]:
    return [r for r in rules() if "alert" in r]


def promtool() -> str:
    found = os.environ.get("BCD_PROMTOOL") or shutil.which("promtool")
    if not found and (REPO / ".tools" / "bin" / "promtool").is_file():
        found = str(REPO / ".tools" / "bin" / "promtool")
    if not found:
        pytest.skip("promtool not found (Debian package prometheus; or set BCD_PROMTOOL)")
    return found


def run_promtool(*args: str, cwd: Path = PROM_DIR) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60, cwd=cwd)


# --------------------------------------------------------------------------- promtool


def test_promtool_checks_the_rules():
    out = run_promtool("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules())} rules found" in out.stdout


def test_promtool_rule_unit_tests_pass():
    assert RULE_TESTS, "no rule tests in deploy/prometheus/tests"
    out = run_promtool("test", "rules", *[str(p.relative_to(PROM_DIR)) for p in RULE_TESTS])
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SUCCESS") == len(RULE_TESTS), out.stdout


def test_promtool_checks_the_example_scrape_config():
    out = run_promtool("check", "config", str(SCRAPE_CONFIG))
    assert out.returncode == 0, out.stdout + out.stderr


# --------------------------------------------------------------------------- the rules themselves


def test_every_alert_has_for_severity_and_annotations_naming_the_node():
    names = [a["alert"] for a in alerts()]
    assert len(names) == len(set(names)), f"alert names repeat: {names}"
    for a in alerts():
        name = a["alert"]
        assert "for" in a, f"{name}: no `for:` (one bad scrape would page)"
        assert a.get("labels", {}).get("severity") in SEVERITIES, f"{name}: severity label not one of {SEVERITIES}"
        ann = a.get("annotations", {})
        assert ann.get("summary") and ann.get("description"), f"{name}: needs summary and description"
        # every alert but "no bcd target at all" concerns one node, and says which
        if name != "BcdMetricsAbsent":
            assert "$labels.node" in ann["summary"] and "$labels.node" in ann["description"], f"{name}: the annotations must name the node"


def test_the_alerts_issue_7_asks_for_exist():
    names = {a["alert"] for a in alerts()}
    asked = {
        "KubernetesReleaseStuck",
        "KubernetesReleasesUnreadable",
        "BcdGpuDisruptionRequired",
        "BcdOutboxNotDraining",
        "BcdSectionFailed",
        "BcdSectionProgressingTooLong",
        "BcdServiceDown",
        "BcdMetricsAbsent",
    }
    assert asked <= names, asked - names


def test_the_gpu_health_alerts_issue_30_asks_for():
    by_name = {a["alert"]: a for a in alerts()}
    series = catalogue().series
    for what, (name, labels) in ISSUE_30_METRICS.items():
        assert name in series and labels <= series[name], f"{what}: {name} with {labels} is not registered"
    for alert, (metric, matchers) in ISSUE_30_ALERTS.items():
        assert alert in by_name, f"no alert {alert}"
        expr = by_name[alert]["expr"]
        assert metric in {s.name for s in selectors(expr)}, f"{alert} does not read {metric}"
        for m in matchers:
            assert m in expr.replace(" ", ""), f"{alert}: no {m} in {expr!r}"
        # each says the card, and what to run on the node
        ann = by_name[alert]["annotations"]
        assert "$labels.pci_address" in ann["summary"] and "bcd gpu recheck" in ann["description"], alert
    # the XID alert does not rely on increase() alone: the inventory makes a card's series at its first XID, at 1
    assert "offset 10m" in by_name["BcdGpuXidCritical"]["expr"]
    # an unhealthy card is Failed too: one alert for it, not two
    assert 'unless on (job, instance, node, pci_address) (bcd_gpu_condition{type="Healthy", status="False"} == 1)' in by_name["BcdGpuFailed"]["expr"]
    health = PROM_DIR / "tests" / "health.yml"
    assert health in RULE_TESTS
    checks = [c for case in yaml.safe_load(health.read_text())["tests"] for c in case.get("alert_rule_test", [])]
    for alert in ISSUE_30_ALERTS:
        assert any(c["alertname"] == alert and c.get("exp_alerts") for c in checks), f"health.yml never sees {alert} fire"
        assert any(c["alertname"] == alert and not c.get("exp_alerts") for c in checks), f"health.yml never sees {alert} stay quiet"


def test_rule_tests_cover_every_alert_firing_and_not_firing():
    firing: set[str] = set()
    quiet: set[str] = set()
    for path in RULE_TESTS:
        doc = yaml.safe_load(path.read_text())
        assert doc["rule_files"] == ["../bcd-rules.yml"], f"{path.name} must test deploy/prometheus/bcd-rules.yml"
        for case in doc["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {a["alert"] for a in alerts()}
    assert not names - firing, f"no rule test sees these fire: {sorted(names - firing)}"
    assert not names - quiet, f"no rule test sees these stay quiet: {sorted(names - quiet)}"
    assert not (firing | quiet) - names, f"rule tests name alerts that do not exist: {sorted((firing | quiet) - names)}"


def test_rules_name_only_metrics_the_services_register():
    problems = []
    for r in rules():
        problems += catalogue().problems(selectors(r["expr"]), f"rule {r.get('alert') or r.get('record')}")
    assert not problems, "\n".join(problems)


def test_the_scrape_config_lists_every_service_port_with_its_node_and_service():
    doc = yaml.safe_load(SCRAPE_CONFIG.read_text())
    assert doc["rule_files"] == ["bcd-rules.yml"]
    (job,) = [j for j in doc["scrape_configs"] if j["job_name"] == "bcd"]
    seen = {}
    for sc in job["static_configs"]:
        assert set(sc["labels"]) == {"node", "service"}, sc
        for target in sc["targets"]:
            host, port = target.rsplit(":", 1)
            assert host == "127.0.0.1", f"{target}: the metrics ports listen on loopback only"
            seen[sc["labels"]["service"]] = int(port)
    assert seen == METRICS_PORTS


# --------------------------------------------------------------------------- the catalogue and the parser


def test_the_catalogue_has_the_metrics_issue_7_asks_for():
    series = catalogue().series
    for what, (name, labels) in ISSUE_7_METRICS.items():
        assert name in series, f"{what}: {name} is not registered by any service"
        assert labels <= series[name], f"{what}: {name} lacks {labels - series[name]}"


def test_the_catalogue_reads_counters_histograms_and_the_runtime():
    series = catalogue().series
    assert {"bcd_requests_total", "bcd_request_duration_seconds_bucket", "bcd_nats_connected", "bcd_service_info"} <= set(series)
    assert "endpoint" in series["bcd_requests_total"] and "le" in series["bcd_request_duration_seconds_bucket"]
    assert {"process_resident_memory_bytes", "process_cpu_seconds_total", "python_info"} <= set(series)
    assert "bcd_requests" not in series  # a counter is stored as <name>_total


def test_source_metrics_refuses_a_name_it_cannot_read(tmp_path):
    (tmp_path / "m.py").write_text("from prometheus_client import Gauge\nNAME = 'x'\nG = Gauge(NAME, 'help')\n")
    with pytest.raises(AssertionError, match="not a literal"):
        source_metrics([tmp_path])


@pytest.mark.parametrize(
    ("expr", "want"),
    [
        ("up == 0", [("up", set())]),
        ('bcd_section_state{state="FAILED"} == 1', [("bcd_section_state", {"state"})]),
        (
            'sum by (node, le) (rate(bcd_converger_pass_duration_seconds_bucket{node=~"$node"}[$__rate_interval]))',
            [("bcd_converger_pass_duration_seconds_bucket", {"node"})],
        ),
        ("bcd_outbox_depth > 0 and bcd_outbox_oldest_age_seconds > 600", [("bcd_outbox_depth", set()), ("bcd_outbox_oldest_age_seconds", set())]),
        ("histogram_quantile(0.99, sum(rate(x_bucket[5m])) by (le))", [("x_bucket", set())]),
        ('absent(up{job="bcd"})', [("up", {"job"})]),
        ('a{l="}{ by"} * on (node) group_left (phase) b offset 5m', [("a", {"l"}), ("b", set())]),
        ('count(bcd_gpu_phase{node=~"${node}", phase!="Ready"} == 1) or vector(0)', [("bcd_gpu_phase", {"node", "phase"})]),
        ('label_replace(m, "dst", "$1", "src", "(.*)")', [("m", set())]),
    ],
)
def test_selectors(expr, want):
    assert [(s.name, set(s.labels)) for s in selectors(expr)] == want


def test_a_selector_without_a_name_is_refused():
    with pytest.raises(AssertionError, match="without a metric name"):
        selectors('{__name__=~"bcd_.*"}')
