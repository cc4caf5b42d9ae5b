"""The code sandbox (verl_prm.code.sandbox): limits, the bwrap and basic modes and their probes, hostile programs,
world-writable directories and sockets, and the failure reason of every run. Needs bubblewrap (`bwrap`, which
.ci/run installs) and root for the uid checks; a missing bwrap is simulated."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from sandbox_support import sandbox_processes

import verl_prm
from verl_prm.code.data import humaneval_task
from verl_prm.code import sandbox_setup
from verl_prm.code.sandbox import isolation, run_many, run_program
from verl_prm.code.sandbox_config import REASONS, SandboxConfig
from verl_prm.code.verifier import CodeTask, verify_many

REPO = Path(__file__).resolve().parents[2]
SUBSET = [0, 16, 32, 48, 64, 80, 96, 112, 128, 144]  # HumanEval problems the sandbox runs
# Small limits: the hostile programs below must not hurt a shared 2-core machine.
HOSTILE = SandboxConfig(timeout_s=2.0, cpu_s=1, memory_mb=256, max_output_bytes=4096, nproc=8, file_mb=4)


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system
        shutil.copy2(source, target)


@pytest.fixture(scope="module")
def tmp_pythons():
    """Interpreters under /tmp (where CI may put its clone and its venv), which the sandbox masks:

    * ``readable``: a copy of this Python's installation (binary + standard library, hard links where possible)
      that other uids can read;
    * ``closed``: the same reached through a directory other uids cannot traverse (0700), as a pyenv Python under
      ``/root`` is: the run's unprivileged uid could not import its standard library without the binds;
    * ``venv``: a ``venv --system-site-packages`` with a module in its own site-packages and a ``.pth`` that adds
      another directory under /tmp (an editable install);
    * ``tmp_on_path``: a venv whose ``.pth`` puts ``/tmp`` itself on ``sys.path``."""
    root = Path(tempfile.mkdtemp(prefix="verl_prm_sandbox_pythons_", dir="/tmp"))
    root.chmod(0o755)
    try:
        base = os.path.realpath(sys.executable)  # the installation's binary (a venv's python links to it)
        version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
        tree = root / "readable"
        (tree / "bin").mkdir(parents=True)
        _link_or_copy(base, str(tree / "bin" / version))
        skip = shutil.ignore_patterns("site-packages", "dist-packages", "test", "tests", "idlelib", "tkinter",
                                      "turtledemo", "ensurepip", "lib2to3", "config-*")
        shutil.copytree(sysconfig.get_path("stdlib"), tree / "lib" / version, symlinks=True,
                        copy_function=_link_or_copy, ignore=skip)
        (root / "closed").mkdir(mode=0o700)
        (root / "closed" / "py").symlink_to(tree)
        venvs, purelibs = {}, {}
        for name in ("venv", "tmp_on_path"):
            subprocess.run([base, "-m", "venv", "--without-pip", "--system-site-packages", str(root / name)], check=True)
            venvs[name] = root / name / "bin" / "python"
            query = "import sysconfig; print(sysconfig.get_path('purelib'))"
            purelib = subprocess.run([str(venvs[name]), "-I", "-c", query], capture_output=True, text=True,
                                     check=True).stdout.strip()
            purelibs[name] = purelib
            if name == "venv":
                Path(purelib, "sandbox_probe_pkg.py").write_text("VALUE = 42\n")
                (root / "editable").mkdir()
                (root / "editable" / "sandbox_probe_editable.py").write_text("VALUE = 7\n")
                Path(purelib, "sandbox_probe_editable.pth").write_text(f"{root / 'editable'}\n")
            else:
                Path(purelib, "sandbox_probe_tmp.pth").write_text("/tmp\n")
        yield SimpleNamespace(root=root, readable=str(tree / "bin" / version),
                              closed=str(root / "closed" / "py" / "bin" / version), venv=str(venvs["venv"]),
                              venv_purelib=purelibs["venv"],
                              tmp_on_path=str(venvs["tmp_on_path"]))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def readable_by_other_uids(path: str) -> bool:
    """``path`` lists as uid 65534 (nobody): an independent check of what an unprivileged uid can read."""
    return subprocess.run(["ls", path], user=65534, group=65534, extra_groups=[], capture_output=True).returncode == 0


# ---------------------------------------------------------------------------------------------- sandbox


def test_bwrap_is_the_default_and_basic_mode_says_at_start_that_it_isolates_little(caplog):
    assert SandboxConfig().mode == "bwrap"
    iso = isolation()
    assert iso.mode == "bwrap" and iso.network.startswith("network namespace")
    assert "private tmpfs over /tmp" in iso.filesystem
    basic = SandboxConfig(timeout_s=10, cpu_s=2, memory_mb=300, mode="basic")  # limits of its own: a fresh probe
    with caplog.at_level(logging.WARNING, logger="verl_prm.code.sandbox"):
        assert isolation(basic).mode == "basic"
    assert any("SandboxConfig(mode='basic') runs programs WITHOUT isolation" in r.getMessage() for r in caplog.records)
    for bad in ("auto", "full", "user", ""):
        with pytest.raises(ValueError, match=re.escape(f"SandboxConfig.mode must be 'bwrap' or 'basic', got {bad!r}")):
            SandboxConfig(mode=bad)


def test_a_missing_or_failing_bwrap_is_an_error_that_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox_setup, "_BWRAP", [])  # forget the bwrap found so far, for this test only
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on PATH
    config = SandboxConfig(timeout_s=5, cpu_s=3)
    message = ("SandboxConfig(mode='bwrap') needs bwrap, which is not installed: install bubblewrap (Debian/Ubuntu: "
               "apt-get install bubblewrap; Fedora/RHEL: dnf install bubblewrap; version 0.8.0 or newer); or ask for "
               "the weaker SandboxConfig(mode='basic')")
    for call in (lambda: isolation(config), lambda: run_program("print(1)\n", config),
                 lambda: verify_many([(CodeTask("t", "assert", "", "assert 1\n"), "")], config)):
        with pytest.raises(RuntimeError, match=re.escape(message)):
            call()
    monkeypatch.undo()
    # a bwrap that cannot create namespaces (a container without them): the probe fails, an error with bwrap's word
    monkeypatch.setattr(sandbox_setup, "_BWRAP", [])
    fake = tmp_path / "bwrap"
    fake.write_text('#!/bin/sh\n[ "$1" = --help ] && { echo "--size BYTES"; exit 0; }\n'
                    'echo "bwrap: Creating new namespace failed: Operation not permitted" >&2\nexit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with pytest.raises(RuntimeError, match=re.escape(
            "cannot run Python here: the probe program ended with sandbox_error: the boot script ended (exit status "
            "1) before starting the program: bwrap: Creating new namespace failed: Operation not permitted; bwrap "
            "needs namespaces")):
        isolation(config)
    # basic mode needs no bwrap
    assert run_program("print(1)\n", dataclasses.replace(config, mode="basic")).stdout == "1\n"


def test_hostile_programs_are_contained_and_scored_with_their_reason(tmp_path, monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("VERL_PRM_TEST_SECRET", secret)
    host_probe = f"/tmp/verl_prm_sandbox_probe_{uuid.uuid4().hex}"
    closed_dir = Path(verl_prm.__file__).parent  # root-owned, 0755: not writable by the sandbox uid
    if any(str(closed_dir).startswith(d + "/") for d in ("/tmp", "/var/tmp", "/dev/shm")):
        closed_dir = Path("/")  # a clone under /tmp is masked by the sandbox (the write would find no directory)
    outside = closed_dir / f"sandbox_probe_{uuid.uuid4().hex}"
    programs = {
        # name: (source, expected reason under bwrap, expected reason in basic mode)
        "passes": ("print('ok')\nassert sum(range(4)) == 6\n", "passed", "passed"),
        "syntax": ("def f(:\n    return 1\n", "syntax_error", "syntax_error"),
        "indentation": ("def f():\nreturn 1\n", "syntax_error", "syntax_error"),
        "assertion": ("assert 1 + 1 == 3, 'wrong'\n", "assertion_failed", "assertion_failed"),
        "runtime": ("[][1]\n", "runtime_error", "runtime_error"),
        "sleep": ("import time\ntime.sleep(60)\n", "timeout", "timeout"),
        "fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
                      "timeout", "timeout"),
        "huge_allocation": ("x = bytearray(8 * 1024 ** 3)\n", "memory", "memory"),
        "socket": ("import socket\nsocket.create_connection(('10.255.255.1', 80), timeout=1)\n",
                   "network_blocked", "network_blocked"),
        # a child process has no audit hook: the network namespace is what stops it (basic mode: nothing does, and
        # the connection waits out its 0.2 s timeout: short, so a loaded machine keeps it within the wall limit)
        "subprocess_network": ("import subprocess, sys\nr = subprocess.run([sys.executable, '-S', '-c', 'import socket; "
                               "socket.create_connection((\"10.255.255.1\", 80), timeout=0.2)'], capture_output=True, "
                               "text=True)\nprint(r.returncode, (r.stderr.strip().splitlines() or [''])[-1])\n", "passed", "passed"),
        "write_outside": (f"open({str(outside)!r}, 'w').write('x')\n", "permission_denied", "passed"),
        "write_tmp": (f"open({host_probe!r}, 'w').write('x')\nprint(open({host_probe!r}).read())\n",
                      "passed", "passed"),
        "env_secret": ("import os\nprint(sorted(os.environ))\nassert 'VERL_PRM_TEST_SECRET' not in os.environ\n",
                       "passed", "passed"),
        # the caller's process is not in the run's /proc (its own PID namespace)
        "parent_environ": (f"print(open('/proc/{os.getpid()}/environ').read())\n", "runtime_error", "passed"),
        "processes": ("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n", "passed",
                      "passed"),
        "sys_exit": ("import sys\nsys.exit(0)\nassert False\n", "early_exit", "early_exit"),
        "os_exit": ("import os\nos._exit(0)\n", "early_exit", "early_exit"),
        "self_kill": ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", "killed", "killed"),
        "output_flood": ("import sys\nfor _ in range(2000):\n    sys.stdout.write('x' * 1000)\n", "passed", "passed"),
        "daemon": ("import os, time\npid = os.fork()\nif pid == 0:\n    os.setsid()\n    time.sleep(60)\n"
                   "    os._exit(0)\nprint(pid)\n", "passed", "passed"),
    }
    names = list(programs)
    try:
        for mode, column in (("bwrap", 1), ("basic", 2)):
            config = dataclasses.replace(HOSTILE, mode=mode)
            started = time.perf_counter()
            # basic mode does not confine a fork bomb (no namespaces; RLIMIT_NPROC does not bind root): beside it the
            # other programs starve past their 2 s limit on a loaded 2-core machine, so there it runs alone, after
            together = [n for n in names if mode == "bwrap" or n != "fork_bomb"]
            results = dict(zip(together, run_many([programs[n][0] for n in together], config, max_workers=4)))
            results.update({n: run_program(programs[n][0], config) for n in names if n not in together})
            elapsed = time.perf_counter() - started
            for name in names:
                result = results[name]
                assert result.reason in REASONS
                assert (result.reason, result.isolation) == (programs[name][column], mode), (name, result)
            assert "wall-clock" in results["sleep"].detail
            assert "sandbox: network access is blocked" in results["socket"].detail
            assert results["assertion"].detail == "AssertionError: wrong"
            assert results["passes"].stdout == "ok\n"
            # nothing of the caller's environment reaches the program
            environment = results["env_secret"].stdout
            assert "VERL_PRM_TEST_SECRET" not in environment and secret not in environment
            # output is capped, the rest discarded
            flood = results["output_flood"]
            assert flood.stdout_truncated and len(flood.stdout) == HOSTILE.max_output_bytes
            # the limits bound every hostile run: 4 at a time, each within its deadline plus clean-up
            walls = {n: r.wall_s for n, r in results.items()}
            assert max(walls.values()) < config.timeout_s + 3.0, walls
            assert elapsed < 60
            if mode == "basic":  # what follows holds under bwrap only
                continue
            assert results["subprocess_network"].stdout.startswith("1 OSError: [Errno 101] Network is unreachable")
            assert results["parent_environ"].detail.startswith("FileNotFoundError: [Errno 2] No such file or directory")
            assert results["processes"].stdout == "[1, 2]\n"  # bwrap's init and the program: no host process
            assert not outside.exists()
            assert not os.path.exists(host_probe)  # the write went to the run's private tmpfs
            assert results["write_tmp"].stdout == "x\n"
            # the daemon left the process group and the session: it ended with the run's PID namespace
            assert sandbox_processes() == []
    finally:  # basic mode writes both; a failed assertion must not leave them behind
        outside.unlink(missing_ok=True)
        Path(host_probe).unlink(missing_ok=True)

    # the CPU limit: alone, with a wall-clock limit it cannot reach first even on a loaded machine
    (cpu_loop,) = run_many(["while True:\n    pass\n"], dataclasses.replace(HOSTILE, timeout_s=60.0), max_workers=1)
    assert cpu_loop.reason == "timeout" and "CPU" in cpu_loop.detail, cpu_loop


def test_machine_is_fine_after_a_fork_bomb():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = run_program(bomb, HOSTILE)
    assert result.reason == "timeout"
    assert sandbox_processes() == []  # no process of any run survives it
    after = run_program("import os\npid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)\nprint('forked')\n",
                        HOSTILE)
    assert after.reason == "passed" and after.stdout == "forked\n"  # the next run can still fork
    # RLIMIT_NPROC counts the run's own processes: nproc=2 lets the program fork once, not twice
    twice = ("import os\npids = []\nfor _ in range(2):\n    try:\n        pids.append(os.fork())\n    except OSError as e:\n"
             "        print('refused', e.errno)\n        break\n    if pids[-1] == 0:\n        os._exit(0)\n"
             "print(len(pids))\n")
    capped = run_program(twice, dataclasses.replace(HOSTILE, nproc=2))
    assert (capped.reason, capped.stdout) == ("passed", "refused 11\n1\n"), capped


def test_basic_mode_also_contains_a_timeout_and_reports_reasons():
    basic = SandboxConfig(timeout_s=1.5, cpu_s=1, memory_mb=256, nproc=8, mode="basic")
    loop, ok, net = run_many(["while True: pass\n", "print(1)\n",
                              "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"], basic, max_workers=3)
    assert (loop.reason, ok.reason, net.reason) == ("timeout", "passed", "network_blocked")
    assert ok.isolation == "basic"


@pytest.mark.skipif(os.geteuid() != 0, reason="the run's own uid: root only")
def test_an_interpreter_behind_a_closed_directory_runs_as_the_runs_uid(tmp_pythons, humaneval):
    # HumanEval prompts import typing etc. lazily: with an unreadable installation each correct solution scored 0
    pairs = [(humaneval_task(humaneval[i]), humaneval[i]["canonical_solution"]) for i in SUBSET[:4]]
    assert not readable_by_other_uids(os.path.dirname(tmp_pythons.closed))  # the reproduction holds
    closed = SandboxConfig(timeout_s=10, python=tmp_pythons.closed)
    verdicts = verify_many(pairs, closed, max_workers=2)
    assert [v.reason for v in verdicts] == ["passed"] * len(pairs), [(v.task_id, v.detail) for v in verdicts]
    assert verdicts[0].run.isolation == "bwrap"
    whoami = run_program("import heapq, os\nprint(os.getuid(), os.getgid(), os.getgroups())\n", closed)
    uid, gid, groups = whoami.stdout.split(maxsplit=2)
    assert int(uid) >= 200_000 and gid == uid and groups == "[]\n", whoami


def test_an_interpreter_and_its_site_packages_under_tmp_stay_visible_read_only(tmp_pythons):
    root = tmp_pythons.root
    program = f"""import errno, os, subprocess, sys
