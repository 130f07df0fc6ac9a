"""podrun as a library: the generator a Python loop calls (RL rollouts, distillation, evals).

    from runner.generator import Generator

    gen = Generator("configs/smollm2_cpu.py", {"generation.max_new_tokens": 32})
    [answer] = gen.generate([{"prompt": "The capital of France is", "max_tokens": 8}])
    print(answer["text"])

    for i, result in gen.stream(requests):       # each request's result as it finishes
        ...
    gen.update_weights(trainer_params)          # new weights, on the devices; nothing compiles
    gen.release()                               # the KV pool's memory back to the trainer
    gen.generate(requests, deadline_s=30.0)     # what each has after 30 s (finish_reason "deadline")

Built once from a deployment config (the file and the overrides the command takes), it restores
the checkpoint while its programs compile, as `python -m runner.main` does, and keeps both: later
calls reuse the compiled programs. A request is a dict as a request file's line holds it (podrun's
own fields, or a whole OpenAI Batch line) and its result the dict the results file would hold; or
a `runner.engine.Request` of token ids, whose result is a `runner.engine.Completion` (a list of n
for n > 1). The command's file job is this generator's calls over the file's lines, plus the
results writer that makes them exactly-once (runner/job.py).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import threading
import time
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from etils import epath
from ml_collections import ConfigDict

from models.registry import Model
from models.weights import check_divisible

from runner.api import common, formats
from runner.api.common import Line, Parsed
from runner.checkpoints import store
from runner.checkpoints.load import open_checkpoint, restore
from runner.cli import setup_devices, unknown_override
from runner.engine import Completion, Request, Scheduler, Stats
from runner.engine.build import build_engine
from runner.settings import Settings, SettingsError, from_config
from runner.text.tokenizer import load_tokenizer, read_chat_template
from sharding.mesh import make_mesh
from sharding.rules import Rules

Result = dict | Completion | list[Completion]


class WeightsError(ValueError):
    """update_weights was given weights the model does not take (the old ones keep serving)."""


class Generator:
    """A deployment's model on its devices, its programs compiled, answering requests from Python.

    One process, one generator: it owns the devices' memory it takes (the weights as it runs
    them, the KV pool). A multi-process deployment calls it on every process with the same
    requests, as the command runs the same file on every host."""

    def __init__(self, config: str | ConfigDict | Settings,
                 overrides: Mapping[str, Any] | None = None, *, params: Any = None,
                 loaded: tuple | None = None, lazy: bool = False):
        """config: a deployment config file ("configs/x.py" or "configs/x.py:arg"), its
        ConfigDict, or its Settings (whose devices the caller set up: the command); overrides:
        {"generation.batch_size": 64, ...}, as the command's --config.* flags. params: weights
        in the checkpoint's names and shapes (e.g. a trainer's, in any sharding over the same
        devices) in place of checkpoint.path's; the model is then checkpoint.model
        (family:preset), or checkpoint.path's metadata. loaded: (metadata, rules, prepared
        params) of a model already on the devices (runner.tools.bench), the generator's own from
        then on. lazy: restore the checkpoint at the first generate, while compiling the
        programs its requests need (the command's job), rather than now while compiling every
        program."""
        if isinstance(config, Settings):
            self.settings = s = config
        else:
            self.settings = s = _settings(config, overrides, checkpoint=params is None)
            setup_devices(s)
        prepared = None
        if loaded is not None:
            self.meta, self.rules, prepared = loaded
        elif params is not None and s.checkpoint_model and not _has_checkpoint(s):
            self.meta = store.Metadata(Model.named(s.checkpoint_model), {}, s.checkpoint_model)
            self.rules = Rules.make(make_mesh(s.mesh), s.rules)
            check_divisible(self.meta.model.declare(s.policy.fuse_projections), self.rules)
        else:
            self.meta, self.rules = open_checkpoint(s)
        model, rules = self.meta.model, self.rules
        has_files = loaded is None and _has_checkpoint(s)
        self.chat_template = read_chat_template(s.chat_template)
        self.tokenizer = load_tokenizer(s.checkpoint_path, self.chat_template) if has_files else None
        self.model_name = (os.path.basename(s.checkpoint_path.rstrip("/")) if has_files
                           else self.meta.source)
        # Built on the weights' declaration, its programs compile while the weights restore.
        self.engine = build_engine(s, model, model.abstract_params(rules, s.policy)
                                   if prepared is None else prepared, rules,
                                   allocate=prepared is not None)
        self._restore: Callable[[], Any] | None = None
        self._parsers: dict[bool, tuple] = {}
        self.stats: Stats | None = None  # the last call's
        if params is not None:
            self.update_weights(params)
        elif prepared is None:
            self._restore = lambda: restore(s, self.meta, rules)
            if not lazy:
                self.load()

    # --- calls -----------------------------------------------------------------------------------

    def generate(self, requests: Iterable[dict | Request], *, deadline_s: float | None = None,
                 cancel: threading.Event | None = None) -> list[Result]:
        """Every request's result, in the order of `requests` (see `stream`)."""
        requests = list(requests)
        out: list[Any] = [None] * len(requests)
        for i, result in self.stream(requests, deadline_s=deadline_s, cancel=cancel):
            out[i] = result
        return out

    def stream(self, requests: Iterable[dict | Request], *, deadline_s: float | None = None,
               cancel: threading.Event | None = None) -> Iterator[tuple[int, Result]]:
        """(index, result) of each request as it finishes: first those that cannot be served
        (a dict with "error"), then the others as their last sample ends.

        deadline_s: seconds from this call after which every request not yet finished ends with
        the tokens it has, finish_reason "deadline"; cancel: an Event that, once set, does the
        same with "cancelled" (a partial rollout). Closing the iterator early stops the job after
        its current step."""
        requests = list(requests)
        if not requests:
            return
        typed = isinstance(requests[0], Request)
        if any(isinstance(r, Request) != typed for r in requests):
            raise TypeError("generate: give every request as a dict, or every one as a "
                            "runner.engine.Request, not both in one call")
        if typed:
            for ended in self.ended(requests, deadline_s=deadline_s, cancel=cancel):
                yield from ((i, samples[0] if requests[i].n == 1 else samples)
                            for i, samples in ended)
            return
        parsed, fmt = self.parse([Line(i + 1, _json(r)) for i, r in enumerate(requests)])
        error_line, result_line = formats.writers(fmt, self.model_name)
        todo = []
        for p in parsed:
            if p.error:
                yield p.index, error_line(p)
            else:
                todo.append(p)
        for ended in self.ended([p.request() for p in todo], [p.stop for p in todo], deadline_s,
                                cancel):
            yield from ((todo[i].index, result_line(todo[i], self.answer(todo[i], samples)))
                        for i, samples in ended)

    def parse(self, lines: list[Line], fmt: formats.FileFormat | None = None,
              skip: Container[int] = ()) -> tuple[list[Parsed], formats.FileFormat]:
        """Request lines read as a file's would be (`fmt`: the file's format, else the first
        line's), but those whose index is in `skip`: each a request, or the reason it cannot be
        served."""
        fmt = fmt or next(filter(None, map(formats.deciding, lines)), None) or formats.FileFormat(
            False, lines[0].number)
        _, _, parse = self._parser(fmt)
        parsed = [parse(i, line) for i, line in enumerate(lines) if i not in skip]
        for line in lines:
            line.release()
        return parsed, fmt

    def answer(self, p: Parsed, samples: list[Completion]) -> common.Answer:
        """Request p's answer from its samples, as the results files write it."""
        chat, _, _ = self._parser(formats.FileFormat(bool(p.api), 0))
        return common.build_answer(p, samples, self.tokenizer, self.settings.echo_prompt, chat)

    def _parser(self, fmt: formats.FileFormat) -> tuple:
        if fmt.openai_batch not in self._parsers:
            self._parsers[fmt.openai_batch] = formats.request_parser(
                self.settings, self.meta.model, self.tokenizer, fmt)
        return self._parsers[fmt.openai_batch]

    def ended(self, requests: list[Request], stops: list[tuple[str, ...]] | None = None,
              deadline_s: float | None = None, cancel: threading.Event | None = None
              ) -> Iterator[list[tuple[int, list[Completion]]]]:
        """The requests that ended in each of the engine's calls, as they end: (index, its
        samples' completions), as `stream` takes them (stops[i]: request i's stop strings,
        checked on the host). self.stats: the job's, as it runs."""
        if (deadline_s is not None or cancel is not None) and jax.process_count() > 1:
            raise ValueError("generate: deadline_s and cancel end a job by this process's clock, "
                             "which the other processes do not share; give neither on several")
        tokenizer = self.tokenizer

        def stop_check(i: int, ids: list[int]) -> bool:  # stop strings, on the host
            return bool(stops and stops[i]) and tokenizer is not None and any(
                st in tokenizer.decode(ids) for st in stops[i])

        _, stop_ids, _ = self._parser(formats.FileFormat(False, 0))
        run = Scheduler(self.engine, requests, stop_ids, stop_check,
                        self.settings.generation.longest_first)
        self.load(requests)
        self.engine.allocate()
        end = None if deadline_s is None else time.monotonic() + deadline_s

        def until() -> str | None:
            if cancel is not None and cancel.is_set():
                return "cancelled"
            return "deadline" if end is not None and time.monotonic() >= end else None

        self.stats = run.stats
        yield from run.ended(until)

    def load(self, requests: list[Request] | None = None) -> None:
        """The checkpoint's weights restored (once), while the programs that `requests` will
        likely run compile (every program, without). A generator built lazy does it at its first
        call; an earlier call makes an error in the weights an error before anything runs."""
        if self._restore is None:
            return
        L = self.engine.layout
        self.engine.prepare(Scheduler(self.engine, requests, longest_first=self.settings.generation
                                      .longest_first).programs() if requests else
                            [L.program(C, 1) for C in L.chunks] + [L.program(0, L.steps)])
        try:
            self.engine.load(self._restore())
        except BaseException:
            self.engine.forget_prepared()  # an error exits without compiling what is left
            raise
        self._restore = None

    # --- weights and memory ----------------------------------------------------------------------

    def update_weights(self, params: Any) -> None:
        """The model's weights replaced by `params`: a tree in the checkpoint's names and shapes
        (nested as Model.declare, or flat {"layers.0.attn.wq": ...}), of precision.params' dtype,
        jax arrays in any sharding over the engine's devices (moved device to device) or host
        arrays. The old weights are freed first, then the new copied (the caller keeps its own)
        and prepared as the engine runs them (fused, quantised, stacked): the devices hold one
        copy of the model beside the caller's. Every compiled program runs on them. A name,
        shape or dtype that does not match raises WeightsError naming the weight, and the old
        weights keep serving."""
        model, rules, policy = self.meta.model, self.rules, self.settings.policy
        decl = model.declare()
        want = store.flatten(decl)
        given = params if _is_flat(params) else store.flatten(params)
        if missing := sorted(want.keys() - given.keys()):
            raise WeightsError(f"update_weights: weight {missing[0]} is missing ({len(missing)} of "
                               f"{model.family}'s {len(want)} weights are)")
        if extra := sorted(given.keys() - want.keys()):
            raise WeightsError(f"update_weights: {extra[0]} is not a weight of {model.family}"
                               + (f" (nor are {len(extra) - 1} more)" if len(extra) > 1 else ""))
        dtype = np.dtype(policy.params)
        for name, w in want.items():
            x = given[name]
            if tuple(x.shape) != w.shape:
                raise WeightsError(f"update_weights: weight {name} has shape {tuple(x.shape)}; "
                                   f"the model's is {w.shape}")
            if np.dtype(x.dtype) != dtype:
                raise WeightsError(f"update_weights: weight {name} is {np.dtype(x.dtype).name}; "
                                   f"precision.params is {dtype.name}")
        # the old weights (the engine's own, prepared) go before the new ones are placed: an
        # update holds one copy of the model beside the caller's, and reuses the old memory
        self.engine.release(pool=False, weights=True)
        self._restore = _no_weights  # until the new weights are in (a failure below leaves none)
        placed = {name: jax.device_put(given[name], rules.sharding(*w.axes), may_alias=False)
                  for name, w in want.items()}
        self.engine.load(model.prepare(store.unflatten(decl, placed), rules, policy), pool=False)
        self._restore = None

    def release(self, weights: bool = False) -> None:
        """Hands the KV pool's device memory back (and with weights=True the weights'): between
        rollouts, the trainer can use it. The next generate takes the pool again, and nothing
        compiles; after weights=True, update_weights must give it weights first."""
        self.engine.release(weights=weights)
        if weights:
            self._restore = _no_weights

    def memory(self) -> dict[str, int]:
        """Bytes this generator holds on the devices: {"weights", "kv_pool"}."""
        held = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree)
                                if isinstance(x, jax.Array) and not x.is_deleted())
        return {"weights": held((self.engine.params, self.engine.greedy_screen)),
                "kv_pool": held(self.engine.cache)}


