"""What the engine's caller and its scheduler share: a request, its completion, a sample as it
runs, and what a job did."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from runner.engine.sampling import TokenLogprobs


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt to generate from: prompt ids and its own sampling settings. max_tokens 0 only
    computes the prompt (a prompt scored, nothing generated). logprobs, prompt_logprobs: whether
    the completion carries each generated token's, or each prompt token's, log-probabilities."""

    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    logprobs: bool = False
    prompt_logprobs: bool = False
    prompt_logprobs_from: int = 1  # the first prompt token whose log-probability is wanted
    n: int = 1  # samples; each is a row of its own, the prompt's full pages shared among them
    # A format the completion must follow: `start()` gives each sample a walk through it with
    # `mask(out)` (the next token's allowed ids, written as `allowed_tokens` reads them),
    # `take(token)` and `complete` (runner/text/structured.py). None: free text.
    constraint: Any = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass
class Completion:
    token_ids: list[int]
    finish_reason: str  # stop | length, or the reason a job ended early (Scheduler.run's until)
    ttft_s: float = 0.0  # from the sample's admission to its first token on the host
    decode_s: float = 0.0  # from then to its last token on the host
    logprobs: list[TokenLogprobs] | None = None  # per generated token, when asked
    # per prompt token after the first; None for those a shared page left uncomputed
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # under a format: the tokens ended (max_tokens) before it was complete
    incomplete_format: bool = False


@dataclasses.dataclass
class Stats:
    """What a job did on the engine."""

    batch_size: int = 0  # the engine's rows
    decode_calls: int = 0
    decode_steps: int = 0  # steps the calls ran (a decode call may end early)
    row_steps: int = 0  # steps x rows
    prefill_row_steps: int = 0  # row-steps computing a prompt's chunk, no token
    inserts: int = 0  # calls with a chunk of a prompt (mixed steps)
    prompt_slots: int = 0  # chunk tokens over every mixed step, padding in
    prompt_tokens: int = 0  # prompt tokens of every sample admitted
    prompt_tokens_computed: int = 0  # of those, the ones computed (not taken from shared pages)
    completion_tokens: int = 0
    insert_s: float = 0.0  # wall time in mixed steps (a first call's compilation too)
    decode_s: float = 0.0  # wall time in decode calls
    masked_calls: int = 0  # calls of one step, under some row's format
    mask_s: float = 0.0  # host time computing the formats' token masks
    pages: int = 0  # the pool's pages, every group's
    pages_peak: int = 0  # the most pages that tables held at once
    pages_mean: float = 0.0  # pages held, the mean over calls
    rows_peak: int = 0  # the most rows live (decoding or prefilling) in one call
    rows_mean: float = 0.0  # rows live, the mean over calls
    preemptions: int = 0  # rows whose pages were taken back mid-request, to be recomputed
    programs: int = 0  # distinct device programs called
    compile_wait_s: float = 0.0  # calls' wall time waiting for their programs' compilation

    @property
    def utilisation(self) -> float:
        """The row-steps in which a row worked (took a token, or computed a chunk of its prompt)
        over all: 1 when no row ever idles."""
        return ((self.completion_tokens + self.prefill_row_steps) / self.row_steps
                if self.row_steps else 0.0)


@dataclasses.dataclass
class Sample:
    """One sample of a request as it runs: its tokens so far and what its completion carries."""

    index: int  # the request's index in the job
    sample: int  # which of its samples
    tokens: list[int]
    queued_s: float  # from the start of the job to its admission
    first_s: float  # from the start of the job to its first token
    logprobs: list[TokenLogprobs] | None = None  # per token, when the request asks
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    walk: Any = None  # the walk through the request's format (Request.constraint), if it has one
    broken: bool = False  # a token the format refused: it ends as incomplete

    def finished(self, request: Request, stop_ids: tuple[int, ...],
                 stop_check: Callable[[int, list[int]], bool] | None, now: float) -> Completion | None:
        """The completion when a stop id, max_tokens, a token its format refused or the stop
        check ends the sample (`now`: the time since the job began), else None."""
        tokens = self.tokens
        if tokens and tokens[-1] in stop_ids and not self.broken:
            reason = "stop"
        elif tokens and self.walk is None and stop_check is not None and stop_check(self.index, tokens):
            reason = "stop"
        elif len(tokens) >= request.max_tokens or self.broken:
            reason = "length"
        else:
            return None
        return Completion(tokens, reason, ttft_s=self.first_s - self.queued_s,
                          decode_s=now - self.first_s, logprobs=self.logprobs,
                          prompt_logprobs=self.prompt_logprobs,
                          incomplete_format=self.walk is not None and (
                              self.broken or reason == "length" and not self.walk.complete))
