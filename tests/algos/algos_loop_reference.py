"""REFERENCE.md §1 (verl 0.9 core_algos semantics) written as plain Python loops over rows, tokens and
groups, in float64. Deliberately independent of megatron_rl: the tests compare the library to these."""

from __future__ import annotations

import math
from collections import defaultdict

import torch


def rows(t: torch.Tensor) -> list[list[float]]:
    return t.double().tolist()


def whiten(x: list[list[float]], m: list[list[float]]) -> list[list[float]]:
    n = sum(sum(r) for r in m)
    mean = sum(xi * mi for xr, mr in zip(x, m) for xi, mi in zip(xr, mr)) / (n + 1e-8)
    var = sum((xi - mean) ** 2 * mi for xr, mr in zip(x, m) for xi, mi in zip(xr, mr)) / (n + 1e-8)
    var *= n / (n - 1)
    return [[(xi - mean) / math.sqrt(var + 1e-8) for xi in xr] for xr in x]


def gae(r, v, m, gamma, lam):
    adv, ret = [], []
    for rr, vr, mr in zip(rows(r), rows(v), rows(m)):
        next_value, last, out = 0.0, 0.0, [0.0] * len(rr)
        for t in reversed(range(len(rr))):
            delta = rr[t] + gamma * next_value - vr[t]
            next_value = vr[t] * mr[t] + (1 - mr[t]) * next_value
            last = (delta + gamma * lam * last) * mr[t] + (1 - mr[t]) * last
            out[t] = last
        adv.append(out)
        ret.append([a + b for a, b in zip(out, vr)])
    return whiten(adv, rows(m)), ret


def _groups(uids):
    members = defaultdict(list)
    for i, u in enumerate(uids):
        members[u].append(i)
    return members


def _broadcast(per_row, m):
    return [[a * mi for mi in mr] for a, mr in zip(per_row, rows(m))]


def grpo(r, m, uids, eps=1e-6, norm=True):
    scores = [sum(rr) for rr in rows(r)]
    out = [0.0] * len(scores)
    for idx in _groups(uids).values():
        g = [scores[i] for i in idx]
        n = len(g)
        mean = sum(g) / n if n > 1 else 0.0
        std = math.sqrt(sum((x - mean) ** 2 for x in g) / (n - 1)) if n > 1 else 1.0
        for i in idx:
            out[i] = (scores[i] - mean) / (std + eps) if norm else scores[i] - mean
    adv = _broadcast(out, m)
    return adv, adv


def rloo(r, m, uids):
    scores = [sum(rr) for rr in rows(r)]
    out = list(scores)
    for idx in _groups(uids).values():
        n = len(idx)
        if n > 1:
            mean = sum(scores[i] for i in idx) / n
            for i in idx:
                out[i] = scores[i] * n / (n - 1) - mean * n / (n - 1)
    adv = _broadcast(out, m)
    return adv, adv


def reinforce_pp_baseline(r, m, uids):
    scores = [sum(rr) for rr in rows(r)]
    out = list(scores)
    for idx in _groups(uids).values():
        if len(idx) > 1:
            mean = sum(scores[i] for i in idx) / len(idx)
            for i in idx:
                out[i] = scores[i] - mean
    mm = rows(m)
    adv = [[a * mi for a, mi in zip(ar, mr)] for ar, mr in zip(whiten(_broadcast(out, m), mm), mm)]
    return adv, adv


def reinforce_pp(r, m, gamma):
    mm = rows(m)
    returns = []
    for rr, mr in zip(rows(r), mm):
        running, out = 0.0, [0.0] * len(rr)
        for t in reversed(range(len(rr))):
            new = rr[t] + gamma * running
            out[t] = new * mr[t]
            running = new * mr[t] + running * (1 - mr[t])
        returns.append(out)
    adv = [[a * mi for a, mi in zip(ar, mr)] for ar, mr in zip(whiten(returns, mm), mm)]
    return adv, returns


def remax(r, baselines, m):
    adv, ret = [], []
    for rr, b, mr in zip(rows(r), baselines.double().tolist(), rows(m)):
        out = [0.0] * len(rr)
        acc = 0.0
        for t in reversed(range(len(rr))):
            acc += rr[t] * mr[t]
            out[t] = acc
        ret.append(out)
        adv.append([o - b * mi for o, mi in zip(out, mr)])
    return adv, ret


