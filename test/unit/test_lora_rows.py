"""LoRA batch info for a subset of rows (``runtime/forward/lora_rows.py``) through SGLang's own
torch_native LoRA backend: the full batch's info comes from SGLang's ``prepare_lora_batch``
(with the CPU pinning stand-in, in a subprocess), the LoRA deltas from the backend's own
``run_lora_a_sgemm`` / ``run_lora_b_sgemm``; the reference is each row's delta computed by
hand from its request's adapter (``scaling * x A^T B^T``)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from sglang_relay.runtime.forward.lora_rows import row_slots, rows_info, rows_swapped

_SCRIPT = r"""
import os, sys
os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
from types import SimpleNamespace
from sglang_relay.runtime.platform import CPU_STANDIN_ENV
from sglang_relay.runtime.standin import cpu
os.environ[cpu.CPU_LORA_ENV] = "1"
os.environ[CPU_STANDIN_ENV] = "1"
cpu.pinning_off()
import torch
from sglang.srt.lora.backend.torch_backend import TorchNativeLoRABackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang_relay.runtime.forward.lora_rows import rows_swapped

g = torch.Generator().manual_seed(0)
lens, slots, ranks, scalings = [3, 2, 4, 3], [0, 0, 1, 2], [4, 2, 0], [2.0, 0.5, 1.0]
n, d_in, d_out, r = sum(lens), 8, 6, 4
backend = TorchNativeLoRABackend(max_loras_per_batch=3, device=torch.device("cpu"))
fb = SimpleNamespace(forward_mode=ForwardMode.EXTEND, batch_size=len(lens), extend_num_tokens=n,
    extend_seq_lens=torch.tensor(lens, dtype=torch.int32), extend_seq_lens_cpu=lens)
backend.prepare_lora_batch(fb, slots, ranks, scalings, use_cuda_graph=False)
x = torch.randn(n, d_in, generator=g, dtype=torch.float64)
A = torch.randn(3, r, d_in, generator=g, dtype=torch.float64)
B = torch.randn(3, d_out, r, generator=g, dtype=torch.float64)
offsets = torch.tensor([0, d_out], dtype=torch.int32)

def delta(rows_x):
    return backend.run_lora_b_sgemm(backend.run_lora_a_sgemm(rows_x, A), B, offsets)

req = [i for i, k in enumerate(lens) for _ in range(k)]
def reference(rows):
    out = torch.zeros(len(rows), d_out, dtype=torch.float64)
    for j, row in enumerate(rows):
        s = slots[req[row]]; k = ranks[s]
        if k:
            out[j] = scalings[s] * (x[row] @ A[s, :k].T) @ B[s, :, :k].T
    return out

full = delta(x)
assert torch.allclose(full, reference(range(n))), "full batch"
info = backend.batch_info
for rows in ([1, 4, 5, 8, 11], [10, 0, 6, 2], [7], [9, 10, 11], []):
    t = torch.tensor(rows, dtype=torch.int64)
    with rows_swapped(backend, t):
        got = delta(x[t])
    assert backend.batch_info is info, "full info restored"
    assert torch.allclose(got, reference(rows)), rows
    if rows:
        assert torch.allclose(got, full[t]), rows
# what relay would compute without the swap: the full batch's segments over the subset
t = torch.tensor([1, 4, 5, 8, 11])
wrong = delta(x[t])
print("WRONG_DIFFERS", not torch.allclose(wrong, reference(t.tolist())))
try:
    with rows_swapped(backend, t):
        raise KeyError("inside")
except KeyError:
    pass
assert backend.batch_info is info
print("OK")
"""


def test_sglangs_lora_layers_on_a_row_subset_get_each_rows_adapter(tmp_path):
    script = tmp_path / "lora_rows.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-2:] == ["WRONG_DIFFERS True", "OK"], proc.stdout


def _info(seg_lens, weights):
    from sglang.srt.lora.backend.torch_backend import TorchNativeLoRABatchInfo

    lens = torch.tensor(seg_lens, dtype=torch.int32)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(lens, 0)
    w = torch.tensor(weights, dtype=torch.int32)
    ranks, scalings = torch.tensor([4, 4]), torch.tensor([1.0, 1.0])
    return TorchNativeLoRABatchInfo(
        use_cuda_graph=False, bs=len(lens), num_segments=len(lens), seg_indptr=indptr.clone(),
        weight_indices=w.clone(), lora_ranks=ranks, scalings=scalings, max_len=int(lens.max()),
        seg_lens=lens.clone(), seg_lens_cpu=lens, seg_indptr_cpu=indptr, weight_indices_cpu=w,
        lora_ranks_cpu=ranks, scalings_cpu=scalings,
    )  # fmt: skip


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_segments_of_sorted_unsorted_and_sparse_rows():
    info = _info([5, 4], [0, 1])  # rows 0-4 under slot 0, 5-8 under slot 1
    brute = [0] * 5 + [1] * 4
    for rows in ([0, 1, 2], [3, 6, 7], [8, 0, 5, 1], [4, 5], list(range(9))):
        t = torch.tensor(rows)
        assert row_slots(info, t).tolist() == [brute[r] for r in rows]
        sub = rows_info(info, t)
        runs = []  # run-length encoding by hand
        for r in rows:
            if runs and runs[-1][0] == brute[r]:
                runs[-1][1] += 1
            else:
                runs.append([brute[r], 1])
        assert sub.weight_indices_cpu.tolist() == [s for s, _ in runs]
        assert sub.seg_lens_cpu.tolist() == [k for _, k in runs]
        assert sub.seg_indptr_cpu.tolist()[-1] == len(rows) == sub.expected_tokens
        assert sub.num_segments == len(runs) and sub.seg_lens.tolist() == [k for _, k in runs]
    with pytest.raises(ValueError, match="rows outside"):
        rows_info(info, torch.tensor([9]))


def test_sglangs_lora_batch_info_has_what_rows_info_reads():
    from sglang.srt.lora.backend.torch_backend import TorchNativeLoRABatchInfo

    from sglang_relay.runtime.sglang.views import missing_surface

    assert missing_surface("TorchNativeLoRABatchInfo", TorchNativeLoRABatchInfo) == []


def test_no_lora_info_leaves_the_backend_alone():
    class Backend:
        batch_info = None

    b = Backend()
    with rows_swapped(b, torch.tensor([0, 1])):
        assert b.batch_info is None
