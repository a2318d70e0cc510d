"""Span shipping: a span recorded on one relay server (the decode server of a
prefill/decode pair, or any server an upstream agent runs on) relays on another (the
prefill server of the next agent's prompt), its KV pages pulled from the first server's
staging region by a transfer engine, its side rows sent beside the offer.

* :mod:`.pages`: the byte ranges of a span in a pool, the pools' geometry;
* :mod:`.staging`: the one region each end exposes to the transfer engine;
* :mod:`.wire`: the messages and their checks (every field from a peer is hostile);
* :mod:`.mooncake`: the transfer engine (Mooncake's, as SGLang's PD uses);
* :mod:`.peers`: the publisher (and how the two ends work); :mod:`.receiver`: the receiver;
* :mod:`.build`: the one a server's settings ask for, built at cache start-up.

Design and measurements: docs/scale-out.md ("Span shipping").
"""
