"""The model of the lease protocol (model/lease.pml), checked by SPIN: every configuration
exhaustively with 0 errors, each seeded fault caught with a counterexample, and each open defect
still shown (it moves to the checked configurations once fixed). Skips without ``spin`` locally;
fails in CI, where ``.ci/run`` installs it."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
import check  # the model's own runner, outside the package

if shutil.which("spin") is None or shutil.which("gcc") is None:
    if os.environ.get("CI") == "true":
        raise RuntimeError("spin and gcc are needed for the model check (Debian: apt-get install spin gcc)")
    pytest.skip("spin or gcc is not installed", allow_module_level=True)

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("config", check.CONFIGS, ids=lambda c: c.name)
def test_the_protocol_holds_in_every_state(config: check.Config) -> None:
    result = check.verify(config)
    assert result.complete, result.output
    assert result.errors == 0, check.trail(result, config)
    assert result.states > 0


@pytest.mark.parametrize("seed", sorted(check.SEEDS))
def test_a_removed_safeguard_gives_a_counterexample(seed: str) -> None:
    what, name, assertion = check.SEEDS[seed]
    config = check.by_name(name)
    result = check.verify(config, check.seeded(seed))
    assert result.errors >= 1, f"{seed} ({what}): no counterexample"
    story = check.trail(result, config, check.seeded(seed))
    assert "failed assertion: assert(" in story and assertion in story.replace(" ", ""), story


@pytest.mark.parametrize("config", check.OPEN, ids=lambda c: c.name)
def test_an_open_defect_is_still_shown(config: check.Config) -> None:
    """Fixed? Then move the configuration to CONFIGS (and the docs' list of open defects)."""
    assert check.verify(config).errors >= 1
