"""Writing a checkpoint: at once (the default) or in the background while training goes on (--async_save).

Both trainers hand `Saver.save` the files their rank writes ({path: object}: their engine's
Engine.files, llama_train/train/engines/) and the trainer state. The checkpoint's life is the same in both modes:
written into <tag>.tmp (store.fresh_dir), `trainer_state.json` with every file's size and sha256
last, then renamed into place and `latest` moved (store.publish_now). kill -9 at any moment leaves
the previous complete checkpoint as `latest`.

--async_save: on the step, each rank copies its objects to host memory (host_copy: one memcpy of the
model state; the stall) and gathers the RNG states; a background thread per rank then writes its files,
hashes them and writes a done-marker (<tag>.tmp/.rank_NNNNN.done, its files' manifest entries). Rank
0's thread waits for every rank's marker on the shared output_dir, hashes what only it wrote, writes
`trainer_state.json` and publishes. The threads run no collective: gloo/NCCL calls from two threads
of a rank could interleave with the training thread's. At most one save is in flight: the next save,
the stop save and the end of training (leaving the `with`) wait for it; an error in the thread is
raised there. A run that leaves by an error (the non-finite guard's stop, a collective that failed)
finishes the save in flight too before it goes, and the watchdog's exit gives it time to
(finish_in_flight): the step it saves was complete and checked before the save began. Only a hard kill
abandons it, leaving `latest` at the previous complete checkpoint.

What is saved is copied at the save step, the trainer state included (the spike guard's windows grow
in place as training goes on).
"""

import copy
import json
import os
import threading
import time

import torch

from llama_train.checkpoint import store as ckpt
from llama_train.checkpoint.settings import CheckpointSettings
from llama_train.distributed.dist import all_gather_object
from llama_train.errors import CheckpointError
from llama_train.fileio import atomic_write, fsync_path

MARKER = ".rank_{:05d}.done"  # a rank's files in <tag>.tmp are written and hashed (async saves)
# leaving by an error, rank 0 waits this long for the other ranks' files (not a collective's timeout)
EXIT_WAIT_S = 60.0


def host_copy(obj):
    """`obj` (a state dict: dicts, lists, tensors, numbers) copied, its tensors in host memory, so the
    training step after it cannot change what is written. copy.deepcopy keeps storages shared inside it
    shared (torch.save writes the same bytes as from the original); device tensors are copied to the
    host first (their views are then separate copies); views made under autograd (ZeRO's flat groups),
    which deepcopy refuses, are copied detached with their requires_grad flag."""
    memo = {}
    for t in _tensors(obj):
        if id(t) in memo:
            continue
        if t.device.type != "cpu":
            memo[id(t)] = t.detach().to("cpu").requires_grad_(t.requires_grad)
        elif t.grad_fn is not None:
            memo[id(t)] = copy.deepcopy(t.detach(), memo).requires_grad_(t.requires_grad)
    return copy.deepcopy(obj, memo)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)


def write_files(files: dict):
    """torch.save each object, then fsync its file: the checkpoint is on disk before `latest` names it."""
    for path, obj in files.items():
        torch.save(obj, path)
        fsync_path(path)


_IN_FLIGHT: set[threading.Thread] = set()  # this process's writer threads still running


def finish_in_flight(timeout_s: float) -> bool:
    """Wait up to `timeout_s` for this process's saves in flight (the watchdog, before it exits); True
    when none is left. One not done by then is abandoned: `latest` still names the previous one."""
    deadline = time.monotonic() + timeout_s
    for thread in list(_IN_FLIGHT):
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in _IN_FLIGHT)


