"""``python -m sglang_relay.profiler``: the same as ``sglang-relay profile``."""

import sys

from sglang_relay.profiler.cli import main

sys.exit(main())
