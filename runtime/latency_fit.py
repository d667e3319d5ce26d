"""An online least-squares fit of a latency (seconds) on a few features of the work (tokens,
pages, batch rows): what an instance measures of itself and publishes with its stats, and what
the gateway fits of its own predictions against what it then measured (kvmesh.gateway.predictor).

The fit is over the last `window` samples, so it follows a machine whose speed changes (shared
cores, a warm cache), and its coefficients are kept non-negative (a negative cost per token
would predict that more work is faster): a feature whose coefficient comes out negative is
dropped and the rest refitted (an active-set non-negative least squares, Lawson and Hanson 1974,
in its simplest form; a handful of features needs no more).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

import numpy as np

RELATIVE_FLOOR_S = 0.001
"""A relative fit weighs samples shorter than this (seconds) as this long."""


class LinearFit:
    """seconds ~ coefficients . features, over the last `window` samples.

    Args:
        num_features: the length of every sample's features.
        window: samples kept (the oldest dropped first).
        min_samples: samples needed before `coefficients` answers.
        relative: weigh each sample by 1 / its seconds, so the fit minimizes the relative error
            (what a predictor "within 25%" is judged by) rather than the absolute one, and the
            long waits of a burst do not decide the short requests' predictions.
    """

    def __init__(self, num_features: int, window: int = 64, min_samples: int = 4, relative: bool = False) -> None:
        if num_features < 1 or window < num_features or min_samples < 1:
            raise ValueError(f"bad LinearFit shape: {num_features} features, window {window}, min {min_samples}")
        self.num_features = num_features
        self.min_samples = min_samples
        self.relative = relative
        self._x: deque[tuple[float, ...]] = deque(maxlen=window)
        self._y: deque[float] = deque(maxlen=window)
        self._coefficients: list[float] | None = None
        self._lock = threading.Lock()  # measured on one thread, read by another (stats)

    def __len__(self) -> int:
        return len(self._y)

    def add(self, features: Sequence[float], seconds: float) -> None:
        """One measurement. Raises ValueError for features of the wrong length."""
        if len(features) != self.num_features:
            raise ValueError(f"expected {self.num_features} features, got {len(features)}")
        if not np.isfinite(seconds) or seconds < 0:
            return
        with self._lock:
            self._x.append(tuple(float(f) for f in features))
            self._y.append(float(seconds))
            self._coefficients = None

    def coefficients(self) -> list[float] | None:
        """The fit's non-negative coefficients (seconds per unit of each feature); None before
        min_samples samples."""
        with self._lock:
            if len(self._y) < self.min_samples:
                return None
            if self._coefficients is None:
                x, y = np.array(self._x), np.array(self._y)
                if self.relative:
                    weights = 1.0 / np.maximum(y, RELATIVE_FLOOR_S)
                    x, y = x * weights[:, None], y * weights
                self._coefficients = nonnegative_fit(x, y)
            return self._coefficients

    def predict(self, features: Sequence[float]) -> float | None:
        """The fit's seconds for these features; None before min_samples samples."""
        coefficients = self.coefficients()
        if coefficients is None:
            return None
        return float(np.dot(coefficients, features))


def nonnegative_fit(x: np.ndarray, y: np.ndarray) -> list[float]:
    """Least squares of y [N] on x [N, F] with every coefficient >= 0: fit, drop the features
    whose coefficients are negative, refit the rest (the dropped ones are 0)."""
    active = list(range(x.shape[1]))
    coefficients = np.zeros(x.shape[1])
    while active:
        solved, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (solved >= 0).all():
            coefficients[active] = solved
            break
        active = [f for f, c in zip(active, solved) if c > 0]
    return [float(c) for c in coefficients]
