"""The only package that touches ``sglang.srt`` internals, all named in ``runtime/sglang/``
(version-checked there)."""
