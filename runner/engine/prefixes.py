"""Automatic prefix sharing: blocks of prompt tokens found by their digest, their keys and values
kept on device for the prompts that start the same way.

A prompt's tokens [0, BS) are its block 0, [BS, 2 BS) block 1, ... A block's digest covers every
token up to its end (each digest chains the one before), so a block matches only behind the same
prefix, at the same positions. The pool holds a fixed number of blocks (generation.prefix_tokens
/ BS); a block that a new prompt needs takes a free one, else the least recently used (matched or
stored) one. A prompt matches the longest run of its blocks from the start that the pool holds.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    """Which prompt blocks the device pool holds, and where (host side; every process keeps the
    same one, as it sees the same requests in the same order)."""

    def __init__(self, blocks: int, block: int):
        self.blocks, self.block = blocks, block
        self._where: OrderedDict[bytes, int] = OrderedDict()  # digest -> block, least recent first
        self._free = list(range(blocks))[::-1]
        self._digests: dict[tuple[int, ...], list[bytes]] = {}

    def digests(self, prompt: Sequence[int]) -> list[bytes]:
        """The digest of each full block of `prompt`."""
        key = tuple(prompt)
        if key not in self._digests:
            out, h = [], b""
            for b in range(len(key) // self.block):
                chunk = key[b * self.block: (b + 1) * self.block]
                h = hashlib.blake2b(h + b"".join(t.to_bytes(4, "little") for t in chunk),
                                    digest_size=16).digest()
                out.append(h)
            self._digests[key] = out
        return self._digests[key]

    def match(self, prompt: Sequence[int], most: int) -> list[int]:
        """The pool's blocks of the longest run of `prompt`'s blocks from its start, at most
        `most` blocks; they become the most recently used."""
        found = []
        for d in self.digests(prompt)[:most]:
            if d not in self._where:
                break
            self._where.move_to_end(d)
            found.append(self._where[d])
        return found

    def holds(self, digest: bytes) -> bool:
        return digest in self._where

    def claim(self, digests: Sequence[bytes]) -> list[int]:
        """Blocks for digests the pool does not hold: free ones, else the least recently used,
        never one claimed in this call; as many as the pool has room for."""
        out, taken = [], set()
        for d in digests:
            if self._free:
                out.append(self._free.pop())
                self._where[d] = out[-1]
            else:
                old = next((k for k, v in self._where.items() if v not in taken), None)
                if old is None:
                    break
                block = self._where.pop(old)
                self._where[d] = block
                out.append(block)
            taken.add(out[-1])
        return out
