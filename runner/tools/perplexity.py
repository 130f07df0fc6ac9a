"""Perplexity of a deployment's model on a text file, to check that a precision change (int8
weights, a bf16 cache) keeps the model's quality.

    python -m runner.tools.perplexity --config=configs/smollm2_cpu.py \
        --text=tests/data/shakespeare.txt [--max_tokens=8192] [--window=512] \
        [--config.precision.quantize=int8|int4]

The text's first max_tokens + 1 tokens (the checkpoint's tokenizer, no special tokens) are cut into
windows of `window` tokens that overlap by one, so every token after the first is predicted exactly
once, from the tokens of its own window before it. Perplexity = exp(mean negative log-likelihood).
The windows run through the model's forward pass on the config's mesh, one a shard of the batch
at a time, each as a sequence of its own in a fresh pool of pages.
"""

from __future__ import annotations

import math
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from models.decoder import Output
from runner.checkpoints.load import load_model
from runner.cli import config_flag, parse_flags, read_config, setup_devices
from runner.errors import USER_ERRORS
from runner.settings import Settings, from_config
from runner.text.tokenizer import load_tokenizer

if __name__ == "__main__":
    _CONFIG = config_flag()
    _TEXT = flags.DEFINE_string("text", None, "a UTF-8 text file")
    _MAX_TOKENS = flags.DEFINE_integer("max_tokens", 8192, "tokens of the text to score")
    _WINDOW = flags.DEFINE_integer("window", 512, "tokens per window (the context of a prediction)")
    _CHUNK = flags.DEFINE_integer("chunk", 0, "feed each window this many tokens at a time, so that "
                                  "later chunks read the earlier ones from the KV cache (0: at once)")


class PerplexityError(ValueError):
    """The text or the window settings cannot give a perplexity."""


def windows(ids: list[int], max_tokens: int, window: int) -> np.ndarray:
    """[n, window] token windows overlapping by one, covering ids[: max_tokens + 1]; the last
    window is padded with -1 (a padded position predicts nothing)."""
    if window < 2:
        raise PerplexityError(f"window={window}: need at least 2 tokens per window")
    ids = ids[: max_tokens + 1]
    if len(ids) < 2:
        raise PerplexityError(f"the text has {len(ids)} token(s); need at least 2")
    step = window - 1
    n = -(-(len(ids) - 1) // step)
    out = np.full((n, window), -1, np.int64)
    for i in range(n):
        chunk = ids[i * step: i * step + window]
        out[i, : len(chunk)] = chunk
    return out


def nll(s: Settings, meta, rules, params, win: np.ndarray, chunk: int = 0) -> tuple[float, int]:
    """(sum of negative log-likelihoods, number of predicted tokens) over the windows.

    chunk > 0 feeds each window `chunk` tokens at a time: every chunk after the first attends to
    the earlier ones through the KV cache, as decoding does, so a cache's precision shows."""
    model, policy = meta.model, s.policy.on(rules)
    data = rules.shards("batch")
    rows = -(-len(win) // data) * data
    padded = np.full((rows, win.shape[1]), -1, np.int64)
    padded[: len(win)] = win
    tokens = np.maximum(padded, 0).astype(np.int32)
    positions = np.where(padded >= 0, np.arange(win.shape[1])[None], -1).astype(np.int32)

    W = win.shape[1]
    if chunk < 0 or (chunk and W % chunk):
        raise PerplexityError(f"chunk={chunk} must divide the window of {W} tokens")
    C = chunk or W

    @jax.jit
    def score(params, tokens, positions):
        """Each of the G windows [G, W] a sequence of its own group, with one row: a step's
        tokens are the row's decode slot (padding here), then a chunk of C of its tokens."""
        G = tokens.shape[0]
        cache, tables = model.paged_cache(G, 1, W, rules, policy, s.generation.page_size)
        rows = jnp.zeros((G, 1 + C), jnp.int32)

        def feed(cache, a):
            window = partial(jax.lax.dynamic_slice_in_dim, start_index=a, slice_size=C, axis=1)
            step = lambda x, pad: jnp.concatenate([jnp.full((G, 1), pad, jnp.int32), window(x)], 1)
            out, cache = model.forward(params, step(tokens, 0), step(positions, -1),
                                       cache.at(tables, tables, rows), rules, policy, Output.LOGITS)
            return cache.pool(), out[:, 1:]

        _, parts = jax.lax.scan(feed, cache, jnp.arange(0, W, C))  # [W / C, G, C, V]
        logits = jnp.moveaxis(parts, 0, 1).reshape(G, W, -1)
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
        target = tokens[:, 1:]
        picked = jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
        scored = positions[:, 1:] >= 0
        return -jnp.sum(jnp.where(scored, picked, 0.0)), jnp.sum(scored)

    total, count = 0.0, 0
    for start in range(0, rows, data):  # one row per data shard at a time bounds the logits' memory
        t, c = score(params, tokens[start: start + data], positions[start: start + data])
        total, count = total + float(t), count + int(c)
    return total, count


def main(argv: list[str]) -> None:
    logging.set_verbosity(logging.WARNING)
    config = read_config(argv, _CONFIG.value, "podrun perplexity", "--text=<file>", bool(_TEXT.value))
    try:
        s = from_config(config)
        try:
            with open(_TEXT.value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise PerplexityError(f"--text={_TEXT.value}: {e}") from e
        setup_devices(s)
        meta, rules, params = load_model(s)
        tokenizer = load_tokenizer(s.checkpoint_path)
        if tokenizer is None:
            raise PerplexityError(f"{s.checkpoint_path} has no tokenizer to read the text with")
        # Enough characters for max_tokens (no tokenizer averages under one character a token).
        ids = tokenizer.encode(text[: 8 * (_MAX_TOKENS.value + 1)], add_special_tokens=False)
        win = windows(ids, _MAX_TOKENS.value, _WINDOW.value)
        total, count = nll(s, meta, rules, params, win, _CHUNK.value)
    except (*USER_ERRORS, PerplexityError) as e:
        sys.exit(f"podrun perplexity: error: {e}")
    if jax.process_index() == 0:
        bf16 = s.policy.quantize == "int4" and s.policy.on(rules).backend.int4_bf16_rows
        print(f"perplexity {math.exp(total / count):.4f} over {count} tokens "
              f"({len(win)} windows of {_WINDOW.value}, chunks of {_CHUNK.value or _WINDOW.value}; "
              f"weights {s.policy.params}, quantize "
              f"{s.policy.quantize}{' (products in bfloat16)' if bf16 else ''}, "
              f"KV cache {s.policy.kv_cache})")


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
