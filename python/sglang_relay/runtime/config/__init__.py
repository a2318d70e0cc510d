"""What a relay server is configured with and what it agrees to serve:

* :mod:`.settings`: the server's relay settings (``SGLANG_RELAY_*``, the profile);
* :mod:`.modes`: SGLang serving modes (attention backends, page sizes, speculative
  decoding, quantization, ...) served or refused, each refusal one message naming the way
  out; :mod:`.quant_methods` classifies SGLang's quantization methods;
* :mod:`.server_options`: every SGLang server option classified (``server_options.toml``).

Owns no tensors and no SGLang object. May import: layers 0-2.
"""
