"""Answer extraction, prompt format, data loading and the gate: no server needed."""
import json
import random
import sys

import pytest

from kimi_k3_moe.gsm8k.answers import canonical, flexible_answer, gold_answer, strict_answer
from kimi_k3_moe.gsm8k.data import DataError, load_gsm8k, read_split
from kimi_k3_moe.gsm8k.gate import make_gate
from kimi_k3_moe.gsm8k.prompts import STOP, build_prompt, cut_at_stop, few_shot_prefix

from .synthetic import MODES, make_problems, write_gsm8k


@pytest.mark.parametrize("reply, strict, flexible", [
    (" She pays 3 * 4 = 12 dollars.\n#### 12", "12", "12"),
    (" The total is 1,250 apples.", None, "1250"),
    (" #### 1,250\n", "1250", "1250"),
    (" #### $18.00", "18", "18"),
    (" It costs $2.50 each, so 5 cost 12.5.", None, "12.5"),
    (" #### 7\nThat is 8 with one more.", "7", "8"),
    (" The change is -3 degrees.", None, "-3"),
    (" 20-5=15", None, "15"),
    (" (4)-2 leaves 2 apples.", None, "2"),
    (" She has 42.", None, "42"),
    (" No idea.", None, None),
    ("", None, None),
    (" #### 5 and later #### 6", "5", "6"),  # strict takes the first, as lm-eval's strict-match
])
def test_extraction(reply, strict, flexible):
    assert strict_answer(reply) == strict
    assert flexible_answer(reply) == flexible


def test_canonical_forms_compare_by_value():
    assert canonical("1,000") == canonical("1000.0") == canonical("$1000") == "1000"
    assert canonical("-0") == "0" and canonical("2.50") == "2.5"
    with pytest.raises(ValueError, match="not a number"):
        canonical("12a")


def test_synthetic_replies_score_as_designed(seed):
    for p in make_problems(random.Random(seed), 40):
        gold = gold_answer(p["answer"])
        assert gold == str(p["value"])
        scored = {m: cut_at_stop(f(p)) for m, f in MODES.items()}
        assert (strict_answer(scored["right"]), flexible_answer(scored["right"])) == (gold, gold)
        assert (strict_answer(scored["flexible_only"]), flexible_answer(scored["flexible_only"])) == (None, gold)
        assert strict_answer(scored["strict_only"]) == gold != flexible_answer(scored["strict_only"])
        assert gold not in (strict_answer(scored["wrong"]), flexible_answer(scored["wrong"]))


def test_prompt_is_question_answer_blocks_then_the_question():
    prefix = few_shot_prefix([("Q1?", "A1\n#### 1"), ("Q2?", "A2\n#### 2")])
    assert build_prompt(prefix, "Q3?") == (
        "Question: Q1?\nAnswer: A1\n#### 1\n\nQuestion: Q2?\nAnswer: A2\n#### 2\n\nQuestion: Q3?\nAnswer:")
    assert build_prompt(few_shot_prefix([]), "Q?") == "Question: Q?\nAnswer:"
    assert "Question" in STOP
    assert cut_at_stop(" #### 4\n\nQuestion: more") == " #### 4\n\n"
    assert cut_at_stop(" #### 4 Assistant: junk") == " #### 4 "


def test_data_folder_loads_and_bad_records_are_named(tmp_path, seed):
    train, test = write_gsm8k(tmp_path, random.Random(seed), n_train=3, n_test=5)
    got_train, got_test, source = load_gsm8k(tmp_path)
    assert [p.question for p in got_test] == [p["question"] for p in test]
    assert [p.gold for p in got_train] == [str(p["value"]) for p in train]
    assert source == str(tmp_path.resolve())

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "a\n#### 1"}) + "\n\n" + json.dumps({"question": "q"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:3: field 'answer' is missing"):
        read_split(bad)
    bad.write_text(json.dumps({"question": "q", "answer": "no final line"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1: field 'answer': answer has no '#### <number>'"):
        read_split(bad)
    bad.write_text("{oops\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1: not JSON"):
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
    g = make_gate(0.95, 0.94, None)
    assert g.passes(0.94) and not g.passes(0.9399) and g.metric == "flexible"
    g = make_gate(0.95, None, None, "strict")  # vLLM's default relative tolerance
    assert g.rtol == 0.08 and g.metric == "strict"
    assert g.passes(437 / 500) and not g.passes(436 / 500)  # bar is 0.874, float noise aside
    assert make_gate(0.5, None, 0.1).bar == pytest.approx(0.45)
    assert make_gate(None, 0.3, None).rule == "flexible accuracy >= 0.3"
    for bad, msg in [((0.9, 0.8, 0.1), "not both"), ((None, None, 0.1), "relative to --baseline"),
                     ((1.5, None, None), "--baseline 1.5 is outside"), ((0.9, None, 1.0), "--rtol 1.0 is outside")]:
        with pytest.raises(ValueError, match=msg):
            make_gate(*bad)
