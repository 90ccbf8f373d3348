"""benchmark.py predict: the model's formulas, its command line, and --validate on the link study.

No accuracy is asserted: how close the model comes is what --validate reports. What
is asserted is the arithmetic (ring allreduce terms, fusion buffers, the overlap
bound), that every cell of the study is checked, and that docs show commands that run.
"""
import json
import re
import shlex
import sys

import pytest

from hvdtrain.bench import bounds, options, predict
from support.checks import ok
from support.launch import REPO, SCRIPTS, launch, python

BENCH = SCRIPTS / "benchmark.py"
STUDY = REPO / "docs" / "performance" / "link-study.json"
FOUR_HOSTS = REPO / "docs" / "performance" / "link-study-4-hosts"  # a whole run: every result file
ROW = re.compile(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", re.M)


def test_ring_allreduce_latency_and_bandwidth_terms():
    assert predict.ring_allreduce_seconds(1e9, 1, 1e9, 1e-3) == 0.0  # one worker: nothing to send
    # 2 ranks: 2 latency steps, and each rank sends and receives all the bytes once
    assert predict.ring_allreduce_seconds(1e9, 2, 1e9, 1e-3) == pytest.approx(2e-3 + 1.0)
    # 8 ranks: 14 steps, 2 x 7/8 of the bytes
    assert predict.ring_allreduce_seconds(8e8, 8, 1e9, 1e-6) == pytest.approx(14e-6 + 1.4)
    assert predict.bus_bandwidth(3.0, 2) == 3.0 and predict.bus_bandwidth(4.0, 8) == pytest.approx(7.0)


def test_fusion_buffers_pack_in_order_up_to_the_threshold():
    assert predict.fusion_buffers([60, 60, 60], 128) == [120, 60]
    assert predict.fusion_buffers([60, 60, 60], 1000) == [180]
    assert predict.fusion_buffers([60, 60, 60], 0) == [60, 60, 60]  # fusion off: one allreduce per tensor
    assert predict.fusion_buffers([10, 200, 10], 100) == [10, 200, 10]  # too large for a buffer: alone
    assert predict.fusion_buffers([], 128) == []
    # The trainers' fixed buckets: a buffer never spans two, whatever the threshold.
    assert predict.fusion_buffers([60, 60, 60], 1000, bucket=100) == [60, 60, 60]
    assert predict.fusion_buffers([30, 30, 60, 60], 1000, bucket=120) == [120, 60]
    # more buffers, more latency terms, the same bandwidth term
    one = predict.communication_seconds([60, 60, 60], 1000, 2, 1.0, 5.0)
    three = predict.communication_seconds([60, 60, 60], 0, 2, 1.0, 5.0)
    assert three - one == pytest.approx(2 * 2 * 5.0)


def test_overlap_bound_and_no_overlap():
    compute, comm = 3.0, 2.0
    assert predict.step_seconds(compute, comm, 1.0, 1.0) == max(compute, comm)  # perfect overlap: the bound
    assert predict.step_seconds(1.0, 2.0, 1.0, 1.0) == 2.0
    assert predict.step_seconds(compute, comm, 2 / 3, 0.0) == compute + comm  # no overlap: the sum
    assert predict.step_seconds(compute, comm, 2 / 3, 0.5) == pytest.approx(3.0 + 1.0)  # 1 s of 2 hidden
    assert predict.step_seconds(compute, comm, 1.0, 1.0, casts=0.5) == 3.5  # casts are not hidden
    assert predict.cast_seconds(1e9, 2e9) == 1.0  # to fp16 and back


def test_gradient_bytes_of_the_models():
    resnet50 = predict.gradient_tensors("resnet50")
    assert sum(resnet50) == 25_557_032 and len(resnet50) == 161
    assert resnet50[0] == 1000  # the classifier's bias: the first gradient backward makes
    assert sum(predict.gradient_tensors("bert-base")) == pytest.approx(110.1e6, rel=1e-3)


def predicted_rows(output):
    return [tuple(float(value) for value in match) for match in ROW.findall(output)]


def test_predict_cli_prints_every_node_count_and_the_fp16_verdict():
    ran = python([BENCH, "predict", "--model", "resnet50", "--compute-ms", "100", "--link-gbit", "25",
                  "--cast-gbps", "500"], timeout=120)
    ok(ran)
    rows = predicted_rows(ran.output)
    assert [row[0] for row in rows] == options.NODES, ran.describe()
    for nodes, comm, step, efficiency, comm16, step16, efficiency16 in rows:
        assert step >= 100.0 and efficiency == pytest.approx(100.0 / step, abs=1e-3)
        assert comm16 < comm  # half the bytes
    assert "102.2 MB of fp32 gradients" in ran.output and "fp16 compression pays from" in ran.output


def test_predict_reads_a_link_from_an_allreduce_sweep(tmp_path):
    """The allreduce mode's JSON: busbw of the largest message, latency of the smallest."""
    rows = [{"library": "horovod", "dtype": "float32", "bytes": size, "seconds": seconds,
             "algbw_gbps": size / seconds / 1e9, "busbw_gbps": size / seconds / 1e9 * 1.5}
            for size, seconds in ((1024, 40e-6), (2**26, 0.1))]
    sweep = tmp_path / "allreduce.json"
    sweep.write_text(json.dumps({"mode": "allreduce", "rows": rows, "environment": {"world_size": 4}}))
    assert predict.link_from_sweep(sweep, "horovod") == (pytest.approx(2**26 / 0.1 * 1.5), None,
                                                         pytest.approx(40e-6 / 6))
    ran = python([BENCH, "predict", "--gradient-bytes", "1e8", "--tensors", "10", "--compute-ms", "50",
                  "--sweep", sweep, "--cast-gbps", "10", "--nodes", "4", "16"], timeout=120)
    ok(ran)
    assert "busbw 1.01 GB/s" in ran.output and "latency 6.7 us" in ran.output, ran.describe()
    assert [row[0] for row in predicted_rows(ran.output)] == [4, 16]


def test_predict_needs_a_workload_and_a_compute_time():
    ran = python([BENCH, "predict", "--link-gbit", "100"], timeout=120)
    assert ran.returncode == 2 and "give --model or --gradient-bytes" in ran.output, ran.describe()


def test_validate_checks_every_cell_of_the_link_study():
    study = json.loads(STUDY.read_text())

    class Options:
        overlap, backward_share, latency_us = 1.0, 2 / 3, 50.0

    cells = bounds.cells(study, Options, cast=1.5e9)
    assert len(cells) == len(study["rows"]) == 16
    for cell, row in zip(cells, study["rows"]):
        model, batch, _ = bounds.model_settings(study["models"][row["model"]])
        base = study["base_one_rank"][row["model"]]
        assert cell["nodes"] == 2 and cell["compute_s"] == pytest.approx(batch / base)
        assert cell["measured_s"] == pytest.approx(2 * batch / row["total"])
        width = 2 if row["fp16_allreduce"] else 4
        params = 25_557_032 if model == "resnet50" else sum(predict.gradient_tensors(model))
        # 2 ranks: busbw = algbw, so the ring moves the gradient bytes once at algbw
        assert cell["comm_s"] == pytest.approx(width * params / (row["link_algbw_gbps"] * 1e9))
        assert cell["fraction_of_bound"] == pytest.approx(max(cell["compute_s"], cell["comm_s"]) / cell["measured_s"])
        assert cell["error"] == pytest.approx(cell["predicted_s"] / cell["measured_s"] - 1)
        assert cell["compute_s"] <= cell["predicted_s"] <= cell["no_overlap_s"] + 1.0  # casts and latency on top
    ran = python([BENCH, "predict", "--validate", STUDY, "--cast-gbps", "1.5"], timeout=180)
    ok(ran)
    assert len(re.findall(r"^\| 1?0?gbit .* [+-]\d+ % \|$", ran.output, re.M)) == 16, ran.describe()
    assert re.search(r"within \+-10 %: \d+ of 16 cells", ran.output), ran.describe()


def test_validate_takes_the_compute_at_the_studys_placement_and_its_hosts():
    """A study from link_study.py --hosts 4: n is the study's hosts, the compute a plain loop on
    every host at once (base_placed, slower than one rank alone: they share the cores), and
    comm = 2(n-1)/n x bytes / busbw with busbw = algbw x 2(n-1)/n, i.e. the bytes over the algbw."""
    study = json.loads(STUDY.read_text())
    placed = {model: rate / 2.5 for model, rate in study["base_one_rank"].items()}
    four = {**study, "hosts": 4, "base_placed": placed}

    class Options:
        overlap, backward_share, latency_us = 1.0, 2 / 3, 50.0

    for cell, row in zip(bounds.cells(four, Options, cast=1.5e9), four["rows"]):
        model, batch, _ = bounds.model_settings(four["models"][row["model"]])
        width = 2 if row["fp16_allreduce"] else 4
        params = sum(predict.gradient_tensors(model))
        assert cell["nodes"] == 4 and cell["compute_s"] == pytest.approx(batch / placed[row["model"]])
        assert cell["measured_s"] == pytest.approx(4 * batch / row["total"])
        assert cell["comm_s"] == pytest.approx(width * params / (row["link_algbw_gbps"] * 1e9))


def test_a_link_studys_summary_is_computed_from_its_result_files(tmp_path):
    """link_study.py --summarize-only over the four-host study's result files, with the options it
    ran with, writes the study.json the docs quote: no figure of it was written by hand."""
    committed = json.loads((FOUR_HOSTS / "study.json").read_text())
    for result in FOUR_HOSTS.glob("*.json"):  # study.json too: the tool keeps the command that measured
        (tmp_path / result.name).write_text(result.read_text())
    options = shlex.split(committed["command"])[1:]
    at = options.index("--output-dir")
    options[at + 1] = str(tmp_path)
    ran = python([REPO / "tools" / "link_study.py", *options, "--summarize-only"], timeout=120)
    ok(ran)
    again = json.loads((tmp_path / "study.json").read_text())
    assert again["command"] == committed["command"] and "--summarize-only" in again["summarized_by"]
    for key in ("hosts", "base_one_rank", "base_placed", "placed_cpu_cores_per_rank", "rows"):
        assert again[key] == committed[key], key


def test_validate_says_where_a_step_goes_on_shared_cores():
    """Per cell: CPU seconds per rank-step (the cell's busy cores x its step) against the plain
    loop's at the same placement; the rest is communication's; the machine's share busy."""
    study = json.loads((FOUR_HOSTS / "study.json").read_text())

    class Options:
        overlap, backward_share, latency_us = 1.0, 2 / 3, 50.0

    for cell, row in zip(bounds.cells(study, Options, cast=1.5e9), study["rows"]):
        loop = study["placed_cpu_cores_per_rank"][row["model"]]
        assert cell["cpu_s"] == pytest.approx(row["cpu_cores_per_rank"] * cell["measured_s"])
        assert cell["loop_cpu_s"] == pytest.approx(loop * cell["compute_s"])
        assert cell["extra_cpu_s"] == pytest.approx(cell["cpu_s"] - cell["loop_cpu_s"])
        assert cell["machine_busy"] == pytest.approx(4 * row["cpu_cores_per_rank"] / study["machine_cores"])
    ran = python([BENCH, "predict", "--validate", FOUR_HOSTS / "study.json", "--cast-gbps", "1.5"], timeout=180)
    ok(ran)
    assert "Where a step goes on the 2 cores the 4 ranks share" in ran.output, ran.describe()


# Every `benchmark.py predict` command the docs show, as written (a comment after it dropped).
DOC_COMMANDS = sorted({match.split("#")[0].strip() for page in ("benchmark.md", "performance.md")
                       for match in re.findall(r"\.venv/bin/python scripts/benchmark\.py predict [^`\n]*",
                                               (REPO / "docs" / page).read_text())})


def test_docs_show_predict_commands():
    assert any("--validate" in command for command in DOC_COMMANDS), DOC_COMMANDS
    assert any("--model bert-large" in command for command in DOC_COMMANDS), DOC_COMMANDS


@pytest.mark.parametrize("command", DOC_COMMANDS)
def test_predict_commands_in_docs_run(command):
    ran = launch([sys.executable, *shlex.split(command)[1:]], 180, cwd=REPO)
    ok(ran)
    assert re.search(r"^\| (2|1gbit) \|", ran.output, re.M), ran.describe()
