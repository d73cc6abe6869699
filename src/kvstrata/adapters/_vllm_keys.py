"""How the vLLM connector keys a request's blocks: a chain of hashes from the namespace root
over the token ids (vLLM's block size), with a block's extra keys (LoRA, multimodal inputs,
prompt embeddings) mixed into its link as vLLM's own block hashes do, and a request's own key
for a state checkpoint only that request may read (``_vllm_checkpoints`` says which).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any

from kvstrata.adapters._vllm_layout import STATE, GroupLayout
from kvstrata.engine_kit import hash_pages

#: BLAKE2b personalisation of a chain link that mixes a block's extra keys into its parent hash
_EXTRA_PERSON = b"kvs-vllm-extra"
#: BLAKE2b personalisation of a request's own key for a checkpoint a decode step left
_DECODE_PERSON = b"kvs-vllm-decode"

ExtraKeys = Callable[[Any, int, int], tuple[Any, ...] | None]


def vllm_extra_keys() -> ExtraKeys | None:
    """A block's extra keys as vLLM's own prefix cache has them (LoRA name and path, multimodal
    item hashes and offsets, a hash of prompt embeddings), or None where this vLLM does not
    offer the function: then requests that carry any are neither looked up nor saved. The
    cache salt vLLM adds to the first block is left out: it is in the chain's root already."""
    try:
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
    except ImportError:  # another vLLM: refuse what cannot be keyed, never serve it unkeyed
        return None

    def extra_keys(request: Any, start: int, end: int) -> tuple[Any, ...] | None:
        keys, _ = generate_block_hash_extra_keys(request, start, end, 0)
        kept = tuple(key for key in keys or () if not (isinstance(key, tuple) and key[:1] == ("cache_salt",)))
        return kept or None

    return extra_keys


def has_extra_keys(request: Any) -> bool:
    """Whether a request's KV depends on more than its token ids and salt: a LoRA adapter,
    multimodal inputs (their placeholder ids are alike for different images) or prompt
    embeddings (their token ids are placeholders)."""
    return bool(
        getattr(request, "lora_request", None)
        or getattr(request, "mm_features", None)
        or getattr(request, "prompt_embeds", None) is not None
    )


def mixed_parent(parent: str, extras: tuple[Any, ...]) -> str:
    """``parent`` (a chain hash) with a block's extra keys mixed in: the block's hash then differs
    from the same tokens' without them, or with others. ``repr`` of vLLM's keys (str, int, bytes
    tuples) is the same in every process."""
    raw = bytes.fromhex(parent)
    digest = hashlib.blake2b(raw, digest_size=len(raw), person=_EXTRA_PERSON)
    digest.update(repr(extras).encode())
    return digest.hexdigest()


def extend_chain(
    hashes: list[str], root: str, request: Any, blocks: int, block_size: int, extra_keys: ExtraKeys | None
) -> None:
    """Extend ``hashes`` (the chain of ``request``'s first blocks from ``root``) to ``blocks``
    blocks; with ``extra_keys``, each block's are mixed into its link: token ids alone would
    serve another adapter's, image's or embedding's KV."""
    have, bs, tokens = len(hashes), block_size, request.all_token_ids
    if extra_keys is None:
        parent = hashes[-1] if have else root
        hashes.extend(hash_pages(list(tokens[have * bs : blocks * bs]), bs, parent))
        return
    for block in range(have, blocks):
        parent = hashes[-1] if block else root
        extras = extra_keys(request, block * bs, (block + 1) * bs)
        if extras:
            parent = mixed_parent(parent, extras)
        hashes.extend(hash_pages(list(tokens[block * bs : (block + 1) * bs]), bs, parent))


def private_key(block_hash: str, owner: str) -> str:
    """The key of a request's decode-time checkpoint of block ``block_hash`` (``owner``: the
    request, as one scheduler instance knows it)."""
    raw = bytes.fromhex(block_hash)
    digest = hashlib.blake2b(raw, digest_size=len(raw), person=_DECODE_PERSON)
    digest.update(owner.encode())
    return digest.hexdigest()


def object_keys(
    group: GroupLayout, hashes: list[str], indices: Iterable[int], decode_states: set[int], owner: str
) -> list[str]:
    """Object keys of ``group``'s blocks ``indices``: the chain hashes, but the request's own key
    for a state checkpoint it stored from a decode step (block indices ``decode_states``)."""
    if group.kind != STATE or not decode_states:
        return [hashes[i] for i in indices]
    return [private_key(hashes[i], owner) if i in decode_states else hashes[i] for i in indices]
