"""The operators' alert rules (deploy/prometheus/alerts.yml): valid, firing exactly as their cases say
(``promtool test rules``), built only on metrics the worker and poller export, each one tested and documented."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from workers.metrics import WorkerMetrics

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "deploy" / "prometheus" / "alerts.yml"
CASES = REPO / "tests" / "prometheus" / "alerts_test.yml"
OPERATIONS = REPO / "docs" / "operations.md"
METRIC = re.compile(r"\bvirtengine_hpc_[a-z0-9_]+")


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail(
            "promtool not found: it comes with Debian's prometheus package, which "
            "temporal-dev/install-system-deps.sh installs"
        )
    return found


def rules() -> list[dict[str, Any]]:
    loaded = yaml.safe_load(RULES.read_text())
    return [rule for group in loaded["groups"] for rule in group["rules"]]


def exported() -> set[str]:
    """Every sample name the project's metrics registry can expose (the same registry serves worker and poller)."""
    names: set[str] = set()
    for family in WorkerMetrics().registry.collect():
        if family.type == "counter":
            names |= {f"{family.name}_total", f"{family.name}_created"}
        elif family.type == "histogram":
            names |= {f"{family.name}_{suffix}" for suffix in ("bucket", "count", "sum", "created")}
        else:
            names.add(family.name)
    return names


def test_rules_are_valid_and_fire_as_their_cases_say() -> None:
    for command in (["check", "rules", str(RULES)], ["test", "rules", str(CASES)]):
        done = subprocess.run(
            [promtool(), *command], capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, f"promtool {' '.join(command)}:\n{done.stdout}{done.stderr}"


def test_rules_and_their_cases_use_only_metrics_the_processes_export() -> None:
    in_rules = {name for rule in rules() for name in METRIC.findall(rule["expr"])}
    cases = yaml.safe_load(CASES.read_text())
    in_cases = {
        name
        for case in cases["tests"]
        for series in case["input_series"]
        for name in METRIC.findall(series["series"])
    }
    assert in_rules, "the rules use the project's metrics"
    assert in_rules - exported() == set(), "rules on metrics nothing exports never fire"
    assert in_cases - exported() == set()
    assert in_rules <= in_cases, "every metric a rule reads is fed in some case"


def test_every_alert_has_a_case_and_is_documented() -> None:
    alerts = [rule["alert"] for rule in rules()]
    cases = yaml.safe_load(CASES.read_text())
    tested = {check["alertname"] for case in cases["tests"] for check in case["alert_rule_test"]}
    assert sorted(tested) == sorted(alerts)
    firing = {
        check["alertname"]
        for case in cases["tests"]
        for check in case["alert_rule_test"]
        if check["exp_alerts"]
    }
    assert firing == set(alerts), "each alert is seen firing, not only silent"
    docs = OPERATIONS.read_text()
    assert [a for a in alerts if f"`{a}`" not in docs] == [], (
        "docs/operations.md says what to do for each alert"
    )
