"""Times to an event that some runs never reach within their budget (right-censoring).

A run that has not collapsed by the end of its step budget says only "t > c": dropping it
would keep the runs that collapsed early and bias every collapse time down; setting it to c
would bias them down too. Both tools here use what a censored run says and nothing more.

Kaplan-Meier (`km_median`): with event times t_1 < t_2 < ..., d_j events at t_j and n_j
runs still at risk just before t_j (censored runs leave the risk set after their c),
  S(t) = prod_{t_j <= t} (1 - d_j / n_j);
the median is the smallest t_j with S(t_j) <= 1/2 (infinite when S stays above 1/2: more
than half the runs outlived the budget).

Censored log-normal regression (`lognormal_regression`, the Tobit model on log time):
  log t_i = x_i . beta + sigma e_i,  e_i ~ N(0, 1);
an observed time contributes the density of its log, a censored one P(log t > log c_i):
  loglik = sum_obs [-log sigma - z_i^2 / 2 - log sqrt(2 pi)] + sum_cens log S_N(z_i),
  z_i = (y_i - x_i . beta) / sigma, S_N = 1 - Phi.
It is maximised by Newton's method in Olsen's parameters gamma = beta / sigma,
theta = 1 / sigma, in which the log-likelihood is concave (Olsen 1978), with step halving;
the covariance of (beta, sigma) is the inverse observed information, carried over by the
delta method. Intervals and tests are Wald's, read with Student's t on events - p degrees
of freedom (p = coefficients): conservative next to the normal for a handful of events.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from sao_jax.report import stats

LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def km_median(times: Sequence[float], observed: Sequence[bool]) -> float:
    """The Kaplan-Meier median of right-censored times (inf when S stays above 1/2)."""
    t = np.asarray(times, np.float64)
    e = np.asarray(observed, bool)
    if t.shape != e.shape:
        raise ValueError(f"km_median: {t.shape} times but {e.shape} observed flags")
    surv = 1.0
    for tj in np.unique(t[e]):
        at_risk = int(np.sum(t >= tj))
        surv *= 1.0 - int(np.sum((t == tj) & e)) / at_risk
        if surv <= 0.5:
            return float(tj)
    return math.inf


def log_survival(v: float) -> float:
    """log(1 - Phi(v)), also far in the upper tail (asymptotic series past v = 30)."""
    if v < 30.0:
        return math.log(0.5 * math.erfc(v / math.sqrt(2.0)))
    return -0.5 * v * v - math.log(v) - LOG_SQRT_2PI + math.log1p(-1.0 / v**2 + 3.0 / v**4)


def hazard(v: float) -> float:
    """phi(v) / (1 - Phi(v)), the inverse Mills ratio of the upper tail."""
    return math.exp(-0.5 * v * v - LOG_SQRT_2PI - log_survival(v))


@dataclasses.dataclass(frozen=True)
class Fit:
    """A censored log-normal regression: coefficients (named), their SEs, sigma."""

    names: tuple[str, ...]
    coef: np.ndarray  # [P]
    cov: np.ndarray  # [P, P]
    sigma: float
    n: int
    events: int
    loglik: float

    @property
    def df(self) -> float:
        return float(max(self.events - len(self.names), 1))

    def se(self, name: str) -> float:
        i = self.names.index(name)
        return float(math.sqrt(max(self.cov[i, i], 0.0)))

    def value(self, name: str) -> float:
        return float(self.coef[self.names.index(name)])

    def interval(self, name: str, alpha: float = stats.ALPHA) -> tuple[float, float]:
        return stats.t_interval(self.value(name), self.se(name), self.df, alpha)

    def p(self, name: str, null: float = 0.0) -> float:
        """Two-sided Wald p of coefficient `name` = `null` (t on `df`)."""
        se = self.se(name)
        return stats.two_sided_p((self.value(name) - null) / se, self.df) if se > 0 else math.nan


def _loglik(x_np, y_n, obs_n, g_p, th) -> float:
    u = th * y_n - x_np @ g_p
    ll = np.sum(np.where(obs_n, math.log(th) - 0.5 * u * u - LOG_SQRT_2PI, 0.0))
    return float(ll + sum(log_survival(v) for v in u[~obs_n]))


def _grad_hess(x_np, y_n, obs_n, g_p, th) -> tuple[np.ndarray, np.ndarray]:
    """Gradient and Hessian of the log-likelihood in (gamma, theta)."""
    p = x_np.shape[1]
    u = th * y_n - x_np @ g_p  # [N]
    d_n = np.concatenate([-x_np, y_n[:, None]], axis=1)  # du / d(gamma, theta) [N, P + 1]
    lam = np.array([hazard(v) if not o else 0.0 for v, o in zip(u, obs_n, strict=True)])
    # d loglik / du: -u (observed), -lambda (censored); d2: -1, -lambda (lambda - u)
    d1 = np.where(obs_n, -u, -lam)
    d2 = np.where(obs_n, -1.0, -lam * (lam - u))
    grad = d_n.T @ d1
    grad[p] += np.sum(obs_n) / th
    hess = (d_n * d2[:, None]).T @ d_n
    hess[p, p] -= np.sum(obs_n) / th**2
    return grad, hess


def lognormal_regression(
    x_np: np.ndarray,
    times_n: Sequence[float],
    observed_n: Sequence[bool],
    names: Sequence[str],
    *,
    max_iter: int = 200,
) -> Fit:
    """The censored log-normal fit of `times_n` (> 0) on the columns of `x_np` [N, P]
    (include a constant column for an intercept). ValueError when it cannot be estimated:
    fewer events than P + 1, a rank-deficient design, or no convergence."""
    x_np = np.asarray(x_np, np.float64)
    y_n = np.log(np.asarray(times_n, np.float64))
    obs_n = np.asarray(observed_n, bool)
    n, p = x_np.shape
    if len(names) != p or y_n.shape != (n,) or obs_n.shape != (n,):
        raise ValueError(f"lognormal_regression: x {x_np.shape}, {len(names)} names, y {y_n.shape}")
    events = int(np.sum(obs_n))
    if events < p + 1:
        raise ValueError(f"lognormal_regression: {events} events, need at least {p + 1}")
    if np.linalg.matrix_rank(x_np[obs_n]) < p:
        raise ValueError("lognormal_regression: the design is rank-deficient on the events")
    beta, *_ = np.linalg.lstsq(x_np, y_n, rcond=None)  # start: censored taken as events
    sigma = max(float(np.std(y_n - x_np @ beta)), 0.1)
    g, th = beta / sigma, 1.0 / sigma
    ll = _loglik(x_np, y_n, obs_n, g, th)
    for _ in range(max_iter):
        grad, hess = _grad_hess(x_np, y_n, obs_n, g, th)
        try:
            step = -np.linalg.solve(hess, grad)
        except np.linalg.LinAlgError:
            raise ValueError("lognormal_regression: singular information") from None
        t = 1.0
        while True:
            g_new, th_new = g + t * step[:p], th + t * step[p]
            if th_new > 0:
                ll_new = _loglik(x_np, y_n, obs_n, g_new, th_new)
                if ll_new >= ll - 1e-12:
                    break
            t *= 0.5
            if t < 1e-12:
                raise ValueError("lognormal_regression: no ascent step")
        g, th, gain, ll = g_new, th_new, ll_new - ll, ll_new
        if abs(gain) < 1e-12 and float(np.max(np.abs(t * step))) < 1e-9:
            break
    else:
        raise ValueError(f"lognormal_regression: no convergence in {max_iter} iterations")
    if th > 1e6:
        raise ValueError("lognormal_regression: sigma -> 0 (the events are fitted exactly)")
    _, hess = _grad_hess(x_np, y_n, obs_n, g, th)
    cov_gt = np.linalg.inv(-hess)  # [P + 1, P + 1]
    jac = np.zeros((p + 1, p + 1))  # d(beta, sigma) / d(gamma, theta)
    jac[:p, :p] = np.eye(p) / th
    jac[:p, p] = -g / th**2
    jac[p, p] = -1.0 / th**2
    cov = jac @ cov_gt @ jac.T
    return Fit(tuple(names), g / th, cov[:p, :p], 1.0 / th, n, events, ll)
