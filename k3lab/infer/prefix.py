r"""A prefix cache for the hybrid model: KDA states and MLA latent pages per block of prompt tokens.

Requests that share a prompt prefix (a system prompt, a document, earlier turns of a chat) need not
prefill it again. For attention-only models a prefix cache keeps KV pages; a KDA layer has no pages
— its state after ``n`` tokens summarises all of them — so the cache keeps **snapshots**:

* the prompt is cut into blocks of ``block_tokens`` tokens; at every block boundary ``b·N`` the
  prefill leaves an entry holding each KDA layer's state ``[1, H, K, V]`` and conv tails at that
  boundary, and each MLA layer's latent **page** ``[c_kv ; k_rope]`` of the block's ``N`` tokens;
* entries form a tree: block ``b`` is keyed by its parent entry and its own ``N`` token ids (exact:
  no hash collisions), so two prompts share entries exactly as far as they share whole blocks;
* a request resumes from its longest cached block ``m`` (at most ``len − 1`` tokens, so the last
  token's logits are computed): the KDA states of entry ``m`` and the MLA pages ``1..m`` concatenated
  — the cache a cold prefill would have at ``m·N`` — and prefills the rest (logits equal a cold run
  to fp32 rounding; tested at 1e-5);
* an entry's KDA snapshot and its MLA pages live and die together (one entry); resuming at block
  ``m`` needs entries ``1..m``, so the LRU order keeps every ancestor more recent than its
  descendants (a hit or an insert touches the chain leaf to root) and eviction always takes a leaf;
* a byte budget ``max_bytes`` for the device tier; over it the least recently used entries move to
  the host tier (``host_max_bytes``, CPU memory) when there is one, else are dropped; the host tier
  drops its own LRU entries over its budget; a hit on a host entry brings it back.

Stats (:meth:`PrefixCache.stats`): token hit rate (prompt tokens served / looked up), request hit
rate, bytes per tier, evictions, and the time saved — the recorded compute time of every reused
block (each entry remembers how long its block took to prefill).

The saving is largest for KDA: a snapshot is ``H·K·V`` floats however long the prefix, where an
attention layer's page set grows with it.
"""

from __future__ import annotations

import numbers
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from k3lab.backend import synchronize
from k3lab.infer import cache as hcache
from k3lab.infer.step import DEFAULT_CHUNK_TOKENS, Prefilled, check_prompt_context, model_device, prefill_rows
from k3lab.mixers.kda import KDACache
from k3lab.mixers.mla import MLACache
from k3lab.model import K3Cache

Tensor = torch.Tensor


def _nbytes(entry_layers) -> int:
    total = 0
    for e in entry_layers:
        for t in vars(e).values():
            if isinstance(t, Tensor):
                total += t.numel() * t.element_size()
    return total


@dataclass
class _Entry:
    id: int
    key: tuple  # (parent id or -1, the block's token ids)
    parent: int | None
    depth: int  # block index b >= 1: the entry is the cache after tokens [0, b·N)
    layers: list  # per decoder layer: KDACache (state at the boundary) or MLACache (this block's page)
    nbytes: int
    compute_s: float
    tier: str = "device"
    children: set = field(default_factory=set)
    hits: int = 0


