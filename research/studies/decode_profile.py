"""py-spy profile of a relay server's scheduler during one greedy batch-1 decode of the
embedded model (writes decode.raw beside it; research/studies/data/decode_profile_*.txt is
its summary). Run from the checkout: python research/studies/decode_profile.py"""

import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import requests

sys.path.insert(0, "test/e2e")
from relay_helpers import running_server  # noqa: E402

MODEL = str(Path.home() / ".cache/sglang-relay/models/SmolLM2-135M-Instruct")
PY_SPY = str(Path(sys.executable).with_name("py-spy"))

with running_server(["--model-path", MODEL, "--max-total-tokens", "8192", *sys.argv[1:]]) as p:
    kids = psutil.Process(p.proc.pid).children(True)
    scheduler = max(kids, key=lambda k: k.memory_info().rss)
    body = {
        "text": "Write a long story about a dog.",
        "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True},
    }
    th = threading.Thread(target=lambda: requests.post(p.url + "/generate", json=body))
    th.start()
    time.sleep(3)
    record = [PY_SPY, "record", "-p", str(scheduler.pid), "-d", "12", "-f", "raw"]
    subprocess.run([*record, "-o", "decode.raw", "--nonblocking"], check=True)
    th.join()
