"""The one numeric comparison of the Python tests (the twin of tests/support/numeric.h).

A NaN or an infinity in either operand fails unless the caller allows it at that place (both
operands then hold the same non-finite value there): `np.max` of an array with a NaN is NaN, and
`NaN > tol` is false, so a bare `if np.max(err) > tol: fail` lets a NaN through.

The checks raise `NumericMismatch` (an AssertionError), never use `assert`, so they also fail
under `python -O`.
"""
from dataclasses import dataclass

import numpy as np


class NumericMismatch(AssertionError):
    pass


def check(condition, message):
    """`assert condition, message` that `python -O` does not remove."""
    if not condition:
        raise AssertionError(message() if callable(message) else message)


def _array(x):
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().to("cpu").double().numpy()
    return np.asarray(x, dtype=np.float64)


@dataclass
class Difference:
    worst: float  # max |got - want|; NaN when a non-finite value was found or the shapes differ
    scale: float  # max |want|
    index: tuple  # where `worst` was found, or the first non-finite value
    got: float
    want: float
    problem: str  # empty, or why `worst` is NaN

    def describe(self):
        if self.problem:
            return self.problem
        return (f"worst |got - want| {self.worst:.6g} at index {self.index} (got {self.got:.9g}, "
                f"want {self.want:.9g}); max |want| {self.scale:.6g}")


def difference(got, want, allow_nonfinite=None):
    """Where two arrays differ most. allow_nonfinite: a boolean mask (or None) of the places
    where both may hold the same non-finite value."""
    g, w = _array(got), _array(want)
    nan = float("nan")
    if g.shape != w.shape:
        return Difference(nan, 0.0, (), nan, nan, f"shapes differ: got {g.shape}, want {w.shape}")
    bad = ~(np.isfinite(g) & np.isfinite(w))
    if allow_nonfinite is not None:
        same = (g == w) | (np.isnan(g) & np.isnan(w))
        bad &= ~(np.asarray(allow_nonfinite, dtype=bool) & same)
    if bad.any():
        i = tuple(int(k) for k in np.argwhere(bad)[0])
        return Difference(nan, 0.0, i, float(g[i]), float(w[i]),
                          f"non-finite value at index {i} of shape {g.shape}: got {g[i]}, want {w[i]}")
    if g.size == 0:
        return Difference(0.0, 0.0, (), 0.0, 0.0, "")
    finite = np.isfinite(g) & np.isfinite(w)
    diff = np.where(finite, np.abs(g - w), 0.0)
    i = np.unravel_index(int(np.argmax(diff)), diff.shape)
    i = tuple(int(k) for k in i)
    scale = float(np.max(np.where(finite, np.abs(w), 0.0)))
    return Difference(float(diff[i]), scale, i, float(g[i]), float(w[i]), "")


def assert_close(got, want, atol=0.0, rtol=0.0, what="", allow_nonfinite=None):
    """Fails unless |got - want| <= atol + rtol * max|want| everywhere and both are finite.
    Returns the Difference."""
    d = difference(got, want, allow_nonfinite)
    bound = atol + rtol * d.scale
    if d.problem or not d.worst <= bound:
        raise NumericMismatch(f"{what + ': ' if what else ''}{d.describe()}; tolerance {bound:.6g} "
                              f"(atol {atol:.3g} + rtol {rtol:.3g} x {d.scale:.6g})")
    return d
