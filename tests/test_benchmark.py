"""scripts/benchmark.py: every mode runs under real launches and writes well-formed results.

No timing assertions: speed is what the benchmark reports, not what a test judges.
What is asserted is that Horovod and DDP compute the same thing (the same losses
for the same seed), the bandwidth arithmetic, and the files each mode promises.
"""
import json
import os
import re
import types

import pytest

from support.checks import ok, one_error_line, only_an_error_line
from support.launch import SCRIPTS, horovodrun, python
from support.weights import checkpoint_at

pytestmark = pytest.mark.usefixtures("need_horovod")

BENCH = SCRIPTS / "benchmark.py"
QUICK = ["--warmup-steps", "1", "--window-steps", "2", "--windows", "2"]
CNN = ["train", "--model", "resnet20", "--image-size", "8", "--batch-size", "4", *QUICK]
BERT = ["train", "--model", "bert-tiny", "--vocab-size", "500", "--seq-length", "16", "--batch-size", "4", *QUICK]
ENVIRONMENT_KEYS = {"date", "cpu", "cpu_count", "gpu", "torch", "horovod", "mpi", "backend", "controller",
                    "world_size", "threads_per_rank", "knobs", "command"}


def result(path):
    data = json.loads(path.read_text())
    assert ENVIRONMENT_KEYS <= set(data["environment"]), data["environment"]
    return data


def check_train_result(data, world_size, backend):
    assert data["environment"]["world_size"] == world_size and data["environment"]["backend"] == backend
    for part in ("total", "per_worker"):
        summary = data[part]
        assert len(summary["values"]) == 2 and all(value > 0 for value in summary["values"])
        assert summary["min"] <= summary["median"] <= summary["max"]
    assert abs(data["total"]["median"] - world_size * data["per_worker"]["median"]) < 1e-6 * data["total"]["median"]
    assert len(data["losses"]) == 1 + 2 * 2
    assert 0 < data["cpu_cores_per_rank"] < 64
    # every rank's step in parts, scored as the trainers' straggler report (runtime/stragglers.py)
    assert [row["rank"] for row in data["ranks"]] == list(range(world_size)), data["ranks"]
    assert all(row["compute_s"] > 0 and 0 < row["relative"]["busy"] <= 1 for row in data["ranks"]), data["ranks"]


# BERT's form in `make test-scale`: the comparison is the benchmark's, whatever the model.
@pytest.mark.parametrize("workload", [CNN, pytest.param(BERT, marks=pytest.mark.scale)], ids=["resnet20", "bert-tiny"])
def test_horovod_and_ddp_train_the_same_losses(tmp_path, workload, need_mpi):
    """The same model, batch, step and seed under Horovod (the MPI controller) and under DDP: the
    same numbers. Under MPI dist.init sets no cycle time (the Gloo controller's: the next test)."""
    ok(horovodrun(2, [BENCH, *workload, "--output", tmp_path / "hvd.json"], timeout=240, transport="mpi"))
    ok(horovodrun(2, [BENCH, *workload, "--baseline", "ddp", "--output", tmp_path / "ddp.json"], timeout=240))
    horovod, ddp = result(tmp_path / "hvd.json"), result(tmp_path / "ddp.json")
    check_train_result(horovod, 2, "horovod")
    check_train_result(ddp, 2, "ddp")
    assert horovod["environment"]["controller"] == "mpi"
    assert "HOROVOD_CYCLE_TIME" not in horovod["environment"]["knobs"], horovod["environment"]["knobs"]
    assert ddp["environment"]["controller"] == "torch.distributed (gloo)"
    for step, (a, b) in enumerate(zip(horovod["losses"], ddp["losses"])):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: Horovod {a} DDP {b}"
    assert horovod["losses"][-1] < horovod["losses"][0]  # it trains


