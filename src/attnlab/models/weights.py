"""Where a model's weights live: what a captured CUDA graph reads, decoding's (attnlab.generation.graphs)
and the training step's (attnlab.train.graphs) alike."""

from __future__ import annotations

import itertools


def weights_fingerprint(model) -> tuple:
    """Where every weight and buffer lives: a captured graph reads those addresses, so any change
    (a move, a cast, a reload that replaces tensors, an adapter added) calls for a new capture."""
    # an FSDP parameter (a DTensor) lives where its local shard does
    return tuple((local_part(t).data_ptr(), t.dtype, t.device, tuple(t.shape))
                 for t in itertools.chain(model.parameters(), model.buffers()))


def local_part(t):
    """This process's part of a tensor: a DTensor's local shard (an FSDP parameter or gradient), else the tensor."""
    return getattr(t, "_local_tensor", t)  # read directly: DTensor.to_local() is an autograd call, 5 us a tensor
