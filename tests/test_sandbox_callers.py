"""The sandbox for every caller: generated code is contained whoever runs the harness and wherever tracelock is
installed, and where it cannot be contained it runs only on the user's explicit opt-in. Each mode is a real harness
process, set up by this (root) test as a user would have it:

- ``root``: this process, a root harness in the repository's own environment;
- ``root, venv in a 0700 folder``: a root harness whose virtual environment lies in a ``mktemp -d`` folder (mode
  0700, which the run's unprivileged user cannot enter);
- ``user``: a harness that is not root (an id no account uses), its venv in a 0700 folder of its own and a home
  with a secret; its sandbox contains each run in a user namespace;
- ``user, namespaces refused``: the same harness where the kernel refuses it user namespaces (its limit set to 0):
  containment is impossible, so generated code is refused unless the user opts in.

The modes that are not this process run their harness in a mount namespace of their own in which the folders on
the way to the machine's interpreter that the harness's user may not enter (here /root, mode 0700) hold only that
way: the machine itself is left as it is. A mode the machine cannot set up is skipped with the reason."""

import ctypes
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile

import pytest

from tracelock import sandbox

FEATURES = sandbox.probe_isolation()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARNESS_UID = sandbox.USER_POOL.stop + 32  # an id no account uses, above the sandbox's pool
_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNS, _CLONE_NEWUSER, _MS_REC, _MS_PRIVATE, _MS_BIND = 0x00020000, 0x10000000, 16384, 1 << 18, 4096

# what each hostile program tries; none may succeed. {home}, {secret}, {port}: the harness user's
HOSTILE = {
    "read a 0600 file of the harness user": "print(open({secret!r}).read())",
    "list the harness user's home": "import os\nprint(os.listdir({home!r}))",
    "write into the harness user's home": "open({home!r} + '/planted', 'w').write('x')",
    "read /etc/shadow": "print(open('/etc/shadow').read())",
    "open a socket to the harness": "import socket\nsocket.create_connection(('127.0.0.1', {port}), 2)",
    "open a socket to the internet": "import socket\nsocket.create_connection(('1.1.1.1', 53), 2)",
}
# run by each mode's harness: the hostile programs, then one ordinary program; prints what happened as JSON
PROBE = """
import dataclasses, json, os, sys
from tracelock import sandbox
home, secret, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
hostile = json.loads(sys.argv[4])
out = {"uid": os.getuid(), "features": sandbox.probe_isolation(), "runs": {}}
try:
    for name, source in hostile.items():
        out["runs"][name] = dataclasses.asdict(sandbox.run_python(source.format(home=home, secret=secret, port=port),
                                                                  timeout=10))
    out["runs"]["ordinary"] = dataclasses.asdict(sandbox.run_python("print(sum(range(10)))", timeout=10))
except sandbox.ContainmentUnavailable as err:
    out["refused"] = str(err)
print(json.dumps(out))
"""


def _traversable(path: str, uid: int) -> bool:
    st = os.stat(path)
    return bool(st.st_mode & stat.S_IXOTH or st.st_uid == uid and st.st_mode & stat.S_IXUSR)


def _reveal(paths: list[str], uid: int) -> None:
    """In the child, in a fresh mount namespace: each folder on the way to ``paths`` that ``uid`` may not enter
    becomes a 0755 tmpfs holding only the way on (deepest first, so a folder inside another is carried along)."""
    def check(rc, what):
        if rc != 0:
            raise OSError(ctypes.get_errno(), what)
    check(_libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check(_libc.mount(None, b"/", None, ctypes.c_ulong(_MS_REC | _MS_PRIVATE), None), "mount(/, private)")
    closed = {}  # folder -> the entries on the way through it
    for path in paths:
        parts = os.path.realpath(path).split(os.sep)
        for i in range(2, len(parts)):
            folder = os.sep.join(parts[:i])
            if not _traversable(folder, uid):
                closed.setdefault(folder, set()).add(parts[i])
    for folder in sorted(closed, key=lambda f: -f.count(os.sep)):
        fds = {name: os.open(os.path.join(folder, name), os.O_PATH) for name in closed[folder]}
        check(_libc.mount(b"tmpfs", folder.encode(), b"tmpfs", ctypes.c_ulong(0), b"mode=0755"), f"mount({folder})")
        for name, fd in fds.items():
            os.mkdir(os.path.join(folder, name))
            check(_libc.mount(f"/proc/self/fd/{fd}".encode(), os.path.join(folder, name).encode(), None,
                              ctypes.c_ulong(_MS_BIND | _MS_REC), None), f"mount({folder}/{name})")
            os.close(fd)


def _become(uid: int, refuse_user_namespaces: bool):
    def preexec():
        _reveal([sys.executable, sys.base_prefix, REPO, sysconfig.get_paths()["purelib"]], uid)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        _libc.prctl(4, 1, 0, 0, 0)  # dumpable again after the switch: its /proc/self is its own
        if refuse_user_namespaces:  # a user namespace whose own limit of nested ones is 0, as a policy would
            if _libc.unshare(_CLONE_NEWUSER) != 0:
                raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER)")
            for name, line in (("setgroups", "deny"), ("gid_map", f"{uid} {uid} 1"), ("uid_map", f"{uid} {uid} 1"),
                               ("sys/user/max_user_namespaces", "0")):
                with open(f"/proc/self/{name}" if "/" not in name else f"/proc/{name}", "w") as f:
                    f.write(line)
    return preexec


