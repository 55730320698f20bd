"""GLA's chunked fla kernels as torch custom ops (`attnlab::gla_chunk_fwd`, `attnlab::gla_chunk_bwd`), checked on CPU
with attnlab's PyTorch GLA standing in for fla's `chunk_gla_fwd` / `chunk_gla_bwd`: the values and gradients of the
reference on the fp32 log gate, the custom ops' own checks (`torch.library.opcheck`), the inputs fla's kernels get laid
out as they read them, and the ops compiled into one graph with no break."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from attnlab.models.kernels.gla.chunk import _chunk_bwd, _chunk_fwd, _chunk_size, gla_chunk_gated
from attnlab.models.ops.gla import chunk_gla
from conftest import compiled_stack_trains_as_written

NORMALIZER = 16.0


def _contiguous(*tensors):
    for t in tensors:  # fla's kernels index [B, T, H, K] in that order
        assert t is None or t.is_contiguous(), "fla's kernel got a tensor not laid out as it reads it"


def _stand_in_fwd(q, k, v, g, g_cumsum, scale, initial_state, output_final_state, chunk_size, **_):
    _contiguous(q, k, v, g, initial_state)
    assert g.dtype == torch.float32 and chunk_size == _chunk_size(q.shape[1])
    o, final_state = chunk_gla(q.float(), k.float(), v.float(), g, initial_state=initial_state, scale=scale)
    A = q.new_zeros(*q.shape[:3], chunk_size, dtype=torch.float32)
    return None, A, None, (final_state if output_final_state else None), o.to(v.dtype)


def _stand_in_bwd(q, k, v, g, g_cumsum, scale, initial_state, h, A, do, dht, chunk_size, **_):
    """The recurrence's gradients written out (a custom op runs below autograd: no autograd inside it). Forward:
    S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T, o_t = scale * S_t^T q_t."""
    _contiguous(q, k, v, g, initial_state, A, do, dht)
    q, k, v, do = q.float(), k.float(), v.float(), do.float()
    batch, seq_len, heads, key_dim = q.shape
    states = [q.new_zeros(batch, heads, key_dim, v.shape[-1]) if initial_state is None else initial_state.float()]
    for t in range(seq_len):
        states.append(g[:, t, :, :, None].exp() * states[-1] + k[:, t, :, :, None] * v[:, t, :, None, :])
    dq, dk, dv, dg = (torch.zeros_like(x) for x in (q, k, v, g))
    dS = torch.zeros_like(states[0]) if dht is None else dht.float().clone()
    for t in reversed(range(seq_len)):
        dS = dS + scale * q[:, t, :, :, None] * do[:, t, :, None, :]
        dq[:, t] = scale * (states[t + 1] * do[:, t, :, None, :]).sum(-1)
        dk[:, t] = (dS * v[:, t, :, None, :]).sum(-1)
        dv[:, t] = (dS * k[:, t, :, :, None]).sum(-2)
        decay = g[:, t, :, :, None].exp()
        dg[:, t] = (dS * decay * states[t]).sum(-1)
        dS = decay * dS
    return dq, dk, dv, dg, (dS if initial_state is not None else None)


@pytest.fixture
def stand_in_fla(monkeypatch):
    """fla's `fla.ops.gla.chunk` replaced by the PyTorch reference (the ops import it when they run)."""
    module = types.ModuleType("fla.ops.gla.chunk")
    module.chunk_gla_fwd, module.chunk_gla_bwd = _stand_in_fwd, _stand_in_bwd
    for name in ("fla", "fla.ops", "fla.ops.gla"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.gla.chunk", module)
    yield module


def _inputs(batch=2, seq_len=40, heads=2, key_dim=8, value_dim=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_len, heads, key_dim, generator=gen)
    k = torch.randn(batch, seq_len, heads, key_dim, generator=gen)
    v = torch.randn(batch, seq_len, heads, value_dim, generator=gen)
    logits = torch.randn(batch, seq_len, heads, key_dim, generator=gen) * 3
    h0 = torch.randn(batch, heads, key_dim, value_dim, generator=gen)
    return q, k, v, logits, h0


def test_the_chunk_size_is_fla_chunk_glas():
    assert [_chunk_size(t) for t in (1, 16, 17, 33, 64, 65, 4096)] == [16, 16, 32, 64, 64, 64, 64]


@pytest.mark.parametrize("with_state", [False, True])
def test_the_ops_compute_the_reference_on_the_fp32_log_gate(stand_in_fla, with_state):
    q, k, v, logits, h0 = _inputs()
    keep = torch.ones(2, 40, 1, 1)
    keep[0, :5] = 0  # left padding: no write, no decay
    leaves = [t.clone().requires_grad_() for t in (q, k, v, logits, h0)]
    h0_in = leaves[4] if with_state else None
    o, state = gla_chunk_gated(leaves[0], leaves[1], leaves[2], leaves[3], NORMALIZER, 0.3, h0_in, with_state, keep=keep)
    assert (state is not None) is with_state
    loss = o.square().sum() + (state.square().sum() if with_state else 0)
    loss.backward()

    ref = [t.clone().requires_grad_() for t in (q, k, v, logits, h0)]
    gate = torch.nn.functional.logsigmoid(ref[3]) / NORMALIZER * keep
    o_ref, state_ref = chunk_gla(ref[0], ref[1], ref[2], gate, initial_state=ref[4] if with_state else None, scale=0.3)
    (o_ref.square().sum() + (state_ref.square().sum() if with_state else 0)).backward()
    torch.testing.assert_close(o, o_ref)
    if with_state:
        torch.testing.assert_close(state, state_ref)
    for got, want in zip(leaves[:4] + ([leaves[4]] if with_state else []), ref):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)
    if not with_state:
        assert leaves[4].grad is None


