"""`hfjax launch`: start N local processes of one multi-process JAX run (for testing multi-host).

Each process gets the environment that `hfjax.distributed.initialize()` reads:

  HFJAX_COORDINATOR     127.0.0.1:PORT, process 0's coordinator (loopback)
  HFJAX_NUM_PROCESSES   N
  HFJAX_PROCESS_ID      0 .. N-1
  XLA_FLAGS             --xla_force_host_platform_device_count=D (D CPU devices each)

and calls `hfjax.distributed.initialize()` (gloo CPU collectives) before JAX starts, so
`jax.devices()` lists all N x D devices and a mesh over them spans the processes.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading

# Runs in each child: join the run before anything starts JAX's backends (importing hfjax does
# not), then run the hfjax subcommand or the script.
_BOOTSTRAP = """
import os, runpy, sys
import hfjax
hfjax.distributed.initialize()
argv = sys.argv[1:]
if argv[0].endswith(".py"):
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as `python script.py` does
    runpy.run_path(argv[0], run_name="__main__")
else:
    from hfjax.cli import main
    sys.exit(main(argv))
"""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "launch",
        help="run an hfjax command as N local processes of one multi-process JAX run",
        description="Starts NPROC processes on this machine, each with DEVICES_PER_PROC CPU devices, joined by "
        "jax.distributed over loopback, each running COMMAND (an hfjax subcommand, or a script.py and its "
        "arguments). Output lines are prefixed with the process id. Exits with the first non-zero exit code.",
    )
    parser.add_argument("--nproc", type=int, required=True, help="number of processes")
    parser.add_argument(
        "--devices-per-proc", type=int, default=4, help="simulated CPU devices per process (default: 4)"
    )
    parser.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)")
    # dest "argv": the top-level parser already stores the subcommand's name in "command".
    parser.add_argument(
        "argv",
        metavar="COMMAND",
        nargs=argparse.REMAINDER,
        help="-- then an hfjax subcommand or a script.py, with arguments",
    )


def run(args: argparse.Namespace) -> int:
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        print(
            "hfjax launch: give the command after --, e.g. hfjax launch --nproc 2 -- generate --model PATH 'Hi'",
            file=sys.stderr,
        )
        return 2
    if args.nproc < 1 or args.devices_per_proc < 1:
        print(
            f"hfjax launch: --nproc and --devices-per-proc must be >= 1, got {args.nproc} and {args.devices_per_proc}",
            file=sys.stderr,
        )
        return 2
    port = args.port or _free_port()
    children = []
    for index in range(args.nproc):
        env = dict(os.environ)
        env.update(process_env(index, args.nproc, args.devices_per_proc, port))
        children.append(
            subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, *command],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    # One thread per child forwards its output, so no child blocks on a full pipe.
    threads = [threading.Thread(target=_forward, args=(i, c), daemon=True) for i, c in enumerate(children)]
    for thread in threads:
        thread.start()
    codes = [child.wait() for child in children]
    for thread in threads:
        thread.join()
    return next((code for code in codes if code), 0)


def _forward(index: int, child: subprocess.Popen) -> None:
    for line in child.stdout:
        print(f"[{index}] {line}", end="", flush=True)


def process_env(index: int, count: int, devices: int, port: int) -> dict[str, str]:
    """The environment variables of process `index` of `count`, each with `devices` CPU devices."""
    flags = os.environ.get("XLA_FLAGS", "")
    flags = " ".join(f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count"))
    return {
        "HFJAX_COORDINATOR": f"127.0.0.1:{port}",
        "HFJAX_NUM_PROCESSES": str(count),
        "HFJAX_PROCESS_ID": str(index),
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
