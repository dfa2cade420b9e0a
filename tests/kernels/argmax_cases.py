"""Rows with planted argmax edge cases, for the Triton argmax tests (interpreter and GPU)."""

import torch

INF, NAN, TOP = float("inf"), float("nan"), 10.0  # TOP is above every clamped random value


def planted_rows(rows: int, vocab: int, chunk: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[rows, vocab] random logits in [-5, 5], row r with case r % 9 planted (c = chunk; a position
    past the vocab wraps around). At vocab 3c + 5 the argmaxes are
    [c+5, 10, 2c+1, 0, c+3, 7, c, 2c, 3c+4]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g).clamp_(-5, 5)
    c = chunk
    cases = [
        {c + 5: TOP, 2 * c + 1: TOP, 3 * c + 4: TOP},  # equal maxima in different chunks
        {10: TOP, 700: TOP, 2 * c + 7: TOP},  # equal maxima within one chunk (and a later one)
        {5: TOP, 2 * c + 1: NAN, 3 * c + 2: NAN},  # NaN beats the maximum; the first NaN wins
        "all -inf",
        {c + 3: -1.0, c + 9: -1.0},  # -inf everywhere else
        {7: INF, 2 * c + 3: INF},  # +inf ties
        {3: INF, c: NAN, 2 * c + 2: NAN},  # NaN beats +inf
        {2 * c: TOP, 3 * c + 4: TOP},  # a chunk's first element
        {3 * c + 4: TOP},  # the row's last element at vocab 3c + 5
    ]
    for r in range(rows):
        case = cases[r % len(cases)]
        if case == "all -inf":
            x[r] = -INF
            continue
        if r % len(cases) == 4:
            x[r] = -INF
        for pos, val in case.items():
            x[r, pos % vocab] = val
    return x.to(dtype)
