"""Process rewards for code: the sandbox against hostile programs, the unit-test verifier on real HumanEval
problems, parallel runs, code step rules and their step_ids, HumanEval/MBPP rows, the verl reward function,
Monte-Carlo labels and search with the verifier, and the code launcher's Hydra composition."""

from __future__ import annotations

import dataclasses
import json
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
import torch

import verl_prm
from verl_prm.code.data import (
    humaneval_rows,
    humaneval_task,
    mbpp_rows,
    read_humaneval,
    read_jsonl,
    write_parquet,
)
from verl_prm.code.sandbox import _processes_of, isolation, run_many, run_program
from verl_prm.code.sandbox_config import REASONS, SandboxConfig
from verl_prm.steps.code import (
    ast_block_starts,
    block_regex,
    code_split_steps,
    code_step_char_spans,
)
from verl_prm.code.verifier import CodeTask, build_program, extract_code, verify, verify_many
from verl_prm.code.verl_score import compute_score, compute_score_batch
from verl_prm.steps import split_steps, step_char_spans

REPO = Path(__file__).resolve().parents[2]
# Ten HumanEval problems spread over the set; the canonical solution of each passes and a mutant fails.
SUBSET = [0, 16, 32, 48, 64, 80, 96, 112, 128, 144]
# Small limits: the hostile programs below must not hurt a shared 2-core machine.
HOSTILE = SandboxConfig(timeout_s=2.0, cpu_s=1, memory_mb=256, max_output_bytes=4096, nproc=8, file_mb=4)
SWAPS = [(" < ", " >= "), (" > ", " <= "), (" == ", " != "), (" + ", " - "), (" - ", " + "), (" * ", " + ")]


def mutate(solution: str) -> str:
    """A wrong solution: the first operator swap that applies, else a body that returns None."""
    for old, new in SWAPS:
        if old in solution:
            return solution.replace(old, new, 1)
    return "    return None\n"


@pytest.fixture(scope="module")
def humaneval():
    return read_humaneval()


@pytest.fixture(scope="module")
def full_isolation() -> bool:
    return isolation().mode == "full"


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system
        shutil.copy2(source, target)


@pytest.fixture(scope="module")
def tmp_pythons():
    """Interpreters under /tmp (where CI may put its clone and its venv), which full isolation masks:

    * ``readable``: a copy of this Python's installation (binary + standard library, hard links where possible)
      that other uids can read;
    * ``closed``: the same reached through a directory other uids cannot traverse (0700), as a pyenv Python under
      ``/root`` is: an unprivileged uid cannot import its standard library;
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
    """``path`` lists as uid 65534 (nobody): an independent check of what the sandbox's user isolation needs."""
    return subprocess.run(["ls", path], user=65534, group=65534, extra_groups=[], capture_output=True).returncode == 0


