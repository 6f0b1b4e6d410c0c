"""The local launcher: processes on this machine, multiprocessing queues and pipes, and weights in shared memory.

The processes are never forked from the trainer (a child would inherit its torch threads and locks): they
are forked from the server launch/forked.py made before the trainer ran anything, or else spawned.

Each worker writes into a pipe of its own whose other end only the trainer holds, so a worker
killed halfway through a message leaves the trainer an end of file on that pipe, never a torn
message in a channel the other workers share.
"""

from __future__ import annotations

from a3po.launch import forked
from a3po.sync import SharedWeights


class WorkerChannels:
    """A started-or-not worker process, its inbox, and the read end of its pipe."""

    def __init__(self, proc, inbox, reader, writer=None):
        self.proc, self.inbox, self.reader, self._writer = proc, inbox, reader, writer

    def started(self) -> None:
        """Drop our copy of the pipe's write end once the child holds its own: its death is then an end of file."""
        if self._writer is not None:
            self._writer.close()


class LocalLauncher:
    name = "local"

    def __init__(self):
        self._ctx = forked.context()

    def host(self) -> str:
        """The address other ranks reach rank 0 at."""
        return "127.0.0.1"

    def weights(self, state) -> SharedWeights:
        return SharedWeights(state)

    def worker(self, worker_id: int, args: tuple) -> WorkerChannels:
        from a3po.rollout.worker import worker_main

        reader, writer = self._ctx.Pipe(duplex=False)
        inbox = self._ctx.Queue()
        proc = self._ctx.Process(target=worker_main, name=f"a3po-rollout-{worker_id}", daemon=True,
                                 args=(worker_id, *args, inbox, writer))
        return WorkerChannels(proc, inbox, reader, writer)

    def follower(self, rank: int, args: tuple):
        from a3po.trainer.ranks import follower_main

        return self._ctx.Process(target=follower_main, args=args, name=f"a3po-rank-{rank}", daemon=True)

    def close(self) -> None:
        pass
