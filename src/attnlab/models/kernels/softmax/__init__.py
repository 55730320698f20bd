"""Softmax attention's decoding kernels (`decode`: the split-key attention of one query over a static KV cache, the
rotary embedding and the cache write), which the attention family's exp similarities share. Training and prefill
run PyTorch's SDPA; the PyTorch reference is `attnlab.models.ops.softmax`."""
