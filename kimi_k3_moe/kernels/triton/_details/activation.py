"""Stage-1 epilogue activations, in fp32, on the full-K gate and up sums."""
import triton
import triton.language as tl

from kimi_k3_moe.kernels.triton._details import constants as C

ACT_SILU = tl.constexpr(C.ACT_SILU)
ACT_SITU = tl.constexpr(C.ACT_SITU)
ACT_SITU_NO_LINEAR = tl.constexpr(C.ACT_SITU_NO_LINEAR)


@triton.jit
def _sigmoid(z):
    # exp overflows to inf for very negative z, and 1/(1+inf) is the right 0.
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _tanh(z):
    # tanh(z) = 2*sigmoid(2z) - 1 saturates correctly at both ends: sigmoid
    # of a large |2z| is exactly 0 or 1 in fp32, where exp-based tanh forms overflow to inf/inf = nan.
    return 2.0 * _sigmoid(2.0 * z) - 1.0


@triton.jit
def apply_activation(gate, up, beta, linear_beta, ACT: tl.constexpr):
    """act(gate) * up for silu; SiTUv2 with runtime betas otherwise.

    ACT is part of the compiled specialisation; the betas are runtime fp32
    arguments, so no two activations or beta pairs can share a binary's result.
    """
    tl.static_assert(ACT == ACT_SILU or ACT == ACT_SITU or ACT == ACT_SITU_NO_LINEAR,
                     "unsupported activation code")
    if ACT == ACT_SILU:
        out = gate * _sigmoid(gate) * up
    else:
        g = beta * _tanh(gate / beta) * _sigmoid(gate)
        if ACT == ACT_SITU:
            out = g * (linear_beta * _tanh(up / linear_beta))
        else:
            out = g * up
    return out
