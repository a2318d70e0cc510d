"""What relay keeps between forwards, and the memory it takes:

* :mod:`.side_data`: per-slot hidden rows and the stamps proving a slot's KV is unchanged;
* :mod:`.span_store`: recorded spans (an agent's decoded output) and their lookup;
* :mod:`.host_tier`: spans demoted to host memory (HiCache) and restored;
* :mod:`.budget`: relay's side memory, reserved out of SGLang's KV budget.

Runs no forward. May import: layers 0-3.
"""
