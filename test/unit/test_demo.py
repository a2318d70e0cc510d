"""The demo's side-by-side table and the client's reading of streamed relay info."""

from __future__ import annotations

from sglang_relay.client import Generation
from sglang_relay.demo import AgentResult, format_table, load_chain


def test_streamed_relay_info_is_unwrapped():
    info = {"reused_tokens": 80, "reuse_rate": 0.8}
    assert Generation("x", 0.1, 1.0, {"relay": [info]}).relay == info
    assert Generation("x", 0.1, 1.0, {"relay": info}).relay == info
    assert Generation("x", 0.1, 1.0, {}).relay is None


def test_table_compares_relay_and_standard():
    on = Generation(
        "same",
        0.2,
        1.0,
        {"prompt_tokens": 100, "relay": [{"reused_tokens": 80, "reuse_rate": 0.8}]},
    )
    off = Generation("other", 0.5, 1.0, {"prompt_tokens": 100})
    table = format_table([AgentResult("Dev", on)], [AgentResult("Dev", off)])
    row = table.splitlines()[-1].split()
    assert row[:4] == ["Dev", "100", "80", "0.80"]
    assert "2.5x" in row and row[-1] == "differs"
    # with token ids (here: bytes), how far the outputs agree
    by_bytes = format_table([AgentResult("Dev", on)], [AgentResult("Dev", off)], str.encode)
    assert by_bytes.splitlines()[-1].endswith("same 0/5 tok")
    same = format_table([AgentResult("Dev", on)], [AgentResult("Dev", on)], str.encode)
    assert same.splitlines()[-1].endswith("identical")


def test_table_separates_one_step_from_the_chain():
    """With standard prefill on the relay pipeline's own prompts, a row says what relay did
    to that step before what the chain drifted; the JSON carries both."""
    from sglang_relay.demo import result_json

    meta = {"prompt_tokens": 100, "relay": [{"reused_tokens": 80, "reuse_rate": 0.8}]}
    on = Generation("abcdef", 0.2, 1.0, meta)
    step = Generation("abcxyz", 0.5, 1.0, {"prompt_tokens": 100})  # same prompt, standard
    off = Generation("uvwxyz", 0.5, 1.0, {"prompt_tokens": 100})  # the standard pipeline
    relay, std, one = (
        [AgentResult("Dev", on)],
        [AgentResult("Dev", off)],
        [AgentResult("Dev", step)],
    )
    row = format_table(relay, std, str.encode, one).splitlines()[-1]
    assert row.endswith("same 3/6 tok | chain: same 0/6 tok"), row
    agent = result_json({"name": "c"}, relay, std, str.encode, one)["agents"][0]
    assert (agent["same_tokens"], agent["one_step"]["same_tokens"]) == (0, 3)
    assert agent["one_step"]["standard_text"] == "abcxyz"
    # a one-step collapse is named apart from the chain's (lower case)
    short = [AgentResult("Dev", Generation("a", 0.2, 1.0, meta))]
    row = format_table(short, std, str.encode, one).splitlines()[-1]
    assert "collapsed | chain: " in row and row.endswith("COLLAPSED"), row


def test_packaged_chain_references_earlier_agents():
    chain = load_chain(None)
    names = [a["name"] for a in chain["agents"]]
    assert names == ["Architect", "Developer", "Reviewer"]
    assert "{Architect}" in chain["agents"][2]["template"]