def test_baseline_none_is_one_process(tmp_path):
    run = ok(python([BENCH, *CNN, "--baseline", "none", "--output", tmp_path / "none.json"], timeout=120))
    check_train_result(result(tmp_path / "none.json"), 1, "none")
    assert re.search(r"total: +median [\d.]+ images/s", run.output), run.describe()
    refused = horovodrun(2, [BENCH, *CNN, "--baseline", "none"], timeout=120)
    one_error_line(refused, "benchmark.py: error:", "launch it with plain python", status=None)


def test_knobs_and_horovod_diagnostics_are_recorded(tmp_path):
    timeline = tmp_path / "trace" / "timeline.json"
    ok(horovodrun(2, [BENCH, *CNN, "--fp16-allreduce", "--fusion-threshold-mb", "8", "--cycle-time-ms", "2",
                      "--horovod-timeline", timeline, "--output", tmp_path / "out.json"], timeout=240))
    data = result(tmp_path / "out.json")
    knobs = data["environment"]["knobs"]
    assert knobs["fp16_allreduce"] is True
    assert knobs["HOROVOD_FUSION_THRESHOLD"] == str(8 * 2**20) and knobs["HOROVOD_CYCLE_TIME"] == "2.0"
    assert knobs["HOROVOD_TIMELINE"] == str(timeline)
    trace = timeline.read_text()
    assert trace.startswith("[") and "ALLREDUCE" in trace
    # benchmark.py timeline: where the time went
    run = ok(python([BENCH, "timeline", timeline, "--output", tmp_path / "summary.json"], timeout=60))
    summary = json.loads((tmp_path / "summary.json").read_text())
    activities = {row["activity"]: row for row in summary["activities"]}
    gradients = activities["ALLREDUCE"]["count"]  # one per tensor and step (plus the benchmark's own sums)
    steps = 1 + 2 * 2
    assert gradients >= steps * 20  # resnet20 has 65 gradient tensors
    # Fused: fewer collectives than tensors, at least one per step.
    assert steps <= summary["collectives"]["GLOO_ALLREDUCE"] < gradients
    assert re.search(r"^\s+NEGOTIATE_ALLREDUCE\s+[\d.]+\s+\d+\s+[\d.]+$", run.output, re.MULTILINE), run.describe()


def test_the_gloo_controller_gets_the_measured_cycle_time(tmp_path):
    """The trainers' start-up (the benchmark's: dist.init(buckets=True)) sets HOROVOD_CYCLE_TIME under
    Gloo (under MPI none: the test above), and a value of the user's wins."""
    from hvdtrain.runtime import dist
    ok(horovodrun(2, [BENCH, *CNN, "--output", tmp_path / "default.json"], timeout=240, transport="gloo"))
    knobs = result(tmp_path / "default.json")["environment"]["knobs"]
    assert knobs.get("HOROVOD_CYCLE_TIME") == dist.GLOO_CYCLE_TIME_MS["cpu"], knobs
    ok(horovodrun(2, [BENCH, *CNN, "--output", tmp_path / "set.json"], timeout=240, transport="gloo",
                  env={"HOROVOD_CYCLE_TIME": "3"}))
    assert result(tmp_path / "set.json")["environment"]["knobs"]["HOROVOD_CYCLE_TIME"] == "3"


def test_the_start_up_call_keeps_horovods_controller_for_gradients_not_in_fixed_buckets(monkeypatch):
    """dist.init() in a user's script that hands its optimizer to a plain hvd.DistributedOptimizer:
    Horovod's own cycle and fusion (the 50 ms Gloo cycle, meant for fixed buckets, made such a script
    0.69 x DDP against 0.88 with a plain hvd.init()); fixed buckets without their settings: one line."""
    import torch
    from hvdtrain.errors import UsageError
    from hvdtrain.runtime import dist
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("HOROVOD_CYCLE_TIME", "HOROVOD_DISABLE_GROUP_FUSION")}
    monkeypatch.setattr(os, "environ", {**environment, "HOROVOD_CONTROLLER": "gloo"})
    dist.configure(use_cuda=False)
    assert "HOROVOD_CYCLE_TIME" not in os.environ and "HOROVOD_DISABLE_GROUP_FUSION" not in os.environ
    model = torch.nn.Linear(2, 2)
    optimizer = types.SimpleNamespace(_p_to_group={}, param_groups=[{"params": list(model.parameters())}])
    with pytest.raises(UsageError, match="needs Horovod configured for them before hvd.init"):
        dist.fixed_gradient_buckets(optimizer)
    dist.configure(use_cuda=False, buckets=True)
    assert os.environ["HOROVOD_CYCLE_TIME"] == dist.GLOO_CYCLE_TIME_MS["cpu"]
    assert os.environ["HOROVOD_DISABLE_GROUP_FUSION"] == "1"


