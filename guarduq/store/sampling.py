"""The review sampler, re-exported from its ground-floor home ``guarduq.sampling`` (kept so that
``guarduq.store.sampling`` imports keep working)."""

from __future__ import annotations

from guarduq.sampling import ReviewSampler, Sample, fit_weights, inclusion_probability

__all__ = ["ReviewSampler", "Sample", "fit_weights", "inclusion_probability"]