def test_inputs_in_another_layout_reach_fla_as_it_reads_them(stand_in_fla):
    """A compiled graph may hand the ops views (the projections' outputs split by heads, transposed buffers): fla's
    kernels get each laid out [B, T, H, K], and the results equal those of contiguous inputs."""
    q, k, v, logits, _ = _inputs()
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, logits)]
    assert not strided[3].is_contiguous()
    o, _ = gla_chunk_gated(*strided, NORMALIZER, 0.3, None, False)
    o_ref, _ = gla_chunk_gated(q, k, v, logits, NORMALIZER, 0.3, None, False)
    torch.testing.assert_close(o, o_ref)


def test_the_custom_ops_pass_torchs_checks(stand_in_fla):
    """Fake forms that match the real outputs, schemas, autograd registration (torch.library.opcheck)."""
    q, k, v, logits, h0 = _inputs(seq_len=20)
    for state, final in ((None, False), (h0, True)):
        args = (q.requires_grad_(), k.requires_grad_(), v, logits.requires_grad_(), NORMALIZER, None, 0.3, state, final)
        torch.library.opcheck(_chunk_fwd, args)
        o, A, _ = _chunk_fwd(*args)
        do = torch.randn_like(o)
        torch.library.opcheck(_chunk_bwd, (q.detach(), k.detach(), v, logits.detach(), NORMALIZER, None, 0.3, state, A.detach(),
                                           do, None))


