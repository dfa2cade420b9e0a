"""The decode CUDA-graph sizes: the default ladder, and checked explicit sizes."""

import pytest

from atomc.runtime.capture_sizes import default_capture_sizes, resolve_capture_sizes


def test_default_ladder():
    assert default_capture_sizes(256, 8192)[:5] == [1, 2, 4, 8, 16]
    assert default_capture_sizes(256, 8192)[-1] == 256
    assert default_capture_sizes(3, 8192) == [1, 2, 3]
    assert default_capture_sizes(256, 20)[-1] == 20  # never above the token budget


def test_explicit_sizes_are_sorted_and_checked():
    assert resolve_capture_sizes(None, 4, 8192) == [1, 2, 4]
    assert resolve_capture_sizes([8, 1, 8], 256, 8192) == [1, 8]
    with pytest.raises(ValueError, match="outside"):
        resolve_capture_sizes([0], 256, 8192)
    with pytest.raises(ValueError, match="outside"):
        resolve_capture_sizes([9000], 256, 8192)
