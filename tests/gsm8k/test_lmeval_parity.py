"""Our lm-eval protocol against lm-eval itself: same prompts, same extracted strings,
same exact_match, on a corpus of tricky replies; and the vllm protocol as documented.

lm-eval runs in its own venv (`make test-gsm8k-lmeval` builds .venv-lmeval) through
lmeval_reference.py: its real gsm8k.yaml, sampler, filters and metric, with the
documents read from the local files and a replay model that gives the corpus'
replies (what a server cannot be made to say). Skipped where lm-eval cannot be
imported, neither here nor in $KIMI_K3_MOE_LMEVAL_PYTHON.
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_k3_moe.gsm8k.data import load_gsm8k
from kimi_k3_moe.gsm8k.prompts import cut_at_stop
from kimi_k3_moe.gsm8k.protocols import PROTOCOLS, build_prompts

from .synthetic import make_problems


def _lmeval_python() -> str | None:
    candidates = [os.environ.get("KIMI_K3_MOE_LMEVAL_PYTHON")]
    if importlib.util.find_spec("lm_eval") is not None:
        candidates.append(sys.executable)
    for python in filter(None, candidates):
        if subprocess.run([python, "-c", "import lm_eval.evaluator"], capture_output=True).returncode == 0:
            return python
    return None


LMEVAL_PYTHON = _lmeval_python()
pytestmark = pytest.mark.skipif(
    LMEVAL_PYTHON is None,
    reason="lm-eval is not importable here nor in $KIMI_K3_MOE_LMEVAL_PYTHON (make test-gsm8k-lmeval installs it)")

# (gold '#### ...' text, reply, vllm protocol correct (strict, flexible))
CORPUS = [
    ("18", " 3 * 6 = 18\n#### 18", (True, True)),
    ("18", " #### 18.00", (True, False)),        # vLLM: last digits "00"
    ("18", " #### $18", (True, True)),
    ("18", " ####18", (True, True)),
    ("18", " #### 018", (True, False)),          # vLLM: "018" is no int literal
    ("18", " The answer is 18.00 dollars", (False, False)),
    ("18", " The answer is 18.", (False, True)),
    ("18", " The answer is $18.", (False, True)),
    ("18", " #### 18\nThat makes 18 apples in all.", (True, True)),
    ("18", " #### 18 apples, and 20 pears are left", (True, False)),
    ("18", " #### 17\n#### 18", (False, True)),
    ("18", " I cannot tell.", (False, False)),
    ("18", "", (False, False)),
    ("18", " #### eighteen", (False, False)),
    ("18", " 18", (False, True)),
    ("18", " #### 1,8", (True, True)),           # commas go before anything is read
    ("18", " The total is 18.5", (False, False)),
    ("18", " #### 18.", (True, True)),
    ("18", " #### 18..", (True, True)),
    ("18", " #### -18", (False, True)),
    ("18", " It is 9 + 9 = 18!", (False, True)),
    ("18", " ####  18", (True, True)),
    ("18", " #### 18 #### 19", (True, False)),
    ("18", "#### 18", (True, True)),
    ("18", " $18.00", (False, False)),
    ("18", " 18%", (False, True)),
    ("18", " #### 18\n\n", (True, True)),
    ("18", " The answer is 18,", (False, True)),
    ("18", " #### 18\nTHE END", (True, True)),
    ("18", " It costs $$ or ..", (False, False)),
    ("18", " 1.8.", (False, False)),
    ("18", " #### 18\r\n", (True, True)),
    ("18", " #### ,18", (True, True)),
    ("-3", " #### -3", (True, True)),            # vLLM's label is 3 too
    ("-3", " The change is -3 degrees.", (False, True)),
    ("-3", " #### 3", (False, True)),
    ("-3", " It drops to -3.", (False, True)),
    ("-3", " #### \u22123", (False, True)),       # a Unicode minus
    ("-3", " 20-23=-3", (False, True)),
    ("1250", " #### 1,250", (True, True)),
    ("1250", " The total is 1,250 apples.", (False, True)),
    ("1250", " #### 1250.0", (True, False)),
    ("1250", " 1 250", (False, False)),
    ("1,250", " #### 1250", (True, True)),
    ("1,250", " It is 1,250.", (False, True)),
    ("8", " 8", (False, True)),
    ("8", " The answer is 8.", (False, True)),
    ("8", " #### 8", (True, True)),
    ("8", " It is \u0668", (False, False)),       # an Arabic-Indic eight: vLLM's literal_eval refuses it
    ("0", " #### 0", (True, True)),
    ("0", " That leaves 00.", (False, True)),
    ("5", " #### 05", (True, False)),
    ("5", " It is 05 apples", (False, False)),
]
# The examples (gold 18): right by value, wrong for lm-eval
LMEVAL_WRONG = {" #### 18.00": ("strict", "flexible"), " #### $18": ("strict",), " ####18": ("strict",),
                " #### 018": ("strict", "flexible"), " The answer is 18.00 dollars": ("flexible",)}
SHOTS = 5


def _write_data(folder: Path, seed: int) -> dict[str, str]:
    """GSM8K-shaped files: 30 synthetic training problems, one test question per corpus reply."""
    folder.mkdir(parents=True)
    train = make_problems(random.Random(seed), 30)
    replies, rows = {}, []
    for i, (gold, reply, _) in enumerate(CORPUS):
        question = f"Case {i}: a shop has some apples. How many apples are left?"
        rows.append({"question": question, "answer": f"Some steps with 7 and 11.\n#### {gold}"})
        replies[question] = reply
    for name, split in (("train", train), ("test", rows)):
        with open(folder / f"{name}.jsonl", "w") as f:
            for r in split:
                f.write(json.dumps({"question": r["question"], "answer": r["answer"]}) + "\n")
    return replies


@pytest.fixture(scope="module")
def lmeval_run(tmp_path_factory, session_seed):
    root = tmp_path_factory.mktemp("lmeval")
    replies = _write_data(root / "data", session_seed)
    (root / "replies.json").write_text(json.dumps(replies))
    env = {**os.environ, "HF_HOME": str(root / "hf")}
    result = subprocess.run([LMEVAL_PYTHON, str(Path(__file__).with_name("lmeval_reference.py")),
                             str(root / "data"), str(root / "replies.json"), str(root / "out.json"),
                             str(len(CORPUS))], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return root / "data", json.loads((root / "out.json").read_text())


def test_lm_eval_protocol_matches_lm_eval(lmeval_run):
    data_dir, ref = lmeval_run
    proto = PROTOCOLS["lm-eval"]
    print(f"lm-eval {ref['lm_eval_version']}")
    # the task as lm-eval ran it: version, shots, seed, stop strings, greedy
    assert ref["task_version"] == 3.0 and ref["num_fewshot"] == SHOTS
    assert ref["fewshot_seed"] == proto.fewshot_seed
    assert ref["gen_kwargs"] == [{"do_sample": False, "temperature": 0.0, "until": list(proto.stop)}]

    train, test, _ = load_gsm8k(data_dir)
    prompts, shots = build_prompts(proto, train, test, SHOTS)
    docs = ref["docs"]
    assert [d["doc_id"] for d in docs] == list(range(len(CORPUS)))
    assert len({tuple(s) for s in shots}) > 1  # lm-eval's examples differ from question to question
    counts = {"strict": 0, "flexible": 0}
    for doc, prompt, problem, (_, reply, _) in zip(docs, prompts, test, CORPUS):
        assert doc["prompt"] == prompt, f"question {doc['doc_id']}: prompts differ"
        assert doc["reply"] == reply == cut_at_stop(reply, proto.stop)
        extracted, correct = proto.score(reply, problem)
        for metric, name in (("strict", "strict-match"), ("flexible", "flexible-extract")):
            theirs = doc["filters"][name]
            assert (extracted[metric], correct[metric]) == (theirs["extracted"], theirs["exact_match"] == 1.0), \
                (reply, metric, theirs)
            counts[metric] += correct[metric]
    assert ref["results"]["exact_match,strict-match"] == counts["strict"] / len(CORPUS)
    assert ref["results"]["exact_match,flexible-extract"] == counts["flexible"] / len(CORPUS)

    # the examples are wrong for lm-eval (and for us), though right by value
    by_reply = {d["reply"]: d for d in docs}
    for reply, metrics in LMEVAL_WRONG.items():
        for metric in metrics:
            name = {"strict": "strict-match", "flexible": "flexible-extract"}[metric]
            assert by_reply[reply]["filters"][name]["exact_match"] == 0.0, (reply, metric)
    assert by_reply[" 3 * 6 = 18\n#### 18"]["filters"]["strict-match"]["exact_match"] == 1.0


def test_vllm_protocol_scores_as_documented(lmeval_run):
    data_dir, _ = lmeval_run
    proto = PROTOCOLS["vllm"]
    _, test, _ = load_gsm8k(data_dir)
    for problem, (_, reply, (strict, flexible)) in zip(test, CORPUS):
        _, correct = proto.score(cut_at_stop(reply, proto.stop), problem)
        assert (correct["strict"], correct["flexible"]) == (strict, flexible), reply
