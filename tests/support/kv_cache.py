"""Decoding with the key/value cache against the full forward pass, for any family's model."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def decode_errors(model, tokens: np.ndarray, full: np.ndarray, pad: int = 3) -> tuple[list, object]:
    """`tokens` [2, 12] decoded by `model` with its cache: the first 8 as one prefill, then one
    token at a time, row 1 left-padded by `pad` (its tokens shifted right, the last `pad`
    dropped). Each step's largest absolute difference, per row, from `full` (the full forward
    pass's logits of `tokens`, [2, 12, vocab]) at that token's position; and the cache after the
    last step."""
    fed = tokens.copy()
    fed[1] = np.concatenate([np.full(pad, 7), tokens[1, :-pad]])  # row 1: `pad` padding slots, then its tokens
    cache = model.init_cache(2, 16, jnp.asarray([0, pad]))
    logits, cache = model.decode(jnp.asarray(fed[:, :8]), cache)
    errors = [np.abs(np.asarray(logits[0]) - full[0, 7]).max(), np.abs(np.asarray(logits[1]) - full[1, 7 - pad]).max()]
    for t in range(8, 12):
        logits, cache = model.decode(jnp.asarray(fed[:, t : t + 1]), cache)
        errors += [
            np.abs(np.asarray(logits[0]) - full[0, t]).max(),
            np.abs(np.asarray(logits[1]) - full[1, t - pad]).max(),
        ]
    return errors, cache
