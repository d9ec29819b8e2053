"""The KV cache's size on each rank, in tokens: from what the plan leaves free (a fraction of it,
or a quantity of bytes; a GPU's default is 0.9 of it), or, on a CPU whose spec says neither,
maxBatchSize sequences of maxModelLen tokens. Pure.

The tokens are what the worker's paged cache gives sequences: whole blocks (a sequence takes
`kv_whole_blocks(length)` positions), and its pool also holds the reserved blocks no sequence uses
(`kv_pool_tokens`), which the bytes count (shard_contract.sharding owns both rules).

Every rank of a group holds the keys and values of the same tokens (its layers' share and its KV
heads' share of each), so the rank that can hold the fewest bounds the group: two small GPUs are
not one big one. A layout fits only if every rank holds at least one whole sequence (maxModelLen
tokens); vLLM refuses to start on less, for the same reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from shard_contract.sharding import KV_BLOCK_SIZE, kv_pool_tokens, kv_sequence_tokens, kv_whole_blocks
from shard_contract.units import count

from ..api import DEFAULT_GPU_FRACTION
from .request import Request


@dataclass(frozen=True)
class KvPolicy:
    """How one kind of rank sizes its KV cache. `reserve`: maxBatchSize x maxModelLen tokens;
    `fraction`: that share of its free memory; `bytes`: that many bytes."""

    mode: Literal["reserve", "fraction", "bytes"]
    fraction: float = 1.0
    bytes: int = 0


def kv_policy(request: Request, kind: str) -> KvPolicy:
    """The spec's choice, else the default of this kind of device: 0.9 of a GPU's free memory; a
    CPU's cache reserved for maxBatchSize sequences (its memory is the host's, shared with the page
    cache and everything else, so it takes only what is asked)."""
    if request.kv_bytes is not None:
        return KvPolicy("bytes", bytes=request.kv_bytes)
    if request.kv_fraction is not None:
        return KvPolicy("fraction", fraction=request.kv_fraction)
    if kind == "gpu":
        return KvPolicy("fraction", fraction=DEFAULT_GPU_FRACTION)
    return KvPolicy("reserve")


def sequence_tokens(request: Request) -> int:
    """What one sequence of maxModelLen tokens takes of the cache: whole blocks."""
    return kv_whole_blocks(request.max_len)


def reserved_tokens(request: Request) -> int:
    """maxBatchSize sequences at their longest (the contract's `Plan.reserved_tokens`)."""
    return request.batch * sequence_tokens(request)


def fit_tokens(policy: KvPolicy, request: Request) -> int:
    """Positions each layer's pool must have room for, for a layout to fit (the reserved blocks
    with the sequences'): the reservation, or one whole sequence in the share of the free memory
    the cache may take (`bytes`: none, its quantity is fixed; `max_layers` bounds it instead)."""
    if policy.mode == "reserve":
        return kv_pool_tokens(reserved_tokens(request))
    if policy.mode == "fraction":
        return math.ceil(kv_pool_tokens(sequence_tokens(request)) / policy.fraction)
    return 0


def fixed_bytes(policy: KvPolicy) -> int:
    """What the cache takes whatever the rank's layers: the quantity asked for."""
    return policy.bytes if policy.mode == "bytes" else 0


def max_layers(policy: KvPolicy, layer_token_bytes: int, request: Request, mask_token_bytes: int = 0) -> int | None:
    """The most layers whose cache of one whole sequence the quantity holds, beside the block
    masks over it (`mask_token_bytes` a position; None: no bound)."""
    if policy.mode != "bytes" or layer_token_bytes <= 0:
        return None
    pool = kv_pool_tokens(sequence_tokens(request))
    return max(policy.bytes - mask_token_bytes * pool, 0) // (layer_token_bytes * pool)


def rank_tokens(policy: KvPolicy, free: int, per_token: int, request: Request) -> int:
    """Tokens a rank's cache holds for sequences (whole blocks): `free` is its usable memory less
    its weights, activations, overhead and staging; `per_token` its bytes of one token's KV and of
    the block masks over it (`sizing.mask_token_bytes`). Its pool (these and the reserved blocks,
    `kv_pool_tokens`) is the share of `free` the policy gives in whole blocks: a quantity rounded
    down (it is a cap), a fraction rounded up where `free` holds the block (so the cache holds at
    least the fraction asked for; a reservation is what `fit_tokens` made room for)."""
    if policy.mode == "reserve" or per_token <= 0:
        return reserved_tokens(request)
    if policy.mode == "bytes":
        return kv_sequence_tokens(max(policy.bytes, 0) // per_token)
    free = max(free, 0)
    pool = kv_whole_blocks(math.ceil(policy.fraction * free / per_token))
    if pool * per_token > free:
        pool -= KV_BLOCK_SIZE
    return kv_sequence_tokens(pool)


def describe_need(policy: KvPolicy, request: Request) -> str:
    """What a layout's KV cache must hold, in the words of an explanation: 'KV cache for ...'."""
    if policy.mode == "reserve":
        return f"{request.max_len} tokens x {count(request.batch, 'sequence')}"
    if policy.mode == "fraction":
        return (f"one sequence of {request.max_len} tokens in {policy.fraction:g} of the memory left free "
                f"(kvCacheMemoryFraction)")
    return f"one sequence of {request.max_len} tokens"
