"""DynamicEmbedding eviction on a cluster beyond tests/test_dynamic_cluster.py:
legacy tf_keras optimizers (scenarios in tests/scenarios/dynamic_eviction.py)."""

import pytest

from conftest import run_scenario

pytestmark = pytest.mark.cluster


@pytest.mark.timeout(420)
def test_legacy_optimizers_evict_reset_slots_and_round_trip():
    """tf_keras.optimizers.legacy Adagrad and Adam, 2 workers, 2 ps, 10 ids
    for 6 rows, a pass every 2 steps: at most 6 live rows, each id once;
    evicted rows and their slots back at their initial values (zeros;
    Adagrad's accumulator 0.1, Adam's m and v 0); a checkpoint round trip
    onto the same shards exact (map, rows, predictions, slots)."""
    r = run_scenario("dynamic_legacy_optimizers", timeout=400)
    for name, slots in (("adagrad", ["accumulator"]), ("adam", ["m", "v"])):
        p = r[name]
        assert 1 <= p["stats"]["live_rows"] <= 6, name
        assert len(p["ids"]) == len(set(p["ids"])) == p["stats"]["live_rows"], name
        assert p["stats"]["evicted"] > 0 and p["stats"]["refused"] > 0, name
        assert p["slot_names"] == slots and p["num_slots"] == 2 * len(slots), name
        assert p["freed_rows"] >= 1, name
        assert p["free_rows_max"] == 0.0 and p["free_slots_max_diff"] == 0.0, name
        t = p["round_trip"]
        assert t["count_equal"] and t["key_equal"], name
        assert t["rows_max_diff"] == 0.0 and t["pred_max_diff"] == 0.0, name
        assert sum(t["index"]) == p["stats"]["live_rows"], name
        assert t["slots_compared"] == slots * 2, name
        assert t["slots_max"] > 0.0 and t["slots_max_diff"] == 0.0, name
        # Counters restored too; the zero step admitted, refused, evicted nothing.
        assert t["stats"] == p["stats"], name
