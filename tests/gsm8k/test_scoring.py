"""Answer extraction, prompt format, data loading and the gate: no server needed.
lm-eval's own scoring and prompts are compared in test_lmeval_parity.py."""
import json
import random
import sys

import pytest

from kimi_k3_moe.gsm8k.answers_vllm import canonical, flexible_answer, gold_answer, strict_answer
from kimi_k3_moe.gsm8k.data import DataError, load_gsm8k, read_split
from kimi_k3_moe.gsm8k.gate import make_gate
from kimi_k3_moe.gsm8k.prompts import build_prompt, cut_at_stop
from kimi_k3_moe.gsm8k.protocols import PROTOCOLS, build_prompts

from .synthetic import MODES, make_problems, write_gsm8k


# the vllm protocol: strict is ours (by value), flexible is vLLM's script (last digits, an int)
@pytest.mark.parametrize("reply, strict, flexible", [
    (" She pays 3 * 4 = 12 dollars.\n#### 12", "12", "12"),
    (" The total is 1,250 apples.", None, "1250"),
    (" #### 1,250\n", "1250", "1250"),
    (" #### $18.00", "18", "0"),   # vLLM reads the digits after the point
    (" It costs $2.50 each, so 5 cost 12.5.", None, "5"),
    (" #### 7\nThat is 8 with one more.", "7", "8"),
    (" The change is -3 degrees.", None, "3"),  # no sign in vLLM's score
    (" #### -3", "-3", "3"),
    (" 20-5=15", None, "15"),
    (" (4)-2 leaves 2 apples.", None, "2"),
    (" She has 42.", None, "42"),
    (" #### 018", "18", None),      # not a Python int literal
    (" That leaves 00.", None, "0"),
    (" No idea.", None, None),
    ("", None, None),
    (" #### 5 and later #### 6", "5", "6"),
])
def test_vllm_protocol_extraction(reply, strict, flexible):
    assert strict_answer(reply) == strict
    assert flexible_answer(reply) == flexible


def test_canonical_forms_compare_by_value():
    assert canonical("1,000") == canonical("1000.0") == canonical("$1000") == "1000"
    assert canonical("-0") == "0" and canonical("2.50") == "2.5"
    with pytest.raises(ValueError, match="not a number"):
        canonical("12a")


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_synthetic_replies_score_as_designed(seed, tmp_path, protocol):
    proto = PROTOCOLS[protocol]
    write_gsm8k(tmp_path, random.Random(seed), n_train=3, n_test=40)
    _, test, _ = load_gsm8k(tmp_path)
    for problem, p in zip(test, _written(tmp_path)):
        assert gold_answer(problem.answer) == problem.gold == str(p["value"])
        correct = {m: proto.score(cut_at_stop(f(p), proto.stop), problem)[1] for m, f in MODES.items()}
        assert correct["right"] == {"strict": True, "flexible": True}
        assert correct["flexible_only"] == {"strict": False, "flexible": True}
        assert correct["strict_only"] == {"strict": True, "flexible": False}
        assert correct["wrong"] == {"strict": False, "flexible": False}


