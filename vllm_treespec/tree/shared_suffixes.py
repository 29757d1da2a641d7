"""Copy drafts from other requests: a bounded store of recent finished outputs.

Agents that call the same tools, pipelines over one schema, and code assistants
that write the same scaffolding repeat text *across* requests. The store keeps
recent finished outputs and, for a request's last tokens, proposes what
followed them in those outputs: the same ``CopyDraft`` continuations the
request's own history gives (``copy_drafts``), grafted into the same tree.

* **Tenants.** Outputs are filed under their tenant (any hashable key; the
  engine's is ``(cache_salt, LoRA adapter)``, and requests without a
  ``cache_salt`` reach the store only with ``cross_request_unsalted``:
  ``vllm_glue.scheduling.attach_tenants``). A lookup reads its own tenant's
  index and nothing else, so no other tenant's text is ever proposed. The
  eviction order is shared: one tenant's traffic can push another's outputs
  out sooner (how much the store holds, not what it holds, is visible).
* **Bounded memory.** At most ``max_tokens`` tokens in all, oldest output first
  out (an output longer than that keeps its last ``max_tokens``). The index
  holds at most ``per_key`` occurrences of each n-gram, the most recent. Its
  keys are the n-grams' hashes and its occurrences packed integers (a tuple
  key and a pair per occurrence took three times the memory); a lookup checks
  every occurrence against the stored tokens, so a collision of hashes never
  proposes a continuation that did not follow the match.
* **Bounded host cost.** A lookup hashes ``max_ngram - min_ngram + 1`` n-grams
  and reads at most ``per_key`` occurrences of each, whatever the store's size.
* **Ranking.** Among the continuations of the longest n-gram that matches,
  the one that followed it most often first (then the most recent), as
  SuffixDecoding ranks by frequency; a continuation that is a prefix of one
  already kept adds nothing and is dropped. Shorter n-grams fill the rest.

Pure Python (a lookup of a few n-grams is cheaper without numpy); no vLLM import.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence

from vllm_treespec.tree.copy_drafts import CopyDraft

Tenant = Hashable  # the engine's: (cache_salt, LoRA adapter)


_ID_SHIFT = 32  # occurrence = doc id << 32 | end


def ngram_key(ngram: tuple[int, ...]) -> int:
    """An n-gram's index key: Python's hash of the tuple, the same in every process
    (ints hash to themselves; only str and bytes hashes are salted per process)."""
    return hash(ngram)


class SharedSuffixes:
    def __init__(self, max_tokens: int, max_ngram: int = 4, min_ngram: int = 2,
                 length: int = 8, per_key: int = 16):
        if max_tokens < 1 or per_key < 1 or length < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"shared suffixes: max_tokens={max_tokens}, per_key={per_key}, "
                             f"length={length} must be >= 1 and min_ngram={min_ngram} <= "
                             f"max_ngram={max_ngram}")
        self.max_tokens, self.length, self.per_key = max_tokens, length, per_key
        self.min_ngram = min_ngram
        self.ngrams = range(max_ngram, min_ngram - 1, -1)  # longest first
        self._docs: OrderedDict[int, tuple[Tenant, tuple[int, ...]]] = OrderedDict()  # oldest first
        self._index: dict[Tenant, dict[int, list[int]]] = {}  # key -> occurrences
        self._next_id = 0
        self.tokens = 0            # tokens held
        self.lookups = self.hits = 0
        self.examined = 0          # occurrences read by the last lookup

    def add(self, tenant: Tenant, tokens: Sequence[int]) -> None:
        """File a finished output under ``tenant``, evicting the oldest first."""
        doc = tuple(int(t) for t in tokens[-self.max_tokens:])
        if len(doc) <= self.min_ngram:  # no n-gram with a token after it: nothing to find
            return
        while self._docs and self.tokens + len(doc) > self.max_tokens:
            self._evict()
        doc_id, self._next_id = self._next_id, self._next_id + 1
        self._docs[doc_id] = (tenant, doc)
        self.tokens += len(doc)
        index = self._index.setdefault(tenant, {})
        for key, end in self._keys(doc):
            seen = index.setdefault(key, [])
            seen.append(doc_id << _ID_SHIFT | end)
            if len(seen) > self.per_key:
                del seen[0]

    def find(self, tenant: Tenant, history: Sequence[int],
             max_branches: int) -> list[CopyDraft]:
        """Up to ``max_branches`` distinct continuations of ``history`` (the root
        last) from ``tenant``'s outputs: longest match first, then the most
        frequent, then the most recent."""
        self.lookups += 1
        self.examined = 0
        index = self._index.get(tenant)
        out: list[CopyDraft] = []
        if not index or max_branches < 1:
            return out
        h = tuple(int(t) for t in history[-self.ngrams.start:])
        for n in self.ngrams:
            if len(h) < n or len(out) >= max_branches:
                continue
            seen = index.get(ngram_key(h[-n:]), ())
            self.examined += len(seen)
            for cont in self._ranked(seen, h[-n:]):
                if len(out) >= max_branches:
                    break
                self._keep(out, CopyDraft(cont, n))
        self.hits += bool(out)
        return out
    @staticmethod
    def _keep(out: list[CopyDraft], draft: CopyDraft) -> None:
        """Keep ``draft`` unless it is a prefix of a kept one; it replaces a kept
        one it extends (one branch, verified once; its match is its own, the
        n-gram it followed)."""
        for i, kept in enumerate(out):
            if kept.tokens[:len(draft.tokens)] == draft.tokens:
                return
            if draft.tokens[:len(kept.tokens)] == kept.tokens:
                out[i] = draft
                return
        out.append(draft)

    def _ranked(self, seen: list[int], ngram: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The continuations after these occurrences of ``ngram`` (those whose
        tokens are it: keys are hashes), most frequent first (ties: most
        recent), each counted with the longer ones it is a prefix of."""
        conts = []
        for occurrence in reversed(seen):               # most recent first
            doc = self._docs[occurrence >> _ID_SHIFT][1]
            end = occurrence & ((1 << _ID_SHIFT) - 1)
            if doc[end + 1 - len(ngram): end + 1] == ngram:
                conts.append(doc[end + 1: end + 1 + self.length])
        counts = Counter()
        for c in conts:
            for k in range(1, len(c) + 1):
                counts[c[:k]] += 1
        order = {c: i for i, c in reversed(list(enumerate(conts)))}
        return sorted(order, key=lambda c: (-counts[c[:1]], -counts[c], order[c]))

    def _keys(self, doc: tuple[int, ...]):
        """(key, its n-gram's last position) for every n-gram with a token after it."""
        for n in self.ngrams:
            for end in range(n - 1, len(doc) - 1):
                yield ngram_key(doc[end - n + 1: end + 1]), end

    def _evict(self) -> None:
        doc_id, (tenant, doc) = self._docs.popitem(last=False)
        self.tokens -= len(doc)
        index = self._index[tenant]
        for key, _ in self._keys(doc):
            seen = index.get(key)
            if seen is None:
                continue
            seen[:] = [e for e in seen if e >> _ID_SHIFT != doc_id]
            if not seen:
                del index[key]
        if not index:
            del self._index[tenant]
