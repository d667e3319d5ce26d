"""Online least-squares fits of latencies (seconds): `LinearFit`, on a few features of the work
(tokens, pages, batch rows), what an instance measures of itself and publishes with its stats;
`RatioFit`, the gateway's correction of its own predictions by what it then measured
(kvmesh.gateway.predictor).

A LinearFit is over the last `window` samples, so it follows a machine whose speed changes (shared
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


class _Window:
    """The last `window` samples of `num_features` features each, and how many a fit needs.
    Raises ValueError for a bad shape."""

    def __init__(self, num_features: int, window: int, min_samples: int) -> None:
        if num_features < 1 or window < num_features or min_samples < 1:
            raise ValueError(
                f"bad {type(self).__name__} shape: {num_features} features, window {window}, min {min_samples}"
            )
        self.num_features = num_features
        self.min_samples = min_samples
        self._x: deque[tuple[float, ...]] = deque(maxlen=window)
        self._y: deque[float] = deque(maxlen=window)

    def __len__(self) -> int:
        return len(self._y)

    def _features(self, features: Sequence[float]) -> tuple[float, ...]:
        """`features` as floats; raises ValueError when there are not num_features of them."""
        if len(features) != self.num_features:
            raise ValueError(f"expected {self.num_features} features, got {len(features)}")
        return tuple(float(f) for f in features)


MIN_RELATIVE_S = 1e-3
"""The least seconds a relative LinearFit divides by (a sample of ~0 s would weigh without bound)."""


class LinearFit(_Window):
    """seconds ~ coefficients . features, over the last `window` samples.

    Args:
        num_features: the length of every sample's features.
        window: samples kept (the oldest dropped first).
        min_samples: samples needed before `coefficients` answers.
        relative: fit the least relative error (each sample weighed by 1 / its seconds) instead of
            the least absolute one, where the absolute fit lets the longest samples decide: the
            prefill profile's, since a TTFT prediction is judged by its relative error (fitted
            on the gateway's logs of two `kvmesh.bench.slo` runs, AMD EPYC Zen 4, 2026-12-07:
            the absolute fit predicted a lone 256-token prompt 1.4x its measured TTFT and was
            within 25% for 0.61 of the lone prompts, the relative one for 0.81).
    """

    def __init__(self, num_features: int, window: int = 64, min_samples: int = 4, relative: bool = False) -> None:
        super().__init__(num_features, window, min_samples)
        self.relative = relative
        self._coefficients: list[float] | None = None
        self._lock = threading.Lock()  # measured on one thread, read by another (stats)

    def add(self, features: Sequence[float], seconds: float) -> None:
        """One measurement. Raises ValueError for features of the wrong length."""
        x = self._features(features)
        if not np.isfinite(seconds) or seconds < 0:
            return
        with self._lock:
            self._x.append(x)
            self._y.append(float(seconds))
            self._coefficients = None

    def coefficients(self) -> list[float] | None:
        """The fit's non-negative coefficients (seconds per unit of each feature); None before
        min_samples samples."""
        with self._lock:
            if len(self._y) < self.min_samples:
                return None
            if self._coefficients is None:
                self._coefficients = nonnegative_fit(np.array(self._x), np.array(self._y), self.relative)
            return self._coefficients

    def predict(self, features: Sequence[float]) -> float | None:
        """The fit's seconds for these features; None before min_samples samples."""
        coefficients = self.coefficients()
        if coefficients is None:
            return None
        return float(np.dot(coefficients, features))


MAX_LOG_RATIO = 2.5
"""The most a RatioFit moves a prediction: a factor of e^2.5 (12x) either way."""


class RatioFit(_Window):
    """measured ~ predicted x exp(coefficients . features), over the last `window` samples: a
    multiplicative correction of a model's prediction, fitted by least squares on the log of
    measured / predicted (the relative error, symmetric: 2x over weighs as 2x under, so a burst's
    long waits do not decide a short prompt's prediction). What the gateway's TTFT calibration is
    (kvmesh.gateway.predictor).

    Raises ValueError for a bad shape (in __init__) or features of the wrong length (in add).
    Not thread-safe: the gateway's event loop is its one user."""

    def __init__(self, num_features: int, window: int = 64, min_samples: int = 8) -> None:
        super().__init__(num_features, window, min_samples)
        self._coefficients: np.ndarray | None = None
        self._range: tuple[np.ndarray, np.ndarray] = (np.zeros(num_features), np.zeros(num_features))

    def add(self, features: Sequence[float], predicted_s: float, measured_s: float) -> None:
        """One prediction and what was then measured (seconds; a pair not both > 0 is skipped)."""
        x = self._features(features)
        if not (predicted_s > 0 and measured_s > 0 and np.isfinite(predicted_s) and np.isfinite(measured_s)):
            return
        self._x.append(x)
        self._y.append(float(np.log(measured_s / predicted_s)))
        self._coefficients = None

    def correct(self, features: Sequence[float], predicted_s: float) -> float | None:
        """`predicted_s` corrected by the fit, each feature held within the range its samples
        span (a fit over 1-4 rows says nothing of 12), by e^2.5 at most either way; None before
        min_samples samples."""
        if len(self._y) < self.min_samples:
            return None
        if self._coefficients is None:
            x = np.array(self._x)
            self._coefficients, *_ = np.linalg.lstsq(x, np.array(self._y), rcond=None)
            self._range = (x.min(axis=0), x.max(axis=0))
        seen = np.clip(np.asarray(features, dtype=float), *self._range)  # no extrapolation
        log_ratio = float(np.clip(np.dot(self._coefficients, seen), -MAX_LOG_RATIO, MAX_LOG_RATIO))
        return predicted_s * float(np.exp(log_ratio))


def nonnegative_fit(x: np.ndarray, y: np.ndarray, relative: bool = False) -> list[float]:
    """Least squares of y [N] on x [N, F] with every coefficient >= 0: fit, drop the features
    whose coefficients are negative, refit the rest (the dropped ones are 0). relative: of the
    relative error, sum ((fit - y) / y)^2 (each row scaled by 1 / y, at least MIN_RELATIVE_S)."""
    if relative:
        scale = 1.0 / np.maximum(y, MIN_RELATIVE_S)
        x, y = x * scale[:, None], y * scale
    active = list(range(x.shape[1]))
    coefficients = np.zeros(x.shape[1])
    while active:
        solved, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (solved >= 0).all():
            coefficients[active] = solved
            break
        active = [f for f, c in zip(active, solved) if c > 0]
    return [float(c) for c in coefficients]
