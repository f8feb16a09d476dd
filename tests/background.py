"""Processes that test modules start as soon as the suite is collected, so that they run beside
the rest of it (one test process rarely keeps both of the suite's 2 cores busy).

`free_port()` and `wait_until_healthy(...)` wait for a server process; `Servers` starts, waits for
and stops a module's `hfjax serve` processes; `openai_400` reads a server's 400 in OpenAI's shape.

A module defines `start_in_background()`, which conftest.py calls once after collection, and
which calls `start(name, argv, seconds=...)` for each of its jobs; a test then calls
`finished(name, starter)`, which waits for the job (calling `starter` first if nothing has, as
when one test runs alone). Jobs run one at a time, the longest first, on a thread of their own;
a test that waits for a job that has not started yet starts it at once.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable


@dataclasses.dataclass
class Job:
    argv: list[str]
    env: dict
    seconds: float  # about how long it takes: the longest run first
    directory: pathlib.Path | None = None  # its scratch directory (its last argument), once started
    process: subprocess.Popen | None = None
    log: object = None


@dataclasses.dataclass(frozen=True)
class Finished:
    returncode: int
    output: str  # stdout and stderr, interleaved
    directory: pathlib.Path


_JOBS: dict[str, Job] = {}
_LOCK = threading.Lock()
_WAKE = threading.Event()
_RUNNER: list[threading.Thread] = []


def python(code: str) -> list[str]:
    """argv of a new Python process running `code` (the job's directory is sys.argv[1])."""
    return [sys.executable, "-c", code]


def start(name: str, argv: list[str], *, seconds: float, env: dict | None = None) -> None:
    """Queues job `name`, once: `argv` plus its scratch directory, its output to a file there."""
    with _LOCK:
        if name not in _JOBS:
            _JOBS[name] = Job(argv, {**os.environ, **(env or {})}, seconds)
        if not _RUNNER:
            _RUNNER.append(threading.Thread(target=_run_queue, daemon=True))
            _RUNNER[0].start()
    _WAKE.set()


def _launch(job: Job) -> None:  # with _LOCK held
    job.directory = pathlib.Path(tempfile.mkdtemp(prefix="hfjax-test-job-"))
    job.log = open(job.directory / "output.log", "w")  # a file, not a pipe: nobody reads the job until it ends
    job.process = subprocess.Popen(
        [*job.argv, str(job.directory)], stdout=job.log, stderr=subprocess.STDOUT, env=job.env
    )


def _run_queue() -> None:
    while True:
        with _LOCK:
            waiting = [job for job in _JOBS.values() if job.process is None]
            running = any(job.process.poll() is None for job in _JOBS.values() if job.process is not None)
            if waiting and not running:
                _launch(max(waiting, key=lambda job: job.seconds))
        _WAKE.wait(timeout=0.5)
        _WAKE.clear()


def finished(name: str, starter: Callable[[], None], timeout: float = 900) -> Finished:
    """Waits for job `name` (calling `starter` first if nothing queued it) and returns what it did."""
    if name not in _JOBS:
        starter()
    job = _JOBS[name]
    with _LOCK:
        if job.process is None:
            _launch(job)
    try:
        job.process.wait(timeout=timeout)
    finally:
        job.log.close()
        _WAKE.set()
    return Finished(job.process.returncode, (job.directory / "output.log").read_text(), job.directory)


def clean_up() -> None:
    with _LOCK:
        for job in _JOBS.values():
            if job.process is not None and job.process.poll() is None:
                # SIGTERM first: a job that started servers of its own (README_SERVE_JOB) stops them on its
                # way out; a SIGKILL left them running after the session (a job that no selected test awaited).
                job.process.terminate()
                try:
                    job.process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    job.process.kill()
            if job.directory is not None:
                shutil.rmtree(job.directory, ignore_errors=True)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(
    process: subprocess.Popen, url: str, log: pathlib.Path, *, name: str, timeout: float = 600
) -> str:
    """Waits until the server `process` answers 200 on `url`/health and returns `url`; raises
    AssertionError with the end of its `log` if it exits first, or after `timeout` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{name} server exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{name} server did not answer /health in {timeout} s")


class Servers:
    """A test module's `hfjax serve` processes: each on a free port of 127.0.0.1, its output in a log
    file of its own in one scratch directory, all stopped (and the directory removed) by `stop()` or
    at exit. `servers[name]` is {"process", "url", "log", "checkpoint"}."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.started: dict[str, dict] = {}
        self._directory: pathlib.Path | None = None

    @property
    def directory(self) -> pathlib.Path:
        """The scratch directory (made on first use): checkpoints the module writes, and the logs."""
        if self._directory is None:
            self._directory = pathlib.Path(tempfile.mkdtemp(prefix=self.prefix))
            atexit.register(self.stop)
        return self._directory

    def __getitem__(self, name: str) -> dict:
        return self.started[name]

    def __iter__(self):
        return iter(self.started)

    def launch(
        self, name: str, checkpoint: pathlib.Path, *flags: str, model_flag: bool = False, env: dict | None = None
    ) -> None:
        """Starts `hfjax serve CHECKPOINT FLAGS --port P` (model_flag: `--model CHECKPOINT` instead), with
        `env` added to this process's environment."""
        port = free_port()
        log = open(self.directory / f"{name}.log", "w")
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})}
        model = ["--model", str(checkpoint)] if model_flag else [str(checkpoint)]
        argv = [sys.executable, "-m", "hfjax.cli", "serve", *model, *flags, "--port", str(port)]
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.started[name] = {
            "process": process,
            "url": f"http://127.0.0.1:{port}",
            "log": log,
            "checkpoint": checkpoint,
        }

    def log(self, name: str) -> str:
        """What server `name` has printed so far."""
        return (self.directory / f"{name}.log").read_text()

    def wait(self, timeout: float = 600) -> dict[str, str]:
        """{name: url} of every server, once each answers /health (see `wait_until_healthy`)."""
        return {
            name: wait_until_healthy(
                server["process"], server["url"], self.directory / f"{name}.log", name=name, timeout=timeout
            )
            for name, server in self.started.items()
        }

    def stop(self) -> None:
        """Kills the servers still running and removes the scratch directory."""
        for server in self.started.values():
            if server["process"].poll() is None:
                server["process"].kill()
                server["process"].wait()
            server["log"].close()
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)


