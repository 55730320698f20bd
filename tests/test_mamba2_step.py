"""Mamba-2's fused decoding step (`kernels/mamba2/step.py`) against the mixer's PyTorch step.

On CPU the kernels run through Triton's interpreter on tiny shapes: outputs, the conv window and the
SSM state after several steps in a row, with padding rows and one or two groups, and the mixer's
forward wired to them. The CUDA tests (marked) decode a tiny model greedily on the fused step against
`kernels="torch"` token for token and against the parallel form's logits, and hold the bf16 step to
the fp32 reference.
"""

import pytest
import torch

from attnlab.models import MIXERS, AttnLabConfig, AttnLabForCausalLM
from attnlab.models.mixers.mamba2 import Mamba2


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


# (hidden, heads, state_size, groups, conv_kernel): P = 2 * hidden / heads
SHAPES = {
    "one group": (16, 2, 8, 1, 4),  # P 16, N 8
    "two groups": (16, 4, 16, 2, 4),  # P 8, N 16: heads 0, 1 read group 0, heads 2, 3 group 1
    "odd sizes": (24, 4, 12, 2, 3),  # P 12, N 12: masked blocks; a window of 2
}


def make_mixer(hidden, heads, state_size, groups, conv_kernel, device="cpu", kernels="torch", seed=0):
    torch.manual_seed(seed)
    config = AttnLabConfig(mixer="mamba2", hidden_size=hidden, num_heads=heads, kernels=kernels,
                           mixer_options={"state_size": state_size, "n_groups": groups, "conv_kernel": conv_kernel})
    mixer = MIXERS["mamba2"](config, 0).to(device)
    with torch.no_grad():  # every term visible: norm weights and D away from 1, a conv bias
        mixer.norm.weight.normal_(1.0, 0.3)
        mixer.D.normal_(1.0, 0.5)
        mixer.conv1d.bias.normal_(0.0, 0.3)
    return mixer


def fused(mixer, x, conv_state, ssm_state, keep):
    """The mixer's step output through the kernels (states advanced in place)."""
    from attnlab.models.kernels.mamba2.step import mamba2_step_

    z, xBC, dt = mixer.in_proj(x)[:, 0].split([mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], dim=-1)
    y = mamba2_step_(xBC, z, dt, conv_state, ssm_state, mixer.conv1d.weight[:, 0], mixer.conv1d.bias, mixer.dt_bias,
                     mixer.A_log, mixer.D, mixer.norm.weight, mixer.norm.group_size, mixer.norm.eps, mixer.n_groups, keep)
    assert y.dtype == z.dtype and y.shape == (x.shape[0], mixer.intermediate_size)
    return mixer.out_proj(y.to(x.dtype))[:, None]


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("shape", list(SHAPES))
@torch.no_grad()
def test_fused_step_matches_the_pytorch_step_over_several_steps(shape, padded):
    mixer = make_mixer(*SHAPES[shape])
    batch, prompt, steps = 3, 5, 4
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, prompt + steps, mixer.in_proj.in_features, generator=g)
    mask = torch.ones(batch, prompt + steps, dtype=torch.long)
    if padded:  # row 1 left-padded; row 2 has a padding position among its steps: neither may move the SSM state
        mask[1, :3] = 0
        mask[2, prompt + 1] = 0
    _, cache = mixer(x[:, :prompt], attention_mask=mask[:, :prompt], use_cache=True)
    conv_state, ssm_state = cache["conv_state"].clone().contiguous(), cache["recurrent_state"].clone()
    for t in range(prompt, prompt + steps):
        keep = mask[:, t] if padded else None
        ssm_before = ssm_state.clone()
        out = fused(mixer, x[:, t:t + 1], conv_state, ssm_state, keep)
        ref, cache = mixer(x[:, t:t + 1], attention_mask=mask[:, :t + 1] if padded else None, cache=cache, use_cache=True)
        assert rel_err(out, ref) <= 1e-5, t
        assert rel_err(conv_state, cache["conv_state"]) <= 1e-6, t
        assert rel_err(ssm_state, cache["recurrent_state"]) <= 1e-5, t
        if padded and not mask[2, t]:
            assert torch.equal(ssm_state[2], ssm_before[2])


@torch.no_grad()
def test_fused_step_rounds_as_the_cuda_step_in_bf16():
    """bf16 inputs and weights, fp32 state: close to the fp32 reference step of the same weights,
    with a padding position in the step (row 1)."""
    mixer = make_mixer(*SHAPES["two groups"])
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 6, mixer.in_proj.in_features, generator=g)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 5] = 0
    _, cache = mixer(x[:, :5], use_cache=True)
    ref, ref_cache = mixer(x[:, 5:], attention_mask=mask, cache={k: v.clone() for k, v in cache.items()}, use_cache=True)
    low = make_mixer(*SHAPES["two groups"]).to(torch.bfloat16)
    conv_state = cache["conv_state"].to(torch.bfloat16).contiguous()
    ssm_state = cache["recurrent_state"].clone()
    out = fused(low, x[:, 5:].bfloat16(), conv_state, ssm_state, mask[:, -1])
    assert torch.equal(ssm_state[1], cache["recurrent_state"][1])  # padding: the state does not move
    assert not conv_state[1, :, -1].any()  # and the window takes in a zero
    assert out.dtype == torch.bfloat16 and conv_state.dtype == torch.bfloat16
    assert rel_err(out, ref) <= 2e-2
    assert rel_err(ssm_state, ref_cache["recurrent_state"]) <= 2e-2
    assert rel_err(conv_state, ref_cache["conv_state"]) <= 1e-2


