"""Row-count bands: ``((first_rows, choice), ...)``, the shape of every per-pass-size choice the
runtime measures (the precision of a pass, the matmul kernel of a projection)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

__all__ = ["band_for", "bands_from_choices", "check_bands"]

Bands = tuple[tuple[int, str], ...]


def check_bands(bands: Bands, valid: Collection[str], what: str) -> None:
    """Bands start at 1 row, at increasing row counts, each naming one of ``valid``."""
    if not bands or bands[0][0] != 1:
        raise ValueError(f"{what} bands must start at 1 row: {bands!r}")
    if any(later[0] <= earlier[0] for earlier, later in zip(bands, bands[1:])):  # noqa: B905 - offset pairs
        raise ValueError(f"{what} bands must start at increasing row counts: {bands!r}")
    unknown = [c for _, c in bands if c not in valid]
    if unknown:
        raise ValueError(f"unknown {what} {unknown[0]!r}; valid: {', '.join(valid)}")


def band_for(bands: Bands, rows: int) -> str:
    """The choice of the last band starting at or below ``rows``."""
    chosen = bands[0][1]
    for first, choice in bands:
        if first > rows:
            break
        chosen = choice
    return chosen


def bands_from_choices(choices: Sequence[tuple[int, str]]) -> Bands:
    """Bands from choices measured at increasing sizes: a pass of r rows goes by the smallest
    measured size ≥ r (past the largest, by the largest), equal neighbours merged."""
    bands: list[tuple[int, str]] = []
    first = 1
    for size, choice in choices:
        if not bands or bands[-1][1] != choice:
            bands.append((first, choice))
        first = size + 1
    return tuple(bands)
