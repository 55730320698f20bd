"""Kernel dispatch: the pure-PyTorch reference everywhere, fla's and attnlab's Triton kernels on CUDA.

`config.kernels` chooses: "auto" uses fla's kernels for CUDA tensors when the `gpu` extra
(flash-linear-attention) is installed, and the reference otherwise; "torch" always uses the
reference; "fla" insists on fla and says why when it cannot. attnlab's own Triton kernels (the
attention family's quadratic form, the mixers' causal conv, SwiGLU's activation) follow the same choice. The reference is
the oracle the fast paths are tested against (tests/test_kernels_cuda.py, tests/test_conv_kernel.py).
"""

from __future__ import annotations

import functools
import importlib.util
import warnings

import torch

from attnlab.models.kernels.limits import attention_family_gap, causal_conv1d_gap, nsa_gap, nsa_step_gap  # noqa: F401


@functools.cache
def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def use_fla(choice: str, x: torch.Tensor) -> bool:
    """Whether this call should run fla's kernel."""
    if choice == "torch":
        return False
    if x.is_cuda and fla_installed():
        return True
    if choice == "fla":
        why = "the tensor is not on a CUDA device" if not x.is_cuda else "flash-linear-attention is not installed (pip install 'attnlab[gpu]')"
        raise RuntimeError(f"model.kernels is 'fla' but {why}; use kernels 'auto' to fall back to the PyTorch reference")
    return False


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(choice: str, x: torch.Tensor, covered: bool = True) -> bool:
    """Whether this call should run one of attnlab's own Triton kernels: a CUDA tensor, a layer the
    kernel covers (`covered`; the layer says why not when it is built), `choice` not "torch", and
    triton installed ("fla" insists on it and says so when it is missing)."""
    if choice == "torch" or not covered or not x.is_cuda:
        return False
    if not triton_installed():
        if choice == "fla":
            raise RuntimeError("model.kernels is 'fla' but triton is not installed (pip install 'attnlab[gpu]')")
        return False
    return True


def attention_family_terms(choice: str, x: torch.Tensor, covered: bool = True):
    """The attention family's `attention_terms` for this call: attnlab's Triton kernels for CUDA
    tensors (memory linear in the sequence length), else the PyTorch reference. `covered`: whether
    the kernels compute the layer's options (the layer says why not when it is built)."""
    if not use_triton(choice, x, covered):
        from attnlab.models.ops.attention_family import attention_terms

        return attention_terms
    from attnlab.models.kernels.attention_family.parallel import attention_terms as fused

    return fused


# Sequence lengths from which a linearizable attention-family layer (power1, power2 without a clamp) trains and
# prefills chunked, in linear time (`kernels/attention_family/chunk.py`), instead of on the tiled quadratic kernels.
# None yet: on an H100 (torch 2.11, Triton 3.6) the chunked form is not ready to be chosen. Its power2 gradients in
# bf16 miss the fp32 reference (q's relative error 0.08-0.12 against the 0.03 the tiled kernels hold, with the
# register-feature kernels; tests/test_attention_family_chunk.py, the CUDA tests marked xfail), and `2mamba` trained
# at 8,055 tokens/s at 1 x 32768 chunked against 31,406 tiled (`attnlab bench zoo --skip-ops --steps 3 --warmup 1
# --model 2mamba --model hf-llama --shape 1x32768`; HF Llama 50,934 in the same run). power1's CUDA tests pass; its
# speed against the tiled form is unmeasured. A similarity enters this table with the crossover measured by gpu.sh
# stage chunk-crossover (reasoned from flops alone: power2 near 5K tokens, power1 a few hundred).
CHUNKED_MIN_TOKENS: dict[str, int] = {}


def attention_family_chunked(choice: str, x: torch.Tensor, seq_len: int, similarity: str):
    """attnlab's chunked, linear-time form of a linearizable attention-family layer (`chunk_attention` of
    `kernels/attention_family/chunk.py`) for a call of `seq_len` tokens on this tensor, or None: the
    quadratic form runs (the tiled kernels on CUDA, the reference elsewhere). Chosen on CUDA (as attnlab's
    other kernels) from `CHUNKED_MIN_TOKENS` tokens on, for every option of those layers."""
    if similarity not in CHUNKED_MIN_TOKENS or seq_len < CHUNKED_MIN_TOKENS[similarity] or not use_triton(choice, x):
        return None
    from attnlab.models.kernels.attention_family.chunk import chunk_attention

    return chunk_attention


def attention_family_step_fn(choice: str, x: torch.Tensor):
    """attnlab's fused decoding step for linearizable attention-family layers (power1, power2
    without a clamp; `kernels/attention_family/step.py`: the state advanced in place) for this CUDA
    tensor, or None: the mixer runs the PyTorch reference `recurrent_step`. It covers every
    similarity, decay and denominator of those layers; float64 runs the reference (with a warning)."""
    if not use_triton(choice, x):
        return None
    if x.dtype == torch.float64:  # the kernel computes in fp32
        warnings.warn("attnlab's attention-family step kernel takes no float64: the step runs the PyTorch reference", stacklevel=3)
        return None
    from attnlab.models.kernels.attention_family.step import attention_family_step_

    return attention_family_step_


