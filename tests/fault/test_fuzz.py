"""The CI-size fault fuzz: a few hundred requests in ~80 seeded random trials (about 2 minutes on 2 cores).

FUZZ_TRIALS and FUZZ_SEED override the size and the run's seed (random by default); the seed is printed
even when the run passes, and every failing trial prints its own seed for `python -m tests.fault.fuzz
--replay SEED`. The nightly size is the CLI with `--trials 10000` (`make soak`).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

from tests.fault.fuzz import draw_trial, run_trials, trial_seeds

pytestmark = [pytest.mark.fault, pytest.mark.timeout(900)]

DEFAULT_TRIALS = 80
# Product bugs this suite found, each reproduced by a strict xfail test of its own and reported: timing races
# that a random trial hits now and then. Here they are counted and printed, not failed on (the soak's CLI
# still fails on them); a check not listed fails the run.
KNOWN_PRODUCT_BUGS = {
    "envoy-reply-not-in-the-apis-shape": (
        "Envoy's own 502 in the release race is not replaced by the request's error (OpenAI-shaped on "
        "/v1/messages): test_api_contract.py::test_envoys_own_answer_in_the_release_race_is_in_the_apis_shape"
    ),
}


def test_fuzz_keeps_every_invariant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trials = int(os.environ.get("FUZZ_TRIALS") or DEFAULT_TRIALS)
    seed = int(os.environ["FUZZ_SEED"]) if os.environ.get("FUZZ_SEED") else secrets.randbits(32)
    with capsys.disabled():
        print(
            f"\nfuzz seed {seed} ({trials} trials): FUZZ_SEED={seed} FUZZ_TRIALS={trials} reproduces the run"
        )
    specs = [draw_trial(s) for s in trial_seeds(seed, trials)]
    report = run_trials(specs, work=tmp_path / "work", seed=seed, artifacts=tmp_path / "failures")
    with capsys.disabled():
        print(report.summary())
    assert report.trials == trials, f"only {report.trials} of {trials} trials ran: {report.env_errors}"
    assert report.requests >= trials
    known = [(s, v) for s, v in report.violations if v.check in KNOWN_PRODUCT_BUGS]
    with capsys.disabled():
        for check in sorted({v.check for _, v in known}):
            seen = [s for s, v in known if v.check == check]
            print(
                f"known product bug seen {len(seen)} time(s) (trials {sorted(set(seen))[:5]}): "
                f"{KNOWN_PRODUCT_BUGS[check]}"
            )
    unexpected = [(s, v) for s, v in report.violations if v.check not in KNOWN_PRODUCT_BUGS]
    assert not unexpected, (
        f"{len(unexpected)} invariant violations (seed {seed}; replay a trial with "
        f"`python -m tests.fault.fuzz --replay TRIAL_SEED`):\n{report.summary()}"
    )
