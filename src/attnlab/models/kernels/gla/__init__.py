"""GLA's decoding step as a Triton kernel (`step`); the chunked and recurrent forms are fla's, wrapped in
`attnlab.models.kernels`. The PyTorch reference is `attnlab.models.ops.gla`."""
