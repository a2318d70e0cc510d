"""Tensor-parallel agreement over a real gloo group of two processes: a rank without a plan
for an extend batch still takes part in the plan check (before, it skipped the collective
its neighbour waited in), a mismatch is seen by both ranks, and relay turned off on one
rank turns off on both."""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_relay.runtime.forward.extend import NO_PLAN
from sglang_relay.runtime.forward.tp import TPSync
from sglang_relay.runtime.runtime import RelayRuntime


class _Group:
    """The two attributes of SGLang's GroupCoordinator TPSync reads, over the default
    (gloo) process group."""

    def __init__(self) -> None:
        self.world_size = dist.get_world_size()
        self.rank_in_group = dist.get_rank()
        self.cpu_group = dist.group.WORLD

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t


def _worker(rank: int, port: int, cases, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=_timeout())
    tp = TPSync(_Group())
    out = []
    for has_plan, off in cases:
        discarded: list[str] = []
        plan = None
        if has_plan[rank]:
            owner = SimpleNamespace(name=f"r{rank}")
            plan = SimpleNamespace(owners=[owner], fingerprint=[1, 7, 3, 5, 9, 3, 5, 9])
        me = SimpleNamespace(
            tp=tp,
            disabled="off here" if off[rank] else None,
            _discard=lambda stats, reason, d=discarded: d.append(reason),
        )
        me.disable = lambda reason, me=me: setattr(me, "disabled", reason)
        agreed = RelayRuntime._tp_agreed(me, plan)
        out.append((agreed, discarded, me.disabled))
    results[rank] = out
    dist.destroy_process_group()


def _two_ranks(worker, *args) -> dict:
    """``worker(rank, port, *args, results)`` in two forked processes over gloo; their
    results by rank (each must exit cleanly)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    results = ctx.Manager().dict()
    procs = [ctx.Process(target=worker, args=(r, port, *args, results)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return dict(results)


def _timeout():
    import datetime

    return datetime.timedelta(seconds=60)


def test_every_rank_takes_part_in_the_plan_check(monkeypatch):
    from sglang_relay.runtime import runtime

    # a plan's fingerprint is whatever the (fake) plan carries
    monkeypatch.setattr(runtime, "plan_fingerprint", lambda plan: plan.fingerprint)
    on = (False, False)
    cases = [((False, False), on), ((True, False), on), ((False, True), on), ((True, True), on)]
    # relay off on rank 1 only (it plans nothing): off on both, the plan falls back as such
    cases.append(((True, False), (False, True)))
    results = _two_ranks(_worker, cases)
    for rank in range(2):
        got = results[rank]
        assert got[0] == (True, [], None)  # neither has a plan: plain forward, no fallback
        for case in (1, 2):  # one rank has a plan, the other none: both see the mismatch
            agreed, discarded, disabled = got[case]
            assert agreed is False and disabled is None
            assert discarded == (["tp_mismatch: plans differ across ranks"]
                                 if cases[case][0][rank] else [])  # fmt: skip
        assert got[3] == (True, [], None)  # the same plan on both
        agreed, discarded, disabled = got[4]
        assert agreed is False
        assert discarded == (["relay_disabled"] if rank == 0 else [])
        assert disabled == ("relay turned itself off on another TP rank" if rank == 0
                            else "off here")  # fmt: skip
    assert NO_PLAN != [1, 7, 3, 5, 9, 3, 5, 9]


def _tag_worker(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=_timeout())
    tp = TPSync(_Group())
    out = []
    # rank 1 skipped the plan check (it failed in between) and is at the restore agreement
    out.append(tp.bounds([0, 3, 9] if rank == 0 else [1], "plan" if rank == 0 else "restore"))
    out.append(tp.bounds([5, rank], "plan"))  # the next exchange pairs correctly again
    out.append(tp.bounds([4, 2], "plan"))
    results[rank] = (out, dict(tp.counters))
    dist.destroy_process_group()


def test_ranks_at_different_exchanges_disagree_instead_of_pairing_values():
    """A rank that skipped an exchange does not pair its values with another exchange's:
    both ranks see bounds that disagree (no hang, no silent agreement), and the exchanges
    after it line up again."""
    results = _two_ranks(_tag_worker)
    for rank in range(2):
        (first, second, third), counters = results[rank]
        n = 3 if rank == 0 else 1
        assert first == ([0] * n, [1] * n)
        assert second == ([5, 0], [5, 1]) and third == ([4, 2], [4, 2])
        assert counters["tp_exchange_mismatches"] == 1


def _failure_worker(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=_timeout())
    tp = TPSync(_Group())
    mine = [
        (None, None),  # no rank failed
        ("memory: relay needs 9 MiB of scratch, 0 MiB free", None),  # rank 0 only
        (None, "error: OutOfMemoryError"),  # rank 1 only
        ("error: KeyError", "memory: relay needs 1 MiB of scratch, 0 MiB free"),  # both
    ]
    results[rank] = [tp.worst_failure(case[rank], "prepare") for case in mine]
    dist.destroy_process_group()


def test_a_step_that_failed_on_one_rank_is_a_failure_on_every_rank():
    """Relay's steps before its first collective (its memory bound, the splice) may fail
    on one rank alone: every rank learns it in one exchange and falls back, each naming
    its own failure, or the kind of another rank's."""
    got = _two_ranks(_failure_worker)
    assert got[0] == [
        None,
        "memory: relay needs 9 MiB of scratch, 0 MiB free",
        "tp_mismatch: error on another TP rank",
        "error: KeyError",
    ]
    assert got[1] == [
        None,
        "tp_mismatch: memory on another TP rank",
        "error: OutOfMemoryError",
        "memory: relay needs 1 MiB of scratch, 0 MiB free",
    ]
