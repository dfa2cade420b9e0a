"""The int arguments a kernel keeps out of Triton's alignment classes: those that follow the step's
token count.

Triton compiles a variant of a kernel per class of each int argument (1, a multiple of 16, other). A
token or pair count specialized that way gives a serving step of 49 tokens other variants than the
start-up forwards compiled at powers of two (runtime/capture_sizes.warm_up_sizes), so the first step of
another class compiled them while every request in flight waited. These counts only bound masks
along the rows, never the contiguous dimension, so their alignment buys no vector loads; the == 1
class (one-token decode) stays. tests/kernels/test_token_count_variants.py runs each kernel of a step
at token counts of every class and finds any argument this misses.
"""

from __future__ import annotations

# off: the kernels specialize their token counts again (the other arm of a timing A/B)
TOKEN_COUNTS_UNALIGNED = True


def token_counts(*names: str) -> list[str]:
    """For `@triton.jit(do_not_specialize_on_alignment=...)`: the arguments that count tokens or pairs."""
    return list(names) if TOKEN_COUNTS_UNALIGNED else []