def sandbox_processes() -> list[int]:
    """Pids of live processes whose real uid is in the sandbox's uid range (none may outlive a run)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                uid = int(fields["Uid"].split()[0])
                if uid >= 200_000 and fields["State"].split()[0] not in ("Z", "X"):
                    pids.append(int(entry))
            except (OSError, KeyError, ValueError):
                pass
    return pids


# ---------------------------------------------------------------------------------------------- sandbox


def test_isolation_mode_matches_the_machine():
    iso = isolation()
    can_unshare = os.geteuid() == 0 and shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--net", "--mount", "true"], capture_output=True).returncode == 0
    assert iso.mode == ("full" if can_unshare else "basic")
    assert iso.network == ("namespace+audit-hook" if can_unshare else "audit-hook")
    assert isolation(SandboxConfig(mode="basic")).mode == "basic"
    if os.geteuid() == 0 and readable_by_other_uids(sysconfig.get_path("stdlib")):
        assert isolation(SandboxConfig(mode="user")).mode == "user"
    elif os.geteuid() == 0:  # a pyenv Python under /root: user isolation cannot import its standard library
        with pytest.raises(RuntimeError, match="mode='user'.* cannot run Python here: user isolation: the probe program"):
            isolation(SandboxConfig(mode="user"))
    for bad in (float("nan"), float("inf"), 0.0):
        with pytest.raises(ValueError, match="SandboxConfig.timeout_s must be a finite number of seconds > 0"):
            SandboxConfig(timeout_s=bad)


def test_hostile_programs_are_contained_and_scored_with_their_reason(tmp_path, monkeypatch, full_isolation):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("VERL_PRM_TEST_SECRET", secret)
    host_probe = f"/tmp/verl_prm_sandbox_probe_{uuid.uuid4().hex}"
    closed_dir = Path(verl_prm.__file__).parent  # root-owned, 0755: not writable by the sandbox uid
    if any(str(closed_dir).startswith(d + "/") for d in ("/tmp", "/var/tmp", "/dev/shm")):
        closed_dir = Path("/")  # a clone under /tmp is masked in full isolation (the write would find no directory)
    outside = closed_dir / f"sandbox_probe_{uuid.uuid4().hex}"
    programs = {
        # name: (source, expected reason in full isolation, expected reason in basic isolation)
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
        # a child process has no audit hook: the network namespace is what stops it
        "subprocess_network": ("import subprocess, sys\nr = subprocess.run([sys.executable, '-S', '-c', 'import socket; "
                               "socket.create_connection((\"10.255.255.1\", 80), timeout=1)'], capture_output=True, "
                               "text=True)\nprint(r.returncode, r.stderr.strip().splitlines()[-1])\n", "passed", "passed"),
        "write_outside": (f"open({str(outside)!r}, 'w').write('x')\n", "permission_denied", "passed"),
        "write_tmp": (f"open({host_probe!r}, 'w').write('x')\nprint(open({host_probe!r}).read())\n",
                      "passed", "passed"),
        "env_secret": ("import os\nprint(sorted(os.environ))\nassert 'VERL_PRM_TEST_SECRET' not in os.environ\n",
                       "passed", "passed"),
        "parent_environ": (f"print(open('/proc/{os.getpid()}/environ').read())\n", "permission_denied", "passed"),
        "sys_exit": ("import sys\nsys.exit(0)\nassert False\n", "early_exit", "early_exit"),
        "os_exit": ("import os\nos._exit(0)\n", "early_exit", "early_exit"),
        "self_kill": ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", "killed", "killed"),
        "output_flood": ("import sys\nfor _ in range(2000):\n    sys.stdout.write('x' * 1000)\n", "passed", "passed"),
        "daemon": ("import os, time\npid = os.fork()\nif pid == 0:\n    os.setsid()\n    time.sleep(60)\n"
                   "    os._exit(0)\nprint(pid)\n", "passed", "passed"),
    }
    names = list(programs)
    started = time.perf_counter()
    results = dict(zip(names, run_many([programs[n][0] for n in names], HOSTILE, max_workers=4)))
    elapsed = time.perf_counter() - started
    column = 1 if full_isolation else 2
    for name in names:
        result = results[name]
        assert result.reason in REASONS
        assert result.reason == programs[name][column], (name, result)
    assert "wall-clock" in results["sleep"].detail
    # the CPU limit: alone, with a wall-clock limit it cannot reach first even on a loaded machine
    (cpu_loop,) = run_many(["while True:\n    pass\n"], dataclasses.replace(HOSTILE, timeout_s=60.0), max_workers=1)
    assert cpu_loop.reason == "timeout" and "CPU" in cpu_loop.detail, cpu_loop
    assert "sandbox: network access is blocked" in results["socket"].detail
    if full_isolation:
        assert results["subprocess_network"].stdout.startswith("1 OSError: [Errno 101] Network is unreachable")
    assert results["assertion"].detail == "AssertionError: wrong"
    assert results["passes"].stdout == "ok\n"
    # nothing of the caller's environment reaches the program
    assert "VERL_PRM_TEST_SECRET" not in results["env_secret"].stdout and secret not in results["env_secret"].stdout
    if full_isolation:  # another uid: the caller's /proc/<pid>/environ is closed (basic mode: the same uid)
        assert results["parent_environ"].stdout == "" and "Permission denied" in results["parent_environ"].detail
    # output is capped, the rest discarded
    flood = results["output_flood"]
    assert flood.stdout_truncated and len(flood.stdout) == HOSTILE.max_output_bytes
    if full_isolation:
        assert not outside.exists()
        assert not os.path.exists(host_probe)  # the write went to the run's private tmpfs
        assert results["write_tmp"].stdout == "x\n"
    else:
        outside.unlink(missing_ok=True)
        Path(host_probe).unlink(missing_ok=True)
    # the daemon left the process group: it was killed with the run anyway
    daemon_pid = int(results["daemon"].stdout.split()[0])
    time.sleep(0.2)
    if full_isolation:
        try:
            with open(f"/proc/{daemon_pid}/status") as f:
                state = next(line for line in f if line.startswith("State:")).split()[1]
            assert state in ("Z", "X")
        except FileNotFoundError:
            pass
    # the limits bound every hostile run: 4 at a time, each within its deadline plus clean-up
    assert max(r.wall_s for r in results.values()) < HOSTILE.timeout_s + 3.0, {n: r.wall_s for n, r in results.items()}
    assert elapsed < 60


def test_machine_is_fine_after_a_fork_bomb(full_isolation):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = run_program(bomb, HOSTILE)
    assert result.reason == "timeout"
    assert sandbox_processes() == []  # no process of any run survives it
    if full_isolation:
        assert _processes_of(200_000 + (os.getpid() % 100_000) * 64)[0] == []
    after = run_program("import os\npid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)\nprint('forked')\n",
                        HOSTILE)
    assert after.reason == "passed" and after.stdout == "forked\n"  # the next run can still fork


def test_basic_mode_also_contains_a_timeout_and_reports_reasons():
    basic = SandboxConfig(timeout_s=1.5, cpu_s=1, memory_mb=256, nproc=8, mode="basic")
    loop, ok, net = run_many(["while True: pass\n", "print(1)\n",
                              "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"], basic, max_workers=3)
    assert (loop.reason, ok.reason, net.reason) == ("timeout", "passed", "network_blocked")
    assert ok.isolation == "basic"


@pytest.mark.skipif(os.geteuid() != 0, reason="user isolation switches uid: root only")
def test_user_mode_switches_uid_and_kills_escaped_processes(tmp_pythons):
    # an interpreter other uids can read (this one may live under /root)
    user = SandboxConfig(timeout_s=2.0, cpu_s=1, memory_mb=256, nproc=8, mode="user", python=tmp_pythons.readable)
    if isolation(dataclasses.replace(user, mode="auto")).mode == "basic":
        pytest.skip("this machine cannot switch uids")
    outside = Path(verl_prm.__file__).parent / f"sandbox_probe_{uuid.uuid4().hex}"
    daemon = "import os, time\npid = os.fork()\nif pid == 0:\n    os.setsid()\n    time.sleep(60)\n    os._exit(0)\nprint(pid)\n"
    ids, write, escaped = run_many(["import os\nprint(os.getuid(), os.getcwd() == os.environ['HOME'])\n",
                                    f"open({str(outside)!r}, 'w').write('x')\n", daemon], user, max_workers=3)
    assert ids.isolation == "user" and ids.reason == "passed"
    uid, home_is_cwd = ids.stdout.split()
    assert int(uid) >= 200_000 and home_is_cwd == "True"
    assert write.reason == "permission_denied" and not outside.exists()
    assert escaped.reason == "passed" and sandbox_processes() == []


@pytest.mark.skipif(os.geteuid() != 0, reason="user isolation switches uid: root only")
def test_an_explicit_mode_is_probed_and_one_that_cannot_run_python_is_an_error(tmp_pythons, humaneval):
    # HumanEval prompts import typing etc. lazily: with an unreadable installation each correct solution scored 0
    pairs = [(humaneval_task(humaneval[i]), humaneval[i]["canonical_solution"]) for i in SUBSET[:4]]
    assert not readable_by_other_uids(os.path.dirname(tmp_pythons.closed))  # the reproduction holds
    if isolation(SandboxConfig(python=tmp_pythons.readable)).mode == "basic":
        pytest.skip("this machine cannot switch uids")
    closed_user = SandboxConfig(timeout_s=10, mode="user", python=tmp_pythons.closed)
    expected = (rf"SandboxConfig\(mode='user', python='{re.escape(tmp_pythons.closed)}', site_packages=False\) cannot "
                rf"run Python here: user isolation: the probe program ended with .*not readable by other uids: "
                rf"{re.escape(str(tmp_pythons.root / 'closed'))} has no o\+x bit.*use mode='full' or 'auto'")
    with pytest.raises(RuntimeError, match=expected):
        isolation(closed_user)
    with pytest.raises(RuntimeError, match=expected):  # an error, never a reward of 0
        verify_many(pairs, closed_user, max_workers=2)
    # "auto" probes too and takes the strongest level that runs Python; full isolation shows the closed tree
    auto = SandboxConfig(timeout_s=10, python=tmp_pythons.closed)
    verdicts = verify_many(pairs, auto, max_workers=2)
    assert [v.reason for v in verdicts] == ["passed"] * len(pairs), [(v.task_id, v.detail) for v in verdicts]
    assert verdicts[0].run.isolation == ("full" if isolation().mode == "full" else "basic")
    # a readable installation runs in user isolation, as the unprivileged uid
    readable_user = dataclasses.replace(closed_user, python=tmp_pythons.readable)
    assert isolation(readable_user).mode == "user"
    verdicts = verify_many(pairs, readable_user, max_workers=2)
    assert [v.reason for v in verdicts] == ["passed"] * len(pairs), [(v.task_id, v.detail) for v in verdicts]
    whoami = run_program("import heapq, os\nprint(os.getuid())\n", readable_user)
    assert whoami.isolation == "user" and int(whoami.stdout) >= 200_000


def test_an_interpreter_and_its_site_packages_under_tmp_stay_visible_read_only(tmp_pythons, full_isolation):
    if not full_isolation:
        pytest.skip("only full isolation masks /tmp")
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
    for mode in ("auto", "basic"):
        result = run_program(status, dataclasses.replace(HOSTILE, mode=mode))
        assert (result.reason, result.stdout) == ("passed", "1 1\n"), (mode, result)
    if os.geteuid() != 0 or isolation().mode != "full":
        pytest.skip("a setuid binary raises privileges only for another uid: needs full isolation as root")
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


def test_every_world_writable_directory_of_the_host_is_private_in_full_isolation(full_isolation):
    if not full_isolation:
        pytest.skip("only full isolation has a mount namespace")
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


def test_no_host_unix_socket_is_reachable_in_full_isolation(full_isolation):
    if not full_isolation:
        pytest.skip("only full isolation refuses Unix-domain sockets")
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
    # A launcher that holds descriptors 3..40 open (all but the status pipe) before it starts Python: the probe
    # passes with the default max_files and fails with 16, which passes SandboxConfig's own check.
    launcher = tmp_path / "python-launcher"
    launcher.write_text(f"""#!/bin/bash
