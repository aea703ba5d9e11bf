"""Paged KV-cache blocks: allocation, freeing, and prefix caching keyed by adapter version.

A block is ``block_size`` token slots of the KV cache. Each sequence owns a block table (the
blocks holding its tokens in order). With prefix caching, a *full* block is also known by a
key: its parent's key, its token ids and the adapter key (adapter name and weights digest, or
none for the bare base). KV depends on all three: the same system prompt under two adapters, or
under one adapter name reloaded with new weights, produces different keys and never shares
blocks. The key also holds the sequence's cache scope (its tenant and ``cache_salt``): KV would
be the same, but a hit is visible (cached tokens, time to first token), so sharing across
tenants would tell one tenant what another has sent. A freed block keeps its key and contents
until the block is handed out again, oldest freed first, so a prompt that returns soon finds its
prefix still cached.

Torch-free on purpose: block accounting is plain bookkeeping that the scheduler tests drive
without a model.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from loraplane.serving.engine.sequence import Sequence

BlockKey = tuple[int, str | None, str | None, tuple[int, ...]]


class OutOfBlocks(RuntimeError):
    pass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    key: BlockKey | None = None

    @property
    def key_hash(self) -> int | None:
        return None if self.key is None else hash(self.key)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # key hash -> block id
        self.hashes: dict[int, list[int]] = {}  # seq id -> key hashes of its full, registered blocks
        self.prefix_hits = 0
        self.prefix_queries = 0
        # Unified paging: adapters borrow pages from the same free list, and when KV runs short
        # the engine may give some back by evicting idle adapters (``reclaim(n)`` frees up to n).
        self.reclaim: Callable[[int], None] | None = None
        self.adapter_pages = 0

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self) -> Block:
        if not self.free_blocks:
            raise OutOfBlocks("no free KV blocks")
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.key is not None:
            h = block.key_hash
            if h is not None and self.cached.get(h) == block_id:
                del self.cached[h]
            block.key = None
        block.ref_count = 1
        return block

    def _key(self, parent: int, seq: Sequence, index: int) -> BlockKey:
        tokens = tuple(seq.tokens(index * self.block_size, (index + 1) * self.block_size))
        return (parent, seq.adapter_key, seq.cache_scope, tokens)

    def _prefix_hits(self, seq: Sequence) -> list[Block]:
        """Cached blocks that hold this sequence's leading full blocks. The last token is always
        left to compute, because its logits are what the step samples from; and every token of a
        sequence that asks for its prompt's log-probabilities, which come from computed rows."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        hits: list[Block] = []
        parent = 0
        for index in range((len(seq) - 1) // self.block_size):
            key = self._key(parent, seq, index)
            block_id = self.cached.get(hash(key))
            if block_id is None or self.blocks[block_id].key != key:
                break
            hits.append(self.blocks[block_id])
            parent = hash(key)
        return hits

    def allocate(self, seq: Sequence) -> bool:
        """Blocks for all of ``seq``'s current tokens, reusing cached prefix blocks. False (and no
        change) when the free blocks do not suffice."""
        assert not seq.block_table, "sequence already holds blocks"
        hits = self._prefix_hits(seq)
        fresh = self.blocks_needed(len(seq)) - len(hits)
        reclaimed = sum(1 for b in hits if b.ref_count == 0)
        if not self._room(fresh + reclaimed):
            return False
        for block in hits:
            if block.ref_count == 0:
                del self.free_blocks[block.block_id]
            block.ref_count += 1
        table = [b.block_id for b in hits] + [self._take().block_id for _ in range(fresh)]
        seq.block_table = table
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        self.hashes[seq.seq_id] = [hash(b.key) for b in hits]
        self.prefix_queries += (len(seq) - 1) // self.block_size
        self.prefix_hits += len(hits)
        return True

    def append_slots(self, seq: Sequence, num_new: int) -> bool:
        """Make room for ``num_new`` more computed tokens; False (and no change) when out of blocks."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new) - len(seq.block_table)
        if not self._room(needed):
            return False
        seq.block_table.extend(self._take().block_id for _ in range(max(needed, 0)))
        return True

    def _room(self, needed: int) -> bool:
        if needed > self.num_free and self.reclaim is not None:
            self.reclaim(needed - self.num_free)
        return needed <= self.num_free

    def take_pages(self, n: int) -> list[int] | None:
        """``n`` pages for an adapter's weights, or None (and nothing taken) if they are not free."""
        if n > self.num_free:
            return None
        self.adapter_pages += n
        return [self._take().block_id for _ in range(n)]

    def return_pages(self, pages: list[int]) -> None:
        for block_id in pages:
            self.blocks[block_id].ref_count = 0
            self.free_blocks[block_id] = None
        self.adapter_pages -= len(pages)

    def register_full_blocks(self, seq: Sequence, upto: int | None = None) -> None:
        """Give every newly completed block of computed tokens its key, so later sequences can
        share it; only blocks before token ``upto`` when given (async scheduling: a token still
        in flight has no value to key a block by yet)."""
        if not self.enable_prefix_caching:
            return
        hashes = self.hashes.setdefault(seq.seq_id, [])
        computed = seq.num_computed_tokens if upto is None else min(upto, seq.num_computed_tokens)
        full = computed // self.block_size
        for index in range(len(hashes), full):
            key = self._key(hashes[-1] if hashes else 0, seq, index)
            block = self.blocks[seq.block_table[index]]
            h = hash(key)
            if block.key is None:
                block.key = key
                self.cached.setdefault(h, block.block_id)
            hashes.append(h)

    def free(self, seq: Sequence) -> None:
        # Release the tail first, so the free list hands out a sequence's last blocks before its
        # first ones: a shared prefix stays cached the longest.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
        seq.block_table = []
        self.hashes.pop(seq.seq_id, None)