import sandbox_probe_pkg, sandbox_probe_editable
print(sandbox_probe_pkg.VALUE, sandbox_probe_editable.VALUE, sys.executable)
child = subprocess.run([sys.executable, '-c', 'import sandbox_probe_pkg; print(sandbox_probe_pkg.VALUE)'],
                       capture_output=True, text=True)
print(child.returncode, child.stdout.strip())
net = subprocess.run([sys.executable, '-S', '-c', 'import socket; socket.create_connection(("10.255.255.1", 80), timeout=1)'],
                     capture_output=True, text=True)
print(net.returncode, net.stderr.strip().splitlines()[-1])
print(sorted(os.listdir({str(root)!r})))
options = {{line.split()[4]: line.split()[5].split(',') for line in open('/proc/self/mountinfo')}}
print(options[{str(root / 'venv')!r}][0], options[{str(root / 'editable')!r}][0])
try:
    open(os.path.join(os.path.dirname(sandbox_probe_pkg.__file__), 'planted.py'), 'w')
except OSError as error:
    print(errno.errorcode[error.errno])
"""
    venv = SandboxConfig(timeout_s=10, cpu_s=5, memory_mb=512, nproc=8, python=tmp_pythons.venv, site_packages=True)
    result = run_program(program, venv)
    assert result.reason == "passed", result
    assert result.stdout.splitlines() == [
        f"42 7 {tmp_pythons.venv}",
        "0 42",  # a child sys.executable finds the venv's site-packages too
        "1 OSError: [Errno 101] Network is unreachable",
        "['editable', 'venv']",  # only the interpreter's paths: the rest of the host's /tmp stays hidden
        "ro ro",
        "EROFS",
    ]
    assert not Path(tmp_pythons.venv_purelib, "planted.py").exists()
    # without site_packages: the standard library only, and the venv's site-packages are not shown
    listing = run_program(f"import os\nprint(sorted(os.listdir({str(root / 'venv')!r})))\nimport sandbox_probe_pkg\n",
                          dataclasses.replace(venv, site_packages=False))
    assert (listing.reason, listing.stdout) == ("runtime_error", "['bin']\n")
    assert listing.detail == "ModuleNotFoundError: No module named 'sandbox_probe_pkg'"
    # a path that cannot be shown without undoing the private /tmp is refused at setup
    with pytest.raises(ValueError, match=r"the interpreter needs /tmp, which the sandbox cannot show read-only without "
                                         r"undoing its private /tmp"):
        isolation(dataclasses.replace(venv, python=tmp_pythons.tmp_on_path))


def test_no_new_privs_stops_setuid_binaries():
    status = ("import subprocess\nown = open('/proc/self/status').read().split('NoNewPrivs:')[1].split()[0]\n"
              "child = subprocess.run(['grep', 'NoNewPrivs', '/proc/self/status'], capture_output=True, text=True)\n"
              "print(own, child.stdout.split()[1])\n")
    for mode in ("bwrap", "basic"):
        result = run_program(status, dataclasses.replace(HOSTILE, mode=mode))
        assert (result.reason, result.stdout) == ("passed", "1 1\n"), (mode, result)
    if os.geteuid() != 0:
        pytest.skip("a setuid binary raises privileges only for another uid: needs the run's own uid (root)")
    # a setuid-root copy of `id` where the sandbox can see it: outside the masked directories (a clone may be under
    # /tmp: then in a directory of its own under /, removed afterwards), on a file system without nosuid
    masked = ("/tmp/", "/var/tmp/", "/dev/shm/")
    home = Path(tempfile.mkdtemp(prefix=".sandbox_setuid_probe_", dir="/" if str(REPO).startswith(masked) else REPO))
    try:
        home.chmod(0o755)
        if os.statvfs(home).f_flag & os.ST_NOSUID or not readable_by_other_uids(str(home)):
            pytest.skip(f"{home} is mounted nosuid or closed to other uids")
        setuid_id = home / "id"
        shutil.copy2(shutil.which("id"), setuid_id)
        setuid_id.chmod(0o4755)
        control = subprocess.run([str(setuid_id), "-u"], user=65534, group=65534, extra_groups=[], capture_output=True,
                                 text=True)
        assert control.stdout == "0\n"  # without no_new_privs the binary runs as root
        result = run_program(f"import os, subprocess\nprint(os.getuid(), subprocess.run([{str(setuid_id)!r}, '-u'], "
                             f"capture_output=True, text=True).stdout.strip())\n", HOSTILE)
        uid, euid = result.stdout.split()
        assert result.reason == "passed" and int(uid) >= 200_000 and euid == uid, result
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_parallel_runs_keep_input_order_and_match_sequential_runs():
    sources = [f"assert {i} % 3 != 0\nprint({i})\n" for i in range(12)]
    parallel = run_many(sources, HOSTILE, max_workers=3)
    sequential = [run_program(s, HOSTILE) for s in sources[:4]]
    assert [r.reason for r in parallel] == ["assertion_failed" if i % 3 == 0 else "passed" for i in range(12)]
    assert [r.stdout for r in parallel if r.passed] == [f"{i}\n" for i in range(12) if i % 3]
    assert [r.reason for r in parallel[:4]] == [r.reason for r in sequential]
    assert sandbox_processes() == []


def _outside_the_masks(prefix: str) -> Path:
    """A new 0755 directory the sandbox does not mask: in the clone, or under / where the clone is in a masked
    directory (CI may clone under /tmp); removed by the caller."""
    from verl_prm.code.sandbox_setup import mask_dirs

    parent = "/" if any(str(REPO) == d or str(REPO).startswith(d + "/") for d in mask_dirs()) else str(REPO)
    directory = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    directory.chmod(0o755)
    return directory


def host_world_writable_dirs() -> list[str]:
    """The host's world-writable directories an unprivileged uid can reach, enumerated now with find(1) (not with
    the sandbox's own scan): every o+w directory outside /proc and /sys whose ancestors all have o+x."""
    found = subprocess.run(["find", "/", "(", "-path", "/proc", "-o", "-path", "/sys", ")", "-prune", "-o", "-type",
                            "d", "-perm", "-0002", "-print", "-prune"], capture_output=True, text=True).stdout.split()

    def reachable(path: str) -> bool:
        parents = [str(p) for p in Path(path).parents]
        return all(os.stat(p).st_mode & 0o001 for p in parents)

    return sorted(p for p in found if reachable(p))


