"""What the machine itself did during a timed run, so a run slowed by something outside it
shows in its row: the share of CPU time the hypervisor gave to other guests (``steal``), the
share left idle, and the load average, from ``/proc`` (Linux; elsewhere nothing). On a
shared VM two runs of the same work minutes apart can differ by more than two methods do
(research/log.md, 2026-12-07)."""

from __future__ import annotations

import os
from pathlib import Path

STAT = Path("/proc/stat")
# /proc/stat's aggregate "cpu" line: user nice system idle iowait irq softirq steal ...
IDLE, IOWAIT, STEAL = 3, 4, 7


def cpu_times(stat: Path = STAT) -> list[int] | None:
    """The aggregate CPU line of ``/proc/stat`` in clock ticks, or None where there is none."""
    try:
        with open(stat) as f:
            first = f.readline().split()
    except OSError:
        return None
    if not first or first[0] != "cpu":
        return None
    return [int(x) for x in first[1:9]]


class HostWatch:
    """Started at a run's start; :meth:`summary` at its end gives the run's shares."""

    def __init__(self, stat: Path = STAT) -> None:
        self.stat = stat
        self.start = cpu_times(stat)

    def summary(self) -> dict[str, float]:
        end = cpu_times(self.stat)
        if self.start is None or end is None:
            return {}
        spent = [b - a for a, b in zip(self.start, end, strict=True)]
        total = sum(spent)
        if total <= 0:
            return {}
        out = {
            "steal_share": round(spent[STEAL] / total, 4),
            "idle_share": round((spent[IDLE] + spent[IOWAIT]) / total, 4),
        }
        if hasattr(os, "getloadavg"):
            out["load_1m"] = round(os.getloadavg()[0], 2)
        return out
