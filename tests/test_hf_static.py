"""HF causal LMs through the static KV cache (generation/hf_static.py) equal HF `generate` and the
plain runner token for token.

On CPU the static step runs eagerly over the same buffers and 4D mask that the CUDA graph replays;
the CUDA test at the end holds the captured step to the eager one.
"""

import gc
import warnings
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from attnlab.data import ByteTokenizer
from attnlab.generation import engine, generate, hf_static, release_graphs
from attnlab.generation.graphs import make_runner
from attnlab.generation.hf_static import BLOCK, HFStaticRunner, hf_static_runner, probe, static_cache_problem
from attnlab.generation.runner import KEPT_RUNNERS

pytestmark = pytest.mark.hf_interop  # CI runs these against the oldest transformers and peft it supports too

PROMPTS = ["Hello there, friend", "A", "The quick brown fox jumps", "Be"]  # four lengths: left padding matters
TINY = dict(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=256, eos_token_id=257, pad_token_id=258)


def llama(**extra):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **extra})).eval()


def qwen3(**extra):
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**{**TINY, "head_dim": 16, **extra})).eval()


MODELS = {
    "llama": llama,
    "qwen3": qwen3,
    "smollm2": lambda: llama(tie_word_embeddings=True, num_key_value_heads=1),  # SmolLM2's shape: Llama, tied, few KV heads
}


def tokenizer():
    return ByteTokenizer()


def run(model, static: bool, monkeypatch, **settings):
    """generate() through the static runner (eager) or the plain runner: (tokens, finish reason, score) per candidate."""
    runner = (lambda m, choice="auto": HFStaticRunner(m, capture=False)) if static else (lambda m, choice="auto": engine.ModelRunner(m))
    monkeypatch.setattr(engine, "make_runner", runner)
    out = generate(model, tokenizer(), PROMPTS, **settings)
    return [[(c.token_ids, c.finish_reason, c.score) for c in r.candidates] for r in out]


def hf_generate(model, eos, new_tokens, **settings):
    enc = tokenizer()(PROMPTS, padding=True, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=258, **settings)
    rows = out[:, enc["input_ids"].shape[1]:].tolist()
    n = settings.get("num_return_sequences", 1)
    kept = [row[:next((i for i, t in enumerate(row) if t in eos), len(row))] for row in rows]
    return [kept[i * n:(i + 1) * n] for i in range(len(PROMPTS))]


def ending_token(model) -> int:
    """A token the first prompt's greedy continuation emits after a few steps: as a second EOS it ends
    that row mid-batch while the others go on."""
    first = generate(model, tokenizer(), PROMPTS, max_new_tokens=8, eos_token_id=[257])
    return first[0].token_ids[3]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_llama_qwen3_and_smollm2_shapes_decode_over_a_static_cache(name):
    model = MODELS[name]()
    assert static_cache_problem(model) is None
    assert probe(model) is None


HF_SETTINGS = {
    "greedy": dict(),
    "beam4": dict(num_beams=4, length_penalty=1.5, early_stopping=False, min_new_tokens=2),
    "greedy-min-new": dict(min_new_tokens=4),
    "beam4-early-2-returned": dict(num_beams=4, length_penalty=0.6, early_stopping=True, num_return_sequences=2),
}


@pytest.mark.parametrize("name, settings", [(name, HF_SETTINGS[s]) for name in sorted(MODELS) for s in ("greedy", "beam4")]
                         + [("llama", HF_SETTINGS[s]) for s in ("greedy-min-new", "beam4-early-2-returned")],
                         ids=[f"{name}-{s}" for name in sorted(MODELS) for s in ("greedy", "beam4")]
                         + ["llama-greedy-min-new", "llama-beam4-early-2-returned"])
def test_static_cache_decoding_matches_hf_generate_token_for_token_with_left_padding(name, settings, monkeypatch):
    model = MODELS[name]()
    eos = [257, ending_token(model)]
    ours = run(model, True, monkeypatch, max_new_tokens=10, eos_token_id=eos, **settings)
    assert [[c[0] for c in r] for r in ours] == hf_generate(model, eos, 10, **settings)
    if not settings:
        reasons = [c[1] for r in ours for c in r]
        assert "eos" in reasons and "length" in reasons  # a row ended mid-batch while the others went on


@pytest.mark.parametrize("settings", [
    dict(max_new_tokens=12),
    dict(max_new_tokens=12, repetition_penalty=1.3, output_scores=True),
    dict(max_new_tokens=10, do_sample=True, top_k=20, seed=3, num_return_sequences=2),
    dict(max_new_tokens=10, do_sample=True, top_p=0.8, temperature=0.7, seed=5, output_scores=True),
    dict(max_new_tokens=9, num_beams=4, length_penalty=1.5),
    dict(max_new_tokens=9, num_beams=2, early_stopping=True, stop=["zzzz"]),
    dict(max_new_tokens=12, stop=["e"]),
], ids=["greedy", "greedy-penalty-scores", "sample", "sample-top-p-scores", "beam4", "beam2-host-stop", "stop-string"])
def test_static_steps_give_the_plain_runners_tokens_as_rows_finish(settings, monkeypatch):
    model = llama()
    eos = [257, ending_token(model)]
    plain = run(model, False, monkeypatch, eos_token_id=eos, **settings)
    static = run(model, True, monkeypatch, eos_token_id=eos, **settings)
    assert [[c[:2] for c in r] for r in static] == [[c[:2] for c in r] for r in plain]
    scores = [c[2] for r in static for c in r], [c[2] for r in plain for c in r]
    if settings.get("output_scores") or settings.get("num_beams", 1) > 1:
        assert scores[0] == pytest.approx(scores[1], rel=1e-5)  # a longer (masked) cache may round differently
    else:
        assert scores[0] == scores[1]


