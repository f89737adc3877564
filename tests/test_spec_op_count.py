"""bench/spec_op_count.py's mixed steps: the ops of a speculative mixed step split into the
target's forward (one graph replay on a GPU) and the eager work around it."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import spec_op_count  # noqa: E402


def test_mixed_steps_split_into_the_target_forward_and_the_launches_around_it(tmp_path):
    r = spec_op_count.measure("chain", 2, 4, str(tmp_path), "torch", arrival_len=16)
    assert r["steps"] >= 1  # (syncs: the tests' FutureMap debug checks make some on the CPU)
    inside, total = r["target_forward_ops_per_step"], r["ops_per_step"]
    around = r["around_target_by_function"]
    assert 0 < inside < total and sum(around.values()) == total - inside
    # around the target's forward: the draft loop, the chunks' draft prefill, the accept
    assert r["by_phase"]["draft loop"] > 0
    assert {"spec/eagle_drafter:after_prefill", "spec/verifier:accept"} <= set(around)


def test_a_graphed_chain_mixed_step_launches_its_replays_and_little_else(tmp_path):
    """`graphs`: the stand-in's replays count one launch each; the mixed forward is one, the
    wrap's graphs hold the draft and the accept, so no model or attention op runs outside a
    replay and the launches around them are a few dozen (the eager step's are hundreds)."""
    r = spec_op_count.measure("chain", 2, 4, str(tmp_path), "torch", arrival_len=16, graphs=True)
    assert r["graphs"] and r["steps"] >= 1
    assert r["target_forward_ops_per_step"] == 1
    assert not {"model forward", "attention backend"} & set(r["by_function"])
    assert r["ops_per_step"] < 100