@pytest.fixture
def _fresh_compile_cache():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_the_ops_compile_into_one_graph_with_their_gradients(stand_in_fla, _fresh_compile_cache):
    """Under torch.compile the ops are opaque calls in one graph (no break, fullgraph), forward and backward, with the
    values and gradients of the ops run as they are."""
    q, k, v, logits, _ = _inputs()
    weight = torch.randn(8, 8)

    def step(q, k, v, logits):  # glue on both sides of the op, as in a block
        o, _, _ = _chunk_fwd(q @ weight, k, v, logits.tanh() * 2, NORMALIZER, None, 0.3, None, False)
        return (o.sigmoid() * v).sum()

    compiled = torch.compile(step, fullgraph=True)
    grads = []
    for fn in (step, compiled):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, logits)]
        loss = fn(*leaves)
        loss.backward()
        grads.append((loss.detach(), [t.grad for t in leaves]))
    torch.testing.assert_close(grads[1][0], grads[0][0])
    for got, want in zip(grads[1][1], grads[0][1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_gla_model_on_the_ops_compiled_as_one_graph_trains_as_it_does_eagerly(stand_in_fla, _fresh_compile_cache,
                                                                                monkeypatch):
    """The blocks of a GLA model on the ops (fla's chunked path, more than 64 tokens), the entry point traced (the mark
    that keeps it a break lifted, as `compiles_whole` would have it): the stack compiles to one graph with no break, the
    ops opaque in it, and the loss and every gradient equal the model as written on the same ops."""
    import types

    import attnlab.models.mixers.gla as gla_mixer
    from attnlab.models import AttnLabConfig, kernels

    on_ops = types.SimpleNamespace(**{**vars(kernels), "use_fla": lambda choice, x: True})  # the mixer alone on the ops
    monkeypatch.setattr(gla_mixer, "kernels", on_ops)
    monkeypatch.setattr(gla_mixer, "gla_chunk_gated", gla_chunk_gated.__wrapped__)
    calls, forward = [], stand_in_fla.chunk_gla_fwd
    monkeypatch.setattr(stand_in_fla, "chunk_gla_fwd", lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs))
    config = AttnLabConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, mixer="gla", tie_word_embeddings=False)
    compiled_stack_trains_as_written(config, torch.randint(0, 64, (2, 80), generator=torch.Generator().manual_seed(1)))
    assert len(calls) == 4  # each model's two layers ran the ops


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_ops_on_flas_kernels_pass_torchs_checks_and_mutate_nothing():
    """On fla's real kernels: no input changed by either op (a compiled graph may read its buffers again),
    fake forms that match the outputs (torch.library.opcheck), and the gradients of the PyTorch reference."""
    pytest.importorskip("fla")
    q, k, v, logits, h0 = (t.cuda() for t in _inputs(seq_len=200, key_dim=32, value_dim=64))
    for state, final in ((None, False), (h0, True)):
        args = (q, k, v, logits, NORMALIZER, None, 0.3, state, final)
        before = [t.clone() for t in (q, k, v, logits) + ((state,) if state is not None else ())]
        o, A, final_state = _chunk_fwd(*args)
        do, dht = torch.randn_like(o), (torch.randn_like(final_state) if final else None)
        grads_in = (do.clone(), None if dht is None else dht.clone())
        _chunk_bwd(q, k, v, logits, NORMALIZER, None, 0.3, state, A, do, dht)
        after = [q, k, v, logits] + ([state] if state is not None else [])
        for b, a in zip(before, after):
            assert torch.equal(b, a), "an op changed one of its inputs"
        assert torch.equal(grads_in[0], do) and (dht is None or torch.equal(grads_in[1], dht))
        torch.library.opcheck(_chunk_fwd, args, test_utils=("test_schema", "test_faketensor"))
        torch.library.opcheck(_chunk_bwd, (q, k, v, logits, NORMALIZER, None, 0.3, state, A, do, dht),
                              test_utils=("test_schema", "test_faketensor"))

    leaves = [t.clone().requires_grad_() for t in (q, k, v, logits)]
    o, _ = gla_chunk_gated(*leaves, NORMALIZER, 0.3, None, False)
    (o * do).sum().backward()
    ref = [t.clone().double().requires_grad_() for t in (q, k, v, logits)]
    o_ref, _ = chunk_gla(ref[0], ref[1], ref[2], torch.nn.functional.logsigmoid(ref[3]) / NORMALIZER, scale=0.3)
    (o_ref * do.double()).sum().backward()
    for got, want in zip([o] + [t.grad for t in leaves], [o_ref] + [t.grad for t in ref]):
        error = (got.double() - want).norm() / want.norm()
        assert error < 5e-3, f"{error:.2e} of the reference's norm"  # fla multiplies in TF32
