"""runner.tools.eval's PodrunLM against lm-eval's own Hugging Face backend (HFLM) on the real
SmolLM2: a local multiple-choice task through lm_eval.simple_evaluate, rolling log-likelihoods
of texts, and greedy generate_until."""

import json

import numpy as np
import pytest
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from runner.checkpoints.convert import convert
from runner.generator import Generator
from runner.tools.eval import PodrunLM

QUESTIONS = [
    ("What is the capital of France?", ["Paris", "Rome", "Berlin", "Madrid"], 0),
    ("How many legs does a spider have?", ["six", "eight", "ten", "four"], 1),
    ("Which planet is known as the red planet?", ["Venus", "Jupiter", "Mars", "Saturn"], 2),
    ("What do bees make?", ["milk", "silk", "wax and honey", "paper"], 2),
    ("What is frozen water called?", ["steam", "ice", "sand", "glass"], 1),
    ("Which animal barks?", ["a cat", "a cow", "a dog", "a fish"], 2),
    ("What colour is the sky on a clear day?", ["green", "blue", "red", "black"], 1),
    ("How many days are in a week?", ["five", "seven", "nine", "twelve"], 1),
]
TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer."]


@pytest.fixture(scope="module")
def lms(smollm2_gguf, smollm2_transformers, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2_eval") / "ck"
    convert(smollm2_gguf, str(out))
    podrun = PodrunLM(Generator("configs/cpu.py", {"checkpoint.path": str(out),
                                                   "generation.max_prompt_len": 64,
                                                   "generation.max_new_tokens": 16,
                                                   "generation.batch_size": 8}))
    hf = HFLM(pretrained=smollm2_transformers.model, tokenizer=smollm2_transformers.tokenizer,
              device="cpu", batch_size=1)
    return podrun, hf


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    data = root / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in QUESTIONS))
    (root / "podrun_questions.yaml").write_text(f"""task: podrun_questions
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {data}
validation_split: validation
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return str(root)


def test_multiple_choice_loglikelihoods_and_accuracy_are_hf_backends(lms, task):
    runs = [simple_evaluate(model=lm, tasks=["podrun_questions"], log_samples=True,
                            task_manager=TaskManager(include_path=task)) for lm in lms]
    scores = [np.array([[r[0][0] for r in s["resps"]] for s in run["samples"]["podrun_questions"]])
              for run in runs]
    ours, theirs = scores
    assert ours.shape == (len(QUESTIONS), 4)
    assert np.max(np.abs(ours - theirs)) < 1e-4, np.max(np.abs(ours - theirs))
    greedy = [[[r[0][1] for r in s["resps"]] for s in run["samples"]["podrun_questions"]]
              for run in runs]
    assert greedy[0] == greedy[1]
    acc = [run["results"]["podrun_questions"]["acc,none"] for run in runs]
    assert acc[0] == acc[1]


def test_rolling_loglikelihoods_and_greedy_generations_are_hf_backends(lms):
    podrun, hf = lms
    rolling = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(TEXTS)]
    ours, theirs = (np.array(lm.loglikelihood_rolling(rolling)) for lm in lms)
    # sums over every token of the text (about 25): float32's rounding adds up, 1e-5 a token
    tokens = [len(podrun.tok_encode(t)) for t in TEXTS]
    assert np.all(np.abs(ours - theirs) < 1e-5 * np.array(tokens) + 1e-4), (ours, theirs)
    asked = [Instance("generate_until", {}, (f"Question: {q}\nAnswer:",
                                             {"until": ["\n"], "max_gen_toks": 12}), i)
             for i, (q, _, _) in enumerate(QUESTIONS[:4])]
    assert podrun.generate_until(asked) == hf.generate_until(asked)
