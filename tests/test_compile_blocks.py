"""The blocks of an attnlab model under torch.compile (`AttnLabForCausalLM.compile_blocks`, `train.compile`): the same
losses and gradients as the blocks as written, the mixers' kernels traced into one graph per block where the mixer
says it compiles whole (`Mixer.compiles_whole`) and left out of the compiled graphs otherwise, and only training
forwards compiled."""

from __future__ import annotations

import pytest
import torch

from attnlab.models import AttnLabConfig, AttnLabForCausalLM

CUDA_MIXERS = ["2mamba", "2mamba-e", "gated_softmax", "linear__output_norm", "softmax", "mamba2", "nsa", "gla"]


def _pair(mixer: str, device: str, **sizes):
    config = AttnLabConfig(vocab_size=128, hidden_size=sizes.get("hidden", 64), num_layers=2, num_heads=sizes.get("heads", 4),
                           mixer=mixer, tie_word_embeddings=False)
    torch.manual_seed(0)
    plain = AttnLabForCausalLM(config).to(device).train()
    compiled = AttnLabForCausalLM(config).to(device).train()
    compiled.load_state_dict(plain.state_dict())
    compiled.compile_blocks()
    return plain, compiled


def _loss_and_grads(model, ids, autocast: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.fixture(autouse=True)
def _fresh_compile_cache():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# nsa: its three gates once were views of one saved sigmoid, which Inductor's backward overwrote in place before the
# gate mixing's backward read them (wrong q, k and v gradients; mixers/nsa.py)
@pytest.mark.parametrize("mixer", ["2mamba", "gla", "nsa", "softmax", "mamba2", "gated_softmax", "2mamba-e", "linear__output_norm"])
def test_compiled_blocks_train_as_the_blocks_as_written_on_cpu(mixer):
    from torch._dynamo.utils import counters

    counters.clear()
    plain, compiled = _pair(mixer, "cpu")
    ids = torch.randint(0, 128, (2, 32))
    for _ in range(2):  # the second step reuses the graphs
        want_loss, want = _loss_and_grads(plain, ids, autocast=False)
        got_loss, got = _loss_and_grads(compiled, ids, autocast=False)
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)
    graphs = counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 4  # both blocks share them; the attention family's mixing breaks its block's graph in two
    # evaluation (no gradients) and decoding (a cache) run the blocks as written: nothing more is compiled
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids, labels=ids).loss, plain(input_ids=ids, labels=ids).loss)
    out = compiled.generate(ids[:1, :8], max_new_tokens=4, do_sample=False)
    assert torch.equal(out, plain.generate(ids[:1, :8], max_new_tokens=4, do_sample=False))
    assert counters["stats"]["unique_graphs"] == graphs


def test_the_stack_compiled_as_one_trains_as_the_blocks_as_written_on_cpu():
    """`compile_blocks(stack=True)`: every block in turn under one torch.compile (one graph for the stack), the same
    losses and gradients; evaluation runs as written."""
    from torch._dynamo.utils import counters

    counters.clear()
    plain, compiled = _pair("softmax", "cpu")
    compiled.compile_blocks(stack=True)
    assert not any(block.compiled for block in compiled.model.layers) and compiled.model.compiled_stack
    ids = torch.randint(0, 128, (2, 32))
    for _ in range(2):
        want_loss, want = _loss_and_grads(plain, ids, autocast=False)
        got_loss, got = _loss_and_grads(compiled, ids, autocast=False)
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids, labels=ids).loss, plain(input_ids=ids, labels=ids).loss)
    assert counters["stats"]["unique_graphs"] == 1
    compiled.compile_blocks(False)
    assert not compiled.model.compiled_stack


