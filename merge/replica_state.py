"""The replica's pure helpers (merge.replica): its applied set checked as a state_dict holds
it, and the settled point of params with their momentum played out."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from merge.fragments import FragmentLayout


def parse_applied(applied: object) -> dict[str, set[int]]:
    """A state_dict's applied set, checked (ValueError): authors to distinct seqs >= 0."""
    if not isinstance(applied, Mapping):
        raise ValueError("replica state 'applied' must map authors to lists of seqs.")
    parsed: dict[str, set[int]] = {}
    for author, seqs in applied.items():
        if not isinstance(author, str) or not isinstance(seqs, list | tuple):
            raise ValueError("replica state 'applied' must map authors to lists of seqs.")
        if not all(type(seq) is int and seq >= 0 for seq in seqs) or len(set(seqs)) != len(seqs):
            raise ValueError(f"replica state 'applied' has invalid seqs for {author}.")
        parsed[author] = set(seqs)
    return parsed


def settled(
    params: torch.Tensor,
    terms: list[list[tuple[float, torch.Tensor]]],
    layout: FragmentLayout | None,
    index: torch.Tensor,
) -> torch.Tensor:
    values = params.reshape(-1)[index].to(torch.float64)
    if layout is None:
        for coefficient, buffer in terms[0]:
            values += coefficient * buffer[index].to(torch.float64)
        return values
    fragment, local = layout.locate(index)
    for p, fragment_terms in enumerate(terms):
        mask = fragment == p
        for coefficient, buffer in fragment_terms:
            values[mask] += coefficient * buffer[local[mask]].to(torch.float64)
    return values
