"""The generation engine: exact against HF generate, padding-invariant, reproducible, safe settings."""

import json

import pytest
import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from attnlab.data import ByteTokenizer
from attnlab.errors import ConfigError
from attnlab.generation import GenerateConfig, generate, generate_ids
from attnlab.models import MIXERS, AttnLabConfig, AttnLabForCausalLM
from attnlab.models.hf_names import CACHE_KEY

from conftest import run_cli

pytestmark = pytest.mark.hf_interop  # CI runs these against the oldest transformers and peft it supports too

PROMPTS = ["Hello there, friend", "A", "The quick brown fox jumps"]  # three lengths: left padding matters
NEW = 10


@pytest.fixture(scope="module")
def tokenizer():
    return ByteTokenizer()


def attnlab_model(mixer: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = AttnLabConfig(vocab_size=259, hidden_size=32, num_layers=2, num_heads=2, mixer=mixer)
    return AttnLabForCausalLM(cfg).eval()


def llama_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, bos_token_id=256, eos_token_id=257, pad_token_id=258)
    return LlamaForCausalLM(cfg).eval()


def qwen3_model():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128, bos_token_id=256, eos_token_id=257,
                      pad_token_id=258)
    return Qwen3ForCausalLM(cfg).eval()


MODELS = {f"attnlab-{name}": (lambda name=name: attnlab_model(name)) for name in sorted(MIXERS)}
MODELS.update({"hf-llama": llama_model, "hf-qwen3": qwen3_model})

BEAM_SETTINGS = [
    dict(num_beams=4, length_penalty=1.5, early_stopping=False, min_new_tokens=2),
    dict(num_beams=4, length_penalty=0.6, early_stopping=True, min_new_tokens=3),
]
EXTRA_BEAM_SETTINGS = [dict(num_beams=3, length_penalty=2.0, early_stopping="never", num_return_sequences=2)]


def frequent_token(model, tokenizer) -> int:
    """A token the model really emits early on, used as a second EOS so that sequences do end."""
    ids = generate_ids(model, tokenizer, PROMPTS, max_new_tokens=6, eos_token_id=[tokenizer.eos_token_id])
    return ids[0][3]


def hf_generate(model, tokenizer, eos, seed=None, prompts=PROMPTS, **settings):
    """transformers' own `generate` loop; `seed`: HF samples from the global generator, seeded here."""
    enc = tokenizer(prompts, padding=True, return_tensors="pt")
    settings.setdefault("do_sample", False)
    if seed is not None:
        torch.manual_seed(seed)
    out = model.generate(**enc, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, **settings)
    n = settings.get("num_return_sequences", 1)
    rows = out[:, enc["input_ids"].shape[1]:].tolist()
    stripped = []
    for row in rows:
        kept = []
        for t in row:
            if t in eos:
                break
            kept.append(t)
        stripped.append(kept)
    return [stripped[i * n:(i + 1) * n] for i in range(len(prompts))]


def ours(model, tokenizer, eos, prompts=PROMPTS, **settings):
    results = generate(model, tokenizer, prompts, max_new_tokens=NEW, eos_token_id=eos, **settings)
    return [[c.token_ids for c in r.candidates] for r in results]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_and_beam_search_match_hf_generate_token_for_token(name, tokenizer):
    model = MODELS[name]()
    eos = [tokenizer.eos_token_id, frequent_token(model, tokenizer)]
    settings = [dict(), dict(min_new_tokens=4)] + BEAM_SETTINGS
    if name in ("attnlab-gla", "attnlab-softmax"):
        settings += EXTRA_BEAM_SETTINGS
    for s in settings:
        assert ours(model, tokenizer, eos, **s) == hf_generate(model, tokenizer, eos, **s), s


def lively_model(mixer: str):
    """Weights large enough that each next token depends on the context (the default initialisation
    mostly repeats one token)."""
    torch.manual_seed(0)
    cfg = AttnLabConfig(vocab_size=259, hidden_size=32, num_layers=2, num_heads=2, mixer=mixer, initializer_range=0.3)
    return AttnLabForCausalLM(cfg).eval()


