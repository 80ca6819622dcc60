"""benchmarks/bench_retrieval.py measures the candidate rule it names: the old sign-normalised rule jumps when a core
crosses |u_0| = |u_1| (docs/design.md: every selection changes), the per-token and signed rules do not. The rule used
to be patched onto a method the retrieval no longer called, so all three measured the default."""

import torch
from bench_retrieval import RULES, candidate_rule, jump

from ultramem.presets import get_config


def test_each_rule_measures_its_own_candidates():
    hidden = torch.randn(2, 64, get_config("tiny-ultramem").hidden_size, generator=torch.Generator().manual_seed(0))
    jumps = {}
    for rule in RULES:
        with candidate_rule(rule):
            jumps[rule] = jump(rule, hidden)
    assert jumps["sign-normalised"] > 0.5, jumps
    assert jumps["per-token"] < 0.05 and jumps["signed"] < 0.05, jumps
