"""The tests' preloaded launcher parent (``launcher_zygote``): when a launcher may run on the
parent's imports, and when it must replace itself with a fresh ``sglang-relay serve``. No
server here: the rule alone; every e2e server start exercises the rest (its log says which
way it started: the session server's must have forked, ``test_server.py``)."""

from __future__ import annotations

import os

import launcher_zygote as lz
import pytest

PARENT = {"HOME": "/root", "OMP_WAIT_POLICY": "PASSIVE", "SGLANG_USE_CPU_ENGINE": "1"}


@pytest.fixture()
def preloaded(monkeypatch):
    # what the parent read while it preloaded: its whole environment (tqdm's import scans
    # it) and a key it looked up that it did not have
    read = {*PARENT, "SGLANG_CPU_OMP_THREADS_BIND"}
    monkeypatch.setattr(lz, "PRELOAD", lz.Preload(pid=os.getppid(), threads=1, read_keys=read))


def test_the_parents_own_environment_forks(preloaded):
    assert lz.why_not_forked(dict(PARENT), PARENT) is None


@pytest.mark.parametrize(
    "key", ["SGLANG_RELAY_CONFIG", "SGLANG_RELAY_CPU_LORA", "SGLANG_RELAY_SCOPE", "SGLANG_HOST_IP"]
)
def test_sglang_keys_the_parent_never_read_may_differ(preloaded, key):
    assert lz.why_not_forked({**PARENT, key: "x"}, PARENT) is None


@pytest.mark.parametrize(
    "change",
    [
        {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"},  # looked up while the parent preloaded
        {"SGLANG_USE_CPU_ENGINE": "0"},  # in the parent's environment: read
        {"OMP_WAIT_POLICY": "ACTIVE"},  # libgomp reads it when torch loads, not os.environ
        {"LD_LIBRARY_PATH": "/opt/lib"},
        {"TRITON_INTERPRET": "1"},
    ],
)
def test_any_other_difference_starts_a_fresh_launcher(preloaded, change):
    why = lz.why_not_forked({**PARENT, **change}, PARENT)
    assert why is not None and next(iter(change)) in why


def test_a_key_the_launcher_lacks_is_a_difference_too(preloaded):
    env = {k: v for k, v in PARENT.items() if k != "OMP_WAIT_POLICY"}
    assert "OMP_WAIT_POLICY" in lz.why_not_forked(env, PARENT)


def test_no_fork_from_a_parent_that_did_not_preload_or_ran_threads(monkeypatch):
    monkeypatch.setattr(lz, "PRELOAD", lz.Preload(threads=1))
    assert "did not preload" in lz.why_not_forked(dict(PARENT), PARENT)
    # preloaded itself: not the parent
    monkeypatch.setattr(lz, "PRELOAD", lz.Preload(pid=os.getpid(), threads=1))
    assert "did not preload" in lz.why_not_forked(dict(PARENT), PARENT)
    monkeypatch.setattr(lz, "PRELOAD", lz.Preload(pid=os.getppid(), threads=3))
    assert "3 threads" in lz.why_not_forked(dict(PARENT), PARENT)


def test_reads_are_recorded_through_every_way_of_reading(monkeypatch):
    monkeypatch.setattr(lz, "PRELOAD", lz.Preload())
    monkeypatch.setenv("RELAY_TEST_PRESENT", "1")
    monkeypatch.delenv("RELAY_TEST_ABSENT", raising=False)
    with lz._recording_reads():
        os.environ.get("RELAY_TEST_ABSENT")
        _ = "RELAY_TEST_IN" in os.environ
        _ = os.environ["RELAY_TEST_PRESENT"]
        lz._replace_environ(lz._snapshot())  # the module's own copies are not reads
    assert lz.PRELOAD.read_keys == {"RELAY_TEST_ABSENT", "RELAY_TEST_IN", "RELAY_TEST_PRESENT"}
    assert type(os.environ).__getitem__.__name__ == "__getitem__"  # unpatched after


def test_a_launcher_gets_the_first_environment_and_its_own_keys(monkeypatch):
    monkeypatch.setattr(lz, "_base", {"A": "1"})
    monkeypatch.setenv("A", "changed since")  # e.g. set by this process's own imports
    env = lz.launcher_env({"SGLANG_RELAY_SCOPE": "key"})
    assert env == {"A": "1", "SGLANG_RELAY_SCOPE": "key"}


def test_a_pythonpath_that_only_adds_folders_forks(preloaded, tmp_path):
    (tmp_path / "a_test_plugin.py").write_text("")
    parent = {**PARENT, "PYTHONPATH": "/p1"}
    env = {**parent, "PYTHONPATH": os.pathsep.join([str(tmp_path), "/p1"])}
    assert lz.added_dirs(env, parent) == [str(tmp_path)]
    assert lz.why_not_forked(env, parent) is None
    assert lz.why_not_forked({**PARENT, "PYTHONPATH": str(tmp_path)}, PARENT) is None
    # the checks add the stand-in's folder before both (cpu_setup): still only one added
    parent = {**PARENT, "PYTHONPATH": "/shim"}
    env = {**parent, "PYTHONPATH": os.pathsep.join(["/shim", str(tmp_path)])}
    assert lz.added_dirs(env, parent) == [str(tmp_path)]
    assert lz.why_not_forked(env, parent) is None


@pytest.mark.parametrize("path", ["/p2", "/p0:/p2:/p1", "", "/p2:/p0:/p1"])
def test_a_pythonpath_that_drops_or_moves_the_parents_entries_does_not(preloaded, path):
    parent = {**PARENT, "PYTHONPATH": "/p1:/p2"}
    assert lz.added_dirs({**parent, "PYTHONPATH": path}, parent) is None
    assert "PYTHONPATH" in lz.why_not_forked({**parent, "PYTHONPATH": path}, parent)


def test_a_prepended_folder_that_hides_an_imported_module_does_not(preloaded, tmp_path):
    lz.PRELOAD.imported.add("json")
    (tmp_path / "json").mkdir()  # a package the parent's `json` would have been
    why = lz.why_not_forked({**PARENT, "PYTHONPATH": str(tmp_path)}, PARENT)
    assert why is not None and "hides modules the parent imported: json" in why


def test_a_pythonpath_the_parent_read_still_forks(preloaded, tmp_path):
    # serve's own checks read it in the preload and run again in the launcher
    lz.PRELOAD.read_keys.add("PYTHONPATH")
    assert lz.why_not_forked({**PARENT, "PYTHONPATH": str(tmp_path)}, PARENT) is None