@torch.no_grad()
def greedy_without_state(model, tokenizer) -> list[list[list[int]]]:
    """What a decoding loop that loses the cache after the prompt produces (attnlab models under
    transformers 5.24's `cache=` before they took that name): each later step sees its last token alone."""
    rows = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        tokens = [int(model(input_ids=ids).logits[0, -1].argmax())]
        while len(tokens) < NEW and tokens[-1] != tokenizer.eos_token_id:
            tokens.append(int(model(input_ids=torch.tensor([[tokens[-1]]])).logits[0, -1].argmax()))
        rows.append([[t for t in tokens if t != tokenizer.eos_token_id]])
    return rows


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_hf_generate_equals_the_engine_on_every_mixer_greedy_sampled_and_beams(name, tokenizer):
    model, eos = lively_model(name), [tokenizer.eos_token_id]
    greedy = ours(model, tokenizer, eos)
    assert greedy != greedy_without_state(model, tokenizer)  # a lost cache would show
    assert hf_generate(model, tokenizer, eos) == greedy
    # the engine batches prompts shortest first: in that order both draw the same rows from the same stream
    sampled = dict(do_sample=True, temperature=1.3, top_k=50, prompts=sorted(PROMPTS, key=len))
    assert hf_generate(model, tokenizer, eos, seed=11, **sampled) == ours(model, tokenizer, eos, seed=11, **sampled)
    beams = dict(num_beams=3, length_penalty=1.2)
    assert hf_generate(model, tokenizer, eos, **beams) == ours(model, tokenizer, eos, **beams)


@pytest.mark.parametrize("name", ["attnlab-gla", "attnlab-softmax", "hf-llama"])
@pytest.mark.parametrize("settings", [dict(), dict(num_beams=4, length_penalty=1.2)])
def test_a_prompt_alone_and_in_a_left_padded_batch_gives_the_same_tokens(name, settings, tokenizer):
    model = MODELS[name]()
    batch = generate_ids(model, tokenizer, PROMPTS, max_new_tokens=NEW, **settings)
    alone = [generate_ids(model, tokenizer, [p], max_new_tokens=NEW, **settings)[0] for p in PROMPTS]
    assert batch == alone


def test_finished_rows_leave_the_batch_without_changing_the_others(tokenizer):
    model = attnlab_model("softmax")
    eos = [tokenizer.eos_token_id, frequent_token(model, tokenizer)]
    small_batches = ours(model, tokenizer, eos, batch_size=1)
    assert ours(model, tokenizer, eos, batch_size=8) == small_batches


def test_eos_and_length_finish_reasons(tokenizer):
    model = attnlab_model("gla")
    eos_token = frequent_token(model, tokenizer)
    res = generate(model, tokenizer, PROMPTS[0], max_new_tokens=NEW, eos_token_id=[eos_token])
    assert res[0].finish_reason == "eos" and eos_token not in res[0].token_ids
    res = generate(model, tokenizer, PROMPTS[0], max_new_tokens=NEW, eos_token_id=[tokenizer.eos_token_id])
    assert res[0].finish_reason == "length" and len(res[0].token_ids) == NEW


def test_min_new_tokens_suppresses_eos_until_reached(tokenizer):
    model = attnlab_model("gla")
    eos_token = frequent_token(model, tokenizer)
    res = generate(model, tokenizer, PROMPTS[0], max_new_tokens=NEW, min_new_tokens=7, eos_token_id=[eos_token])
    assert len(res[0].token_ids) >= 7


def test_sampling_with_a_fixed_seed_is_reproducible(tokenizer):
    model = attnlab_model("gla")
    a = generate_ids(model, tokenizer, PROMPTS, max_new_tokens=NEW, do_sample=True, temperature=1.5, seed=7)
    b = generate_ids(model, tokenizer, PROMPTS, max_new_tokens=NEW, do_sample=True, temperature=1.5, seed=7)
    c = generate_ids(model, tokenizer, PROMPTS, max_new_tokens=NEW, do_sample=True, temperature=1.5, seed=8)
    assert a == b and a != c


class FixedLogitsLM(nn.Module):
    """Always predicts the same distribution: logit = token id / 10. Ignores logits_to_keep."""

    def __init__(self, vocab: int = 259):
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(1))
        self.vocab = vocab

    def forward(self, input_ids, attention_mask=None, use_cache=None, **cache):  # the cache under the installed name
        logits = torch.arange(self.vocab, dtype=torch.float32).div(10).expand(*input_ids.shape, self.vocab)
        return CausalLMOutputWithPast(logits=logits, **{CACHE_KEY: TrivialCache()})


class TrivialCache:
    def reorder_cache(self, rows):
        pass


