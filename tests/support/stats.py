"""The one goodness-of-fit test of the suite: Pearson's chi-square of sample counts against an exact law.

Pooling rule (one for every test): cells whose expected count is below 5 are pooled into one cell; if
that pool itself expects fewer than 5, the smallest remaining cell joins it. Every cell tested then
expects at least 5 (Cochran's rule), where the statistic is close to chi-square with (cells - 1)
degrees of freedom, so a correct sampler gets a p-value close to uniform on [0, 1] and
`assert_fits(..., alpha)` fails by chance with probability alpha.

Before this module the suite had three variants of the rule; each pooled the same cells or fewer, so
the pool could expect fewer than 5, where the statistic's tail is heavier than chi-square's and the
test fails by chance more often than its alpha. Each test keeps its alpha, so its false-failure
probability is at most what it was. The seeds are fixed, so a given run is deterministic: alpha is
the probability that a fresh seed fails a correct sampler.
"""

from __future__ import annotations

import scipy.stats
import torch

MIN_EXPECTED = 5.0


def chi_square_pvalue(counts: torch.Tensor, law: torch.Tensor) -> float:
    """Pearson chi-square p-value of `counts` against `law` (same number of cells, any shapes; law sums to
    1), with cells pooled as the module says. A sample in a cell of probability 0 is an error here, not
    a small p-value: such a continuation must never be emitted."""
    counts = counts.flatten().double()
    law = law.flatten().double()
    if counts.shape != law.shape:
        raise ValueError(f"counts has {counts.numel()} cells, law {law.numel()}")
    assert float(counts[law == 0].sum()) == 0, "a sample fell where the law has probability 0"
    total = float(counts.sum())
    expected = law / law.sum() * total
    order = torch.argsort(expected).tolist()
    pool = [i for i in order if float(expected[i]) < MIN_EXPECTED]
    rest = [i for i in order if float(expected[i]) >= MIN_EXPECTED]
    if pool and rest and float(expected[pool].sum()) < MIN_EXPECTED:
        pool.append(rest.pop(0))
    observed = [float(counts[i]) for i in rest]
    wanted = [float(expected[i]) for i in rest]
    if pool:
        observed.append(float(counts[pool].sum()))
        wanted.append(float(expected[pool].sum()))
    assert len(observed) >= 2, f"only {len(observed)} cell expects >= {MIN_EXPECTED}: too few samples"
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, wanted))
    return float(scipy.stats.chi2.sf(stat, len(observed) - 1))


def assert_fits(counts: torch.Tensor, law: torch.Tensor, alpha: float, what: str = "") -> None:
    """Assert that `counts` fit `law` at level `alpha`: fails by chance with probability alpha."""
    pvalue = chi_square_pvalue(counts, law)
    assert pvalue > alpha, f"{what}chi-square p = {pvalue:.2e} <= alpha = {alpha:g}"
