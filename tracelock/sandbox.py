"""Sandboxed execution of generated Python code (docs/evaluation.md), never in the harness process: a fresh interpreter
per program with resource limits, its own process group, a scrubbed environment, closed stdin and a working
directory of its own, contained for every caller and every installation, and never with a capability.

**Containment** (``CONTAINMENT``, probed once per process in real children): each run gets private mount, PID and
(unless ``network=True``) network namespaces and a file tree of its own, made by its init and switched to with
pivot_root, after which the machine's tree is detached: the system's folders (/usr, /bin, /lib..., /etc) and the
interpreter's installation (its prefixes and the folders its symlinks pass through, wherever they live, a folder
only its owner may enter on the way included) mounted back read-only at their own paths, a minimal /dev, /proc of
the run's PID namespace, and a private tmpfs of ``SCRATCH_MB`` as the working directory, the one writable place.
Every other folder of the machine (the harness user's home, /tmp, /var, /run, /mnt, ...) is absent. A root
harness builds it as root and the program then drops to an unprivileged user; any other harness builds it in a user
namespace of the run's own that maps the harness's user to itself, and the program drops every capability the
namespace gave it. Either way the program ends with empty capability sets (bounding set included) and
no_new_privs: it can read, inside its tree, only what its user may.

PID 1 of the namespace is a minimal init (the harness's fork, not dumpable, so its memory cannot be read through
/proc) that only reaps; the program is its child (PID 2), so a signal the program or its children send it acts as
it would anywhere, and when the program ends, init passes on how it ended and exits, and the kernel kills every
process the program left, daemons that left the process group included.

**Fail closed**: where containment is impossible (a root harness refused mount namespaces, a user refused user
namespaces, an architecture without a known pivot_root number), `run_python` raises `ContainmentUnavailable`
unless the user opts in explicitly (``OPT_IN_ENV`` set to 1, or the command line's ``OPT_IN_FLAG``); such runs
carry ``RunResult.contained = False`` and the run's records say so (`sandbox_record`). A root harness never runs
generated code as root: uncontained, the program still drops to an unprivileged user, which must then be able to
reach the interpreter.

**Process budgets**: a root harness drops each run to a user of its own, leased for the run from a pool of ids that
no account uses (``USER_POOL``; ``SEPARATE_USERS``), so that RLIMIT_NPROC, which counts every process of a user,
is the run's own budget. A lease is a lock file held for the run (released by the kernel if the harness dies); a
user that still owns a process, a zombie of an earlier run included, is never leased; when the run ends, whatever
is left under its user is killed. Where the pool cannot be used every run is ``nobody`` and a warning says so once;
the harness then kills what is left in the run's session and waits for its zombies before it returns. In a user
namespace (a harness that is not root) the kernel (5.14 and later) counts RLIMIT_NPROC per namespace: each run's
budget is again its own.

Statuses are the same in every mode: a program ended by a signal (its own, a child's, its process group's, or a
limit's) is "killed" and ``RunResult.signal`` names the signal. A program that dies of an unhandled exception is a
"runtime_error" with its traceback, a refused ``fork()`` (``BlockingIOError``, the process limit) included."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import math
import os
import resource
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor

__all__ = ["RunResult", "run_python", "check_program", "check_many", "probe_isolation", "sandbox_record",
           "require_containment", "ContainmentUnavailable", "NETWORK_ISOLATION", "CONTAINMENT", "SEPARATE_USERS",
           "USER_NAMESPACE", "USER_POOL", "OPT_IN_ENV", "OPT_IN_FLAG"]

OUTPUT_LIMIT = 4096  # bytes kept per stream: enough for a traceback, small enough for thousands of results
NETWORK_ISOLATION: bool | None = None  # None until probed; False: no network namespace is permitted here
DROP_PRIVILEGES: bool | None = None  # True: the harness is root and the child switches to an unprivileged user
SEPARATE_USERS: bool | None = None  # True: every run has a user of its own from USER_POOL (else nobody, shared)
# the runs' users (uid = gid): no account, above the ranges that systemd and container tools hand out (up to
# 0x6FFFFFFF), below systemd's "foreign" range (0x7FFE0000); one per concurrent run on the machine
USER_POOL = range(0x7A000000, 0x7A000000 + 256)
# where the leases are: root-only, so no sandboxed program can take one; the first that is usable
LEASE_DIRS = ("/run/tracelock-sandbox", "/tmp/tracelock-sandbox-leases")
LEASE_WAIT_S = 60.0  # how long a run waits for a free user when USER_POOL is exhausted
LEFTOVER_WAIT_S = 5.0  # how long a run on a shared user waits for its leftover zombies to be reaped
CONTAINMENT: bool | None = None  # True: each run in a file tree and PID namespace of its own; False: refused here
USER_NAMESPACE: bool | None = None  # True: the harness is not root: containment comes with a user namespace
UNCONTAINED_RUNS: bool | None = None  # True: a run without containment (only ever with the opt-in) can start here
# the explicit opt-in to run generated code where it cannot be contained: the environment variable set to 1, or the
# command-line flag (which sets it for the command and the processes it starts)
OPT_IN_ENV, OPT_IN_FLAG = "TRACELOCK_ALLOW_UNCONTAINED_CODE", "--allow-uncontained-code"
SCRATCH_MB = 64  # size of a contained run's working directory, a tmpfs: memory-backed, so bounded

_libc = ctypes.CDLL(None, use_errno=True)  # loaded now: preexec_fn runs between fork and exec
_CLONE_NEWNET, _CLONE_NEWNS, _CLONE_NEWPID, _CLONE_NEWUSER = 0x40000000, 0x00020000, 0x20000000, 0x10000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MS_PRIVATE, _MNT_DETACH = 2, 4, 8, 4096, 16384, 1 << 18, 2
# mount_setattr(2) has the same number on every architecture; struct mount_attr is four u64. pivot_root(2) has
# no libc wrapper and a number per architecture: elsewhere containment is refused (fail closed)
_SYS_MOUNT_SETATTR, _AT_FDCWD, _AT_RECURSIVE = 442, -100, 0x8000
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV = 1, 2, 4
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41}.get(os.uname().machine)
_PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 4, 24, 38, 47, 4
_CAPABILITY_VERSION_3 = 0x20080522
try:  # the highest capability this kernel knows: each one is dropped from a user namespace's bounding set
    with open("/proc/sys/kernel/cap_last_cap") as _f:
        _CAP_LAST = int(_f.read())
except (OSError, ValueError):
    _CAP_LAST = 40
_NOBODY = (65534, 65534)  # uid, gid of nobody/nogroup on Linux: the shared fallback user
# last traceback lines that mean a resource limit, not a bug: RLIMIT_AS, RLIMIT_FSIZE (EFBIG). A refused fork
# (RLIMIT_NPROC, EAGAIN) is not among them: the program may handle it, and when it does not it dies of an exception
# like any other ("runtime_error", with its traceback), not of a signal
_RESOURCE_ERRORS = ("MemoryError", "OSError: [Errno 27]")
# WNOWAIT peeks without reaping: the zombie keeps its pid (= the process group id) from reuse until killpg
_PEEK = os.WEXITED | os.WNOHANG | os.WNOWAIT
_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
_probe_lock, _compile_lock = threading.Lock(), threading.Lock()
_LAYOUT: tuple[tuple[str, ...], ...] = ()  # set by probe_isolation: see _tree_layout
_REFUSED = ""  # set by probe_isolation: why containment is refused here, for the error
_opt_in_warned = False
_LEASE_DIR: str | None = None  # set by probe_isolation: see _lease_dir


@dataclasses.dataclass
class RunResult:
    """Outcome of one sandboxed run.

    ``status``: "ok", "syntax_error", "runtime_error" (exception, failed assert, exit != 0), "timeout" (wall clock)
    or "killed" (signal or resource limit: SIGXCPU, MemoryError, file too large). A refused ``fork()`` that the
    program does not handle is a "runtime_error" (its traceback ends in ``BlockingIOError``). ``returncode``:
    None when the program never ran or hit the wall timeout; negative: the signal that killed it. ``contained``:
    False only for a run the user let go without containment (``OPT_IN_ENV``), so records can say so.
    """

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    contained: bool = True  # False: run without containment, on the user's explicit opt-in (OPT_IN_ENV)

    @property
    def passed(self) -> bool:
        """True when the program ran to completion with exit code 0 (pass@1 for a program that ends in its tests)."""
        return self.status == "ok"

    @property
    def signal(self) -> str | None:
        """The name of the signal that ended the program ("SIGSEGV", "SIGKILL", ...), None when it exited."""
        return _signal_name(-self.returncode) if self.returncode is not None and self.returncode < 0 else None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal has no name of its own
        return f"signal {number}"


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise OSError(ctypes.get_errno(), f"{what} failed")


def _drop_privileges(user: tuple[int, int] | None) -> None:
    """The program's last step before exec: no capability left, in any mode, none it could regain. The bounding
    set is emptied first, while the process may still do so; then ``user``, the unprivileged user a root harness
    switches to (setresuid clears the other sets), or None: the harness's own user inside a user namespace, where
    the process holds the namespace's full set until its ambient, inheritable, permitted and effective sets are
    cleared here. no_new_privs: no setuid binary or file capability gives any back."""
    for cap in range(_CAP_LAST + 1):
        _check(_libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0), "prctl(PR_CAPBSET_DROP)")
    _check(_libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "prctl(PR_CAP_AMBIENT)")
    if user is not None:
        os.setgroups([])
        os.setresgid(*(user[1],) * 3)
        os.setresuid(*(user[0],) * 3)
    header = (ctypes.c_uint32 * 2)(_CAPABILITY_VERSION_3, 0)  # capset(2) v3: {version, pid}, 2 x {eff, perm, inh}
    _check(_libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def _enter_user_namespace(flags: int) -> None:
    """unshare(CLONE_NEWUSER | flags) and map the harness's own uid and gid to themselves: inside, the process holds
    every capability over what the namespace owns (its mounts, its PID and network namespaces) and none over the
    machine's files beyond its user's own permissions."""
    uid, gid = os.getuid(), os.getgid()
    _check(_libc.unshare(_CLONE_NEWUSER | flags), "unshare(CLONE_NEWUSER)")
    for name, line in (("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1"), ("uid_map", f"{uid} {uid} 1")):
        fd = os.open(f"/proc/self/{name}", os.O_WRONLY)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def _contain_processes(workdir: str, source: bytes, user: tuple[int, int] | None) -> None:
    """Called right after the unshare, in the process Popen knows (the "reporter", which stays outside the new PID
    namespace). Forks the namespace's PID 1, a minimal init that builds the run's file tree and forks the program
    (PID 2); only the program returns, to drop privileges and exec. Init waits for the program, reaping orphans on
    the way, sends its wait status through a pipe and exits, which kills whatever is left in the namespace; the
    reporter then ends exactly as the program did (same exit code, same signal). Neither init nor the reporter is
    dumpable: the program, the same user as them in a user namespace, cannot read their memory (a copy of the
    harness's) through /proc or ptrace.
    """
    _check(_libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    status_r, status_w = os.pipe()
    init = os.fork()
    if init == 0:
        program = _run_init(workdir, source, user, status_r, status_w)
        if program == 0:
            return
    try:  # never return: that would exec the program a second time
        os.close(status_w)
        # the output pipes and Popen's exec-error pipe belong to the program
        os.closerange(0, status_r)
        os.closerange(status_r + 1, os.sysconf("SC_OPEN_MAX"))
        reported = b""
        while chunk := os.read(status_r, 4 - len(reported)):
            reported += chunk
        own = os.waitpid(init, 0)[1]
        # init reports the program's end; without a report (init was killed, or its setup failed) its own end
        _end_like(int.from_bytes(reported, "little", signed=True) if len(reported) == 4 else own)
    finally:
        os._exit(255)


def _run_init(workdir: str, source: bytes, user: tuple[int, int] | None, status_r: int, status_w: int) -> int:
    """PID 1 of the run's namespace: returns 0 in the program's process, never in init's."""
    os.close(status_r)
    # an error here reaches Popen through its exec-error pipe, as any preexec's
    _build_tree(workdir, source, user or (os.getuid(), os.getgid()))
    program = os.fork()
    if program == 0:
        os.close(status_w)
        return 0
    try:
        os.closerange(0, status_w)
        os.closerange(status_w + 1, os.sysconf("SC_OPEN_MAX"))
        while True:  # orphans of the program are re-parented here: reap them until the program itself ends
            pid, status = os.waitpid(-1, 0)
            if pid == program:
                os.write(status_w, status.to_bytes(4, "little", signed=True))
                break
    finally:
        os._exit(0)


def _end_like(status: int) -> None:
    """Exit the way a wait status says a process ended: the same exit code, or killed by the same signal."""
    if os.WIFSIGNALED(status):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        _libc.signal(os.WTERMSIG(status), None)  # SIG_DFL: the harness's handlers were inherited
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [os.WTERMSIG(status)])
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 255)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encoded = [None if v is None else v.encode() for v in (source, target, fstype, data)]
    _check(_libc.mount(encoded[0], encoded[1], encoded[2], ctypes.c_ulong(flags), encoded[3]), f"mount({target})")