def _written(folder):
    with open(folder / "test.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return [{**r, "value": int(r["answer"].rsplit("#### ", 1)[1].replace(",", ""))} for r in rows]


def test_prompt_is_question_answer_blocks_then_the_question():
    assert build_prompt([("Q1?", "A1\n#### 1"), ("Q2?", "A2\n#### 2")], "Q3?") == (
        "Question: Q1?\nAnswer: A1\n#### 1\n\nQuestion: Q2?\nAnswer: A2\n#### 2\n\nQuestion: Q3?\nAnswer:")
    assert build_prompt([], "Q?") == "Question: Q?\nAnswer:"
    vllm, lm_eval = PROTOCOLS["vllm"], PROTOCOLS["lm-eval"]
    assert vllm.stop == ("Question", "Assistant:", "<|separator|>")
    assert lm_eval.stop == ("Question:", "</s>", "<|im_end|>")
    assert cut_at_stop(" #### 4\n\nQuestion: more", vllm.stop) == " #### 4\n\n"
    assert cut_at_stop(" #### 4 Assistant: junk", vllm.stop) == " #### 4 "
    assert cut_at_stop(" #### 4 Questions<|im_end|>junk", lm_eval.stop) == " #### 4 Questions"


def test_protocols_pick_their_examples(tmp_path, seed):
    write_gsm8k(tmp_path, random.Random(seed), n_train=20, n_test=6)
    train, test, _ = load_gsm8k(tmp_path)
    prompts, shots = build_prompts(PROTOCOLS["vllm"], train, test, 5)
    assert shots == [[0, 1, 2, 3, 4]] * 6  # vLLM's script: the first five, for every question
    prompts, shots = build_prompts(PROTOCOLS["lm-eval"], train, test, 5)
    rng = random.Random(1234)  # lm-eval: one generator, one draw per question in test order
    assert shots == [rng.sample(range(20), 5) for _ in range(6)]
    assert len({tuple(s) for s in shots}) > 1
    assert prompts[0].startswith(f"Question: {train[shots[0][0]].question}\nAnswer: {train[shots[0][0]].answer}\n\n")
    # the first questions' prompts do not depend on how many are asked (lm-eval's --limit)
    assert build_prompts(PROTOCOLS["lm-eval"], train, test[:2], 5)[0] == prompts[:2]


def test_data_folder_loads_and_bad_records_are_named(tmp_path, seed):
    train, test = write_gsm8k(tmp_path, random.Random(seed), n_train=3, n_test=5)
    got_train, got_test, source = load_gsm8k(tmp_path)
    assert [p.question for p in got_test] == [p["question"] for p in test]
    assert [p.gold for p in got_train] == [str(p["value"]) for p in train]
    assert source == str(tmp_path.resolve())

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "a\n#### 1"}) + "\n\n" + json.dumps({"question": "q"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl: line 3: field 'answer' is missing"):
        read_split(bad)
    bad.write_text(json.dumps({"question": "q", "answer": "no final line"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl: line 1: field 'answer': answer has no '#### <number>'"):
        read_split(bad)
    bad.write_text("{oops\n")
    with pytest.raises(DataError, match=r"bad.jsonl: line 1 column 2: not JSON: Expecting property name"):
        read_split(bad)
    # a raw control character inside a string: json's message alone has no position
    bad.write_text(json.dumps({"question": "q", "answer": "a\n#### 1"}) + "\n" + '{"question": "a\tb"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl: line 2 column 16: not JSON: Invalid control character at$"):
        read_split(bad)
    bad.write_bytes(b'{"question": "caf\xe9", "answer": "#### 1"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl: line 1 column 18: not UTF-8 \(byte 0xe9\)"):
        read_split(bad)

    (tmp_path / "train.jsonl").unlink()
    with pytest.raises(DataError, match=r"lacks train.jsonl: put GSM8K's train.jsonl and test.jsonl"):
        load_gsm8k(tmp_path)


def test_without_a_folder_or_datasets_the_error_says_where_to_put_the_files(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(DataError, match=r"`datasets` package is not installed: put GSM8K's train.jsonl"):
        load_gsm8k(None)


def test_hub_loader_is_asked_for_openai_gsm8k_main(monkeypatch, seed):
    """`datasets` is not installed here and the hub is out of reach: a stand-in module
    checks that we ask for the right dataset and read its rows."""
    rows = make_problems(random.Random(seed), 4)
    calls = []

    class StandIn:
        @staticmethod
        def load_dataset(*args):
            calls.append(args)
            return {"train": rows[:1], "test": [{"question": r["question"], "answer": r["answer"]} for r in rows[1:]]}

    monkeypatch.setitem(sys.modules, "datasets", StandIn)
    train, test, source = load_gsm8k(None)
    assert calls == [("openai/gsm8k", "main")] and source == "huggingface:openai/gsm8k/main"
    assert len(train) == 1 and [p.gold for p in test] == [str(r["value"]) for r in rows[1:]]


def test_gate_rules():
    assert make_gate(None, None, None) is None
    g = make_gate(None, 0.94, None)
    assert g.passes(0.94) and not g.passes(0.9399) and g.metric == "flexible"
    g = make_gate(0.95, None, None, "strict")  # vLLM's default relative tolerance
    assert g.rtol == 0.08 and g.metric == "strict"
    assert g.passes(437 / 500) and not g.passes(436 / 500)  # bar is 0.874, float noise aside
    assert make_gate(0.5, None, 0.1).bar == pytest.approx(0.45)
    assert make_gate(None, 0.3, None).rule == "flexible accuracy >= 0.3"
    for bad, msg in [((0.9, 0.8, 0.1), "--threshold and --baseline and --rtol are two different gates"),
                     ((0.9, 0.8, None), "--threshold and --baseline are two different gates: give "
                                        r"--threshold T or --baseline B \[--rtol R\], not both"),
                     ((None, 0.8, 0.1), "--threshold and --rtol are two"),
                     ((None, None, 0.1), "relative to --baseline"),
                     ((1.5, None, None), "--baseline 1.5 is outside"), ((0.9, None, 1.0), "--rtol 1.0 is outside")]:
        with pytest.raises(ValueError, match=msg):
            make_gate(*bad)