def test_every_world_writable_directory_of_the_host_is_private():
    dirs = host_world_writable_dirs()
    assert "/tmp" in dirs  # the enumeration works
    later = _outside_the_masks(".sandbox_ww_probe_")  # world-writable, but created after the sandbox's scan
    try:
        isolation()  # the scan has run in this process
        later.chmod(0o777)
        name = f"verl_prm_probe_{uuid.uuid4().hex}"
        program = f"""import errno
mounts = {{line.split()[4]: line.split(' - ')[1].split()[0] for line in open('/proc/self/mountinfo')}}
for d in {dirs!r}:
    with open(d + '/{name}', 'wb') as f:
        f.write(b'x' * (3 << 20))  # 3 MiB, as in the report (/run/lock)
    print(d, mounts.get(d))
try:
    open({str(later)!r} + '/{name}', 'w')
except OSError as error:
    print('later', errno.errorcode[error.errno])
"""
        result = run_program(program, HOSTILE)
        assert result.reason == "passed", result
        assert result.stdout.splitlines() == [f"{d} tmpfs" for d in dirs] + ["later EROFS"]
        left = [d for d in dirs + [str(later)] if os.path.exists(f"{d}/{name}")]
        assert left == []  # nothing reached the host
    finally:
        shutil.rmtree(later, ignore_errors=True)


