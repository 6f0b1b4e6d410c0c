"""The a3po command line in subprocesses: `a3po(...)` runs one command to its end; `Run` is an `a3po train` in a
session of its own, for the tests that signal, kill or stop its processes.

Each run gets its own session (start_new_session), so its process group stands for a
terminal's Ctrl-C or a scheduler's group-wide SIGTERM, and every process still in the
session after the trainer is gone is one it left behind. Every wait has a deadline, and the
`launch` fixture (conftest.py) kills whatever is left of each session, so nothing can hang CI.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

CLI = [sys.executable, "-m", "a3po.cli"]  # `a3po` as installed, with this interpreter
TINY = ["--preset", "tiny", "logging.tensorboard=false"]
LONG = [*TINY, "total_train_steps=400", "evaluator.freq_steps=0"]
ORPHAN_EXIT_S = 5.0  # generous: the workers' watchdog reacts within a second (docs/operations.md)
EXIT_S = 60  # a stopped run must be gone by then, whatever it was doing


def a3po(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
         timeout: float = 600) -> subprocess.CompletedProcess:
    """`a3po *args` as a user types it, run to its end in cwd, stdout and stderr captured as text.
    env: variables set on top of this process's environment; timeout: a deadline only."""
    return subprocess.run([*CLI, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env} if env else None)


def started_with(folder: Path, code: str) -> dict[str, str]:
    """Environment variables under which every Python process a command starts runs `code` first: a
    sitecustomize.py in `folder`, put first on PYTHONPATH."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(code)
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p)}


def without(module: str, folder: Path) -> dict[str, str]:
    """Environment variables under which `module` cannot be imported by any process of the command."""
    return started_with(folder, f"import sys\nsys.modules[{module!r}] = None\n")


class Run:
    """A `python -m a3po.cli train` in a session of its own, stderr in a file we can read while it runs."""

    def __init__(self, args, cwd: Path, env: dict[str, str] | None = None):
        """env: variables set on top of this process's environment, as in `a3po`."""
        self.cwd = cwd
        self.err_path = cwd / "stderr.txt"
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([*CLI, "train", *args], cwd=cwd, env={**os.environ, **env} if env else None,
                                         stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        self.sid = self.proc.pid

    @property
    def err(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_for(self, ready, what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.proc.poll() is None, f"run exited ({self.proc.returncode}) before {what}:\n{self.err[-3000:]}"
            assert time.monotonic() < deadline, f"no {what} after {timeout}s:\n{self.err[-3000:]}"
            time.sleep(0.1)

    def wait_for_text(self, text: str, timeout: float = 120) -> None:
        self.wait_for(lambda: text in self.err, repr(text), timeout)

    def finish(self, timeout: float = EXIT_S) -> int:
        return self.proc.wait(timeout=timeout)

    def others(self) -> list[int]:
        """Live processes of this run's session other than the trainer."""
        return [p for p in session_members(self.sid) if p != self.proc.pid]

    def kill_all(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.sid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first), or None if it is gone."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _live_where(field: int, value: int) -> list[int]:
    """Live (not zombie) processes whose /proc stat field `field` (after the state) equals value."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            fields = proc_stat(int(d.name))
            if fields and fields[0] != "Z" and int(fields[field]) == value:
                out.append(int(d.name))
    return out


def session_members(sid: int) -> list[int]:
    """Live (not zombie) processes whose session id is sid."""
    return _live_where(3, sid)


def children_of(pid: int) -> list[int]:
    """Live (not zombie) processes whose parent is pid."""
    return _live_where(1, pid)


def descendants(pid: int) -> dict[int, tuple[str, int]]:
    """Every live process below pid, whatever session it started (torchrun starts its ranks in new ones): its
    name and its parent."""
    found, todo = {}, children_of(pid)
    while todo:
        child = todo.pop()
        fields = proc_stat(child)
        with contextlib.suppress(OSError):
            if fields:
                found[child] = ((Path("/proc") / str(child) / "comm").read_text().strip(), int(fields[1]))
                todo += children_of(child)
    return found


def rollout_workers(run: Run) -> list[int]:
    """The run's rollout worker processes (named a3po-rollout-<i>; trainer ranks are spawned the same way)."""
    def is_worker(pid):
        try:
            return (Path("/proc") / str(pid) / "comm").read_text().startswith("a3po-rollout")
        except OSError:
            return False

    return [p for p in run.others() if is_worker(p)]


def gone_within(pids: list[int], timeout: float) -> float | None:
    """Seconds until none of pids is alive, or None if some still are after timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not any((s := proc_stat(p)) and s[0] != "Z" for p in pids):
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def lines_with(err: str, needle: str) -> list[str]:
    return [line for line in err.split("\n") if needle in line]


def assert_one_clean_line(err: str, needle: str) -> str:
    """Exactly one line carries the message, it starts its own line (not after a progress bar's \\r), no traceback."""
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    found = lines_with(err, needle)
    assert len(found) == 1, f"expected one {needle!r} line:\n{err[-3000:]}"
    assert found[0].startswith(needle), f"the message is glued to another line: {found[0]!r}"
    return found[0]


def steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def metrics_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@contextlib.contextmanager
def served(*args: str, timeout: float = 180):
    """`a3po serve *args` on a free port of 127.0.0.1: yields (process, base URL) once it says it is serving, the
    process's output until then (stdout and stderr) in its `startup`; it is stopped (SIGTERM, then killed) when
    the block ends."""
    import select

    proc = subprocess.Popen([*CLI, "serve", "--port", "0", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        said = [""]
        while "a3po serve: serving" not in said[-1]:
            left = deadline - time.monotonic()
            assert left > 0 and proc.poll() is None, f"a3po serve did not start ({proc.poll()}): {''.join(said)}"
            if select.select([proc.stdout], [], [], min(left, 1.0))[0]:
                said.append(proc.stdout.readline())
        proc.startup = "".join(said)
        yield proc, said[-1].split(" at ", 1)[1].split()[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=EXIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
