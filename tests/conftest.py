import os
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
if not torch.cuda.is_available():
    # attnlab's own Triton kernels run on CPU tensors through Triton's interpreter; it must be chosen
    # before triton is first imported (tests/test_attention_family_kernels.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A tiny run: every test that trains starts from these overrides (seconds on 2 CPU cores).
TINY = [
    "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
    "data.seq_len=32", "train.batch_size=4", "train.max_steps=8", "train.warmup_steps=2",
    "train.eval_every=4", "train.eval_batches=2", "train.save_every=4", "train.log_every=2",
    "train.sample_tokens=8", "train.device=cpu",
]


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """About 40 KB of the default corpus as one local text file."""
    from attnlab.data import read_documents

    text = "\n".join(read_documents("shakespeare")[:2])[:40_000]
    path = tmp_path_factory.mktemp("corpus") / "plays.txt"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def tiny(small_corpus) -> list[str]:
    return TINY + [f"data.source={small_corpus}"]


def run_cli(*args: str) -> int:
    """Run the attnlab CLI in this process; return its exit code."""
    from attnlab.cli import main

    argv = sys.argv
    sys.argv = ["attnlab", *args]
    try:
        main()
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        sys.argv = argv
    return 0


def sets(overrides: list[str]) -> list[str]:
    out = []
    for o in overrides:
        out += ["--set", o]
    return out


def random_nsa_inputs(batch, seq_len, heads, kv_heads, dim, seed=0):
    """q, k, v and the three branch gates of an NSA op, from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_len, heads, dim, generator=gen) * 2
    k = torch.randn(batch, seq_len, kv_heads, dim, generator=gen)
    v = torch.randn(batch, seq_len, kv_heads, dim, generator=gen)
    gates = torch.rand(batch, seq_len, heads, 3, generator=gen).unbind(-1)
    return q, k, v, gates


@pytest.fixture(scope="module")
def attnlab_dir(tmp_path_factory):
    """A tiny attnlab GLA model (tied head) with the byte tokenizer, saved once per test module."""
    from attnlab.data import load_tokenizer
    from attnlab.models import AttnLabConfig, AttnLabForCausalLM

    torch.manual_seed(0)
    model = AttnLabForCausalLM(AttnLabConfig(vocab_size=259, hidden_size=32, num_layers=1, num_heads=2))
    path = tmp_path_factory.mktemp("attnlab")
    model.save_pretrained(path)
    load_tokenizer("byte").save_pretrained(path)
    return path


def captured_and_eager_tokens(model, tokenizer, prompts, eager_runner, monkeypatch, **settings):
    """The first candidate's tokens per prompt from `generate` on the runner it chooses (CUDA graphs captured), and on
    `eager_runner(model)` (the same static steps, run eagerly)."""
    from attnlab.generation import engine, generate
    from attnlab.generation.runner import release_graphs

    release_graphs(model)
    graphed = generate(model, tokenizer, prompts, **settings)
    monkeypatch.setattr(engine, "make_runner", lambda m, choice="auto": eager_runner(m))
    eager = generate(model, tokenizer, prompts, **settings)
    release_graphs(model)
    return [r.candidates[0].token_ids for r in graphed], [r.candidates[0].token_ids for r in eager]


def masked_logits_and_grads(model, ids, mask, autocast: bool = False):
    """A padded batch's logits (fp32) and every parameter's gradient of the mean squared logit over its tokens:
    what the tests comparing two paths of one model (kernels and reference) look at."""
    model.zero_grad()
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    (logits * mask[..., None]).square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def compiled_stack_trains_as_written(config, ids) -> None:
    """Two models of `config` from the same weights, one with its blocks compiled as one stack: the stack is one graph
    with no break, and its loss and every gradient on `ids` equal the model as written's."""
    from torch._dynamo.utils import counters

    from attnlab.models import AttnLabForCausalLM

    torch.manual_seed(0)
    plain = AttnLabForCausalLM(config).train()
    compiled = AttnLabForCausalLM(config).train()
    compiled.load_state_dict(plain.state_dict())
    compiled.compile_blocks(stack=True)
    counters.clear()
    results = []
    for model in (plain, compiled):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {name: p.grad for name, p in model.named_parameters()}))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, grad in got_grads.items():
        error = (grad - want_grads[name]).norm() / want_grads[name].norm().clamp_min(1e-12)
        assert error < 1e-4, f"{name}'s gradient is {error:.2e} of its norm from the model as written"
