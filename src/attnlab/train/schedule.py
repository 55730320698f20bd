"""The learning-rate schedules of `train.schedule`, as transformers' schedulers, and the rate at any step.

cosine   warmup, then a cosine down to 10% of train.lr at train.max_steps
linear   warmup, then a straight line down to 0 at train.max_steps
constant warmup, then train.lr for ever
wsd      warmup, train.lr (stable), then a straight line to 0 over the last train.decay_fraction of the steps

cosine and linear are functions of max_steps at every step: resuming with a larger train.max_steps
re-stretches them and the rate jumps. constant, and wsd resumed before its decay began, extend a run
without changing the rate it had (preflight says which happens).
"""

from __future__ import annotations


def decay_steps(t) -> int:
    return max(1, round(t.decay_fraction * t.max_steps))


def scheduler_spec(t) -> tuple[str, dict]:
    """(transformers scheduler name, its kwargs) for a TrainSection."""
    if t.schedule == "cosine":
        return "cosine_with_min_lr", {"min_lr_rate": 0.1}
    if t.schedule == "linear":
        return "linear", {}
    if t.schedule == "constant":
        return "constant_with_warmup", {}
    if t.schedule == "wsd":
        return "warmup_stable_decay", {"num_decay_steps": decay_steps(t), "decay_type": "linear", "min_lr_ratio": 0.0}
    raise ValueError(f"unknown train.schedule {t.schedule!r}")


def lr_at(t, step: int) -> float:
    """The learning rate the optimizer uses for the update after `step` steps (transformers' own scheduler)."""
    import torch
    from transformers import get_scheduler

    name, kwargs = scheduler_spec(t)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=t.lr)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=t.max_steps,
                              scheduler_specific_kwargs=kwargs)
    return t.lr * scheduler.lr_lambdas[0](step)


def resume_lr_note(old, new, step: int) -> str | None:
    """What resuming at `step` with the TrainSection `new` (instead of `old`, the one the checkpoint was written
    with) does to the learning rate; None when nothing that shapes the schedule changed."""
    keys = ("max_steps", "schedule", "lr", "warmup_steps", "decay_fraction")
    changed = [k for k in keys if getattr(old, k) != getattr(new, k)]
    if not changed:
        return None
    before, after = lr_at(old, step), lr_at(new, step)
    what = ", ".join(f"train.{k} {getattr(old, k)} -> {getattr(new, k)}" for k in changed)
    if abs(after - before) <= 1e-12 + 1e-6 * abs(before):
        return f"{what}: the learning rate at the resume step {step} stays {after:.3g} (the schedule extends cleanly)"
    hint = "" if new.schedule in ("constant", "wsd") else \
        " train.schedule=wsd (warmup, stable, decay) or constant extends a run without changing its rate."
    return (f"{what}: the learning rate at the resume step {step} goes from {before:.3g} to {after:.3g} "
            f"({new.schedule} schedule re-shaped by the new settings).{hint}")
