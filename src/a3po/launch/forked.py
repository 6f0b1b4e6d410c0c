"""A fork server forked from the command-line process right after its imports, for the local launcher's processes.

A spawned rollout worker or trainer rank is a new interpreter: it imports torch and transformers again,
seconds of CPU before it does anything, once per process and again for every replacement. Python's
forkserver start method would fork them from a server instead, but that server is itself a new
interpreter that imports everything once more. Here the server is forked from `a3po train` itself, at
the one moment when a fork is safe: after its imports, before torch has run anything (no OpenMP pool, no
Python thread but the main one, no CUDA). The processes it forks start with every module imported, and
multiprocessing's own forkserver protocol carries their queues, pipes, pids and exit codes, so the
launcher's handles behave as with spawned processes.

Only where that moment is known to be safe: Linux, a CPU build of torch (a CUDA driver initialised in a
parent does not survive a fork), one Python thread. Elsewhere, and when `start()` was never called,
the local launcher spawns as before.

The server ignores SIGINT and SIGTERM (a terminal's Ctrl-C or a `kill` of the process group is for the
trainer to handle) and ends when the trainer does: multiprocessing's server exits once no process holds
its "alive" pipe. A forked child inherits ignored SIGINT and SIGTERM; child.take_signals() sets them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import sys
import threading
from multiprocessing import forkserver, util

NAME = "a3po-forkserver"
_started = False


def start() -> bool:
    """Fork the server now, if this process may be forked; True if it runs. Call once the imports are done and
    before anything has run on torch."""
    global _started
    if not _started and _safe_to_fork():
        spawn = util.spawnv_passfds
        util.spawnv_passfds = _fork_instead  # what forkserver.ensure_running starts its server with
        try:
            forkserver.ensure_running()
            _started = True
        except OSError:  # no Unix socket or pipe to be had: spawned, then, as before
            pass
        finally:
            util.spawnv_passfds = spawn
    return _started


def context():
    """The multiprocessing context the local launcher starts its processes with."""
    return mp.get_context("forkserver" if _started else "spawn")


def _safe_to_fork() -> bool:
    import torch

    cpu_build = torch.version.cuda is None and getattr(torch.version, "hip", None) is None
    return sys.platform == "linux" and cpu_build and threading.active_count() == 1


def _fork_instead(path: str, args: list[str], passfds) -> int:
    """util.spawnv_passfds's contract (start `args`, a `python -c CODE`, with only `passfds` open besides the
    standard streams; return its pid), by forking this process and running CODE in the child."""
    code = args[args.index("-c") + 1]
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        keep = sorted({0, 1, 2, *passfds})
        for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")]):
            os.closerange(low + 1, high)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.register_at_fork(after_in_child=_seed_afresh)
        from a3po.child import name_process

        name_process(NAME)
        exec(compile(code, NAME, "exec"), {"__name__": NAME})  # multiprocessing's own server command
        status = 0
    except SystemExit:  # how the server ends: no client left
        status = 0
    finally:
        _remove_socket_folder()
        os._exit(status)


def _remove_socket_folder() -> None:
    """The server's socket is in a temporary folder of the trainer's (multiprocessing's pymp-*), which the trainer
    removes as it exits; a trainer killed outright cannot, and the server, which ends once the trainer and every
    worker are gone, removes it then."""
    address = forkserver._forkserver._forkserver_address
    if isinstance(address, str) and os.path.basename(os.path.dirname(address)).startswith("pymp-"):
        shutil.rmtree(os.path.dirname(address), ignore_errors=True)


def _seed_afresh() -> None:
    """As in a spawned process, the global generators of numpy and torch start from fresh entropy in each forked child,
    not from a state they would all share (Python's `random` reseeds itself after a fork). a3po seeds what it draws;
    this is for the user's code in a worker."""
    for name, reseed in (("numpy", lambda m: m.random.seed()), ("torch", lambda m: m.seed())):
        if name in sys.modules:
            reseed(sys.modules[name])