def test_a_stack_that_breaks_the_graph_says_so_and_compiles_block_by_block(monkeypatch):
    """A break inside the stack's loop would make dynamo run every block as written; the stack compiles with
    fullgraph, so a break raises before anything runs, the model warns and compiles its blocks one by one."""
    from torch._dynamo.utils import counters

    from attnlab.models.mixers.softmax import SoftmaxAttention

    @torch.compiler.disable
    def opaque(y):
        return y

    forward = SoftmaxAttention.forward
    monkeypatch.setattr(SoftmaxAttention, "forward", lambda self, *a, **k: (lambda out: (opaque(out[0]), out[1]))(forward(self, *a, **k)))
    counters.clear()
    plain, compiled = _pair("softmax", "cpu")
    compiled.compile_blocks(stack=True)
    ids = torch.randint(0, 128, (2, 32))
    want_loss, want = _loss_and_grads(plain, ids, autocast=False)
    with pytest.warns(UserWarning, match="do not compile as one graph") as said:
        got_loss, got = _loss_and_grads(compiled, ids, autocast=False)
    message = str(said[0].message)  # what broke it and where, for the one who reads the log
    assert "torch.compiler.disable" in message and "test_compile_blocks.py" in message and "in <lambda>" in message, message
    assert not compiled.model.compiled_stack and all(block.compiled for block in compiled.model.layers)
    assert counters["stats"]["unique_graphs"] >= 1  # the blocks, each compiled around the break
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


def test_the_kernel_lookups_are_made_at_import_and_compile_in_a_fresh_process():
    """Which kernel packages are installed is known at import: torch 2.11's dynamo does not trace
    `importlib.util.find_spec`, so a lookup left to the first call broke a stack compiled before any eager step (on CUDA,
    where the mixers ask), and the trainer's eager step ran block by block instead of as one graph. A fresh process
    whose `find_spec` fails once attnlab is imported compiles the lookups with fullgraph and gets their values."""
    import importlib.util
    import subprocess
    import sys

    script = ("import importlib.util, torch\nfrom attnlab.models.kernels import fla_installed, triton_installed\n"
              "def lookup(name, package=None):\n    raise AssertionError(f'find_spec({name!r}) after import')\n"
              "importlib.util.find_spec = lookup\n"
              "f = torch.compile(lambda x: x + fla_installed() + 2 * triton_installed(), fullgraph=True, backend='eager')\n"
              "print(f(torch.zeros(1)).item())")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    want = (importlib.util.find_spec("fla") is not None) + 2 * (importlib.util.find_spec("triton") is not None)
    assert float(done.stdout.split()[-1]) == want


