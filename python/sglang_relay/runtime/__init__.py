"""The plug-in that runs inside SGLang's processes; the only package that touches
``sglang.srt`` internals, all named in :mod:`.sglang` (version-checked there).

Subpackages by responsibility, in layers: a module may import its own subpackage and the
layers below it, never one above (``test/unit/test_structure.py`` enforces the map).

====  =============  =========================================================================
 0    (this folder)  leaf modules every layer shares: :mod:`.state` (per-process state),
                     :mod:`.backend` (is relay this server's cache), :mod:`.platform` (is the
                     CPU stand-in on), :mod:`.stats`, :mod:`.metrics`, :mod:`.import_gc`
 1    models         what an architecture adapter is, one adapter file per architecture
 2    sglang         the SGLang contract: hook targets, hooks, typed views, mirrors
 3    config         server settings, the SGLang modes and options relay serves or refuses
 4    cache          per-slot side data, the span store, the host tier, the side-memory budget
 5    forward        the relayed forward: layer driver, extend, probe, attention, LoRA rows,
                     plain forwards' capture (decode), TP agreement
 6    sched          the request path: trust boundary, per-request options, gate, planner,
                     the early-stop guard
 7    scale          data-parallel routing and fingerprints, span shipping between servers
 8    (this folder)  the composition: :mod:`.runtime` (one scheduler's relay runtime),
                     :mod:`.radix_cache` (SGLang's tree cache that owns it), :mod:`.plugin`
                     (the entry point that registers every hook)
 -    standin        CPU stand-ins for GPU-only SGLang paths; registered by its own entry
                     point, only where ``sglang-relay`` set the CPU stand-in up. No module
                     outside it imports it (``sglang_relay.cpu_setup`` names its shim folder).
====  =============  =========================================================================
"""
