"""Static decoding (the path CUDA graphs capture) equals the engine's dynamic path token for token.

On CPU the static path runs eagerly over the same preallocated buffers the graph would replay;
tests/test_kernels_cuda.py holds the captured graphs to the eager engine on a GPU.
"""

import pytest
import torch

from attnlab.data import ByteTokenizer
from attnlab.generation import engine, generate
from attnlab.generation.graphs import StaticRunner, fixed_size_decoding, make_runner
from attnlab.models import MIXERS, AttnLabConfig, AttnLabForCausalLM

PROMPTS = ["Hello there, friend", "A", "The quick brown fox jumps", "Be"]
FIXED = sorted(name for name, cls in MIXERS.items() if getattr(cls, "fixed_size_state", False))
STATIC = FIXED + ["softmax"]  # fixed-size states, and KV caches in static buffers
FAMILY_KV = ["2mamba-e", "gated_softmax", "softmax_taylor_80terms", "nsa"]  # the attention family's KV variants (decay, counts, clamps) and NSA


def model_for(mixer: str):
    torch.manual_seed(0)
    return AttnLabForCausalLM(AttnLabConfig(vocab_size=259, hidden_size=32, num_layers=2, num_heads=2, mixer=mixer)).eval()


def run(model, static: bool, monkeypatch, **settings):
    if static:
        monkeypatch.setattr(engine, "make_runner", lambda m, choice="auto": StaticRunner(m, capture=False))
    else:
        monkeypatch.setattr(engine, "make_runner", lambda m, choice="auto": engine.ModelRunner(m))
    out = generate(model, ByteTokenizer(), PROMPTS, **settings)
    return [[(c.token_ids, c.finish_reason, c.score) for c in r.candidates] for r in out]


def emitted_token(model, **settings) -> int:
    """A token that, as an extra EOS, ends a row early while other rows go on (the first that does,
    among the tokens the first prompt's best continuation emits)."""
    out = generate(model, ByteTokenizer(), PROMPTS, **{**settings, "eos_token_id": [257]})
    tokens = out[0].candidates[0].token_ids
    for token in tokens[settings.get("min_new_tokens", 0) + 1:] + tokens:
        ends = generate(model, ByteTokenizer(), PROMPTS, **{**settings, "eos_token_id": [257, token]})
        if any(c.finish_reason == "eos" for r in ends for c in r.candidates):
            return token
    return tokens[0]


def test_gla_and_mamba2_decode_over_fixed_size_state_and_softmax_does_not():
    assert {"gla", "mamba2"} <= set(FIXED)
    assert fixed_size_decoding(model_for("gla")) and not fixed_size_decoding(model_for("softmax"))


def test_without_cuda_generate_uses_the_plain_runner():
    assert type(make_runner(model_for("gla"))) is engine.ModelRunner
    assert type(make_runner(model_for("gla"), "off")) is engine.ModelRunner


SETTINGS = [
    dict(max_new_tokens=12),
    dict(max_new_tokens=12, repetition_penalty=1.3),
    dict(max_new_tokens=10, do_sample=True, top_k=20, seed=3, num_return_sequences=2),
    dict(max_new_tokens=9, num_beams=3, length_penalty=1.5, min_new_tokens=2),
    dict(max_new_tokens=9, num_beams=4, early_stopping=True, num_return_sequences=2, output_scores=True),
    dict(max_new_tokens=20, output_scores=True),
    dict(max_new_tokens=12, do_sample=True, top_p=0.8, temperature=0.7, output_scores=True, seed=5),
    dict(max_new_tokens=12, stop=["e"]),
    dict(max_new_tokens=12, min_new_tokens=2, output_scores=True),
]
SETTING_IDS = ["greedy", "greedy-penalty", "sample", "beam3", "beam4-early", "greedy-scores-long", "sample-scores", "stop-string", "greedy-min-new"]


@pytest.mark.parametrize("mixer", STATIC)
@pytest.mark.parametrize("settings", SETTINGS, ids=SETTING_IDS)
def test_static_steps_give_the_dynamic_tokens_with_rows_finishing_early(mixer, settings, monkeypatch):
    check_static_against_dynamic(mixer, settings, monkeypatch)


@pytest.mark.parametrize("mixer", FAMILY_KV)
@pytest.mark.parametrize("settings", [SETTINGS[0], SETTINGS[2], SETTINGS[3]], ids=["greedy", "sample", "beam3"])
def test_family_kv_variants_decode_statically_as_dynamically(mixer, settings, monkeypatch):
    check_static_against_dynamic(mixer, settings, monkeypatch)


