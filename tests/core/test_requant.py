"""The load path: chunked, device-aware conversion of a layer's experts, and its memory bound."""
import pytest
import torch

from kimi_k3_moe.experts import Int4Experts, Mxfp4Experts
from kimi_k3_moe.formats import int4, mxfp4
from kimi_k3_moe.kernels import get_backend
from kimi_k3_moe.loading import prepare_for
from kimi_k3_moe.weights.peak_memory import measure_peak
from kimi_k3_moe.weights.requant import conversion_device, requantize_experts


def random_experts(gen, e=6, h=256, i=64):
    def quantized(rows, cols):
        w = torch.randn(e, rows, cols, generator=gen) * 0.02
        w[..., 5] *= 15
        return mxfp4.quantize(w)

    w13_p, w13_s = quantized(2 * i, h)
    w2_p, w2_s = quantized(h, i)
    return Mxfp4Experts(w13_p, w13_s, w2_p, w2_s)


def same_bits(a: Int4Experts, b: Int4Experts) -> bool:
    for x, y in ((a.w13, b.w13), (a.w2, b.w2)):
        for field in ("packed", "scales", "offsets"):
            u, v = getattr(x, field), getattr(y, field)
            if (u is None) != (v is None) or (u is not None and not torch.equal(u.cpu(), v.cpu())):
                return False
    return a.method == b.method


@pytest.mark.parametrize("method", int4.METHODS)
def test_chunked_conversion_equals_whole_tensor_bit_for_bit(gen, method):
    experts = random_experts(gen, e=4)
    whole = requantize_experts(experts, method=method, chunk_bytes=1 << 40, device="cpu", progress=False)
    per_row = int4.scratch_bytes_per_row(256, method)
    for chunk_bytes in (200 * per_row, 700 * per_row):  # chunk edges fall inside experts
        chunked = requantize_experts(experts, method=method, chunk_bytes=chunk_bytes, device="cpu",
                                     progress=False)
        assert same_bits(whole, chunked), chunk_bytes
    # And equal to converting each tensor in one call of the format code.
    direct = int4.requantize(experts.w13_packed, experts.w13_scale, method=method, chunk_bytes=1 << 40)
    assert torch.equal(direct.packed, whole.w13.packed) and torch.equal(direct.scales, whole.w13.scales)


@pytest.mark.parametrize("method", int4.METHODS)
def test_peak_scratch_stays_within_two_chunks(gen, method):
    experts = random_experts(gen, e=8, h=512, i=128)
    chunk_bytes = 1 << 20  # the layer's own scratch in one piece would be several times this
    whole_scratch = experts.num_experts * (2 * 128 * int4.scratch_bytes_per_row(512, method)
                                           + 512 * int4.scratch_bytes_per_row(128, method))
    assert whole_scratch > 4 * chunk_bytes
    requantize_experts(experts, method=method, device="cpu", progress=False)  # build tables first
    result, peak = measure_peak(
        lambda: requantize_experts(experts, method=method, chunk_bytes=chunk_bytes, device="cpu",
                                   progress=False), "cpu")
    assert peak.retained_bytes == result.nbytes
    assert 0 < peak.extra_bytes <= 2 * chunk_bytes, peak


def test_measure_peak_sees_transient_allocations():
    def spike():
        scratch = torch.ones(1 << 20, dtype=torch.float64)  # 8 MiB, freed before returning
        return scratch[:1024].clone()

    result, peak = measure_peak(spike, "cpu")
    assert peak.retained_bytes == result.numel() * 8
    assert peak.peak_bytes >= 8 << 20


def test_progress_counts_every_expert_of_both_tensors(gen):
    experts = random_experts(gen, e=5)
    seen = []
    for packed, scales in ((experts.w13_packed, experts.w13_scale), (experts.w2_packed, experts.w2_scale)):
        per_row = int4.scratch_bytes_per_row(packed.shape[-1] * 2, "search")
        int4.requantize(packed, scales, method="search", chunk_bytes=60 * per_row, progress=seen.append)
    assert sum(seen) == 2 * experts.num_experts and len(seen) > 2


def test_conversion_device_prefers_the_gpu():
    assert conversion_device("cpu", torch.device("cpu")) == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert conversion_device(None, torch.device("cpu")).type == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("method", int4.METHODS)
def test_gpu_conversion_equals_cpu_bit_for_bit(gen, method):
    experts = random_experts(gen, e=4, h=512, i=128)
    on_cpu = requantize_experts(experts, method=method, device="cpu", progress=False)
    on_gpu = requantize_experts(experts, method=method, device="cuda", chunk_bytes=300_000, progress=False)
    assert on_gpu.device.type == "cpu"  # results land where the experts were
    assert same_bits(on_cpu, on_gpu)
    resident = requantize_experts(experts.to("cuda"), method=method, progress=False)
    assert resident.device.type == "cuda" and same_bits(on_cpu, resident)


def test_torch_backend_takes_preconverted_experts_of_its_method_only(gen):
    experts = random_experts(gen, e=3)
    backend = get_backend("torch", weight_format="int4")
    assert backend.int4_method == int4.DEFAULT_METHOD
    converted = requantize_experts(experts, progress=False)
    assert backend.prepare(converted) is converted
    assert same_bits(prepare_for(backend, experts), converted)  # the load path converts
    with pytest.raises(ValueError, match="use int4 method 'asym'.*configured for 'search'"):
        backend.prepare(requantize_experts(experts, method="asym", progress=False))
    with pytest.raises(ValueError, match="weight_format='mxfp4' was given int4 experts"):
        get_backend("torch").prepare(converted)
    with pytest.raises(ValueError, match="int4_method 'fancy'"):
        get_backend("torch", weight_format="int4", int4_method="fancy")
    assert "asym" in get_backend("torch", weight_format="int4", int4_method="asym").describe()


def test_int4_experts_check_their_shapes(gen):
    converted = requantize_experts(random_experts(gen, e=2), progress=False)
    with pytest.raises(ValueError, match="Int4Experts.w2 shape"):
        Int4Experts(converted.w13, converted.w13)
    assert converted.select([1]).num_experts == 1
