"""The rank function of ``tests/test_fake_ranks.py``'s "what breaks first": each rank of one run builds and
runs the Llama-70B-shaped model of :mod:`rank_steps` in one of its ways, on its first layers."""

from __future__ import annotations

from rank_steps import WHAT_BREAKS_FIRST, _llama_70b

from pytest_gpumem import RankContext


def llama_70b_ways(runs: tuple[tuple[str, int], ...], rank: int, ctx: RankContext) -> None:
    """Rank ``r`` runs ``runs[r]``: a way of :data:`rank_steps.WHAT_BREAKS_FIRST` and how many decoder
    layers (``functools.partial(llama_70b_ways, runs)`` is the rank function)."""
    way, layers = runs[rank]
    _llama_70b(ctx, **WHAT_BREAKS_FIRST[way], layers=layers)
