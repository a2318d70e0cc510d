# experiment only: Mooncake's sender takes CPU page indices (no pinned buffer, no CUDA event)
import importlib.abc
import importlib.util
import sys

TARGET = "sglang.srt.disaggregation.mooncake.conn"


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.MooncakeKVSender.supports_host_tensor_indices = False
            print("pdx: MooncakeKVSender.supports_host_tensor_indices = False", file=sys.stderr)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
