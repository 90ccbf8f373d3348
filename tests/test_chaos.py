"""tools/chaos.py: an elastic job under a seeded schedule of killed workers, held to the same job without faults.

The smallest real form: 4 slots on this machine, a worker SIGKILLed and another
one second later, while the world re-forms (Horovod's driver refills each slot),
against the run without faults; the relaunch path (`--relaunch`) at 2 slots, one
fault. The larger forms (make test-scale): 16 slots, a fault every 15 s; BERT; a host cut off. The
16-rank schedules at T = 60, 30 and 15 s are docs/scale.md's.
"""
import json

import pytest

from support.checks import ok
from support.elastic_jobs import GLOO_TIMEOUT_SECONDS
from support.launch import REPO, python
from support.weights import TOLERANCE

CHAOS = REPO / "tools" / "chaos.py"
# Gloo's timeout far above a reset (a new worker's start on a loaded machine included), the
# Horovod logs that split each recovery into phases, and every run's output kept (what a
# failed assertion shows).
TIMED = ["--gloo-timeout", GLOO_TIMEOUT_SECONDS, "--horovod-log-level", "INFO"]


def log_tail(logs, run, lines=80):
    """The end of a chaos run's kept output (--log), for an assertion's message."""
    path = logs / f"{run}.log"
    return "\n".join(path.read_text().splitlines()[-lines:]) if path.exists() else f"(no {path})"


def test_killed_workers_lose_no_sample_and_change_no_weight(tmp_path):
    report_file, picture, logs = tmp_path / "chaos.json", tmp_path / "chaos.png", tmp_path / "logs"
    # Seed 29 at T = 3 s: the first kill 2.4 s after the first step, the second 1 s later, while the
    # survivors form the next world with the new worker (it ended the job: every survivor's Gloo
    # rendezvous failed and the Horovod patch exited them; then it cost the listening pairs 150 s).
    # 5 epochs (225 steps): both kills fall in training, and the world trains again after them.
    ran = ok(python([CHAOS, "--ranks", "4", "--interval", "3", "--seed", "29", "--faults", "2", "--then-after", "1",
                     "--epochs", "5", "--json", report_file, "--plot", picture, "--log", logs, *TIMED], timeout=600))
    report = json.loads(report_file.read_text())
    without, faulty = report["runs"]
    assert without["exit"] == 0 and without["faults"] == 0 and without["samples_lost_or_twice"] == 0, without
    assert faulty["exit"] == 0 and faulty["faults"] == 2, (faulty, ran.describe())
    first, second = faulty["fault_records"]
    assert first["reform_s"] is None, faulty  # no world formed between the kills: the second fell in the re-form
    # The world that lost a worker while forming gave up when the driver marked it failed, not at Gloo's
    # timeout (its listening pairs waited 5 timeouts); what it printed: from rank 0 of that world, unless
    # it was the one killed, "the new world did not form (...)". One line a fault: horovodrun's shell
    # printed "[k]<stderr>:Killed" beside it (the Horovod patch's exec). What the world waits for is the
    # new worker's start: 4-10 s here, 32 s in a CI run on a loaded 2-core machine, where the job's
    # first step came 44 s after its launch (against Horovod's 30 s timeout it looked like one).
    assert second["first_step_s"] is not None and second["first_step_s"] < GLOO_TIMEOUT_SECONDS, \
        (json.dumps(second), log_tail(logs, "every-3s"))
    # The recovery's phases follow each other: the driver saw the exit, assigned the world that formed,
    # its Gloo contexts formed, the trainers synced the state, the first step.
    phases = second["phases"]
    assert phases is not None and None not in phases.values(), json.dumps(second)
    assert list(phases.values()) == sorted(phases.values()), json.dumps(second)
    # One line a fault, counted over both: where the worker lost first was rank 0, its line comes
    # from the rank the state comes from once a world has formed, after the second kill.
    said = first["said"] + second["said"]
    assert first["lines"] + second["lines"] <= 2, json.dumps([first, second])
    assert not any("timeout" in line.lower() or "Killed" in line for line in said), json.dumps([first, second])
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


def test_the_relaunch_path_resumes_each_fault_from_the_newest_checkpoint(tmp_path):
    """--relaunch: a fixed-size job that a killed worker ends (one line), launched again at once
    from its newest checkpoint, trains the weights of the run without faults bit for bit."""
    report_file = tmp_path / "chaos.json"
    # Seed 3 draws its fault 1.0 s after the first step: within the job's 6 epochs (2.4 s for 4 on
    # a 2-core Xeon, where a draw of 2.0 s at --interval 2 fell after its end).
    ran = ok(python([CHAOS, "--relaunch", "--ranks", "2", "--interval", "1", "--seed", "3", "--faults", "1",
                     "--epochs", "6", "--json", report_file], timeout=600))
    report = json.loads(report_file.read_text())
    assert report["path"] == "relaunch", report
    without, faulty = report["runs"]
    assert without["exit"] == 0 and without["world_sizes"] == [2], without
    assert faulty["exit"] == 0 and faulty["faults"] == 1, (faulty, ran.describe())
    assert faulty["world_sizes"] == [2, 2], faulty  # launched twice
    fault, = faulty["fault_records"]
    assert fault["detect_s"] is not None and fault["first_step_s"] is not None, faulty
    assert faulty["samples_lost_or_twice"] == 0, faulty
    assert faulty["weights_max_difference"] == 0.0, faulty
    assert faulty["steps"] == without["steps"] and 0 < faulty["steps_kept"] <= 1, faulty


