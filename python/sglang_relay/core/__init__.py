"""Pure-torch RelayCaching math (never imports sglang): re-rotation, span matching, token
selection, the layer schedule and reuse accounting, the reference executor."""
