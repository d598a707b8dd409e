"""The options of one call, parsed once by the public functions and handed down as they are."""

from __future__ import annotations

from typing import NamedTuple

from .. import dropout as dropout_rng


class AttentionOptions(NamedTuple):
    """Checked options of an attention call (softmax_scale as given: its default needs the head dim)."""

    softmax_scale: object = None
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    deterministic: bool = False
    dropout: dropout_rng.DropoutSpec = dropout_rng.NO_DROPOUT


def resolve_dropout(dropout_p, dropout_seed, dropout_offset, draw_seed: bool,
                    rng_state=None) -> dropout_rng.DropoutSpec:
    """The checked DropoutSpec of a call. Without a seed, draw_seed picks a fresh one (the autograd
    entry points, which keep it for the backward); the explicit forward/backward functions need a
    seed or a device rng_state (int64 (seed, offset), as torch's generator fills it)."""
    p = dropout_rng.check_dropout(dropout_p)
    if p == 0.0:
        return dropout_rng.NO_DROPOUT
    if rng_state is not None:
        if dropout_seed is not None:
            raise ValueError("dropout_seed: expected None when dropout_rng_state is given (the kernels read "
                             f"the seed from it), got {dropout_seed!r}")
        return dropout_rng.DropoutSpec(p, 0, 0, rng_state)
    if dropout_seed is None:
        if not draw_seed:
            raise ValueError("dropout_seed: expected an int with dropout_p > 0 (the backward must regenerate "
                             "the forward's mask), got None")
        dropout_seed = dropout_rng.new_seed()
    seed = dropout_rng.check_seed("dropout_seed", dropout_seed)
    offset = dropout_rng.check_seed("dropout_offset", dropout_offset)
    return dropout_rng.DropoutSpec(p, seed, offset)


def dropout_source(dropout: dropout_rng.DropoutSpec) -> dict:
    """The keyword arguments that hand a resolved spec's seed (or device rng_state) on."""
    if dropout.p == 0:
        return {}
    if dropout.rng_state is not None:
        return {"dropout_rng_state": dropout.rng_state}
    return {"dropout_seed": dropout.seed, "dropout_offset": dropout.offset}


__all__ = ["AttentionOptions", "dropout_source", "resolve_dropout"]
