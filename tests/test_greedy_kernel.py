"""The greedy step kernel: argmax and the engine's on-device bookkeeping in one launch, against the
PyTorch ops it replaces in `_greedy_or_sample_on_device`.

Without a GPU the kernel runs through Triton's interpreter (tests/conftest.py) on small shapes, with
one the same tests run it compiled; the CUDA test at the end holds the engine with the kernel to the
engine without it, token for token.
"""

import pytest
import torch

pytest.importorskip("triton")

from attnlab.generation import greedy_kernel  # noqa: E402
from attnlab.generation.greedy_kernel import greedy_step_  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference_step(logits, eos_t, done, out, lengths, ended_by_eos, step):
    """The engine's ops for a plain greedy step, as they stand beside the kernel."""
    next_tokens = logits.argmax(dim=-1)
    live = ~done
    is_eos = torch.isin(next_tokens, eos_t) & live if len(eos_t) else torch.zeros_like(live)
    keep = live & ~is_eos
    out[:, step] = torch.where(keep, next_tokens, out[:, step])
    lengths += keep.long()
    ended_by_eos |= is_eos
    done |= is_eos
    return next_tokens


def buffers(R, steps, pad_id=7):
    out = torch.full((R, steps), pad_id, dtype=torch.long, device=DEVICE)
    return out, *(torch.zeros(R, dtype=t, device=DEVICE) for t in (torch.long, torch.bool, torch.bool))


def step_logits(gen, R, V, step, eos, dtype):
    """Logits whose argmax is often a tie (coarse values: bf16 and fp32 alike hold them exactly) or, on
    some rows and steps, an EOS id; one row of -inf, where torch's argmax answers 0."""
    logits = torch.randint(-40, 8, (R, V), generator=gen).to(dtype) / 4
    logits[0, [3, V // 2, V - 1]] = 5.0  # three equal maxima, the first in the first tile
    logits[1, [V - 2, V - 1]] = 6.0  # two equal maxima in the last, partial tile
    if eos and step % 2:
        logits[2 + step % 3, eos[step % len(eos)]] = 9.0
    if step == 2:
        logits[R - 1] = float("-inf")
    return logits.to(DEVICE)


@pytest.mark.parametrize("block", [128, greedy_kernel.BLOCK])  # several tiles per row; one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V,eos", [(1000, [17, 999]), (259, [258]), (259, [])])
def test_greedy_step_matches_the_engine_ops_over_several_steps(V, eos, dtype, block, monkeypatch):
    monkeypatch.setattr(greedy_kernel, "BLOCK", block)
    gen = torch.Generator().manual_seed(V + len(eos))
    R, steps = 6, 6
    eos_t = torch.tensor(eos, dtype=torch.long, device=DEVICE)
    out, lengths, done, ended = buffers(R, steps)
    done[5] = True  # a row already done before the first step
    ref = tuple(t.clone() for t in (out, lengths, done, ended))
    for step in range(steps):
        logits = step_logits(gen, R, V, step, eos, dtype)
        tokens = greedy_step_(logits, eos_t, done, out, lengths, ended, step)
        ref_tokens = reference_step(logits, eos_t, ref[2], ref[0], ref[1], ref[3], step)
        assert torch.equal(tokens, ref_tokens)
        for got, want in zip((out, lengths, done, ended), ref):
            assert torch.equal(got, want)
    assert ended.any() == bool(eos) and not ended[5]  # EOS ended some rows; never a row already done


def test_greedy_step_reads_strided_rows_of_logits():
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(3, 4, 259, generator=gen).to(DEVICE)  # [rows, time, vocab]: the last position's logits are a strided view
    logits = full[:, -1]
    eos_t = logits[1].argmax()[None]
    out, lengths, done, ended = buffers(3, 2)
    tokens = greedy_step_(logits, eos_t, done, out, lengths, ended, 1)
    assert torch.equal(tokens, logits.argmax(-1))
    assert done.tolist() == [False, True, False] and ended.tolist() == [False, True, False]
    assert torch.equal(out[:, 1], torch.where(done, 7, tokens)) and lengths.tolist() == [1, 0, 1]


def test_greedy_step_refuses_buffers_of_the_wrong_shape():
    out, lengths, done, ended = buffers(4, 3)
    logits, eos_t = torch.zeros(4, 10, device=DEVICE), torch.tensor([1], device=DEVICE)
    with pytest.raises(ValueError, match="lengths"):
        greedy_step_(logits, eos_t, done, out, lengths[:3], ended, 0)
    with pytest.raises(ValueError, match="logits"):
        greedy_step_(logits[..., None], eos_t, done, out, lengths, ended, 0)
    with pytest.raises(ValueError, match="step"):
        greedy_step_(logits, eos_t, done, out, lengths, ended, 3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mixer", ["gla", "2mamba"])
def test_engine_with_the_greedy_kernel_decodes_as_without_it(mixer, monkeypatch):
    from attnlab.data import ByteTokenizer
    from attnlab.generation import engine, generate
    from attnlab.models import AttnLabConfig, AttnLabForCausalLM

    torch.manual_seed(0)
    model = AttnLabForCausalLM(AttnLabConfig(vocab_size=259, hidden_size=256, num_layers=2, num_heads=2, mixer=mixer))
    model = model.to("cuda").eval()
    prompts = ["Hello there, friend", "A", "The quick brown fox", "To be, or not"]
    launches = []

    def counted(*args):
        launches.append(args[-1])
        return greedy_step_(*args)

    monkeypatch.setattr(greedy_kernel, "greedy_step_", counted)

    def decode(**settings):
        out = generate(model, ByteTokenizer(), prompts, **{"max_new_tokens": 40, **settings})
        return [(c.token_ids, c.finish_reason) for r in out for c in r.candidates]

    plain = decode(eos_token_id=[])
    eos = [plain[0][0][20], plain[2][0][30]]  # tokens the rows emit: rows end by EOS at different steps
    for settings in ({}, {"eos_token_id": eos}, {"eos_token_id": eos, "min_new_tokens": 5}, {"eos_token_id": []}):
        launches.clear()
        fused = decode(**settings)
        assert launches and min(launches) == settings.get("min_new_tokens", 0)  # EOS suppressed: the ops, not the kernel
        monkeypatch.setattr(engine, "FUSED_GREEDY", False)
        assert fused == decode(**settings), settings
        monkeypatch.setattr(engine, "FUSED_GREEDY", True)
        if settings == {"eos_token_id": eos}:  # (suppressing EOS for 5 steps may steer the rows off these tokens)
            assert "eos" in {reason for _, reason in fused}
