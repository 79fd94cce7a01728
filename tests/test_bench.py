"""tf-asyncps bench: its logic and tiny real runs (straggler injection, which
the bench's straggler runs use: tests/test_straggler.py)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import run_command
from tf_asyncps.app import bench, bench_report
from tf_asyncps.cluster import netns

pytestmark = pytest.mark.timeout(300)
NETNS_MISSING = netns.unavailable(rate=True)


def test_default_runs_cover_every_policy_and_the_baselines():
    names = [r["name"] for r in bench.default_configs(num_workers=2)]
    assert names[:2] == ["single", "vanilla"]
    for p in ("async", "drop_stale", "staleness_aware", "ssp", "dc_asgd", "sync_replicas",
              "async+locking", "local_sgd", "straggler_sync_all", "straggler_sync_backup"):
        assert p in names
    runs = {r["name"]: r for r in bench.default_configs(num_workers=2, sync_every=8,
                                                        straggler_workers=5)}
    assert runs["local_sgd"]["spe"] == 8 and runs["local_sgd"]["policy_args"] == {"sync_every": 8}
    assert runs["straggler_sync_all"]["policy_args"] == {"replicas_to_aggregate": 5,
                                                         "total_num_replicas": 5}
    assert runs["straggler_sync_backup"]["policy_args"]["replicas_to_aggregate"] == 4
    # The 1M-parameter model: the baselines, async and local_sgd again.
    assert [n for n in names if n.endswith("@1m")] == [
        "single@1m", "vanilla@1m", "async@1m", "local_sgd@1m"]
    assert runs["local_sgd@1m"]["model"] == "mlp_1m" and runs["local_sgd"]["model"] == "mlp"
    assert runs["local_sgd@1m"]["spe"] == 8
    assert bench.MODELS["mlp_1m"] == (1024, 1024)
    assert not any(r["name"].endswith("@1m")
                   for r in bench.default_configs(num_workers=2, large_model=False))
    # The slowest runs may be given runs of their own length.
    steps = {r["name"]: r.get("steps") for r in bench.default_configs(
        straggler_steps=640, large_model_steps=320)}
    assert steps["straggler_sync_all"] == steps["straggler_sync_backup"] == 640
    assert {n: v for n, v in steps.items() if n.endswith("@1m")} == {
        "single@1m": 320, "vanilla@1m": 320, "async@1m": 320, "local_sgd@1m": 320}
    assert steps["async"] is None and steps["local_sgd"] is None


def test_unknown_run_name_is_rejected():
    with pytest.raises(ValueError, match="bench_only.*nope"):
        bench.default_configs(only=["async", "nope"])


def _result(name, steps_per_sec, acc=0.95, updates=None):
    return {"name": name, "num_workers": 2, "spe": 16, "steps_per_sec": steps_per_sec,
            "examples_per_sec": steps_per_sec * 32, "updates_per_sec": updates,
            "test_accuracy": acc, "steps_to_target": 160, "seconds_to_target": 1.0,
            "staleness": None, "segments": [{"steps": 160, "seconds": 1.0,
                                             "test_accuracy": acc, "global_step": None}]}


def _entry(name, rates, acc=0.95, updates=None):
    """A run's entry as run_all builds it from repeats of these steps/s."""
    return bench.aggregate_repeats(
        {"name": name, "num_workers": 2, "spe": 16},
        [_result(name, r, acc=acc, updates=None if updates is None else updates * r / rates[0])
         for r in rates])


