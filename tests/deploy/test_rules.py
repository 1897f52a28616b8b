"""deploy/prometheus/rules: valid for promtool, every alert unit-tested (tests/deploy/rules_test.yml),
every alert one signal against one threshold, and mounted where the shipped prometheus.yml looks.

promtool comes with Debian's prometheus package (`make prometheus`; `make test` runs it first): the tests
that run it are slow ones, so `make test-fast` needs nothing but the venv.
"""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest
import yaml

from tests.deploy.dashboard import ROOT
from tests.deploy.prometheus_rules import ALERT_EXPR, RULE_FILES, RULES, rules

UNIT_TESTS = Path(__file__).with_name("rules_test.yml")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool is missing: run `make prometheus` (make test does)")
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120, cwd=UNIT_TESTS.parent)


@pytest.mark.slow
def test_rule_files_are_valid():
    assert RULE_FILES
    result = promtool("check", "rules", *map(str, RULE_FILES))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_alert_unit_tests_pass():
    result = promtool("test", "rules", UNIT_TESTS.name)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test_that_fires_it():
    tests = yaml.safe_load(UNIT_TESTS.read_text())
    assert [(ROOT / "tests" / "deploy" / f).resolve() for f in tests["rule_files"]] == RULE_FILES
    fired = {
        case["alertname"] for test in tests["tests"] for case in test.get("alert_rule_test", []) if case["exp_alerts"]
    }
    assert {rule["alert"] for rule in rules("alert")} == fired


def test_every_alert_compares_one_signal_with_a_threshold_and_says_what_is_wrong():
    for rule in rules("alert"):
        assert ALERT_EXPR.fullmatch(rule["expr"].strip()), rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_compose_mounts_the_rules_where_prometheus_yml_looks_for_them():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = dict(volume.split(":")[:2] for volume in compose["services"]["prometheus"]["volumes"])
    config_source = next(source for source, target in mounts.items() if target == "/etc/prometheus/prometheus.yml")
    config = yaml.safe_load((ROOT / config_source).read_text())
    (pattern,) = config["rule_files"]
    rules_mount = next(target for source, target in mounts.items() if (ROOT / source).resolve() == RULES)
    inside = [str(PurePosixPath(rules_mount) / path.name) for path in RULE_FILES]
    assert all(fnmatch.fnmatch(path, pattern) for path in inside)
