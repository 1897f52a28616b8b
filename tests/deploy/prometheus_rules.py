"""ardit's Prometheus rules as the tests read them: the files, their rules, the shape of an alert."""

from __future__ import annotations

import re

import yaml

from tests.deploy.dashboard import ROOT

RULES = ROOT / "deploy" / "prometheus" / "rules"
RULE_FILES = sorted(RULES.glob("*.yml"))
# `<signal> <op> <number>`: the scrape test evaluates the signal against the running pair.
ALERT_EXPR = re.compile(r"(?P<signal>.+?)\s*(?P<op>==|!=|>=|<=|>|<)\s*(?P<threshold>-?[0-9.]+(?:e-?[0-9]+)?)", re.S)


def rules(kind: str) -> list[dict]:
    """Every rule of ``kind`` (``record`` or ``alert``), in file order."""
    return [
        rule
        for path in RULE_FILES
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
        if kind in rule
    ]