def check_static_against_dynamic(mixer, settings, monkeypatch):
    model = model_for(mixer)
    eos = [257, emitted_token(model, **settings)]  # a token the model emits, so that rows and beams finish at different steps
    dynamic = run(model, False, monkeypatch, eos_token_id=eos, batch_size=4, **settings)
    static = run(model, True, monkeypatch, eos_token_id=eos, batch_size=4, **settings)
    # Tokens and finish reasons exactly; scores to float rounding (the dynamic path shrinks the batch,
    # and a matrix product over fewer rows may round differently)
    assert [[c[:2] for c in r] for r in static] == [[c[:2] for c in r] for r in dynamic]
    scores = [c[2] for r in static for c in r], [c[2] for r in dynamic for c in r]
    if settings.get("output_scores") or settings.get("num_beams", 1) > 1:
        assert scores[0] == pytest.approx(scores[1], rel=1e-6)
    else:
        assert scores[0] == scores[1] == [None] * len(scores[0])
    # rows finishing early is exercised (for beams: the test below; a random model repeats one token
    # per row, so EOS suppression by min_new_tokens steers rows away from any EOS candidate)
    if settings.get("num_beams", 1) == 1 and not settings.get("stop") and not settings.get("min_new_tokens"):
        assert any(c[1] == "eos" for r in dynamic for c in r)


@pytest.mark.parametrize("stop, expected_sizes", [
    ([], [4, 8]),  # on the device: finished prompts stay in the batch, frozen, until the host looks
    (["zzzz"], None),  # stop strings need the host each step: finished prompts leave the batch
])
def test_beam_search_on_a_static_batch_equals_the_dynamic_path_as_prompts_finish(monkeypatch, stop, expected_sizes):
    model = model_for("gla")
    settings = dict(max_new_tokens=9, num_beams=2, early_stopping=True, batch_size=4, stop=stop)
    first = generate(model, ByteTokenizer(), PROMPTS, eos_token_id=[257], **settings)
    ids = [r.token_ids for r in first]
    eos = [257, ids[0][0], ids[2][0], ids[3][0], ids[1][3]]  # prompts end early, at different steps
    dynamic = run(model, False, monkeypatch, eos_token_id=eos, **settings)
    runners = []

    def recording(m, choice="auto"):
        runners.append(StaticRunner(m, capture=False))
        return runners[-1]

    monkeypatch.setattr(engine, "make_runner", recording)
    out = generate(model, ByteTokenizer(), PROMPTS, eos_token_id=eos, **settings)
    assert [[(c.token_ids, c.finish_reason, c.score) for c in r.candidates] for r in out] == dynamic
    sizes = sorted(runners[-1].steps)
    if expected_sizes is not None:
        assert sizes == expected_sizes
    else:
        assert sizes[-1] == 8 and len(sizes) > 2  # 4 prompts x 2 beams, then fewer as prompts finish


def test_without_stop_strings_a_static_batch_decodes_on_the_device_and_looks_at_it_every_few_steps(monkeypatch):
    model = model_for("gla")
    calls = []
    real = engine._greedy_or_sample_on_device
    monkeypatch.setattr(engine, "_greedy_or_sample_on_device", lambda *a: calls.append(1) or real(*a))
    run(model, True, monkeypatch, max_new_tokens=5)
    assert calls == [1]
    run(model, True, monkeypatch, max_new_tokens=5, stop=["x"])  # stop strings need the decoded text each step
    assert calls == [1]


def test_fused_projections_compute_what_the_separate_projections_compute():
    from attnlab.models.modules import FusedProjections, fuse_projections, fused_projections

    model = model_for("gla")
    pairs = fuse_projections(model)
    assert {type(m).__name__ for m, _ in pairs} == {"GatedLinearAttention", "SwiGLU"} and len(pairs) == 4
    ids = torch.randint(0, 256, (3, 11))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with fused_projections(pairs):
            assert all(m.fused_weight is not None for m, _ in pairs)
            fused = model(input_ids=ids).logits
    assert all(m.fused_weight is None for m in model.modules() if isinstance(m, FusedProjections))
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    attn, stacks = pairs[0]
    # q, k and the forget gate (its two low-rank factors multiplied) | v, g
    assert [tuple(w.shape[:2]) for w in stacks] == [(3, 16), (2, 32)]
    with fused_projections(pairs), torch.no_grad():
        assert all(p.is_contiguous() for p in attn.project(torch.randn(3, 1, 32)))  # as fla's kernels want them


def test_generate_fuses_for_its_own_steps_only_and_skips_wrapped_projections():
    from attnlab.models.modules import FusedProjections, fuse_projections

    model = model_for("gla")
    seen = []
    block = model.model.layers[0]
    hook = block.attn.register_forward_pre_hook(lambda m, a: seen.append(m.fused_weight is not None))
    generate(model, ByteTokenizer(), PROMPTS[:2], max_new_tokens=3)
    hook.remove()
    assert seen and all(seen)  # prefill and every step ran with the fused weights
    assert all(m.fused_weight is None for m in model.modules() if isinstance(m, FusedProjections))
    block.attn.k_proj = torch.nn.Sequential(block.attn.k_proj)  # stands for an adapter around k_proj
    assert block.attn not in [m for m, _ in fuse_projections(model)]
    other = model.model.layers[1].attn
    other.gk_proj[1] = torch.nn.Sequential(other.gk_proj[1])  # ... or around the gate's second factor
    assert other not in [m for m, _ in fuse_projections(model)]