def _venv(folder: str, owner: int | None = None) -> str:
    """A virtual environment in ``folder`` that sees this environment's packages (tracelock, pytest, torch)."""
    venv = os.path.join(folder, "venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    purelib = subprocess.run([os.path.join(venv, "bin", "python"), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True,
                             text=True, check=True).stdout.strip()
    with open(os.path.join(purelib, "project.pth"), "w") as f:
        f.write(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    if owner is not None:
        for at, dirs, files in os.walk(folder):
            for name in [at] + [os.path.join(at, n) for n in dirs + files]:
                os.lchown(name, owner, owner)
    return os.path.join(venv, "bin", "python")


@pytest.fixture(scope="module")
def callers():
    """mode -> how to start its harness: (python, preexec_fn, home, secret file), the folders made for it removed
    afterwards."""
    made, modes = [], {}

    def home_with_secret(owner: int) -> tuple[str, str]:
        home = tempfile.mkdtemp(prefix="tracelock-callers-home-")  # 0700, as a home folder
        made.append(home)
        secret = os.path.join(home, ".secret-token")
        with open(secret, "w") as f:
            f.write(f"s3cret-{os.getpid()}-{owner}")
        os.chmod(secret, 0o600)
        for path in (home, secret):
            os.chown(path, owner, owner)
        return home, secret

    modes["root"] = (sys.executable, None, *home_with_secret(0))
    if os.geteuid() == 0:
        folder = tempfile.mkdtemp(prefix="tracelock-callers-root-")  # mode 0700, as mktemp -d makes it
        made.append(folder)
        modes["root, venv in a 0700 folder"] = (_venv(folder), None, *home_with_secret(0))
        folder = tempfile.mkdtemp(prefix="tracelock-callers-user-")
        made.append(folder)
        os.chown(folder, HARNESS_UID, HARNESS_UID)
        python = _venv(folder, owner=HARNESS_UID)
        home, secret = home_with_secret(HARNESS_UID)
        modes["user"] = (python, _become(HARNESS_UID, False), home, secret)
        modes["user, namespaces refused"] = (python, _become(HARNESS_UID, True), home, secret)
    yield modes
    for folder in made:
        shutil.rmtree(folder, ignore_errors=True)


def _harness(callers, mode: str, args: list[str], env: dict | None = None, timeout: float = 300):
    """Run ``python args`` as ``mode``'s harness, in the repository; the CompletedProcess."""
    if mode not in callers:
        pytest.skip(f"{mode}: needs a root test process to set the harness up")
    python, preexec, home, _ = callers[mode]
    env = {k: v for k, v in os.environ.items() if k != sandbox.OPT_IN_ENV} | dict(
        HOME=home, PYTHONDONTWRITEBYTECODE="1", **(env or {}))
    return subprocess.run([python, *args], cwd=REPO, env=env, preexec_fn=preexec, capture_output=True, text=True,
                          timeout=timeout)


CALLERS = ["root", "root, venv in a 0700 folder", "user"]


@pytest.mark.parametrize("mode", CALLERS)
def test_hostile_programs_are_refused_for_every_caller(callers, mode):
    """Each hostile program fails, and nothing of the harness user's leaks, is planted or is reached."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        server.setblocking(False)
        if mode not in callers:
            pytest.skip(f"{mode}: needs a root test process to set the harness up")
        _, _, home, secret = callers[mode]
        done = _harness(callers, mode, ["-c", PROBE, home, secret, str(server.getsockname()[1]),
                                        json.dumps(HOSTILE)])
        assert done.returncode == 0, done.stderr[-2000:]
        out = json.loads(done.stdout)
        connected = True
        try:
            server.accept()[0].close()
        except BlockingIOError:
            connected = False
    with open(secret) as f:
        token = f.read()
    assert out["uid"] == (0 if mode.startswith("root") else HARNESS_UID)
    assert "refused" not in out and out["features"]["containment"], out
    wrong = {}
    for name, run in out["runs"].items():
        if name == "ordinary":
            continue
        if run["status"] == "ok" or token in run["stdout"] + run["stderr"] or not run["contained"]:
            wrong[name] = (run["status"], run["stdout"][-200:], run["stderr"][-300:])
    print(f"\n{mode}: uid {out['uid']}, {out['features']}; "
          + "; ".join(f"{n}: {r['status']} ({(r['stderr'].strip().splitlines() or [''])[-1][:60]})"
                      for n, r in out["runs"].items()))
    assert wrong == {}
    assert not os.path.exists(os.path.join(home, "planted")) and not connected
    assert (out["runs"]["ordinary"]["status"], out["runs"]["ordinary"]["stdout"]) == ("ok", "45\n")


# the hostile suite and the isolation test (a bomber beside correct programs, 0 mis-scored), as each caller
SUITES = ["tests/test_sandbox_hostile.py::test_hostile_programs_are_contained_and_fail",
          "tests/test_sandbox_isolation.py::test_a_fork_bomb_beside_a_forking_program_costs_it_nothing[pid-namespace]",
          "tests/test_sandbox_isolation.py::test_check_many_with_a_bomb_in_one_worker[pid-namespace]"]


@pytest.mark.parametrize("mode", CALLERS[1:])  # the root harness in place runs those files itself
def test_the_hostile_suite_and_the_isolation_test_pass_for_every_caller(callers, mode):
    done = _harness(callers, mode, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *SUITES],
                    env={"TRACELOCK_BOMBS": "5"})
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    print(f"\n{mode}: {summary}")
    assert done.returncode == 0 and summary.startswith(f"{len(SUITES)} passed") and "skipped" not in summary, \
        done.stdout[-3000:] + done.stderr[-2000:]


def test_uncontained_code_runs_only_on_the_opt_in(callers):
    """Where the kernel refuses containment, generated code is refused with the reason and both ways to opt in; with
    the opt-in it runs, and its results and the run's record say it ran uncontained."""
    mode = "user, namespaces refused"
    if mode not in callers:
        pytest.skip(f"{mode}: needs a root test process to set the harness up")
    _, _, home, secret = callers[mode]
    check = ("import json\nfrom tracelock import sandbox\n"
             "try:\n    r = sandbox.run_python('print(6 * 7)')\n"
             "    print(json.dumps([r.status, r.stdout, r.contained, sandbox.sandbox_record()]))\n"
             "except sandbox.ContainmentUnavailable as err:\n    print(json.dumps(['refused', str(err)]))\n")
    refused = json.loads(_harness(callers, mode, ["-c", check]).stdout)
    assert refused[0] == "refused" and "user namespaces" in refused[1], refused
    assert sandbox.OPT_IN_FLAG in refused[1] and f"{sandbox.OPT_IN_ENV}=1" in refused[1], refused
    status, stdout, contained, record = json.loads(_harness(callers, mode, ["-c", check],
                                                            env={sandbox.OPT_IN_ENV: "1"}).stdout)
    assert (status, stdout, contained) == ("ok", "42\n", False)
    assert record["contained"] is False and record["opt_in"] is True, record
    bad = _harness(callers, mode, ["-c", check], env={sandbox.OPT_IN_ENV: "yes"})
    assert bad.returncode == 1 and f"ValueError: {sandbox.OPT_IN_ENV}='yes': set it to 1" in bad.stderr, bad.stderr


def test_eval_refuses_uncontained_code_before_decoding_and_records_the_opt_in(callers):
    """The command line: refused in one line naming both opt-ins, before anything is written; with the flag the run
    goes ahead and its manifest, summary and every code item's record say the code ran uncontained."""
    mode = "user, namespaces refused"
    if mode not in callers:
        pytest.skip(f"{mode}: needs a root test process to set the harness up")
    out = os.path.join(tempfile.mkdtemp(prefix="tracelock-callers-out-"), "run")
    os.chown(os.path.dirname(out), HARNESS_UID, HARNESS_UID)
    try:
        command = ["-m", "tracelock", "eval", "--model", "testbed", "--tasks", "testbed:code", "--policies",
                   "threshold:tau=0.9", "--settings", "16/8", "--limit", "2", "--workers", "1", "--out", out,
                   "--quiet"]
        refused = _harness(callers, mode, command)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert refused.stderr.startswith("tracelock eval: error: generated code cannot be contained here")
        assert sandbox.OPT_IN_FLAG in refused.stderr and sandbox.OPT_IN_ENV in refused.stderr
        assert not os.path.exists(out)
        done = _harness(callers, mode, command + [sandbox.OPT_IN_FLAG])
        assert done.returncode == 0, done.stderr
        with open(os.path.join(out, "manifest.json")) as f:
            assert json.load(f)["sandbox"]["opt_in"] is True
        with open(os.path.join(out, "summary.json")) as f:
            assert json.load(f)["sandbox"]["contained"] is False
        records = [json.loads(line) for at, _, files in os.walk(out) for name in files if name.startswith("items-")
                   for line in open(os.path.join(at, name))]
        assert len(records) == 2 and all(r["uncontained_code"] is True for r in records), records
    finally:
        shutil.rmtree(os.path.dirname(out), ignore_errors=True)
