"""lm-eval-harness over a podrun Generator: its `LM`, and a command that runs tasks with it.

    pip install lm-eval
    python -m runner.tools.eval --config=configs/smollm2_cpu.py --tasks=my_task \
        --include_path=tasks/ [--limit=100] [--output=results.json]

`PodrunLM(generator)` is an lm_eval `LM` for `lm_eval.simple_evaluate(model=...)`:
- loglikelihood: each (context, continuation) tokenized as lm-eval's Hugging Face backend does
  (the context's trailing spaces moved to the continuation, the pair encoded whole, then split;
  an empty context given the BOS id, else the end-of-text id), scored by podrun's `continuation`
  field: the continuation's summed log-probability and whether greedy decoding gives it. The
  requests of one call share their prompts' pages, so the choices of a multiple-choice question
  compute its context once.
- loglikelihood_rolling: a text's every token scored in windows of up to
  generation.max_prompt_len tokens, each after the one before (lm-eval's rolling windows).
- generate_until: the context's tokens, up to gen_kwargs' max_gen_toks (default 256) new ones,
  cut at the first of `until`; greedy unless do_sample (then its temperature).

Tasks come from local files (`--include_path`, a folder of task YAMLs whose dataset_kwargs name
local data files), since this command fetches nothing.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags

try:
    from lm_eval import simple_evaluate, utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.tasks import TaskManager
except ImportError as e:  # an optional dependency: say which, and how to get it
    raise ImportError(f"runner.tools.eval needs lm-eval ({e}): pip install lm-eval") from e

from runner.cli import config_flag, read_config
from runner.errors import USER_ERRORS
from runner.generator import Generator

MAX_GEN_TOKS = 256  # lm-eval's default for generate_until


class PodrunLM(TemplateLM):
    """An lm_eval LM whose every request a podrun Generator answers (see the module's text)."""

    def __init__(self, generator: Generator):
        super().__init__()
        if generator.tokenizer is None:
            raise ValueError("lm-eval needs the checkpoint's tokenizer, and this generator has none")
        self.gen, self.tok = generator, generator.tokenizer

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_token_ids[0]

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_token_id if self.tok.bos_token_id is not None else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string, add_special_tokens=add_special_tokens is not False)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs
                              ) -> list[tuple[float, bool]]:
        """(summed log-probability, greedy) of each request's continuation tokens after its
        context's."""
        out = []
        for result in self._generate([{"prompt_token_ids": list(context),
                                       "continuation": list(continuation), "max_tokens": 0}
                                      for _, context, continuation in requests]):
            out.append((result["continuation"]["logprob"], result["continuation"]["is_greedy"]))
        for (key, _, _), answer in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        limit = self.gen.settings.generation.max_prompt_len
        windows, owner = [], []
        for i, request in enumerate(requests):
            (text,) = request.args
            for window in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text, add_special_tokens=False),
                    prefix_token=self.prefix_token_id, max_seq_len=limit, context_len=1)):
                windows.append((None, *window))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        asked = []
        for request in requests:
            context, kwargs = request.args
            kwargs = dict(kwargs)
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            sample = kwargs.get("do_sample", False)
            asked.append({"prompt_token_ids": self.tok_encode(context), "stop": until,
                          "max_tokens": int(kwargs.get("max_gen_toks", MAX_GEN_TOKS)),
                          "temperature": float(kwargs.get("temperature", 1.0)) if sample else 0.0})
        texts = [r["text"] for r in self._generate(asked)]
        for request, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", request.args, text)
        return texts

    def _generate(self, requests: list[dict]) -> list[dict]:
        """The generator's results, an error one raised (lm-eval has no place for it)."""
        results = self.gen.generate(requests)
        for n, r in enumerate(results):
            if "error" in r:
                raise ValueError(f"lm-eval request {n}: {r['error']}")
        return results


if __name__ == "__main__":  # flags of this command only, so that the module can be imported
    _CONFIG = config_flag()
    flags.DEFINE_list("tasks", None, "lm-eval task names (from --include_path or lm-eval's own)")
    flags.DEFINE_string("include_path", None, "a folder of task YAMLs")
    flags.DEFINE_integer("limit", None, "at most this many examples a task")
    flags.DEFINE_string("output", "", "write lm-eval's results as JSON here")
FLAGS = flags.FLAGS


def main(argv: list[str]) -> None:
    config = read_config(argv, _CONFIG.value, "podrun eval", "--tasks", bool(FLAGS.tasks))
    try:
        lm = PodrunLM(Generator(config))
    except (*USER_ERRORS, ValueError) as e:
        sys.exit(f"podrun eval: error: {e}")
    results = simple_evaluate(model=lm, tasks=FLAGS.tasks, limit=FLAGS.limit,
                              task_manager=TaskManager(include_path=FLAGS.include_path))
    print(utils.make_table(results))
    if FLAGS.output:
        with open(FLAGS.output, "w") as f:
            json.dump(results["results"], f, indent=1, default=str)


if __name__ == "__main__":
    app.run(main)
