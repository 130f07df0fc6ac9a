"""A model's forward passes outside the engine, over a page pool laid out as the engine lays out
a step (models/paged.py): sequences in R rows of each of G groups (the mesh's batch shards), a
step's tokens [G, R + C] the rows' decode tokens, then a chunk of one row's prompt. The tests'
one way to run a model for its logits."""

import jax
import numpy as np

from models.decoder import Output
from models.policy import Policy
from models.registry import Model
from sharding.rules import Rules


class Rows:
    """Sequences i = g * R + r in row r of group g of a page pool of `length` tokens a sequence,
    pages of `page_size` (each sequence's own, in order: Model.paged_cache)."""

    def __init__(self, model: Model, params, rules: Rules, policy: Policy, n: int, length: int,
                 page_size: int = 4):
        self.model, self.params, self.rules, self.policy = model, params, rules, policy
        self.n = n
        self.G = G = rules.shards("batch")
        self.R = -(-n // G)
        self.pool, self.tables = model.paged_cache(G, self.R, length, rules, policy, page_size)
        self.lengths = np.zeros(n, int)  # positions each sequence has written

        def step(params, pool, tables, tokens, positions, rows, output):
            out, cache = model.forward(params, tokens, positions, pool.at(tables, tables, rows),
                                       rules, policy, output)
            return out, cache.pool()

        self._step = jax.jit(step, static_argnames="output")

    def _args(self, tokens, positions, rows):
        return self.params, self.pool, self.tables, tokens, positions, rows, Output.LOGITS

    def _call(self, tokens, positions, rows) -> np.ndarray:
        out, self.pool = self._step(*self._args(tokens, positions, rows))
        return np.asarray(out)

    def prefill(self, prompts: list, chunk: int = 0) -> list[np.ndarray]:
        """Each sequence's prompt (a list of token ids), a row at a time in chunks of `chunk`
        tokens (0: whole), the decode slots padding: each prompt's logits [len, V]."""
        G, R = self.G, self.R
        C = chunk or max(len(p) for p in prompts)
        out = [[] for _ in prompts]
        for r in range(R):
            mine = {g: g * R + r for g in range(G) if g * R + r < len(prompts)}
            for start in range(0, max(len(prompts[i]) for i in mine.values()), C):
                tokens = np.zeros((G, R + C), np.int32)
                positions = np.full((G, R + C), -1, np.int32)
                for g, i in mine.items():
                    part = prompts[i][start:start + C]
                    tokens[g, R:R + len(part)] = part
                    positions[g, R:R + len(part)] = start + np.arange(len(part))
                rows = np.broadcast_to(np.r_[np.arange(R), np.full(C, r)], (G, R + C)).astype(np.int32)
                logits = self._call(tokens, positions, rows)
                for g, i in mine.items():
                    out[i].append(logits[g, R:R + len(prompts[i][start:start + C])])
        for i, p in enumerate(prompts):
            self.lengths[i] = len(p)
        return [np.concatenate(o) for o in out]

    def _decode_args(self, tokens):
        G, R = self.G, self.R
        grid = np.zeros((G * R,), np.int32)
        positions = np.full((G * R,), -1, np.int32)
        grid[:self.n] = tokens
        positions[:self.n] = self.lengths
        rows = np.broadcast_to(np.arange(R, dtype=np.int32), (G, R))
        return grid.reshape(G, R), positions.reshape(G, R), rows

    def step(self, tokens) -> np.ndarray:
        """One decode step: each sequence's next token [n] at its next position -> logits [n, V]."""
        logits = self._call(*self._decode_args(np.asarray(tokens)))
        self.lengths += 1
        return logits.reshape(self.G * self.R, -1)[:self.n]

    def step_hlo(self, tokens) -> str:
        """The program a decode step of these tokens runs, as text (nothing runs)."""
        return self._step.lower(*self._args(*self._decode_args(np.asarray(tokens)))).as_text()


def prompt_logits(model: Model, params, rules: Rules, policy: Policy, prompts, chunk: int = 0,
                  page_size: int = 4) -> list[np.ndarray]:
    """Each prompt's logits at every position, [len, V] (Rows.prefill)."""
    prompts = [list(map(int, p)) for p in prompts]
    rows = Rows(model, params, rules, policy, len(prompts), max(map(len, prompts)), page_size)
    return rows.prefill(prompts, chunk)


def greedy(model: Model, params, rules: Rules, policy: Policy, prompts, steps: int,
           page_size: int = 4) -> list[list[int]]:
    """`steps` greedy tokens after each prompt, decoded together."""
    prompts = [list(map(int, p)) for p in prompts]
    rows = Rows(model, params, rules, policy, len(prompts), max(map(len, prompts)) + steps,
                page_size)
    tokens = np.array([p[-1] for p in rows.prefill(prompts)]).argmax(-1)
    got = [tokens]
    for _ in range(steps - 1):
        got.append(rows.step(got[-1]).argmax(-1))
    return np.stack(got, axis=1).tolist()
