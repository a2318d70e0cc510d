"""Tensor parallel: every rank runs the same relay plan and selects the same tokens.

Under ``--tp N`` SGLang runs one scheduler per rank, each with its own tree cache, KV pool
(its slice of the KV heads) and, here, its own relay runtime. The schedulers are replicated
(rank 0 broadcasts the requests, every rank schedules the same batches), so span stores,
slot ledgers and plans are equal by construction; the layer loop's collectives (the
row-parallel ``o_proj`` / ``down_proj`` all-reduces) only work if every rank activates the
same rows. Two things would break that, and this module closes both:

* **Per-rank scores.** A rank sees only its KV heads, so its per-token deviation (and the
  attention mass behind influence) differs from its neighbours'. :meth:`TPSync.mean`
  all-reduces the scores of a span group before selection (one ``[S]`` float32 all-reduce
  per group per relay extend): every rank then ranks the same numbers.
* **Drift.** Replication is proven, not assumed: before any collective whose shape depends
  on the plan, :meth:`TPSync.agree` compares a fingerprint of the plan across ranks (MIN and
  MAX all-reduces of a few int64 on the CPU group); after selection it compares the
  selected rows the same way. Every rank sees the same MIN/MAX, so on a mismatch all ranks
  fall back to SGLang's forward together (``fallback: tp_mismatch``), never one alone.
"""

from __future__ import annotations

import zlib
from collections import Counter
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang_relay.runtime.sglang.views import GroupCoordinator

MOD = (1 << 61) - 1
# why a rank's step of a relay extend failed, as :meth:`TPSync.worst_failure` carries it
FAILURES = {"memory": 1, "error": 2}


def fingerprint(*tensors: torch.Tensor) -> list[int]:
    """A few int64 summarising index tensors (count, sum, position-weighted sum each)."""
    out: list[int] = []
    for t in tensors:
        v = t.to(torch.int64).flatten().cpu()
        weights = torch.arange(1, v.numel() + 1, dtype=torch.int64)
        out += [v.numel(), int(v.sum()) % MOD, int((v * weights).sum()) % MOD]
    return out


class TPSync:
    """The TP group's view for the relay runtime (one per scheduler process)."""

    def __init__(self, group: GroupCoordinator) -> None:
        self.group = group  # SGLang's GroupCoordinator for the TP group
        self.size = int(group.world_size)
        self.rank = int(group.rank_in_group)
        self.counters: Counter[str] = Counter()

    def mean(self, scores: torch.Tensor) -> torch.Tensor:
        """The TP-group mean of per-rank ``[S]`` scores (float32)."""
        self.counters["tp_score_reductions"] += 1
        return self.group.all_reduce(scores.float().contiguous()) / self.size

    def agree(self, values: list[int], what: str) -> bool:
        """Whether every rank holds the same ``values`` (collective: call on every rank)."""
        lo, hi = self.bounds(values, what)
        return lo == hi

    def bounds(self, values: list[int], what: str) -> tuple[list[int], list[int]]:
        """The element-wise MIN and MAX of ``values`` over the ranks (collective). Equal
        bounds: every rank holds the same. The exchange is tagged: the ranks first agree
        that each is at the same exchange (``what``) with as many values; if one is not
        (a rank failed between two exchanges and skipped one), no values are paired with
        another exchange's: every rank gets bounds that disagree everywhere (``hi`` all 1,
        ``lo`` all 0), and the next exchange starts aligned again."""
        self.counters[f"tp_{what}_checks"] += 1
        head_lo, head_hi = self._min_max([zlib.crc32(what.encode()), len(values)])
        if head_lo != head_hi:
            self.counters[f"tp_{what}_mismatches"] += 1
            self.counters["tp_exchange_mismatches"] += 1
            return [0] * len(values), [1] * len(values)
        lo, hi = self._min_max(values)
        if lo != hi:
            self.counters[f"tp_{what}_mismatches"] += 1
        return lo, hi

    def agree_plan(self, fp: list[int], disabled: bool) -> tuple[bool, str, bool]:
        """Whether every rank holds the plan of fingerprint ``fp`` (a rank without one
        sends ``NO_PLAN``, so no rank skips this collective): ``(agreed, the fallback
        reason when not, whether relay is off on some rank)``."""
        lo, hi = self.bounds([int(disabled), *fp], "plan")
        if lo == hi:
            return True, "", bool(hi[0])
        reason = "relay_disabled" if hi[0] else "tp_mismatch: plans differ across ranks"
        return False, reason, bool(hi[0])

    def worst_failure(self, failed: str | None, what: str) -> str | None:
        """The fallback reason of a step every rank ran (collective): this rank's own
        ``failed`` (``memory: ...``, ``error: ...``), else, when another rank's step
        failed, which kind, else None."""
        code = 0 if failed is None else FAILURES.get(failed.split(":")[0], len(FAILURES) + 1)
        worst = self.bounds([code], what)[1][0]
        if failed is not None or worst == 0:
            return failed
        kind = {v: k for k, v in FAILURES.items()}.get(worst, "an error")
        return f"tp_mismatch: {kind} on another TP rank"

    def _min_max(self, values: list[int]) -> tuple[list[int], list[int]]:
        """Element-wise MIN and MAX over the ranks in one all-reduce (MIN of the values and
        of their negations) on the CPU group."""
        n = len(values)
        t = torch.tensor([*values, *(-v for v in values)], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN,
                                     group=self.group.cpu_group)  # fmt: skip
        return t[:n].tolist(), (-t[n:]).tolist()

    def stats(self) -> dict[str, int]:
        return {"tp_size": self.size, "tp_rank": self.rank, **dict(self.counters)}


class TPMismatch(RuntimeError):
    """Ranks disagree on a plan or a selection: every rank falls back together."""