def test_repeats_give_medians_and_min_max_ranges():
    e = _entry("async", [300.0, 420.0, 380.0])
    assert e["steps_per_sec"] == 380.0 and e["steps_per_sec_range"] == [300.0, 420.0]
    assert e["examples_per_sec"] == 380.0 * 32
    assert [r["steps_per_sec"] for r in e["repeats"]] == [300.0, 420.0, 380.0]
    even = _entry("async", [100.0, 200.0, 400.0, 300.0])
    assert even["steps_per_sec"] == 250.0 and even["steps_per_sec_range"] == [100.0, 400.0]
    # A failed repeat is left out of the figures and counted.
    part = bench.aggregate_repeats({"name": "a", "num_workers": 2, "spe": 16},
                                   [_result("a", 10.0), {"error": "timed out"}])
    assert part["steps_per_sec"] == 10.0 and part["failed_repeats"] == 1
    assert "error" not in part
    failed = bench.aggregate_repeats({"name": "a", "num_workers": 2, "spe": 16},
                                     [{"error": "exit status 1"}] * 2)
    assert failed["error"] == "exit status 1"
    assert bench.spread([None, 3.0, 1.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert bench.spread([None]) is None


def test_a_ratio_is_of_medians_with_the_range_of_paired_repeats():
    a = _entry("async", [300.0, 420.0, 380.0])
    v = _entry("vanilla", [400.0, 400.0, 500.0])
    value, rng = bench_report.ratio(a, v)
    assert value == pytest.approx(380.0 / 400.0)
    # Repeat k against repeat k (run back to back): 0.75, 1.05, 0.76.
    assert rng == pytest.approx([0.75, 1.05])


@pytest.mark.parametrize("value,rng,target,want", [
    (1.0, [0.96, 1.1], 0.95, "met"),
    (0.95, [0.95, 0.95], 0.95, "met"),        # the bound itself is met
    (0.97, [0.90, 1.02], 0.95, "unclear"),    # straddles: cannot say
    (0.80, [0.70, 0.94], 0.95, "not met"),
    (0.97, None, 0.95, "met"),                # one repeat: the value alone
    (None, None, 0.95, "no data")])
def test_met_unclear_not_met_rule(value, rng, target, want):
    assert bench_report.verdict(value, rng, target) == want


def test_summary_ratios_and_target_checks(tmp_path):
    settings = {"batch_size": 32, "learning_rate": 0.1, "seed": 0, "steps": 160,
                "eval_every": 160, "target_accuracy": 0.9, "repeats": 3}
    results = [_entry("single", [4000.0, 3900.0, 4100.0]),
               _entry("vanilla", [400.0, 400.0, 400.0]),
               _entry("async", [380.0, 370.0, 390.0]),
               _entry("drop_stale", [300.0, 380.0, 400.0]),
               _entry("local_sgd", [2400.0, 2300.0, 2500.0], acc=0.91),
               _entry("straggler_sync_all", [50.0, 50.0, 50.0], updates=10.0),
               _entry("straggler_sync_backup", [50.0, 50.0, 50.0], updates=25.0),
               {"name": "dc_asgd", "num_workers": 2, "spe": 16, "error": "timed out"},
               dict(_entry("single@1m", [1000.0] * 3), model="mlp_1m"),
               dict(_entry("vanilla@1m", [100.0] * 3), model="mlp_1m"),
               dict(_entry("local_sgd@1m", [600.0, 650.0, 800.0]), model="mlp_1m")]
    doc = bench_report.summarize(results, settings)
    by = {r["name"]: r for r in doc["results"]}
    assert by["async"]["x_vanilla"] == pytest.approx(0.95)
    assert by["async"]["x_vanilla_range"] == pytest.approx([0.925, 0.975])
    assert by["local_sgd"]["x_single"] == pytest.approx(0.6)
    assert by["local_sgd"]["x_vanilla"] == pytest.approx(6.0)
    # Each model's runs are compared with that model's baselines.
    assert by["local_sgd@1m"]["x_vanilla"] == pytest.approx(6.5)
    assert by["local_sgd@1m"]["x_single"] == pytest.approx(0.65)
    checks = {c["check"]: c for c in doc["checks"]}
    # async: median 0.95 meets 0.95, but its range reaches down to 0.925.
    assert checks["async throughput / vanilla PSS (mlp)"]["verdict"] == "unclear"
    assert checks["drop_stale throughput / vanilla PSS (mlp)"]["verdict"] == "unclear"
    assert checks["local_sgd throughput / single process (mlp)"]["verdict"] == "met"
    assert checks["local_sgd throughput / vanilla PSS (mlp)"]["verdict"] == "met"
    # 1M model: x single 0.6-0.8 around the 0.7 target; x vanilla 6-8 >= 3.
    assert checks["local_sgd throughput / single process (mlp_1m)"]["verdict"] == "unclear"
    assert checks["local_sgd throughput / vanilla PSS (mlp_1m)"]["verdict"] == "met"
    backup = [c for c in doc["checks"] if c["check"].startswith("sync_replicas")][0]
    assert backup["value"] == pytest.approx(2.5) and backup["verdict"] == "met"
    paths = bench_report.write_outputs(doc, str(tmp_path))
    assert [os.path.basename(p) for p in paths] == [
        "bench.json", "bench.md", "throughput.png", "accuracy.png", "staleness.png"]
    for p in paths[2:]:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    md = open(paths[1]).read()
    assert "| async | 2 | 16 | 380 (370-390) |" in md and "failed: timed out" in md
    assert "0.95 (0.93-0.97)" in md and "**unclear**" in md
    assert "3 repeat(s) per run, interleaved" in md
    assert json.load(open(paths[0]))["results"][2]["x_vanilla"] == pytest.approx(0.95)


def test_scaling_runs_grow_workers_and_ps_tasks():
    runs = bench.scaling_configs(steps_per_execution=8)
    assert [r["name"] for r in runs] == ["single", "async@w1p1", "async@w2p1", "async@w4p1",
                                         "async@w1p2", "async@w2p2", "async@w4p2"]
    shapes = [(r["num_workers"], r["num_ps"]) for r in runs[1:]]
    assert shapes == [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2)]
    assert all(r["spe"] == 8 and r["model"] == "mlp" for r in runs)
    with pytest.raises(ValueError, match="bench_scaling"):
        bench.scaling_configs(only=["async@w8p1"])


def test_peak_memory_is_read_per_task_and_kept_as_the_highest_repeat():
    me = bench.peak_rss_mb({"chief": os.getpid(), "ps:0": 2 ** 22 + 1})
    assert me["chief"] > 10 and me["ps:0"] is None  # no such process: None, no error
    repeats = [dict(_result("async@w2p1", 300.0), peak_rss_mb={
        "chief": 900.0, "ps:0": 500.0, "worker:0": 600.0, "worker:1": 650.0}),
        dict(_result("async@w2p1", 320.0), peak_rss_mb={
            "chief": 950.0, "ps:0": 480.0, "worker:0": 700.0, "worker:1": None})]
    e = bench.aggregate_repeats({"name": "async@w2p1", "num_workers": 2, "num_ps": 1,
                                 "spe": 16, "scaling": True}, repeats)
    assert e["peak_rss_mb"] == {"chief": 950.0, "ps:0": 500.0, "worker:0": 700.0,
                                "worker:1": 650.0}
    assert bench_report.peak_by_kind(e) == {"chief": 950.0, "ps": 500.0, "worker": 700.0}
    base = bench.aggregate_repeats(
        {"name": "async@w1p1", "num_workers": 1, "num_ps": 1, "spe": 16, "scaling": True},
        [dict(_result("async@w1p1", 200.0), peak_rss_mb={"chief": 800.0, "ps:0": 400.0,
                                                         "worker:0": 600.0})] * 2)
    settings = {"batch_size": 32, "learning_rate": 0.1, "seed": 0, "steps": 160,
                "eval_every": 160, "target_accuracy": 0.9, "repeats": 2,
                "bench_wall_time_s": 754.0}
    md = bench_report.markdown(bench_report.summarize([base, e], settings))
    # steps/s 310 (300-320) against 200 at 1 worker, 1 ps: 1.55 (1.50-1.60).
    assert "| async@w2p1 | 2 | 1 | 310 (300-320) | 1.55 (1.50-1.60) | 950 | 500 | 700 |" in md
    assert "The bench ran 12.6 min (2 runs x 2 repeat(s))." in md


def test_runs_share_a_cluster_per_shape_until_a_task_dies(monkeypatch):
    import tf_asyncps.cluster

    class Proc:
        def __init__(self):
            self.code = None

        def poll(self):
            return self.code

    class FakeCluster:
        def __init__(self, num_workers, num_ps, hosts=None):
            self.shape, self.procs, self.stopped = (num_workers, num_ps), {"ps:0": Proc()}, False

        def start(self):
            return self

        def stop(self):
            self.stopped = True

    monkeypatch.setattr(tf_asyncps.cluster, "LocalCluster", FakeCluster)
    clusters = {}

    def get(**run):
        return bench._cluster_for(dict({"num_workers": 2}, **run), clusters, None)

    a = get(policy="async")
    assert get(kind="vanilla") is a and get(policy="sync_replicas") is a  # shared
    b = get(num_workers=4)
    assert b is not a and b.shape == (4, 1) and not a.stopped  # another shape
    a.procs["ps:0"].code = -9  # a task died: started again
    a2 = get(policy="async")
    assert a2 is not a and a.stopped
    # At most MAX_CLUSTERS (2) up: a third shape stops the least recently used.
    c = get(num_workers=2, num_ps=2)
    assert c.shape == (2, 2) and b.stopped and not a2.stopped
    assert list(clusters) == [(2, 1), (2, 2)]


def test_hosts_runs_and_their_targets():
    runs = bench.hosts_configs(num_workers=2, sync_every=16, local_sgd_steps=1920)
    assert [r["name"] for r in runs] == ["vanilla@1m", "async@1m", "sync_replicas@1m",
                                         "local_sgd@1m", "async+bf16@1m", "vanilla@emb",
                                         "async@emb", "async+dedup@emb", "async+bf16@emb"]
    assert [r.get("steps") for r in runs] == [None, None, None, 1920] + [None] * 5
    assert all(r["model"] == "mlp_1m" and r["num_workers"] == 2 for r in runs[:5])
    assert [r.get("wire_dtype") for r in runs[:5]] == [None] * 4 + ["bfloat16"]
    assert runs[4] == dict(runs[1], name="async+bf16@1m", wire_dtype="bfloat16")
    assert all(r["model"] == "emb" and r["num_ps"] == 2 for r in runs[5:])
    assert [r.get("dedup") for r in runs[5:]] == [None, False, True, True]
    with pytest.raises(ValueError, match="bench_hosts"):
        bench.hosts_configs(only=["single"])
    settings = {"batch_size": 32, "learning_rate": 0.1, "seed": 0, "steps": 320,
                "eval_every": 64, "target_accuracy": 0.9, "repeats": 2, "hosts": True,
                "bandwidth_mbit": 100.0}

    def entry(name, rates, accs, sent):
        reps = [dict(_result(name, r, acc=a), bytes_sent_per_step=sent,
                     bytes_received_per_step=sent) for r, a in zip(rates, accs)]
        return dict(bench.aggregate_repeats({"name": name, "num_workers": 2, "spe": 16},
                                            reps), model="mlp_1m")

    results = [entry("vanilla@1m", [2.0, 2.5], [0.93, 0.95], 4.6e6),
               entry("local_sgd@1m", [14.0, 11.0], [0.935, 0.945], 2.9e5)]
    doc = bench_report.summarize(results + [entry("async+bf16@1m", [3.8, 4.4], [0.93, 0.94],
                                                  2.3e6)], settings)
    checks = {c["check"]: c for c in doc["checks"]}
    at = " (mlp_1m, 100 Mbit/s links)"
    # 4.1 / 2.25 = 1.82 (medians); paired repeats 1.9 and 1.76 straddle 1.8.
    c = checks["async+bf16 throughput / vanilla PSS" + at]
    assert c["value"] == pytest.approx(4.1 / 2.25) and c["range"] == pytest.approx([1.76, 1.9])
    assert c["verdict"] == "unclear" and c["target"] == 1.8
    # 12.5 / 2.25 = 5.56 (median ratio); paired repeats 7.0 and 4.4 straddle 5.
    c = checks["local_sgd throughput / vanilla PSS" + at]
    assert c["value"] == pytest.approx(12.5 / 2.25) and c["verdict"] == "unclear"
    # Accuracy: medians 0.94 - 0.94; per repeat +0.005 and -0.005: within 1 point.
    c = checks["local_sgd test accuracy - vanilla PSS's" + at]
    assert c["value"] == pytest.approx(0.0) and c["range"] == pytest.approx([-0.005, 0.005])
    assert c["verdict"] == "met"
    assert "local_sgd throughput / single process (mlp_1m)" not in checks
    # A failed repeat drops its pair only: repeat 2 stays paired with repeat 2.
    van = dict(results[0], repeats=[{"error": "timed out"}] + results[0]["repeats"][1:])
    doc = bench_report.summarize([van, results[1]], settings)
    c = {c["check"]: c for c in doc["checks"]}["local_sgd test accuracy - vanilla PSS's" + at]
    assert c["range"] == pytest.approx([-0.005, -0.005])
    md = bench_report.markdown(doc)
    assert "links limited to 100 Mbit/s each way" in md
    assert "| 4600 | 4600 |" in md and "| 290 | 290 |" in md


def test_embedding_runs_are_selected_by_the_group_name_emb():
    names = [r["name"] for r in bench.hosts_configs(only=["emb"])]
    assert names == ["vanilla@emb", "async@emb", "async+dedup@emb", "async+bf16@emb"]
    # local_sgd@emb (whole-table exchanges) only when named.
    names = [r["name"] for r in bench.hosts_configs(only=["emb", "local_sgd@emb"])]
    assert names == ["vanilla@emb", "async@emb", "async+dedup@emb", "async+bf16@emb",
                     "local_sgd@emb"]
    # bfloat16 on the wire, distinct ids: the strategy's wire_dtype.
    (bf16,) = [r for r in bench.hosts_configs(only=["async+bf16@emb"])]
    assert (bf16["wire_dtype"], bf16["dedup"], bf16["policy"]) == ("bfloat16", True, "async")
    # dynamic@emb (DynamicEmbedding of the same rows) too.
    runs = bench.hosts_configs(only=["dynamic@emb"])
    assert [(r["name"], r["policy"], r["dedup"], r["dynamic"]) for r in runs] == \
        [("dynamic@emb", "async", True, True)]
    # async+nocheck@emb: async+dedup@emb without the non-finite check.
    (nocheck,) = bench.hosts_configs(only=["async+nocheck@emb"])
    (dedup,) = bench.hosts_configs(only=["async+dedup@emb"])
    assert nocheck == dict(dedup, name="async+nocheck@emb", skip_nonfinite=False)
    with pytest.raises(ValueError, match=r"unknown run\(s\) \['async@embb'\]"):
        bench.hosts_configs(only=["async@embb"])


def test_wire_limit_of_an_id_stream_is_distinct_ids_times_272_bytes_plus_the_head():
    from tf_asyncps.app import bench_emb
    ids = [[3, 3, 7, 9], [5, 5, 5, 5]]  # 3 and 1 distinct ids: 2 per batch on average
    # 2 x (8 B id + 4 x 32 B row) x 2 (read, push) + 33 head float32 x 4 B x 2.
    assert bench_emb.limit_bytes_per_step(ids) == 2 * 272 + 264
    assert bench_emb.limit_bytes_per_step(ids, dim=4, head_params=0) == 2 * (8 + 16) * 2
    with pytest.raises(ValueError, match=r"ids must be \[batches, batch\]"):
        bench_emb.limit_bytes_per_step([1, 2])
    # The stream: seeded, in range, far fewer distinct ids than ids (Zipf 1.2).
    a, b = bench_emb.id_stream(0, batches=8), bench_emb.id_stream(0, batches=8)
    assert a.shape == (8, 512) and a.dtype == "int64" and (a == b).all()
    assert 0 <= a.min() and a.max() < bench_emb.ROWS
    assert bench_emb.limit_bytes_per_step(a) < 0.6 * 512 * 272


def test_embedding_table_reports_bytes_beside_vanilla_and_the_limit():
    settings = {"batch_size": 32, "learning_rate": 0.1, "seed": 0, "steps": 320,
                "eval_every": 64, "target_accuracy": 0.9, "repeats": 2, "hosts": True,
                "bandwidth_mbit": 100.0}

    def entry(name, rates, nbytes):
        reps = [dict(_result(name, r, acc=None), bytes_sent_per_step=b / 2,
                     bytes_received_per_step=b / 2, bytes_per_step=b,
                     limit_bytes_per_step=50e3) for r, b in zip(rates, nbytes)]
        return dict(bench.aggregate_repeats({"name": name, "num_workers": 2, "spe": 16},
                                            reps), model="emb")

    doc = bench_report.summarize([entry("vanilla@emb", [10.0, 12.0], [120e3, 120e3]),
                                  entry("async+dedup@emb", [15.0, 12.0], [80e3, 90e3])],
                                 settings)
    r = doc["results"][1]
    assert r["x_vanilla"] == pytest.approx(13.5 / 11) and r["x_vanilla_range"] == [1.0, 1.5]
    assert r["x_vanilla_bytes"] == pytest.approx(85 / 120)
    assert r["x_limit"] == pytest.approx(1.7) and r["x_limit_range"] == [1.6, 1.8]
    assert doc["checks"] == []
    md = bench_report.markdown(doc)
    assert "| async+dedup@emb | 2 | 16 | 13.5 (12.0-15.0) | 1.23 (1.00-1.50) | " \
           "42.5 (40.0-45.0) | 42.5 (40.0-45.0) | 85.0 (80.0-90.0) | 0.71 (0.67-0.75) | " \
           "50.0 | 1.70 (1.60-1.80) |" in md
    assert "Digits MLP" not in md  # only embedding runs: only their table
    doc["settings"]["bench_wall_time_s"] = 264.0
    assert bench_report.markdown(doc).endswith("The bench ran 4.4 min (2 runs x 2 repeat(s)).\n")


@pytest.mark.skipif(NETNS_MISSING is not None,
                    reason=f"needs network namespaces and tc tbf: {NETNS_MISSING}")
@pytest.mark.cluster
def test_tiny_hosts_bench_counts_the_bytes_each_policy_sends(tmp_path):
    out = tmp_path / "bench"
    rc, output = run_command([sys.executable, "-m", "tf_asyncps", "bench",
                              "--bench_hosts=netns", "--bench_bandwidth_mbit=400",
                              "--bench_only=vanilla@1m,local_sgd@1m", "--bench_steps=64",
                              "--bench_hosts_local_sgd_steps=64",
                              "--bench_eval_every=32", "--bench_repeats=1",
                              f"--output_dir={out}"], timeout=280)
    by = {x["name"]: x for x in json.load(open(out / "bench.json"))["results"]}
    params_bytes = 4 * 1_126_410
    # vanilla: every worker step reads the model and sends a gradient of it;
    # on the wire that is the model's bytes plus headers (< 10%).
    for key in ("bytes_sent_per_step", "bytes_received_per_step"):
        assert params_bytes <= by["vanilla@1m"][key] <= 1.1 * params_bytes, by["vanilla@1m"]
    # local_sgd: each worker runs 16 of a segment's 32 steps as one closure
    # (sync_every 16), pushing its delta once (an exchange) or twice (and the
    # epoch-end flush): 1 or 2 models per worker per 32 steps.
    ls = by["local_sgd@1m"]["bytes_sent_per_step"]
    assert params_bytes * 2 / 32 <= ls <= 1.1 * params_bytes * 2 * 2 / 32, ls


@pytest.mark.skipif(NETNS_MISSING is not None,
                    reason=f"needs network namespaces and tc tbf: {NETNS_MISSING}")
@pytest.mark.cluster
def test_tiny_embedding_bench_reads_distinct_rows_only_with_dedup(tmp_path):
    from tf_asyncps.app import bench_emb
    out = tmp_path / "bench"
    rc, output = run_command([sys.executable, "-m", "tf_asyncps", "bench",
                              "--bench_hosts=netns", "--bench_bandwidth_mbit=400",
                              "--bench_only=async@emb,async+dedup@emb", "--bench_steps=64",
                              "--bench_eval_every=32", "--bench_repeats=1",
                              f"--output_dir={out}"], timeout=280)
    by = {x["name"]: x for x in json.load(open(out / "bench.json"))["results"]}
    limit = bench_emb.limit_bytes_per_step(bench_emb.id_stream(0))  # --seed's default
    row = 4 * bench_emb.DIM
    for r in by.values():
        assert r["limit_bytes_per_step"] == limit
        # Nothing below the limit; nothing above every id's row and id both
        # ways plus the head, with headers (< 10%).
        assert limit <= r["bytes_per_step"] <= 1.1 * (bench_emb.BATCH * (8 + row) * 2 + 264), r
        # Every link: the workers' traffic once, plus the ps tasks' between
        # themselves and the chief's (a few KB per step).
        assert r["bytes_per_step"] <= r["all_links_bytes_per_step"] <= r["bytes_per_step"] + 10e3
    # Without de-duplication a worker receives every id's row; with it about
    # the distinct ones' (half the limit), plus headers.
    assert by["async@emb"]["bytes_received_per_step"] >= bench_emb.BATCH * row
    assert by["async+dedup@emb"]["bytes_received_per_step"] <= 1.5 * limit / 2


@pytest.mark.cluster
def test_tiny_bench_run_writes_a_well_formed_bench_json(tmp_path):
    out = tmp_path / "bench"
    rc, output = run_command([sys.executable, "-m", "tf_asyncps", "bench",
                     "--bench_only=single,async", "--num_workers=1", "--bench_steps=32",
                     "--bench_repeats=2",
                     "--bench_eval_every=16", "--bench_steps_per_execution=16",
                              f"--output_dir={out}"], timeout=240)
    assert rc == 0
    # Interleaved repeats: single, async, single, async.
    assert "[2/4] async (repeat 1/2)" in output and "[3/4] single (repeat 2/2)" in output
    doc = json.load(open(out / "bench.json"))
    by = {x["name"]: x for x in doc["results"]}
    assert set(by) == {"single", "async"}
    for x in by.values():
        assert len(x["repeats"]) == 2 and x["failed_repeats"] == 0
        rates = sorted(r["steps_per_sec"] for r in x["repeats"])
        assert x["steps_per_sec_range"] == rates
        assert x["steps_per_sec"] == pytest.approx(sum(rates) / 2)
        assert len(x["segments"]) == 2 and x["steps_per_sec"] > 0
        assert 0.0 <= x["test_accuracy"] <= 1.0
    assert by["single"]["staleness"] is None and by["single"]["x_single"] == 1.0
    # Both async repeats ran on the same ps/worker processes (one cluster per shape).
    pids = [r["task_pids"] for r in by["async"]["repeats"]]
    assert pids[0] == pids[1] and sorted(pids[0]) == ["ps:0", "worker:0"]
    assert all(v > 0 for v in by["async"]["peak_rss_mb"].values())
    s = by["async"]["staleness"]
    # One worker: every step applied once, tau always 0.
    assert s["applied"] == s["global_step"] == 32 and s["max"] == 0
    assert by["async"]["segments"][-1]["global_step"] == 32
    assert (out / "bench.md").exists() and (out / "throughput.png").exists()


@pytest.mark.parametrize("args, match", [
    (["--bench_steps=400", "--bench_eval_every=160"], "multiple"),
    (["--bench_steps=160", "--bench_eval_every=160"], "twice"),
    (["--output_dir=/proc/no-such-dir"], "output_dir"),
    (["--bench_scaling", "--bench_hosts=netns"], "--bench_scaling runs on loopback"),
    (["--bench_1m_steps=500"], "--bench_1m_steps=500 must be a multiple"),
    (["--bench_straggler_steps=320"], "--bench_straggler_steps=320 must be a multiple"),
    # The fix is named: the largest eval interval that 160 steps allow (every run
    # has 16 steps per closure, the straggler pair 1).
    (["--bench_only=single,async", "--bench_steps=160"], "e.g. --bench_eval_every=80."),
    (["--output_dir=pyproject.toml"], "--output_dir=pyproject.toml is a file, not a directory"),
])
def test_bench_rejects_bad_settings_before_running(args, match):
    rc, output = run_command([sys.executable, "-m", "tf_asyncps", "bench"] + args,
                             timeout=60, check=False)
    assert rc != 0 and match in output and "Traceback" not in output
    assert "[1/" not in output  # nothing ran


# -- the CTR runs (NAME@ctr) -----------------------------------------------------
def test_ctr_runs_only_when_named_and_their_settings():
    from tf_asyncps.app import bench_ctr
    assert not any(r["model"] == "ctr" for r in bench.default_configs())
    assert not any(r["model"] == "ctr" for r in bench.hosts_configs())
    runs = bench.default_configs(num_workers=2, steps_per_execution=8, only=["ctr"],
                                 ctr={"max_rows": 5000, "scale": 0.5})
    assert [r["name"] for r in runs] == list(bench_ctr.CTR_RUNS) == [
        "single@ctr", "vanilla@ctr", "vanilla_one_table@ctr", "async@ctr",
        "async_one_table@ctr", "async_bf16@ctr", "best@ctr", "keras3@ctr"]
    by = {r["name"]: r for r in runs}
    assert all((r["max_rows"], r["scale"], r["spe"], r["model"]) == (5000, 0.5, 8, "ctr")
               for r in runs)
    assert (by["single@ctr"]["kind"], by["single@ctr"]["num_workers"]) == ("single", 0)
    assert all(by[n]["num_workers"] == 2 and by[n]["num_ps"] == 2 for n in by if n != "single@ctr")
    assert [by[n]["embedding"] for n in ("vanilla@ctr", "vanilla_one_table@ctr", "best@ctr")] \
        == ["tables", "offset", "collection"]
    assert by["vanilla@ctr"]["kind"] == by["vanilla_one_table@ctr"]["kind"] == "vanilla"
    assert by["async_bf16@ctr"] == dict(by["async@ctr"], name="async_bf16@ctr",
                                        wire_dtype="bfloat16")
    assert by["keras3@ctr"] == dict(by["async@ctr"], name="keras3@ctr", keras="3")
    best = by["best@ctr"]
    assert (best["policy"], best["policy_args"], best["wire_dtype"]) == (
        "route", {"sparse": "async", "local_steps": 16, "exchange": "mean"}, "bfloat16")
    # By name: best@ctr with the sum exchange (LocalSteps's default).
    (best_sum,) = bench.default_configs(only=["best_sum@ctr"])
    assert best_sum == dict(best, name="best_sum@ctr", max_rows=best_sum["max_rows"],
                            scale=best_sum["scale"], spe=best_sum["spe"],
                            policy_args={"sparse": "async", "local_steps": 16,
                                         "exchange": "sum"})
    # Named one by one, beside other runs; on hosts too.
    assert [r["name"] for r in bench.default_configs(only=["async", "best@ctr"])] == [
        "async", "best@ctr"]
    (h,) = bench.hosts_configs(only=["vanilla@ctr"])
    assert h["hosts"] is True and h["num_ps"] == 2
    with pytest.raises(ValueError, match="--bench_ctr_scale must be in"):
        bench.default_configs(only=["ctr"], ctr={"max_rows": 10, "scale": 0.0})
    with pytest.raises(ValueError, match="unknown run"):
        bench.default_configs(only=["best@ctrr"])


def test_ctr_limit_counts_distinct_feature_ids_and_the_dense_part_both_ways():
    import numpy as np
    from tf_asyncps.app import bench_ctr
    # Bottom 13-64-16, interaction 16 + 27 * 26 / 2 = 367, top 367-256-128-1.
    assert bench_ctr.dense_params(26) == (13 * 64 + 64) + (64 * 16 + 16) + (
        367 * 256 + 256) + (256 * 128 + 128) + (128 + 1) == 129169
    # Two batches of 3 examples, 2 features: equal ids of two features are two rows.
    sparse = np.array([[[1, 1], [1, 2], [1, 1]],     # feature 0: {1}, 1: {1, 2} -> 3
                       [[4, 5], [6, 5], [7, 5]]])    # feature 0: {4, 6, 7}, 1: {5} -> 4
    assert bench_ctr.distinct_ids_per_step(sparse) == 3.5
    # 3.5 x (8 B id + 4 B x 16) x 2 + 10 dense float32 x 4 B x 2.
    assert bench_ctr.limit_bytes_per_step(3.5, dense=10) == 3.5 * 72 * 2 + 80
    with pytest.raises(ValueError, match=r"\[batches, batch, F\]"):
        bench_ctr.distinct_ids_per_step([[1, 2]])


def test_ctr_socket_counters_are_read_per_connection_of_the_given_processes(monkeypatch):
    from tf_asyncps.app import bench_ctr
    out = ("0 0 127.0.0.1:5001 127.0.0.1:41000 users:((\"python\",pid=11,fd=7))\n"
           "\t cubic bytes_sent:100 bytes_acked:101 bytes_received:2000 segs_out:3\n"
           "0 0 127.0.0.1:41000 127.0.0.1:5001 users:((\"python\",pid=12,fd=9))\n"
           "\t cubic bytes_sent:2000 bytes_received:100\n"
           "0 0 127.0.0.1:41002 127.0.0.1:5002 users:((\"python\",pid=11,fd=8))\n"
           "\t cubic bytes_received:50\n")
    monkeypatch.setattr(bench_ctr.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 0, out, ""))
    got = bench_ctr.socket_bytes([11])
    assert got == {(11, "127.0.0.1:5001", "127.0.0.1:41000"): [100, 2000],
                   (11, "127.0.0.1:41002", "127.0.0.1:5002"): [0, 50]}
    # A connection seen only in the second reading counts from zero.
    before = {(11, "127.0.0.1:5001", "127.0.0.1:41000"): [40, 500]}
    assert bench_ctr._bytes_between(before, got) == (60, 1550)