def _set_mount(path: str, attr_set: int, recursive: bool) -> None:
    attr = (ctypes.c_uint64 * 4)(attr_set, 0, 0, 0)  # struct mount_attr: attr_set, attr_clr, propagation, userns_fd
    _check(_libc.syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, path.encode(), _AT_RECURSIVE if recursive else 0, attr,
                         ctypes.sizeof(attr)), f"mount_setattr({path})")


def _tree_layout() -> tuple[tuple[str, ...], ...]:
    """What a contained run's file tree holds, worked out once in the harness (whose view of the machine the
    child's mount namespace copies): ``("bind", path)``: a host folder mounted back read-only at the same path (the
    system's /usr, /bin, /lib..., /etc, and the interpreter's installation wherever it lives, folders only their
    owner may enter on the way included); ``("symlink", path, target)``: a host symlink on the way to one of them,
    recreated (/bin -> usr/bin); ``("dir", path)``: a folder on the way, empty but for what is mounted below it.
    Every other folder of the machine (home folders, /tmp, /var, /run, /srv, /mnt, /opt...) is absent."""
    ops: dict[str, tuple[str, ...]] = {}
    binds: list[str] = []

    def covered(path: str) -> bool:
        return any(path == b or path.startswith(b.rstrip("/") + "/") for b in binds)

    def reach(path: str, depth: int = 0) -> None:
        """Make ``path`` resolve in the new tree as on the host: its folders, and its symlinks followed."""
        parts = [p for p in os.path.abspath(path).split("/") if p]
        for i in range(len(parts)):
            here = "/" + "/".join(parts[:i + 1])
            if covered(here) or depth > 40:
                return
            try:
                st = os.lstat(here)
            except OSError:
                return
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(here)
                ops.setdefault(here, ("symlink", here, target))
                rest = "/".join(parts[i + 1:])
                reach(os.path.join(os.path.dirname(here), target, rest), depth + 1)
                return
            if not stat.S_ISDIR(st.st_mode):
                return
            ops.setdefault(here, ("dir", here))

    system = [p for p in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
              if os.path.lexists(p)]
    exe, hops = os.path.abspath(sys.executable), []
    while len(hops) < 40:  # the interpreter's symlink chain: venv/bin/python -> python3 -> /opt/.../python3.11
        hops.append(exe)
        if not os.path.islink(exe):
            break
        exe = os.path.join(os.path.dirname(exe), os.readlink(exe))
    interpreter = {os.path.realpath(p) for p in (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
                                                 os.path.dirname(os.path.realpath(sys.executable)))}
    wanted = [os.path.realpath(p) for p in system if not os.path.islink(p)] + sorted(interpreter)
    for path in sorted(set(wanted), key=len):  # a folder inside one already mounted is mounted with it
        if os.path.isdir(path) and path != "/" and not covered(path):
            reach(os.path.dirname(path))
            binds.append(path)
            ops[path] = ("bind", path)
    for path in system + hops:
        reach(path)
    # folders first, parents before children; then the mounts, outer before inner
    return tuple(sorted(ops.values(), key=lambda op: (op[0] == "bind", op[1].count("/"), op[1])))


