"""The relayed forward and what plain forwards leave for it:

* :mod:`.layer_driver`: the adapter's layer modules, run in SGLang's order;
* :mod:`.extend`: a relay extend (splice, selected rows, layers) and its batch plan;
* :mod:`.probe`: the attention probe that scores span tokens;
* :mod:`.attention`: relay's extend attention (torch reference, Triton, FlashInfer);
* :mod:`.lora_rows`: LoRA batch info for a subset of rows;
* :mod:`.decode`: plain forwards on SGLang's own forward, and the rows relay keeps;
* :mod:`.tp`: every tensor-parallel rank selects the same rows.

Decides nothing per request (the planner does). May import: layers 0-4.
"""
