"""GLA's fast forms: `chunk` (training and prefill) and `fused_recurrent` (decoding and short prefills) on fla's
kernels, and `step` (the engine's decoding step as one Triton kernel). The PyTorch reference is
`attnlab.models.ops.gla`; the mixer (`attnlab.models.mixers.gla`) chooses between them."""
