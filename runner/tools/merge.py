"""The parts of a split job (io.parts > 1) merged into its results file, or where they stand.

    python -m runner.tools.merge --config=configs/<deployment>.py --config.io.input=requests.jsonl \
        --config.io.output=results.jsonl --config.io.parts=64 [--status]

With the config the parts ran with (the same overrides: a part written with other settings that
change results is refused, naming them), the parts' files beside io.output are streamed into
io.output in input order, each result checked against its request line (runner/results/parts.py);
io.output appears whole or not at all. --status reads the parts' files alone (not the input) and
prints each part's state: done (requests, errors, tokens, attempts, wall time), started (results
so far, attempts, its last write), failed (the error its last attempt recorded) or pending; then
the totals and the slowest part. docs/parts.md.
"""

from __future__ import annotations

import sys
import time

from absl import app, flags

from runner.cli import config_flag, parse_flags, read_config
from runner.errors import USER_ERRORS
from runner.results import parts
from runner.settings import from_config

if __name__ == "__main__":  # flags of this command only, so the module can be imported
    _CONFIG = config_flag()
    _STATUS = flags.DEFINE_bool("status", False, "print where each part stands instead of merging")


def describe(output: str, states: list[parts.State], now: float | None = None) -> str:
    """The --status report: a line per part, then the totals and the slowest part."""
    now = time.time() if now is None else now
    count = {k: sum(s.state == k for s in states) for k in ("done", "started", "failed", "pending")}
    out = [f"{len(states)} parts of {output}: " + ", ".join(f"{n} {k}" for k, n in count.items())]
    out.append(f"{'part':>6}  {'state':<8} {'requests':>15} {'results':>9} {'errors':>7} {'prompt':>10} "
               f"{'completion':>11} {'attempts':>8}  wall / note")
    for s in states:
        h = s.header
        span = f"{s.lines[0] + 1}-{s.lines[1]}" if s.lines and s.lines[1] > s.lines[0] else "-"
        if s.state == "done":
            row = (f"{s.results:>9} {h.get('errors', 0):>7} {h.get('prompt_tokens', 0):>10} "
                   f"{h.get('completion_tokens', 0):>11} {s.attempts:>8}  {h.get('wall_s', 0):.1f} s")
        else:
            total = f"/{s.lines[1] - s.lines[0]}" if s.lines else ""
            note = (s.error if s.state == "failed" else
                    f"last written {now - s.updated:.0f} s ago" if s.updated is not None and s.state == "started"
                    else "")
            row = f"{f'{s.results}{total}' if s.state != 'pending' else '-':>9} {'':>7} {'':>10} {'':>11} " \
                  f"{s.attempts if s.state != 'pending' else '-':>8}  {note}"
        out.append(f"{s.index:>6}  {s.state:<8} {span:>15} {row}".rstrip())
    done = [s for s in states if s.state == "done"]
    if done:
        total = lambda k: sum(int(s.header.get(k, 0)) for s in done)  # noqa: E731
        out.append(f"done: {total('requests')} requests ({total('errors')} errors), {total('prompt_tokens')} "
                   f"prompt + {total('completion_tokens')} completion tokens in {len(done)} parts")
        slow = max(done, key=lambda s: s.header.get("wall_s", 0))
        h = slow.header
        rate = h.get("completion_tokens", 0) / h["wall_s"] if h.get("wall_s") else 0.0
        out.append(f"slowest part: {slow.index}, {h.get('wall_s', 0):.1f} s on {h.get('host', '?')} "
                   f"({h.get('requests', 0)} requests, {rate:.1f} completion tokens/s, "
                   f"{slow.attempts} attempt(s))")
    retried = [s for s in states if s.attempts > 1]
    if retried:
        out.append("retried: " + ", ".join(f"part {s.index} ({s.attempts} attempts)" for s in retried))
    return "\n".join(out)


def main(argv: list[str]) -> None:
    config = read_config(argv, _CONFIG.value, "podrun merge")
    try:
        s = from_config(config)
        if s.parts < 2:
            sys.exit(f"podrun merge: error: io.parts={s.parts}: give the --config.io.parts the parts ran with")
        if not s.output:
            sys.exit("podrun merge: error: io.output is empty: pass --config.io.output=<results.jsonl>")
        if _STATUS.value:
            print(describe(s.output, parts.states(s.output, s.parts)))
            if others := parts.other_counts(s.output, s.parts):
                print(f"beside them: part files of {s.output} cut into {' or '.join(map(str, others))} "
                      "parts (another --config.io.parts)")
            return
        m = parts.merge(s.input, s.output, s.parts, s.result_config)
    except USER_ERRORS as e:
        sys.exit(f"podrun merge: error: {e}")
    print(f"merged {s.parts} parts into {s.output}: {m.requests} requests ({m.errors} errors), "
          f"{m.prompt_tokens} prompt + {m.completion_tokens} completion tokens")


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