status=-1
[[ "${{@: -1}}" =~ \\"status_fd\\":\\ ([0-9]+) ]] && status=${{BASH_REMATCH[1]}}
for fd in $(seq 3 40); do [[ $fd == "$status" ]] || eval "exec $fd</dev/null"; done
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


# ---------------------------------------------------------------------------------------------- verifier


def test_humaneval_canonical_solutions_pass_and_mutants_fail(humaneval):
    problems = [humaneval[i] for i in SUBSET]
    pairs = [(humaneval_task(p), p["canonical_solution"]) for p in problems]
    pairs += [(humaneval_task(p), mutate(p["canonical_solution"])) for p in problems]
    verdicts = verify_many(pairs, SandboxConfig(timeout_s=10), max_workers=2)
    good, bad = verdicts[: len(problems)], verdicts[len(problems):]
    assert [v.reason for v in good] == ["passed"] * len(problems), [(v.task_id, v.detail) for v in good]
    assert not any(v.passed for v in bad)
    assert {v.reason for v in bad} <= {"assertion_failed", "runtime_error"}
    assert [v.task_id for v in good] == [p["task_id"] for p in problems]


def test_build_program_for_a_body_a_full_function_and_a_fenced_chat_answer(humaneval):
    problem = humaneval[0]
    task = humaneval_task(problem)
    body = problem["canonical_solution"]
    function = "def has_close_elements(numbers, threshold):\n" + body
    chat = f"Here you go:\n```python\nfrom typing import List\n\n{function}```\nIt compares all pairs."
    assert extract_code(chat) == f"from typing import List\n\n{function}"
    assert build_program(task, body).startswith(problem["prompt"] + body)
    assert build_program(task, body).endswith("check(has_close_elements)\n")
    for completion in (body, function, chat):
        assert verify(task, completion).passed
    assert verify(task, chat.replace(" < threshold", " > threshold")).reason == "assertion_failed"
    with pytest.raises(ValueError, match="no tests"):
        CodeTask("t", "assert", "", "  ")