# A fresh process, as the trainer's: the stack compiled on the first training forward, before anything ran eagerly
_FIRST_STEP_AS_ONE_GRAPH = """
import sys, warnings
import torch
from attnlab.models import AttnLabConfig, AttnLabForCausalLM
for mixer in sys.argv[1:]:
    torch._dynamo.reset()
    config = AttnLabConfig(vocab_size=128, hidden_size=256, num_layers=2, num_heads=4, mixer=mixer, tie_word_embeddings=False)
    model = AttnLabForCausalLM(config).cuda().train()
    model.compile_blocks(stack=True)
    ids = torch.randint(0, 128, (2, 256), device="cuda")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model(input_ids=ids, labels=ids).loss.backward()
    broke = [str(w.message) for w in said if "do not compile as one graph" in str(w.message)]
    print(mixer, "one graph" if model.model.compiled_stack and not broke else f"fell back: {broke}", flush=True)
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_stack_of_every_mixer_that_compiles_whole_is_one_graph_from_the_first_step_on_cuda():
    """The mixers the trainer compiles as one stack ("auto": `compiles_whole`) do so on CUDA from a fresh process's first
    training step, with their kernels: no fallback to block by block."""
    import subprocess
    import sys

    whole = ["2mamba", "2mamba-e", "gated_softmax", "linear__output_norm", "softmax", "mamba2"]
    done = subprocess.run([sys.executable, "-c", _FIRST_STEP_AS_ONE_GRAPH, *whole], capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [f"{mixer} one graph" for mixer in whole]


@pytest.mark.parametrize("stack", [False, True], ids=["block-by-block", "stack"])
def test_nsa_with_its_statistics_compiles_on_the_first_step_and_never_again(stack):
    """NSA's statistics are written into a buffer the module holds from the start: one made by the first training
    forward changed what its compiled graphs were guarded on, so the second step compiled every block again (in the
    trainer's one-graph stack, a second compile of the whole model)."""
    from torch._dynamo.utils import counters

    _, model = _pair("nsa", "cpu", hidden=32, heads=2)
    model.compile_blocks(stack=stack)
    model.enable_health_stats()
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    counters.clear()
    model(input_ids=ids, labels=ids).loss.backward()
    compiled = counters["stats"]["unique_graphs"]
    first = model.health_stats()
    assert compiled >= 1 and "nsa_k_mean" in first and first["nsa_k_max"] > 0
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
    assert counters["stats"]["unique_graphs"] == compiled, "a later training step compiled again"
    assert model.health_stats() == first  # the same batch: the same statistics, read from the same buffer
    model.enable_health_stats(False)
    assert model.health_stats() == {}


def test_compile_blocks_off_again_runs_the_blocks_as_written():
    from torch._dynamo.utils import counters

    counters.clear()
    _, compiled = _pair("softmax", "cpu")
    compiled.compile_blocks(False)
    ids = torch.randint(0, 128, (2, 16))
    compiled(input_ids=ids, labels=ids).loss.backward()
    assert counters["stats"]["unique_graphs"] == 0


def test_the_train_section_compiles_eager_steps_only_when_asked():
    from attnlab.config.schema import TrainSection

    assert TrainSection().compile == "auto"
    assert TrainSection(compile=True).compile is True and TrainSection(compile=False).compile is False


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mixer", CUDA_MIXERS)
def test_compiled_blocks_on_the_mixers_kernels_train_as_the_blocks_as_written(mixer):
    """On CUDA the glue is compiled and the mixers' Triton kernels run between the compiled parts. In fp32 the
    gradients equal the model as written's (up to TF32 rounding in the kernels); under bf16 autocast both round
    differently (Inductor fuses the norms and gates the written model runs as separate kernels), so each is held to
    the fp32 gradients: the compiled blocks' error at most twice the written model's, per parameter (relative to the
    parameter's gradient norm)."""
    from torch._dynamo.utils import counters

    plain, compiled = _pair(mixer, "cuda", hidden=256, heads=4)
    for model in (plain, compiled):  # NSA's statistics are written from inside the compiled graph too
        model.enable_health_stats()
    ids = torch.randint(0, 128, (2, 256), device="cuda")
    counters.clear()
    for _ in range(2):  # the second call runs the compiled graphs as they are kept
        want_loss, want = _loss_and_grads(plain, ids, autocast=False)
        got_loss, got = _loss_and_grads(compiled, ids, autocast=False)
    torch.testing.assert_close(got_loss, want_loss, rtol=2e-4, atol=2e-5)
    want_stats, got_stats = plain.health_stats(), compiled.health_stats()
    assert got_stats.keys() == want_stats.keys()
    for key, value in want_stats.items():
        assert abs(got_stats[key] - value) <= 1e-3 * max(1.0, abs(value)), (key, got_stats[key], value)
    for name in want:  # fla's GLA and attnlab's NSA kernels multiply fp32 operands as TF32 (tl.dot's default): inputs that
        # differ in their last bits (Inductor sums in another order) round differently there; measured on an H100,
        # 1.5e-4 (nsa) and 2.5e-4 (gla) of a gradient's norm, the others below 1e-4. A wrong gradient is off by its size
        error = (got[name] - want[name]).norm() / want[name].norm().clamp_min(1e-12)
        assert error < 1e-3, f"fp32: {name}'s gradient differs from the blocks as written by {error:.2e} of its norm"
    assert counters["stats"]["unique_graphs"] >= 1
    if compiled.compiles_whole():  # the mixer's kernels traced: one graph for both blocks, no break
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])

    plain_loss, plain_bf16 = _loss_and_grads(plain, ids, autocast=True)
    got_loss, got_bf16 = _loss_and_grads(compiled, ids, autocast=True)
    assert abs(got_loss - want_loss) <= 2 * abs(plain_loss - want_loss) + 2e-3 * want_loss
    for name in want:
        norm = want[name].norm().clamp_min(1e-12)
        plain_error = (plain_bf16[name] - want[name]).norm() / norm
        error = (got_bf16[name] - want[name]).norm() / norm
        assert error <= 2 * plain_error + 1e-3, (f"bf16: {name}'s gradient is {error:.2e} of its norm from fp32 arithmetic, "
                                                 f"the blocks as written {plain_error:.2e}")


