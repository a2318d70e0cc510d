"""Relay across processes and servers:

* :mod:`.dp_routing`: the DP controller routes a request to the rank holding its spans;
* :mod:`.dp_fingerprints`: what each rank publishes for that routing;
* :mod:`.ship`: span shipping between servers (prefill/decode disaggregation).

May import: layers 0-6.
"""
