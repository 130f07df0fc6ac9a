"""Weights and KV cache on transparent huge pages (CPU, Linux): `collapse`; and the heap's freed
bytes handed back after the weights are prepared: `return_freed_memory`.

A decode step streams every weight from memory. On 4 KiB pages that stream crosses a page every
4 KiB, each a TLB miss, and in a virtual machine each miss walks two page tables. XLA:CPU's own
buffers get no huge pages where the system leaves them to madvise (the common default), so after
the engine has placed its arrays, `collapse` asks the kernel to move them onto 2 MiB pages now
(madvise MADV_COLLAPSE, Linux 6.1 and later): the contents and addresses stay as they are.

Fewer TLB misses let a decode step's stream of weights read faster; a compute-bound prefill is
unchanged (docs/benchmarks/cpu-fixed-shapes-2026.md has the measurements).
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import jax

MADV_COLLAPSE = 25  # linux/mman.h
HUGE = 2 << 20


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def return_freed_memory() -> None:
    """Hands the C heap's free memory back to the system (glibc's malloc_trim; nothing elsewhere).
    Preparing the weights (fusing, quantising, packing in panels: models/registry.prepare) frees
    each restored array once its new form exists, and glibc kept those bytes: SmolLM2 in panels
    held 1104 MB of RSS after its load against 868 MB as restored, 786 MB once trimmed."""
    if not sys.platform.startswith("linux"):
        return
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


def regions(tree: Any) -> list[tuple[int, int]]:
    """The 2 MiB-aligned regions [start, end) that hold the CPU buffers of `tree`'s arrays (those
    on this process), merged where they touch."""
    spans = []
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array) or leaf.is_deleted():
            continue
        for shard in leaf.addressable_shards:
            if shard.device.platform != "cpu" or not shard.data.nbytes:
                continue
            p = shard.data.unsafe_buffer_pointer()
            spans.append((p // HUGE * HUGE, -(-(p + shard.data.nbytes) // HUGE) * HUGE))
    merged: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def collapse(tree: Any) -> tuple[int, int]:
    """Moves the memory of `tree`'s CPU arrays onto 2 MiB pages, one page at a time (a page the
    kernel cannot collapse stays as it was). Returns (bytes collapsed, bytes asked): (0, 0) off
    Linux, (0, asked) where the kernel has no MADV_COLLAPSE or THP is off.
    The 2 MiB around a buffer may hold other allocations of the process: collapsing moves pages,
    never their contents."""
    return collapse_regions(regions(tree))


def collapse_regions(spans: list[tuple[int, int]]) -> tuple[int, int]:
    """collapse's work on regions(tree): the system calls alone, which hold no Python lock and
    can run on a thread of their own while the arrays are in use."""
    madvise = _madvise()
    if madvise is None:
        return 0, 0
    done = asked = 0
    for a, b in spans:
        for page in range(a, b, HUGE):
            asked += HUGE
            if madvise(page, HUGE, MADV_COLLAPSE) == 0:  # else EINVAL (no MADV_COLLAPSE, THP
                done += HUGE  # off), EAGAIN / ENOMEM (no free huge page, part unmapped): as it was
    return done, asked
