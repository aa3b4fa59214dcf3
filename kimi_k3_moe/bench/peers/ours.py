"""Our own backends as bench rows (triton, flydsl, torch; each weight format)."""
from __future__ import annotations

from kimi_k3_moe.bench.peers.base import OURS, Peer, PeerUnavailable, Runner
from kimi_k3_moe.kernels import BackendUnavailable, get_backend
from kimi_k3_moe.loading import prepare_for


class OursPeer(Peer):
    role = OURS

    def __init__(self, backend: str, weight_format: str = "mxfp4", **options):
        self.backend_name, self.weight_format, self.options = backend, weight_format, options
        act = options.get("act_dtype")
        self.name = f"ours_{backend}_{weight_format}" + (f"_{act}" if act else "")
        self.label = f"ours {backend} {weight_format}" + (f" ({act} activations)" if act else "")

    def _backend(self):
        return get_backend(self.backend_name, weight_format=self.weight_format, **self.options)

    def probe(self) -> tuple[bool, str]:
        try:
            return self._backend().available()
        except (BackendUnavailable, ValueError, TypeError) as exc:
            return False, str(exc)

    def build(self, experts, activation, shape, expert_map) -> Runner:
        try:
            be = self._backend()
            be.require_available()
            prepared = prepare_for(be, experts)
        except (BackendUnavailable, ValueError, TypeError) as exc:
            raise PeerUnavailable(str(exc)) from exc

        def run(hidden, routed):
            weights, ids = routed
            return be.forward(prepared, hidden, weights, ids, activation, expert_map)
        exact = self.weight_format == "mxfp4" and not be.act_quant.quantizes
        # a lossy format is judged on the weights it encodes, not on MXFP4's
        ref_w = None if exact else (lambda e: be.dequantize_prepared(prepared, e)[0],
                                    lambda e: be.dequantize_prepared(prepared, e)[1])
        # quantized activations are judged against a reference rounding them the same way
        runner = Runner(run=run, activation=activation, reference_weights=ref_w,
                        act_quant=be.act_quant if be.act_quant.quantizes else None)
        runner.backend, runner.prepared = be, prepared
        if hasattr(be, "lookup"):
            runner.config_source = lambda t: be.lookup(prepared, t).source
        return runner
