"""CPU kernels through XLA's FFI: built from cpu_matmul.cc (products) and cpu_attention.cc
(attention), which share cpu_kernels.h, into one library on first use, then registered with jax.

    matmul_f32(x [M, K], w [K, N] (or [N, K], w_nk)) -> [M, N], float32, for a few rows of x
    matmul_panels(x [M, K], panels [P, K, 64], n) -> [M, n], float32: w [K, n] packed in column
        panels (pack_panels), for decode steps and prefills alike
    matmul_nk_s8(x [M, K] f32, q [N, K] int8, scale [N] f32) -> [M, N] f32 = x . (q * scale)^T
    matmul_nk_s4(x [M, K] f32, q [N, K / 2] uint8, d, m [N, K / 32] f16) -> [M, N] f32, for int4
        weights in groups of 32 (models/quant.py's layout: d * u + m)
    greedy_screened(x [M, D], w [D, V] (or [V, D]), screen) -> [M] int32, the argmax of x . w
        without reading most of w: through an int8 copy with error bounds (greedy_screen)
    paged_attention(q [T, N, H], pages k/v [P, K, S, H], tables [R, M], rows, q_pos [T])
        -> [T, N, H], a ragged step's queries over a pool of KV pages through page tables
    rms_norm(x [..., D], w [D], eps) -> [..., D], float32: x / sqrt(mean(x^2) + eps) * w in one call

A batch-1 decode step is tens or hundreds of products one after another, a few microseconds
apart. XLA:CPU's dot runs the small ones on one thread (as fast on one core as on two);
matmul_f32 splits each product over threads that spin between products.

XLA:CPU has no fast form of a product with int8 weights: converting them to float32 inside the dot
falls back to a slow loop, an order of magnitude slower than its float32 dot. The kernel dequantises in registers and reads each weight byte once, so a decode step moves
a quarter of the float32 bytes.

The shared library is compiled with the machine's C++ compiler ($CXX, else g++) for the CPU it runs
on (-march=native) into ~/.cache/podrun/kernels/ (or $PODRUN_KERNEL_CACHE), keyed by a hash of the
source, the flags, the jax version and the CPU's feature flags (a home directory shared by machines
of different kinds keeps one build per kind), so each machine builds it once (about 3 s).
$PODRUN_KERNEL_FLAGS adds compiler flags: `-mno-avx512f` builds the AVX2 path on an AVX-512
machine, `-mno-avx512f -mno-avx2 -mno-fma` the portable one (the tests check every path so).
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

SOURCES = tuple(Path(__file__).with_name(n) for n in ("cpu_matmul.cc", "cpu_attention.cc"))
HEADERS = (Path(__file__).with_name("cpu_kernels.h"),)
TARGETS = ("podrun_matmul_f32", "podrun_matmul_panels", "podrun_matmul_nk_s8", "podrun_matmul_nk_s4",
           "podrun_greedy_screened", "podrun_paged_attention", "podrun_paged_attention_s8",
           "podrun_rms_norm")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")


class KernelBuildError(RuntimeError):
    """The CPU kernels could not be compiled or loaded."""


def _cache_dir() -> Path:
    return Path(os.environ.get("PODRUN_KERNEL_CACHE") or "~/.cache/podrun/kernels").expanduser()


def _compiler() -> str:
    cxx = os.environ.get("CXX") or "g++"
    found = shutil.which(cxx)
    if not found:
        sources = " and ".join(p.name for p in SOURCES)
        raise KernelBuildError(
            f"podrun's CPU kernels need a C++ compiler to build {sources}, "
            f"and {cxx!r} is not on PATH; install g++ (apt-get install g++) or set CXX, or run with "
            "--config.kernels.enabled=False (much slower int8 through XLA)")
    return found


def _cpu_features() -> bytes:
    """The CPU's feature flags (what -march=native compiles for); empty where /proc is absent."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""


def _flags() -> tuple[str, ...]:
    return FLAGS + tuple(os.environ.get("PODRUN_KERNEL_FLAGS", "").split())