def _no_weights():
    raise WeightsError("generate: the weights were released (release(weights=True)); give new ones "
                       "with update_weights first")


def _json(request: Any) -> str:
    """A request dict as a request file's line: numpy's numbers and arrays as JSON's; what JSON
    cannot hold makes a line that is not JSON, which gets that line's error."""
    try:
        return json.dumps(request, default=lambda x: x.tolist() if hasattr(x, "tolist") else repr(x))
    except (TypeError, ValueError) as e:
        return f"<{type(e).__name__}: {e}>"


def _is_flat(params: Any) -> bool:
    return isinstance(params, Mapping) and all(not isinstance(v, Mapping) and not isinstance(v, list)
                                               for v in params.values())


def _has_checkpoint(s: Settings) -> bool:
    return bool(s.checkpoint_path) and (epath.Path(s.checkpoint_path) / store.METADATA).exists()


def _settings(config: str | ConfigDict, overrides: Mapping[str, Any] | None,
              checkpoint: bool = True) -> Settings:
    """The Settings of a config file (or ConfigDict) and its overrides, checked as the command
    checks its flags (checkpoint: from_config's)."""
    if isinstance(config, str):
        path, _, arg = config.partition(":")
        spec = importlib.util.spec_from_file_location("podrun_config", path)
        if spec is None or not os.path.isfile(path):
            raise SettingsError(f"config {path}: no such file")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        config = module.get_config(arg) if arg else module.get_config()
    else:
        config = copy.deepcopy(config)  # the caller's stays as it was
    config.lock()  # as the command's: an override of a field the config lacks is an error
    for key, value in (overrides or {}).items():
        try:
            config.update_from_flattened_dict({key: value})
        except KeyError:
            raise SettingsError(unknown_override([f"--config.{key}=x"],
                                                 f"'{key.rsplit('.', 1)[-1]}'")) from None
    return from_config(config, checkpoint)