def test_no_host_unix_socket_is_reachable():
    import socket
    import threading

    home = _outside_the_masks(".sandbox_socket_probe_")
    path = str(home / "listener.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    received = []
    try:
        listener.bind(path)
        os.chmod(path, 0o777)
        listener.listen(8)
        listener.settimeout(0.2)
        stop = threading.Event()

        def serve():
            while not stop.is_set():
                try:
                    connection, _ = listener.accept()
                except OSError:
                    continue
                with connection:
                    received.append(connection.recv(100))

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        pid = os.fork()
        if pid == 0:  # another uid (nobody) outside the sandbox reaches the listener
            try:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                with socket.socket(socket.AF_UNIX) as control:
                    control.connect(path)
                    control.send(b"control")
                os._exit(0)
            except BaseException:
                os._exit(1)
        assert os.waitpid(pid, 0)[1] == 0
        direct = f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({path!r})\ns.send(b'direct')\n"
        child = (f"import subprocess, sys\nr = subprocess.run([sys.executable, '-S', '-c', {direct!r}], "
                 f"capture_output=True, text=True)\nprint(r.stderr.strip().splitlines()[-1])\n")
        raw = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               "print(libc.socket(1, 1, 0), ctypes.get_errno())\n")
        pair = "import socket\na, b = socket.socketpair()\na.send(b'ok')\nprint(b.recv(2))\n"
        results = run_many([direct, child, raw, pair], HOSTILE, max_workers=2)
        stop.set()
        thread.join(timeout=5)
    finally:
        listener.close()
        shutil.rmtree(home, ignore_errors=True)
    assert [r.reason for r in results] == ["network_blocked", "passed", "passed", "passed"], results
    assert results[0].detail == "OSError: [Errno 97] Address family not supported by protocol"
    assert results[1].stdout == "OSError: [Errno 97] Address family not supported by protocol\n"  # no audit hook
    assert results[2].stdout == "-1 97\n"  # the raw system call: seccomp, not the audit hook
    assert results[3].stdout == "b'ok'\n"  # a socketpair reaches nothing outside and still works
    assert received == [b"control"]