def test_verl_compute_score_signature_and_batch(humaneval):
    rows = humaneval_rows([humaneval[i] for i in SUBSET[:3]])
    truths = [row["reward_model"]["ground_truth"] for row in rows]
    solutions = [humaneval[i]["canonical_solution"] for i in SUBSET[:3]]
    wrong = [mutate(s) for s in solutions]
    single = [compute_score("openai_humaneval", s, g, {"index": 0}) for s, g in zip(solutions + wrong, truths * 2)]
    assert [r["score"] for r in single] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert all(r["acc"] == r["score"] for r in single) and single[0]["reason"] == "passed"
    assert compute_score("x", solutions[0], json.loads(truths[0]))["score"] == 1.0  # a dict ground truth
    batch = compute_score_batch(["openai_humaneval"] * 6, solutions + wrong, truths * 2, max_workers=2)
    assert batch == single
    assert compute_score("x", "    while True: pass\n", truths[0], None, timeout_s=1.0, cpu_s=1)["reason"] == "timeout"
    with pytest.raises(TypeError, match="unknown reward_kwargs"):
        compute_score("x", solutions[0], truths[0], None, timeout=3)
    with pytest.raises(ValueError, match="not JSON"):
        compute_score("x", solutions[0], "def f(): pass", None)


# ---------------------------------------------------------------------------------------------- data


def test_humaneval_rows_round_trip_through_parquet_and_the_label_reader(tmp_path, humaneval):
    from verl_prm.labeling.inputs import read_prompts

    assert len(humaneval) == 164
    path = write_parquet(humaneval_rows(humaneval[:5], "test"), tmp_path / "test.parquet")
    items = read_prompts(path)
    assert [item.extra_info["task_id"] for item in items] == [p["task_id"] for p in humaneval[:5]]
    assert items[0].prompt[0]["role"] == "user" and humaneval[0]["prompt"] in items[0].prompt[0]["content"]
    task = CodeTask.from_ground_truth(items[1].ground_truth)
    assert task == humaneval_task(humaneval[1])
    assert compute_score(items[1].data_source, items[1].extra_info["reference"], items[1].ground_truth)["score"] == 1.0


