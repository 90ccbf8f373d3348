"""tools/chaos.py: an elastic job under a seeded schedule of killed workers, held to the same job without faults.

The smallest real form: 4 slots on this machine, two workers SIGKILLed three
seconds apart (Horovod's driver refills each slot), against the run without
faults. The 16-rank schedules at T = 60, 30 and 15 s are docs/scale.md's.
"""
import json

from support.checks import ok
from support.launch import REPO, python
from support.weights import TOLERANCE

CHAOS = REPO / "tools" / "chaos.py"


def test_killed_workers_lose_no_sample_and_change_no_weight(tmp_path):
    report_file, picture = tmp_path / "chaos.json", tmp_path / "chaos.png"
    # Seed 29 at T = 3 s: the first kill 2.9 s after the first step, the second 3.0 s after the job
    # trains again (--one-at-a-time: a worker killed while the world re-forms ends the job today,
    # docs/scale.md), both well inside the job's 450 steps.
    ran = ok(python([CHAOS, "--ranks", "4", "--interval", "3", "--seed", "29", "--faults", "2", "--one-at-a-time",
                     "--epochs", "10", "--json", report_file, "--plot", picture], timeout=600))
    report = json.loads(report_file.read_text())
    without, faulty = report["runs"]
    assert without["exit"] == 0 and without["faults"] == 0 and without["samples_lost_or_twice"] == 0, without
    assert faulty["exit"] == 0 and faulty["faults"] == 2, (faulty, ran.describe())
    # Every epoch trained each sample once, whatever the resets went back to.
    assert faulty["samples_lost_or_twice"] == 0, faulty
    # fp32 and --global-batch: the same optimisation as the run that lost no one. Bit for bit when
    # every world had 4 ranks (the gradients' fixed buckets: before them, a reset's first step fused
    # other buffers and a CI run under load ended 4e-3 away); a world that formed without the new
    # worker splits the batch otherwise, and float32's summation order then moves the weights apart
    # as steps go (1.2e-5 after 450 steps in a CI run under load, past the 1e-5 held for a few dozen).
    difference = faulty["weights_max_difference"]
    assert difference is not None, faulty
    if set(faulty["world_sizes"]) == {4}:
        assert difference == 0.0, faulty
    else:
        assert difference <= 10 * TOLERANCE, faulty
    assert faulty["steps"] == without["steps"] and 0 < faulty["steps_kept"] <= 1, faulty
    assert 0 < faulty["efficiency"], faulty
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
