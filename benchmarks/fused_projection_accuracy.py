"""How far the bf16 decode step strays from fp32 arithmetic on the same weights, with the input projections
separate (`plain`) and fused as the engine runs them (`fused`): logits and recurrent states, over several seeds.
Run on a GPU with fla: `python benchmarks/fused_projection_accuracy.py` (tests/test_kernels_cuda.py holds the bounds)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_kernels_cuda import bf16_fla_model_and_prompts, decode_step_paths, rel_err  # noqa: E402

print(f"{'seed':>4s} {'what':>10s} {'plain':>9s} {'fused':>9s} {'fused-plain':>12s}")
for seed in range(5):
    torch.manual_seed(seed)
    model, ids = bf16_fla_model_and_prompts(seed)
    paths = decode_step_paths(model, ids)
    for key in ("logits", "prefill", "states"):
        pick = (lambda n: [paths[n][key]]) if key == "logits" else (lambda n: paths[n][key])
        for layer, exact in enumerate(pick("exact")):
            plain, fused = (rel_err(pick(n)[layer], exact) for n in ("plain", "fused"))
            between = rel_err(pick("fused")[layer], pick("plain")[layer])
            print(f"{seed:>4d} {key + ('' if key == 'logits' else str(layer)):>10s} {plain:>9.2e} {fused:>9.2e} {between:>12.2e}")
