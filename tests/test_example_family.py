"""A new mixer family is its own pieces and one registration, nothing else edited.

This file is a whole family, `example_cumulative_mean`: each position's output is the mean of the values of
the real tokens up to it, behind an output gate. It has what every family has, in the places a family in
`attnlab.models` keeps them:

* the PyTorch reference, the oracle (`models/ops/<family>.py`): `cumulative_mean`, one token at a time;
* the mixer's parallel form (training, prefill) and its one-token step form (decoding) over a fixed-size
  state, choosing once in `forward` (`models/mixers/<family>.py`; a fast path would live in
  `models/kernels/<family>/`);
* one registration through the registry's public API (`register_mixer`).

The tests then ask of it what attnlab asks of every mixer: a model config names it, the model trains, the
step form decodes as the parallel form computes, attnlab's engine and HF `generate` decode it alike, and it
saves and loads. The registration is undone after the tests, so nothing leaks into tests that go over
every registered mixer.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlab.data import ByteTokenizer
from attnlab.generation import generate
from attnlab.models import MIXERS, AttnLabConfig, AttnLabForCausalLM
from attnlab.models.mixers import Mixer, register_mixer

NAME = "example_cumulative_mean"
PROMPTS = ["Hello there, friend", "A", "The quick brown fox"]  # three lengths: left padding matters
NEW = 8


# --- the reference (models/ops/<family>.py) ---------------------------------------------------------------------

def cumulative_mean(v: torch.Tensor, is_token: torch.Tensor | None = None, state: tuple | None = None):
    """y_t = the mean of v_s over the real tokens s <= t, those of `state` included, one step at a time.

    v [B, T, D]; is_token [B, T] (1: a real token, 0: padding) or None; state (sum [B, D], count [B, 1]) fp32 or None.
    Returns (y [B, T, D] fp32, the state after the last token)."""
    batch, seq_len, width = v.shape
    total, count = state if state is not None else (v.new_zeros(batch, width, dtype=torch.float32),
                                                   v.new_zeros(batch, 1, dtype=torch.float32))
    ys = []
    for t in range(seq_len):
        keep = torch.ones(batch, 1) if is_token is None else is_token[:, t, None].float()
        total = total + keep * v[:, t].float()
        count = count + keep
        ys.append(total / count.clamp_min(1))
    return torch.stack(ys, dim=1), (total, count)


# --- the mixer (models/mixers/<family>.py) ----------------------------------------------------------------------

class CumulativeMean(Mixer):
    """o_proj(mean of v over the real tokens so far * silu(g)). Decodes over (sum, count) of fixed size."""

    fixed_size_state = True
    default_options = {"expand": 1}  # the values' width: expand * hidden_size

    def __init__(self, config, layer_idx: int):
        super().__init__()
        options = self.resolve_options(config.mixer_options)
        self.layer_idx = layer_idx
        width = options["expand"] * config.hidden_size
        self.v_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.g_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.o_proj = nn.Linear(width, config.hidden_size, bias=False)

    def forward(self, x, attention_mask=None, cache=None, use_cache=False):
        batch, seq_len, _ = x.shape
        v = self.v_proj(x).float()  # [B, T, D]
        keep = (torch.ones(batch, seq_len, 1, device=x.device) if attention_mask is None
                else attention_mask[:, -seq_len:, None].float())  # [B, T, 1]
        total = cache["sum"] if cache is not None else v.new_zeros(batch, v.shape[-1])
        count = cache["count"] if cache is not None else v.new_zeros(batch, 1)
        if seq_len == 1 and cache is not None:  # the step form: the state advanced by one token
            total, count = total + keep[:, 0] * v[:, 0], count + keep[:, 0]
            y = (total / count.clamp_min(1))[:, None]
        else:  # the parallel form: prefix sums over time
            sums = total[:, None] + torch.cumsum(v * keep, dim=1)
            counts = count[:, None] + torch.cumsum(keep, dim=1)
            y = sums / counts.clamp_min(1)
            total, count = sums[:, -1], counts[:, -1]
        out = self.o_proj((y * F.silu(self.g_proj(x).float())).to(x.dtype))
        return out, ({"sum": total, "count": count} if use_cache else None)


# --- the registration, undone after the tests -------------------------------------------------------------------

@pytest.fixture(autouse=True, scope="module")
def registered():
    assert NAME not in MIXERS
    register_mixer(NAME)(CumulativeMean)
    yield
    MIXERS.pop(NAME)


def model(seed: int = 0, **options) -> AttnLabForCausalLM:
    torch.manual_seed(seed)
    config = AttnLabConfig(vocab_size=259, hidden_size=32, num_layers=2, num_heads=2, mixer=NAME, mixer_options=options)
    return AttnLabForCausalLM(config).eval()


def test_the_parallel_form_is_the_reference_with_padding_and_a_carried_state():
    torch.manual_seed(0)
    layer = next(m for m in model().modules() if isinstance(m, CumulativeMean))
    x = torch.randn(2, 7, 32)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        out, state = layer(x, attention_mask=mask, use_cache=True)
        v = layer.v_proj(x)
        y, (total, count) = cumulative_mean(v, mask)
        expected = layer.o_proj(y * F.silu(layer.g_proj(x)))
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(state["sum"], total)
        torch.testing.assert_close(state["count"], count)
        more = torch.randn(2, 3, 32)  # a prefill that continues the cache
        out2, _ = layer(more, cache=state, use_cache=True)
        y2, _ = cumulative_mean(layer.v_proj(more), None, (total, count))
        torch.testing.assert_close(out2, layer.o_proj(y2 * F.silu(layer.g_proj(more))))


def test_a_config_naming_the_family_builds_and_trains_on_cpu():
    net = model(expand=2).train()
    assert net.config.mixer == NAME and net.config.mixer_options == {"expand": 2}
    ids = torch.randint(0, 256, (4, 24))
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-2)
    losses = []
    for _ in range(8):
        loss = net(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in net.parameters())
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_unknown_options_of_the_family_are_refused():
    with pytest.raises(ValueError, match="unknown option"):
        AttnLabConfig(vocab_size=259, hidden_size=32, num_layers=1, num_heads=2, mixer=NAME, mixer_options={"width": 3})


def test_step_decoding_equals_the_parallel_forward():
    net = model()
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        full = net(input_ids=ids).logits
        out = net(input_ids=ids[:, :5], use_cache=True)
        steps = [out.logits]
        for t in range(5, 12):
            out = net(input_ids=ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def hf_generate(net, tokenizer, **settings) -> list[list[int]]:
    enc = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    out = net.generate(**enc, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                       **settings)
    return out[:, enc["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("settings", [{}, {"num_beams": 3}])
def test_attnlab_generate_and_hf_generate_decode_the_family_alike(settings):
    net, tokenizer = model(seed=1), ByteTokenizer()
    ours = [r.candidates[0].token_ids for r in generate(net, tokenizer, PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW,
                                                         **settings)]
    assert all(len(ids) == NEW for ids in ours)
    assert ours == hf_generate(net, tokenizer, **settings)


def test_a_model_of_the_family_saves_and_loads(tmp_path):
    net = model(seed=2, expand=2)
    net.save_pretrained(tmp_path)
    loaded = AttnLabForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.mixer == NAME and loaded.config.mixer_options == {"expand": 2}
    ids = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, net(input_ids=ids).logits)
