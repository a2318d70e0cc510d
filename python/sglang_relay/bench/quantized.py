"""``sglang-relay bench quantized --url URL``: the check a quantized relay server must pass
before its method is trusted (docs/gpu.md runs it on a GPU for each served method; the CPU
tests run the same assertions, test/e2e/test_quantized.py).

Against a running relay server, for each of ``--prompts`` prompts (token ids, no
tokenizer needed): an upstream output is decoded, pasted between other ids, and the
downstream prompt is answered four ways, 6 greedy tokens with logprobs:

* relay (the server's default): the pasted output must be relayed (>= 90 % of it);
* standard prefill, cold (its own cache salt: nothing cached);
* standard prefill with its first 17 tokens a prefix hit (another salt, the head sent
  first): what SGLang itself gives when other rows share the matmul;
* the all-selected oracle (every span token recomputed in every layer).

SGLang's own gap (cold vs prefix hit) is the yardstick: a method that rounds activations
(FP8, int8) turns last-bit differences between two correct kernels into whole rounding
steps, so exact equality is not a property any implementation has. The check passes when
every paste relays, the oracle's tokens equal cold standard's wherever the prefix hit's do,
and the oracle's largest logprob gap is within ``max(1e-4, SGLang's own largest gap)``.
Prints one line per prompt and a verdict; exit code 1 on failure."""

from __future__ import annotations

import argparse
import json
from typing import Any

import requests

from sglang_relay.client import flush_cache

# every span token recomputed in every layer: relay's exactness oracle (docs/method.md)
ALL_SELECTED = {
    "l_start": 0, "l_det": 0, "l_end": -1, "top_ratio": 1.0, "max_ratio": None,
    "first_k": 0, "l_suf": 0,
}  # fmt: skip
HEAD = 17  # prompt tokens before the pasted span
TOLERANCE = 1e-4  # logprob agreement of two runs of the same arithmetic


def _generate(url: str, ids: list[int], n: int, relay: Any = None, **extra) -> dict:
    params: dict[str, Any] = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    if relay is not None:
        params["custom_params"] = {"relay": relay}
    body = {"input_ids": ids, "sampling_params": params, "return_logprob": True, **extra}
    resp = requests.post(url + "/generate", json=body, timeout=600)
    resp.raise_for_status()
    return resp.json()


def _logprobs(out: dict) -> list[float]:
    return [float(x[0]) for x in out["meta_info"]["output_token_logprobs"]]


def _gap(a: dict, b: dict) -> float:
    return max(abs(x - y) for x, y in zip(_logprobs(a), _logprobs(b), strict=True))


def check_prompt(url: str, k: int, n_up: int = 64, n_down: int = 6) -> dict[str, Any]:
    """One prompt's four answers and what they show (see the module doc)."""
    base = 1000 + 700 * k
    span = _generate(url, list(range(base, base + 40)), n_up)["output_ids"][:-1]
    head = list(range(base + 100, base + 100 + HEAD))
    prompt = [*head, *span, *range(base + 200, base + 211)]
    relayed = _generate(url, [base + 300, *prompt[1:]], n_down)["meta_info"]["relay"]
    cold = _generate(url, prompt, n_down, "standard", cache_salt=f"cold-{k}")
    _generate(url, head, 1, "standard", cache_salt=f"hit-{k}")
    hit = _generate(url, prompt, n_down, "standard", cache_salt=f"hit-{k}")
    oracle = _generate(url, prompt, n_down, {"method": "relay", "config": ALL_SELECTED})
    return {
        "prompt": k,
        "span_tokens": len(span),
        "relayed_tokens": relayed.get("reused_tokens", 0),
        "relay_fallback": relayed.get("fallback"),
        "cold_cached_tokens": cold["meta_info"].get("cached_tokens", 0),
        "hit_cached_tokens": hit["meta_info"].get("cached_tokens", 0),
        "oracle_reused_tokens": oracle["meta_info"]["relay"].get("reused_tokens", 0),
        "hit_tokens_equal": hit["output_ids"] == cold["output_ids"],
        "oracle_tokens_equal": oracle["output_ids"] == cold["output_ids"],
        "sglang_gap": _gap(cold, hit),
        "oracle_gap": _gap(oracle, cold),
    }


def verdict(info: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """The check's failures (empty: passed)."""
    fails = []
    if info.get("disabled"):
        fails.append(f"relay is disabled: {info['disabled']}")
    for r in rows:
        if r["relayed_tokens"] < 0.9 * r["span_tokens"]:
            fails.append(f"prompt {r['prompt']}: paste not relayed ({r['relay_fallback']})")
        if r["cold_cached_tokens"] or not r["hit_cached_tokens"]:
            fails.append(f"prompt {r['prompt']}: cold was cached or the prefix did not hit")
        if r["oracle_reused_tokens"] != r["span_tokens"]:
            fails.append(f"prompt {r['prompt']}: the oracle did not take the span")
        if r["hit_tokens_equal"] and not r["oracle_tokens_equal"]:
            fails.append(f"prompt {r['prompt']}: oracle tokens differ where SGLang's do not")
    yardstick = max([TOLERANCE] + [r["sglang_gap"] for r in rows])
    worst = max((r["oracle_gap"] for r in rows), default=0.0)
    if worst > yardstick:
        fails.append(f"oracle logprob gap {worst:.3g} > SGLang's own {yardstick:.3g}")
    return fails


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sglang-relay bench quantized", description=__doc__)
    parser.add_argument("--url", required=True, help="a running relay server")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--json", help="write the rows and the verdict here")
    args = parser.parse_args(argv)
    url = args.url.rstrip("/")
    state = requests.get(url + "/get_server_info", timeout=30).json()
    info = state["internal_states"][0]["relay"]
    print(f"linear method {info.get('linear_method')}, rows {info.get('linear_rows')}")
    # every measure below needs cold prompts: drop what an earlier run left in the cache
    flush_cache(url)
    rows = []
    for k in range(args.prompts):
        rows.append(check_prompt(url, k))
        r = rows[-1]
        print(
            f"prompt {k}: relayed {r['relayed_tokens']}/{r['span_tokens']}  oracle tokens "
            f"{'==' if r['oracle_tokens_equal'] else '!='} cold  gap {r['oracle_gap']:.2e}  "
            f"| SGLang prefix hit {'==' if r['hit_tokens_equal'] else '!='} cold  "
            f"gap {r['sglang_gap']:.2e}",
            flush=True,
        )
    fails = verdict(info, rows)
    print("PASS" if not fails else "FAIL: " + "; ".join(fails))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"server": info, "rows": rows, "failures": fails}, f, indent=1)
    return 1 if fails else 0
