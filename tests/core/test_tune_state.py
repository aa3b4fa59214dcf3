"""The tune loop's resume file: a damaged one costs a fresh start, never an exception."""
import json

import pytest

from kimi_k3_moe.tune.loop import State

FINGERPRINT = {"shape": "tiny", "backend": "triton"}


@pytest.mark.parametrize("text", ["{", "[1, 2]", "null", '"text"',  # a list raised AttributeError
                                  json.dumps({"fingerprint": FINGERPRINT, "results": [1]}),
                                  json.dumps({"fingerprint": FINGERPRINT, "results": {"1": 5}})])
def test_a_damaged_state_file_starts_afresh(tmp_path, text):
    path = tmp_path / "s.json"
    path.write_text(text)
    state = State(path, FINGERPRINT)
    assert state.results == {} and state.resumed == 0


def test_a_matching_state_file_resumes(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"fingerprint": FINGERPRINT, "results": {"1": {"a": {"status": "timed"}}}}))
    assert State(path, FINGERPRINT).resumed == 1
    assert State(path, {**FINGERPRINT, "shape": "tp8"}).resumed == 0
