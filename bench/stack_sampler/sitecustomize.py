"""A stack sampler for every Python process a command starts (a bench tool, not the engine's):

    PYTHONPATH=bench/stack_sampler:$PYTHONPATH STACK_SAMPLER=/tmp/stacks python bench/serving.py ...
    python bench/stack_report.py /tmp/stacks

Python imports `sitecustomize` at start-up in every interpreter whose path holds this folder, so
the server, its spawned engine process and the clients all sample themselves. With
STACK_SAMPLER=PATH set, a daemon thread reads the main thread's Python stack every SAMPLE_S and
appends JSON lines to PATH.<pid> for what a profile of averages hides, the rare long stops:

- "held": the main thread's innermost frame stayed at one instruction for over HELD_S, a call
  into C (a kernel launch, a device wait, a socket poll); `cpu_ms`, the main thread's CPU time
  meanwhile, says whether it spun (about `ms`) or slept (about 0);
- "gap": the sampler itself could not run for over HELD_S (the GIL held throughout, or the
  process stopped), with the main thread's stack before and after.

Where PyTorch has initialised CUDA it also rewrites PATH.<pid>.allocator.json, the caching
allocator's event counters (`num_alloc_retries` and friends), about once a second. The
sampling costs the main thread a GIL hand-over every SAMPLE_S; time what it finds again
without it.
"""
import json
import os
import sys
import threading
import time

SAMPLE_S = 0.002
HELD_S = 0.008
DEPTH = 30                 # frames kept per stack, innermost first
ALLOCATOR_EVERY = 500      # samples between the allocator counters' snapshots


def _stack(frame) -> list:
    stack = []
    while frame is not None and len(stack) < DEPTH:
        stack.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return stack


def _allocator_counters(path: str) -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        counters = {k: v for k, v in torch.cuda.memory_stats().items() if k.startswith("num_")}
        with open(path, "w") as f:
            json.dump(counters, f)


def _sample(path: str) -> None:
    main = threading.main_thread()
    clock = time.pthread_getcpuclockid(main.ident)
    out = open(f"{path}.{os.getpid()}", "w")

    def write(event: dict) -> None:
        out.write(json.dumps(event) + "\n")
        out.flush()

    last_t, last_cpu, last_stack = time.perf_counter(), time.clock_gettime(clock), []
    held_key, held_t, held_cpu, samples = None, last_t, last_cpu, 0
    while True:
        time.sleep(SAMPLE_S)
        now, cpu = time.perf_counter(), time.clock_gettime(clock)
        frame = sys._current_frames().get(main.ident)
        stack = _stack(frame)
        if now - last_t > HELD_S:
            write({"kind": "gap", "t": now, "ms": 1e3 * (now - last_t), "cpu_ms": 1e3 * (cpu - last_cpu),
                   "stack": last_stack, "after": stack})
        key = (id(frame), frame.f_lasti if frame is not None else -1)
        if key != held_key:
            if last_t - held_t > HELD_S:
                write({"kind": "held", "t": last_t, "ms": 1e3 * (last_t - held_t),
                       "cpu_ms": 1e3 * (last_cpu - held_cpu), "stack": last_stack})
            held_key, held_t, held_cpu = key, now, cpu
        last_t, last_cpu, last_stack = now, cpu, stack
        samples += 1
        if samples % ALLOCATOR_EVERY == 0:
            _allocator_counters(f"{path}.{os.getpid()}.allocator.json")


if os.environ.get("STACK_SAMPLER"):
    threading.Thread(target=_sample, args=(os.environ["STACK_SAMPLER"],), daemon=True,
                     name="stack-sampler").start()
