"""One greedy decoding step's bookkeeping as one Triton kernel: argmax over the vocabulary, the EOS
test, and the updates of the engine's on-device buffers (generated tokens, lengths, finish flags).

In `_greedy_or_sample_on_device` these are a dozen tiny PyTorch ops per token after the model's
captured step; at small batches each op's launch costs more than its work, so one launch replaces
them. Same results as those ops: the argmax takes the first index of the maximum, as `torch.argmax`
does (NaN logits are not handled as torch handles them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # vocabulary entries one program compares per tile
EOS_BLOCK = 16  # EOS ids compared per tile
WARPS = 16  # one program streams a whole row: many warps keep enough loads in flight (H100, V = 32k to 152k)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # widened to fp32 exactly, so the argmax is unchanged


@triton.jit(do_not_specialize=["step", "s_out", "E"])  # a new step, length or EOS count must not compile a new kernel
def _greedy_step_kernel(LOGITS, s_logits, V, EOS, E, DONE, OUT, s_out, LENGTHS, ENDED, NEXT, step,
                        BLOCK: tl.constexpr, EOS_BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    # Each lane keeps its first maximum (strictly greater replaces, tiles go left to right); the
    # lowest index among the lanes holding the row's maximum is then torch.argmax's answer. Lanes
    # start at their own index so that a row of -inf gives 0, as torch does.
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = cols
    for start in range(0, V, BLOCK):
        c = start + cols
        x = tl.load(LOGITS + r * s_logits + c, mask=c < V, other=float("-inf")).to(tl.float32)
        better = x > best
        best = tl.where(better, x, best)
        best_i = tl.where(better, c, best_i)
    top = tl.max(best, axis=0)
    token = tl.min(tl.where(best == top, best_i, V), axis=0).to(tl.int64)

    hits = tl.zeros([EOS_BLOCK], tl.int32)
    for start in range(0, E, EOS_BLOCK):
        e = start + tl.arange(0, EOS_BLOCK)
        ids = tl.load(EOS + e, mask=e < E, other=-1)
        hits += (ids == token).to(tl.int32)
    live = tl.load(DONE + r) == 0
    is_eos = live & (tl.sum(hits, axis=0) > 0)
    keep = live & (tl.sum(hits, axis=0) == 0)

    tl.store(OUT + r * s_out + step, token, mask=keep)
    tl.store(LENGTHS + r, tl.load(LENGTHS + r) + keep.to(tl.int64))
    tl.store(ENDED + r, tl.full([], 1, tl.uint8), mask=is_eos)
    tl.store(DONE + r, tl.full([], 1, tl.uint8), mask=is_eos)
    tl.store(NEXT + r, token)


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype or t.device != device or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {shape} on {device}, "
                         f"got {t.dtype} of shape {tuple(t.shape)} on {t.device}")


def greedy_step_(logits: torch.Tensor, eos: torch.Tensor, done: torch.Tensor, out: torch.Tensor, lengths: torch.Tensor,
                 ended_by_eos: torch.Tensor, step: int) -> torch.Tensor:
    """Choose every row's next token (argmax of `logits` [R, V]) and record it, in place.

    A live row (not `done`) whose token is one of `eos` [E] ends: `ended_by_eos` and `done` are set.
    Any other live row keeps its token: `out[r, step]` = token, `lengths[r]` += 1. Rows already done
    are left as they are. Returns the tokens [R] int64 of every row, done ones included (the next
    step feeds them to the model, whose outputs for those rows are ignored).
    """
    if logits.dim() != 2 or logits.shape[1] == 0 or logits.dtype not in DTYPES or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, vocab] of {', '.join(map(str, DTYPES))} with a contiguous last dim, "
                         f"got {logits.dtype} of shape {tuple(logits.shape)} and strides {logits.stride()}")
    R, device = logits.shape[0], logits.device
    _check("eos", eos, (eos.numel(),), torch.long, device)
    _check("done", done, (R,), torch.bool, device)
    _check("lengths", lengths, (R,), torch.long, device)
    _check("ended_by_eos", ended_by_eos, (R,), torch.bool, device)
    if out.dim() != 2:
        raise ValueError(f"out must be [rows, max_new_tokens], got shape {tuple(out.shape)}")
    _check("out", out, (R, out.shape[1]), torch.long, device)
    if not 0 <= step < out.shape[1]:
        raise ValueError(f"step {step} is outside out's {out.shape[1]} columns")
    next_tokens = torch.empty(R, dtype=torch.long, device=device)
    if R == 0:
        return next_tokens
    E = eos.numel()
    if E == 0:  # never read (every load is masked), but the kernel wants a real pointer
        eos = torch.full((1,), -1, dtype=torch.long, device=device)
    _greedy_step_kernel[(R,)](logits, logits.stride(0), logits.shape[1], eos, E, done.view(torch.uint8), out,
                              out.stride(0), lengths, ended_by_eos.view(torch.uint8), next_tokens, step,
                              BLOCK=BLOCK, EOS_BLOCK=EOS_BLOCK, num_warps=WARPS)
    return next_tokens
