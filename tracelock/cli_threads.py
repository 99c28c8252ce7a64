"""The thread rule of the CLI and the Python API: torch threads default to ``$OMP_NUM_THREADS`` or the physical
cores (`default_threads`), and on a busy machine to the cores its load leaves free, said once on stderr
(`threads_for_load`, `machine_load`); `apply_runtime_options` applies ``--threads`` and ``--quiet`` to this process
and the processes it starts.

Nothing here imports torch: it runs before a command loads it (torch reads ``OMP_NUM_THREADS`` when it loads).
"""

import os
import sys
import time

from tracelock.progress import QUIET_ENV


def physical_cores() -> int:
    """Physical cores this process may run on (hyperthread siblings count once), from sysfs; the logical CPU count
    where sysfs does not say."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(topology + "physical_package_id") as pkg, open(topology + "core_id") as core:
                cores.add((pkg.read().strip(), core.read().strip()))
        except OSError:
            cores.add(("cpu", cpu))
    return max(1, len(cores))


def default_threads() -> int:
    """``$OMP_NUM_THREADS`` when set to a positive number, else the physical cores available."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(env) if env.isdigit() and int(env) > 0 else physical_cores()


def threads_for_load(threads: int | None, default: int, cores: int, load: float,
                     how: str = "--threads {n}") -> tuple[int, str | None]:
    """(torch threads to use, a notice or None) for a thread count chosen by the user (None: not chosen) on a machine
    whose load is ``load`` over ``cores`` cores (`machine_load`). Threads that wait for a core stall each other at
    every op: on a shared 2-core machine two threads made `tracelock demo --model testbed-dream` 15x slower than one.
    So the default comes down to the cores the load leaves free, and a chosen count above them is kept but called
    out. ``how`` is how the user sets the count (the CLI's ``--threads {n}``, the API's
    ``torch.set_num_threads({n})``). The one rule of the CLI and the Python API."""
    free = max(1, int(cores - load + 0.5))
    if threads is None and default > free:
        return free, (f"this machine is busy (load average {load:.1f} on {cores} cores): using {free} torch "
                      f"thread{'s' if free > 1 else ''} instead of {default}, as threads that wait for a core make "
                      f"decoding many times slower; {how.format(n='N')} sets the count")
    if threads is not None and threads > free:
        chosen = how.format(n=threads)
        return threads, (f"{chosen} on a busy machine (load average {load:.1f} on {cores} cores): threads that wait "
                         f"for a core make decoding many times slower; {how.format(n=free)} may well be faster")
    return threads or default, None


def _cpu_jiffies(cpus, stat_text: str) -> tuple[int, int]:
    """(busy, total) jiffies of the logical ``cpus`` in a /proc/stat text."""
    busy = total = 0
    for line in stat_text.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            values = [int(v) for v in fields[:8]]
            total += sum(values)
            busy += sum(values) - values[3] - (values[4] if len(values) > 4 else 0)  # idle and iowait
    return busy, total


def busy_cores(before: str, after: str, cpus, cores: int) -> float | None:
    """Physical cores' worth of work the logical ``cpus`` did between two /proc/stat texts (None: no time passed)."""
    (b0, t0), (b1, t1) = _cpu_jiffies(cpus, before), _cpu_jiffies(cpus, after)
    if t1 <= t0:
        return None
    return (b1 - b0) / (t1 - t0) * cores


def machine_load(cores: int, sample_seconds: float = 0.1) -> float:
    """The load a command's threads would compete with, in cores: the 1-minute load average, unless a short sample
    of the CPUs this process may use says they are freer now. The average still counts, for about a minute, a run
    that has just ended (the user's own previous command, say), which would cost the next run its threads for
    nothing; the sample is taken only when the average says the machine is busy, so an idle machine waits for none."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load < 0.5 or not os.path.exists("/proc/stat"):
        return load
    cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    try:
        with open("/proc/stat") as f:
            before = f.read()
        time.sleep(sample_seconds)
        with open("/proc/stat") as f:
            after = f.read()
    except OSError:
        return load
    now = busy_cores(before, after, cpus, cores)
    return load if now is None else min(load, now)


# commands that decode (or train) nothing: no load sample, no busy-machine notice
NO_COMPUTE = ("env", "report", "tiny-checkpoint", "testbed-ship", "testbed-ship-controller")
NOTICE_ENV = "TRACELOCK_LOAD_NOTICED"  # set once the busy-machine notice is said: the run's other processes keep quiet


def apply_runtime_options(args) -> None:
    """Set the thread count and the quiet switch for this process and the processes it starts. torch reads
    ``OMP_NUM_THREADS`` when it loads, which the CLI does only inside a command, after this. The busy-machine notice
    prints once per run (not again in the processes it starts), not with --quiet, and not for a command that decodes
    nothing (`NO_COMPUTE`)."""
    quiet = getattr(args, "quiet", False)
    if quiet:
        os.environ[QUIET_ENV] = "1"
    if getattr(args, "allow_uncontained_code", False):  # read by tracelock.sandbox, here and in torchrun's ranks
        os.environ["TRACELOCK_ALLOW_UNCONTAINED_CODE"] = "1"
    threads = getattr(args, "threads", None) or None  # testbed-train's --threads 0 is its default
    if threads is not None or "OMP_NUM_THREADS" not in os.environ:
        cores = physical_cores()
        computes = getattr(args, "command", None) not in NO_COMPUTE
        n, notice = threads_for_load(threads, default_threads(), cores, machine_load(cores) if computes else 0.0)
        if notice and not quiet and not os.environ.get(NOTICE_ENV):
            print(f"{getattr(args, 'command', 'tracelock')}: {notice}", file=sys.stderr, flush=True)
            os.environ[NOTICE_ENV] = "1"
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(n)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(n)
