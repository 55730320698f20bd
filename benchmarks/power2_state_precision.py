"""How far power2's decoding state strays from fp32 arithmetic, on CPU: a 2mamba model (4 layers of 1024,
16 heads, bf16 weights) reads a 256-token prompt and is then fed 256 more given tokens one step at a time
(teacher forcing); each step's logits are held to the same model in fp32 on the reference path.

    python benchmarks/power2_state_precision.py [--steps 256] [--out results.json]

Four ways to carry the state: the recurrence that rewrites it every step (`recurrent_step`) in fp32 and in
bf16, and the windowed step (`windowed_step`: the state read, the latest tokens attended to in a window and
folded in when it fills, every 64 tokens) in fp32 and in bf16. The windowed rows run the PyTorch reference of
the CUDA kernels' arithmetic in place of the kernels. Prints, per way: the logits' relative error at the last
step and the largest over the steps, and how often the greedy token agrees with the fp32 model's.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from attnlab.models import AttnLabConfig, AttnLabForCausalLM, kernels
from attnlab.models.ops.attention_family import recurrent_step, windowed_step


def reference_step_(q, k, v, log_decay, state, normalizer, count, *, recent=None, decay_fn=None, **kwargs):
    """The step kernel's contract (buffers advanced in place) on the PyTorch reference."""
    if decay_fn == "neg_softplus":
        log_decay = -F.softplus(log_decay.float())
    if recent is None:
        o, new_state, new_norm = recurrent_step(q, k, v, log_decay, state, normalizer, count, **kwargs)
    else:
        o, new_state, new_norm, new_recent = windowed_step(q, k, v, log_decay, state, normalizer, recent, count, **kwargs)
        for name, t in new_recent.items():
            recent[name].copy_(t)
    state.copy_(new_state)
    if normalizer is not None:
        normalizer.copy_(new_norm)
    return o


def model(dtype: torch.dtype, state_dtype: str, kernels_choice: str) -> AttnLabForCausalLM:
    torch.manual_seed(0)
    config = AttnLabConfig(vocab_size=259, hidden_size=1024, num_layers=4, num_heads=16, mixer="2mamba",
                           kernels=kernels_choice, mixer_options={"state_dtype": state_dtype})
    return AttnLabForCausalLM(config).to(dtype).eval()


@torch.no_grad()
def logits_per_step(net, prompt: torch.Tensor, fed: torch.Tensor) -> list[torch.Tensor]:
    out = net(input_ids=prompt, use_cache=True)
    cache, steps = out.past_key_values, [out.logits[:, -1].float()]
    for i in range(fed.shape[1]):
        out = net(input_ids=fed[:, i:i + 1], cache=cache, use_cache=True)
        cache = out.past_key_values
        steps.append(out.logits[:, -1].float())
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(1)
    prompt, fed = torch.randint(0, 259, (2, 256)), torch.randint(0, 259, (2, args.steps))
    reference = logits_per_step(model(torch.float32, "float32", "torch"), prompt, fed)
    rows = {}
    original = kernels.attention_family_step_fn
    for windowed in (False, True):
        for state_dtype in ("float32", "bfloat16"):
            if windowed:  # the mixer's fast path (window buffers, the decay formed in the step) on the reference
                kernels.attention_family_step_fn = lambda choice, x: reference_step_
            steps = logits_per_step(model(torch.bfloat16, state_dtype, "auto"), prompt, fed)
            kernels.attention_family_step_fn = original
            errors = [((a - b).norm() / b.norm()).item() for a, b in zip(steps, reference)]
            agree = sum((a.argmax(-1) == b.argmax(-1)).float().mean().item() for a, b in zip(steps, reference)) / len(steps)
            name = f"{'windowed' if windowed else 'rewritten'} {state_dtype}"
            rows[name] = {"last_rel_err": errors[-1], "max_rel_err": max(errors), "greedy_agreement": agree}
            print(f"{name:20s} last {errors[-1]:.2e}  max {max(errors):.2e}  greedy agrees {agree:.1%}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"steps": args.steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
