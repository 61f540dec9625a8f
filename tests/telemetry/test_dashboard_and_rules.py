"""The Grafana dashboard and the Prometheus alert rules, checked with the tools that use them.

- `promtool check rules` accepts telemetry/prometheus/alerts.yml; `promtool test rules`
  passes telemetry/prometheus/alerts_test.yml, which has a firing and a silent case for
  every alert, and fails when an alert is made to never or to always fire (so each case
  can fail).
- The dashboard's shape: the rows and panels the operators need, the datasource as a
  variable, no overlapping panels, no unknown template variable.
- Live: a real Prometheus on loopback scrapes a running moed every second; after a few
  requests every query of every panel runs through Prometheus' HTTP API with Grafana's
  variables substituted ($__rate_interval -> 4s, $__interval -> 1s, $__range -> 5m,
  template variables -> .*). Each must parse; the fleet, serving and expert panels must return
  numbers. A misspelt metric parses and returns nothing, so every metric a panel or a rule
  names must also appear in moed's own scrape. The rules load into that Prometheus and
  evaluate without error.
- Fleet: Prometheus runs the shipped scrape configuration's `moed` job
  (telemetry/prometheus/prometheus.yml: file-based service discovery) on a file naming
  two daemons. Every panel query parses; each query of the Fleet row returns a number, and
  those drawn per instance one series for each daemon. One daemon is then killed: `up`
  and the Fleet row say so, and MoedDown (for that instance only) and MoedFleetHalfDown
  become pending.

Grafana itself is not installed here: the dashboard is checked this way and never
rendered. promtool and prometheus come from Debian's `prometheus` package, which the test
run installs when it may (tests/tools.py); where it cannot, these tests skip saying so,
and under MOED_TEST_TOOLS=require (CI) they fail instead. No sleeps: Prometheus'
readiness is its own log line; scrapes and rule evaluations are awaited by polling its
API against a deadline.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
import tools
from metrics_scrape import parse as parse_scrape

from daemon.store.streaming import minimum_cache_bytes
from ext.formats.checkpoint import Checkpoint
from ext.makemodel import make_model
from ext.models.config import load_config
from ext.models.experts import ExpertLayout

from daemon_proc import Daemon, free_port, short_dir, wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "telemetry" / "grafana" / "moed.json"
RULES = ROOT / "telemetry" / "prometheus" / "alerts.yml"
RULES_TEST = ROOT / "telemetry" / "prometheus" / "alerts_test.yml"
SCRAPE_CONFIG = ROOT / "telemetry" / "prometheus" / "prometheus.yml"

ROWS = ("Fleet", "Serving", "Experts", "Prefetch", "Engine", "Memory", "Tuner")
ROWS_WITH_DATA = ("Fleet", "Serving", "Experts")   # after a few requests these must show numbers
PANELS = {                                  # row -> panels the issue asks for (by title)
    "Fleet": {"Instances up", "Fleet tokens per second", "Up by instance",
              "Tokens per second by instance", "Running and waiting by instance",
              "Time to first token p90 by instance", "Expert cache hit ratio by instance",
              "Prefix cache reuse by instance"},
    "Serving": {"Request rate", "Errors", "Running and waiting", "Time to first token",
                "Inter-token latency"},
    "Experts": {"Expert cache hit ratio", "Hit ratio per layer", "Expert bytes read per second",
                "Expert bytes read per token", "Expert read latency", "Evictions",
                "Pin swaps in range"},
    "Prefetch": {"Prefetch issued vs used", "Prefetch bytes: read vs wasted"},
    "Engine": {"IO wait vs compute", "Threads"},
    "Memory": {"Memory budget vs available vs resident", "Resident set size"},
    "Tuner": {"Tuner trials in range", "Tuner trials"},
}
ALERTS = {"MoedDown", "MoedFleetHalfDown", "MoedHighErrorRatio", "MoedExpertHitRatioCollapse", "MoedExpertReadErrors",
          "MoedMemoryHeadroomLow", "MoedQueueSaturated"}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRAFANA_VARIABLES = {"__rate_interval": "4s", "__interval": "1s", "__range": "5m"}
PROMETHEUS_MADE = {"up"}                    # series Prometheus writes itself, not in moed's scrape
DEADLINE_S = 90.0


def tool(name: str) -> str:
    """The path of a Prometheus tool the test declared with @pytest.mark.tools."""
    return tools.path(name)


# ---------------------------------------------------------------------- PromQL metric names

_PROMQL_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<duration>(?:\d+(?:ms|[smhdwy]))+(?![\w.]))
  | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^=<>(){},@])
""", re.VERBOSE)
# words that are never metric names where they stand (aggregations, set operators, modifiers,
# literals); the grouping ones may be followed by a parenthesised list of label names
_GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS = _GROUPING | {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk",
    "topk", "quantile", "limitk", "limit_ratio", "and", "or", "unless", "atan2", "bool", "offset",
    "inf", "nan"}


