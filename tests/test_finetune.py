"""Fine-tuning: exact label masks, LoRA/DoRA/QLoRA through peft, control tokens, adapter reload, merge, bad input."""

import json
import re
import sys

import pytest
import torch
from conftest import run_cli, sets

pytestmark = pytest.mark.hf_interop  # CI runs these against the oldest transformers and peft it supports too

IGNORE = -100
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _bpe_tokenizer():
    """A small BPE tokenizer without pre-tokenisation: merges cross the prompt/completion boundary."""
    from tokenizers import Tokenizer, models, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    corpus = ["Q: what is two? A: two is a number.", "Q: name a colour: blue", "answer: yes", "x: y"] * 50
    alphabet = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;?!'\n<>_|-")
    trainer = trainers.BpeTrainer(vocab_size=160, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>", "<pad>"], initial_alphabet=alphabet)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<pad>",
                                   bos_token="<|im_start|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny HF Llama (untied head) with a BPE tokenizer that has a chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _bpe_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id)
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


STYLE_ROWS = [{"prompt": f"<T> what is {w}?\n", "completion": f"{w}."} for w in ("red", "sky", "sea", "sun")] + \
             [{"prompt": f"<V> what is {w}?\n", "completion": f"{w} is a thing that we all know well, a long answer."} for w in ("red", "sky", "sea", "sun")]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(base, data, tmp_path, extra=()):
    from attnlab.finetune.config import load_finetune_config

    cfg_path = tmp_path / "ft.yaml"
    cfg_path.write_text("{}\n")
    overrides = [f"base.path={base}", f"data.train={data}", "data.max_len=64", "train.max_steps=6", "train.warmup_steps=1",
                 "train.batch_size=4", "train.log_every=2", "train.device=cpu", "train.lr=5e-3", "finetune.r=4",
                 "finetune.dropout=0.0", *extra]
    return load_finetune_config(cfg_path, overrides)


def _check_labels(batch, prompt_lens, completion_ids):
    """Token by token: -100 on the prompt and on padding, the token id on every completion token."""
    for r in range(batch["input_ids"].shape[0]):
        n_p, comp = prompt_lens[r], completion_ids[r]
        for t in range(batch["input_ids"].shape[1]):
            label, tok, mask = batch["labels"][r, t].item(), batch["input_ids"][r, t].item(), batch["attention_mask"][r, t].item()
            if t < n_p:
                assert label == IGNORE and mask == 1, (r, t)
            elif t < n_p + len(comp):
                assert label == tok == comp[t - n_p] and mask == 1, (r, t)
            else:
                assert label == IGNORE and mask == 0, (r, t)


def test_prompt_completion_labels_mask_exactly_prompt_and_padding_when_prompt_is_not_a_prefix(llama_dir):
    from attnlab.data import load_tokenizer
    from attnlab.finetune.data import PadCollator, encode_rows

    tok = load_tokenizer(str(llama_dir))
    rows = [{"prompt": "x:", "completion": " y"}, {"prompt": "Q: name a colour:", "completion": " blue and more"}]
    for r in rows:  # the case this test is about: the prompt's tokens are not a prefix of prompt+completion's
        p, pc = tok(r["prompt"])["input_ids"], tok(r["prompt"] + r["completion"])["input_ids"]
        assert pc[: len(p)] != p
    enc = encode_rows(tok, rows, max_len=64)
    batch = PadCollator(tok.pad_token_id)(enc.examples)
    prompts = [tok(r["prompt"])["input_ids"] for r in rows]
    comps = [tok(r["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in rows]
    _check_labels(batch, [len(p) for p in prompts], comps)
    for r, p in enumerate(prompts):  # the prompt trained on is the prompt generation sees
        assert batch["input_ids"][r, : len(p)].tolist() == p


def test_chat_labels_mask_exactly_the_rendered_prompt_and_padding(llama_dir):
    from attnlab.data import load_tokenizer
    from attnlab.finetune.data import PadCollator, chat_prompt_ids, encode_rows

    tok = load_tokenizer(str(llama_dir))
    rows = [{"messages": [{"role": "user", "content": "what is two?"}, {"role": "assistant", "content": "two is a number."}]},
            {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x:"},
                          {"role": "assistant", "content": "y"}]}]
    enc = encode_rows(tok, rows, max_len=128)
    batch = PadCollator(tok.pad_token_id)(enc.examples)
    prompts = [tok.apply_chat_template(r["messages"][:-1], tokenize=False, add_generation_prompt=True) for r in rows]
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    full = [tok.apply_chat_template(r["messages"], tokenize=False) for r in rows]
    comps = [tok(f[len(p):], add_special_tokens=False)["input_ids"] for f, p in zip(full, prompts)]
    assert all(c[-2] == tok.convert_tokens_to_ids("<|im_end|>") for c in comps)  # the end-of-turn token is trained
    _check_labels(batch, [len(p) for p in prompt_ids], comps)
    assert prompt_ids[0] == chat_prompt_ids(tok, "what is two?")


def test_byte_tokenizer_labels_mask_exactly_prompt_and_padding(attnlab_dir):
    from attnlab.data import load_tokenizer
    from attnlab.finetune.data import PadCollator, encode_rows

    tok = load_tokenizer(str(attnlab_dir))
    enc = encode_rows(tok, STYLE_ROWS[:2] + STYLE_ROWS[-1:], max_len=128)
    batch = PadCollator(tok.pad_token_id)(enc.examples)
    rows = STYLE_ROWS[:2] + STYLE_ROWS[-1:]
    _check_labels(batch, [len(r["prompt"].encode()) for r in rows], [list(r["completion"].encode()) + [tok.eos_token_id] for r in rows])


def test_example_whose_completion_is_truncated_away_is_dropped_and_counted(attnlab_dir):
    from attnlab.data import load_tokenizer
    from attnlab.finetune.data import encode_rows

    tok = load_tokenizer(str(attnlab_dir))
    rows = [{"prompt": "a" * 20, "completion": "b"}, {"prompt": "a" * 5, "completion": "b" * 30}, {"prompt": "a", "completion": "b"}]
    enc = encode_rows(tok, rows, max_len=20)
    assert enc.dropped == [0] and enc.truncated == 1 and len(enc.examples) == 2
    assert all(any(l != IGNORE for l in e["labels"]) for e in enc.examples)  # never a zero-token loss
    assert "1 truncated" in enc.summary("train") and "1 dropped" in enc.summary("train")


def test_target_presets_name_attnlab_mixer_and_llama_projections(attnlab_dir, llama_dir):
    from attnlab.finetune.model import load_base, resolve_targets

    model, _, _ = load_base(str(attnlab_dir))
    assert resolve_targets(model, "auto") == ["q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "gk_proj.0", "gk_proj.1",
                                              "gate_proj", "up_proj", "down_proj"]
    llama, _, _ = load_base(str(llama_dir))
    assert resolve_targets(llama, "auto") == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_all_linear_never_wraps_the_lm_head(llama_dir, tmp_path):
    from attnlab.finetune.run import prepare

    cfg = _cfg(llama_dir, _jsonl(tmp_path / "d.jsonl", STYLE_ROWS), tmp_path, ["finetune.target_modules=all-linear"])
    p = prepare(cfg)
    assert "lm_head" not in p.targets
    assert not any("lm_head" in n and "lora" in n for n, _ in p.model.named_parameters())
    assert any("q_proj.lora_A" in n for n, _ in p.model.named_parameters())


def test_dora_and_rslora_configure_peft(llama_dir, tmp_path):
    from attnlab.finetune.run import prepare

    cfg = _cfg(llama_dir, _jsonl(tmp_path / "d.jsonl", STYLE_ROWS), tmp_path, ["finetune.method=dora", "finetune.rslora=true"])
    p = prepare(cfg)
    pc = p.model.peft_config["default"]
    assert pc.use_dora and pc.use_rslora
    assert any("lora_magnitude_vector" in n for n, _ in p.model.named_parameters())


def test_control_tokens_start_at_the_mean_row_and_only_their_rows_train(attnlab_dir, tmp_path):
    from attnlab.finetune.run import run_finetune

    cfg = _cfg(attnlab_dir, _jsonl(tmp_path / "d.jsonl", STYLE_ROWS), tmp_path, ["finetune.control_tokens=[<T>, <V>]"])
    from attnlab.finetune.model import add_control_tokens, load_base

    base, tok, _ = load_base(str(attnlab_dir))
    before = base.get_input_embeddings().weight.detach().clone()
    ids = add_control_tokens(base, tok, ["<T>", "<V>"])
    assert ids == {"<T>": 259, "<V>": 260}
    assert torch.allclose(base.get_input_embeddings().weight[259], before.mean(0), atol=1e-6)
    result = run_finetune(cfg, tmp_path / "run")
    trained = result.run_dir
    from attnlab import load

    model, tok2 = load(trained, device="cpu")
    after = model.get_input_embeddings()
    weight = after.weight if hasattr(after, "weight") else after.base_layer.weight
    merged = after(torch.arange(261))
    assert torch.equal(merged[:259], before)  # every original row untouched
    assert not torch.allclose(merged[259], before.mean(0))  # the control rows trained
    assert weight.shape[0] == 261 and len(tok2) == 261


def test_adapter_reloads_in_one_call_and_generates_identically(attnlab_dir, tmp_path):
    import attnlab
    from attnlab.finetune.run import run_finetune

    cfg = _cfg(attnlab_dir, _jsonl(tmp_path / "d.jsonl", STYLE_ROWS), tmp_path, ["finetune.control_tokens=[<T>, <V>]"])
    captured = {}
    import attnlab.finetune.adapter as adapter_mod

    real_save = adapter_mod.save_adapter

    def save_and_generate(peft_model, tokenizer, out, meta, yaml_text):
        model = peft_model.get_base_model()
        captured["before"] = attnlab.generate(model, tokenizer, ["<T> what is red?\n", "<V> what is sky?\n"], max_new_tokens=12)
        return real_save(peft_model, tokenizer, out, meta, yaml_text)

    adapter_mod.save_adapter = save_and_generate
    try:
        result = run_finetune(cfg, tmp_path / "run")
    finally:
        adapter_mod.save_adapter = real_save
    model, tok = attnlab.load(result.adapter_dir, device="cpu")
    after = attnlab.generate(model, tok, ["<T> what is red?\n", "<V> what is sky?\n"], max_new_tokens=12)
    assert [r.token_ids for r in after] == [r.token_ids for r in captured["before"]]
    assert model.get_input_embeddings().weight.shape[0] == 261


def test_llama_dora_adapter_with_untied_head_reloads_with_identical_logits(llama_dir, tmp_path):
    import attnlab
    from attnlab.finetune.run import run_finetune

    cfg = _cfg(llama_dir, _jsonl(tmp_path / "d.jsonl", STYLE_ROWS), tmp_path,
               ["finetune.control_tokens=[<T>, <V>]", "finetune.method=dora", "data.chat_template=true"])
    result = run_finetune(cfg, tmp_path / "run")
    model, tok = attnlab.load(tmp_path / "run", device="cpu")  # the run directory resolves to its adapter
    ids = torch.tensor([tok("<T> what is red?")["input_ids"]])
    assert tok.convert_tokens_to_ids("<T>") in ids[0].tolist()
    model2, _ = attnlab.load(result.adapter_dir, device="cpu")
    assert torch.equal(model(input_ids=ids).logits, model2(input_ids=ids).logits)
    assert (result.adapter_dir / "adapter_model.safetensors").is_file() and (result.adapter_dir / "control_tokens.safetensors").is_file()


def test_merge_command_writes_a_standalone_model_with_the_same_outputs(attnlab_dir, tmp_path):
    import attnlab
    from attnlab.finetune.run import run_finetune

    cfg = _cfg(attnlab_dir, _jsonl(tmp_path / "d.jsonl", STYLE_ROWS), tmp_path, ["finetune.control_tokens=[<T>, <V>]"])
    result = run_finetune(cfg, tmp_path / "run")
    assert run_cli("merge", str(result.adapter_dir), str(tmp_path / "merged")) == 0
    assert not (tmp_path / "merged" / "attnlab_adapter.json").exists() and (tmp_path / "merged" / "config.json").is_file()
    merged, tok = attnlab.load(tmp_path / "merged", device="cpu")
    adapted, _ = attnlab.load(result.adapter_dir, device="cpu")
    ids = torch.tensor([tok("<V> what is sea?\n")["input_ids"]])
    torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


def test_finetune_cli_writes_the_run_artifacts_and_the_report(attnlab_dir, tmp_path, capsys):
    data = _jsonl(tmp_path / "d.jsonl", STYLE_ROWS)
    cfg = tmp_path / "ft.yaml"
    cfg.write_text("finetune:\n  control_tokens: ['<T>', '<V>']\n  generation:\n    '<T>': {max_new_tokens: 4}\n"
                   "    '<V>': {min_new_tokens: 8, max_new_tokens: 12}\n")
    overrides = [f"base.path={attnlab_dir}", f"data.train={data}", f"data.val={data}", f"finetune.eval_prompts={data}",
                 "train.max_steps=4", "train.warmup_steps=1", "train.batch_size=4", "train.log_every=3", "train.save_every=2",
                 "train.device=cpu", "finetune.r=4"]
    run = tmp_path / "run"
    assert run_cli("finetune", str(cfg), *sets(overrides), "--run-dir", str(run), "--merge") == 0
    for name in ("config.yaml", "run.json", "heartbeat.jsonl", "metrics.csv", "tb", "checkpoints", "final/attnlab_adapter.json",
                 "final/finetune_config.yaml", "final/tokenizer_config.json", "merged/config.json"):
        assert (run / name).exists(), name
    report = json.loads((run / "run.json").read_text())
    assert report["status"] == "finished"
    for key in ("trainable_params", "trainable_pct", "peak_cpu_rss_mib", "tokens_per_s", "final_loss", "val_loss", "style_separation"):
        assert report[key] is not None, key
    assert 0 < report["trainable_pct"] < 100
    for measured in (report["style"], report["style_control"]):  # after training, and the untuned base before it
        assert measured["decoding"].startswith("greedy, the same budget")
        assert measured["max_new_tokens"] == 2 * max(len(r["completion"].encode()) + 1 for r in STYLE_ROWS)  # + EOS
    assert report["style_separation_untuned"] == report["style_control"]["style_separation"]
    out = capsys.readouterr().out
    assert "style separation" in out and "untuned base" in out
    # the last loss logged is step 3's (log_every 3 of 4 steps), and the summary says so
    assert report["final_loss_step"] == 3 and re.search(r"final train loss\s+│\s+\d+\.\d{4} \(step 3\)", out)


def test_generation_presets_follow_the_control_token_in_the_prompt():
    from attnlab.config.presets import settings_for_prompt

    presets = {"default": {"max_new_tokens": 50}, "<T>": {"max_new_tokens": 20}, "<V>": {"min_new_tokens": 30, "max_new_tokens": 100}}
    assert settings_for_prompt("<T> hi", presets).max_new_tokens == 20
    v = settings_for_prompt("<V> hi", presets)
    assert (v.min_new_tokens, v.max_new_tokens) == (30, 100)
    assert settings_for_prompt("hi", presets).max_new_tokens == 50
    assert settings_for_prompt("<V> hi", presets, {"max_new_tokens": 40}).max_new_tokens == 40  # explicit settings win


def test_reloaded_adapter_carries_its_generation_presets(attnlab_dir, tmp_path):
    import attnlab
    from attnlab.finetune.presets import generate_with_presets
    from attnlab.finetune.run import run_finetune

    cfg = _cfg(attnlab_dir, _jsonl(tmp_path / "d.jsonl", STYLE_ROWS), tmp_path,
               ["finetune.control_tokens=[<T>, <V>]", "finetune.generation={'<T>': {max_new_tokens: 3}, '<V>': {min_new_tokens: 9, max_new_tokens: 9}}"])
    result = run_finetune(cfg, tmp_path / "run")
    model, tok = attnlab.load(result.adapter_dir, device="cpu")
    out = generate_with_presets(model, tok, ["<T> a?\n", "<V> a?\n"], model.attnlab_generation_presets)
    assert len(out[0].token_ids) <= 3 and len(out[1].token_ids) == 9


# --- bad input: one clear message each, non-zero exit ------------------------------------------

def _cli_error(tmp_path, capsys, overrides, cfg_text="{}\n"):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(cfg_text)
    code = run_cli("finetune", str(cfg), *sets(["train.max_steps=2", "train.warmup_steps=0", "train.device=cpu", *overrides]),
                   "--run-dir", str(tmp_path / "run"))
    return code, capsys.readouterr().err


def test_base_model_path_that_does_not_exist_is_refused(tmp_path, capsys):
    data = _jsonl(tmp_path / "d.jsonl", STYLE_ROWS)
    code, err = _cli_error(tmp_path, capsys, [f"base.path={tmp_path / 'nope'}", f"data.train={data}"])
    assert code == 1 and "base model not found" in err


def test_gguf_without_a_tokenizer_is_refused(tmp_path, capsys):
    import gguf
    import numpy as np

    path = tmp_path / "bare.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    data = _jsonl(tmp_path / "d.jsonl", STYLE_ROWS)
    code, err = _cli_error(tmp_path, capsys, [f"base.path={path}", f"data.train={data}"])
    assert code == 1 and "holds no usable tokenizer" in err


def test_dataset_row_without_completion_is_refused_with_its_line(attnlab_dir, tmp_path, capsys):
    data = _jsonl(tmp_path / "d.jsonl", STYLE_ROWS[:2] + [{"prompt": "no answer"}])
    code, err = _cli_error(tmp_path, capsys, [f"base.path={attnlab_dir}", f"data.train={data}"])
    assert code == 1 and 'line 3: the row has no "completion" field' in err


def test_control_token_that_already_exists_is_refused(attnlab_dir, tmp_path, capsys):
    data = _jsonl(tmp_path / "d.jsonl", STYLE_ROWS)
    code, err = _cli_error(tmp_path, capsys, [f"base.path={attnlab_dir}", f"data.train={data}", "finetune.control_tokens=[<eos>]"])
    assert code == 1 and "already exist" in err


def test_target_modules_that_match_nothing_are_refused(attnlab_dir, tmp_path, capsys):
    data = _jsonl(tmp_path / "d.jsonl", STYLE_ROWS)
    code, err = _cli_error(tmp_path, capsys, [f"base.path={attnlab_dir}", f"data.train={data}", "finetune.target_modules=[c_attn]"])
    assert code == 1 and "match no linear layer" in err


def test_qlora_without_bitsandbytes_is_refused(attnlab_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails as if it were not installed
    data = _jsonl(tmp_path / "d.jsonl", STYLE_ROWS)
    code, err = _cli_error(tmp_path, capsys, [f"base.path={attnlab_dir}", f"data.train={data}", "finetune.method=qlora"])
    assert code == 1 and "needs bitsandbytes" in err


def test_qlora_trains_a_4bit_base_on_cpu_and_reloads_it_quantised(llama_dir, tmp_path):
    pytest.importorskip("bitsandbytes")
    import attnlab
    from attnlab.finetune.run import run_finetune

    cfg = _cfg(llama_dir, _jsonl(tmp_path / "d.jsonl", STYLE_ROWS), tmp_path, ["finetune.method=qlora", "finetune.control_tokens=[<T>, <V>]"])
    result = run_finetune(cfg, tmp_path / "run")
    assert result.report["final_loss"] is not None
    model, tok = attnlab.load(result.adapter_dir, device="cpu")
    assert type(model.model.layers[0].self_attn.q_proj.base_layer).__name__ == "Linear4bit"
    assert tok.convert_tokens_to_ids("<T>") == result.report["control_tokens"]["<T>"]



# --- the style metric measures the model, not the decoding settings ------------------------------------

def test_style_metric_decodes_both_styles_under_one_budget_and_an_untrained_model_scores_one(attnlab_dir):
    import attnlab
    from attnlab.finetune.model import add_control_tokens
    from attnlab.finetune.presets import style_separation

    model, tok = attnlab.load(attnlab_dir, device="cpu")
    add_control_tokens(model, tok, ["<T>", "<V>"])
    prompts = ["<T> what is red?\n", "<V> what is red?\n", "<T> what is sky?\n", "<V> what is sky?\n"]
    presets_that_would_separate = {"<T>": {"max_new_tokens": 2}, "<V>": {"min_new_tokens": 10, "max_new_tokens": 10}}
    model.attnlab_generation_presets = presets_that_would_separate  # ignored by the metric
    out = style_separation(model, tok, prompts, ["<T>", "<V>"], max_new_tokens=12)
    assert out["max_new_tokens"] == 12 and out["prompts"] == {"<T>": 2, "<V>": 2}
    # an untrained model never picks EOS: both styles run into the one budget, and the separation is 1.0
    assert out["mean_new_tokens"] == {"<T>": 12, "<V>": 12} and out["hit_budget"] == {"<T>": 2, "<V>": 2}
    assert out["style_separation"] == 1.0


def test_style_metric_ratio_follows_where_the_model_stops(attnlab_dir, monkeypatch):
    import attnlab.generation
    from attnlab.finetune.presets import style_separation
    from attnlab.generation.engine import Candidate, GenerationResult

    seen = []

    def fake_generate(model, tokenizer, prompts, settings, progress=None):
        seen.append(settings)
        return [GenerationResult(p, [Candidate("x", [1] * (2 if "<T>" in p else 8), "eos")]) for p in prompts]

    monkeypatch.setattr(attnlab.generation, "generate", fake_generate)
    out = style_separation(None, None, ["<T> a", "<V> a", "<T> b", "<V> b"], ["<T>", "<V>"], max_new_tokens=40)
    assert out["style_separation"] == 4.0 and out["hit_budget"] == {"<T>": 0, "<V>": 0}
    assert len(seen) == 1 and seen[0].max_new_tokens == 40 and not seen[0].do_sample and seen[0].min_new_tokens == 0


# --- finetune shares train's machinery -------------------------------------------------------------------

def _adapter_tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path / "adapter_model.safetensors"))


def test_resume_continues_to_the_uninterrupted_runs_adapter(attnlab_dir, tmp_path):
    from attnlab.finetune.run import run_finetune

    data = _jsonl(tmp_path / "d.jsonl", STYLE_ROWS)
    common = ["finetune.control_tokens=[<T>, <V>]", "train.schedule=constant", "train.warmup_steps=0", "train.save_every=3"]
    whole = run_finetune(_cfg(attnlab_dir, data, tmp_path, common), tmp_path / "whole")
    part = _cfg(attnlab_dir, data, tmp_path, [*common, "train.max_steps=3"])
    run_finetune(part, tmp_path / "split")
    assert (tmp_path / "split" / "checkpoints" / "step-0000003").is_dir()
    rest = _cfg(attnlab_dir, data, tmp_path, common)  # max_steps 6: only the length changes
    resumed = run_finetune(rest, tmp_path / "split", resume=True)
    assert resumed.report["steps"] == whole.report["steps"] == 6
    a, b = _adapter_tensors(whole.adapter_dir), _adapter_tensors(resumed.adapter_dir)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)
    steps = [json.loads(line)["step"] for line in (tmp_path / "split" / "heartbeat.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps))  # the telemetry continues, no step twice
    assert json.loads((tmp_path / "split" / "run.json").read_text())["status"] == "finished"


def test_a_run_stopped_after_its_last_checkpoint_resumes_to_finish_it(attnlab_dir, tmp_path):
    import shutil

    from attnlab.errors import ConfigError
    from attnlab.finetune.run import run_finetune

    data = _jsonl(tmp_path / "d.jsonl", STYLE_ROWS)
    cfg = _cfg(attnlab_dir, data, tmp_path, ["train.max_steps=3", "train.save_every=3", "train.warmup_steps=0"])
    done = run_finetune(cfg, tmp_path / "run")
    expected = _adapter_tensors(done.adapter_dir)
    shutil.rmtree(tmp_path / "run" / "final")  # as if stopped between the last checkpoint and the final adapter
    finished = run_finetune(cfg, tmp_path / "run", resume=True)
    assert finished.report["steps"] == 3 and json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "finished"
    for name, tensor in _adapter_tensors(finished.adapter_dir).items():
        torch.testing.assert_close(tensor, expected[name])
    with pytest.raises(ConfigError, match="already reached step 3"):  # a finished run is not resumed again
        run_finetune(cfg, tmp_path / "run", resume=True)


def test_eval_section_runs_during_finetuning_and_records_the_best_checkpoint(attnlab_dir, tmp_path):
    from attnlab.finetune.run import run_finetune

    cfg = _cfg(attnlab_dir, _jsonl(tmp_path / "d.jsonl", STYLE_ROWS), tmp_path,
               ["train.save_every=2", "eval.every=2", "eval.tasks=[{task: perplexity, limit: 1}]",
                "eval.best_metric=perplexity/bits_per_byte", "eval.best_mode=min"])
    result = run_finetune(cfg, tmp_path / "run")
    evals = [json.loads(line) for line in (tmp_path / "run" / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [2, 4, 6]
    best = json.loads((tmp_path / "run" / "best.json").read_text())
    assert best["value"] == min(e["perplexity/bits_per_byte"] for e in evals)
    assert (tmp_path / "run" / best["checkpoint"]).is_dir()  # kept by the rotation
    assert result.report["best"]["step"] == best["step"] and "perplexity/bits_per_byte" in result.report["eval"]


def test_packing_concatenates_examples_and_keeps_each_label_mask():
    from attnlab.finetune.data import IGNORE, pack_examples

    ex = [{"input_ids": [1, 2, 3], "labels": [IGNORE, IGNORE, 3]}, {"input_ids": [4, 5], "labels": [IGNORE, 5]},
          {"input_ids": [6, 7, 8, 9], "labels": [IGNORE, 7, 8, 9]}]
    rows = pack_examples(ex, max_len=6)
    assert rows == [{"input_ids": [1, 2, 3, 4, 5], "labels": [IGNORE, IGNORE, 3, IGNORE, 5]},
                    {"input_ids": [6, 7, 8, 9], "labels": [IGNORE, 7, 8, 9]}]


def test_packing_and_epochs_set_the_rows_and_the_steps(attnlab_dir, tmp_path):
    from attnlab.finetune.run import run_finetune

    cfg = _cfg(attnlab_dir, _jsonl(tmp_path / "d.jsonl", STYLE_ROWS), tmp_path,
               ["data.packing=true", "data.max_len=128", "train.epochs=2", "train.batch_size=1"])
    report = run_finetune(cfg, tmp_path / "run").report
    assert report["packing"] and report["train_examples"] == 8 and report["train_rows"] < 8
    assert report["steps"] == report["max_steps"] == 2 * report["train_rows"]


def test_epochs_shorter_than_the_warmup_are_refused(attnlab_dir, tmp_path, capsys):
    data = _jsonl(tmp_path / "d.jsonl", STYLE_ROWS)
    code, err = _cli_error(tmp_path, capsys, [f"base.path={attnlab_dir}", f"data.train={data}", "train.epochs=0.5",
                                              "train.batch_size=4", "train.warmup_steps=2"])
    assert code == 1 and "fewer than train.warmup_steps=2" in err


def test_full_finetuning_trains_every_parameter_and_writes_a_whole_model(llama_dir, tmp_path):
    import attnlab
    from attnlab.finetune.run import run_finetune

    cfg = _cfg(llama_dir, _jsonl(tmp_path / "d.jsonl", STYLE_ROWS), tmp_path,
               ["finetune.method=full", "finetune.control_tokens=[<T>, <V>]", "train.lr=1e-3", "train.save_every=3"])
    result = run_finetune(cfg, tmp_path / "run")
    assert result.report["trainable_pct"] == 100.0 and result.report["target_modules"] == ["all"]
    final = result.adapter_dir
    assert (final / "config.json").is_file() and not (final / "attnlab_adapter.json").exists()
    model, tok = attnlab.load(tmp_path / "run", device="cpu")  # the run resolves to its whole model
    base, _ = attnlab.load(llama_dir, device="cpu")
    assert model.get_input_embeddings().weight.shape[0] == len(tok) == base.get_input_embeddings().weight.shape[0] + 2
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, base.model.layers[0].mlp.up_proj.weight)
    resumed = run_finetune(_cfg(llama_dir, _jsonl(tmp_path / "d.jsonl", STYLE_ROWS), tmp_path,
                                ["finetune.method=full", "finetune.control_tokens=[<T>, <V>]", "train.lr=1e-3",
                                 "train.save_every=3", "train.max_steps=8"]), tmp_path / "run", resume=True)
    assert resumed.report["steps"] == 8


# --- adapters record a base that loads; merged models keep the base's dtype ------------------------------

def _bytelevel_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["Q: what is two? A: two is a number.", "Q: name a colour: blue", "answer: yes", "x: y"] * 50
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>", bos_token="<|im_start|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="module")
def gguf_base(tmp_path_factory):
    """A tiny Llama as a GGUF file with an embedded byte-level BPE tokenizer (as SmolLM2's), tied head. Its vocabulary
    lacks <|endoftext|>, which transformers' GGUF tokenizer conversion then appends: one token beyond the embedding."""
    import gguf
    import numpy as np

    tok = _bytelevel_tokenizer()
    spec = json.loads(tok.backend_tokenizer.to_str())
    tokens = sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    special = {"<|im_start|>", "<|im_end|>", "<pad>"}
    d, ff = 32, 64
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128); w.add_embedding_length(d); w.add_block_count(1); w.add_feed_forward_length(ff)
    w.add_head_count(2); w.add_head_count_kv(2); w.add_rope_dimension_count(d // 2); w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(tokens)); w.add_tokenizer_model("gpt2"); w.add_token_list(tokens); w.add_token_merges(merges)
    w.add_token_types([3 if t in special else 1 for t in tokens]); w.add_chat_template(tok.chat_template)
    w.add_bos_token_id(tok.bos_token_id); w.add_eos_token_id(tok.eos_token_id); w.add_pad_token_id(tok.pad_token_id)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", (rng.standard_normal((len(tokens), d)) * 0.05).astype(np.float32))
    for name, shape in [("attn_q", (d, d)), ("attn_k", (d, d)), ("attn_v", (d, d)), ("attn_output", (d, d)),
                        ("ffn_gate", (ff, d)), ("ffn_up", (ff, d)), ("ffn_down", (d, ff))]:
        w.add_tensor(f"blk.0.{name}.weight", (rng.standard_normal(shape) * 0.05).astype(np.float32))
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        w.add_tensor(name, np.ones(d, np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _autopeft_logits(adapter_dir, ids):
    import warnings

    from peft import AutoPeftModelForCausalLM

    import attnlab.models  # noqa: F401  (attnlab's Auto classes)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = AutoPeftModelForCausalLM.from_pretrained(str(adapter_dir), dtype=torch.float32).eval()
    assert not [w for w in caught if "vocabulary" in str(w.message)], [str(w.message) for w in caught]
    return model(input_ids=ids).logits


def test_adapter_on_a_gguf_base_opens_with_autopeft_and_matches_attnlab_load(gguf_base, tmp_path, cache):
    import warnings

    import attnlab
    from attnlab.finetune.run import run_finetune

    cfg = _cfg(gguf_base, _jsonl(tmp_path / "d.jsonl", STYLE_ROWS), tmp_path,
               ["finetune.control_tokens=[<T>, <V>]", "data.chat_template=true", "train.save_every=3"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_finetune(cfg, tmp_path / "run")
    assert not [w for w in caught if "vocabulary" in str(w.message)]  # checkpoints and the adapter: no guess about the vocabulary
    adapter_cfg = json.loads((result.adapter_dir / "adapter_config.json").read_text())
    base_dir = adapter_cfg["base_model_name_or_path"]
    assert base_dir.startswith(str(cache)) and (tmp_path / base_dir / "config.json").is_file()
    model, tok = attnlab.load(result.adapter_dir, device="cpu")
    ids = torch.tensor([tok("<T> what is two?")["input_ids"]])
    torch.testing.assert_close(_autopeft_logits(result.adapter_dir, ids), model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_untied_head_adapter_opens_with_autopeft_with_the_trained_control_rows(llama_dir, tmp_path):
    import attnlab
    from attnlab.finetune.run import run_finetune

    cfg = _cfg(llama_dir, _jsonl(tmp_path / "d.jsonl", STYLE_ROWS), tmp_path, ["finetune.control_tokens=[<T>, <V>]"])
    result = run_finetune(cfg, tmp_path / "run")
    model, tok = attnlab.load(result.adapter_dir, device="cpu")
    ids = torch.tensor([tok("<T> what is red?")["input_ids"]])
    torch.testing.assert_close(_autopeft_logits(result.adapter_dir, ids), model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_merged_model_is_saved_in_the_base_models_dtype(llama_dir, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from attnlab.finetune.adapter import merge_adapter
    from attnlab.finetune.run import run_finetune

    bf16 = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.bfloat16).save_pretrained(bf16)
    AutoTokenizer.from_pretrained(llama_dir).save_pretrained(bf16)
    result = run_finetune(_cfg(bf16, _jsonl(tmp_path / "d.jsonl", STYLE_ROWS), tmp_path, ["finetune.control_tokens=[<T>, <V>]"]),
                          tmp_path / "run")
    merged = merge_adapter(result.adapter_dir, tmp_path / "merged")
    with safe_open(str(merged / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118 (safe_open is not iterable)
    assert json.loads((merged / "config.json").read_text())["dtype"] == "bfloat16"


def test_qlora_on_a_gguf_base_dequantises_then_quantises(gguf_base, tmp_path, cache):
    pytest.importorskip("bitsandbytes")
    import attnlab
    from attnlab.finetune.run import run_finetune

    cfg = _cfg(gguf_base, _jsonl(tmp_path / "d.jsonl", STYLE_ROWS), tmp_path,
               ["finetune.method=qlora", "finetune.control_tokens=[<T>, <V>]", "train.max_steps=2"])
    result = run_finetune(cfg, tmp_path / "run")
    assert result.report["final_loss"] is not None
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "finished"
    model, _ = attnlab.load(result.adapter_dir, device="cpu")
    assert type(model.model.layers[0].self_attn.q_proj.base_layer).__name__ == "Linear4bit"


def test_sigterm_saves_at_the_next_step_marks_the_run_interrupted_and_resume_finishes_it(attnlab_dir, tmp_path, monkeypatch):
    """A fine-tuning run stopped by SIGTERM (Slurm preemption, `timeout`) as `attnlab train` is: the step under
    way finishes, a checkpoint is saved, run.json says "interrupted"; --resume continues to the end."""
    import os
    import signal

    import transformers

    from attnlab.errors import RunInterrupted
    from attnlab.finetune.run import run_finetune

    class TermAtStep2(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # arrives during step 2

    real_init = transformers.Trainer.__init__

    def with_term(self, *args, callbacks=None, **kwargs):
        real_init(self, *args, callbacks=[*(callbacks or []), TermAtStep2()], **kwargs)

    data = _jsonl(tmp_path / "d.jsonl", STYLE_ROWS)
    cfg = _cfg(attnlab_dir, data, tmp_path, ["finetune.control_tokens=[<T>, <V>]", "train.save_every=100"])
    monkeypatch.setattr(transformers.Trainer, "__init__", with_term)
    with pytest.raises(RunInterrupted) as stopped:
        run_finetune(cfg, tmp_path / "run")
    monkeypatch.undo()
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "interrupted"
    assert (tmp_path / "run" / "checkpoints" / "step-0000002").is_dir()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is put back
    resumed = run_finetune(cfg, tmp_path / "run", resume=True)
    assert resumed.report["steps"] == 6
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "finished"
