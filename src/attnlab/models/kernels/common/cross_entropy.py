"""Token cross-entropy on fla's fused kernel (`fla.modules.FusedCrossEntropyLoss`), which computes the loss
without fp32 copies of the logits. The PyTorch reference is `torch.nn.functional.cross_entropy`, which
`attnlab.models.modeling` runs where fla does not."""

from __future__ import annotations


def cross_entropy(logits, labels, ignore_index: int = -100, reduction: str = "mean"):
    """Token cross-entropy over [N, V] logits without materialising fp32 copies."""
    from fla.modules import FusedCrossEntropyLoss

    return FusedCrossEntropyLoss(ignore_index=ignore_index, reduction=reduction)(logits, labels)