def test_fused_step_rejects_states_it_cannot_advance_in_place():
    from attnlab.models.kernels.mamba2.step import mamba2_step_

    mixer = make_mixer(*SHAPES["one group"])
    z, xBC, dt = torch.zeros(2, 32), torch.zeros(2, mixer.conv_dim), torch.zeros(2, 2)
    args = (mixer.conv1d.weight[:, 0], mixer.conv1d.bias, mixer.dt_bias, mixer.A_log, mixer.D, mixer.norm.weight, 32, 1e-6, 1)
    conv_state = torch.zeros(2, mixer.conv_dim, 3)
    with pytest.raises(ValueError, match="fp32"):
        mamba2_step_(xBC, z, dt, conv_state, torch.zeros(2, 2, 16, 8, dtype=torch.float64), *args)
    with pytest.raises(ValueError, match="conv_state"):
        mamba2_step_(xBC, z, dt, conv_state.transpose(1, 2).contiguous().transpose(1, 2), torch.zeros(2, 2, 16, 8), *args)


def test_the_step_runs_the_kernels_only_on_cuda_without_gradients():
    mixer = make_mixer(*SHAPES["one group"], kernels="auto")
    conv_state, ssm_state = torch.zeros(1, mixer.conv_dim, 3), torch.zeros(1, 2, 16, 8)
    x = torch.zeros(1, 1, 16)
    with torch.no_grad():
        assert not mixer.fused_step_applies(x, conv_state, ssm_state)  # CPU: the reference
    if torch.cuda.is_available():
        x, conv_state, ssm_state = x.cuda(), conv_state.cuda(), ssm_state.cuda()
        mixer.cuda()
        with torch.no_grad():
            assert mixer.fused_step_applies(x, conv_state, ssm_state)
            assert not mixer.fused_step_applies(x, None, ssm_state)
            assert not mixer.fused_step_applies(x, conv_state, ssm_state.bfloat16())
        assert not mixer.fused_step_applies(x, conv_state, ssm_state)  # gradients wanted


def test_a_conv_kernel_size_the_kernels_do_not_cover_falls_back_to_the_reference_with_a_warning():
    with pytest.warns(UserWarning, match="decoding step run the PyTorch reference"):
        mixer = make_mixer(16, 2, 8, 1, 9, kernels="auto")
    if torch.cuda.is_available():
        mixer.cuda()
        conv_state, ssm_state = torch.zeros(1, mixer.conv_dim, 8, device="cuda"), torch.zeros(1, 2, 16, 8, device="cuda")
        with torch.no_grad():
            assert not mixer.fused_step_applies(torch.zeros(1, 1, 16, device="cuda"), conv_state, ssm_state)


def tiny_model(device="cpu", kernels="auto", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    config = AttnLabConfig(vocab_size=64, hidden_size=16, num_layers=2, num_heads=4, mixer="mamba2", kernels=kernels,
                           mixer_options={"state_size": 16, "n_groups": 2, "chunk_size": 8})
    model = AttnLabForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
    return model.to(device=device, dtype=dtype)


def decode(model, ids, mask, steps):
    """Greedy decoding one token at a time over the model's cache: (tokens [B, steps], logits [B, steps, V])."""
    out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    cache, tokens, logits = out.past_key_values, [], []
    for _ in range(steps):
        last = out.logits[:, -1].float()
        logits.append(last)
        tokens.append(last.argmax(-1))
        mask = torch.cat([mask, mask.new_ones(len(ids), 1)], dim=1)
        out = model(input_ids=tokens[-1][:, None], attention_mask=mask, cache=cache, use_cache=True)
        cache = out.past_key_values
    return torch.stack(tokens, 1), torch.stack(logits, 1)


@torch.no_grad()
def test_model_forward_on_the_fused_step_decodes_as_the_reference(monkeypatch):
    """The mixer's forward wired to the kernels (on CPU through the interpreter), left-padded batch."""
    model = tiny_model()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :4] = 0
    ref_tokens, ref_logits = decode(model, ids, mask, 4)
    calls = []
    monkeypatch.setattr(Mamba2, "fused_step_applies", lambda self, x, c, s: calls.append(1) or (c is not None))
    tokens, logits = decode(model, ids, mask, 4)
    assert len(calls) >= 2 * 4  # every layer's every step took the kernels
    assert torch.equal(tokens, ref_tokens)
    assert rel_err(logits, ref_logits) <= 1e-5


