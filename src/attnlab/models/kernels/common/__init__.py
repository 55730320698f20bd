"""Triton kernels that several families share: the causal depthwise convolution (`conv`), the gated RMSNorm
(`gated_norm`), SwiGLU's activation (`swiglu`) and the beams' cache reorder (`beam_reorder`)."""
