"""The softmax mixer's paths against the PyTorch reference `attnlab.models.ops.softmax`."""

import torch

from attnlab.models import AttnLabConfig
from attnlab.models.mixers.softmax import SoftmaxAttention
from attnlab.models.ops.softmax import causal_attention, decode_attention


def mixer(num_kv_heads: int = 2) -> SoftmaxAttention:
    torch.manual_seed(0)
    config = AttnLabConfig(vocab_size=259, hidden_size=32, num_layers=1, num_heads=4, mixer="softmax",
                           mixer_options={"num_kv_heads": num_kv_heads})
    return SoftmaxAttention(config, 0)


def qkv(batch: int, seq_len: int, total: int, heads: int = 4, kv_heads: int = 2, dim: int = 8):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch, seq_len, heads, dim, generator=g), torch.randn(batch, total, kv_heads, dim, generator=g),
            torch.randn(batch, total, kv_heads, dim, generator=g))


def test_the_parallel_form_on_sdpa_is_the_reference_causal_attention():
    layer = mixer()
    q, k, v = qkv(2, 9, 9)
    torch.testing.assert_close(layer._parallel(q, k, v, None, 0), causal_attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_the_parallel_form_with_left_padding_and_a_past_is_the_reference():
    layer = mixer()
    q, k, v = qkv(2, 4, 10)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    torch.testing.assert_close(layer._parallel(q, k, v, mask, 6), causal_attention(q, k, v, mask), atol=1e-5, rtol=1e-5)


def test_a_decoding_step_over_the_cache_is_the_reference():
    layer = mixer(num_kv_heads=1)
    q, k, v = qkv(2, 1, 7, kv_heads=1)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0
    torch.testing.assert_close(layer._step(q, k, v, mask), causal_attention(q, k, v, mask), atol=1e-5, rtol=1e-5)


def test_the_static_cache_reference_is_causal_attention_over_the_written_columns():
    q, k, v = qkv(2, 1, 12)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[0, :4] = False
    length = torch.tensor([9, 12])
    out = decode_attention(q[:, 0], k, v, valid, length, 8 ** -0.5)
    for row in range(2):
        n = int(length[row])
        want = causal_attention(q[row:row + 1], k[row:row + 1, :n], v[row:row + 1, :n], valid[row:row + 1, :n].long())
        torch.testing.assert_close(out[row], want[0, 0], atol=1e-5, rtol=1e-5)