@torch.no_grad()
def test_a_step_whose_new_state_is_not_asked_for_leaves_the_cache_alone(monkeypatch):
    monkeypatch.setattr(Mamba2, "fused_step_applies", lambda self, x, c, s: c is not None)
    mixer = make_mixer(*SHAPES["one group"])
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(6))
    _, cache = mixer(x[:, :5], use_cache=True)
    before = {name: t.clone() for name, t in cache.items()}
    out, none = mixer(x[:, 5:], cache=cache, use_cache=False)  # the reference step: nothing advanced in place
    assert none is None and all(torch.equal(cache[name], before[name]) for name in before)
    fused_out, _ = mixer(x[:, 5:], cache=cache, use_cache=True)
    assert rel_err(fused_out, out) <= 1e-5 and not torch.equal(cache["recurrent_state"], before["recurrent_state"])


# ------------------------------------------------------------------------------------------ CUDA


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.no_grad()
def test_cuda_greedy_decoding_on_the_fused_step_matches_the_reference_token_for_token(padded):
    fast = tiny_model("cuda", kernels="auto")
    ref = tiny_model("cuda", kernels="torch")
    ids = torch.randint(0, 64, (3, 9), device="cuda", generator=torch.Generator(device="cuda").manual_seed(4))
    mask = torch.ones(3, 9, dtype=torch.long, device="cuda")
    if padded:
        mask[1, :5] = 0
        mask[2, :2] = 0
    tokens, logits = decode(fast, ids, mask, 12)
    ref_tokens, ref_logits = decode(ref, ids, mask, 12)
    assert torch.equal(tokens, ref_tokens)
    assert rel_err(logits, ref_logits) <= 1e-4
    # the parallel form over the prompt and the generated tokens gives the same logits
    full = torch.cat([ids, tokens[:, :-1]], dim=1)
    full_mask = torch.cat([mask, mask.new_ones(3, 11)], dim=1)
    parallel = ref(input_ids=full, attention_mask=full_mask).logits[:, 8:].float()
    assert rel_err(logits, parallel) <= 1e-4


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.no_grad()
def test_cuda_fused_step_advances_the_states_in_place_and_bf16_matches_the_fp32_reference():
    # the benchmarked head shape (P 128, N 64) at a smaller width, two groups, a padding row
    fast = make_mixer(256, 4, 64, 2, 4, device="cuda", kernels="auto").bfloat16()
    ref = make_mixer(256, 4, 64, 2, 4, device="cuda", kernels="torch")
    ref.load_state_dict({k: v.float() for k, v in fast.state_dict().items()})
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(8, 40, 256, device="cuda", generator=g)
    mask = torch.ones(8, 40, dtype=torch.long, device="cuda")
    mask[3, :20] = 0
    mask[5, 36] = 0
    _, cache = fast(x[:, :32].bfloat16(), attention_mask=mask[:, :32], use_cache=True)
    _, ref_cache = ref(x[:, :32], attention_mask=mask[:, :32], use_cache=True)
    held = dict(cache)
    outs, ref_outs = [], []
    for t in range(32, 40):
        out, cache = fast(x[:, t:t + 1].bfloat16(), attention_mask=mask[:, :t + 1], cache=cache, use_cache=True)
        ref_out, ref_cache = ref(x[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=ref_cache, use_cache=True)
        outs.append(out)
        ref_outs.append(ref_out)
    assert all(cache[name] is held[name] for name in held)  # in place: nothing for the engine to copy
    assert rel_err(torch.cat(outs, 1), torch.cat(ref_outs, 1)) <= 2e-2
    assert rel_err(cache["recurrent_state"], ref_cache["recurrent_state"]) <= 2e-2
    assert rel_err(cache["conv_state"], ref_cache["conv_state"]) <= 1e-2


@pytest.mark.parametrize("settings", [dict(max_new_tokens=24), dict(max_new_tokens=12, num_beams=3)], ids=["greedy", "beam3"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decoding_on_the_fused_step_equals_the_eager_engine_and_the_reference(settings, monkeypatch):
    from attnlab.data import ByteTokenizer
    from attnlab.generation import engine, generate
    from attnlab.generation.graphs import StaticRunner, make_runner

    torch.manual_seed(0)
    cfg = dict(vocab_size=259, hidden_size=64, num_layers=2, num_heads=4, mixer="mamba2",
               mixer_options={"state_size": 16, "n_groups": 2})
    model = AttnLabForCausalLM(AttnLabConfig(**cfg)).cuda().eval()
    ref = AttnLabForCausalLM(AttnLabConfig(kernels="torch", **cfg)).cuda().eval()
    ref.load_state_dict(model.state_dict())
    prompts = ["Hello there, friend", "A", "The quick brown fox jumps"]

    def tokens(out):
        return [[c.token_ids for c in r.candidates] for r in out]

    graphed = generate(model, ByteTokenizer(), prompts, **settings)
    assert isinstance(make_runner(model), StaticRunner)  # decoded through captured steps
    monkeypatch.setattr(engine, "make_runner", lambda m, choice="auto": engine.ModelRunner(m))
    eager = generate(model, ByteTokenizer(), prompts, **settings)
    reference = generate(ref, ByteTokenizer(), prompts, **settings)
    assert tokens(graphed) == tokens(eager) == tokens(reference)