def test_humaneval_preparation_script_writes_a_seeded_split(tmp_path):
    script = REPO / "examples" / "code" / "prepare_humaneval.py"
    out = subprocess.run([sys.executable, str(script), "--local_save_dir", str(tmp_path), "--test_size", "20"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import pandas as pd

    train, test = pd.read_parquet(tmp_path / "train.parquet"), pd.read_parquet(tmp_path / "test.parquet")
    assert (len(train), len(test)) == (144, 20)
    ids = [e["task_id"] for e in train["extra_info"]] + [e["task_id"] for e in test["extra_info"]]
    assert len(set(ids)) == 164


def test_mbpp_rows_from_jsonl_are_scored_by_their_asserts(tmp_path):
    # Records in MBPP's layout (task_id, text, code, test_list, test_setup_code), as the hub serves them.
    records = [
        {"task_id": 901, "text": "Write a function to find the shared elements from the given two lists.",
         "code": "def similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b)))\n",
         "test_list": ["assert similar_elements((3, 4, 5, 6), (5, 7, 4, 10)) == (4, 5)",
                       "assert similar_elements((1, 2, 3, 4), (5, 4, 3, 7)) == (3, 4)"],
         "test_setup_code": ""},
        {"task_id": 902, "text": "Write a python function to identify non-prime numbers.",
         "code": "import math\ndef is_not_prime(n):\n    if n < 2:\n        return True\n"
                 "    for i in range(2, int(math.sqrt(n)) + 1):\n        if n % i == 0:\n            return True\n"
                 "    return False\n",
         "test_list": ["assert is_not_prime(2) == False", "assert is_not_prime(10) == True",
                       "assert is_not_prime(35) == True"],
         "test_setup_code": "import math"},
    ]
    jsonl = tmp_path / "mbpp.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = mbpp_rows(read_jsonl(jsonl), "test")
    tasks = [CodeTask.from_ground_truth(r["reward_model"]["ground_truth"]) for r in rows]
    assert [t.entry_point for t in tasks] == ["similar_elements", "is_not_prime"]
    assert "assert is_not_prime(10) == True" in rows[1]["prompt"][0]["content"]
    fenced = [f"```python\n{r['code']}```" for r in records]
    wrong = [records[0]["code"].replace("&", "|"), records[1]["code"].replace("    return False\n", "    return True\n")]
    scores = compute_score_batch(["mbpp"] * 4, fenced + wrong, [r["reward_model"]["ground_truth"] for r in rows] * 2,
                                 max_workers=2)
    assert [s["score"] for s in scores] == [1.0, 1.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------- steps


def test_block_rule_equals_the_indent_regex_on_every_humaneval_solution(humaneval):
    total_steps = 0
    for problem in humaneval:
        body = problem["canonical_solution"]
        spans = code_step_char_spans(body, "block")
        assert ast_block_starts(body) is not None, problem["task_id"]
        assert spans == code_step_char_spans(body, "indent") == step_char_spans(body, None, regex=block_regex(4))
        assert "".join(body[s:e] for s, e in spans) == body  # the steps tile the text
        assert spans[0][0] == 0 and spans[-1][1] == len(body)
        total_steps += len(spans)
    assert total_steps > 2 * len(humaneval)


def test_block_rule_on_real_solutions_and_its_options(humaneval):
    body = humaneval[0]["canonical_solution"]
    steps = [body[s:e] for s, e in code_step_char_spans(body)]
    assert steps == [body[: body.index("    return False")], "    return False\n"]
    # depth 1: the loop's body statement starts its own step
    deep = [body[s:e] for s, e in code_step_char_spans(body, depth=1)]
    assert deep[0] == "    for idx, elem in enumerate(numbers):\n" and len(deep) == 3
    # a whole function (a chat answer): docstring stays in one step with the ast rule
    full = humaneval[0]["prompt"] + body
    full_steps = [full[s:e] for s, e in code_step_char_spans(full, depth=1)]
    assert full_steps[0] == "from typing import List\n\n\n"
    assert full_steps[1] == "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
    assert full_steps[2].lstrip().startswith('"""') and full_steps[2].rstrip().endswith('"""')
    assert full_steps[-1] == "    return False\n"
    # comments, decorators, clauses, multi-line expressions
    code = ("# helper\nimport math\n@staticmethod\ndef f(x):\n    return x\nif x:\n    y = [1,\n2]\nelse:\n"
            "    y = 3\n\ntry:\n    pass\nexcept E:\n    pass\n")
    texts = [code[s:e] for s, e in code_step_char_spans(code)]
    assert texts == ["# helper\nimport math\n", "@staticmethod\ndef f(x):\n    return x\n",
                     "if x:\n    y = [1,\n2]\nelse:\n    y = 3\n\n", "try:\n    pass\nexcept E:\n    pass\n"]
    # text that does not parse falls back to the indent rule (a response cut mid-statement)
    cut = body[: body.index("distance = abs(") + 15]
    assert ast_block_starts(cut) is None
    assert code_step_char_spans(cut) == step_char_spans(cut, None, regex=block_regex(4))
    # line rule and delimiter rule are verl_prm.steps' own
    assert code_step_char_spans(body, "line") == step_char_spans(body, "\n")
    assert code_step_char_spans(body, "delimiter", delimiter="\n\n") == step_char_spans(body, "\n\n")
    assert code_step_char_spans("  \n\n", "block") == [] and code_step_char_spans("", "line") == []
    assert len(code_step_char_spans(full, depth=1, max_steps=2)) == 2
    with pytest.raises(ValueError, match="code step rule"):
        code_step_char_spans(body, "sentences")


def _tokenize(tokenizer, texts):
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, width - len(row):] = torch.tensor(row)  # left padded, as some rollouts are
        mask[b, width - len(row):] = 1
    return ids, mask


def test_code_split_steps_follows_the_split_steps_contract(humaneval, bpe_large, bpe_small):
    texts = [p["canonical_solution"] for p in humaneval[:24]] + ["", "    x = 'é€😀'\n    return x\n"]
    for tokenizer in (bpe_large, bpe_small):
        ids, mask = _tokenize(tokenizer, texts)
        for rule, reference in (("line", dict(delimiter="\n")), ("indent", dict(delimiter=None, regex=block_regex(4)))):
            ours = code_split_steps(ids, mask, tokenizer, rule, base_indent=4, max_steps=6)
            theirs = split_steps(ids, mask, tokenizer, max_steps=6, **reference)
            for name in ("step_ids", "num_steps", "step_ends", "merged_steps", "collapsed_steps", "step_char_ends"):
                assert torch.equal(getattr(ours, name), getattr(theirs, name)), (rule, name)
        block = code_split_steps(ids, mask, tokenizer, "block")
        for b, text in enumerate(block.texts):
            spans = code_step_char_spans(text, "block")
            assert block.texts[b] == texts[b]
            assert int(block.num_steps[b]) == len(spans) - int(block.collapsed_steps[b])
            # each step's last token holds its last character; tokens of step h come before step h+1's
            for h in range(int(block.num_steps[b])):
                end_token = int(block.step_ends[b, h])
                assert int(block.step_ids[b, end_token]) == h
                assert block.step_texts(b)[h] == text[(0 if h == 0 else int(block.step_char_ends[b, h - 1])):
                                                      int(block.step_char_ends[b, h])]
            valid = mask[b].bool() & (ids[b] != tokenizer.eos_token_id)
            if len(spans):
                assert (block.step_ids[b][valid] >= 0).all()
            assert (block.step_ids[b][~valid] == -1).all()


# ---------------------------------------------------------------------------------------------- labels, search


@pytest.fixture(scope="module")
def scripted_problems(humaneval):
    """Three HumanEval problems whose tests fail when any step of the reference body returns None early."""
    from verl_prm.code.scripted import wrong_step

    chosen = []
    for index in (0, 2, 4, 12, 22):
        problem = humaneval[index]
        body = problem["canonical_solution"]
        steps = [body[s:e] for s, e in code_step_char_spans(body)]
        if len(steps) >= 2:
            chosen.append(problem)
        if len(chosen) == 3:
            break
    tasks = [humaneval_task(p) for p in chosen]
    # every single-step corruption of every reference fails its tests (the closed-form values need it)
    pairs = []
    for task, problem in zip(tasks, chosen):
        body = problem["canonical_solution"]
        spans = code_step_char_spans(body)
        for h in range(len(spans)):
            steps = [body[s:e] for s, e in spans]
            steps[h] = wrong_step(steps[h])
            pairs.append((task, "".join(steps)))
    assert not any(v.passed for v in verify_many(pairs, max_workers=2))
    return chosen, tasks


def test_monte_carlo_labels_with_the_unit_test_verifier_equal_the_closed_form(scripted_problems):
    from verl_prm.code.scripted import ScriptedCodeGenerator
    from verl_prm.labeling.inputs import PromptItem
    from verl_prm.labeling.monte_carlo import LabelSettings, MonteCarloLabeler
    from verl_prm.labeling.scoring import OutcomeScorer, load_reward_function

    problems, tasks = scripted_problems
    prompts = [p["prompt"] for p in problems]
    references = [p["canonical_solution"] for p in problems]
    policy = ScriptedCodeGenerator(prompts, references, p_correct=0.5)
    prover = ScriptedCodeGenerator(prompts, references, p_correct=1.0)
    # the CLI's extension point: --reward-fn verl_prm/code/verl_score.py:compute_score
    scorer = OutcomeScorer(load_reward_function(str(REPO / "verl_prm" / "code" / "verl_score.py") + ":compute_score"))
    settings = LabelSettings(n_cov=3, n_mc=2, delimiter=None, step_regex=block_regex(4), seed=3)
    items = [PromptItem(i, prompts[i], t.to_ground_truth(), "openai_humaneval") for i, t in enumerate(tasks)]
    rows = MonteCarloLabeler(policy, prover, scorer, settings).label(items, prompts)
    assert len(rows) == 9
    saw_pit = saw_success = False
    for row in rows:
        response = row["response"]
        spans = list(zip(row["step_starts"], row["step_ends"]))
        assert spans == code_step_char_spans(response, "block")  # the labeller's regex steps are the ast blocks
        wrong = [response[s:e].rstrip().endswith("# wrong step") for s, e in spans]
        for h, q in enumerate(row["q"]):
            # the prover writes every remaining step correctly: Q = 1 until the first wrong step, then 0
            assert q == (0.0 if any(wrong[: h + 1]) else 1.0), (row["prompt_index"], h, wrong, row["q"])
        assert row["outcome"] == (0.0 if any(wrong) else 1.0)
        assert row["prompt_value"] == 1.0
        saw_pit |= any(wrong)
        saw_success |= not any(wrong)
    assert saw_pit and saw_success


def test_search_with_the_unit_test_critic(scripted_problems):
    from verl_prm.code.scripted import ScriptedCodeGenerator
    from verl_prm.code.search import UnitTestCritic
    from verl_prm.search import (
        BeamConfig,
        BestOfNConfig,
        CachedCritic,
        GreedyConfig,
        beam_search,
        best_of_n,
        greedy_step_search,
        node_seed,
    )

    problems, tasks = scripted_problems
    prompts = [p["prompt"] for p in problems]
    references = [p["canonical_solution"] for p in problems]
    policy = ScriptedCodeGenerator(prompts, references, p_correct=0.6)
    prover = ScriptedCodeGenerator(prompts, references, p_correct=1.0)
    critic = UnitTestCritic(tasks, prompts, prover, n_rollouts=1, max_workers=2)
    ids = list(range(len(problems)))

    def passes(node) -> bool:
        return verify(tasks[node.problem], "".join(node.steps)).passed

    # best-of-N with the verifier as ORM picks a passing sample whenever one of the N passes
    chosen = best_of_n(ids, policy, CachedCritic(critic), BestOfNConfig(n=4, rank="orm", seed=1))
    samples = policy.sample_responses(ids, 4, [node_seed(1, "best_of_n", p) for p in ids])  # best_of_n's draws
    for result, group in zip(chosen, samples):
        assert passes(result.node) == any(passes(node) for node in group)
        assert result.score == float(passes(result.node))
    # greedy step search accepts a step iff its continuations pass: every answer passes
    greedy = greedy_step_search(ids, policy, CachedCritic(critic),
                                GreedyConfig(threshold=0.5, accept_on="value", max_retries=6, max_backtracks=0, seed=2))
    assert all(passes(r.node) for r in greedy)
    assert all(r.info["rejected"] + r.info["accepted"] == r.compute.step_samples for r in greedy)
    assert any(r.info["rejected"] > 0 for r in greedy)
    # beam search on Q (the verifier's values) keeps a correct beam
    beams = beam_search(ids, policy, CachedCritic(critic), None,
                        BeamConfig(beam_width=2, samples_per_beam=2, alpha=0.0, max_steps=8, seed=3))
    assert all(passes(r.node) and r.score == 1.0 for r in beams)
    assert critic.sandbox_runs > 0 and sandbox_processes() == []


# ---------------------------------------------------------------------------------------------- launcher


def test_code_launcher_composes_with_verl_and_passes_validation(tmp_path, bpe_small):
    import verl
    from hydra import compose, initialize_config_dir
    from transformers import Qwen2Config, Qwen2ForTokenClassification
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from verl_prm.integrations.verl.run_config import validate_run_config

    critic = tmp_path / "critic"
    config = Qwen2Config(vocab_size=len(bpe_small), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                         pad_token_id=bpe_small.pad_token_id)
    Qwen2ForTokenClassification(config).save_pretrained(critic)
    bpe_small.save_pretrained(critic)
    bin_dir, capture = tmp_path / "bin", tmp_path / "call"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" "$@" > "{capture}"\n')
    fake.chmod(0o755)
    script = REPO / "examples" / "code" / "run_qwen2_5_coder_0_5b_humaneval_pav_grpo.sh"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", HOME=str(tmp_path), CRITIC_PATH=str(critic))
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    argv = capture.read_bytes().decode().split("\0")[:-1]
    assert argv[:2] == ["-m", "verl.trainer.main_ppo"]
    config_dir = str(Path(verl.__file__).resolve().parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        composed = compose("ppo_trainer", overrides=argv[2:])
    validate_config(composed, use_reference_policy=need_reference_policy(composed), use_critic=need_critic(composed))
    hook, pav = validate_run_config(composed)
    assert hook.steps.code_rule == "block" and hook.steps.code_depth == 1 and hook.steps.delimiter is None
    assert hook.steps.regex is None and hook.steps.max_tokens is None
    assert composed.reward.custom_reward_function.path == "pkg://verl_prm.code.verl_score"
    assert composed.reward.reward_manager.name == "pav" and composed.algorithm.adv_estimator == "pav_grpo"
    # the reward function verl loads from that path scores with the sandbox
    from verl.trainer.ppo.reward import get_custom_reward_fn

    reward_fn = get_custom_reward_fn(composed)
    task = CodeTask("t", "assert", "", "assert add(2, 3) == 5")
    assert reward_fn(data_source="x", solution_str="def add(a, b):\n    return a + b\n",
                     ground_truth=task.to_ground_truth(), extra_info={})["score"] == 1.0
    assert reward_fn(data_source="x", solution_str="def add(a, b):\n    return a - b\n",
                     ground_truth=task.to_ground_truth(), extra_info={})["reason"] == "assertion_failed"


# ---------------------------------------------------------------------------------------------- CLIs


@pytest.fixture(scope="module")
def tiny_code_models(tmp_path_factory, humaneval):
    """A tiny random causal LM (its samples are noise: almost always a syntax error) and a tiny value-head critic
    with its tokenizer, trained on HumanEval text, plus three HumanEval rows as parquet."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForTokenClassification

    from verl_prm.labeling.tiny_model import write_tiny_causal_lm

    root = tmp_path_factory.mktemp("code_cli")
    texts = [p["prompt"] + p["canonical_solution"] for p in humaneval]
    policy = write_tiny_causal_lm(texts, root / "policy", vocab_size=400, hidden_size=32, num_layers=1)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForTokenClassification(config).save_pretrained(root / "critic")
    tokenizer.save_pretrained(root / "critic")
    rows = write_parquet(humaneval_rows(humaneval[:3]), root / "humaneval.parquet")
    return policy, root / "critic", rows


def test_label_cli_scores_code_with_the_reward_fn_extension_point(tiny_code_models, tmp_path):
    import pandas as pd

    from verl_prm.labeling.cli import main

    policy, _, rows = tiny_code_models
    out = tmp_path / "labels"
    assert main(["--input", str(rows), "--policy", str(policy), "--output-dir", str(out), "--n-cov", "2",
                 "--n-mc", "1", "--max-new-tokens", "24", "--device", "cpu", "--no-progress",
                 "--delimiter", "\\n\\n", "--step-regex", block_regex(0, depth=1),
                 "--reward-fn", str(REPO / "verl_prm" / "code" / "verl_score.py") + ":compute_score"]) == 0
    labels = pd.concat([pd.read_parquet(p) for p in sorted(out.glob("*.parquet"))])
    assert len(labels) == 6
    for _, row in labels.iterrows():
        # the noise the tiny policy writes fails its tests; the labels are its outcomes and prefix values
        ground = CodeTask.from_ground_truth(row["ground_truth"])
        assert row["outcome"] == float(verify(ground, row["response"]).passed) == 0.0
        assert [int(e) for e in row["step_ends"]] == [e for _, e in step_char_spans(row["response"], None,
                                                                                     regex=block_regex(0, depth=1))]


def test_search_cli_runs_on_code_with_the_unit_test_outcome(tiny_code_models, tmp_path, humaneval):
    from verl_prm.search.cli import main

    policy, critic, rows = tiny_code_models
    out = tmp_path / "search"
    assert main(["--input", str(rows), "--policy", str(policy), "--q-critic", str(critic),
                 "--output-dir", str(out), "--methods", "best_of_n,greedy", "--n", "1", "--max-steps", "3",
                 "--max-step-tokens", "8", "--max-response-tokens", "16", "--device", "cpu",
                 "--step-regex", block_regex(0, depth=1),
                 "--reward-fn", str(REPO / "verl_prm" / "code" / "verl_score.py") + ":compute_score"]) == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["method"] for r in records} == {"best_of_n", "greedy"} and len(records) == 6
    tasks = [humaneval_task(p) for p in humaneval[:3]]
    for record in records:  # the search's outcome is the sandboxed unit tests' verdict on the chosen response
        assert record["reward"] == float(verify(tasks[record["problem"]], record["response"]).passed)


def test_label_settings_split_by_a_code_rule():
    from verl_prm.labeling.cli import label_parser
    from verl_prm.labeling.monte_carlo import LabelSettings

    text = "def f(x):\n    y = [\n        1,\n    ]\n    return y\n"
    spans = LabelSettings(code_rule="block", code_depth=1).step_spans(text)
    assert spans == [tuple(span) for span in code_step_char_spans(text, "block", depth=1)]
    assert [text[s:e] for s, e in spans] == ["def f(x):\n", "    y = [\n        1,\n    ]\n", "    return y\n"]
    assert LabelSettings().step_spans("A.\n\nB.") == [(0, 4), (4, 6)]
    for options, message in (({"code_rule": "ast"}, "code_rule must be"),
                             ({"code_rule": "line", "step_regex": "x"}, "not both"),
                             ({"code_depth": -1}, "code_depth must be >= 0")):
        with pytest.raises(ValueError, match=message):
            LabelSettings(**options)
    args = label_parser().parse_args(["--input", "x", "--output-dir", "o", "--policy", "p", "--reward-fn", "f",
                                      "--code-rule", "block", "--code-depth", "1"])
    assert (args.code_rule, args.code_depth) == ("block", 1)