def attention_family_state_update_fn(choice: str, x: torch.Tensor):
    """attnlab's kernel for a linearizable attention-family layer's state after a prompt (power2's
    d^2 features formed in registers only; `kernels/attention_family/step.py`) for this CUDA tensor,
    or None: the prefill runs the PyTorch reference `linear_state_update`, a chunk of features at a time."""
    if not use_triton(choice, x) or x.dtype == torch.float64:
        return None
    from attnlab.models.kernels.attention_family.step import linear_state_update

    return linear_state_update


def causal_conv1d_fn(choice: str, x: torch.Tensor, covered: bool = True):
    """attnlab's causal depthwise conv kernel (`kernels/common/conv.py`: x [B, T, C], weight [C, K], bias,
    initial_state [B, K-1, C], silu -> y, final_state) for this CUDA tensor, or None: the mixer runs
    its PyTorch reference. `covered`: whether the kernel covers the layer's kernel size (the layer
    says why not when it is built)."""
    if not use_triton(choice, x, covered):
        return None
    if x.dtype == torch.float64:  # Triton's kernel accumulates in fp32
        warnings.warn("attnlab's conv kernel takes no float64: the convolution runs the PyTorch reference", stacklevel=3)
        return None
    from attnlab.models.kernels.common.conv import causal_conv1d

    return causal_conv1d


def nsa_parallel(choice: str, x: torch.Tensor, covered: bool = True):
    """NSA's training and prefill form for this call: attnlab's Triton kernels for CUDA tensors
    (memory linear in the sequence length), else the PyTorch reference. `covered`: whether the
    kernels compute the layer's options (the layer says why not when it is built)."""
    if not use_triton(choice, x, covered):
        from attnlab.models.ops.nsa import parallel_nsa

        return parallel_nsa
    from attnlab.models.kernels.nsa.parallel import parallel_nsa as fused

    return fused


def nsa_step_fn(choice: str, x: torch.Tensor, covered: bool = True):
    """NSA's one-token decoding step over the static cache's buffers for this call: attnlab's Triton
    kernel (`kernels/nsa/step.py`, one launch) for CUDA tensors in bf16, fp16 or fp32, else the PyTorch
    reference `ops.nsa.nsa_step`. `covered`: whether the kernel covers the layer's sizes (the layer
    says why not when it is built)."""
    from attnlab.models.ops.nsa import nsa_step as reference

    if not use_triton(choice, x, covered):
        return reference
    if x.dtype == torch.float64:  # Triton's kernel accumulates in fp32
        warnings.warn("attnlab's NSA step kernel takes no float64: the step runs the PyTorch reference", stacklevel=3)
        return reference
    from attnlab.models.kernels.nsa.step import nsa_step_kernel

    return nsa_step_kernel


def _log_forget_gate(logits: torch.Tensor, normalizer: float, keep: torch.Tensor | None) -> torch.Tensor:
    gate = torch.nn.functional.logsigmoid(logits.float()).div_(normalizer)
    return gate if keep is None else gate.mul_(keep)


class _GatedChunkGLA(torch.autograd.Function):
    """fla's chunked GLA with the log forget gate logsigmoid(logits) / normalizer computed in fp32
    inside. It keeps the gate's logits (bf16 under autocast) for the backward and recomputes the
    fp32 gate there, where applying the gate outside keeps two fp32 copies per layer (the
    logsigmoid's input and the kernel's cumulative sum). The values and gradients are those of the
    fp32 gate: the logits are the only input and are kept exactly."""

    @staticmethod
    def forward(ctx, q, k, v, logits, normalizer, keep, scale, initial_state, output_final_state):
        import triton
        from fla.ops.gla.chunk import chunk_gla_fwd

        chunk_size = min(64, max(16, triton.next_power_of_2(q.shape[1])))  # as fla's chunk_gla
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        gate = _log_forget_gate(logits, normalizer, keep)
        _, A, _, final_state, o = chunk_gla_fwd(q=q, k=k, v=v, g=gate, g_cumsum=None, scale=scale, initial_state=initial_state,
                                                output_final_state=output_final_state, chunk_size=chunk_size)
        ctx.save_for_backward(q, k, v, logits, keep, initial_state, A)
        ctx.normalizer, ctx.scale, ctx.chunk_size = normalizer, scale, chunk_size
        return o, final_state

    @staticmethod
    def backward(ctx, do, dht):
        from fla.ops.gla.chunk import chunk_gla_bwd

        q, k, v, logits, keep, initial_state, A = ctx.saved_tensors
        gate = _log_forget_gate(logits, ctx.normalizer, keep)
        dq, dk, dv, dg, dh0 = chunk_gla_bwd(q=q, k=k, v=v, g=gate, g_cumsum=None, scale=ctx.scale, initial_state=initial_state,
                                            h=None, A=A, do=do.contiguous(), dht=dht, chunk_size=ctx.chunk_size)
        del gate
        # d logsigmoid(x) / dx = sigmoid(-x)
        dlogits = torch.sigmoid(logits.float().neg_()).mul_(dg).div_(ctx.normalizer)
        if keep is not None:
            dlogits.mul_(keep)
        return dq.to(q), dk.to(k), dv.to(v), dlogits.to(logits.dtype), None, None, None, dh0, None


