from __future__ import annotations

import os

import pytest

# The e2e tests run several SGLang processes (servers, DP and TP ranks) on the cores the test
# process uses too. OpenMP's default busy-wait has each process's idle threads spin against
# the others' work: the DP-2 and router tests took 65 s and 143 s with it, 16 s and 20 s
# without (2-core VM). Set before torch loads; the servers inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def model_dir():
    """The converted embedded model (converted once per cache folder)."""
    from sglang_relay.embedded_model import ensure_model

    return ensure_model(quiet=True)


def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        default=os.environ.get("SGLANG_RELAY_FULL_TESTS") == "1",
        help="also run the tests marked `full` (make test-full; SGLANG_RELAY_FULL_TESTS=1)",
    )


def pytest_collection_modifyitems(config, items):
    # Each `full` test repeats, on another configuration, a path a CI-tier test already
    # serves end to end (a server start is ~60 s here): CI stays well inside its limit and
    # `make test-full` runs them all. Skipped with a reason, so the summary shows them.
    if config.getoption("--full"):
        return
    skip = pytest.mark.skip(reason="full tier: run with `make test-full`")
    for item in items:
        if item.get_closest_marker("full") is not None:
            item.add_marker(skip)


def pytest_configure(config):
    # No hub at run time: anything that tries to download must fail fast.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # Without a GPU the Triton kernels run under the interpreter (kernels/tests). It must be
    # on before triton is first imported: its own @jit library functions are resolved then.
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
