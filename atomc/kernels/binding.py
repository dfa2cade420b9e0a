"""What every backend's op bindings share: a backend op's fake implementation is the atomc op's.

Calling the atomc op on fake tensors reaches its fake impl, so the shapes a backend op promises
have one source of truth (atomc/ops), whatever the backend.
"""

from __future__ import annotations

import torch


def fake_as_atomc(namespace: str, name: str) -> None:
    torch.library.register_fake(f"{namespace}::{name}")(
        lambda *args, **kwargs: getattr(torch.ops.atomc, name).default(*args, **kwargs)
    )