def test_top_k_never_samples_outside_the_k_most_likely_tokens(tokenizer):
    ids = generate_ids(FixedLogitsLM(), tokenizer, ["x"] * 4, max_new_tokens=200, do_sample=True, top_k=5, eos_token_id=[0])
    allowed = set(range(259 - 5, 259))
    assert all(set(row) <= allowed for row in ids)
    assert set().union(*map(set, ids)) == allowed


def test_top_p_never_samples_outside_the_nucleus(tokenizer):
    probs = torch.softmax(torch.arange(259, dtype=torch.float32) / 10, dim=0)
    order = torch.argsort(probs, descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    ids = generate_ids(FixedLogitsLM(), tokenizer, ["x"] * 4, max_new_tokens=200, do_sample=True, top_p=0.5, eos_token_id=[0])
    assert set().union(*map(set, ids)) <= nucleus


class IgnoresLogitsToKeep(nn.Module):
    """Seed 001: a recurrent model asked for the last position returns every position."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None, use_cache=None, **cache):  # the cache under the installed name
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache, **cache)


def test_beam_search_on_a_model_that_ignores_logits_to_keep_runs_and_matches(tokenizer):
    inner = attnlab_model("gla")
    wrapped = IgnoresLogitsToKeep(inner)
    expected = generate_ids(inner, tokenizer, PROMPTS, max_new_tokens=NEW, num_beams=4)
    assert generate_ids(wrapped, tokenizer, PROMPTS, max_new_tokens=NEW, num_beams=4) == expected


def test_num_beams_1_is_greedy(tokenizer):
    model = attnlab_model("gla")
    assert generate_ids(model, tokenizer, PROMPTS, max_new_tokens=NEW, num_beams=1) == generate_ids(model, tokenizer, PROMPTS, max_new_tokens=NEW)


def test_stop_strings_spanning_several_tokens_end_generation_at_the_string(tokenizer):
    model = attnlab_model("gla")
    free = generate(model, tokenizer, PROMPTS[0], max_new_tokens=NEW)[0]
    stop = free.text[3:6]  # three byte tokens
    first = free.text.find(stop)
    res = generate(model, tokenizer, PROMPTS[0], max_new_tokens=NEW, stop=[stop])[0]
    assert res.finish_reason == "stop"
    assert res.text == free.text[:first]
    assert tokenizer.decode(res.token_ids).endswith(stop)  # generation ran through the stop string, no further
    beams = generate(model, tokenizer, PROMPTS[0], max_new_tokens=NEW, num_beams=2, stop=[stop])[0]
    assert stop not in beams.text


def test_a_stop_string_inside_the_prompt_does_not_stop_generation(tokenizer):
    model = attnlab_model("gla")
    res = generate(model, tokenizer, "stop here", max_new_tokens=NEW, stop=["stop"])[0]
    assert res.finish_reason == "length"


def test_streamed_pieces_add_up_to_the_final_text(tokenizer):
    model = attnlab_model("gla")
    pieces = []
    res = generate(model, tokenizer, PROMPTS[0], max_new_tokens=NEW, stream=pieces.append)[0]
    assert "".join(pieces) == res.text


def test_beam_search_returns_candidates_best_first(tokenizer):
    model = attnlab_model("gla")
    res = generate(model, tokenizer, PROMPTS, max_new_tokens=NEW, num_beams=4, num_return_sequences=3)
    for r in res:
        scores = [c.score for c in r.candidates]
        assert len(scores) == 3 and scores == sorted(scores, reverse=True)


class ExplodingLM(FixedLogitsLM):
    def forward(self, *args, **kwargs):
        raise AssertionError("the model must not run")


@pytest.mark.parametrize("settings, message", [
    (dict(min_new_tokens=20, max_new_tokens=10), "min_new_tokens"),
    (dict(num_beams=2, num_return_sequences=3), "num_return_sequences"),
    (dict(temperature=0.7), "do_sample"),
    (dict(do_sample=True, num_beams=4), "beam"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(top_p=1.5), "top_p"),
])
def test_impossible_settings_are_rejected_before_any_compute(settings, message, tokenizer):
    with pytest.raises(ConfigError, match=message):
        generate(ExplodingLM(), tokenizer, PROMPTS, **settings)


def test_generate_ids_returns_one_plain_list_per_prompt(tokenizer):
    ids = generate_ids(attnlab_model("gla"), tokenizer, PROMPTS + [[72, 105]], max_new_tokens=3)
    assert len(ids) == 4 and all(isinstance(row, list) and all(isinstance(t, int) for t in row) for row in ids)


def test_generate_config_round_trips_as_an_object(tokenizer):
    cfg = GenerateConfig(max_new_tokens=5, num_beams=2)
    assert generate_ids(attnlab_model("gla"), tokenizer, PROMPTS, cfg) == generate_ids(attnlab_model("gla"), tokenizer, PROMPTS, max_new_tokens=5, num_beams=2)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("model") / "m"
    attnlab_model("gla").save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_cli_generate_streams_one_prompt(saved_model, capsys):
    assert run_cli("generate", str(saved_model), "--prompt", "Hello", "--max-new-tokens", "5") == 0
    captured = capsys.readouterr()
    assert "Hello" in captured.out and "finish: length" in captured.err


def test_cli_generate_writes_jsonl_for_an_input_file(saved_model, tmp_path):
    src, dst = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    assert run_cli("generate", str(saved_model), "--input", str(src), "--output", str(dst), "--num-beams", "2", "--max-new-tokens", "4") == 0
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["id"] for r in rows] == [0, 1, 2] and all(len(r["token_ids"]) <= 4 for r in rows)


@pytest.mark.parametrize("args, message", [
    (["--prompt", "x", "--min-new-tokens", "9", "--max-new-tokens", "3"], "min_new_tokens"),
    (["--prompt", "x", "--early-stopping", "maybe"], "early-stopping"),
    ([], "--prompt"),
])
def test_cli_generate_rejects_bad_settings(saved_model, capsys, args, message):
    assert run_cli("generate", str(saved_model), *args) == 1
    assert message in capsys.readouterr().err


def test_cli_generate_on_a_missing_model_says_what_it_expected(tmp_path, capsys):
    assert run_cli("generate", str(tmp_path / "nope"), "--prompt", "x") == 1
    assert "model not found" in capsys.readouterr().err


def test_top_level_generate_and_load_round_trip(saved_model):
    import attnlab

    model, tokenizer = attnlab.load(saved_model, device="cpu")
    results = attnlab.generate(model, tokenizer, PROMPTS, attnlab.GenerateConfig(max_new_tokens=4))
    assert [r.token_ids for r in results] == generate_ids(model, tokenizer, PROMPTS, max_new_tokens=4)


def test_bench_decode_reports_new_tokens_per_second_for_engine_and_hf(tmp_path, capsys):
    out = tmp_path / "decode.json"
    assert run_cli("bench", "decode", "--batch-size", "2", "--prompt-len", "4", "--new-tokens", "3", "--repeats", "1", "--device", "cpu", "--out", str(out)) == 0
    row = json.loads(out.read_text())["results"][0]
    assert row["batch"] == 2 and row["attnlab_new_tok_per_s"] > 0 and row["hf_generate_new_tok_per_s"] > 0
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the plot beside the JSON


def test_bench_train_plot_shows_every_row_including_one_that_ran_out_of_memory(tmp_path):
    from attnlab.bench.plot import plot_train

    rows = [dict(model="attnlab-gla", batch=8, seq_len=2048, tok_per_s=129220, peak_gib=17.3, reserved_gib=21.0),
            dict(model="fla-gla", batch=8, seq_len=2048, tok_per_s=98021, peak_gib=22.8, reserved_gib=24.0),
            dict(model="hf-llama", batch=1, seq_len=16384, tok_per_s=None, peak_gib=None, reserved_gib=None)]
    path = plot_train(rows, tmp_path / "train.png", "a GPU")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_bench_decode_times_beam_search_against_greedy_over_as_many_rows_and_hf_on_a_peer(tmp_path):
    out = tmp_path / "decode.json"
    assert run_cli("bench", "decode", "--arch", "attnlab-gla", "--hf-arch", "hf-llama", "--hidden", "32", "--layers", "1", "--heads", "2",
                   "--vocab", "300", "--batch-size", "2", "--prompt-len", "4", "--new-tokens", "3", "--repeats", "1", "--beams", "2",
                   "--device", "cpu", "--out", str(out)) == 0
    result = json.loads(out.read_text())
    row = result["results"][0]
    assert "hf-llama" in result["model"] and row["beams"] == 2 and row["beam_cost_ratio"] > 0 and row["hf_generate_new_tok_per_s"] > 0