def promql_tokens(expr: str) -> list[tuple[str, str]]:
    """(kind, text) of each token of a PromQL expression, without spaces and comments.

    Raises ValueError on a character PromQL does not have."""
    tokens, pos = [], 0
    while pos < len(expr):
        m = _PROMQL_TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot read PromQL at {expr[pos:pos + 20]!r} in {expr!r}")
        if m.lastgroup not in ("space", "comment"):
            tokens.append((m.lastgroup, m.group()))
        pos = m.end()
    return tokens


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects.

    Skipped: functions and aggregations (a name followed by "("), keywords, label names and
    values inside {...} (except a `__name__="..."` matcher, which names a metric), label
    lists after by/without/on/ignoring/group_left/group_right, ranges, strings, numbers."""
    tokens = promql_tokens(expr)
    names, i = set(), 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1][1] if i + 1 < len(tokens) else None
        if text == "{":
            end = next(j for j in range(i, len(tokens)) if tokens[j][1] == "}")
            matchers = tokens[i + 1:end]
            for j in range(len(matchers) - 2):
                if matchers[j][1] == "__name__" and matchers[j + 1][1] == "=":
                    names.add(matchers[j + 2][1][1:-1])
            i = end
        elif kind == "name":
            if text.lower() in _GROUPING and following == "(":
                i = next(j for j in range(i, len(tokens)) if tokens[j][1] == ")")
            elif text.lower() not in _KEYWORDS and following != "(":
                names.add(text)
        i += 1
    return names


@pytest.mark.parametrize("expr, names", [
    ('histogram_quantile(0.99, sum by (le) (rate(moed_a_seconds_bucket{instance=~".*", '
     'le!="+Inf"}[5m])))', {"moed_a_seconds_bucket"}),
    ("sum(rate(a_total[5m])) by (job) / on (job) group_left (version) b_info offset 1h",
     {"a_total", "b_info"}),
    ('up{job="moed"} == bool 0 unless ignoring(instance) c', {"up", "c"}),
    ("time() - process_start_time_seconds", {"process_start_time_seconds"}),
    ('label_replace(m, "dst", "not_a_metric", "src", "(.*)")', {"m"}),
    ("topk(3, x) or vector(1) and absent(y) @ start()", {"x", "y"}),
    ('{__name__="by_name", job="j"} + 1e3 * 0x1F - Inf + NaN', {"by_name"}),
    ("sum without (layer) (z[1h:5m])  # a comment naming w\n", {"z"}),
    ("max_over_time(deriv(q[10m])[30m:1m]) > 0.5 * min(r) without (tier)", {"q", "r"}),
    ("a * on(x) group_left b", {"a", "b"}),
    ("rate (spaced_total [4s])", {"spaced_total"}),
])
def test_metric_names_finds_metrics_and_only_metrics(expr, names):
    assert metric_names(expr) == names


def test_promql_tokens_refuse_what_is_not_promql():
    with pytest.raises(ValueError, match="cannot read PromQL"):
        promql_tokens("a ; b")


# ---------------------------------------------------------------------- the dashboard


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def rows_and_panels(dashboard: dict) -> list[tuple[str, dict]]:
    """(row title, panel) of every non-row panel, in order, rows collapsed or not."""
    out, row = [], None
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
            out += [(row, p) for p in panel.get("panels", [])]
        else:
            out.append((row, panel))
    return out


def template_names(dashboard: dict) -> set[str]:
    return {v["name"] for v in dashboard["templating"]["list"]}


def substitute(expr: str, templates: set[str]) -> str:
    """An expression as Grafana would send it: $__rate_interval -> 4s, $__interval -> 1s,
    $__range -> 5m, template variables ($name, ${name}, ${name:format}) -> .*; `$1` (a
    label_replace group) stays as it is.

    Raises KeyError on a variable that is neither Grafana's nor the dashboard's."""
    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name.isdigit():
            return m.group()
        if name in GRAFANA_VARIABLES:
            return GRAFANA_VARIABLES[name]
        if name in templates:
            return ".*"
        raise KeyError(f"unknown variable ${name} in {expr!r}")
    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", one, expr)


@dataclass(frozen=True)
class Query:
    row: str
    panel: str
    ref: str
    expr: str              # substituted
    legend: str = ""       # its legendFormat

    def __str__(self) -> str:
        return f"{self.row} / {self.panel} / {self.ref}: {self.expr}"


def dashboard_queries(dashboard: dict) -> list[Query]:
    templates = template_names(dashboard)
    return [Query(row, panel["title"], target["refId"], substitute(target["expr"], templates),
                  target.get("legendFormat", ""))
            for row, panel in rows_and_panels(dashboard) for target in panel["targets"]]


def variable_queries(dashboard: dict) -> list[str]:
    """The queries of the dashboard's query variables (Grafana's label_values(metric, label))."""
    out = []
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            out.append(v["query"]["query"] if isinstance(v["query"], dict) else v["query"])
    return out


def test_substitute_replaces_every_variable():
    templates = {"instance"}
    assert (substitute('rate(x{instance=~"$instance"}[$__rate_interval]) + '
                       'increase(y{i=~"${instance:regex}"}[$__range]) + z[$__interval]', templates)
            == 'rate(x{instance=~".*"}[4s]) + increase(y{i=~".*"}[5m]) + z[1s]')
    assert (substitute('label_replace(x, "class", "$1", "status", "(.)..")', templates)
            == 'label_replace(x, "class", "$1", "status", "(.)..")')
    with pytest.raises(KeyError, match="unknown variable"):
        substitute('x{job=~"$job"}', templates)


def test_dashboard_has_the_rows_and_panels_operators_need():
    dashboard = load_dashboard()
    assert [p["title"] for p in dashboard["panels"] if p["type"] == "row"] == list(ROWS)
    titles: dict[str, set[str]] = {}
    for row, panel in rows_and_panels(dashboard):
        titles.setdefault(row, set()).add(panel["title"])
    for row, wanted in PANELS.items():
        assert wanted <= titles[row], (row, wanted - titles[row])
    heatmap = next(p for _, p in rows_and_panels(dashboard) if p["title"] == "Hit ratio per layer")
    assert heatmap["type"] == "heatmap"
    assert "by (layer)" in heatmap["targets"][0]["expr"]
    assert heatmap["targets"][0]["legendFormat"] == "{{layer}}"


@pytest.mark.parametrize("title, metric", [
    ("Time to first token", "moed_time_to_first_token_seconds_bucket"),
    ("Inter-token latency", "moed_inter_token_latency_seconds_bucket"),
    ("Expert read latency", "moed_expert_read_seconds_bucket"),
])
def test_latency_panels_are_p50_p90_p99_of_histograms(title, metric):
    panel = next(p for _, p in rows_and_panels(load_dashboard()) if p["title"] == title)
    quantiles = []
    for target in panel["targets"]:
        m = re.fullmatch(r"histogram_quantile\(([0-9.]+), sum by \(le\) \(rate\((\w+)\{.*\}\[\$__rate_interval\]\)\)\)",
                         target["expr"])
        assert m, target["expr"]
        assert m.group(2) == metric
        quantiles.append(float(m.group(1)))
    assert quantiles == [0.5, 0.9, 0.99]


def test_dashboard_datasource_is_a_variable_everywhere():
    dashboard = load_dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for row, panel in rows_and_panels(dashboard):
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, (panel["title"], target["refId"])
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == DATASOURCE
            assert v["includeAll"] and v["allValue"] == ".*"


def test_dashboard_panels_have_unique_ids_and_do_not_overlap():
    dashboard = load_dashboard()
    ids = [p["id"] for p in dashboard["panels"]] + [p["id"] for _, p in rows_and_panels(dashboard)
                                                     if p not in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, (panel["title"], cells.get((x, y)))
                cells[(x, y)] = panel["title"]
    refs = [(p["title"], t["refId"]) for _, p in rows_and_panels(dashboard) for t in p["targets"]]
    assert len(refs) == len(set(refs))


def test_every_dashboard_query_names_moed_metrics_and_no_unknown_variable():
    queries = dashboard_queries(load_dashboard())     # substitute raises on an unknown variable
    assert len(queries) > 40
    for q in queries:
        assert not re.search(r"\$(?!\d)", q.expr), q
        assert metric_names(q.expr), q


# ---------------------------------------------------------------------- the alert rules


def load_rules() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"]
    return [rule for group in groups for rule in group["rules"]]


@pytest.mark.tools("promtool")
def test_promtool_check_rules_accepts_the_rules():
    out = subprocess.run([tool("promtool"), "check", "rules", str(RULES)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in out.stdout


def test_every_alert_has_a_duration_a_severity_and_annotations():
    rules = load_rules()
    assert {r["alert"] for r in rules} == ALERTS
    for rule in rules:
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert set(rule["annotations"]) == {"summary", "description"}, rule["alert"]
        assert all(rule["annotations"].values()), rule["alert"]
    assert "up{job=\"moed\"}" in next(r["expr"] for r in rules if r["alert"] == "MoedDown")


def rule_test_cases() -> list[tuple[str, str, bool]]:
    """(alertname, eval_time, fires) of every alert_rule_test entry of alerts_test.yml."""
    tests = yaml.safe_load(RULES_TEST.read_text(encoding="utf-8"))["tests"]
    return [(case["alertname"], case["eval_time"], bool(case["exp_alerts"]))
            for test in tests for case in test["alert_rule_test"]]


def promtool_test(directory: Path) -> subprocess.CompletedProcess:
    return subprocess.run([tool("promtool"), "test", "rules", "alerts_test.yml"], cwd=directory,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.tools("promtool")
def test_promtool_test_rules_passes_with_a_firing_and_a_silent_case_per_alert():
    cases = rule_test_cases()
    assert {name for name, _, fires in cases if fires} == ALERTS
    assert {name for name, _, fires in cases if not fires} == ALERTS
    out = promtool_test(RULES.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


@pytest.mark.tools("promtool")
@pytest.mark.parametrize("mutation, expr", [("never", "vector(1) > 2"), ("always", "vector(1)")])
def test_rule_tests_fail_when_the_alerts_never_or_always_fire(tmp_path, mutation, expr):
    """Every firing case fails when its alert never fires; every alert has a silent case
    that fails when it always fires. So each case checks something."""
    document = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    for group in document["groups"]:
        for rule in group["rules"]:
            rule["expr"] = expr
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(document), encoding="utf-8")
    shutil.copy(RULES_TEST, tmp_path / "alerts_test.yml")
    out = promtool_test(tmp_path)
    assert out.returncode != 0
    failed = set(re.findall(r"alertname: (\w+), time: (\w+),", out.stdout + out.stderr))
    cases = rule_test_cases()
    if mutation == "never":
        assert {(name, t) for name, t, fires in cases if fires} <= failed
    else:
        assert {name for name, t, fires in cases if not fires and (name, t) in failed} == ALERTS


def rule_metric_names() -> set[str]:
    return set().union(*(metric_names(rule["expr"]) for rule in load_rules()))


def dashboard_metric_names() -> set[str]:
    dashboard = load_dashboard()
    names = set().union(*(metric_names(q.expr) for q in dashboard_queries(dashboard)))
    for query in variable_queries(dashboard):
        m = re.fullmatch(r"label_values\((\w+), *\w+\)", query)
        assert m, query
        names.add(m.group(1))
    return names


# ---------------------------------------------------------------------- live: moed + Prometheus

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # loopback: no proxy


def http_get(url: str, params: dict | None = None) -> tuple[int, bytes]:
    if params:
        url += "?" + urllib.parse.urlencode(params)
    try:
        with OPENER.open(url, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read()


def scraped_names(text: str) -> set[str]:
    """The sample names (`_bucket`, `_total`, ... included) of a text-format scrape."""
    return {name for name, _ in parse_scrape(text)[1]}


def static_scrape(target: str) -> list[dict]:
    """A scrape configuration of one target as job `moed`."""
    return [{"job_name": "moed", "static_configs": [{"targets": [target]}]}]


class Prometheus:
    """A real Prometheus server on loopback with these scrape configurations, every second,
    and the alert rules loaded; `lines` is its log, read as it arrives."""

    def __init__(self, workdir: Path, scrape_configs: list[dict]):
        self.url = f"http://127.0.0.1:{free_port()}"
        config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                             "evaluation_interval": "1s"},
                  "rule_files": [str(RULES)],
                  "scrape_configs": scrape_configs}
        (workdir / "prometheus.yml").write_text(json.dumps(config), encoding="utf-8")  # JSON is YAML
        self.proc = subprocess.Popen(
            [tool("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._closed = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        with self._cond:
            self._cond.wait_for(lambda: self._ready() or self._closed, DEADLINE_S)
            assert self._ready(), "Prometheus did not start:\n" + self.log()

    def _read(self) -> None:
        for line in self.proc.stderr:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _ready(self) -> bool:
        return any("Server is ready to receive web requests" in line for line in self.lines)

    def log(self) -> str:
        with self._cond:
            return "".join(self.lines[-30:])

    def api(self, path: str, **params) -> dict:
        status, body = http_get(self.url + path, params)
        answer = json.loads(body)
        assert "status" in answer, (status, body[:500])
        return answer

    def query(self, expr: str, at: float) -> dict:
        """An instant query at `at` (Unix seconds): the API's whole answer."""
        return self.api("/api/v1/query", query=expr, time=f"{at:.3f}")

    def up_targets(self) -> set[str]:
        """The instances (host:port) of the targets whose last scrape succeeded."""
        targets = self.api("/api/v1/targets")["data"]["activeTargets"]
        return {t["labels"]["instance"] for t in targets if t["health"] == "up"}

    def value(self, expr: str, at: float) -> float | None:
        """The value of a one-sample instant query (None: no sample)."""
        answer = self.query(expr, at)
        assert answer["status"] == "success", (expr, answer)
        result = answer["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)
        self._reader.join(60)
        self.proc.stderr.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("telemetry") / "model", arch="qwen3_moe", layers=4,
                      experts=16, top_k=4, hidden=128, intermediate=64, dtype="bf16", seed=0)