def test_sandbox_config_checks_every_field():
    cases = {
        "max_files": (3, "SandboxConfig.max_files must be a whole number in [16, 2147483647] (file descriptors"),
        "file_mb": (0, "SandboxConfig.file_mb must be a whole number in [1, 2147483647] (MiB"),
        "cpu_s": (0, "SandboxConfig.cpu_s must be a whole number in [1, 2147483647]"),
        "memory_mb": (32, "SandboxConfig.memory_mb must be a whole number in [64, 2147483647]"),
        "nproc": (0, "SandboxConfig.nproc must be a whole number in [1, 2147483647]"),
        "max_output_bytes": (-1, "SandboxConfig.max_output_bytes must be a whole number in [0, 2147483647]"),
    }
    for name, (value, message) in cases.items():
        for bad in (value, True, 2.0, float("nan"), "8", None, 2**31):
            with pytest.raises(ValueError, match=re.escape(message.split(" (")[0])):
                SandboxConfig(**{name: bad})
        with pytest.raises(ValueError) as error:
            SandboxConfig(**{name: value})
        assert str(error.value).startswith(message) and str(error.value).endswith(f"got {value}")
    for bad in (True, "10", None, float("-inf")):
        with pytest.raises(ValueError, match="SandboxConfig.timeout_s must be a finite number of seconds > 0"):
            SandboxConfig(timeout_s=bad)
    with pytest.raises(ValueError, match="SandboxConfig.site_packages must be True or False, got 1"):
        SandboxConfig(site_packages=1)
    with pytest.raises(ValueError, match="SandboxConfig.python must be the path of an interpreter, got ''"):
        SandboxConfig(python="")
    assert SandboxConfig(timeout_s=5, max_files=16, file_mb=1, memory_mb=64, nproc=1, max_output_bytes=0).timeout_s == 5


