"""`kernjax serve` processes as the tests start them. Every process is started through `Procs`
(the `procs` fixture), which kills and reaps all it started, whatever the test did; the servers
pick their own ports (`--port 0`, `--pp_listen 127.0.0.1:0`) and the tests read them back from
the logs; waits are on what a log says or on a process ending, each with a deadline."""

from __future__ import annotations

import glob
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

HTTP = re.compile(r"http://127\.0\.0\.1:(\d+)")  # the head's first line naming its URL
PP = re.compile(r" to join on 127\.0\.0\.1:(\d+)")  # "waiting for stage 1 to join on ..."


def until(cond, seconds: float, every: float = 0.05):
    """`cond()` once it is true, or its last value when `seconds` have passed."""
    deadline = time.monotonic() + seconds
    while not (got := cond()) and time.monotonic() < deadline:
        time.sleep(every)
    return got


def writers(path: Path) -> list[int]:
    """The processes that hold `path` open (Linux's /proc): a process and the children it
    passed its log to (multiprocessing's resource tracker, say)."""
    target, pids = str(path.resolve()), []
    for fd in glob.glob("/proc/[0-9]*/fd/*"):
        try:
            if os.readlink(fd) == target:
                pids.append(int(fd.split("/")[2]))
        except OSError:  # gone meanwhile
            pass
    return pids


def refusing_port() -> socket.socket:
    """A socket bound to a free port of 127.0.0.1 and not listening: a connection to the port is
    refused, and no other socket can take it while this one is open. `listen()` on it to play a
    server there."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


class Proc:
    """A `kernjax serve` process; its stdout and stderr go to `log`."""

    def __init__(self, args, log: Path, gpu: int | None = None):
        self.log = log
        env = dict(os.environ) if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
        with log.open("w") as out:
            self.p = subprocess.Popen([sys.executable, "-m", "kernjax", "serve", *args],
                                      stdout=out, stderr=subprocess.STDOUT, env=env)

    def text(self) -> str:
        return self.log.read_text()

    def wait_for(self, words: str, seconds: float = 60, times: int = 1) -> bool:
        """Until the log says `words` (`times` times), the process ends, or `seconds` pass;
        whether the log says them."""
        deadline = time.monotonic() + seconds
        while self.text().count(words) < times:
            if self.p.poll() is not None or time.monotonic() > deadline:
                return self.text().count(words) >= times
            time.sleep(0.1)
        return True

    def wait(self, seconds: float) -> int | None:
        """The exit status once the process ends within `seconds`; None if it is still running."""
        try:
            return self.p.wait(seconds)
        except subprocess.TimeoutExpired:
            return None

    def port(self, pattern: re.Pattern, seconds: float = 120) -> int:
        """The port (`pattern`'s group) the log names, once it does; an AssertionError with the
        log if the process ends or `seconds` pass first."""
        deadline = time.monotonic() + seconds
        while not (m := pattern.search(self.text())):
            if self.p.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{self.log.name} names no port ({pattern.pattern}):\n"
                                     + self.text())
            time.sleep(0.1)
        return int(m.group(1))

    @property
    def url(self) -> str:
        """The head's HTTP address, which it picked (`--port 0`)."""
        return f"http://127.0.0.1:{self.port(HTTP)}"

    @property
    def pp(self) -> int:
        """The port where the head takes stages, which it picked (`--pp_listen 127.0.0.1:0`)."""
        return self.port(PP)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


class Procs:
    """Starts `kernjax serve` processes; `stop` kills and reaps every one (the `procs` fixture
    calls it after each test, passed or failed)."""

    def __init__(self):
        self.started: list[Proc] = []

    def serve(self, *args: str, log: Path, gpu: int | None = None) -> Proc:
        """A `kernjax serve` process; it compiles its prefill program before serving and each
        other program when first used (`--warm prefill`) unless `args` say otherwise."""
        if not any(a.startswith("--warm") for a in args):
            args = (*args, "--warm", "prefill")
        proc = Proc(args, log, gpu)
        self.started.append(proc)
        return proc

    def head(self, stage_dir: Path, log: Path, *extra: str, gpu=None) -> Proc:
        """Stage 0 of a cut, on ports it picks: `.url` and `.pp` read them from its log."""
        return self.serve("--stage_dir", str(stage_dir), "--pp_listen", "127.0.0.1:0", "--port",
                          "0", *extra, log=log, gpu=gpu)

    def joiner(self, stage_dir: Path, pp: int, log: Path, *extra: str, gpu=None) -> Proc:
        return self.serve("--stage_dir", str(stage_dir), "--pp_head", f"127.0.0.1:{pp}", *extra,
                          log=log, gpu=gpu)

    def stop(self) -> None:
        for proc in self.started:
            proc.stop()


class Pipeline:
    """A head and its stages (or the whole program) from one cut directory, started by `procs`:
    the head at once, the stages by `start_stages` (once the head names its port), and `ready`
    waits until it serves at `.http`. Several start at once when each `start_stages` before any
    `ready`."""

    def __init__(self, procs: Procs, cut: Path, tmp: Path, *, stages: int, timeout: float = 60,
                 extra: tuple = (), gpus: int = 0):
        self.started, self.cut, self.tmp, self.stages = procs, cut, tmp, stages
        self.extra, self.gpu = extra, (lambda s: s % gpus) if gpus else (lambda s: None)
        if stages == 1:  # flags from a file, as absl allows
            (tmp / "whole.flags").write_text(f"--stage_dir={cut / 'whole'}\n--port=0\n")
            self.procs = [procs.serve(f"--flagfile={tmp / 'whole.flags'}", log=tmp / "whole.log")]
        else:
            self.procs = [procs.head(cut / "stage0", tmp / "stage0.log", "--stage_timeout",
                                     str(timeout), *extra, gpu=self.gpu(0))]

    def start_stages(self) -> Pipeline:
        """Starts the stages past the head once it names the port where they join."""
        if self.stages > 1 and len(self.procs) == 1:
            pp = self._started(lambda: self.procs[0].pp)
            self.procs += [self.started.joiner(self.cut / f"stage{s}", pp,
                                               self.tmp / f"stage{s}.log", *self.extra,
                                               gpu=self.gpu(s)) for s in range(1, self.stages)]
        return self

    def ready(self) -> Pipeline:
        """Once the head serves (every stage joined): `.http` is its address."""
        self.start_stages()
        deadline = time.monotonic() + 120
        while "serving" not in self.procs[0].text():
            if any(p.p.poll() is not None for p in self.procs) or time.monotonic() > deadline:
                raise AssertionError("the pipeline did not start:\n" + self.logs())
            time.sleep(0.1)
        self.http = self._started(lambda: self.procs[0].url)
        return self

    def _started(self, read):
        try:
            return read()
        except AssertionError:
            raise AssertionError("the pipeline did not start:\n" + self.logs()) from None

    def logs(self) -> str:
        return "\n".join(f"--- {p.log.name}\n{p.text()}" for p in self.procs)