def test_the_trainer_compiles_the_blocks_of_an_eager_step_and_says_why_not_under_checkpointing(monkeypatch):
    from types import SimpleNamespace

    import attnlab.train.loop as loop
    from attnlab.train.graphs import CHECKPOINT_KWARGS
    from attnlab.train.loop import AttnLabTrainer

    said = []
    trainer = SimpleNamespace(accelerator=SimpleNamespace(unwrap_model=lambda m: m), say=said.append, compile_blocks=True)
    _, model = _pair("softmax", "cpu")
    model.compile_blocks(False)
    AttnLabTrainer._compile_eager_step(trainer, model, 32)
    assert not trainer.compile_blocks and model.model.compiled_stack  # decided once; one process: the stack as one graph
    assert "as one graph" in said[-1]

    # "auto": compiled where every mixer compiles whole, as written where the mixer's kernels would break the graph
    for mixer, whole in (("2mamba-e", True), ("gated_softmax", True), ("mamba2", True), ("softmax", True), ("2mamba", True),
                         ("linear__output_norm", True), ("gla", False), ("nsa", False)):
        _, model = _pair(mixer, "cpu")
        model.compile_blocks(False)
        trainer.compile_blocks = "auto"
        AttnLabTrainer._compile_eager_step(trainer, model, 32)
        assert model.compiles_whole(32) is whole and model.model.compiled_stack is whole, mixer
        assert not any(block.compiled for block in model.model.layers), mixer
        assert ("as one graph" if whole else "would break each block's graph") in said[-1]

    # several processes: block by block (each block's gradients ready for their reduction as its backward ends); a
    # mixer that breaks the graph, compiled when asked: block by block too (a break inside the stack's loop would leave
    # it all as written)
    for mixer, processes in (("softmax", 2), ("gla", 1)):
        monkeypatch.setattr(loop, "world_size", lambda n=processes: n)
        _, model = _pair(mixer, "cpu")
        model.compile_blocks(False)
        trainer.compile_blocks = True
        AttnLabTrainer._compile_eager_step(trainer, model, 32)
        assert all(block.compiled for block in model.model.layers) and not model.model.compiled_stack, mixer
        assert "each block compiled" in said[-1]

    _, model = _pair("softmax", "cpu")
    model.compile_blocks(False)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=CHECKPOINT_KWARGS)
    AttnLabTrainer._compile_eager_step(trainer, model, 32)
    assert not any(block.compiled for block in model.model.layers) and not model.model.compiled_stack
    assert "gradient checkpointing" in said[-1]


def test_the_linearizable_variants_compile_whole_below_their_chunked_form_only(monkeypatch):
    """The chunked form (long sequences on CUDA) stays outside torch.compile: a model of those variants does not compile
    whole at lengths that pick it, so the trainer does not compile its blocks as one graph there."""
    from attnlab.models import kernels

    _, model = _pair("2mamba", "cpu")
    assert model.compiles_whole() and model.compiles_whole(64)
    monkeypatch.setattr(kernels, "attention_family_chunked", lambda choice, x, seq_len, similarity, prompt=False:
                        (lambda *a, **k: None) if seq_len >= 4096 else None)
    assert model.compiles_whole(1024) and not model.compiles_whole(4096)
    _, model = _pair("2mamba-e", "cpu")  # not linearizable: no chunked form
    assert model.compiles_whole(4096)
