"""The CPU stand-in for sgl_kernel: importable, and loud when a kernel is actually called."""

from __future__ import annotations

import subprocess
import sys

from sglang_relay.cpu_setup import SHIM_DIR


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {SHIM_DIR!r}); {code}"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_names_import_and_raise_when_called():
    proc = _run(
        "from sgl_kernel import rmsnorm, copy_all_layer_kv_cache_cpu\n"
        "try:\n    rmsnorm(1)\nexcept RuntimeError as e:\n    print('ERR', e)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "ERR sgl_kernel.rmsnorm was called" in proc.stdout
    assert "needs a GPU" in proc.stdout


def test_submodules_are_absent_so_sglang_takes_its_fallbacks():
    proc = _run("import sgl_kernel.scalar_type")
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr


_LORA_BATCH = """
import os, sys
os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
from types import SimpleNamespace
from sglang_relay.runtime.standin import cpu
if sys.argv[1] == "on":
    os.environ[cpu.CPU_LORA_ENV] = "1"
    cpu.pinning_off()
import torch
from sglang.srt.lora.backend.torch_backend import TorchNativeLoRABackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode
backend = TorchNativeLoRABackend(max_loras_per_batch=2, device=torch.device("cpu"))
fb = SimpleNamespace(forward_mode=ForwardMode.EXTEND, batch_size=3, extend_num_tokens=9,
    extend_seq_lens=torch.tensor([3, 2, 4], dtype=torch.int32), extend_seq_lens_cpu=[3, 2, 4])
try:
    backend.prepare_lora_batch(fb, [0, 0, 1], [8, 4], [2.0, 0.5], use_cuda_graph=False)
except RuntimeError as exc:
    print("RAISED", exc)
    sys.exit(3)
info = backend.batch_info
print(info.seg_lens_cpu.tolist(), info.weight_indices_cpu.tolist(), info.seg_indptr_cpu.tolist(),
      info.lora_ranks_cpu.tolist(), info.scalings_cpu.tolist())
"""


def test_sglangs_lora_batch_is_prepared_on_the_cpu_with_pinning_off(tmp_path):
    """SGLang's torch_native LoRA backend pins its per-batch tensors, which raises without
    an NVIDIA driver; with ``SGLANG_RELAY_CPU_LORA=1`` (``cpu.pinning_off``) it builds the
    batch info: requests of 3, 2, 4 tokens under adapter slots 0, 0, 1 merge into
    segments of 5 and 4 tokens."""
    script = tmp_path / "lora_batch.py"
    script.write_text(_LORA_BATCH)

    def run(mode):
        return subprocess.run(
            [sys.executable, str(script), mode], capture_output=True, text=True, timeout=300
        )

    off = run("off")
    assert off.returncode == 3 and "NVIDIA driver" in off.stdout, off.stdout + off.stderr[-2000:]
    on = run("on")
    assert on.returncode == 0, on.stderr[-2000:]
    last = on.stdout.strip().splitlines()[-1]
    assert last == "[5, 4] [0, 1] [0, 5, 9] [8, 4] [2.0, 0.5]", on.stdout


_REGISTER = """
import os
from sglang_relay.runtime import plugin, standin
from sglang_relay.runtime.platform import CPU_STANDIN_ENV
from sglang_relay.runtime.state import STATE
for on in ("0", "1"):  # one process: SGLang's imports are the cost
    os.environ[CPU_STANDIN_ENV] = on
    STATE.plugin_registered = STATE.standin_registered = False
    STATE.hooks.clear()
    plugin.register()  # SGLang's loader calls both entry points (pyproject.toml)
    standin.register()
    print(sorted({(t, h.__name__) for t, h in STATE.hooks}))
"""


def test_a_plain_cpu_server_keeps_sglangs_behaviour_unless_relay_set_up_the_stand_in():
    """SGLang's own ``SGLANG_USE_CPU_ENGINE=1`` does not turn on relay's CPU hooks (a plain
    SGLang server on a CPU host with the package installed stays SGLang's); the stand-in's
    marker, set by ``cpu.activate`` (``sglang-relay serve``), does."""
    import os

    from sglang_relay.runtime.sglang.targets import (
        CPU_GRAPH_FAKE_TARGET,
        DP_EVENT_LOOP_TARGET,
        GENERATE_REQUEST_TARGET,
        MODEL_PARALLEL_GROUP_TARGET,
        PROCESS_START_TARGET,
    )

    cpu_only = {MODEL_PARALLEL_GROUP_TARGET, CPU_GRAPH_FAKE_TARGET, DP_EVENT_LOOP_TARGET}
    # on SGLang's process start: relay's refusal always, the stand-in's forkserver not
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    # SGLang imports sgl_kernel: the stand-in package here (a CPU build of it elsewhere)
    env["PYTHONPATH"] = os.pathsep.join([SHIM_DIR, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _REGISTER], capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    plain, standin = (set(eval(line)) for line in proc.stdout.strip().splitlines()[-2:])  # noqa: S307
    forkserver = (PROCESS_START_TARGET, "children_from_forkserver")
    for hooks in (plain, standin):
        targets = {t for t, _ in hooks}
        assert GENERATE_REQUEST_TARGET in targets  # the plug-in did register
        assert (PROCESS_START_TARGET, "_refuse_before_children") in hooks
    assert not (cpu_only & {t for t, _ in plain}) and forkserver not in plain, plain
    assert cpu_only <= {t for t, _ in standin} and forkserver in standin, standin