class Moed:
    """A running `moed serve` streaming experts through a cache near its minimum, and the
    tokens generated for the requests sent to it so far."""

    def __init__(self, daemon):
        self.daemon = daemon
        self.instance = daemon.wait_event('metrics_listening')['address']   # host:port
        self.metrics_url = f"http://{self.instance}/metrics"
        self.tokens = 0
        self.requests = 0

    def drive(self) -> None:
        """Two completions (8 tokens each) and one bad request (a 400)."""
        for prompt in ("The expert cache", "Prometheus scrapes moed"):
            status, answer = self.daemon.json("POST", "/v1/completions", {
                "model": "model", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True})
            assert status == 200, answer
            self.tokens += answer["usage"]["completion_tokens"]
            self.requests += 1
        status, answer = self.daemon.json("POST", "/v1/completions", {
            "model": "model", "prompt": "x", "max_tokens": -1})
        assert status == 400, answer

    def scrape(self) -> str:
        status, body = http_get(self.metrics_url)
        assert status == 200, body[:500]
        return body.decode()


def start_moed(model_dir: Path) -> Moed:
    config = load_config(model_dir)
    minimum = minimum_cache_bytes(ExpertLayout(Checkpoint(model_dir), config), config)
    return Moed(Daemon(model_dir, short_dir(), "--expert-cache-bytes", str(minimum * 3 // 2),
                       "--threads", "1"))


def close_moed(m: Moed) -> None:
    """Stop it if it runs (exit 0 and the log contract asserted); remove its files."""
    try:
        if m.daemon.proc.poll() is None:
            assert m.daemon.stop() == 0
    finally:
        m.daemon.cleanup()
        m.daemon.proc.stdout.close()
        m.daemon.proc.stderr.close()


@pytest.fixture(scope="module")
def moed(model_dir):
    m = start_moed(model_dir)
    try:
        yield m
    finally:
        close_moed(m)


def test_every_metric_named_in_a_panel_or_a_rule_appears_in_the_scrape(moed):
    moed.drive()
    scraped = scraped_names(moed.scrape())
    named = dashboard_metric_names() | rule_metric_names()
    assert PROMETHEUS_MADE <= named
    missing = sorted(named - PROMETHEUS_MADE - scraped)
    assert not missing, f"named in a panel or a rule, not in moed's scrape: {missing}"


@dataclass
class Live:
    prometheus: Prometheus
    at: float                   # the instant (Unix seconds) every panel query is evaluated at
    missing: set[str]           # metric names the dashboard or rules use that moed lacks


def finite(answer: dict) -> bool:
    """Whether an instant query's answer has a sample with a finite value."""
    data = answer["data"]
    if data["resultType"] == "scalar":
        return math.isfinite(float(data["result"][1]))
    return any(math.isfinite(float(r["value"][1])) for r in data["result"])


def drive_until_numbers(prometheus: Prometheus, moeds: list[Moed], wanted: list[Query],
                        numbers=lambda q, answer: finite(answer)) -> float:
    """Drive requests into every daemon until a scrape shows every token each generated so
    far and, at that instant, `numbers(query, answer)` holds for every wanted query (the
    4 s rate windows hold two scrapes around traffic); returns that instant."""
    pending: list[Query] = []

    def scraped_and_numbers():
        at = time.time()
        for m in moeds:
            tokens = prometheus.value(f'sum(moed_generation_tokens_total{{instance="{m.instance}"}})', at)
            if tokens is None or tokens < m.tokens:
                return None                         # the last requests are not scraped yet
            assert tokens == m.tokens
        pending[:] = [q for q in wanted if not numbers(q, prometheus.query(q.expr, at))]
        if pending:
            for m in moeds:                         # the traffic left the rate windows: more
                m.drive()
            return None
        return at

    for m in moeds:
        m.drive()
    return wait_until(scraped_and_numbers, "scrapes with numbers in every wanted panel",
                      lambda: "\n".join(map(str, pending)) + "\n" + prometheus.log())


@pytest.fixture(scope="module")
def live(moed, tmp_path_factory):
    """Prometheus scraping moed; traffic until the fleet, serving and expert panels have numbers.

    Waits (by polling Prometheus' API) for the target to be up, then drives requests until
    every fleet, serving and expert query that names only metrics moed has returns a finite
    number."""
    prometheus = Prometheus(tmp_path_factory.mktemp("prometheus"), static_scrape(moed.instance))
    try:
        wait_until(prometheus.up_targets, "moed's target to be up", prometheus.log)
        missing = (dashboard_metric_names() | rule_metric_names()) - PROMETHEUS_MADE \
            - scraped_names(moed.scrape())
        assert "moed_generation_tokens_total" not in missing, sorted(missing)
        wanted = [q for q in dashboard_queries(load_dashboard())
                  if q.row in ROWS_WITH_DATA and not metric_names(q.expr) & missing]
        at = drive_until_numbers(prometheus, [moed], wanted)
        yield Live(prometheus, at, missing)
    finally:
        prometheus.stop()


@pytest.mark.tools("prometheus")
def test_every_panel_query_parses_and_fleet_serving_and_expert_panels_return_data(live):
    failures = []
    for q in dashboard_queries(load_dashboard()):
        answer = live.prometheus.query(q.expr, live.at)
        if answer["status"] != "success":
            failures.append(f"{q}\n    -> {answer.get('errorType')}: {answer.get('error')}")
        elif q.row in ROWS_WITH_DATA and not finite(answer):
            failures.append(f"{q}\n    -> no data ({answer['data']['result']}); metrics moed "
                            f"lacks: {sorted(metric_names(q.expr) & live.missing)}")
    assert failures == [], "\n".join(failures)


@pytest.mark.tools("prometheus")
def test_the_rules_load_into_prometheus_and_evaluate_without_error(live):
    def evaluated():
        groups = live.prometheus.api("/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return rules if all(r["health"] != "unknown" for r in rules) else None
    rules = wait_until(evaluated, "every rule to be evaluated", live.prometheus.log)
    assert {r["name"] for r in rules} == ALERTS
    assert [(r["name"], r["health"], r.get("lastError", "")) for r in rules
            if r["health"] != "ok"] == []
    firing = {a["labels"]["alertname"] for a in live.prometheus.api("/api/v1/alerts")["data"]["alerts"]}
    assert not firing & {"MoedDown", "MoedExpertReadErrors", "MoedHighErrorRatio"}, firing


# ---------------------------------------------------------------------- live: a fleet of two


def fleet_scrape_configs(targets_file: Path) -> list[dict]:
    """The shipped `moed` job (telemetry/prometheus/prometheus.yml), discovering its
    targets in `targets_file` instead of /etc/prometheus/moed-targets/."""
    config = yaml.safe_load(SCRAPE_CONFIG.read_text(encoding="utf-8"))
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "moed"]
    (discovery,) = job["file_sd_configs"]
    discovery["files"] = [str(targets_file)]
    return [job]


@pytest.mark.tools("promtool")
def test_promtool_accepts_the_shipped_scrape_configuration(tmp_path):
    config = yaml.safe_load(SCRAPE_CONFIG.read_text(encoding="utf-8"))
    assert config["rule_files"] == ["/etc/prometheus/moed-alerts.yml"]
    config["rule_files"] = [str(RULES)]                 # where the rules are in this tree
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
    out = subprocess.run([tool("promtool"), "check", "config", str(tmp_path / "prometheus.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr


@dataclass
class Fleet:
    prometheus: Prometheus
    moeds: list[Moed]
    at: float


def per_instance(query: Query) -> bool:
    """Whether a panel draws one series per instance (its legend names the instance)."""
    return "{{instance}}" in query.legend


def instances(answer: dict) -> set[str]:
    """The instances of an instant query's finite samples."""
    return {r["metric"].get("instance") for r in answer["data"]["result"]
            if math.isfinite(float(r["value"][1]))}


@pytest.fixture(scope="module")
def fleet(moed, model_dir, tmp_path_factory):
    """moed and a second daemon, found by Prometheus in a file (the shipped job's file-based
    discovery); traffic until every Fleet query has numbers, one series per daemon for the
    panels drawn per instance."""
    second = start_moed(model_dir)
    workdir = tmp_path_factory.mktemp("fleet")
    moeds = [moed, second]
    (workdir / "targets.yml").write_text(
        yaml.safe_dump([{"targets": [m.instance for m in moeds]}]), encoding="utf-8")
    prometheus = Prometheus(workdir, fleet_scrape_configs(workdir / "targets.yml"))
    try:
        every = {m.instance for m in moeds}
        wait_until(lambda: prometheus.up_targets() == every, "both targets to be up", prometheus.log)
        wanted = [q for q in dashboard_queries(load_dashboard()) if q.row == "Fleet"]

        def numbers(query: Query, answer: dict) -> bool:
            return instances(answer) == every if per_instance(query) else finite(answer)
        at = drive_until_numbers(prometheus, moeds, wanted, numbers)
        yield Fleet(prometheus, moeds, at)
    finally:
        prometheus.stop()
        close_moed(second)


def fleet_panel(title: str) -> list[Query]:
    return [q for q in dashboard_queries(load_dashboard()) if q.panel == title]


@pytest.mark.tools("prometheus")
def test_every_panel_query_runs_on_a_fleet_and_the_fleet_row_shows_each_daemon(fleet):
    every = {m.instance for m in fleet.moeds}
    failures = []
    for q in dashboard_queries(load_dashboard()):
        answer = fleet.prometheus.query(q.expr, fleet.at)
        if answer["status"] != "success":
            failures.append(f"{q}\n    -> {answer.get('errorType')}: {answer.get('error')}")
        elif q.row == "Fleet" and per_instance(q) and instances(answer) != every:
            failures.append(f"{q}\n    -> instances {instances(answer)}, not {every}")
    assert failures == [], "\n".join(failures)
    up, scraped = fleet_panel("Instances up")
    assert (fleet.prometheus.value(up.expr, fleet.at),
            fleet.prometheus.value(scraped.expr, fleet.at)) == (2, 2)
    (tokens,) = fleet_panel("Fleet tokens per second")
    (by_instance,) = fleet_panel("Tokens per second by instance")
    total = sum(float(r["value"][1]) for r in
                fleet.prometheus.query(by_instance.expr, fleet.at)["data"]["result"])
    assert fleet.prometheus.value(tokens.expr, fleet.at) == pytest.approx(total) and total > 0


@pytest.mark.tools("prometheus")
def test_a_daemon_down_shows_in_the_fleet_row_and_its_alerts_go_pending(fleet):
    survivor, victim = fleet.moeds
    victim.daemon.kill()
    wait_until(lambda: fleet.prometheus.up_targets() == {survivor.instance},
               "the killed daemon's target to be down", fleet.prometheus.log)
    up, scraped = fleet_panel("Instances up")
    at = time.time()
    assert (fleet.prometheus.value(up.expr, at), fleet.prometheus.value(scraped.expr, at)) == (1, 2)
    (by_instance,) = fleet_panel("Up by instance")
    assert {r["metric"]["instance"]: float(r["value"][1]) for r in
            fleet.prometheus.query(by_instance.expr, at)["data"]["result"]} == {
        survivor.instance: 1.0, victim.instance: 0.0}

    def pending():
        alerts = fleet.prometheus.api("/api/v1/alerts")["data"]["alerts"]
        found = {(a["labels"]["alertname"], a["labels"].get("instance"), a["state"]) for a in alerts}
        return found if {("MoedDown", victim.instance, "pending"),
                         ("MoedFleetHalfDown", None, "pending")} <= found else None
    found = wait_until(pending, "MoedDown and MoedFleetHalfDown to be pending", fleet.prometheus.log)
    assert not {a for a in found if a[0] == "MoedDown" and a[1] != victim.instance}, found