def openai_400(answer, param: str) -> str:
    """The message of `answer` (an httpx response), checked to be a 400 in OpenAI's error shape whose
    `param` is `param` and whose message names it."""
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and param.split(".")[0].split("[")[0] in error["message"], error
    return error["message"]


def headless_chromium():
    """A Selenium driver of Debian's chromium, headless, 1000x700 (skips the test where selenium, chromium
    or chromium-driver is missing). The caller quits it."""
    import pytest

    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is a test dependency: pip install selenium")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip(
            "Debian's chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1000,700",
    ):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))


# The README's Serve section, run as a user runs it: the checkpoint line of its first example, then each
# line of the bash block that holds $HFJAX_README_BLOCK (its server in the background, on a free port
# rather than the README's), in a directory of the job's own ($HFJAX_README: the README's path). Prints
# each command's outcome as a JSON line, the server's log last.
README_SERVE_JOB = r"""
import json, os, pathlib, re, signal, socket, subprocess, sys
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (clean_up's stop: the finally below stops the servers)
directory = sys.argv[1]
section = pathlib.Path(os.environ["HFJAX_README"]).read_text().split("\n## Serve\n", 1)[1].split("\n## ", 1)[0]
blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
checkpoint = next(line for line in blocks[0].splitlines() if line.startswith("python -c "))
lines = next(block for block in blocks if os.environ["HFJAX_README_BLOCK"] in block).splitlines()
ports = {}  # each --port of the block: a free one
for readme_port in dict.fromkeys(re.findall(r"--port (\d+)", "\n".join(lines))):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        ports[readme_port] = str(s.getsockname()[1])
bin_dir = pathlib.Path(directory, "bin")
bin_dir.mkdir()
# `hfjax` and `python` on the PATH are this interpreter's, as a user's environment would have them.
(bin_dir / "hfjax").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m hfjax.cli "$@"\n')
(bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
for shim in ("hfjax", "python"):
    (bin_dir / shim).chmod(0o755)
env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OMP_WAIT_POLICY": "PASSIVE"}
servers = []
try:
    for line in [checkpoint, *lines]:
        line = line.replace("/tmp/hfjax-readme", directory)
        for readme_port, port in ports.items():
            line = line.replace(":" + readme_port + "/", ":" + port + "/").replace("--port " + readme_port, "--port " + port)
        if line.rstrip().endswith("&"):
            log = open(pathlib.Path(directory, f"server-{len(servers)}.log"), "w")
            servers.append(subprocess.Popen(line.rstrip(" &"), shell=True, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            continue
        ran = subprocess.run(line, shell=True, env=env, capture_output=True, text=True, timeout=600)
        print(json.dumps({"command": line.split()[0], "returncode": ran.returncode, "stdout": ran.stdout, "stderr": ran.stderr[-2000:]}), flush=True)
finally:
    for number, server in enumerate(servers):
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        log = pathlib.Path(directory, f"server-{number}.log").read_text()
        print(json.dumps({"command": "server", "returncode": server.returncode, "log": log[-3000:]}))
"""
