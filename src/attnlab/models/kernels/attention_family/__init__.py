"""The attention family's Triton kernels: `parallel` (the tiled quadratic form, training and prefill), `chunk` (the
chunked, linear-time form of the linearizable similarities) and `step` (the decoding step and the prompt's state).
The PyTorch reference is `attnlab.models.ops.attention_family`; `attnlab.models.kernels` chooses between them."""
