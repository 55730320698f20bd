"""Native sparse attention's Triton kernels: `parallel` (training and prefill), `step` (the decoding step over the
static cache) and `stats` (the health statistics). The PyTorch reference is `attnlab.models.ops.nsa`."""