class Saver:
    """This rank's checkpoint writer; `async_save`: in a background thread (module docstring). Use in a
    `with`: leaving it waits for the save in flight, also when leaving by an exception."""

    def __init__(
        self, async_save: bool, hashes: bool, keep_last: int, rank: int, world: int, timeout_s: float
    ):
        self.async_save, self.hashes, self.keep_last = async_save, hashes, keep_last
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self._thread, self._error = None, None

    @classmethod
    def of(cls, settings: CheckpointSettings, rank: int, world: int) -> "Saver":
        """--async_save, --hash_checkpoints, --keep_last; rank 0 waits for the others' files as long as a
        collective would (--dist_timeout_minutes)."""
        return cls(settings.async_save, settings.hashes, settings.keep_last, rank, world, settings.timeout_s)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            return self.wait()
        self.timeout_s = min(self.timeout_s, EXIT_WAIT_S)  # ranks that died write no marker
        try:  # the run's own error is the one raised; the save's is said here
            self.wait()
        except Exception as e:
            print(f"[rank {self.rank}] the checkpoint in flight was not completed: {e}", flush=True)

    def save(self, root: str, tag: str, files, state: dict):
        """Collective: checkpoint `tag` under `root`; `files(tmp)` -> {path: object} this rank writes."""
        self.wait()  # at most one in flight: the previous one is published (rank 0) before this begins
        tmp = ckpt.fresh_dir(root, tag, self.rank)
        mine = files(tmp)
        if not self.async_save:
            write_files(mine)
            ckpt.save_train_state(tmp, state, self.rank, self.hashes)
            return ckpt.publish(root, tag, self.keep_last, self.rank)
        snapshot, rngs = host_copy(mine), all_gather_object(ckpt.rng_state())
        state = copy.deepcopy(state)  # as at this step: the spike guard's windows go on growing in place
        self._thread = threading.Thread(
            target=self._background, args=(root, tag, tmp, [snapshot], state, rngs), name="llama-train-save"
        )
        self._thread.daemon = True  # a kill ends it: the previous checkpoint stays `latest`
        _IN_FLIGHT.add(self._thread)
        self._thread.start()

    def wait(self):
        """Until the save in flight (if any) is done: written, and on rank 0 published."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _background(self, root: str, tag: str, tmp: str, box: list, state: dict, rngs: list):
        try:
            snapshot = box.pop()  # held only here: the host copy goes as soon as it is on disk
            write_files(snapshot)
            names = sorted(os.path.relpath(p, tmp) for p in snapshot)
            del snapshot
            ckpt._injected_delay(state["step"])  # tests: killed here, the files are there, no marker
            start = time.perf_counter()
            entries = ckpt.file_entries(tmp, names, self.hashes)
            hash_s = time.perf_counter() - start  # rank 0's line reports its own share
            atomic_write(os.path.join(tmp, MARKER.format(self.rank)), json.dumps(entries))
            if self.rank == 0:
                self._complete(tmp, state, rngs, hash_s)
                ckpt.publish_now(root, tag, self.keep_last)
        except BaseException as e:  # raised on the training thread at the next wait
            self._error = e
        finally:
            _IN_FLIGHT.discard(threading.current_thread())

    def _complete(self, tmp: str, state: dict, rngs: list, hash_s: float):
        """Rank 0's thread: every rank's marker, then the RNG file, the manifest and trainer_state.json."""
        entries, start = self._wait_for_markers(tmp), time.perf_counter()
        torch.save(rngs, os.path.join(tmp, ckpt.RNG_FILE))
        listed = ckpt.listing(tmp)
        entries |= ckpt.file_entries(tmp, [n for n in listed if n not in entries], self.hashes)  # ours only
        ckpt.write_state(
            tmp, state, {n: entries[n] for n in listed}, hash_s + time.perf_counter() - start, self.hashes
        )

    def _wait_for_markers(self, tmp: str) -> dict:
        """Every rank's manifest entries, from its marker (removed once read: not part of the checkpoint)."""
        paths, deadline = [os.path.join(tmp, MARKER.format(r)) for r in range(self.world)], time.monotonic()
        while not all(os.path.exists(p) for p in paths):
            if time.monotonic() - deadline > self.timeout_s:
                missing = [r for r, p in enumerate(paths) if not os.path.exists(p)]
                raise CheckpointError(
                    f"async save {tmp}: ranks {missing} did not finish within {self.timeout_s:.0f} s"
                )
            time.sleep(0.05)
        entries = {}
        for p in paths:
            with open(p) as f:
                entries |= json.load(f)
            os.remove(p)
        return entries