def test_the_startup_probe_runs_under_the_configured_limits_and_names_the_limit_too_small(tmp_path):
    # A launcher that holds descriptors 3..40 open (all but the status pipe and the program's) before it starts
    # Python: the probe passes with the default max_files and fails with 16, which passes SandboxConfig's own check.
    launcher = tmp_path / "python-launcher"
    launcher.write_text(f"""#!/bin/bash
status=-1 source=-1
[[ "${{@: -1}}" =~ \\"status_fd\\":\\ ([0-9]+) ]] && status=${{BASH_REMATCH[1]}}
[[ "${{@: -1}}" =~ \\"source_fd\\":\\ ([0-9]+) ]] && source=${{BASH_REMATCH[1]}}
for fd in $(seq 3 40); do [[ $fd == "$status" || $fd == "$source" ]] || eval "exec $fd</dev/null"; done
exec {sys.executable} "$@"
""")
    launcher.chmod(0o755)
    level = isolation().mode
    assert run_program("print('ok')\n", SandboxConfig(timeout_s=10, python=str(launcher))).stdout == "ok\n"
    tight = SandboxConfig(timeout_s=10, max_files=16, python=str(launcher))
    expected = (f"SandboxConfig(max_files=16) is too small to start {launcher} in {level} isolation: the start-up "
                f"probe ended with sandbox_error: OSError: [Errno 24] Too many open files")
    with pytest.raises(ValueError) as error:
        isolation(tight)
    assert str(error.value).startswith(expected), error.value
    assert str(error.value).endswith("and passes with max_files=256 (the default); raise max_files")
    with pytest.raises(ValueError, match=re.escape(expected)):  # at start-up, never a 0 for a correct program
        task = CodeTask(task_id="t", kind="assert", prompt="def f():\n", tests="assert f() == 1\n")
        verify_many([(task, "    return 1\n")], tight, max_workers=1)
    assert run_program("print('ok')\n", dataclasses.replace(tight, max_files=64)).stdout == "ok\n"