def test_eager_attention_decodes_with_an_additive_mask(monkeypatch):
    model = llama(attn_implementation="eager")
    assert model.config._attn_implementation == "eager" and probe(model) is None
    settings = dict(max_new_tokens=10, eos_token_id=[257, ending_token(model)])
    assert run(model, True, monkeypatch, **settings) == run(model, False, monkeypatch, **settings)


def test_beam_reorder_gathers_into_the_same_buffers_and_new_batch_sizes_get_their_own():
    model = llama()
    runner = HFStaticRunner(model, capture=False)
    runner.reserve(8)
    ids = torch.randint(0, 256, (2, 5))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    _, state = runner.prefill(ids, mask)
    small = state.cache
    runner.select(state, torch.tensor([0, 0, 1, 1]))  # prompts expanded to 2 beams each
    wide = state.cache
    assert wide is not small and wide.batch == 4 and sorted(runner.steps) == [2, 4]
    assert torch.equal(wide.allowed[:, :5], mask.bool().repeat_interleave(2, 0))
    runner.step(torch.tensor([1, 2, 3, 4]), state)
    before = wide.cache.layers[0].keys.clone()
    pointers = [layer.keys.data_ptr() for layer in wide.cache.layers]
    runner.select(state, torch.tensor([1, 0, 3, 3]))  # a beam reorder
    assert state.cache is wide and [layer.keys.data_ptr() for layer in wide.cache.layers] == pointers
    assert torch.equal(wide.cache.layers[0].keys[:, :, :6], before[[1, 0, 3, 3], :, :6])
    assert wide.length == 6 and int(wide.cache.layers[0].cumulative_length) == 6


