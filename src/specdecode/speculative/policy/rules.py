"""Pure depth rules: expected committed tokens, auto-k and D-Cut. No state, unit-testable alone."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdecode.speculative.policy.estimators import AcceptanceEstimator


def expected_committed(alpha: float, k: int) -> float:
    """Tokens committed per step with i.i.d. acceptance alpha and k drafts: (1 - a^(k+1)) / (1 - a)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def auto_k(cost, batch_size: int, k_max: int, estimator: "AcceptanceEstimator", draft_step_time: float,
           catch_up_seconds: float = 0.0, remaining_tokens: float = float("inf"), draft_fixed: float = 0.0) -> int:
    """The draft length that maximises expected committed tokens per second for this batch
    (0 = plain decoding is faster). Baseline policy: one k for the whole batch.
    `catch_up_seconds`: a one-time drafter cost paid before drafting can start, amortised
    over the steps left to the batch (`remaining_tokens` per sequence / tokens per step): a
    large batch must not pay a drafter prefill over every prompt to draft a step or two.
    `draft_fixed`: seconds every proposal costs whatever its depth."""
    best_k, best_rate = 0, batch_size / cost.step_time(batch_size, batch_size)
    for k in range(1, k_max + 1):
        tau = estimator.expected_committed(k)
        amortised = catch_up_seconds / max(1.0, remaining_tokens / tau)
        seconds = draft_fixed + k * draft_step_time + cost.step_time(batch_size, batch_size * (k + 1)) + amortised
        rate = batch_size * tau / seconds
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


def dcut_lengths(confidence: list[list[float]], num_tokens: list[int], cost, draft_seconds: float) -> list[int]:
    """D-Cut verification depth per request (AngelSlim D-Cut, DSpark's scheduler rule).

    Survival a[q][i] = prod_{j<=i} confidence[q][j] estimates P(draft i of request q is
    accepted). Every request with a draft keeps its first position; the other (q, i) pairs
    are admitted in descending a (ties: earlier position first) while the expected committed
    tokens per second, tau / (draft_seconds + T(B, N)), keeps improving, stopping at the
    first pair that does not improve it.

    Why this is lossless: a draft token must be verified against the distribution it was
    sampled from, so whether position i is kept may depend on the prefix x_<i but not on
    x_i itself. The confidences given here depend only on x_<i (the drafter's top
    probability at i, or past acceptance statistics); in descending order, (q, i) is
    decided before any pair whose score involves x_i (a[q][i+1] <= a[q][i]), and the
    early stop means no later pair can change that decision. A global argmax over K would
    look at later pairs and is not exact under sampling (DSpark shows a shifted
    distribution); under greedy decoding any pruning is exact.

    Forwards are priced non-decreasing in their width (w tokens a sequence at most any wider
    forward's price): the live cost measures a width from the steps that ran it, and a width run
    mostly in slow circumstances (traced, MTP k=3 W4A8 batch 1: width 3, verified after a shallow
    plan or a switch from plain decoding, 1.16-1.22x its profile against width 4's 0.99-1.03x)
    priced above the next one stopped the admission before it: a third of the 3-token drafts were
    cut to 1. The prices depend on no draft, so the rule stays lossless.
    """
    B = len(num_tokens)
    kept = [min(1, n) for n in num_tokens]
    survival: list[tuple[float, int, int]] = []
    tau = float(B)
    for q, n in enumerate(num_tokens):
        a = 1.0
        for i in range(n):
            a *= confidence[q][i]
            if i == 0:
                tau += a
            else:
                survival.append((a, q, i))
    # [w - 1]: the forward of w tokens a sequence, at most any wider one's price (w up to the deepest draft + 1).
    whole = [cost.step_time(B, B * w) for w in range(1, 2 + max(num_tokens, default=0))]
    for w in range(len(whole) - 2, -1, -1):
        whole[w] = min(whole[w], whole[w + 1])

    def price(n: int) -> float:  # n tokens in all: at most the whole batch at ceil(n / B) tokens each
        return min(cost.step_time(B, n), whole[min(len(whole), -(-n // B)) - 1])

    N = B + sum(kept)
    rate = tau / (draft_seconds + price(N))
    survival.sort(key=lambda t: (-t[0], t[2]))
    for a, q, i in survival:
        new_rate = (tau + a) / (draft_seconds + price(N + 1))
        if new_rate <= rate:
            break
        tau, N, rate = tau + a, N + 1, new_rate
        kept[q] = i + 1
    return kept
