"""bench/stack_sampler and bench/stack_report.py: a child process's long stops are found where
they happened, a sleep told from a spin by its CPU time."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import stack_report  # noqa: E402

CHILD = """
import time

def sleeper():
    time.sleep(0.15)

def spinner():
    end = time.perf_counter() + 0.15
    while time.perf_counter() < end:
        pass

sleeper()
spinner()
time.sleep(0.05)  # the sampler reports a stop once the thread has moved on
"""


def test_a_sleep_and_a_spin_are_found_with_their_cpu_time(tmp_path):
    path = str(tmp_path / "stacks")
    env = {**os.environ, "STACK_SAMPLER": path,
           "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "bench", "stack_sampler"),
                                          os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", CHILD], env=env, check=True, timeout=60)
    (pid, events), = stack_report.read_events(path).items()
    found = stack_report.groups(events, frames=1)
    slept = [g for g in found if g.kind == "held" and g.frames[0].startswith("<string>:sleeper:")]
    assert slept and slept[0].total_ms >= 100
    assert slept[0].cpu_ms < 0.05 * slept[0].total_ms  # asleep: off the CPU
    spun = [g for g in found if g.kind == "held" and g.frames[0].startswith("<string>:spinner:")]
    # on the CPU whenever it had one (a loaded 2-core machine gives it a third to a half)
    assert spun and sum(g.cpu_ms for g in spun) > 0.2 * sum(g.total_ms for g in spun), spun
    report = stack_report.main([path, "--frames", "2", "--skip", "spinner"])
    assert all("spinner" not in " ".join(g["frames"]) for g in report[pid])
