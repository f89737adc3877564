"""Ops a steady-state speculative step dispatches, per engine function, on the CPU.

    python bench/spec_op_count.py --modes chain,tree --batch-sizes 1,4 --out ops.json
    python bench/spec_op_count.py --modes chain --batch-sizes 4 --arrival-prompt-len 32

Builds a tiny random Llama target and an EAGLE-3 head (config.json + `load_format="dummy"`),
runs the engine in speculative mode with the accept length forced (as bench/step_profile.py
does on the GPU) into its steady state, and profiles a few decode steps with torch.profiler
(CPU activity, Python stacks). Each leaf aten op that does work (views and allocations are
skipped) is one kernel on a GPU, so the count is the CPU-side proxy for the kernels a CUDA
graph of the step replays: the GPU-side measure is bench/step_profile.py. An op is charged
to the innermost engine function on its stack (the attention backend and the models are
reported as one group each: they are the same in a plain step). Host syncs (`item`,
`_local_scalar_dense`, `nonzero`) are counted separately: the steady state must have none.

`--arrival-prompt-len N` counts mixed steps instead (`mixed_steps`: a prompt of N tokens arrives
before every profiled step, and only the steps that launched a mixed step count): the ops inside
the target's forward, which a bucket replays as one CUDA graph (runtime/captured_mixed.py), and
the ops around it, which a GPU launches one by one from the scheduler thread (the draft, the LM
head, the accept, the chunks' draft prefill).

`--graphs` runs the engine's CUDA graphs through the tests' CPU stand-in (tests/helpers.py
`eager_graphs`: a replay runs its part eagerly) and counts each replay as one op, a launch, as on
a GPU: what is left around the replays is what the scheduler thread launches one by one. Compare
a graphed chain mixed step with its eager one:

    python bench/spec_op_count.py --modes chain --batch-sizes 4 --arrival-prompt-len 32 [--graphs]

`--cuda-kernels` takes the draft tree's CUDA paths (the Triton kernels of
engine/spec/tree_kernels.py, run by the Triton interpreter) and counts each launch as one op,
as a GPU would; without it the torch code those kernels replace is counted (what runs off
CUDA). The greedy argmax (torch.argmax here) is two kernels on CUDA either way. The profiler
then records the interpreter's Python too, which is slow and memory-hungry: use it at bs=1
with few steps (`--cuda-kernels --batch-sizes 1 --steps 2`).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from collections import Counter, defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

MODES = {"chain": dict(num_steps=3, topk=1, num_draft_tokens=4),
         "tree": dict(num_steps=5, topk=4, num_draft_tokens=8)}
TARGET = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024,
              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
# Ops that launch no kernel: views, metadata and allocations.
NO_KERNEL = {"aten::" + n for n in (
    "empty", "empty_strided", "empty_like", "view", "reshape", "_reshape_alias", "as_strided", "expand",
    "expand_as", "unsqueeze", "squeeze", "select", "slice", "t", "transpose", "permute", "detach", "alias",
    "resolve_conj", "resolve_neg", "unbind", "split", "chunk", "narrow", "lift_fresh", "_unsafe_view",
    "result_type", "is_nonzero", "view_as", "numpy_T", "contiguous", "flatten", "unflatten", "movedim",
    "split_with_sizes", "_has_compatible_shallow_copy_type", "set_", "dim", "size", "stride", "is_same_size",
    "to", "resize_", "broadcast_tensors", "as_strided_", "detach_", "scalar_tensor", "new_empty",
    "_local_scalar_dense", "item", "lift_fresh_copy", "unsqueeze_", "squeeze_")}
SYNCS = {"aten::_local_scalar_dense", "aten::nonzero"}  # the op that waits for the device
# Innermost engine frames that name a whole subsystem rather than a step of the iteration.
# The draft head's top-k is part of the speculative overhead: it keeps its own name.
GROUPS = [("attention backend", re.compile(r"engine/attention/")),
          ("model forward", re.compile(r"engine/(models|layers/(?!sampler|argmax))(?!.*: topk$)"))]
# Phases of the iteration: the innermost of these functions an op runs in.
PHASES = [("draft loop", re.compile(r": (_draft_start|_draft_forward|_draft_grow|_level_drafted)$")),
          ("accept (target tokens, walk)", re.compile(r"spec/tree\.py.*: accept$|: _target_tokens$")),
          ("compaction", re.compile(r": (compact_rows|compaction_moves|move_kv_cache)$")),
          ("verify (tree, target forward)", re.compile(r": _verify_(half|forward|accept)$")),
          ("draft extend + stash + outputs", re.compile(r": _extend_half$")),
          ("prefill-free forward glue", re.compile(r"runtime/step\.py.*: run$")),
          ("schedule side", re.compile(r"(scheduler/|: launch_decode$)"))]


def write_pair(root: str) -> tuple[str, str]:
    target, draft = os.path.join(root, "target"), os.path.join(root, "eagle3")
    for path, cfg in ((target, TARGET), (draft, dict(TARGET, architectures=["LlamaForCausalLMEagle3"],
                                                          num_hidden_layers=1, draft_vocab_size=256))):
        os.makedirs(path, exist_ok=True)
        json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    return target, draft


def engine_frame(event) -> str:
    """The innermost engine function an op runs in, as `module:function` (the profiler
    records Python calls as the op's ancestor events, named `path(line): function`)."""
    e = event.cpu_parent
    while e is not None:
        path = e.name.replace("\\", "/")
        if re.search(r"(^|/)engine/", path) and "): " in path:  # absolute, or relative to the cwd
            for group, pattern in GROUPS:
                if pattern.search(path):
                    return group
            m = re.search(r"engine/(.+?)\.py\(\d+\): (.+)", path)
            return f"{m.group(1)}:{m.group(2)}" if m else path
        e = e.cpu_parent
    return "(outside the engine)"


def phase(event) -> str:
    e = event.cpu_parent
    while e is not None:
        for name, pattern in PHASES:
            if "): " in e.name and pattern.search(e.name.replace("\\", "/")):
                return name
        e = e.cpu_parent
    return "(outside the engine)"


def kernel_ops(prof) -> list:
    """The lowest aten ops that do work: the kernel proxy (one op, one kernel on a GPU).
    Views and allocations are skipped; a composite op is charged through its children."""
    does_work = {}

    def works(e) -> bool:
        if id(e) not in does_work:
            does_work[id(e)] = e.name not in NO_KERNEL or any(works(c) for c in aten_children(e))
        return does_work[id(e)]

    def below(e) -> bool:
        return any(works(c) for c in aten_children(e))

    return [e for e in prof.events() if KERNEL_PATTERN.match(e.name) and ancestor(e, KERNEL_PATTERN) is None or (
        e.name.startswith("aten::") and e.name not in NO_KERNEL and not below(e)
        # (not the interpreter's own ops inside a Triton launch, nor a replayed part's)
        and ancestor(e, KERNEL_PATTERN) is None)]


def aten_children(e) -> list:
    return [c for c in e.cpu_children if c.name.startswith("aten::")]


KERNEL_RANGE = "triton kernel: "
GRAPH_RANGE = "graph replay: "  # + the part's name (`--graphs`)
KERNEL_PATTERN = re.compile(f"^({KERNEL_RANGE}|{GRAPH_RANGE})")  # ranges that are one launch whatever runs inside
STEP_FRAME = re.compile(r"engine/api\.py\(\d+\): step$")  # Engine.step: one per profiled step
# A mixed step's target forward: the model runner's forward called by the speculative worker's
# step body (the draft head's forwards are called by the drafter).
TARGET_FORWARD = re.compile(r"runtime/model_runner\.py\(\d+\): forward$")
SPEC_BODY = re.compile(r"spec/spec_worker\.py\(\d+\): body$")


def ancestor(e, pattern: re.Pattern):
    """The innermost event around op `e` whose name matches `pattern` (None if none does)."""
    e = e.cpu_parent
    while e is not None:
        if pattern.search(e.name.replace("\\", "/")):
            return e
        e = e.cpu_parent
    return None


def in_target_forward(e) -> bool:
    if e.name.startswith(GRAPH_RANGE + "forward"):  # a captured mixed forward's replay
        return True
    forward = ancestor(e, TARGET_FORWARD)
    while forward is not None:
        if forward.cpu_parent is not None and SPEC_BODY.search(forward.cpu_parent.name.replace("\\", "/")):
            return True
        forward = ancestor(forward, TARGET_FORWARD)
    return False


def use_tree_kernels() -> None:
    """Run the CUDA paths of tree_kernels on the CPU (interpreter), each launch one range."""
    from specserve.engine.spec import tree_kernels

    def counted(fn):
        def launch(*args, **kwargs):
            with record_function(KERNEL_RANGE + fn.__name__):
                return fn(*args, **kwargs)
        return launch

    tree_kernels.use_kernel = lambda t: True
    for name in ("accept_walk", "expand", "keep_best", "build_tree"):
        setattr(tree_kernels, name, counted(getattr(tree_kernels, name)))


def arrival_prompt(index: int, length: int) -> list[int]:
    """A prompt no earlier one shares a prefix with (the radix cache would shorten it)."""
    return [(11 * index + 5 * j) % 400 + 100 for j in range(length)]


def graphed(engine, monkeypatch) -> None:
    """Capture the engine's graphs through the tests' CPU stand-in, each replay one range named
    by its part."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from helpers import capture_eager_graphs

    graphs = capture_eager_graphs(engine, monkeypatch)
    replay = graphs.replay

    def one_launch(self, captured, part):
        with record_function(GRAPH_RANGE + getattr(self.parts[part], "__name__", "part")):
            return replay(self, captured, part)

    monkeypatch.setattr(graphs, "replay", one_launch)


def measure(mode: str, bs: int, steps: int, root: str, backend: str, arrival_len: int = 0,
            graphs: bool = False) -> dict:
    import pytest

    from specserve.engine import Engine, EngineConfig, SamplingParams, SpecConfig

    target, draft = write_pair(root)
    spec = SpecConfig(algorithm="eagle3", draft_model=draft, bench_force_accept_len=3, **MODES[mode])
    engine = Engine(EngineConfig(model=target, device="cpu", dtype="float32", load_format="dummy", spec=spec,
                                 max_running_requests=bs + (arrival_len > 0), max_context_len=512,
                                 attention_backend=backend, enable_prefix_cache=False,
                                 mixed_steps=arrival_len > 0))
    # The profiler records the thread it runs in: run the forward "stream" (an executor thread
    # on the CPU) inline, so that the schedule side and the forwards are both recorded.
    ctx = engine.core.ctx
    ctx.launch = lambda fn: ctx._run(fn, (0.0, 0.0))
    monkeypatch = pytest.MonkeyPatch()
    if graphs:
        graphed(engine, monkeypatch)
    params = SamplingParams(max_new_tokens=4 * (steps + 8), temperature=0.0, ignore_eos=True)
    for i in range(bs):
        engine.add_request(f"ops-{i}", [(7 * i + j) % 500 + 3 for j in range(16 + i)], params)
    while not any(o.new_token_ids for o in engine.step()):  # prefill, outside the window
        pass
    for _ in range(4):  # settle into the steady state
        engine.step()
    by_frame, by_op, by_phase = Counter(), Counter(), Counter()
    by_frame_op = defaultdict(Counter)
    syncs = Counter()
    in_target, around_target = 0, Counter()

    # One profile over every step (several in a row do not parse reliably); a step is told by its
    # Engine.step frame, in call order.
    launched_mixed = []
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for step in range(steps):
            if arrival_len:  # each step a mixed one: the decode rows and a new prompt
                engine.add_request(f"arrival-{step}", arrival_prompt(step, arrival_len),
                                   SamplingParams(max_new_tokens=1, temperature=0.0))
            mixed0 = engine.metrics.num_mixed_steps
            engine.step()
            launched_mixed.append(engine.metrics.num_mixed_steps > mixed0)
    engine.shutdown()
    monkeypatch.undo()
    events = prof.events()
    step_frames = sorted((e for e in events if STEP_FRAME.search(e.name)), key=lambda e: e.time_range.start)
    assert len(step_frames) == steps, (len(step_frames), steps)
    # Without arrivals every step counts; with them, those that launched a mixed step.
    counted = {id(e) for e, mixed in zip(step_frames, launched_mixed) if mixed or not arrival_len}
    num_steps = len(counted)
    for e in kernel_ops(prof):
        if id(ancestor(e, STEP_FRAME)) not in counted:
            continue
        frame = engine_frame(e)
        by_frame[frame] += 1
        by_op[e.name] += 1
        by_phase[phase(e)] += 1
        by_frame_op[frame][e.name] += 1
        if in_target_forward(e):
            in_target += 1
        else:
            around_target[frame] += 1
    for e in events:
        if e.name in SYNCS and id(ancestor(e, STEP_FRAME)) in counted:
            syncs[engine_frame(e)] += 1
    if not num_steps:
        raise RuntimeError("no mixed step was profiled: the arrivals did not ride")
    per = lambda c: {k: v / num_steps for k, v in c.most_common()}
    return {"mode": mode, "batch_size": bs, "steps": num_steps, "arrival_prompt_len": arrival_len,
            "attention_backend": backend, "graphs": graphs,
            "target_forward_ops_per_step": in_target / num_steps if arrival_len else None,
            "around_target_by_function": per(around_target) if arrival_len else None,
            "cuda_kernels": KERNEL_RANGE.strip() in str(by_op),
            "ops_per_step": sum(by_frame.values()) / num_steps,
            "spec_ops_per_step": sum(v for k, v in by_frame.items() if k not in dict(GROUPS)) / num_steps,
            "syncs_per_step": per(syncs), "by_phase": per(by_phase), "by_function": per(by_frame), "by_op": per(by_op),
            "by_function_op": {f: per(c) for f, c in by_frame_op.items()}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="chain,tree")
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--attention-backend", default="torch")
    ap.add_argument("--detail", action="store_true", help="print the ops of every function")
    ap.add_argument("--arrival-prompt-len", type=int, default=0,
                    help="mixed steps: a prompt of this many tokens arrives before every profiled step")
    ap.add_argument("--graphs", action="store_true",
                    help="the engine's CUDA graphs through the tests' CPU stand-in, one op a replay")
    ap.add_argument("--cuda-kernels", action="store_true",
                    help="take the draft tree's Triton kernels (interpreted), one op a launch")
    ap.add_argument("--out", default="spec_op_count.json")
    args = ap.parse_args()
    if args.cuda_kernels:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is first imported
        use_tree_kernels()
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory() as root:
        for mode in args.modes.split(","):
            for bs in map(int, args.batch_sizes.split(",")):
                r = measure(mode, bs, args.steps, root, args.attention_backend, args.arrival_prompt_len,
                            args.graphs)
                results.append(r)
                print(f"\n{mode} bs={bs}: {r['ops_per_step']:.1f} ops/step, {r['spec_ops_per_step']:.1f} "
                      f"outside the model and attention; host syncs {r['syncs_per_step'] or 'none'}")
                if args.arrival_prompt_len:
                    print(f"  mixed steps ({r['steps']} profiled): {r['target_forward_ops_per_step']:.1f} ops in "
                          f"the target's forward (one graph replay where a bucket holds it), "
                          f"{r['ops_per_step'] - r['target_forward_ops_per_step']:.1f} around it:")
                    for frame, n in list(r["around_target_by_function"].items())[:8]:
                        print(f"  {n:7.1f}  {frame}")
                for name, n in r["by_phase"].items():
                    print(f"  {n:7.1f}  {name}")
                print("  by function:")
                for frame, n in r["by_function"].items():
                    print(f"  {n:7.1f}  {frame}")
                    if args.detail:
                        ops = r["by_function_op"][frame]
                        print("           " + ", ".join(f"{o[6:]} {c:g}" for o, c in ops.items()))
    json.dump(results, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
