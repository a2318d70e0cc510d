"""The SGLang functions relay's layer driver reproduces by hand, pinned by the digest of
their source.

Plain forwards are SGLang's own. The relay extend, the probe and the span context run
SGLang's modules in an order of their own (:mod:`sglang_relay.runtime.forward.layer_driver`), so
they are only right while the SGLang code they mirror is the code they were verified
against: the stack's forward (embedding, residual start, final norm), each decoder
layer's forward (the order of norm, attention, MLP and the layer boundaries), the
attention block's forward and q/k/v preparation, the MLP block's forward, and the layer
boundary functions every architecture shares (:data:`SHARED`). docs/architecture.md
("What relay runs itself") says what each one does for relay.

At start-up :func:`check_served_mirrors` derives these functions from the served model's
own classes and compares the digest of each one's source with the one recorded in
``mirrors.json`` (SGLang 0.5.23 as released). A function whose source changed, or that no
adapter was verified on (a subclass a fork defines, say), refuses relay with its name:
relay would otherwise splice rows computed in an order SGLang no longer uses.

Re-recording (``python -m sglang_relay.runtime.sglang.mirrors --record``) states that the
mirror was re-verified against the new source: run the e2e relay-vs-reference tests of
every architecture first (``make test-full``).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import textwrap
from pathlib import Path

from sglang_relay.runtime.sglang.hooks import resolve

RECORD = Path(__file__).with_name("mirrors.json")

# Shared by every architecture (one module path each; the layer classes call them).
SHARED = (
    "sglang.srt.layers.layer_boundary.prepare._reduce_update_read",  # norm(h, r) -> (x, h + r)
    "sglang.srt.layers.layer_boundary.residual.batch.start",
    "sglang.srt.layers.layer_boundary.residual.batch.final_norm",  # model.norm(h, r)
    "sglang.srt.layers.layer_boundary.residual.batch.written_residual",  # DecodeCapture
    "sglang.srt.models.utils.apply_qk_norm",  # the split q/k/v preparation
)

# The SGLang model modules whose classes the adapters serve (what --record walks).
MODEL_MODULES = (
    "sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla",
    "sglang.srt.models.deepseek_v2",
    "sglang.srt.models.gemma3_causal",
    "sglang.srt.models.glm4_moe",
    "sglang.srt.models.gpt_oss",
    "sglang.srt.models.llama",
    "sglang.srt.models.minimax_m2",
    "sglang.srt.models.mixtral",
    "sglang.srt.models.qwen2",
    "sglang.srt.models.qwen2_moe",
    "sglang.srt.models.qwen3",
    "sglang.srt.models.qwen3_moe",
)

# (MLA: the absorbed path's preparation and core, which ``anatomy.mla_qkv`` / ``mla_out``
# mirror, the latent projections they call, and the load step that splits ``w_kc`` / ``w_vc``)
_METHODS = (
    "forward",
    "forward_prepare_native",
    "forward_native",
    "forward_absorb_prepare",
    "forward_absorb_core",
    "prepare_qkv_latent",
    "q_b_proj_forward",
    "post_load_weights",
)


def digest(fn) -> str:
    """sha256 (16 hex digits) of a function's dedented source."""
    src = textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))
    return hashlib.sha256(src.encode()).hexdigest()[:16]


def _defining(cls: type, method: str) -> str | None:
    """``module.Class.method`` of the class in ``cls``'s MRO that defines ``method``."""
    for klass in cls.__mro__:
        if method in vars(klass):
            return f"{klass.__module__}.{klass.__qualname__}.{method}"
    return None


def served_mirrors(model, mlp_name: str = "mlp") -> list[str]:
    """Every function the layer driver mirrors for the decoder stack ``model``: its
    forward, and per layer class the layer's, its attention block's (with
    ``forward_prepare_native`` where the block has one) and its MLP block's forward."""
    names = [_defining(type(model), "forward")]
    for layer in model.layers:
        names.append(_defining(type(layer), "forward"))
        names.extend(_defining(type(layer.self_attn), m) for m in _METHODS)
        names.append(_defining(type(getattr(layer, mlp_name)), "forward"))
    return list(dict.fromkeys(n for n in [*names, *SHARED] if n))


def recorded() -> dict[str, str]:
    return json.loads(RECORD.read_text())["digests"]


def mirror_problems(names, record: dict[str, str] | None = None) -> list[str]:
    """What among ``names`` relay cannot vouch for (empty: nothing)."""
    record = recorded() if record is None else record
    problems = []
    for name in names:
        want = record.get(name)
        if want is None:
            problems.append(f"{name} (no adapter was verified on it)")
            continue
        try:
            got = digest(resolve(name))
        except (ImportError, KeyError, AttributeError, OSError, TypeError) as exc:
            problems.append(f"{name} (its source cannot be read: {type(exc).__name__})")
            continue
        if got != want:
            problems.append(f"{name} (source changed: digest {got}, verified {want})")
    return problems


def check_served_mirrors(model, mlp_name: str = "mlp") -> None:
    """Refuse relay unless every SGLang function the layer driver mirrors for this model is
    the one it was verified against."""
    problems = mirror_problems(served_mirrors(model, mlp_name))
    if problems:
        raise ValueError(
            "sglang-relay's layer driver reproduces these SGLang functions by hand and "
            "cannot vouch for the installed ones: "
            + "; ".join(problems[:3])
            + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
            + ". Install the SGLang release this sglang-relay supports, or serve without "
            "relay (--no-relay)."
        )


def _candidates() -> list[str]:
    """What ``--record`` pins: :data:`SHARED` and every ``forward`` /
    ``forward_prepare_native`` defined by a class of :data:`MODEL_MODULES`."""
    names = list(SHARED)
    for mod_name in MODEL_MODULES:
        mod = importlib.import_module(mod_name)
        for cls in vars(mod).values():
            if not isinstance(cls, type) or cls.__module__ != mod_name:
                continue
            if cls.__name__.endswith("ForCausalLM"):  # logits: SGLang's on every path
                continue
            names.extend(f"{mod_name}.{cls.__qualname__}.{m}" for m in _METHODS if m in vars(cls))
    return names


def main(argv=None) -> int:
    import argparse

    import sglang

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true", help=f"rewrite {RECORD.name}")
    args = parser.parse_args(argv)
    if not args.record:
        problems = mirror_problems(recorded())
        print("\n".join(problems) or f"all {len(recorded())} mirrored functions match")
        return 1 if problems else 0
    digests = {name: digest(resolve(name)) for name in _candidates()}
    record = {"sglang": sglang.__version__, "digests": digests}
    RECORD.write_text(json.dumps(record, indent=1) + "\n")
    print(f"recorded {len(digests)} functions of SGLang {sglang.__version__} in {RECORD}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
