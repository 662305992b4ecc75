"""A small Dockerfile parser for the image tests and the chart's end-to-end test (which runs the operator
image's ENTRYPOINT as a local process): instructions with line continuations joined, comments dropped,
stages split at FROM, global ARG defaults expanded in FROM lines."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]

    def last(self, op: str) -> str:
        hits = self.all(op)
        assert hits, f"stage FROM {self.base} has no {op}"
        return hits[-1]

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for arg in self.all("ENV"):
            for token in shlex.split(arg):
                k, _, v = token.partition("=")
                out[k] = v
        return out

    def exec_form(self, op: str) -> list[str]:
        value = json.loads(self.last(op))
        assert isinstance(value, list), f"{op} must be in exec form (a JSON array), got {self.last(op)!r}"
        return value

    def runs(self) -> str:
        return "\n".join(self.all("RUN"))


@dataclass
class Dockerfile:
    args: dict[str, str]  # global ARGs (before the first FROM) with their defaults
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]


def parse_dockerfile(path: Path) -> Dockerfile:
    """Instructions with continuations joined and comments dropped; ${ARG} expanded in FROM lines."""
    logical, current = [], ""
    for line in path.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for instr in logical:
        op, _, rest = instr.strip().partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "FROM":
            expanded = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], rest)
            base, _, name = expanded.partition(" AS ")
            stages.append(Stage(base.strip(), name.strip() or None))
        elif op == "ARG" and not stages:
            k, _, v = rest.partition("=")
            args[k] = v
        else:
            assert stages, f"{path.name}: {op} before FROM"
            stages[-1].instructions.append((op, rest))
    return Dockerfile(args, stages)