@pytest.mark.parametrize("transport", ["mpi", "gloo"])
def test_allreduce_sweep_against_mpi4py_and_torch_distributed(tmp_path, transport, need_mpi):
    out = tmp_path / "sweep.json"
    ok(horovodrun(2, [BENCH, "allreduce", "--max-bytes", "16K", "--seconds", "0.02", "--output", out],
                  timeout=240, transport=transport))
    data = result(out)
    sizes = [1024, 4096, 16384]
    libraries = {"horovod", "torch"} | ({"mpi"} if transport == "mpi" else set())
    for row in data["rows"]:
        assert row["seconds"] > 0
        assert abs(row["algbw_gbps"] - row["bytes"] / row["seconds"] / 1e9) < 1e-9
        assert abs(row["busbw_gbps"] - row["algbw_gbps"] * 2 * (2 - 1) / 2) < 1e-9
    measured = {(row["library"], row["dtype"], row["bytes"]) for row in data["rows"]}
    expected = {(lib, dtype, size) for lib in libraries for dtype in ("float32", "float16") for size in sizes
                if not (lib == "mpi" and dtype == "float16")}
    assert measured == expected
    assert ("mpi" in data["unavailable"]) == (transport == "gloo")
    assert data["environment"]["controller"] == transport


def test_scaling_writes_table_json_and_plot(tmp_path):
    out = tmp_path / "scaling"
    run = ok(python([BENCH, "scaling", "--np", "1", "2", "--output-dir", out, "--", *BERT[1:]], timeout=400))
    data = json.loads((out / "scaling.json").read_text())
    assert [row["workers"] for row in data["rows"]] == [1, 2]
    assert data["rows"][0]["efficiency"] == 1.0 and data["rows"][1]["efficiency"] > 0
    assert (out / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for size in (1, 2):
        check_train_result(result(out / f"train-np{size}.json"), size, "horovod")
    assert re.search(r"^\s+2\s+[\d.]+\s+[\d.]+\s+[\d.]+$", run.output, re.MULTILINE), run.describe()


@pytest.mark.parametrize("args, fragment", [
    (["train", "--model", "resnet21"], "invalid choice: 'resnet21'"),
    (["allreduce", "--max-bytes", "12Q"], "not a size: '12Q'"),
    (["allreduce", "--min-bytes", "1M", "--max-bytes", "1K"], "--min-bytes is larger than --max-bytes"),
    (["train", "--baseline", "ddp", "--cycle-time-ms", "2"], "apply to Horovod runs only"),
])
def test_bad_arguments_are_one_line(args, fragment):
    only_an_error_line(python([BENCH, *args], timeout=60), fragment)


def test_trainers_write_horovod_timeline_and_autotune_log(tmp_path):
    """The same diagnostics options in the trainers (shared: hvdtrain.run.add_horovod_diagnostics)."""
    timeline, tuning = tmp_path / "diag" / "timeline.json", tmp_path / "diag" / "autotune.csv"
    ok(horovodrun(2, [SCRIPTS / "train_cnn.py", "--model", "convnet", "--image-size", "8", "--epochs", "1",
                      "--output-dir", tmp_path / "out", "--horovod-timeline", timeline,
                      "--horovod-autotune-log", tuning], timeout=240))
    assert timeline.read_text().startswith("[") and "ALLREDUCE" in timeline.read_text()
    assert tuning.read_text().startswith("hierarchical_allreduce,")  # the autotuner's CSV header


def test_compare_runs_every_kind_interleaved_and_reports_ratios(tmp_path):
    """Also: horovodrun is found beside the venv's Python when the venv is not on PATH."""
    out = tmp_path / "compare"
    run = ok(python([BENCH, "compare", "--repeats", "1", "--output-dir", out,
                     "--horovod-args", "--cycle-time-ms 2", "--", *CNN[1:]], timeout=400,
                    env={"PATH": "/usr/local/bin:/usr/bin:/bin"}))
    data = json.loads((out / "compare.json").read_text())
    assert set(data["rates"]) == {"horovod", "ddp", "horovod_1", "none", "independent"}
    medians = data["medians"]
    assert data["ratios"]["horovod / ddp"] == medians["horovod"] / medians["ddp"]
    assert data["ratios"]["horovod_1 / none"] == medians["horovod_1"] / medians["none"]
    assert data["ratios"]["weak scaling 1 -> 2"] == medians["horovod"] / (2 * medians["horovod_1"])
    assert data["ratios"]["ddp weak scaling 1 -> 2"] == medians["ddp"] / (2 * medians["none"])
    assert data["ratios"]["ceiling: 2 independent / (2 x none)"] == medians["independent"] / (2 * medians["none"])
    assert data["ratios"]["horovod / 2 independent"] == medians["horovod"] / medians["independent"]
    assert data["ratios"]["ddp / 2 independent"] == medians["ddp"] / medians["independent"]
    assert data["horovod_over_ddp_per_round"] == [data["rates"]["horovod"][0] / data["rates"]["ddp"][0]]
    # The independent kind: two plain processes, each its own result, summed.
    alone = [result(out / f"independent-0-{index}.json") for index in (0, 1)]
    assert all(part["environment"]["backend"] == "none" for part in alone)
    assert medians["independent"] == pytest.approx(sum(part["total"]["median"] for part in alone))
    horovod = result(out / "horovod-0.json")["environment"]
    assert horovod["knobs"]["HOROVOD_CYCLE_TIME"] == "2.0" and horovod["controller"] == "mpi"
    assert "HOROVOD_CYCLE_TIME" not in result(out / "ddp-0.json")["environment"]["knobs"]
    for name in ("horovod / ddp", "horovod_1 / none", "weak scaling 1 -> 2", "ddp weak scaling 1 -> 2",
                 "ceiling: 2 independent / (2 x none)", "horovod / 2 independent", "ddp / 2 independent"):
        assert re.search(rf"^{re.escape(name)}: [\d.]+$", run.output, re.MULTILINE), run.describe()


def test_tune_launches_every_combination_and_writes_the_fastest_beyond_the_noise(tmp_path):
    """tune: the defaults and each combination launched (interleaved rounds), each run getting
    its settings; the profile holds the fastest if it beats the defaults by more than the
    median spread between rounds, else the defaults (nothing set): which one depends on this
    machine's noise, the rule does not."""
    out = tmp_path / "tune"
    run = ok(python([BENCH, "tune", "--np", "2", "--fusion-mb", "0", "64", "--cycle-ms", "2.5",
                     "--compression", "none", "--repeats", "2", "--output-dir", out, "--", *CNN[1:]], timeout=600))
    data = json.loads((out / "tune.json").read_text())
    rows = data["rows"]
    assert [(row["fusion_mb"], row["cycle_ms"], row["fp16_allreduce"]) for row in rows] == [
        (None, None, False), (0, 2.5, False), (64, 2.5, False)], rows
    for index, row in enumerate(rows):
        for repeat in range(2):  # each run got its settings (as the run itself recorded them)
            knobs = result(out / f"run{index}-{repeat}.json")["environment"]["knobs"]
            expected = {} if row["fusion_mb"] is None else {
                "HOROVOD_FUSION_THRESHOLD": str(row["fusion_mb"] * 2**20), "HOROVOD_CYCLE_TIME": "2.5"}
            assert {name: knobs.get(name) for name in expected} == expected, knobs
        assert len(row["rates"]) == 2 and row["of_defaults"] == row["median"] / rows[0]["median"]
    written = lambda name: (out / name).stat().st_mtime_ns  # noqa: E731
    # an uncounted warm-up launch first; the second round starts in the middle of the grid
    assert written("warmup.json") < written("run0-0.json") < written("run2-0.json") < written("run1-1.json")
    assert written("run1-1.json") < written("run2-1.json") < written("run0-1.json")
    fastest = max(rows, key=lambda row: row["median"])
    spreads = sorted((max(row["rates"]) - min(row["rates"])) / row["median"] for row in rows)
    assert data["noise"] == pytest.approx(spreads[1])  # the median of three
    chosen = fastest if fastest["median"] / rows[0]["median"] - 1 > data["noise"] else rows[0]
    assert (data["fastest"], data["best"]) == (fastest["name"], chosen["name"]), data
    assert f"* {chosen['name']}" in run.output, run.describe()
    profile = json.loads((out / "horovod-profile.json").read_text())
    expected = {} if chosen is rows[0] else {"HOROVOD_FUSION_THRESHOLD": str(chosen["fusion_mb"] * 2**20),
                                             "HOROVOD_CYCLE_TIME": "2.5"}
    assert profile["environment"] == expected and profile["fp16_allreduce"] is False, profile
    assert profile["tuned_on"]["np"] == 2 and profile["tuned_on"]["controller"] == "mpi", profile


def test_the_trainers_read_a_tuned_profile_and_the_environment_and_flag_win(tmp_path):
    from hvdtrain.runtime import horovod_profile  # what benchmark.py tune writes with

    profile = horovod_profile.write(tmp_path / "profile.json", 64, 2.5, True,
                                    {"np": 2, "controller": "mpi", "train_args": "--model resnet20"})
    train = [SCRIPTS / "train_cnn.py", "--model", "convnet", "--image-size", "8", "--max-steps", "2",
             "--horovod-profile", profile]
    used = ok(horovodrun(2, [*train, "--output-dir", tmp_path / "a"], timeout=240))
    assert (f"Horovod profile {profile} (tuned on 2 ranks, mpi controller, --model resnet20): "
            f"HOROVOD_FUSION_THRESHOLD={64 * 2**20}, HOROVOD_CYCLE_TIME=2.5, fp16 allreduce on") in used.output
    assert checkpoint_at(tmp_path / "a", 2)["settings"]["fp16_allreduce"] is True  # what the run computed with
    kept = ok(horovodrun(2, [*train, "--output-dir", tmp_path / "b", "--no-fp16-allreduce"], timeout=240,
                         env={"HOROVOD_CYCLE_TIME": "7"}))
    assert (f"HOROVOD_FUSION_THRESHOLD={64 * 2**20}; kept HOROVOD_CYCLE_TIME=7 (set in the environment), "
            "fp16 allreduce off (the flag)") in kept.output, kept.describe()
    assert checkpoint_at(tmp_path / "b", 2)["settings"]["fp16_allreduce"] is False


@pytest.mark.parametrize("text, fragment", [
    (None, "cannot read it (No such file or directory)"),
    ("{", "not JSON"),
    ('{"format": "other"}', "not a Horovod profile"),
    ('{"format": "hvdtrain-horovod-profile/1", "environment": {"HOROVOD_TIMELINE": "x"}}', '"environment" may set'),
], ids=["missing", "not-json", "other-format", "other-variable"])
def test_a_bad_horovod_profile_is_one_line_exit_2(tmp_path, text, fragment):
    profile = tmp_path / "profile.json"
    if text is not None:
        profile.write_text(text)
    run = python([SCRIPTS / "train_cnn.py", "--horovod-profile", profile, "--output-dir", tmp_path / "out"],
                 timeout=120)
    only_an_error_line(run, f"--horovod-profile {profile}: {fragment}")
