"""Prometheus's own PromQL parser for the tests (tests/charts/promql: a Go program over
github.com/prometheus/prometheus/promql/parser, built once per Prometheus version into the cache): each
expression's selectors (metric and label matchers) and `by` groupings, or its parse error; and `selects`, the
label matchers applied to a series' labels as Prometheus applies them. The dashboard's queries and the KEDA
query the operator builds are checked with it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

PROMQL_SRC = Path(__file__).resolve().parent / "promql"
CACHE = Path(os.environ.get("GEMMA_CACHE", Path.home() / ".cache" / "gemma-rust-operator"))


def promql_version() -> str:
    m = re.search(r"github\.com/prometheus/prometheus (v\S+)", (PROMQL_SRC / "go.mod").read_text())
    return m.group(1)


@pytest.fixture(scope="session")
def promql_check() -> Path:
    """The parser binary, built once per Prometheus version into the cache."""
    binary = CACHE / f"promql-check-{promql_version()}" / "promql-check"
    if not binary.is_file():
        go = shutil.which("go") or "/usr/local/go/bin/go"
        binary.parent.mkdir(parents=True, exist_ok=True)
        tmp = binary.with_suffix(".tmp")
        env = {**os.environ, "GOTOOLCHAIN": "local", "CGO_ENABLED": "0", "GOFLAGS": "-mod=readonly -buildvcs=false -p=2"}
        p = subprocess.run([go, "build", "-trimpath", "-o", str(tmp), "."], cwd=PROMQL_SRC, env=env,
                           capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, f"building tests/charts/promql failed:\n{p.stdout}\n{p.stderr}"
        tmp.rename(binary)
    return binary


def parse_promql(binary: Path, exprs: list[str]) -> list[dict]:
    p = subprocess.run([str(binary)], input=json.dumps(exprs), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def selects(matchers: list[dict], labels: dict[str, str]) -> bool:
    for m in matchers:
        value = labels.get(m["name"], "")
        ok = {"=": value == m["value"], "!=": value != m["value"],
              "=~": re.fullmatch(m["value"], value) is not None,
              "!~": re.fullmatch(m["value"], value) is None}[m["type"]]
        if not ok:
            return False
    return True