def gla_chunk_gated(q, k, v, logits, normalizer: float, scale, initial_state, output_final_state: bool, keep=None):
    """fla's chunked GLA on the log forget gate logsigmoid(`logits`) / `normalizer` (times `keep`,
    0 at padding), computed in fp32 inside; see `_GatedChunkGLA`."""
    return _GatedChunkGLA.apply(q, k, v, logits, normalizer, keep, scale, initial_state, output_final_state)


def gla_step_(q, k, v, logits, state, normalizer: float, scale: float, bias=None, keep=None):
    """One decoding step with the forget gate computed from its logits, the fp32 state advanced in
    place (see `kernels/gla/step.py`). q, k, logits: [B, H, K]; v: [B, H, V]; keep: [B] or None."""
    from attnlab.models.kernels.gla.step import gla_step_ as step

    return step(q, k, v, logits, state, normalizer, scale, bias, keep)


def gla_recurrent(q, k, v, gk, scale, initial_state, output_final_state: bool):
    """fla's fused recurrent GLA (decoding and short prefills)."""
    from fla.ops.gla import fused_recurrent_gla

    return fused_recurrent_gla(q, k, v, gk=gk, scale=scale, initial_state=initial_state, output_final_state=output_final_state)


def rms_norm(x, weight, eps: float):
    from fla.modules.norm.layernorm import rms_norm as fla_rms_norm

    return fla_rms_norm(x, weight, None, eps=eps)


class _AddRMSNorm(torch.autograd.Function):
    """(residual + x, and its RMSNorm in `out_dtype`) in one pass of fla's norm kernels; the
    backward gets the gradients of x and of the residual from one pass too. Keeps the sum (the
    residual's dtype) and the fp32 inverse norms, as fla's own prenorm path does."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, out_dtype):
        from fla.modules.norm.layernorm import layer_norm_fwd

        shape = x.shape
        rows = x.reshape(-1, shape[-1]).contiguous()
        res_rows = None if residual is None else residual.reshape(-1, shape[-1]).contiguous()
        y, _, rstd, summed = layer_norm_fwd(rows, weight, None, eps, residual=res_rows, out_dtype=out_dtype, is_rms_norm=True)
        ctx.save_for_backward(summed, weight, rstd)
        ctx.shape, ctx.x_dtype, ctx.has_residual = shape, x.dtype, residual is not None
        if residual is None:
            return y.view(shape)
        return y.view(shape), summed.view(shape)

    @staticmethod
    def backward(ctx, dy, dsummed=None):
        from fla.modules.norm.layernorm import layer_norm_bwd

        summed, weight, rstd = ctx.saved_tensors
        width = ctx.shape[-1]
        dy = torch.zeros(summed.shape, dtype=summed.dtype, device=summed.device) if dy is None else dy.reshape(-1, width).contiguous()
        dres = None if dsummed is None else dsummed.reshape(-1, width).contiguous()
        dx, dw, _, dres_in = layer_norm_bwd(dy, summed, weight, None, None, rstd, dres=dres, has_residual=ctx.has_residual,
                                            is_rms_norm=True, x_dtype=ctx.x_dtype)
        dresidual = dres_in.view(ctx.shape) if ctx.has_residual else None
        return dx.view(ctx.shape), dresidual, dw, None, None


def add_rms_norm(x, residual, weight, eps: float, out_dtype: torch.dtype):
    """RMSNorm of `x` (or of `residual + x`) with its output in `out_dtype`; with a residual,
    returns (normed, residual + x)."""
    return _AddRMSNorm.apply(x, residual, weight, eps, out_dtype)


def rms_norm_swish_gate(x, gate, weight, eps: float):
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    return rms_norm_gated(x, gate, weight, None, activation="swish", eps=eps)


def swiglu(gate, up):
    """silu(gate) * up through attnlab's elementwise kernels (`kernels/common/swiglu.py`)."""
    from attnlab.models.kernels.common.swiglu import swiglu as triton_swiglu

    return triton_swiglu(gate, up)


def swiglu_linear(gate, up, weight, bias):
    """down(swiglu(gate, up)) that keeps only gate and up for the backward (the product is recomputed)."""
    from attnlab.models.kernels.common.swiglu import swiglu_linear as triton_swiglu_linear

    return triton_swiglu_linear(gate, up, weight, bias)


def cross_entropy(logits, labels, ignore_index: int = -100, reduction: str = "mean"):
    """Token cross-entropy over [N, V] logits without materialising fp32 copies."""
    from fla.modules import FusedCrossEntropyLoss

    return FusedCrossEntropyLoss(ignore_index=ignore_index, reduction=reduction)(logits, labels)
