"""The persistent compilation cache, counted from jax's own cache events (not timed): a second
identical run compiles nothing."""

import re

from tests.reference import tiny_hf
from tests.test_end_to_end import podrun, write_jsonl

CACHE_LINE = re.compile(r"podrun\[0\]: compilation cache: (\d+) hits, (\d+) misses")


def test_a_second_run_compiles_nothing(tmp_path):
    tiny_hf("llama", seed=3).save_pretrained(tmp_path / "hf")
    podrun("runner.tools.convert", f"--source={tmp_path / 'hf'}", f"--output={tmp_path / 'ck'}")
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt_token_ids": [i + 1] * (1 + 3 * i), "max_tokens": 5}
                                             for i in range(6)])

    def run(output):
        p = podrun("runner.main", f"--config=configs/cpu.py:{tmp_path / 'ck'}", f"--config.io.input={inp}",
                   f"--config.io.output={output}", "--config.generation.max_prompt_len=16",
                   "--config.generation.max_new_tokens=8", "--config.generation.batch_size=4",
                   f"--config.compilation_cache.dir={tmp_path / 'xla'}")
        found = CACHE_LINE.findall(p.stderr)
        assert len(found) == 1, p.stderr[-2000:]
        return tuple(int(x) for x in found[0])

    hits, misses = run(tmp_path / "first.jsonl")
    assert misses > 0 and hits == 0  # a fresh cache: everything compiled, and written
    assert len(list((tmp_path / "xla").iterdir())) >= misses
    assert run(tmp_path / "second.jsonl") == (misses, 0)  # everything read back, nothing compiled
    assert (tmp_path / "second.jsonl").read_text() == (tmp_path / "first.jsonl").read_text()
