"""Fuzzing a small synthetic checkpoint: every corruption ends in CheckpointError (or ConfigError for
config.json), or in a load equal to the original; never another exception type, never a hang."""
import random
import shutil
import signal
import struct
import time

import pytest
import torch

from kimi_k3_moe.configs import ConfigError, K3MoEConfig
from kimi_k3_moe.weights import CheckpointError, CheckpointReader, read_layer_experts, read_router
from kimi_k3_moe.weights.checkpoint import INDEX_FILE
from kimi_k3_moe.weights.synthetic import make_checkpoint
from kimi_k3_moe.weights.validate import validate_experts

SHAPE = dict(num_layers=2, hidden_size=64, routed_expert_hidden_size=64, moe_intermediate_size=64,
             num_experts=4, num_experts_per_token=2, num_shared_experts=0)
CASE_SECONDS = 10


def load_all(path):
    cfg = K3MoEConfig.from_hf_config(path)
    reader = CheckpointReader(path)
    out = []
    for layer in cfg.require_moe_layers():  # as the loaders do: a config without MoE layers is refused
        experts = read_layer_experts(reader, layer, hidden_size=cfg.routed_expert_hidden_size,
                                     intermediate_size=cfg.moe_intermediate_size, num_experts=cfg.num_experts)
        validate_experts(experts, layer=f"layer {layer}", env={})
        out += [*experts.tensors(), *read_router(reader, layer)]
    return out


def _timeout(signum, frame):
    raise TimeoutError(f"a corrupted checkpoint took more than {CASE_SECONDS} s to load")


def run_case(folder, original, expected_errors):
    """'error' or 'loaded'; fails the test on anything else."""
    old = signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(CASE_SECONDS)
    try:
        loaded = load_all(folder)
    except expected_errors as exc:
        assert str(exc), "an empty error message"
        return "error"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert len(loaded) == len(original) and all(torch.equal(a, b) for a, b in zip(loaded, original)), \
        "a corrupted checkpoint loaded different tensors without an error"
    return "loaded"


@pytest.fixture
def pristine(tmp_path, seed):
    single = make_checkpoint(tmp_path / "single", seed=seed, **SHAPE)
    sharded = make_checkpoint(tmp_path / "sharded", seed=seed, shards=2, **SHAPE)
    return single, sharded


def corrupt_cases(single, sharded, rng):
    """(folder to copy, file in it, new bytes of that file, errors allowed)."""
    weights = single / "model.safetensors"
    shard = sorted(sharded.glob("*.safetensors"))[0]
    cases = []
    for target, folder in ((weights, single), (shard, sharded)):
        data = target.read_bytes()
        header_end = 8 + struct.unpack("<Q", data[:8])[0]
        offsets = set(range(0, 17)) | {header_end - 1, header_end, header_end + 1, len(data) - 1}
        offsets |= {rng.randrange(17, header_end) for _ in range(60)}
        offsets |= {rng.randrange(header_end, len(data)) for _ in range(60)}
        cases += [(folder, target.name, data[:n], CheckpointError) for n in sorted(offsets)]
        for _ in range(300 if target is weights else 100):
            pos = rng.randrange(0, header_end)
            flipped = bytearray(data)
            flipped[pos] ^= 1 << rng.randrange(8)
            cases.append((folder, target.name, bytes(flipped), CheckpointError))
    for name, folder, errors in ((INDEX_FILE, sharded, CheckpointError),
                                 ("config.json", single, (ConfigError, CheckpointError))):
        text = (folder / name).read_bytes()
        cases += [(folder, name, text[:n], errors) for n in sorted({rng.randrange(len(text)) for _ in range(40)})]
        for _ in range(60):
            flipped = bytearray(text)
            flipped[rng.randrange(len(text))] ^= 1 << rng.randrange(8)
            cases.append((folder, name, bytes(flipped), errors))
    return cases


def test_corruptions_end_in_a_checkpoint_error_or_a_correct_load(pristine, tmp_path, seed):
    single, sharded = pristine
    originals = {single: load_all(single), sharded: load_all(sharded)}
    rng = random.Random(seed)
    outcomes = {"error": 0, "loaded": 0}
    start = time.perf_counter()
    work = tmp_path / "work"
    for folder, name, data, errors in corrupt_cases(single, sharded, rng):
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(folder, work)
        (work / name).write_bytes(data)
        try:
            outcomes[run_case(work, originals[folder], errors)] += 1
        except AssertionError as exc:
            raise AssertionError(f"{name} corrupted (seed {seed}): {exc}") from exc
        except Exception as exc:
            raise AssertionError(f"{name} corrupted (seed {seed}) raised {type(exc).__name__}: {exc}") from exc
    tried = sum(outcomes.values())
    print(f"checkpoint fuzz: {tried} corruptions tried: {outcomes['error']} refused with a named error, "
          f"{outcomes['loaded']} harmless and loaded equal; {time.perf_counter() - start:.1f} s")
    assert tried >= 800 and outcomes["error"] >= tried // 2


def test_errors_name_the_file(pristine, tmp_path):
    single, sharded = pristine
    weights = single / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"single/model\.safetensors is not a readable safetensors file"):
        CheckpointReader(single)
    shard = sorted(sharded.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"lists 1 shard\(s\) that are missing: {shard.name}"):
        CheckpointReader(sharded)
    (sharded / INDEX_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json is not valid JSON: .*line 1 column 2"):
        CheckpointReader(sharded)
    (single / "config.json").write_text('{"text_config": ')
    with pytest.raises(ConfigError, match=r"single/config\.json is not valid JSON"):
        K3MoEConfig.from_hf_config(single)
