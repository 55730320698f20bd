"""Mamba-2's Triton kernels: `ssd` (the chunked SSD and `ssd`, Mamba-2's parallel form), `core` (the layer between
its projections as one autograd node, the gated norm with the output projection, the SSD through fla's GLA),
`grads` (the backward's elementwise part) and `step` (the decoding step). The PyTorch reference is
`attnlab.models.ops.mamba2`."""
