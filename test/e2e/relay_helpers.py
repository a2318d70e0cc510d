"""Helpers shared by the relay e2e tests."""

from __future__ import annotations

import contextlib
import os
import shlex
import warnings
from collections.abc import Iterator

import psutil
import pytest
import requests
from launcher_zygote import launcher_env, start_launcher

# ALL_SELECTED: the relay config that recomputes every span token in every layer, which
# must equal standard (the product's own, as `sglang-relay bench quantized` sends it)
from sglang_relay.bench.quantized import ALL_SELECTED
from sglang_relay.errors import RelayError
from sglang_relay.process import ServerProcess

# extra flags for every e2e server, e.g. "--dtype float32" on a GPU (docs/gpu.md)
EXTRA_ARGS = shlex.split(os.environ.get("SGLANG_RELAY_TEST_SERVER_ARGS", ""))
# the session server's KV pool (conftest.py), two contexts of the embedded model
E2E_KV_TOKENS = 16384


# graph-mode decode on the CPU: one captured batch size keeps the compile short on 2 cores;
# batches of 2+ decode eagerly
GRAPH_ARGS = [
    "--enable-torch-compile",
    "--cuda-graph-bs-decode",
    "1",
    "--torch-compile-max-bs",
    "1",
]

# a server rule that captures the stream (layer 2) in decode: context masses at layer 2
# times the last-row probe, one cap per request
CONTEXT_RULE_AT_2 = {
    "l_start": 0, "l_det": 0, "l_end": -1, "signal": "context", "l_ctx": 2, "tau_dev": 0.0,
    "first_k": 0, "l_suf": 0, "budget": "request", "probe": 0.25,
}  # fmt: skip
# a request's rule: the stored hidden state at layer 2, detection (fresh K/V) at 3
DEVIATION_AT_3 = {
    "l_start": 2, "l_det": 3, "first_k": 4, "tau_dev": 1.0, "l_suf": 0, "signal": "value",
    "budget": "span", "probe": None,
}  # fmt: skip


class PreloadedServerProcess(ServerProcess):
    """A test server whose launcher forks from this test process's preloaded parent
    (``launcher_zygote``: SGLang's server modules imported once per test process), or is
    spawned where that parent cannot serve it."""

    forked = True  # False: spawned as `ServerProcess` spawns, with the same environment

    def _start_child(self, command, log, env):
        env = launcher_env(self.env)
        forked = start_launcher(command, log.name, env) if self.forked else None
        return forked if forked is not None else super()._start_child(command, log, env)


def server_fixture(
    *flags: str,
    kv_tokens: int = 8192,
    env: dict[str, str] | None = None,
    scope: str = "module",
    needs: str | None = None,
):
    """A pytest fixture of one real server on the embedded model (``model_dir``): a KV pool
    of ``kv_tokens``, ``flags`` and ``env`` added; the fixture's name is the name it is
    assigned to. ``needs``: a module the server cannot run without (skipped if absent)."""

    @pytest.fixture(scope=scope)
    def fixture(model_dir):
        if needs is not None:
            pytest.importorskip(needs)
        args = ["--model-path", str(model_dir), "--max-total-tokens", str(kv_tokens), *flags]
        with running_server(args, env=env) as proc:
            yield proc

    return fixture


@contextlib.contextmanager
def running_server(args: list[str], env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """A real server on loopback (``args`` + ``EXTRA_ARGS``, ``env`` added to its
    environment); on exit it is stopped and no process of its group may be left behind."""
    proc = _started(args, env)
    group = [proc.proc.pid] + [c.pid for c in psutil.Process(proc.proc.pid).children(True)]
    try:
        yield proc
    finally:  # a failing test must not leave a server (and its memory) behind
        proc.stop()
    alive = [pid for pid in group if psutil.pid_exists(pid) and _not_zombie(pid)]
    assert not alive, f"server processes left behind: {alive}\n{proc.log_tail()}"


# SGLang's launcher's report of a rank that failed before it was ready
RANK_DIED = "scheduler died during initialization"


def _started(args: list[str], env: dict[str, str] | None) -> ServerProcess:
    """A started server; where a rank died during its start-up, started once more, spawned
    (not forked from the preloaded parent), with a warning that carries the first error in
    its log. The landing CI of 2026-12-07 lost a TP=2 server so (a fresh launcher: serve's
    checks set SGLANG_CPU_OMP_THREADS_BIND for it, which the parent read); its log was not
    kept, and six local starts, beside other servers too, did not repeat it."""
    proc = PreloadedServerProcess([*args, *EXTRA_ARGS], env=env)
    try:
        return proc.start(timeout=600)
    except RelayError as exc:
        if RANK_DIED not in str(exc):
            raise
        warnings.warn(f"a server's rank died during start-up; spawned again: {exc}", stacklevel=4)
    proc = PreloadedServerProcess([*args, *EXTRA_ARGS], env=env)
    proc.forked = False
    return proc.start(timeout=600)


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def chat(tok, system: str, user: str) -> str:
    return tok.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": user}],
        tokenize=False,
        add_generation_prompt=True,
    )


