"""Kernels that several families share: the causal depthwise convolution (`conv`), the gated RMSNorm
(`gated_norm`), SwiGLU's activation (`swiglu`) and the beams' cache reorder (`beam_reorder`), attnlab's Triton
kernels; RMSNorm (`norm`) and the token cross-entropy (`cross_entropy`) on fla's kernels."""