def kl_value(lp: float, ref: float, kind: str) -> float:
    kind = kind.rstrip("+")
    if kind in ("kl", "k1"):
        return lp - ref
    if kind == "abs":
        return abs(lp - ref)
    if kind in ("mse", "k2"):
        return 0.5 * (lp - ref) ** 2
    d = min(max(ref - lp, -20.0), 20.0)
    return min(max(math.exp(d) - d - 1, -10.0), 10.0)


def kl_grad(lp: float, ref: float, kind: str) -> float:
    """d kl / d logprob."""
    if kind.endswith("+"):
        return lp - ref  # k2's gradient
    if kind in ("kl", "k1"):
        return 1.0
    if kind == "abs":
        return math.copysign(1.0, lp - ref) if lp != ref else 0.0
    if kind in ("mse", "k2"):
        return lp - ref
    d = ref - lp
    if abs(d) >= 20 or abs(math.exp(d) - d - 1) >= 10:
        return 0.0  # clamped
    return -(math.exp(d) - 1)


def agg(loss, mask, mode, num_tokens=None, num_seqs=None, scale=None):
    lr, mr = rows(loss), rows(mask)
    if mode == "token-mean":
        total = sum(li * mi for lrow, mrow in zip(lr, mr) for li, mi in zip(lrow, mrow))
        n = num_tokens if num_tokens is not None else sum(map(sum, mr))
        return total / n if n else 0.0
    if mode == "token-sum":
        return sum(li * mi for lrow, mrow in zip(lr, mr) for li, mi in zip(lrow, mrow))
    seq = []
    for lrow, mrow in zip(lr, mr):
        tokens = sum(mrow)
        if tokens == 0:
            continue
        s = sum(li * mi for li, mi in zip(lrow, mrow))
        seq.append(s / (tokens + 1e-8) if mode == "seq-mean-token-mean" else s)
    n = num_seqs if num_seqs is not None else len(seq)
    out = sum(seq) / n if n else 0.0
    if mode == "seq-mean-token-sum-norm":
        out /= scale if scale is not None else len(mr[0])
    return out


def vanilla_token_losses(old, lp, adv, low, high, c):
    """Per-token loss, clipfrac flags (clip, dual clip) and the clamped log-ratio."""
    losses, clip, lower, log_ratios = [], [], [], []
    for orow, lrow, arow in zip(rows(old), rows(lp), rows(adv)):
        lr_, cl_, lo_, kr_ = [], [], [], []
        for o, p, a in zip(orow, lrow, arow):
            log_ratio = min(max(p - o, -20.0), 20.0)
            ratio = math.exp(log_ratio)
            l1 = -a * ratio
            l2 = -a * min(max(ratio, 1 - low), 1 + high)
            token_loss = max(l1, l2)
            dual = token_loss > -a * c and a < 0
            if a < 0:
                token_loss = min(token_loss, -a * c)
            lr_.append(token_loss), cl_.append(float(l2 > l1)), lo_.append(float(dual)), kr_.append(log_ratio)
        losses.append(lr_), clip.append(cl_), lower.append(lo_), log_ratios.append(kr_)
    return losses, clip, lower, log_ratios


def gspo_token_losses(old, lp, adv, mask, low, high):
    """Per-token loss value (the forward) and clip flags."""
    losses, clip = [], []
    for orow, lrow, arow, mrow in zip(rows(old), rows(lp), rows(adv), rows(mask)):
        seq = sum((p - o) * m for p, o, m in zip(lrow, orow, mrow)) / max(sum(mrow), 1)
        s = math.exp(min(seq, 10.0))
        l_row, c_row = [], []
        for a in arow:
            l1, l2 = -a * s, -a * min(max(s, 1 - low), 1 + high)
            l_row.append(max(l1, l2))
            c_row.append(float(l2 > l1))
        losses.append(l_row), clip.append(c_row)
    return losses, clip


def masked_mean(x, mask) -> float:
    num = sum(xi * mi for xr, mr in zip(x, rows(mask)) for xi, mi in zip(xr, mr))
    return num / (sum(map(sum, rows(mask))) + 1e-8)
