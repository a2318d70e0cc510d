"""The only package that touches ``sglang.srt`` internals (version-checked in ``compat``)."""