def _ctr_entry(name, cpu, nbytes, auc, loss, rates=(20.0, 22.0)):
    reps = [dict(_result(name, r, acc=0.75), cpu_s_per_step={"chief": 0.001, "ps:0": c / 2,
                                                              "worker:0": c / 2 - 0.001},
                 cpu_s_per_step_total=c, bytes_per_step=b, bytes_sent_per_step=b / 2,
                 bytes_received_per_step=b / 2, limit_bytes_per_step=1.6e6,
                 test_auc=a, test_loss=lo, rows=[10, 20])
            for r, c, b, a, lo in zip(rates, cpu, nbytes, auc, loss)]
    return bench.aggregate_repeats({"name": name, "num_workers": 1, "spe": 16, "model": "ctr",
                                    "max_rows": 20, "scale": 1.0}, reps)


def test_ctr_report_ratios_targets_and_table():
    settings = {"batch_size": 32, "learning_rate": 0.1, "seed": 0, "steps": 480,
                "eval_every": 160, "target_accuracy": 0.9, "repeats": 2}
    results = [_ctr_entry("vanilla@ctr", [0.050, 0.054], [2.2e6, 2.2e6], [0.63, 0.64],
                          [0.55, 0.55]),
               _ctr_entry("vanilla_one_table@ctr", [0.040, 0.040], [2.2e6, 2.2e6],
                          [0.63, 0.63], [0.55, 0.55]),
               _ctr_entry("async@ctr", [0.048, 0.056], [1.6e6, 1.6e6], [0.63, 0.64],
                          [0.55, 0.55]),
               _ctr_entry("best@ctr", [0.024, 0.026], [0.36e6, 0.38e6], [0.628, 0.641],
                          [0.56, 0.5775])]
    doc = bench_report.summarize(results, settings)
    by = {r["name"]: r for r in doc["results"]}
    best = by["best@ctr"]
    assert best["cpu_s_per_step"]["ps:0"] == pytest.approx(0.0125)
    assert best["cpu_s_per_step_range"]["ps:0"] == pytest.approx([0.012, 0.013])
    assert best["x_vanilla_cpu"] == pytest.approx(0.025 / 0.052)
    assert best["x_vanilla_cpu_range"] == pytest.approx([0.024 / 0.05, 0.026 / 0.054])
    assert best["x_vanilla_bytes"] == pytest.approx(0.37 / 2.2)
    assert best["x_limit"] == pytest.approx(0.37 / 1.6)
    checks = {c["check"]: c for c in doc["checks"]}
    c = checks["best@ctr CPU per worker step / vanilla PSS's"]
    assert (c["aim"], c["verdict"]) == ("<= 0.5", "met")  # 0.48, paired 0.48 and 0.48
    assert checks["best@ctr CPU per worker step / vanilla one-table's"]["verdict"] == "met"
    # async: 1.04 median, paired 0.96 and 1.037: straddles 1.0.
    assert checks["async@ctr CPU per worker step / vanilla PSS's"]["verdict"] == "unclear"
    assert checks["best@ctr bytes per worker step / vanilla PSS's"]["verdict"] == "met"
    # Log loss: paired 0.56 / 0.55 = 1.018 and 0.5775 / 0.55 = 1.05 straddle 1.03.
    c = checks["best@ctr held-out log loss / vanilla PSS's"]
    assert c["range"] == pytest.approx([0.56 / 0.55, 1.05]) and c["verdict"] == "unclear"
    # AUC: -0.002 and +0.001 per repeat, both above -0.005.
    c = checks["best@ctr held-out AUC - vanilla PSS's"]
    assert c["range"] == pytest.approx([-0.002, 0.001]) and c["verdict"] == "met"
    assert not any("Mbit" in k for k in checks)  # loopback: no steps/s target
    md = bench_report.markdown(doc)
    assert "| best@ctr | 21.0 (20.0-22.0) | 25.0 (24.0-26.0) | 0.48 (0.48-0.48) | 1.0 | " \
           "12.5 (12.0-13.0) | 11.5 (11.0-12.0) | 370 (360-380) | 0.17 (0.16-0.17) | 1600 | " \
           "0.23 (0.23-0.24) | 0.6345 (0.6280-0.6410) | 0.5688 (0.5600-0.5775) |" in md
    assert "| target |" in md and "| <= 0.5 | met |" in md and "Digits MLP" not in md
    assert "| best@ctr held-out AUC - vanilla PSS's | -0.0005 (-0.0020-0.0010) | >= -0.005 |" \
        in md
    assert bench_report.verdict(0.9, [0.8, 1.1], 1.0, at_most=True) == "unclear"
    assert bench_report.verdict(1.2, [1.1, 1.3], 1.0, at_most=True) == "not met"