def generate(url, text, n=16, relay=None, logprobs=False, **extra):
    # long generations are upstream outputs: make their length deterministic
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": n >= 100}
    if relay is not None:
        params["custom_params"] = {"relay": relay}
    body = {"text": text, "sampling_params": params, **extra}
    if logprobs:
        body.update(return_logprob=True, top_logprobs_num=5)
    resp = requests.post(url + "/generate", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def review_prompt(tok, span: list[int]) -> tuple[list[int], int]:
    """A reviewer's chat prompt (token ids) that pastes ``span`` as the answer to review,
    and where the span starts in it."""
    head = tok(
        "<|im_start|>system\nYou are a strict reviewer.<|im_end|>\n<|im_start|>user\n"
        "Review this answer:\n\n"
    ).input_ids
    tail = tok("\n\nList its mistakes.<|im_end|>\n<|im_start|>assistant\n").input_ids
    return head + span + tail, len(head)


def generate_ids(url: str, ids: list[int], n: int, relay=None, headers=None, **extra) -> dict:
    """Greedy ``n`` tokens after token ids ``ids`` (EOS ignored), ``relay`` as the
    request's relay option, ``headers`` as extra HTTP headers."""
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    if relay is not None:
        params["custom_params"] = {"relay": relay}
    body = {"input_ids": ids, "sampling_params": params, **extra}
    resp = requests.post(url + "/generate", json=body, headers=headers, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def decoded_upstream(url: str, ref, up_ids: list[int], n: int, upstreams: dict | None = None):
    """The server's greedy decode of ``n`` tokens after ``up_ids``, checked equal to the
    reference executor's, whose record (span, decode KV) it returns. ``upstreams``: a dict a
    module keeps, so each upstream prompt is decoded once there and the tests after the
    first relay its span, still stored on the server (a 96-token decode is ~9 s here, and
    the reference's as much again)."""
    from sglang_relay.core import reference as R

    key = (url, tuple(up_ids), n)
    if upstreams is not None and key in upstreams:
        return upstreams[key]
    upstream = generate_ids(url, up_ids, n)
    record = R.generate(ref, [up_ids], len(upstream["output_ids"]))[0]
    assert record.output == upstream["output_ids"]  # the same spans on both sides
    if upstreams is not None:
        upstreams[key] = record
    return record


def relay_one_upstream(
    url: str, ref, cfg, relay=None, upstreams: dict | None = None
) -> tuple[dict, object, list[int]]:
    """Through the server: an upstream of 96 greedy tokens after 40 fixed ids, then a
    downstream prompt embedding its output (span) between other ids, with ``relay`` as the
    request's option. Checks the upstream equals the reference executor's greedy decode
    and that the span was relayed whole, then returns ``(downstream response, the
    reference executor's relay prefill of the same prompt under cfg, the span)``.
    ``upstreams``: as :func:`decoded_upstream`."""
    from sglang_relay.core import reference as R

    record = decoded_upstream(url, ref, list(range(1000, 1040)), 96, upstreams)
    span = record.span_tokens
    head, tail = list(range(2000, 2023)), list(range(3000, 3011))
    prompt = head + span + tail
    served = generate_ids(url, prompt, 4, relay, return_logprob=True, top_logprobs_num=5)
    info = served["meta_info"]["relay"]
    assert info["fallback"] is None and info["reused_tokens"] == len(span), info
    occ = R.SpanOccurrence(len(head), record, 0, len(span))
    return served, R.relay_prefill(ref, prompt, [occ], cfg), span


def assert_matches_reference(served: dict, result, tol: float = 2e-3) -> None:
    """The server's selection, reuse and first-token logprobs equal the reference's."""
    import math

    import pytest

    info = served["meta_info"]["relay"]
    assert sum(result.selected) == pytest.approx(info["selected_tokens"], abs=1)
    assert result.reuse_rate == pytest.approx(info["reuse_rate"], abs=0.01)
    ref_lp = result.logits[-1].double().log_softmax(-1)
    for lp, tid, _ in served["meta_info"]["output_top_logprobs"][0]:
        assert math.isclose(lp, float(ref_lp[tid]), abs_tol=tol), (tid, lp, float(ref_lp[tid]))


def assert_all_selected_equals_standard(
    url: str, span: list[int], n: int = 8, *, relayed: bool = True
) -> None:
    """The all-selected oracle (every span token recomputed in every layer) through the
    server: the same tokens and logprobs as standard prefill of the same prompt, and (with
    ``relayed``) the whole span relayed."""
    import math

    prompt = list(range(4000, 4017)) + span + list(range(3000, 3011))
    relay = {"method": "relay", "config": ALL_SELECTED}
    oracle = generate_ids(url, prompt, n, relay, return_logprob=True)
    std = generate_ids(url, prompt, n, "standard", return_logprob=True)
    if relayed:
        assert oracle["meta_info"]["relay"]["reused_tokens"] == len(span)
    assert oracle["output_ids"] == std["output_ids"]
    got = [x[0] for x in oracle["meta_info"]["output_token_logprobs"]]
    want = [x[0] for x in std["meta_info"]["output_token_logprobs"]]
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(got, want, strict=True))


def relay_info(url):
    return requests.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]["relay"]


def first_logprobs(out) -> dict[int, float]:
    return {tid: lp for lp, tid, _ in out["meta_info"]["output_top_logprobs"][0]}


# ---- relay scope tests: one upstream prompt for all, outputs pasted downstream
SCOPE_UP_IDS = list(range(1000, 1040))  # every upstream asks the same, so outputs are identical
SCOPE_UP_TOKENS = 48  # spans of 47 tokens (>= min_span 32)


def scoped_upstream(url, salt, relay):
    extra = {"cache_salt": salt} if salt else {}
    return generate_ids(url, SCOPE_UP_IDS, SCOPE_UP_TOKENS, relay, **extra)["output_ids"]


def scoped_downstream(url, span, salt, relay, tag):
    prompt = [2000 + tag, *range(2001, 2020), *span, *range(3000, 3009)]
    extra = {"cache_salt": salt} if salt else {}
    return generate_ids(url, prompt, 4, relay, return_logprob=True, **extra)
