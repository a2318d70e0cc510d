"""Model families: what an architecture adapter is (:mod:`.anatomy`: the layer modules the
relay loop drives, the start-up check of a served model), one adapter file per
architecture (:mod:`.adapters`, listed there explicitly) and the lookup over them
(:mod:`.registry`).

Pure data plus checks on live modules. May import: layer 0 only (``runtime/__init__.py``).
"""
