"""A request's path to a relayed forward:

* :mod:`.trust`: the tokenizer side's trust boundary (private keys stripped, fields
  validated, 400s);
* :mod:`.options`: per-request options -> the ``RelayConfig`` a request runs with;
* :mod:`.gate`: the scheduler side: admission and one request's plan or fallback;
* :mod:`.planner`: a batch's spans matched, scored and selected into a plan;
* :mod:`.guard`: the early-stop guard that redoes a collapsed relayed reply.

May import: layers 0-5.
"""
