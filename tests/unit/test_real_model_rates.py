"""benchmarks/real_model.py's timing rounds: what a device call cut short still keeps."""

from __future__ import annotations

import time

import torch

from benchmarks.real_model import rates


def _config(seconds_per_token: float):
    """A fake generate call: n tokens take n x ``seconds_per_token`` (no sleep: the clock is faked
    by returning the seconds)."""
    def run(n: int):
        return torch.arange(n), n * seconds_per_token
    return run


def test_rates_report_each_round_and_stop_at_the_deadline():
    configs = {("a", "eager"): _config(0.01), ("b", "eager"): _config(0.02)}
    seen = []
    res = rates(configs, batch=2, new=11, rounds=3, on_round=lambda r: seen.append(
        {k: list(v["rates"]) for k, v in r.items()}))
    # saved after the first calls (no rates yet), then before each later round
    assert [len(s[("a", "eager")]) for s in seen] == [0, 1, 2]
    assert abs(res[("a", "eager")]["median"] - 200.0) < 1e-6  # batch x (new - 1) / warm seconds: 20 / 0.1
    assert abs(res[("b", "eager")]["median"] - 100.0) < 1e-6
    assert res[("b", "eager")]["prefills"] == [0.02] * 3  # each round's 1-token call
    # a deadline already past: the first calls run, no round does, and the rows say so
    cut = rates(configs, batch=2, new=11, rounds=3, deadline=time.perf_counter() - 1)
    assert cut[("a", "eager")]["rates"] == [] and cut[("a", "eager")]["median"] is None
    assert torch.equal(cut[("a", "eager")]["tokens"], torch.arange(11))