def build() -> Path:
    """The compiled library, built now unless this machine already has it."""
    cxx = _compiler()
    source = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    flags = _flags()
    key = hashlib.sha256(source + " ".join(flags).encode() + cxx.encode()
                         + jax.__version__.encode() + _cpu_features()).hexdigest()[:16]
    out = _cache_dir() / f"cpu_kernels-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".lock", "w") as lock:  # several processes of one host build it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():
            return out
        print(f"podrun: building the CPU kernels into {out} (once per machine)", file=sys.stderr,
              flush=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_out = Path(tmp) / out.name
            cmd = [cxx, *flags, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", str(tmp_out)]
            done = subprocess.run(cmd, check=False, capture_output=True, text=True)
            if done.returncode:
                raise KernelBuildError(f"building the CPU kernels failed ({' '.join(cmd)}):\n"
                                       f"{done.stderr[-2000:]}")
            os.replace(tmp_out, out)
    return out


@functools.cache
def available() -> bool:
    """Whether the kernels can be built and loaded here. When not (no C++ compiler, say), callers
    fall back to XLA, which gives the same results more slowly; one warning says why."""
    try:
        register()
    except KernelBuildError as e:
        warnings.warn(f"podrun's CPU kernels are unavailable, XLA runs their work instead: {e}",
                      RuntimeWarning, stacklevel=2)
        return False
    return True


def vector_path() -> str:
    """Which vectors the built kernels use: avx512, avx2 or portable."""
    fn = ctypes.cdll.LoadLibrary(str(build())).podrun_vector_path
    fn.restype = ctypes.c_char_p
    return fn().decode()


@functools.cache
def bf16_rows() -> int:
    """The rows of x from which matmul_nk_s4 may round x and W to bfloat16 and multiply them in
    AVX-512 BF16 (twice a core's float32 multiply-adds), as fast as float32 there and faster from
    there on; 0 where this CPU has no AVX-512 BF16, and every product is float32."""
    return ctypes.cdll.LoadLibrary(str(build())).podrun_bf16_rows()


@functools.cache
def register() -> None:
    """Builds (if needed) and registers every target with jax's CPU FFI; once per process."""
    path = build()
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
    except OSError as e:
        raise KernelBuildError(f"cannot load {path}: {e}; delete it to rebuild") from e
    for name in TARGETS:
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """x [..., D] / sqrt(mean(x^2, -1) + eps) * w [D], float32, in one call (a decode step's norm:
    XLA:CPU runs it as four operations)."""
    register()
    return jax.ffi.ffi_call("podrun_rms_norm", jax.ShapeDtypeStruct(x.shape, jnp.float32))(
        x.astype(jnp.float32), w.astype(jnp.float32), eps=np.float32(eps))


def matmul_f32(x: jax.Array, w: jax.Array, w_nk: bool = False) -> jax.Array:
    """x [M, K] . w [K, N] (or . w[N, K]^T with w_nk) -> [M, N], float32."""
    register()
    n = w.shape[0 if w_nk else 1]
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call("podrun_matmul_f32", out)(x, w, w_nk=bool(w_nk))


PANEL = 64  # columns a panel (cpu_matmul.cc's kPanel)


def pack_panels(w: jax.Array, w_nk: bool = False) -> jax.Array:
    """w [K, N] (or [N, K] with w_nk) as panels [ceil(N / PANEL), K, PANEL] of PANEL columns each,
    the last one padded with zero columns: what matmul_panels reads."""
    w = w.T if w_nk else w
    K, N = w.shape
    P = -(-N // PANEL)
    w = jnp.pad(w, ((0, 0), (0, P * PANEL - N)))
    return w.reshape(K, P, PANEL).transpose(1, 0, 2)


def matmul_panels(x: jax.Array, panels: jax.Array, n: int) -> jax.Array:
    """x [M, K] . w -> [M, n], float32, for w [K, n] packed by pack_panels."""
    register()
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call("podrun_matmul_panels", out)(x, panels)


def matmul_nk_s8(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """x [M, K] float32, q [N, K] int8, scale [N] float32 -> [M, N] float32."""
    register()
    out = jax.ShapeDtypeStruct((x.shape[0], q.shape[0]), jnp.float32)
    return jax.ffi.ffi_call("podrun_matmul_nk_s8", out)(x.astype(jnp.float32), q, scale)


def matmul_nk_s4(x: jax.Array, q: jax.Array, d: jax.Array, m: jax.Array, bf16_rows: int = 0
                 ) -> jax.Array:
    """x [M, K] float32, q [N, K / 2] uint8, d, m [N, K / 32] float16 -> [M, N] float32. With
    bf16_rows (> 0, this CPU's bf16_rows() or more) and at least that many rows, x and the
    weights are rounded to bfloat16 and their products summed in float32."""
    register()
    out = jax.ShapeDtypeStruct((x.shape[0], q.shape[0]), jnp.float32)
    return jax.ffi.ffi_call("podrun_matmul_nk_s4", out)(x.astype(jnp.float32), q, d, m,
                                                        bf16_rows=np.int64(bf16_rows))


class Screen(NamedTuple):
    """An unembedding W's rows in int8, for greedy_screened: W_v ~ scale_v q_v, and radius_v with
    |x . W_v - scale_v fl(x . q_v)| <= ||x|| radius_v for every x (float32 rounding included)."""

    q: jax.Array  # [V, D] int8
    scale: jax.Array  # [V] float32
    radius: jax.Array  # [V] float32


@functools.partial(jax.jit, static_argnames="w_nk")
def greedy_screen(w: jax.Array, w_nk: bool = False) -> Screen:
    """The screen of a float32 unembedding w [D, V] (or [V, D] with w_nk).

    radius_v = 1.001 ||e_v|| + (2 D + 16) u (||W_v|| + ||e_v||), where e_v = W_v - scale_v q_v and
    u = 2^-24: the first term bounds x . e_v (Cauchy-Schwarz; the 0.1% covers the float32 sum of
    squares), the second the float32 rounding, each at most D u of the terms' magnitudes, of the
    screen's dot product, of e and the norms, and of the bound's own arithmetic in the kernel.
    """
    rows = w.astype(jnp.float32) if w_nk else w.astype(jnp.float32).T  # [V, D]
    D = rows.shape[1]
    amax = jnp.max(jnp.abs(rows), axis=1)
    scale = jnp.where(amax > 0, amax / 127, 1.0)
    q = jnp.clip(jnp.round(rows / scale[:, None]), -127, 127)
    e = rows - scale[:, None] * q
    norm = lambda a: jnp.sqrt(jnp.sum(a * a, axis=1))
    e_norm = norm(e)
    radius = 1.001 * e_norm + (2 * D + 16) * 2.0**-24 * (norm(rows) + e_norm)
    return Screen(q.astype(jnp.int8), scale, radius)


def greedy_screened(x: jax.Array, w: jax.Array, screen: Screen, w_nk: bool = False) -> jax.Array:
    """The largest logit's index for each row of x [M, D] against w [D, V] (or [V, D] with w_nk),
    int32 [M]: the argmax of x . w computed in float64 (ties to the lowest index), reading the
    int8 screen and the few rows of w whose logits it cannot rule out (cpu_matmul.cc)."""
    register()
    out = jax.ShapeDtypeStruct((x.shape[0],), jnp.int32)
    return jax.ffi.ffi_call("podrun_greedy_screened", out)(
        x.astype(jnp.float32), w, screen.q, screen.scale, screen.radius, w_nk=bool(w_nk))


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, tables: jax.Array,
                    rows: jax.Array, q_pos: jax.Array, sinks: jax.Array | None, window: int | None,
                    scale: float, k_scale: jax.Array | None = None,
                    v_scale: jax.Array | None = None) -> jax.Array:
    """q [T, N, H] float32: T query tokens of a ragged step, each belonging to a sequence;
    k_pages, v_pages [P, K, S, H] (float32, or int8 with k_scale, v_scale [P, K, S] float32: value =
    int8 * scale), or one group's [1, P, K, S, H] ([1, P, K, S]): the KV page pool, P pages of S
    slots each, K kv heads; tables [R, M] int32: the
    pages of each of R sequences, position p of sequence r in page tables[r, p // S], slot p % S;
    rows [T] int32: each query's sequence; q_pos [T] int32: each query's position, -1 for a padding
    query (its output is zeros, and nothing is read for it); sinks [N] or None (one extra logit per
    query head that takes probability mass and contributes no value); window: int or None (a key
    at position p is visible to a query at t when 0 <= p <= t and, with a window, t - p < window);
    scale: the softmax scale. Query head n uses kv head n // (N // K). Returns [T, N, H] float32.

    Every visible position is assumed written. Only the table entries of the pages a query's
    visible positions lie in are read (those past q_pos // S may be garbage); the kernel checks
    them, and rows, against the pool and tables and fails the call with an invalid argument where
    one is out of range."""
    register()
    if (k_scale is None) != (v_scale is None):
        raise ValueError("paged_attention: int8 pages take both k_scale and v_scale, or neither")
    has_sinks = sinks is not None
    sinks = jnp.zeros(q.shape[1:2], jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    i32 = jnp.int32
    pages = (k_pages, v_pages) if k_scale is None else (
        k_pages, v_pages, k_scale.astype(jnp.float32), v_scale.astype(jnp.float32))
    target = "podrun_paged_attention" if k_scale is None else "podrun_paged_attention_s8"
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32), *pages, tables.astype(i32), rows.astype(i32), q_pos.astype(i32),
        sinks, has_sinks=np.int64(has_sinks), scale=np.float32(scale), window=np.int64(window or 0))
