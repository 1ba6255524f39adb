"""A guard against silent regressions of the demo: the README's first command, run as a user runs
it, lands in the range the README states (read from the same results file the README is rendered
from, so the two cannot disagree)."""

import json
import sys

import pytest

from support import ROOT, run_command
from tools import seeds


@pytest.mark.slow
def test_the_default_run_lands_in_the_stated_range(tmp_path, optimized):
    result = json.loads((ROOT / "results" / "default_run.json").read_text())
    low, high = result["data"]["range"]
    # Evaluating only at the start and the end changes nothing in training (evaluation reads the
    # weights), so the final exact match is the default run's, in less time.
    run_command([sys.executable, "-m", "experiments.sft", "--run-dir", str(tmp_path / "sft"),
                 "--eval.every", "0", "--checkpoint.every", "0"], timeout=1800)
    final = seeds.evals(tmp_path / "sft")[-1]
    assert final["step"] == result["data"]["curves"]["0"][-1][0]  # the recipe's length
    assert low <= final["exact_match"] <= high, (
        f"the default run's held-out exact match {final['exact_match']:.3f} is outside the "
        f"README's range [{low:.3f}, {high:.3f}] (results/default_run.json): the demo regressed, "
        "or the recipe changed without python -m tools.default_run")