@pytest.mark.cluster
@pytest.mark.long  # the socket counting path: test_tiny_embedding_bench_reads_distinct_rows_only_with_dedup
def test_tiny_ctr_bench_counts_at_least_the_limit_of_its_batches(tmp_path):
    """One async@ctr run on 1 worker and 2 ps, tables of at most 300 rows: the
    bytes counted on the worker's sockets are at least the limit recomputed
    here from the worker's batches, and every reported field is there."""
    import numpy as np
    from tf_asyncps.app import bench_ctr, ctr_data
    out = tmp_path / "bench"
    run_command([sys.executable, "-m", "tf_asyncps", "bench", "--bench_only=async@ctr",
                 "--num_workers=1", "--bench_ctr_max_rows=300", "--bench_steps=32",
                 "--bench_eval_every=16", "--bench_repeats=1", f"--output_dir={out}"],
                timeout=150)
    doc = json.load(open(out / "bench.json"))
    (r,) = doc["results"]
    rows = ctr_data.table_rows(300)
    data = ctr_data.make(rows, bench_ctr.ZIPF_A, 0)
    x, _, _ = data.arrays(ctr_data.train_stream(0), bench_ctr.LIMIT_BATCHES * 512, 512)
    sparse = x["sparse"].reshape(-1, 512, 26)
    distinct = np.mean([sum(len(set(b[:, f])) for f in range(26)) for b in sparse])
    limit = distinct * (8 + 4 * 16) * 2 + 2 * 4 * 129169
    assert r["limit_bytes_per_step"] == pytest.approx(limit)
    assert r["bytes_per_step"] >= limit, r
    assert r["bytes_per_step"] == r["bytes_sent_per_step"] + r["bytes_received_per_step"]
    assert set(r["cpu_s_per_step"]) == {"chief", "ps:0", "ps:1", "worker:0"}
    assert r["cpu_s_per_step_total"] == pytest.approx(sum(r["cpu_s_per_step"].values()))
    assert all(v > 0 for v in r["cpu_s_per_step"].values() if v is not None)
    assert 0.0 <= r["test_auc"] <= 1.0 and r["test_loss"] > 0 and r["steps_per_sec"] > 0
    assert r["staleness"]["global_step"] == 32 and r["repeats"][0]["rows"] == list(rows)
    assert r["x_limit"] == pytest.approx(r["bytes_per_step"] / limit)
    md = (out / "bench.md").read_text()
    assert "| async@ctr |" in md and "× limit | AUC | log loss |" in md