@pytest.mark.scale
@pytest.mark.whole_machine  # 16 ranks: a test beside it stretched a reset past 30 s
def test_sixteen_ranks_under_a_fault_every_15_s_lose_no_sample(tmp_path):
    """docs/scale.md's harshest schedule, shortened: 16 slots, a worker killed every 15 s on
    average whenever it falls (in a reset too): the job completes, every sample once per epoch."""
    report_file, logs = tmp_path / "chaos.json", tmp_path / "logs"
    ran = ok(python([CHAOS, "--ranks", "16", "--interval", "15", "--seed", "1", "--epochs", "20",
                     "--json", report_file, "--log", logs, *TIMED], timeout=1500))
    without, faulty = json.loads(report_file.read_text())["runs"]
    assert faulty["exit"] == 0 and faulty["faults"] >= 2, (faulty, ran.describe())
    assert faulty["samples_lost_or_twice"] == 0, faulty
    # No loss waited out Gloo's timeout (one kill in three to five did, before the patch ended a
    # rank's background loop when its Gloo pair broke).
    assert faulty["longest_pause_s"] < GLOO_TIMEOUT_SECONDS, (faulty, log_tail(logs, "every-15s"))
    difference = faulty["weights_max_difference"]
    assert difference is not None and difference <= 10 * TOLERANCE, faulty
    print(f"16 ranks, a fault every 15 s: {faulty['faults']} faults, efficiency {faulty['efficiency']}, "
          f"steps kept {faulty['steps_kept']}")


@pytest.mark.scale  # test_elastic.py's BERT test proves the elastic data at its smallest
def test_bert_under_killed_workers_trains_every_instance_once(tmp_path):
    """--trainer bert: pretrain_bert.py --elastic (no dropout, length bins) at 4 slots, two workers
    killed: every epoch trains the instances of the run without faults' once, the weights within 1e-5."""
    report_file, logs = tmp_path / "chaos.json", tmp_path / "logs"
    ran = ok(python([CHAOS, "--trainer", "bert", "--ranks", "4", "--interval", "6", "--seed", "2", "--faults", "2",
                     "--steps", "120", "--json", report_file, "--log", logs, *TIMED], timeout=900))
    without, faulty = json.loads(report_file.read_text())["runs"]
    assert without["exit"] == 0 and without["samples_lost_or_twice"] == 0, without
    assert faulty["exit"] == 0 and faulty["faults"] >= 1, (faulty, ran.describe())
    assert faulty["samples_lost_or_twice"] == 0, (faulty, log_tail(logs, "every-6s"))
    assert faulty["weights_max_difference"] is not None and faulty["weights_max_difference"] <= TOLERANCE, faulty


@pytest.mark.scale  # test_elastic.py's cut-off test proves the mechanism at 3 ranks on two hosts
def test_a_host_cut_off_for_longer_than_the_wait_is_left_behind_and_the_job_completes(tmp_path):
    """--fault link at 8 slots on four hosts: a host's link down for 30 s; its workers are named in one
    line and left behind before Gloo's timeout (120 s here), the job completes, every sample once."""
    report_file, logs = tmp_path / "chaos.json", tmp_path / "logs"
    ran = ok(python([CHAOS, "--ranks", "8", "--hosts", "4", "--fault", "link", "--return-after", "30",
                     "--interval", "5", "--faults", "1", "--seed", "3", "--epochs", "8", "--json", report_file,
                     "--log", logs, *TIMED], timeout=900))
    without, faulty = json.loads(report_file.read_text())["runs"]
    assert faulty["exit"] == 0 and faulty["faults"] == 1, (faulty, ran.describe())
    fault, = faulty["fault_records"]
    assert fault["first_step_s"] is not None and fault["first_step_s"] < 45, (json.dumps(fault),
                                                                              log_tail(logs, "every-5s"))
    assert fault["lines"] == 1 and "could not be reached" in fault["said"][0], json.dumps(fault)
    assert faulty["samples_lost_or_twice"] == 0, faulty
    # The final weights are compared and reported, not bounded: a resize from 8 ranks to 6 sums the
    # gradients in another order over hundreds of steps (5.2e-3 in one run; docs/scale-log.md reports
    # 1.2e-5 to 2.8e-2 after host losses), so only a job that saved no model fails here.
    assert faulty["weights_max_difference"] is not None, faulty