class PrefixCache:
    """Block-wise prefix cache for one model (see the module docstring).

    model: the K3ForCausalLM whose caches are stored; block_tokens: N; max_bytes: device-tier budget;
    host_max_bytes: host-tier budget (0: no host tier); host_device: where the host tier lives.
    """

    def __init__(self, model, block_tokens: int = 64, max_bytes: int = 256 << 20, host_max_bytes: int = 0,
                 host_device: str | torch.device = "cpu"):
        hcache.check_model(model)
        for name, value, low in (("block_tokens", block_tokens, 1), ("max_bytes", max_bytes, 1),
                                 ("host_max_bytes", host_max_bytes, 0)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                raise ValueError(f"{name}={value!r}: must be an integer >= {low}")
        self.model = model
        self.block_tokens = int(block_tokens)
        self.max_bytes, self.host_max_bytes = int(max_bytes), int(host_max_bytes)
        self.host_device = torch.device(host_device)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._index: dict[tuple, int] = {}
        self._next_id = 0
        self.bytes = {"device": 0, "host": 0}
        self.counters = dict(requests=0, hit_requests=0, lookup_tokens=0, hit_tokens=0,
                             inserted=0, to_host=0, from_host=0, dropped=0, skipped=0)

    # --- bookkeeping ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict:
        """Counters plus rates and bytes: token_hit_rate = hit_tokens / lookup_tokens, request_hit_rate."""
        c = dict(self.counters)
        c["token_hit_rate"] = c["hit_tokens"] / c["lookup_tokens"] if c["lookup_tokens"] else 0.0
        c["request_hit_rate"] = c["hit_requests"] / c["requests"] if c["requests"] else 0.0
        c.update(entries=len(self._entries), device_bytes=self.bytes["device"], host_bytes=self.bytes["host"])
        return c

    def _chain(self, entry_id: int) -> list[_Entry]:
        """Entries from the root block to ``entry_id``."""
        chain = []
        while entry_id is not None:
            e = self._entries[entry_id]
            chain.append(e)
            entry_id = e.parent
        return chain[::-1]

    def _touch(self, chain: list[_Entry]) -> None:
        for e in reversed(chain):  # leaf first: the root ends most recent
            self._entries.move_to_end(e.id)

    def _move(self, e: _Entry, tier: str) -> None:
        device = model_device(self.model) if tier == "device" else self.host_device
        e.layers = [type(x)(*(None if t is None else t.to(device) for t in vars(x).values())) for x in e.layers]
        self.bytes[e.tier] -= e.nbytes
        self.bytes[tier] += e.nbytes
        e.tier = tier

    def _drop(self, e: _Entry) -> None:
        for child in list(e.children):
            self._drop(self._entries[child])
        del self._entries[e.id]
        del self._index[e.key]
        self.bytes[e.tier] -= e.nbytes
        if e.parent is not None and e.parent in self._entries:
            self._entries[e.parent].children.discard(e.id)
        self.counters["dropped"] += 1

    def _enforce(self) -> None:
        """Evict LRU entries until both tiers fit their budgets (device -> host -> dropped)."""
        while self.bytes["device"] > self.max_bytes:
            e = next(x for x in self._entries.values() if x.tier == "device")
            if self.host_max_bytes and e.nbytes <= self.host_max_bytes:
                self._move(e, "host")
                self.counters["to_host"] += 1
            else:
                self._drop(e)
        while self.bytes["host"] > self.host_max_bytes:
            self._drop(next(x for x in self._entries.values() if x.tier == "host"))

    # --- lookup / insert ---------------------------------------------------------------------------
    def lookup(self, tokens: list[int], max_tokens: int | None = None) -> tuple[K3Cache | None, int]:
        """The cache after the longest cached block prefix of ``tokens`` of at most ``max_tokens`` tokens,
        and its length (``(None, 0)`` on a miss). Counts a request; promotes host entries to the device.

        The returned cache is the caller's own: every tensor in it is a copy, so writing into it in place
        changes nothing stored (tested). The cost is one copy of the KDA states and conv tails per hit
        (``H·K·V`` floats a KDA layer, independent of the prefix length) on top of the MLA pages, which
        are concatenated into new memory anyway."""
        N = self.block_tokens
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        parent, chain = -1, []
        for b in range(limit // N):
            entry_id = self._index.get((parent, tuple(tokens[b * N:(b + 1) * N])))
            if entry_id is None:
                break
            chain.append(self._entries[entry_id])
            parent = entry_id
        self.counters["requests"] += 1
        self.counters["lookup_tokens"] += limit
        if not chain:
            return None, 0
        for e in chain:
            e.hits += 1
            if e.tier == "host":
                self._move(e, "device")
                self.counters["from_host"] += 1
        self._touch(chain)
        hit = len(chain) * N
        self.counters["hit_requests"] += 1
        self.counters["hit_tokens"] += hit
        leaf = chain[-1]
        layers = []
        for i, x in enumerate(leaf.layers):
            if isinstance(x, KDACache):  # a copy: the store must not share memory with a caller's cache
                layers.append(KDACache(*(None if t is None else t.clone() for t in vars(x).values())))
            else:
                pages = [e.layers[i] for e in chain]
                layers.append(MLACache(torch.cat([p.c_kv for p in pages], 1), torch.cat([p.k_rope for p in pages], 1)))
        cache = K3Cache(layers, hit)
        self._enforce()  # promotions may have pushed the device tier over its budget
        return cache, hit

    def insert(self, parent: int | None, block: tuple, depth: int, cache: K3Cache, compute_s: float) -> int | None:
        """Store the snapshot after block ``depth`` (token ids ``block``) under ``parent`` (an entry id, or
        None for the first block); ``cache`` is the one-row cache at ``depth·N``. Returns the entry id
        (the existing one if present; None if the parent is gone or the entry exceeds the budget)."""
        key = (-1 if parent is None else parent, tuple(block))
        if key in self._index:
            self._touch(self._chain(self._index[key]))
            return self._index[key]
        if parent is not None and parent not in self._entries:
            self.counters["skipped"] += 1
            return None
        N = self.block_tokens
        lo, hi = (depth - 1) * N, depth * N
        layers = []
        for x in cache.layers:
            if isinstance(x, KDACache):
                layers.append(KDACache(*(t.clone() for t in (x.recurrent, x.conv_q, x.conv_k, x.conv_v))))
            else:
                if x.key_mask is not None:
                    raise ValueError("PrefixCache.insert: a padded (masked) cache cannot be snapshotted")
                layers.append(MLACache(x.c_kv[:, lo:hi].clone(), x.k_rope[:, lo:hi].clone()))
        nbytes = _nbytes(layers)
        if nbytes > self.max_bytes:
            self.counters["skipped"] += 1
            return None
        e = _Entry(self._next_id, key, parent, depth, layers, nbytes, compute_s)
        self._next_id += 1
        self._entries[e.id] = e
        self._index[key] = e.id
        self.bytes["device"] += nbytes
        if parent is not None:
            self._entries[parent].children.add(e.id)
        self._touch(self._chain(e.id))
        self.counters["inserted"] += 1
        self._enforce()
        return e.id if e.id in self._entries else None

    @torch.no_grad()
    def prefill(self, tokens: list[int], chunk_size: int = DEFAULT_CHUNK_TOKENS,
                allow_longer: bool = False) -> tuple[Prefilled, int]:
        """Prefill one prompt through the cache: resume from the longest hit, snapshot every block
        boundary computed. Returns (the one-row :class:`Prefilled`, tokens served from the cache).
        A prompt longer than ``config.max_position_embeddings`` is refused (ValueError naming it) unless
        ``allow_longer``, before any lookup."""
        check_prompt_context([tokens], self.model.config, allow_longer, names=["prompt"])
        N, model = self.block_tokens, self.model
        cache, hit = self.lookup(tokens, max_tokens=len(tokens) - 1)
        parent = None
        if hit:
            parent = self._index_of(tokens, hit // N)
        chain = {"parent": parent}

        def on_block(end, block_cache, seconds):
            depth = end // N
            chain["parent"] = self.insert(chain["parent"], tokens[end - N:end], depth, block_cache, seconds) \
                if (chain["parent"] is not None or depth == 1) else None

        ids = torch.tensor([tokens[hit:]], dtype=torch.long, device=model_device(model))
        pre = prefill_rows(model, ids, chunk_size, cache=cache, block_tokens=N, on_block=on_block)
        pre.lengths = [len(tokens)]
        synchronize(model_device(model))
        return pre, hit

    def _index_of(self, tokens: list[int], blocks: int) -> int | None:
        parent = -1
        for b in range(blocks):
            parent = self._index.get((parent, tuple(tokens[b * self.block_tokens:(b + 1) * self.block_tokens])))
            if parent is None:
                return None
        return parent
