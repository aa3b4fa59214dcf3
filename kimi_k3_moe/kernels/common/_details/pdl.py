"""Programmatic dependent launch (NVIDIA sm_90+, `MoEConfig.pdl`).

Under it, the launches of one forward after the first start while the launch before them is
still draining: each kernel lets the next one's programs be scheduled as soon as its own are
all running (`griddepcontrol.launch_dependents`) and waits for the one before it to finish,
its writes visible (`griddepcontrol.wait`), before it reads what that one wrote. Every
kernel waits so, so a finished launch implies all earlier ones finished (kernels read
buffers written two or more launches back). Both instructions are no-ops for a kernel not
launched as a dependent. A kernel with PDL must write nothing before its wait.
"""
import triton
import triton.language as tl

try:  # Triton 3.4+: the griddepcontrol ops and the launch_pdl option
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    AVAILABLE = "launch_pdl" in CUDAOptions.__dataclass_fields__
except ImportError:
    AVAILABLE = False

if not AVAILABLE:  # never called (the backend turns pdl off), but the kernels must still compile
    @triton.jit
    def gdc_wait():
        return

    gdc_launch_dependents = gdc_wait


@triton.jit
def let_next_start(PDL: tl.constexpr):
    """The next launch may start its programs once every program of this one has called this."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Block until the launch before this one has finished and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def enter(PDL: tl.constexpr):
    """At the top of a kernel that reads its predecessor's output from the start."""
    let_next_start(PDL)
    wait_for_previous(PDL)
