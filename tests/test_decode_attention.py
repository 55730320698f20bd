"""Decoding over a static KV cache: the split-key Triton kernel (`kernels/softmax/decode.py`) against
SDPA under the same mask (through Triton's interpreter on CPU, compiled on CUDA), and the engine's
captured steps against its eager static steps on a GPU."""

import pytest
import torch

from attnlab.generation.graphs import StaticRunner, kv_capacity, static_decoding
from attnlab.models import AttnLabConfig, AttnLabForCausalLM
from attnlab.models.kernels.softmax.decode import decode_attention, splits_for
from attnlab.models.ops.softmax import decode_attention as decode_attention_reference

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cache_inputs(batch, heads, kv_heads, head_dim, capacity, lengths, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, heads, head_dim, device=device, generator=g).to(dtype)
    k = torch.randn(batch, capacity, kv_heads, head_dim, device=device, generator=g).to(dtype)
    v = torch.randn(batch, capacity, kv_heads, head_dim, device=device, generator=g).to(dtype)
    length = torch.tensor(lengths, device=device)
    valid = torch.rand(batch, capacity, device=device, generator=g) > 0.3  # holes: left padding
    valid[torch.arange(batch), length - 1] = True  # the token just written
    return q, k, v, valid, length


@pytest.mark.parametrize("batch, heads, kv_heads, head_dim, capacity, lengths", [
    (3, 4, 2, 16, 150, [145, 40, 1]),  # grouped heads, a row with one column, a partial last tile
    (2, 2, 2, 8, 64, [64, 64]),  # full, one tile
    (1, 4, 4, 12, 300, [77]),  # head dim not a power of two; most ranges past the length
])
def test_kernel_matches_sdpa_under_the_mask(batch, heads, kv_heads, head_dim, capacity, lengths):
    q, k, v, valid, length = cache_inputs(batch, heads, kv_heads, head_dim, capacity, lengths)
    out = decode_attention(q, k, v, valid.view(torch.uint8), length, 0.3)
    ref = decode_attention_reference(q, k, v, valid, length, 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_columns_past_the_length_are_never_read():
    q, k, v, valid, length = cache_inputs(2, 2, 2, 8, 128, [50, 70])
    valid[:, 70:] = True
    k[:, 70:], v[:, 70:] = float("nan"), float("nan")  # unwritten: garbage that must not reach the output
    out = decode_attention(q, k, v, valid.view(torch.uint8), length, 0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, decode_attention_reference(q, k[:, :70], v[:, :70], valid[:, :70], length, 0.5))


def test_splits_keep_the_gpu_busy_and_each_range_holds_a_tile():
    from attnlab.models.kernels.softmax.decode import BLOCK_N, TARGET_PROGRAMS

    assert splits_for(8 * 16, 2304) == min(TARGET_PROGRAMS // 128, 2304 // BLOCK_N)  # batch 8, 16 heads
    assert splits_for(1, 64) == 1
    assert splits_for(1, 100_000) == min(TARGET_PROGRAMS, -(-100_000 // BLOCK_N))


def test_kv_capacity_rounds_up_so_that_captures_are_reused():
    assert kv_capacity(2048, 256) == 2304
    assert kv_capacity(5, 12) == 256
    assert kv_capacity(250, 6) == 256 and kv_capacity(250, 7) == 512


def test_softmax_decodes_statically_and_refuses_without_a_length_bound():
    model = AttnLabForCausalLM(AttnLabConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, mixer="softmax")).eval()
    assert static_decoding(model)
    runner = StaticRunner(model, capture=False)
    ids, mask = torch.randint(0, 64, (2, 7)), torch.ones(2, 7, dtype=torch.long)
    with pytest.raises(ValueError, match="reserve"):
        runner.prefill(ids, mask)
    runner.reserve(3)
    logits, state = runner.prefill(ids, mask)
    buffers = state.cache.states[0]
    assert buffers["key"].shape[1] == 256 and buffers["length"].tolist() == [7, 7]
    step = runner.step(logits.argmax(-1), state)
    assert buffers["length"].tolist() == [8, 8] and bool(buffers["valid"][:, 7].all()) and step.shape == (2, 64)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_on_cuda_matches_sdpa(dtype):
    q, k, v, valid, length = cache_inputs(8, 16, 4, 64, 2304, [2100] * 8, device="cuda", dtype=dtype)
    out = decode_attention(q, k, v, valid.view(torch.uint8), length, 0.125).float()
    ref = decode_attention_reference(q.float(), k.float(), v.float(), valid, length, 0.125)
    assert float((out - ref).norm() / ref.norm()) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("settings", [
    dict(max_new_tokens=40),
    dict(max_new_tokens=24, do_sample=True, top_k=50, seed=1, num_return_sequences=2),
    dict(max_new_tokens=16, num_beams=4, length_penalty=1.2),
], ids=["greedy", "sample", "beam4"])
def test_captured_softmax_steps_equal_the_eager_static_steps(settings, monkeypatch):
    from attnlab.generation import engine, generate
    from attnlab.generation.graphs import make_runner
    from attnlab.data import ByteTokenizer

    torch.manual_seed(0)
    model = AttnLabForCausalLM(AttnLabConfig(vocab_size=259, hidden_size=512, num_layers=2, num_heads=8, mixer="softmax",
                                             mixer_options={"num_kv_heads": 4})).cuda().to(torch.bfloat16).eval()
    assert isinstance(make_runner(model), StaticRunner)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (5, 90, 33)]
    eos = [257, 65]
    graphed = generate(model, ByteTokenizer(), prompts, eos_token_id=eos, **settings)
    replayed = generate(model, ByteTokenizer(), prompts, eos_token_id=eos, **settings)  # the graphs kept from the first call
    monkeypatch.setattr(engine, "make_runner", lambda m, choice="auto": StaticRunner(m, capture=False))
    eager = generate(model, ByteTokenizer(), prompts, eos_token_id=eos, **settings)
    tokens = [[[c.token_ids for c in r.candidates] for r in out] for out in (graphed, replayed, eager)]
    assert tokens[0] == tokens[1] == tokens[2]


@pytest.mark.parametrize("options", [
    dict(similarity="exp", denominator="count", clamp_scores=5.0),  # gated_softmax
    dict(similarity="exp", denominator="sum", decay="neg_softplus"),  # 2mamba-e
    dict(similarity="softmax", denominator="sum_clamped", clamp_scores=5.0),
    dict(similarity="softmax", denominator="sum_detached", clamp_scores=5.0, decay="neg_softplus"),
    dict(similarity="exp", denominator="none", clamp_scores=5.0),
    dict(similarity="exp", denominator="count_power", clamp_scores=5.0),
])
def test_family_step_on_the_kernel_matches_the_reference_form(options):
    """The attention family's exp similarities over a static cache: the kernel's softmax weights,
    raw sum and count give every denominator as `attention_terms` computes it."""
    from attnlab.models.mixers.attention_family import AttentionFamily
    from attnlab.models.ops.attention_family import log_decay_cumsum, parallel_attention

    torch.manual_seed(0)
    config = AttnLabConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, mixer="attention_family",
                           mixer_options=options)
    mixer = AttentionFamily(config, 0)
    batch, capacity, heads, dim = 2, 96, 2, 16
    q, k, v, valid, length = cache_inputs(batch, heads, heads, dim, capacity, [90, 33])
    q = q * 3  # scores past the clamp
    decays = None
    if options.get("decay"):
        decays = log_decay_cumsum(-torch.rand(batch, capacity, heads)).flip(1).transpose(1, 2).contiguous()  # each key's decay to the query
    cache = {"key": k, "value": v, "valid": valid, "length": length}
    out = mixer._static_kernel(q[:, None], cache, decays)
    columns = torch.arange(capacity)
    ref = parallel_attention(
        q[:, None], k, v, clamp=options.get("clamp_scores"), query_log_decay=None if decays is None else torch.zeros(batch, 1, heads),
        key_log_decay=None if decays is None else -decays.transpose(1, 2), key_mask=valid & (columns[None] < length[:, None]), **mixer._attention_kwargs())
    # fp32 sums in another order: an error relative to the output's scale (un-normalised outputs reach the hundreds)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_and_cache_write_in_one_kernel_match_the_separate_steps(dtype):
    from attnlab.models.kernels.softmax.decode import rope_write_
    from attnlab.models.mixers.softmax import write_static_kv
    from attnlab.models.ops.common import apply_rotary, rotary_cos_sin, rotary_inv_freq

    torch.manual_seed(0)
    batch, heads, kv_heads, dim, capacity = 3, 4, 2, 12, 20
    q = torch.randn(batch, heads, dim).to(dtype)
    kv = torch.randn(batch, 2 * kv_heads * dim).to(dtype)  # k and v as views of one projection, as when fused
    k, v = kv[:, :kv_heads * dim].view(batch, kv_heads, dim), kv[:, kv_heads * dim:].view(batch, kv_heads, dim)

    def cache():
        return {"key": torch.zeros(batch, capacity, kv_heads, dim, dtype=dtype), "value": torch.zeros(batch, capacity, kv_heads, dim, dtype=dtype),
                "valid": torch.zeros(batch, capacity, dtype=torch.bool), "length": torch.tensor([5, 9, 0]),
                "position": torch.tensor([5, 3, 0])}

    fused, ref = cache(), cache()
    q_fused = rope_write_(q, k, v, rotary_inv_freq(dim, 10000.0), fused["position"], fused["length"], fused["key"], fused["value"],
                          fused["valid"].view(torch.uint8))
    cos, sin = rotary_cos_sin(ref["position"][:, None], dim, 10000.0)
    q_ref = apply_rotary(q[:, None], cos, sin)[:, 0]
    write_static_kv(ref, apply_rotary(k[:, None], cos, sin), v[:, None], None)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(q_fused, q_ref, **tol)
    torch.testing.assert_close(fused["key"], ref["key"], **tol)
    torch.testing.assert_close(fused["value"], ref["value"], rtol=0, atol=0)
    assert torch.equal(fused["valid"], ref["valid"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_one_kernel_matches_the_reference(dtype):
    from attnlab.models.kernels.softmax.decode import rope_
    from attnlab.models.ops.common import apply_rotary, rotary_cos_sin, rotary_inv_freq

    torch.manual_seed(0)
    qkv = torch.randn(3, 3, 4, 8).to(dtype)  # q, k, v of 4 heads as views of one projection
    q, k = qkv[:, 0], qkv[:, 1, :2]  # grouped: 2 key heads
    position = torch.tensor([0, 7, 1000])
    q_rot, k_rot = rope_(q, k, rotary_inv_freq(8, 10000.0), position)
    cos, sin = rotary_cos_sin(position[:, None], 8, 10000.0)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(q_rot, apply_rotary(q[:, None], cos, sin)[:, 0], **tol)
    torch.testing.assert_close(k_rot, apply_rotary(k[:, None], cos, sin)[:, 0], **tol)


def test_cache_write_in_one_kernel_matches_the_eager_write():
    from attnlab.models.kernels.softmax.decode import kv_write_
    from attnlab.models.mixers.softmax import static_kv_state, write_static_kv

    g = torch.Generator().manual_seed(0)
    prefix = {"key": torch.randn(3, 5, 2, 12, generator=g), "value": torch.randn(3, 5, 2, 12, generator=g),
              "mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])}
    eager, fused = static_kv_state(prefix, 16), static_kv_state(prefix, 16)
    for _ in range(3):
        k, v = torch.randn(3, 1, 2, 12, generator=g), torch.randn(3, 1, 2, 12, generator=g)
        write_static_kv(eager, k, v, None)
        kv_write_(k[:, 0], v[:, 0], fused["length"], fused["position"], fused["key"], fused["value"], fused["valid"].view(torch.uint8))
    for name in ("key", "value", "valid", "length", "position"):
        assert torch.equal(fused[name], eager[name]), name


def test_attention_advances_each_keys_decay_as_it_reads_it():
    q, k, v, valid, length = cache_inputs(3, 4, 2, 16, 150, [145, 40, 1])
    g = torch.Generator().manual_seed(1)
    bias = -torch.rand(3, 4, 150, generator=g) * 3
    step = -torch.rand(3, 4, generator=g)
    expected = bias + step[..., None]
    expected[torch.arange(3), :, length - 1] = 0.0  # the key just written has not decayed
    columns = torch.arange(150)
    expected = torch.where(columns < length[:, None, None], expected, bias)  # columns past the length are left alone
    o, stats = decode_attention(q, k, v, valid.view(torch.uint8), length, 0.3, bias=bias, stats=True, step_bias=step)
    ref, ref_stats = decode_attention(q, k, v, valid.view(torch.uint8), length, 0.3, bias=expected.clone(), stats=True)
    torch.testing.assert_close(bias, expected, rtol=0, atol=0)
    torch.testing.assert_close(o, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stats, ref_stats, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mixer", ["2mamba-e", "gated_softmax"])
def test_family_static_steps_through_the_kernels_give_the_reference_tokens(mixer, monkeypatch):
    """The attention family's KV steps with attnlab's kernels (here through Triton's interpreter): the
    one-kernel cache write and the attention that advances the decays give the reference's tokens."""
    from attnlab.data import ByteTokenizer
    from attnlab.generation import engine, generate
    from attnlab.models import kernels
    from attnlab.models.mixers import attention_family

    torch.manual_seed(0)
    model = AttnLabForCausalLM(AttnLabConfig(vocab_size=259, hidden_size=32, num_layers=2, num_heads=2, mixer=mixer)).eval()
    monkeypatch.setattr(engine, "make_runner", lambda m, choice="auto": StaticRunner(m, capture=False))
    prompts = ["Hello there", "A", "The quick brown fox"]
    settings = dict(max_new_tokens=6, output_scores=True, batch_size=3)
    reference = generate(model, ByteTokenizer(), prompts, **settings)
    calls = []
    real = attention_family.AttentionFamily._static_kernel

    def counted(self, *args):
        calls.append(1)
        return real(self, *args)

    monkeypatch.setattr(attention_family.AttentionFamily, "_static_kernel", counted)
    monkeypatch.setattr(kernels, "use_triton", lambda choice, x, covered=True: covered and choice != "torch" and x.dim() == 4 and x.shape[1] == 1)
    fused = generate(model, ByteTokenizer(), prompts, **settings)
    assert calls  # the kernel path ran
    for a, b in zip(reference, fused):
        assert [c.token_ids for c in a.candidates] == [c.token_ids for c in b.candidates]
        assert [c.score for c in a.candidates] == pytest.approx([c.score for c in b.candidates], rel=1e-4)
