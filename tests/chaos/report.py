"""What a chaos run saw: violations (deduplicated), operations, faults, recovery times.

:class:`ViolationBook` keeps one entry per (kind, subject) with how often and when it was
seen, because a periodic check reports a lasting violation on every snapshot.
:class:`ChaosReport` renders as text for the test log and as JSON for
``$DXPOOL_CHAOS_REPORT``.
"""

from __future__ import annotations

import json
import statistics
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.chaos.faults import FaultRecord
from tests.chaos.invariants import Violation


@dataclass
class Seen:
    violation: Violation
    phase: str
    first_s: float
    last_s: float
    count: int = 1

    def to_json(self) -> dict[str, Any]:
        return {
            **self.violation.to_json(),
            "phase": self.phase,
            "first_s": round(self.first_s, 3),
            "last_s": round(self.last_s, 3),
            "count": self.count,
        }


class ViolationBook:
    """Thread-safe, deduplicated violations; times are seconds since the run started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], Seen] = {}

    def add(self, violations: list[Violation], phase: str, at_s: float) -> None:
        with self._lock:
            for violation in violations:
                key = (str(violation.kind), violation.subject)
                seen = self._seen.get(key)
                if seen is None:
                    self._seen[key] = Seen(violation, phase, at_s, at_s)
                else:
                    seen.count += 1
                    seen.last_s = at_s

    def entries(self) -> list[Seen]:
        with self._lock:
            return sorted(self._seen.values(), key=lambda s: (s.first_s, str(s.violation.kind)))

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "min": round(min(values), 3),
        "median": round(statistics.median(values), 3),
        "max": round(max(values), 3),
    }


@dataclass
class ChaosReport:
    config: dict[str, Any]
    workload: dict[str, Any] = field(default_factory=dict)
    faults: list[dict[str, Any]] = field(default_factory=list)
    recovery: dict[str, dict[str, Any]] = field(default_factory=dict)
    checks: dict[str, Any] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    final: dict[str, Any] = field(default_factory=dict)
    violations: list[dict[str, Any]] = field(default_factory=list)

    @staticmethod
    def recovery_of(records: list[FaultRecord]) -> dict[str, dict[str, Any]]:
        """Per fault kind: how many, how many recovered, and the recovery seconds (plus
        each extra milestone, e.g. ``fenced_s``)."""
        by_kind: dict[str, list[FaultRecord]] = defaultdict(list)
        for record in records:
            by_kind[record.kind].append(record)
        result: dict[str, dict[str, Any]] = {}
        for kind, items in sorted(by_kind.items()):
            seconds = [r.recovery_s for r in items if r.recovery_s is not None]
            entry: dict[str, Any] = {
                "count": len(items),
                "recovered": len(seconds),
                "recovery_s": _summary(seconds),
            }
            marks: dict[str, list[float]] = defaultdict(list)
            for record in items:
                for name, value in record.marks.items():
                    marks[name].append(value)
            for name, values in sorted(marks.items()):
                entry[f"{name}_s"] = {**_summary(values), "seen": len(values)}
            result[kind] = entry
        return result

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "phases_s": self.phases,
            "workload": self.workload,
            "faults_by_kind": dict(Counter(f["kind"] for f in self.faults)),
            "recovery": self.recovery,
            "faults": self.faults,
            "checks": self.checks,
            "final": self.final,
            "violations": self.violations,
        }

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n")

    def render(self) -> str:
        lines = ["== dxpool chaos report"]
        cfg = self.config
        lines.append(
            "config: " + ", ".join(f"{k}={v}" for k, v in cfg.items() if not isinstance(v, dict))
        )
        lines.append("phases (s): " + ", ".join(f"{k}={v:.1f}" for k, v in self.phases.items()))
        lines.append(f"iterations: {self.workload.get('iterations', 0)}")
        lines.append("operations:")
        for op, codes in self.workload.get("operations", {}).items():
            lines.append(f"  {op:<14} " + ", ".join(f"{c}={n}" for c, n in sorted(codes.items())))
        lines.append(
            f"acknowledged composes: {self.workload.get('acknowledged_composes', 0)}, "
            f"released by the test: {self.workload.get('released', 0)}"
        )
        kinds = Counter(f["kind"] for f in self.faults)
        lines.append("faults: " + ", ".join(f"{k}={n}" for k, n in sorted(kinds.items())))
        lines.append("recovery (seconds from injection):")
        for kind, entry in self.recovery.items():
            parts = [f"recovered {entry['recovered']}/{entry['count']}"]
            parts += [
                f"{name} {_fmt(value)}" for name, value in entry.items() if name.endswith("_s")
            ]
            lines.append(f"  {kind:<18} " + "; ".join(parts))
        lines.append("checks: " + ", ".join(f"{k}={v}" for k, v in self.checks.items()))
        lines.append("final: " + ", ".join(f"{k}={v}" for k, v in self.final.items()))
        lines.append(f"violations: {len(self.violations)}")
        for v in self.violations:
            lines.append(
                f"  [{v['phase']} {v['first_s']:.1f}s x{v['count']}] {v['kind']} "
                f"{v['subject']}: {v['detail']}"
            )
        return "\n".join(lines)


def _fmt(value: dict[str, float]) -> str:
    if not value:
        return "-"
    body = "/".join(f"{value[k]:.2f}" for k in ("min", "median", "max") if k in value)
    seen = f" (n={value['seen']:.0f})" if "seen" in value else ""
    return f"{body}{seen}" if body else "-"


__all__ = ["ChaosReport", "Seen", "ViolationBook"]
