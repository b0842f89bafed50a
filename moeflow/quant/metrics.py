"""msprobe's comparison metrics and verdicts, over sufficient statistics.

Names and thresholds are msprobe's (MindStudio probe, `msprobe compare`):
Cosine, MaxAbsErr, MaxRelativeErr, One Thousandth Err Ratio (share of
elements whose relative error is below 0.001). A tensor is an *error* when
cosine < 0.99 and max abs err > 0.001, or cosine < 0.9, or max abs err > 1
(msprobe's accuracy check); moeflow calls it a *warning* when only one half of
the first rule holds (cosine < 0.99, or max abs err > 0.001), else *pass*.

Statistics are sums and maxima (dot products, squared norms, counts), so the
golden set can be split over Ray tasks and merged exactly.
"""

from __future__ import annotations

import math

import torch

COS_THRESHOLD = 0.99  # msprobe CompareConst.COS_THRESHOLD
MAX_ABS_ERR_THRESHOLD = 0.001  # CompareConst.MAX_ABS_ERR_THRESHOLD
COS_MAX_THRESHOLD = 0.9  # CompareConst.COS_MAX_THRESHOLD
MAX_ABS_ERR_MAX_THRESHOLD = 1.0  # CompareConst.MAX_ABS_ERR_MAX_THRESHOLD
THOUSAND_RATIO_THRESHOLD = 0.001  # CompareConst.THOUSAND_RATIO_THRESHOLD
FLOAT_EPSILON = 2.220446049250313e-16  # np.finfo(float).eps (msprobe Const.FLOAT_EPSILON)


def empty() -> dict:
    return {"dot": 0.0, "nn": 0.0, "bb": 0.0, "max_abs": 0.0, "max_rel": 0.0, "close": 0,
            "count": 0, "nonfinite": 0}


def accumulate(stats: dict, bench: torch.Tensor, cand: torch.Tensor) -> None:
    """Add one pair of tensors (any shape, same numel) to `stats`.

    Relative error as msprobe computes it: |(n - b) / b| in float32, eps added to
    both where the bench element is 0.
    """
    b = bench.detach().reshape(-1).float()
    n = cand.detach().reshape(-1).float()
    finite = torch.isfinite(b) & torch.isfinite(n)
    stats["nonfinite"] += int((~finite).sum())
    b, n = b[finite], n[finite]
    b64, n64 = b.double(), n.double()
    stats["dot"] += float(n64 @ b64)
    stats["nn"] += float(n64 @ n64)
    stats["bb"] += float(b64 @ b64)
    if b.numel():
        stats["max_abs"] = max(stats["max_abs"], float((n - b).abs().max()))
        zero = b == 0
        eps = torch.finfo(torch.float32).eps
        bz, nz = b + zero * eps, n + zero * eps
        rel = ((nz - bz) / bz).abs()
        stats["max_rel"] = max(stats["max_rel"], float(rel.max()))
        stats["close"] += int((rel < THOUSAND_RATIO_THRESHOLD).sum())
    stats["count"] += b.numel()


def merge(a: dict, b: dict) -> dict:
    out = {k: a[k] + b[k] for k in ("dot", "nn", "bb", "close", "count", "nonfinite")}
    out.update(max_abs=max(a["max_abs"], b["max_abs"]), max_rel=max(a["max_rel"], b["max_rel"]))
    return out


def finish(stats: dict) -> dict:
    """{"cosine", "max_abs", "max_rel", "one_thousandth_err_ratio", "status"}."""
    na, nb = math.sqrt(stats["nn"]), math.sqrt(stats["bb"])
    if stats["nonfinite"]:
        cos = float("nan")
    elif na <= FLOAT_EPSILON and nb <= FLOAT_EPSILON:
        cos = 1.0
    elif na <= FLOAT_EPSILON or nb <= FLOAT_EPSILON:
        cos = 0.0
    else:
        # clamped: sqrt(nn) * sqrt(bb) rounds, so identical tensors could score 1 + 1 ulp
        cos = max(-1.0, min(1.0, stats["dot"] / (na * nb)))
    ratio = stats["close"] / stats["count"] if stats["count"] else 1.0
    out = {"cosine": cos, "max_abs": stats["max_abs"], "max_rel": stats["max_rel"],
           "one_thousandth_err_ratio": ratio}
    out["status"] = status(cos, stats["max_abs"])
    return out


def status(cosine: float, max_abs: float) -> str:
    """msprobe's accuracy check (error), moeflow's warning band, else pass."""
    if math.isnan(cosine):
        return "error"
    if (cosine < COS_THRESHOLD and max_abs > MAX_ABS_ERR_THRESHOLD) or cosine < COS_MAX_THRESHOLD \
            or max_abs > MAX_ABS_ERR_MAX_THRESHOLD:
        return "error"
    if cosine < COS_THRESHOLD or max_abs > MAX_ABS_ERR_THRESHOLD:
        return "warning"
    return "pass"