class _Ops(TorchDispatchMode):
    """Records the name of every aten op run under it."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name().split(".")[0])  # without the overload
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["llama", "qwen3", "llama-eager"])
def test_the_step_that_cuda_graphs_record_never_reads_back_to_the_host(name):
    model = llama(attn_implementation="eager") if name == "llama-eager" else MODELS[name]()
    runner = HFStaticRunner(model, capture=False)
    runner.reserve(4)
    ids = torch.randint(0, 256, (2, 5))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    _, state = runner.prefill(ids, mask)
    with torch.no_grad(), _Ops() as ops:
        state.cache._run()
    syncing = {"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::masked_select", "aten::unique",
               "aten::lift_fresh", "aten::_unique2", "aten::equal", "aten::is_nonzero"}  # reads, or tensors from host data
    assert "aten::index_copy_" in ops.names and not syncing & set(ops.names)


def test_a_second_call_in_the_same_block_reuses_the_buffers_and_a_longer_one_resizes_them(monkeypatch):
    block = 32
    monkeypatch.setattr(hf_static, "BLOCK", block)  # short blocks, to cross one in a few tokens
    model = llama()
    runner = HFStaticRunner(model, capture=False)
    monkeypatch.setattr(engine, "make_runner", lambda m, choice="auto": runner)
    settings = dict(eos_token_id=[257, ending_token(model)], batch_size=4)
    longest = max(len(p) for p in PROMPTS)
    first = generate(model, tokenizer(), PROMPTS, max_new_tokens=4, **settings)
    step = runner.steps[4]
    keys = step.cache.layers[0].keys.data_ptr()
    assert runner.max_len == block
    second = generate(model, tokenizer(), PROMPTS, max_new_tokens=block - longest, **settings)  # the block, to the last slot
    assert runner.steps[4] is step and step.cache.layers[0].keys.data_ptr() == keys  # no new buffers, no new capture
    assert [r.token_ids[:4] for r in second] == [r.token_ids[:4] for r in first]
    longer = generate(model, tokenizer(), PROMPTS, max_new_tokens=block - longest + 1, **settings)  # one past the block
    assert runner.max_len == 2 * block and runner.steps[4] is not step
    plain = run(model, False, monkeypatch, max_new_tokens=block - longest + 1, **settings)
    assert [[(c.token_ids, c.finish_reason) for c in r.candidates] for r in longer] == [[c[:2] for c in r] for r in plain]


def test_a_step_past_the_reserved_length_is_refused():
    model = llama()
    runner = HFStaticRunner(model, capture=False)  # nothing reserved: room for the prompt and one token
    ids = torch.randint(0, 256, (1, BLOCK - 1))
    _, state = runner.prefill(ids, torch.ones_like(ids))
    runner.step(ids[:, -1], state)
    with pytest.raises(RuntimeError, match="reserve"):
        runner.step(ids[:, -1], state)


def spread(model):
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers": 1, "lm_head": "cpu"}  # as accelerate's device_map leaves it
    return model


@pytest.mark.parametrize("make, reason", [
    (lambda: qwen3(use_sliding_window=True, sliding_window=8, max_window_layers=0), "StaticSlidingWindowLayer"),
    (lambda: llama(attn_implementation="flex_attention"), "flex_attention"),
    (lambda: llama(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "dynamic RoPE"),
    (lambda: spread(llama()), "spread over"),
], ids=["sliding-window", "flex-attention", "dynamic-rope", "several-devices"])
def test_a_model_the_static_path_does_not_cover_decodes_with_the_plain_runner_and_one_warning(make, reason):
    model = make()
    assert reason in static_cache_problem(model)
    with pytest.warns(UserWarning, match="without a static cache"):
        assert type(hf_static_runner(model, capture=False)) is engine.ModelRunner
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per model
        assert type(hf_static_runner(model, capture=False)) is engine.ModelRunner
    release_graphs(model)
    assert model not in KEPT_RUNNERS


def test_the_static_runner_is_kept_between_calls_while_the_weights_stay_where_they_are():
    model = llama()
    first = hf_static_runner(model, capture=False)
    assert isinstance(first, HFStaticRunner) and hf_static_runner(model, capture=False) is first
    model.double()  # new tensors: the buffers (and any captured graph) no longer apply
    second = hf_static_runner(model, capture=False)
    assert second is not first
    ids = torch.randint(0, 256, (2, 5))
    second.reserve(4)
    _, state = second.prefill(ids, torch.ones_like(ids))
    second.select(state, torch.tensor([0, 0, 1, 1]))
    kept = weakref.ref(second)
    gc.disable()
    try:
        del first, second, state
        release_graphs(model)
        assert model not in KEPT_RUNNERS
        assert kept() is None  # freed at once: no reference cycle keeps its buffers until a garbage collection
    finally:
        gc.enable()


def test_without_cuda_hf_models_decode_with_the_plain_runner():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU choice")
    assert type(make_runner(llama())) is engine.ModelRunner


class _ByteTok(ByteTokenizer):
    pad_token_id = 258


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("settings", [
    dict(max_new_tokens=40),
    dict(max_new_tokens=24, do_sample=True, top_k=20, seed=3, num_return_sequences=2),
    dict(max_new_tokens=16, num_beams=4, length_penalty=1.2),
], ids=["greedy", "sample", "beam4"])
def test_cuda_graph_steps_equal_the_eager_static_steps_token_for_token(settings, monkeypatch):
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**TINY, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 8})
    model = LlamaForCausalLM(cfg).cuda().to(torch.bfloat16).eval()
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (5, 90, 33)]
    eos = [257]
    release_graphs(model)
    graphed = generate(model, _ByteTok(), prompts, eos_token_id=eos, **settings)
    runner = make_runner(model)
    assert isinstance(runner, HFStaticRunner) and any(s.graph is not None for s in runner.steps.values())
    replayed = generate(model, _ByteTok(), prompts, eos_token_id=eos, **settings)  # the graphs kept from the first call
    assert make_runner(model) is runner
    ids = [[c.token_ids for c in r.candidates] for r in graphed]
    assert [[c.token_ids for c in r.candidates] for r in replayed] == ids
    monkeypatch.setattr(engine, "make_runner", lambda m, choice="auto": HFStaticRunner(m, capture=False))
    eager = generate(model, _ByteTok(), prompts, eos_token_id=eos, **settings)
    assert [[c.token_ids for c in r.candidates] for r in eager] == ids
    release_graphs(model)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_step_logits_match_the_plain_runner_in_bf16():
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**TINY, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2})
    model = LlamaForCausalLM(cfg).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(0, 256, (3, 70), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    mask[2, :65] = 0
    graphed, plain = HFStaticRunner(model, capture=True), engine.ModelRunner(model)
    graphed.reserve(8)
    outs = []
    for runner in (graphed, plain):
        logits, state = runner.prefill(ids, mask)
        got = [logits]
        for t in range(6):
            got.append(runner.step(ids[:, t], state))
        outs.append(torch.stack(got))
    assert graphed.steps[3].graph is not None
    assert ((outs[0] - outs[1]).norm() / outs[1].norm()).item() < 2e-2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_steps_of_batches_of_different_lengths_equal_the_eager_static_steps(monkeypatch):
    """A batch of another static length clears the runner's steps, and with them every graph of its pool (a capture
    into the released pool failed)."""
    from conftest import captured_and_eager_tokens

    torch.manual_seed(0)
    cfg = LlamaConfig(**{**TINY, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 8})
    model = LlamaForCausalLM(cfg).cuda().to(torch.bfloat16).eval()
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (5, 7, 300, 310, 9, 11)]
    graphed, eager = captured_and_eager_tokens(model, _ByteTok(), prompts, lambda m: HFStaticRunner(m, capture=False),
                                               monkeypatch, max_new_tokens=6, batch_size=2, eos_token_id=[257])
    assert graphed == eager
