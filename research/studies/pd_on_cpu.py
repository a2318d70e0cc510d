"""SGLang 0.5.23's prefill/decode disaggregation on this CPU: one prefill server and one
decode server (plain SGLang, ``--no-relay``), KV moved by Mooncake over TCP on loopback,
one request through both (what sglang-router's PD mode does: the same body to both, with
``bootstrap_host/port/room``), its tokens compared with a Hugging Face greedy decode.

Prerequisites (not in ``make setup``; research only):

    .venv/bin/pip install --no-deps mooncake-transfer-engine-non-cuda==0.3.13.post1
    mkdir -p /tmp/debs && cd /tmp/debs && apt-get download libibverbs1 libnl-3-200 libnl-route-3-200
    for d in *.deb; do dpkg -x $d /tmp/ibv; done

What it takes beyond SGLang's own code, each found by running it:
* the non-CUDA Mooncake wheel (the default one links libcudart.so.12 and libcuda.so.1) and
  Debian's libibverbs1 + libnl (loaded even for TCP; no RDMA device is needed);
* ``--disaggregation-transfer-backend mooncake_tcp``, ``SGLANG_HOST_IP=127.0.0.1``,
  ``--disable-overlap-schedule``;
* on the decode server ``--disaggregation-decode-retraction-backup cpu_tensor``: the
  default (``host_pool``) builds a HiCache host pool, pinned (relay's stand-in for that,
  ``SGLANG_RELAY_CPU_HICACHE=1``, works only where relay's plug-in runs);
* ``MooncakeKVSender.supports_host_tensor_indices = False`` in the prefill scheduler
  (``pd_cpu_site/sitecustomize.py``): with it True, ``prefill.py:_send_kv_chunk`` builds
  its page indices in pinned memory and records a ``torch.cuda.Event``; False takes the
  CPU index path SGLang has for other senders.

    python research/studies/pd_on_cpu.py --json research/studies/data/pd_on_cpu_2026-11-28.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import time
from pathlib import Path

import requests

from sglang_relay.embedded_model import ensure_model
from sglang_relay.process import ServerProcess

LIBS = "/tmp/ibv/usr/lib/x86_64-linux-gnu:/tmp/ibv/lib/x86_64-linux-gnu"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--bootstrap-port", type=int, default=18998)
    p.add_argument("--json", required=True)
    args = p.parse_args()
    model = str(ensure_model())
    env = {
        "LD_LIBRARY_PATH": LIBS,
        "SGLANG_HOST_IP": "127.0.0.1",
        "MOONCAKE_PROTOCOL": "tcp",
        "PYTHONPATH": str(Path(__file__).with_name("pd_cpu_site")),
    }
    common = ["--no-relay", "--model-path", model, "--max-total-tokens", "4096",
              "--disaggregation-transfer-backend", "mooncake_tcp",
              "--disable-overlap-schedule"]  # fmt: skip
    prefill = ServerProcess(
        [*common, "--disaggregation-mode", "prefill",
         "--disaggregation-bootstrap-port", str(args.bootstrap_port)], env=env,
    )  # fmt: skip
    decode = ServerProcess(
        [*common, "--disaggregation-mode", "decode",
         "--disaggregation-decode-retraction-backup", "cpu_tensor"], env=env,
    )  # fmt: skip
    rows = []
    with prefill, decode:
        for prompt in PROMPTS:
            body = {
                "text": prompt,
                "sampling_params": {"max_new_tokens": args.tokens, "temperature": 0},
                "bootstrap_host": "127.0.0.1",
                "bootstrap_port": args.bootstrap_port,
                "bootstrap_room": random.randrange(1, 2**62),
            }
            t0 = time.perf_counter()
            with cf.ThreadPoolExecutor(2) as ex:
                fp = ex.submit(requests.post, prefill.url + "/generate", json=body, timeout=300)
                fd = ex.submit(requests.post, decode.url + "/generate", json=body, timeout=300)
                rp, rd = fp.result(), fd.result()
            rows.append(
                {
                    "prompt": prompt,
                    "prefill_status": rp.status_code,
                    "decode_status": rd.status_code,
                    "output_ids": rd.json()["output_ids"] if rd.ok else None,
                    "latency_s": round(time.perf_counter() - t0, 3),
                }
            )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model)
    for row in rows:
        ids = tok(row["prompt"], return_tensors="pt").input_ids
        out = hf.generate(ids, max_new_tokens=args.tokens, do_sample=False)
        row["hf_greedy_ids"] = out[0, ids.shape[1] :].tolist()
        row["same_as_hf"] = row["output_ids"] == row["hf_greedy_ids"]
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
