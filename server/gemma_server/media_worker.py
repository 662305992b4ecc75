"""Media decoding in worker processes, each with a memory and CPU limit of its own, that the server can kill.

Why processes: decoding a client's file runs a program the client wrote. media.py refuses from the header
whatever the header states (pixels, scans, sample rate, channels, frames, decoded bytes); what no header
bounds (a decoder's own memory, a file built to be slow within those limits) runs here, where a deadline can
stop it and an operating-system limit can end it, and where neither stalls the server's event loop or the
threads that render and tokenize every prompt (asyncio's default executor).

A worker is `python -m gemma_server.media_worker MEMORY SECONDS`. It imports its decoders (numpy, Pillow,
soundfile, scipy.signal) and media.py once, then limits itself (setrlimit(2), from the child, so the server
is never limited): RLIMIT_AS at its size after those imports + MEMORY (past it an allocation fails: Python's
MemoryError, or the decoder's own out-of-memory error), RLIMIT_CPU at the CPU time it has used + SECONDS
before each job (past it the kernel sends SIGXCPU, which ends it), RLIMIT_CORE 0; and it runs at nice 10,
below the server's threads. It reads jobs from its stdin and writes replies to its stdout: pickle protocol 5
with out-of-band buffers (PEP 574), so an image's pixels or a clip's samples cross as one copy; the library
code's own stdout is sent to stderr, so nothing a decoder prints can break a reply.

The server's side is `Workers`: `size` workers, one for each place (`place`, an asyncio semaphore). A request
holds one place while its media are decoded, pre-processed and encoded (media_encoder.soft_tokens), so at most
`size` requests hold decoded media at once, and one that waits holds only its body. A job runs within a
wall-clock deadline (the same SECONDS). A worker past it, one whose request was cancelled (its client left),
one that ran out of memory, and one that died (SIGXCPU, the kernel's OOM killer, a crash) is killed and
replaced by a fresh one, started at once in the background; the request gets a 400 naming the part. The
pipes are read and written on the pool's own threads, never on the event loop or asyncio's default executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO

from gemma_server import media
from gemma_server.errors import ApiError, bad_request

log = logging.getLogger(__name__)

# The worker's niceness: decoding yields the CPU to the server's own threads.
NICE = 10
# Threads for the numeric libraries a worker imports: one (a decode is one job on one core).
THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# The most bytes a reply's header (the pickle without its out-of-band buffers) may take.
MAX_HEAD = 1 << 20


# ---- the pipe's messages ----------------------------------------------------------------------------------


def send(stream: BinaryIO, obj: Any) -> None:
    """Write `obj` as one message: the count of parts, their sizes, the pickle (protocol 5), then each
    out-of-band buffer as it is in memory."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    sizes = [len(head), *(r.nbytes for r in raws)]
    stream.write(struct.pack(f"<I{len(sizes)}Q", len(sizes), *sizes))
    stream.write(head)
    for raw in raws:
        stream.write(raw)
    stream.flush()