def _build_tree(workdir: str, source: bytes, user: tuple[int, int]) -> None:
    """In the run's fresh mount namespace, before the privilege drop: a new root, a small tmpfs mounted on the run's
    (empty) directory, holding only ``_LAYOUT`` (read-only), a minimal /dev (null, zero, full, random, urandom),
    /proc of the run's PID namespace, and at ``workdir``'s own path the one writable place: a private tmpfs of
    ``SCRATCH_MB`` owned by the run's user, with the program in it. pivot_root then makes it the root and detaches
    the machine's tree, so nothing outside it can be reached again, by ``..`` or otherwise."""
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing below propagates back to the harness's tree
    os.umask(0o022)  # the skeleton's folders: for the run's user to pass through (the run's own umask is set after)
    root = workdir
    _mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=1m,nr_inodes=4096")
    for op in _LAYOUT:
        at = root + op[1]
        if op[0] == "symlink":
            os.symlink(op[2], at)
        elif op[0] == "dir":
            os.makedirs(at, 0o755, exist_ok=True)
        else:
            os.makedirs(at, 0o755, exist_ok=True)
            _mount(op[1], at, None, _MS_BIND | _MS_REC)
            _set_mount(at, _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV, recursive=True)
    os.makedirs(root + "/dev", 0o755)
    for name in ("null", "zero", "full", "random", "urandom"):
        os.close(os.open(f"{root}/dev/{name}", os.O_WRONLY | os.O_CREAT, 0o644))
        _mount(f"/dev/{name}", f"{root}/dev/{name}", None, _MS_BIND)
        _set_mount(f"{root}/dev/{name}", _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID, recursive=False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    os.makedirs(root + "/proc", 0o755)
    _mount("proc", root + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    os.makedirs(root + "/tmp", 0o755, exist_ok=True)
    os.makedirs(root + workdir, 0o755, exist_ok=True)
    _mount("tmpfs", root + workdir, "tmpfs", _MS_NOSUID | _MS_NODEV,
           f"mode=0700,uid={user[0]},gid={user[1]},size={SCRATCH_MB}m,nr_inodes=4096")
    path = os.path.join(root + workdir, "candidate.py")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with memoryview(source) as view:
        while view:
            view = view[os.write(fd, view):]
    os.close(fd)
    os.chown(path, *user)
    _set_mount(root, _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID, recursive=False)  # the skeleton itself: read-only
    os.chdir(root)
    _check(_libc.syscall(_SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", _MNT_DETACH), "umount2(old root)")  # the machine's tree, stacked on the new root
    os.chdir(workdir)
    os.umask(0o077)


def _preexec(workdir: str, source: bytes, *, isolate: bool, contain: bool, user: tuple[int, int] | None,
             limits: list):
    flags = (_CLONE_NEWNET if isolate else 0) | (_CLONE_NEWNS | _CLONE_NEWPID if contain else 0)
    # a harness that is not root gets its namespaces through a user namespace of the run's own
    userns = bool(flags) and os.geteuid() != 0

    def preexec() -> None:
        os.setsid()  # own process group, so killpg reaches every descendant that did not leave it
        os.umask(0o077)
        if userns:  # fail closed: isolation was requested and probed as available
            _enter_user_namespace(flags)
        elif flags:
            _check(_libc.unshare(flags), "unshare")
        if contain:
            _contain_processes(workdir, source, user)
        if userns or user is not None:
            _drop_privileges(user)  # after the unshare and the mounts, which need the capabilities
        for which, value in limits:
            resource.setrlimit(which, value)
    return preexec


def _lease_dir() -> str | None:
    """The first of LEASE_DIRS that is (or can be made) a directory only the harness (root) can write in."""
    for path in LEASE_DIRS:
        with contextlib.suppress(OSError):
            os.makedirs(path, mode=0o700, exist_ok=True)
            st = os.lstat(path)  # not a symlink, and not made by someone else beforehand (/tmp)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022:
                return path
    return None


def _uid_of(pid: str) -> tuple[int, bool] | None:
    """(real uid, zombie) of a process, the uid RLIMIT_NPROC counts it under; None when it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
        at, state = status.index(b"\nUid:\t") + 6, status.index(b"\nState:\t") + 8
        return int(status[at:status.index(b"\t", at)]), status[state:state + 1] == b"Z"
    except (OSError, ValueError):
        return None


def _session_of(pid: str) -> tuple[int, bool] | None:
    """(session id, zombie) of a process; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[3]), fields[0] == b"Z"
    except (OSError, ValueError, IndexError):
        return None


def _scan(of) -> dict[int, list[tuple[int, bool]]]:
    """The processes in the harness's /proc (every PID namespace below its own included), by ``of(pid)[0]``:
    value -> [(pid, zombie)]. Zombies count: RLIMIT_NPROC counts a process until it is reaped."""
    found: dict[int, list[tuple[int, bool]]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (got := of(name)) is not None:
            found.setdefault(got[0], []).append((int(name), got[1]))
    return found


def _kill_pinned(pid: int, of, value: int) -> None:
    """SIGKILL ``pid`` if ``of(pid)[0] == value`` still holds once a pidfd pins the process: a pid freed and reused
    between the scan and the kill names another process, which the check then sees."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd (Python or kernel too old): the short race of a plain kill
        if (of(str(pid)) or (None,))[0] == value:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return
    try:
        if (of(str(pid)) or (None,))[0] == value:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    finally:
        os.close(fd)


def _clear_leftovers(of, value: int, *, spare: int, wait_for_zombies: bool) -> None:
    """Kill every live process with ``of(pid)[0] == value`` but ``spare`` (the run's own, not reaped yet), again
    until none is left (a fork bomb forks while it dies), for at most LEFTOVER_WAIT_S; with ``wait_for_zombies``
    also wait until the zombies are reaped (whoever reaps them: the machine's init may take seconds)."""
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while left := [(pid, zombie) for pid, zombie in _scan(of).get(value, []) if pid != spare]:
        live = [pid for pid, zombie in left if not zombie]
        if not (live or wait_for_zombies) or time.monotonic() > deadline:
            return
        for pid in live:
            _kill_pinned(pid, of, value)
        time.sleep(0.001 if live else 0.01)


def _lease_user() -> tuple[int, int]:
    """(uid, the fd holding its lease): a user of USER_POOL that no run holds and that owns no process, an earlier
    run's zombies included. The lease is an exclusive flock on the user's file in the lease directory, held until
    the fd is closed (by the kernel, if the harness dies), and per open file, so threads exclude each other too."""
    size, start = len(USER_POOL), secrets.randbelow(len(USER_POOL))  # a random start: few collisions to skip
    deadline = time.monotonic() + LEASE_WAIT_S
    while True:
        busy: set[int] = set()
        for k in range(size):
            uid = USER_POOL[(start + k) % size]
            if uid in busy:
                continue
            fd = os.open(os.path.join(_LEASE_DIR, str(uid)), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                busy = set(_scan(_uid_of)).intersection(USER_POOL)  # scanned after the lock: nothing new comes
                if uid not in busy:
                    return uid, fd
            except BlockingIOError:
                pass
            os.close(fd)
        if time.monotonic() > deadline:
            raise RuntimeError(f"no sandbox user free: all {size} of tracelock.sandbox.USER_POOL are in use by "
                               f"runs or their leftover processes after {LEASE_WAIT_S:.0f} s; run fewer at once")
        time.sleep(0.05)


@contextlib.contextmanager
def _run_user(separate: bool, drop: bool):
    """(user, own): the user a run is dropped to (None: the harness's own) and whether no other run shares it."""
    if not separate:
        yield (_NOBODY if drop else None), False
        return
    uid, fd = _lease_user()
    try:
        yield (uid, uid), True
    finally:
        os.close(fd)  # after _launch cleared the user's processes


def _launch(source: str, timeout: float, *, isolate: bool, contain: bool, user: tuple[int, int] | None,
            own_user: bool, limits: list) -> tuple[str, str, int | None]:
    """Run ``source`` as candidate.py in a fresh working directory, as ``user`` (None: the harness's own), which
    ``own_user`` says no other run shares; (stdout, stderr, returncode or None on timeout)."""
    workdir = tempfile.mkdtemp(prefix="tracelock-sandbox-")
    try:
        if not contain:  # a contained child writes its own copy in its private tmpfs
            with open(os.path.join(workdir, "candidate.py"), "w", encoding="utf-8") as f:
                f.write(source)
            if user is not None:  # the run's user must be able to read the source and write in its directory
                os.chown(workdir, *user)
        preexec = _preexec(workdir, source.encode(), isolate=isolate, contain=contain, user=user, limits=limits)
        # -S -s -P rather than -I: -I implies -E, which would ignore PYTHONHASHSEED
        with subprocess.Popen([sys.executable, "-S", "-s", "-B", "-P", "candidate.py"], cwd=workdir,
                              env=dict(_ENV, HOME=workdir), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, preexec_fn=preexec, close_fds=True) as proc:
            stdout, stderr, timed_out = _collect(proc, timeout, user[0] if own_user else None)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return stdout, stderr, None if timed_out else proc.returncode


def probe_isolation() -> dict[str, bool]:
    """Find out, once per process, which isolation features this machine permits, each tried in a real child.

    Returns:
        ``{"network_isolation", "drop_privileges", "separate_users", "containment", "user_namespace",
        "uncontained_runs"}`` (bools), also kept in the module-level flags. ``containment`` False: `run_python`
        refuses to run generated code unless the user opts in (``OPT_IN_ENV``); ``uncontained_runs``: whether such
        a run can start at all (a root harness never runs generated code as root, and without containment the
        run's unprivileged user must be able to reach the interpreter).
    """
    global NETWORK_ISOLATION, DROP_PRIVILEGES, SEPARATE_USERS, CONTAINMENT, USER_NAMESPACE, UNCONTAINED_RUNS, \
        _LAYOUT, _LEASE_DIR, _REFUSED

    def works(*, separate: bool = False, drop: bool = False, **flags) -> bool:
        # tried in a real child: seccomp, namespace policy or an unmapped id can refuse what root may do; the
        # import reads the standard library: the interpreter's files are reachable from inside
        with contextlib.suppress(OSError, subprocess.SubprocessError, RuntimeError), \
                _run_user(separate, drop) as (user, own):
            return _launch("import json\nprint(json.dumps(1))", 30, limits=[], user=user, own_user=own,
                           **flags)[::2] == ("1\n", 0)
        return False

    with _probe_lock:
        if NETWORK_ISOLATION is None:
            root = os.geteuid() == 0
            _LAYOUT = _tree_layout()
            _LEASE_DIR = _lease_dir() if root else None
            pivot = _SYS_PIVOT_ROOT is not None
            if root:  # runs always drop to an unprivileged user: one of their own, else nobody
                own_c = pivot and _LEASE_DIR is not None and works(contain=True, isolate=False, separate=True)
                CONTAINMENT = own_c or pivot and works(contain=True, isolate=False, drop=True)
                own_u = _LEASE_DIR is not None and works(contain=False, isolate=False, separate=True)
                UNCONTAINED_RUNS = own_u or works(contain=False, isolate=False, drop=True)
                SEPARATE_USERS = own_c if CONTAINMENT else own_u
                DROP_PRIVILEGES = CONTAINMENT or UNCONTAINED_RUNS
                NETWORK_ISOLATION = works(isolate=True, contain=False)  # the probe's own program, as root
                USER_NAMESPACE = False
            else:  # the harness's own user, in a user namespace of each run's own
                CONTAINMENT = pivot and works(contain=True, isolate=False)
                UNCONTAINED_RUNS = works(contain=False, isolate=False)
                NETWORK_ISOLATION = CONTAINMENT and works(contain=True, isolate=True)
                SEPARATE_USERS = DROP_PRIVILEGES = False
                USER_NAMESPACE = CONTAINMENT
            _REFUSED = "" if CONTAINMENT else (
                f"pivot_root has no known system call number on {os.uname().machine}" if not pivot else
                "the kernel refuses mount and PID namespaces to this root harness (a container without "
                "CAP_SYS_ADMIN, or a seccomp policy)" if root else
                "the kernel refuses user namespaces to this user (kernel.unprivileged_userns_clone, "
                "user.max_user_namespaces, or an AppArmor or seccomp policy)")
            partial = [what for what, ok in (("network isolation", NETWORK_ISOLATION),
                                             ("a user per run (else concurrent runs share nobody's max_processes)",
                                              SEPARATE_USERS or USER_NAMESPACE)) if not ok]
            if CONTAINMENT and partial:  # said once per process; without containment run_python says it
                warnings.warn(f"partial sandbox, without {' and '.join(partial)}", RuntimeWarning, stacklevel=2)
    return {"network_isolation": NETWORK_ISOLATION, "drop_privileges": DROP_PRIVILEGES,
            "separate_users": SEPARATE_USERS, "containment": CONTAINMENT, "user_namespace": USER_NAMESPACE,
            "uncontained_runs": UNCONTAINED_RUNS}


def _opted_in() -> bool:
    value = os.environ.get(OPT_IN_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{OPT_IN_ENV}={value[:40]!r}: set it to 1 to run generated code without containment, or "
                         "unset it")
    return value == "1"


def _unreachable_folder() -> str | None:
    """The first folder on the way to the interpreter that other users may not enter (mode 0700 and the like)."""
    path = os.path.realpath(sys.executable)
    parts = path.split(os.sep)
    for i in range(2, len(parts)):
        folder = os.sep.join(parts[:i])
        with contextlib.suppress(OSError):
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                return folder
    return None


class ContainmentUnavailable(PermissionError):
    """Generated code cannot be contained on this machine and the user has not opted in (``OPT_IN_ENV``), or no
    run can start at all. A PermissionError, so the command line prints its one line and exits 2."""


def require_containment() -> bool:
    """Check, before any work, that generated code may run here; raise `ContainmentUnavailable` with the reason and
    the fix if not. Returns True when runs are contained, False when they run uncontained on the user's opt-in
    (a warning says so, once per process)."""
    global _opt_in_warned
    probe_isolation()
    if CONTAINMENT:
        return True
    if not _opted_in():
        raise ContainmentUnavailable(
            f"generated code cannot be contained here ({_REFUSED}), and uncontained it could read, and write, what "
            f"its user can: run it anyway only if you trust it, with {OPT_IN_FLAG} or {OPT_IN_ENV}=1")
    if not UNCONTAINED_RUNS:
        folder = _unreachable_folder()
        raise ContainmentUnavailable(
            f"generated code cannot be contained here ({_REFUSED}), and not even run uncontained: "
            + (f"the unprivileged user it runs as cannot enter {folder} to reach the interpreter; install tracelock "
               "where other users can read it" if folder else "the unprivileged user it runs as cannot start the "
               "interpreter"))
    if not _opt_in_warned:
        _opt_in_warned = True
        warnings.warn(f"generated code runs without containment ({OPT_IN_ENV}=1): it can read every file its user "
                      "can and write wherever that user may; the records mark these runs uncontained",
                      RuntimeWarning, stacklevel=2)
    return False


def sandbox_record() -> dict:
    """What protected the generated code of a run, for its records: ``{"contained": bool, "opt_in": bool, ...}``
    with the probed features; ``opt_in`` True means the user let it run without containment."""
    features = probe_isolation()
    return dict(contained=bool(CONTAINMENT), opt_in=not CONTAINMENT and _opted_in(),
                **{k: bool(v) for k, v in features.items() if k != "containment"})


def _syntax_error(source: str) -> str | None:
    # Compiling executes nothing and is far cheaper than a process. dont_inherit keeps this module's __future__
    # flags out; the lock because catch_warnings (silencing SyntaxWarning here) is not thread-safe.
    try:
        with _compile_lock, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile(source, "<candidate>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:  # ValueError: null bytes in the source
        return "".join(traceback.format_exception_only(exc))
    except (RecursionError, MemoryError):  # pathological input: let the sandboxed child report it
        pass
    return None


def _lowered(which: int, soft: int, hard: int | None = None) -> tuple[int, tuple[int, int]]:
    # never above the harness's own hard limit: the child is no longer root when it applies these
    hard, cap = soft if hard is None else hard, resource.getrlimit(which)[1]
    return which, tuple(v if cap == resource.RLIM_INFINITY else min(v, cap) for v in (soft, hard))


def _kill_run(proc: subprocess.Popen, own_uid: int | None, *, wait_for_zombies: bool) -> None:
    """Kill the run's process group, then every process left of the run's own user (``own_uid``), daemons
    included, or else of the run's session; on a shared user, also wait for the session's zombies (the user's next
    run would count them). Called before proc is reaped: until then its pid, the session's id, names no other
    process."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    if own_uid is not None:  # a user with zombies left is not leased again (_lease_user): no need to wait
        _clear_leftovers(_uid_of, own_uid, spare=proc.pid, wait_for_zombies=False)
    else:
        _clear_leftovers(_session_of, proc.pid, spare=proc.pid, wait_for_zombies=wait_for_zombies)


def _collect(proc: subprocess.Popen, timeout: float, own_uid: int | None) -> tuple[str, str, bool]:
    """Read both pipes until EOF or the deadline; keep the head of stdout and the tail of stderr (the traceback).
    Then clear what the program left (_kill_run)."""
    deadline, out, err, timed_out = time.monotonic() + timeout, bytearray(), bytearray(), False
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ, out)
            sel.register(proc.stderr, selectors.EVENT_READ, err)
            while sel.get_map():
                if os.waitid(os.P_PID, proc.pid, _PEEK):  # exited, but leftover children may hold the pipes open
                    _kill_run(proc, own_uid, wait_for_zombies=False)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = os.waitid(os.P_PID, proc.pid, _PEEK) is None
                    break
                for key, _ in sel.select(min(remaining, 0.05)):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                    elif key.data is out:
                        out += chunk[: max(0, OUTPUT_LIMIT + 1 - len(out))]
                    else:
                        err += chunk
                        del err[: max(0, len(err) - OUTPUT_LIMIT - 1)]
        # both pipes at EOF: a contained run's reporter exits just after the program and its init closed them, so
        # give it until the deadline (polled: peeking keeps the pid, the process group's id, from reuse until the
        # killpg below)
        while not timed_out and os.waitid(os.P_PID, proc.pid, _PEEK) is None:
            timed_out = time.monotonic() >= deadline
            time.sleep(0.001)
    finally:  # also on errors and KeyboardInterrupt: nothing may outlive the run
        _kill_run(proc, own_uid, wait_for_zombies=True)
        proc.wait()  # the caller's `with Popen` closes the pipes
    out = out[:OUTPUT_LIMIT] + b"\n[... truncated]" if len(out) > OUTPUT_LIMIT else out
    err = b"[truncated ...]\n" + err[-OUTPUT_LIMIT:] if len(err) > OUTPUT_LIMIT else err
    return out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), timed_out


def cpu_seconds_for(timeout: float) -> int:
    """The default CPU-time limit for a wall-clock ``timeout``: one second above it. With equal limits a busy
    single-threaded program races the two (its SIGXCPU can land before a loaded harness notices the deadline, and
    an endless loop reads "killed"); one second apart, it always reaches the wall clock first ("timeout"), while a
    program burning several cores is still stopped by CPU time."""
    return math.ceil(timeout) + 1


def run_python(source: str, *, timeout: float = 5.0, cpu_seconds: int | None = None, memory_mb: int = 512,
               max_processes: int = 16, max_file_mb: int = 1, network: bool = False) -> RunResult:
    """Run untrusted Python source in a fresh sandboxed subprocess.

    Args:
        source: the program; written to a file in the run's temporary directory, never put on a command line.
        timeout: wall-clock seconds before the whole process group is killed (status "timeout").
        cpu_seconds: RLIMIT_CPU; SIGXCPU at the limit, SIGKILL one second later (status "killed"); None:
            ``cpu_seconds_for(timeout)``, one second above the wall clock.
        memory_mb: RLIMIT_AS in MiB (the interpreter itself needs about 30).
        max_processes: RLIMIT_NPROC; it counts all processes and threads of the child's user, zombies included:
            the run's own user (``SEPARATE_USERS``) when the harness is root, else ``nobody`` (shared by concurrent
            runs) where the pool is refused; for any other harness its user within the run's own user namespace.
        max_file_mb: RLIMIT_FSIZE in MiB, the largest file the program may write.
        network: False: an empty network namespace where permitted (``NETWORK_ISOLATION``); True: untouched.

    Returns:
        A RunResult; stdout and stderr are cut to ``OUTPUT_LIMIT`` bytes (head of stdout, tail of stderr).

    Raises:
        ContainmentUnavailable: the program cannot be contained here and the user has not opted in (``OPT_IN_ENV``),
            or no run can start at all; checked before anything runs.
    """
    if cpu_seconds is None and timeout > 0:
        cpu_seconds = cpu_seconds_for(timeout)
    if timeout <= 0 or min(cpu_seconds, memory_mb, max_processes, max_file_mb) < 1:
        raise ValueError("timeout must be > 0 and cpu_seconds, memory_mb, max_processes, max_file_mb >= 1")
    start = time.perf_counter()
    if (error := _syntax_error(source)) is not None:
        return RunResult("syntax_error", None, "", error, time.perf_counter() - start)
    contained = require_containment()
    if os.geteuid() == 0 and not DROP_PRIVILEGES:  # never as root (require_containment leaves no such case)
        raise ContainmentUnavailable("a root harness found no unprivileged user to run generated code as")
    # in a user namespace the run's reporter and init count under its user too: two processes on top
    processes = max_processes + (2 if contained and USER_NAMESPACE else 0)
    # RLIMIT_AS last: the forked child still has the parent's large address space until exec
    limits = [_lowered(resource.RLIMIT_CORE, 0), _lowered(resource.RLIMIT_CPU, cpu_seconds, cpu_seconds + 1),
              _lowered(resource.RLIMIT_NPROC, processes), _lowered(resource.RLIMIT_FSIZE, max_file_mb << 20),
              _lowered(resource.RLIMIT_AS, memory_mb << 20)]
    with _run_user(SEPARATE_USERS, DROP_PRIVILEGES) as (user, own):
        stdout, stderr, rc = _launch(source, timeout, isolate=bool(not network and NETWORK_ISOLATION),
                                     contain=contained, user=user, own_user=own, limits=limits)
    last = (stderr.strip().splitlines() or [""])[-1]
    status = ("timeout" if rc is None else "ok" if rc == 0 else
              "killed" if rc < 0 or last.startswith(_RESOURCE_ERRORS) else "runtime_error")
    if rc is not None and rc < 0:  # a crash leaves no traceback: say what ended it
        stderr += f"[tracelock: the program was killed by {_signal_name(-rc)}]\n"
    return RunResult(status, rc, stdout, stderr, time.perf_counter() - start, contained)


def check_program(program: str, tests: str, *, entry_point: str | None = None, timeout: float = 5.0,
                  **limits) -> RunResult:
    """Run a program followed by its tests in one sandboxed process (HumanEval style).

    Args:
        program: the candidate program (for HumanEval: prompt + completion).
        tests: test code; HumanEval's defines ``check(candidate)`` and asserts inside it.
        entry_point: when given, ``check(<entry_point>)`` is appended and called.
        timeout, **limits: as for ``run_python`` (cpu_seconds, memory_mb, max_processes, max_file_mb, network).

    Returns:
        The RunResult; status "ok" means the program and every assert ran without error and the tests reached their
        end: a program that exits with code 0 before that (``sys.exit(0)``, ``os._exit(0)``) is a "runtime_error".
        The program shares its process with the tests, so this guards against mistakes, not against a program
        written to fake a pass.
    """
    if entry_point is not None and not entry_point.isidentifier():
        raise ValueError(f"entry_point must be a Python identifier, got {entry_point!r}")
    call = f"\ncheck({entry_point})\n" if entry_point else ""
    # the last line of the run's stderr once the tests are through; fresh per run, so no program prints it by chance
    done = f"[tracelock: tests finished {secrets.token_hex(8)}]"
    epilogue = f"\nprint({done!r}, file=__import__('sys').stderr, flush=True)\n"
    result = run_python(f"{program}\n\n{tests}\n{call}{epilogue}", timeout=timeout, **limits)
    if result.status != "ok":
        return result
    if done in result.stderr:
        return dataclasses.replace(result, stderr=result.stderr.replace(done + "\n", ""))
    return dataclasses.replace(result, status="runtime_error",
                               stderr=result.stderr + "[tracelock: the program exited with code 0 before its tests "
                               "finished]\n")


def check_many(jobs: list[tuple[str, str, str | None]], *, workers: int = 2, timeout: float = 5.0,
               **limits) -> list[RunResult]:
    """Run ``(program, tests, entry_point)`` jobs concurrently, each in its own sandboxed process.

    Args:
        jobs: the jobs, as for ``check_program``.
        workers: how many subprocesses run at once (the threads only wait on them, so the GIL is no bottleneck).
        timeout, **limits: per job, as for ``run_python``.

    Returns:
        One RunResult per job, in input order.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    probe_isolation()  # once, before the threads race for it
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda j: check_program(j[0], j[1], entry_point=j[2], timeout=timeout, **limits), jobs))
