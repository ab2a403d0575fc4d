"""Prefix affinity keys: what a request is routed by. The router ranks replicas by them
(``router.load_ledger``) and a decoder request carries them (``decoder.messages``), so
they live here, below both."""

from __future__ import annotations

from collections.abc import Sequence

PREFIX_LENGTHS = (16, 32, 64, 128, 256, 512, 1024)


def prefix_keys(token_ids: Sequence[int]) -> list[int]:
    """Hashes of the prompt's prefixes at ``PREFIX_LENGTHS`` (longest first)."""
    return [hash(tuple(token_ids[:n])) for n in reversed(PREFIX_LENGTHS) if n <= len(token_ids)]


def affinity_keys(token_ids: Sequence[int], deterministic: bool) -> list[int]:
    """What a request is routed by: its prefixes when it is deterministic (its lane KV
    may be reusable where it went before), nothing otherwise."""
    return prefix_keys(token_ids) if deterministic else []