def receive(stream: BinaryIO, limit: int) -> Any:
    """Read one message written by `send`.

    Args:
        stream: the pipe.
        limit: the most bytes it may take in all.
    Raises:
        EOFError: the pipe closed (the other side ended).
        ValueError: a message larger than `limit`.
    """
    (count,) = struct.unpack("<I", _exactly(stream, 4))
    if not 1 <= count <= 1024:
        raise ValueError(f"a message of {count} parts")
    sizes = struct.unpack(f"<{count}Q", _exactly(stream, 8 * count))
    if sizes[0] > max(MAX_HEAD, limit // 4) or sum(sizes) > limit:
        raise ValueError(f"a message of {sum(sizes)} bytes")
    head = _exactly(stream, sizes[0])
    buffers = []
    for size in sizes[1:]:
        buffer = bytearray(size)
        view, at = memoryview(buffer), 0
        while at < size:
            n = stream.readinto(view[at:])
            if not n:
                raise EOFError("the pipe closed")
            at += n
        buffers.append(buffer)
    return pickle.loads(head, buffers=buffers)


def _exactly(stream: BinaryIO, n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise EOFError("the pipe closed")
    return data


def pack(item: media.Decoded) -> media.Decoded:
    """A decoded part as it crosses the pipe: an image's RGB pixels as one out-of-band buffer."""
    if item.kind != "image":
        return item
    return dataclasses.replace(item, value=(item.value.size, pickle.PickleBuffer(item.value.tobytes())))


def unpack(item: media.Decoded) -> media.Decoded:
    """`pack` undone: the RGB `PIL.Image.Image` again."""
    if item.kind != "image":
        return item
    from PIL import Image

    size, pixels = item.value
    return dataclasses.replace(item, value=Image.frombytes("RGB", size, pixels))


# ---- the jobs (in the worker) -----------------------------------------------------------------------------


def decode_part(part: media.Part, data: bytes | None, limits: media.Limits, audio_used: float, decoded_used: int,
                clip_seconds: float | None) -> media.Decoded:
    """One request part decoded (`media.decode`): its bytes fetched (`data`) or taken from its base64."""
    if data is None:
        data = media.inline_bytes(part, limits.item_bytes)
    return pack(media.decode(part, data, limits, audio_used, decoded_used, clip_seconds))


def decode_file(data: bytes, param: str, limits: media.Limits, clip_samples: int) -> tuple[float, list[media.Decoded]]:
    """A transcription's file decoded (`media.decode_audio`) and cut into clips (`media.cut_clips`)."""
    wave, seconds, _ = media.decode_audio(data, param, limits.audio_seconds, limits=limits)
    return seconds, media.cut_clips(wave, clip_samples, param)


JOBS = {"part": decode_part, "file": decode_file}


def _address_space() -> int:
    """This process's virtual memory size (/proc/self/status VmSize), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmSize in /proc/self/status")


def main(argv: list[str]) -> int:
    """The worker: limit itself, say it is ready, then answer jobs until its stdin closes.

    Args:
        argv: [MEMORY, SECONDS]: bytes it may allocate beyond its libraries, CPU seconds a job may take.
    """
    import resource

    memory, seconds = int(argv[0]), float(argv[1])
    os.nice(NICE)  # first, so even its imports yield to the server
    # Ctrl+C in a terminal reaches the whole process group: the server ends its workers itself (or they read
    # the end of their stdin when it exits).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The pipes get descriptors of their own; what the libraries print goes to stderr.
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    import numpy  # noqa: F401 - imported before the limits, as the decoders are
    import scipy.signal  # noqa: F401
    import soundfile  # noqa: F401
    from PIL import Image

    Image.init()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    limit = _address_space() + memory
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    _, cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)
    send(replies, ("ready", os.getpid()))
    while True:
        try:
            name, args = receive(requests, limit)
        except EOFError:
            return 0
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu = math.ceil(usage.ru_utime + usage.ru_stime + seconds)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu if cpu_hard == resource.RLIM_INFINITY else min(cpu, cpu_hard),
                                                 cpu_hard))
        try:
            reply: tuple = ("ok", JOBS[name](*args))
        except ApiError as e:
            reply = ("refused", e.status, e.param, e.message)
        except MemoryError:
            reply = ("memory",)
        except Exception as e:  # noqa: BLE001 - a library's error on a client's file is that file's 400
            reply = ("failed", f"{type(e).__name__}: {e}"[:300])
        del args
        send(replies, reply)
        del reply


# ---- the server's side ------------------------------------------------------------------------------------


class WorkerDied(Exception):
    """A worker's pipe closed: it exited or was killed (`returncode`, negative for a signal)."""

    def __init__(self, returncode: int | None) -> None:
        super().__init__(f"the media worker ended ({returncode})")
        self.returncode = returncode


class Worker:
    """One worker process and its pipes; its methods block (they run on the pool's threads).

    Args:
        memory: bytes it may allocate beyond its libraries (RLIMIT_AS).
        seconds: CPU seconds a job may take (RLIMIT_CPU).
    Raises:
        WorkerDied: it ended before it was ready.
    """

    def __init__(self, memory: int, seconds: float) -> None:
        self.memory = memory
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gemma_server.media_worker", str(memory), repr(seconds)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, **THREAD_ENV})
        try:
            receive(self.proc.stdout, MAX_HEAD)
        except (EOFError, ValueError):
            raise WorkerDied(self.end()) from None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, name: str, *args: Any) -> tuple:
        """Run the job `name` (JOBS) and return its reply, its decoded parts unpacked.

        Raises:
            WorkerDied: the worker ended (killed, SIGXCPU, crashed) before it replied.
        """
        try:
            send(self.proc.stdin, (name, args))
            reply = receive(self.proc.stdout, self.memory + MAX_HEAD)
        except (EOFError, ValueError, OSError):
            raise WorkerDied(self.end()) from None
        if reply[0] == "ok":
            result = reply[1]
            if isinstance(result, media.Decoded):
                return ("ok", unpack(result))
            seconds, clips = result
            return ("ok", (seconds, [unpack(c) for c in clips]))
        return reply

    def kill(self) -> None:
        """SIGKILL it (its pipes then close, which ends a `call` blocked on them)."""
        if self.proc.poll() is None:
            self.proc.kill()

    def end(self) -> int:
        """Kill it, reap it and close its pipes; its exit status (negative: the signal that ended it)."""
        self.kill()
        code = self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()
        return code


def _started(future: Future[Worker]) -> bool:
    """Whether a worker's start has finished with a worker (not failed, not cancelled)."""
    return future.done() and not future.cancelled() and future.exception() is None


class Workers:
    """The server's media workers: `size` places, each with a worker (started, or starting in the background).

    Args:
        size: workers and places (--media-workers).
        memory: bytes a worker may allocate beyond its libraries (--media-worker-memory).
        timeout: wall-clock and CPU seconds of one job (--media-decode-timeout).
    """

    def __init__(self, size: int, memory: int, timeout: float) -> None:
        self.size = size
        self.memory = memory
        self.timeout = timeout
        self._places = asyncio.Semaphore(size)
        # Two threads a worker: one waits on its job while another starts its replacement.
        self._io = ThreadPoolExecutor(2 * size, thread_name_prefix="media-io")
        self._lock = threading.Lock()
        self._idle: list[Future[Worker]] = []  # workers ready or starting, not in a job
        self._busy: set[Worker] = set()
        self._closed = False
        self.replaced = 0  # workers killed (deadline, cancel, memory) or found dead, and replaced

    @classmethod
    def of(cls, config) -> Workers:
        return cls(config.media_workers, config.media_worker_memory, config.media_decode_timeout)

    def start(self) -> None:
        """Start every worker in the background (the first requests then find them ready)."""
        with self._lock:
            while not self._closed and len(self._idle) + len(self._busy) < self.size:
                self._idle.append(self._io.submit(Worker, self.memory, self.timeout))

    @contextlib.asynccontextmanager
    async def place(self) -> AsyncIterator[None]:
        """Hold one of the `size` places (waiting for one): a request's whole media path runs in it."""
        async with self._places:
            yield

    def describe(self) -> dict[str, Any]:
        """What /v1/engine shows of them: the settings, how many are ready (started, idle or in a job; a fresh
        one imports its decoders first, seconds), and how many were replaced."""
        with self._lock:
            ready = len(self._busy) + sum(map(_started, self._idle))
        return {"workers": self.size, "ready": ready, "decode_timeout": self.timeout, "worker_memory": self.memory,
                "replaced": self.replaced}

    async def decode(self, part: media.Part, data: bytes | None, limits: media.Limits, audio_used: float,
                     decoded_used: int, clip_seconds: float | None) -> media.Decoded:
        """One request part decoded in a worker (`decode_part`).

        Raises:
            ApiError: 400 naming the part: a limit it breaks, a file that cannot be read, a decode past the
                deadline, the memory or the CPU limit.
        """
        return await self._run(part.param, part.kind, "part", part, data, limits, audio_used, decoded_used,
                               clip_seconds)

    async def decode_file(self, data: bytes, param: str, limits: media.Limits,
                          clip_samples: int) -> tuple[float, list[media.Decoded]]:
        """A transcription's file decoded and cut into clips in a worker (`decode_file`): (seconds, clips).

        Raises:
            ApiError: as `decode`.
        """
        return await self._run(param, "audio", "file", data, param, limits, clip_samples)

    async def _run(self, param: str, kind: str, name: str, *args: Any) -> Any:
        worker = await self._lease()
        try:
            async with asyncio.timeout(self.timeout):
                reply = await asyncio.wrap_future(self._io.submit(worker.call, name, *args))
        except TimeoutError:
            self._replace(worker)
            raise bad_request(param, f"The {kind} took longer than {self.timeout:g} s to decode "
                                     f"(--media-decode-timeout).") from None
        except WorkerDied as e:
            self._replace(worker)
            raise bad_request(param, self._death(kind, e.returncode)) from None
        except BaseException:  # cancelled: the client left, so its decode stops
            self._replace(worker)
            raise
        status = reply[0]
        if status == "memory":
            self._replace(worker)
            raise bad_request(param, f"The {kind} needs more memory to decode than a media worker may take "
                                     f"({self.memory} bytes, --media-worker-memory).")
        self._give_back(worker)
        if status == "ok":
            return reply[1]
        if status == "refused":
            _, code, where, message = reply
            raise ApiError(code, message, where)
        log.warning("media worker: %s failed on %s: %s", name, param, reply[1])
        raise bad_request(param, f"The {kind} could not be decoded: {reply[1]}")

    def _death(self, kind: str, returncode: int | None) -> str:
        """Why a worker that died in a job did, in the request's words."""
        if returncode == -signal.SIGXCPU:
            return (f"The {kind} took more than {self.timeout:g} s of CPU to decode (--media-decode-timeout); its "
                    f"worker was stopped.")
        if returncode == -signal.SIGKILL:
            return f"The {kind}'s decoder was killed (out of memory); its worker was replaced."
        how = signal.Signals(-returncode).name if returncode and returncode < 0 else f"exit status {returncode}"
        return f"The {kind}'s decoder stopped ({how}); its worker was replaced."

    async def _lease(self) -> Worker:
        """An idle worker (a ready one first), or one started now; busy until given back or replaced.

        Raises:
            WorkerDied, OSError: a worker could not start (the server's fault: a 500).
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("the media workers are shut down")
            ready = [f for f in self._idle if _started(f)]
            future = ready[0] if ready else (self._idle[0] if self._idle else None)
            if future is not None:
                self._idle.remove(future)
            else:
                future = self._io.submit(Worker, self.memory, self.timeout)
        try:
            # Shielded: a request cancelled while its worker starts leaves the start to finish, and the worker idle.
            worker = await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:
            with self._lock:
                self._idle.append(future)
            raise
        except BaseException:
            with self._lock:
                if not self._closed:
                    self._idle.append(self._io.submit(Worker, self.memory, self.timeout))
            raise
        with self._lock:
            self._busy.add(worker)
        return worker

    def _give_back(self, worker: Worker) -> None:
        done: Future[Worker] = Future()
        done.set_result(worker)
        with self._lock:
            self._busy.discard(worker)
            if self._closed:
                worker.kill()
            else:
                self._idle.append(done)

    def _replace(self, worker: Worker) -> None:
        """Kill `worker` (reaped on a pool thread) and start another in its place."""
        worker.kill()
        with self._lock:
            self._busy.discard(worker)
            self.replaced += 1
            if not self._closed:
                self._io.submit(worker.end)
                self._idle.append(self._io.submit(Worker, self.memory, self.timeout))

    def shutdown(self) -> None:
        """Kill every worker (those starting too, once started) and stop the threads."""
        with self._lock:
            self._closed = True
            futures, busy = list(self._idle), list(self._busy)
            self._idle.clear()
        for worker in busy:
            worker.kill()
        for future in futures:
            future.add_done_callback(lambda f: _started(f) and f.result().kill())
        self._io.shutdown(wait=False, cancel_futures=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