def test_the_static_runner_is_kept_between_calls_while_the_weights_stay_where_they_are():
    from attnlab.generation.graphs import cached_static_runner
    from attnlab.generation.runner import KEPT_RUNNERS, release_graphs

    model = model_for("gla")
    first = cached_static_runner(model, capture=False)
    assert cached_static_runner(model, capture=False) is first
    ids = torch.randint(0, 256, (2, 9))
    logits, _ = first.prefill(ids, torch.ones_like(ids))
    with torch.no_grad():
        model.model.layers[0].attn.q_proj.weight.mul_(2.0)  # an in-place update (an optimizer step) ...
        model.model.layers[0].attn.gk_proj[0].weight.mul_(3.0)  # (the gate's fused product is refreshed too)
    again = cached_static_runner(model, capture=False)
    assert again is first
    changed, _ = again.prefill(ids, torch.ones_like(ids))
    expected, _ = engine.ModelRunner(model).prefill(ids, torch.ones_like(ids))
    torch.testing.assert_close(changed, expected)  # ... reaches the fused weights
    assert not torch.allclose(changed, logits)
    model.double()  # new tensors: the old buffers (and any captured graph) no longer apply
    assert cached_static_runner(model, capture=False) is not first
    release_graphs(model)
    assert model not in KEPT_RUNNERS


@pytest.mark.parametrize("compression", ["mean", "mlp"])
@pytest.mark.parametrize("settings", [SETTINGS[0], SETTINGS[3]], ids=["greedy", "beam3"])
def test_nsa_decodes_statically_as_dynamically_across_block_boundaries(compression, settings, monkeypatch):
    """Blocks of 4 tokens: the static step recompresses the block its token falls in, and selection,
    window and compressed attention read only complete blocks, as the dynamic cache does."""
    torch.manual_seed(0)
    options = dict(block_size=4, block_counts=3, window_size=6, compression=compression)
    model = AttnLabForCausalLM(AttnLabConfig(vocab_size=259, hidden_size=32, num_layers=2, num_heads=2, mixer="nsa",
                                             mixer_options=options)).eval()
    settings = {**settings, "max_new_tokens": 14}
    dynamic = run(model, False, monkeypatch, batch_size=4, **settings)
    static = run(model, True, monkeypatch, batch_size=4, **settings)
    assert [[c[:2] for c in r] for r in static] == [[c[:2] for c in r] for r in dynamic]


def test_a_capture_after_every_graph_of_the_shared_pool_is_gone_starts_a_new_pool(monkeypatch):
    """PyTorch releases a graph pool once no graph captured into it is alive and then refuses a capture into it (an
    internal assert): a runner whose steps were all replaced (prompts needing KV buffers of another size) captures
    into a new pool, and shares the pool while any of its graphs lives."""
    import gc
    import itertools
    from contextlib import nullcontext

    from attnlab.generation.runner import GraphPool

    handles = itertools.count()
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(handles))
    captured = []
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: captured.append(pool) or nullcontext())

    class Graph:  # stands in for torch.cuda.CUDAGraph
        pass

    pool = GraphPool()
    first = Graph()
    with pool.capture(first):
        pass
    second = Graph()
    with pool.capture(second):  # the first still lives: the same pool
        pass
    del first
    third = Graph()
    with pool.capture(third):  # the second still lives
        pass
    del second, third
    gc.collect()
    with pool.capture(Graph()):  # none lives: a new pool
        pass
    assert captured == [0, 0, 0, 1]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_decoding_of_batches_needing_kv_buffers_of_different_sizes_equals_the_eager_steps(monkeypatch):
    """Batches whose prompts need KV buffers of another capacity replace the step captured for their batch size; the
    replaced step's graph was the only one in the runner's pool (a capture into the released pool failed)."""
    from conftest import captured_and_eager_tokens

    torch.manual_seed(0)
    model = AttnLabForCausalLM(AttnLabConfig(vocab_size=259, hidden_size=64, num_layers=2, num_heads=2, mixer="softmax",
                                             max_position_embeddings=2048)).cuda().to(torch.bfloat16).eval()
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (10, 12, 600, 610, 20, 30)]  # capacities 256, 768, 256
    graphed, eager = captured_and_eager_tokens(model, ByteTokenizer(), prompts, lambda m: StaticRunner(m, capture=False),
                                               monkeypatch, max_new_tokens=6, batch_size=2, eos_token_id=[257])
    assert graphed == eager
