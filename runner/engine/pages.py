"""The KV cache's pages on the host: which pages are free, which sequence holds which, and which
full prompt pages are kept for prompts that start the same way.

The device holds, per layer, a pool of `pages` pages of `page_size` token slots (models/paged.py).
A sequence's table lists its pages in order: position p lives in page table[p // page_size], slot
p % page_size. A sequence takes pages as it grows and gives them back when it ends.

Prefix sharing is pages in several tables: every full page of a prompt is named by a digest of
every token up to its end (each digest chains the one before, so a page matches only behind the
same prefix, at the same positions), and a page named so stays in the pool after its sequences
end, until its room is needed (least recently used first). A page is never written twice: a
sequence writes only the pages it took fresh, and takes a named page only when all its slots are
before the first token it computes.

Every process of a multi-host run keeps the same pool: it sees the same requests and tokens in
the same order, and nothing here depends on a clock.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence


def digests(tokens: Sequence[int], page_size: int) -> list[bytes]:
    """The chained digest of each full page of `tokens`."""
    out, h = [], b""
    for b in range(len(tokens) // page_size):
        chunk = tokens[b * page_size: (b + 1) * page_size]
        h = hashlib.blake2b(h + b"".join(int(t).to_bytes(4, "little", signed=True) for t in chunk),
                            digest_size=16).digest()
        out.append(h)
    return out


class PagePool:
    """The pages of one pool: reference counts, free pages, and the named (shareable) ones."""

    def __init__(self, pages: int, page_size: int):
        if pages < 1 or page_size < 1:
            raise ValueError(f"a page pool needs pages >= 1 and page_size >= 1, got {pages}, {page_size}")
        self.pages, self.page_size = pages, page_size
        self.refs = [0] * pages
        self._free = list(range(pages))[::-1]  # pop() takes the lowest first
        self._named: dict[bytes, int] = {}  # digest -> page
        self._name_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # named pages no table holds, LRU first

    @property
    def available(self) -> int:
        """Pages a sequence could take now: free ones and named ones that no table holds."""
        return len(self._free) + len(self._idle)

    @property
    def in_use(self) -> int:
        """Pages some table holds."""
        return self.pages - self.available

    def take(self) -> int:
        """A page for new tokens: a free one, else the least recently used idle named one (its
        name forgotten). Raises when there is none: callers check `available` first."""
        if self._free:
            page = self._free.pop()
        elif self._idle:
            page, _ = self._idle.popitem(last=False)
            del self._named[self._name_of.pop(page)]
        else:
            raise RuntimeError("no page is available")
        self.refs[page] = 1
        return page

    def release(self, pages: Sequence[int]) -> None:
        """A table gives its pages back: each is free again when no other table holds it, or idle
        (still matchable) when it is named."""
        for page in pages:
            if self.refs[page] <= 0:
                raise RuntimeError(f"page {page} released more often than taken")
            self.refs[page] -= 1
            if not self.refs[page]:
                if page in self._name_of:
                    self._idle[page] = None
                else:
                    self._free.append(page)

    def match(self, names: Sequence[bytes]) -> list[int]:
        """The named pages of the longest run of `names` from the start, each now held once more
        by the caller's table."""
        found = []
        for d in names:
            page = self._named.get(d)
            if page is None:
                break
            if not self.refs[page]:
                del self._idle[page]
            self.refs[page] += 1
            found.append(page)
        return found

    def matchable(self, names: Sequence[bytes]) -> int:
        """How many of `names` from the start `match` would find, holding nothing."""
        return next((n for n, d in enumerate(names) if d not in self._named), len(names))

    def holds_all(self, names: Sequence[bytes]) -> bool:
        return all(d in self._named for d in names)

    def name(self, page: int, digest: bytes) -> None:
        """Marks a held page, whose slots are all written, as the page of `digest`, for later
        prompts to match. A digest already named keeps its page; a page has one name."""
        if digest in self._named or page in self._name_of:
            return
        self._named[digest], self._name_of[page] = page, digest


HOLE = -1  # a table entry given back (a windowed layer's page that left the window)


class Table:
    """One sequence's pages, in position order, and how many of its tokens the device holds.
    A windowed layers' table has holes (HOLE) before the pages its window still reaches."""

    def __init__(self, pool: PagePool, shared: Sequence[int] = (), skipped: int = 0):
        """shared: pages matched from the pool (never written by this table), after `skipped`
        holes (a window's table need not hold a shared prefix's early pages)."""
        self.pool = pool
        self.pages: list[int] = [HOLE] * skipped + list(shared)
        self.shared = len(self.pages)
        self.length = self.shared * pool.page_size  # tokens whose keys and values are written

    def pages_for(self, tokens: int) -> int:
        """Pages more that holding `tokens` tokens in all would take."""
        return max(0, -(-tokens // self.pool.page_size) - len(self.pages))

    def grow(self, tokens: int) -> bool:
        """Takes pages until the table holds room for `tokens` tokens; False (and nothing taken)
        when the pool has too few."""
        need = self.pages_for(tokens)
        if need > self.pool.available:
            return False
        self.pages += [self.pool.take() for _ in range(need)]
        return True

    def release(self) -> None:
        self.pool.release([p for p in self.pages if p != HOLE])
        self.pages, self.shared, self.length = [], 0, 0

    def release_before(self, position: int) -> None:
        """Gives back the pages whose every slot lies before `position` (they left the window
        of every query still to come)."""
        for i in range(min(position // self.pool.page_size, len(self.pages))):
            if self.pages[i] != HOLE:
                self.pool.release([self.pages[i]])
                self.pages[i] = HOLE

    def name_full_pages(self, names: Sequence[bytes]) -> None:
        """Names this table's pages whose slots are all written, for the digests `names` of its
        prompt's full pages."""
        full = min(len(names), self.length // self.pool.page_size, len(self.pages))
        for i in range(self.shared, full):
            if self.pages[i] != HOLE:
                self.pool.name(self.pages[i], names[i])
