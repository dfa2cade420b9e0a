"""atomc's FX passes on the Dynamo graph: normalise, canonicalise to atomc ops, fuse, lower to a backend."""

import atomc.ops  # noqa: F401  (the passes name torch.ops.atomc.* at import time)
from atomc.passes.base import AtomcPass, PassResult
from atomc.passes.manager import PassManager, PassReport

__all__ = ["AtomcPass", "PassManager", "PassReport", "PassResult"]
