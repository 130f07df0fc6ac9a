"""The main job: restore a checkpoint onto the mesh, answer a file of requests, write the results."""

from __future__ import annotations

import time
from typing import Callable

import jax
from jax.experimental import multihost_utils

from runner import log
from runner.api import formats
from runner.api.common import read_lines
from runner.errors import AllFailedError
from runner.generator import Generator
from runner.report import Summary, log_stats, progress_bar
from runner.results import parts
from runner.results.writer import Results, error_message
from runner.settings import Settings
from runner.text.tokenizer import read_chat_template


def answer(s: Settings, loaded: tuple | None = None) -> Summary:
    """The job: answers the request file s.input into the results file s.output (with io.parts > 1:
    part io.part of it into that part's file, then, once every part is done, the merge into
    s.output); what it did. `loaded`: (metadata, rules, params) of a model already on the devices
    (load_model's, or runner.tools.bench's random weights), in place of checkpoint.path's;
    without a tokenizer, its requests give prompt_token_ids."""
    began = time.time()
    # a bad request file or output path fails before the checkpoint is touched
    lines = read_lines(s.input)
    fmt = formats.file_format(lines)
    read_chat_template(s.chat_template)  # a mistyped path fails here, loading nothing
    writer = jax.process_index() == 0
    if s.parts > 1:
        def generate(part_lines: list, results: Results, header: Callable[[], dict]) -> Summary:
            return _generate(s, part_lines, fmt, results, loaded, header)

        return parts.answer_part(s, lines, fmt, began, generate, writer)
    results = Results(s.output, lines, writer=writer)
    if not s.overwrite and results.finished(*formats.ids(lines, fmt)):
        if results.failed:  # as the run that wrote it ended: every request failed
            raise AllFailedError(f"every one of the {len(lines)} requests failed (in {s.output}, an earlier "
                                 f"run's); line {lines[0].number}: {results.failed}; fix the cause and "
                                 "pass --config.io.overwrite=True to generate them again")
        log.info(f"{s.output} already holds the results of {s.input}'s {len(lines)} requests: "
                 "nothing to do (--config.io.overwrite=True generates them again)")
        return Summary(requests=len(lines), already_done=len(lines))
    return _generate(s, lines, fmt, results, loaded)


def _generate(s: Settings, lines: list, fmt, results: Results, loaded, header=None) -> Summary:
    """`lines` answered into `results` (`header()`: the line its final file starts with): the
    generator's calls over them, each call's results written as it ends."""
    if header:  # a part: its partial file records this attempt before the model loads (--status)
        _open(results)
    # Built lazy: the weights restore while the programs these requests need compile.
    gen = Generator(s, loaded=loaded, lazy=True)
    pending, _ = gen.parse(lines, fmt, skip=results.done)
    todo = [p for p in pending if not p.error]  # in file order: the scheduler takes them so
    requests = [p.request() for p in todo]
    gen.load(requests)
    if not header:
        _open(results)
    summary = Summary(requests=len(lines), already_done=len(lines) - len(pending))
    bad = [p for p in pending if p.error]
    error_line, result_line = formats.writers(fmt, gen.model_name)
    results.add([(p.index, error_line(p)) for p in bad])
    summary.errors = len(bad)
    L = gen.engine.layout
    log.info(f"{len(lines)} requests: {summary.already_done} already done, {len(bad)} invalid, "
             f"{len(todo)} to generate on mesh {dict(gen.rules.mesh.shape)} in {L.batch_size} rows "
             f"and a pool of {L.pages * L.groups} pages of {L.page_size} tokens")

    bar = progress_bar(gen.engine, len(todo))
    t0 = time.perf_counter()
    for ended in gen.ended(requests, [p.stop for p in todo]):
        rows = []
        for i, samples in ended:
            p = todo[i]
            a = gen.answer(p, samples)
            summary.count(a.prompt_tokens, a.completion_tokens, samples)
            rows.append((p.index, result_line(p, a)))
        results.add(rows)
        bar.update(len(rows))
    summary.generate_s = time.perf_counter() - t0
    summary.utilisation, summary.stats = gen.stats.utilisation, gen.stats
    bar.close()
    log_stats(gen.engine, gen.stats)
    results.write_final(len(lines), header() if header else None)
    if jax.process_count() > 1:  # the results file is whole before any process reports success
        multihost_utils.sync_global_devices("podrun: results written")
    log.info(f"{summary.line()} -> {results.output}")
    errors = [error_message(r) for r in results.done.values()]
    if lines and len(results.done) == len(lines) and all(errors):
        raise AllFailedError(f"every one of the {len(lines)} requests failed; line "
                             f"{lines[0].number}: {error_message(results.done[0])}")
    return summary


def _open(results: Results) -> None:
    """The partial file opened for appending, once every process has read it."""
    if jax.process_count() > 1:  # everyone has read the partial file before anyone appends to it
        multihost_utils.sync_global_devices("podrun: results read")
    results.open()
