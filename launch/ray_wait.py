"""Wait until a Ray cluster has the expected number of alive nodes (used by launch/ray_on_slurm.sh).

Exits 0 once ``--nodes`` nodes are alive; exits 1 with the hosts that did join when ``--timeout-s``
passes, or as soon as a watched process (the srun step of the Ray head or workers) has exited.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", required=True, help="host:port of the Ray head's GCS")
    parser.add_argument("--nodes", type=int, required=True, help="alive nodes to wait for")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--poll-s", type=float, default=2.0)
    parser.add_argument("--watch-pid", type=int, action="append", default=[],
                        help="fail at once when this process has exited (repeatable)")
    parser.add_argument("--expected-hosts", default="", help="the job's nodes, for the error message")
    return parser.parse_args()


def exited(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def gcs_listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError:
        return False
    return True


class Waiter:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.deadline = time.monotonic() + args.timeout_s

    def check_watched(self) -> None:
        dead = [pid for pid in self.args.watch_pid if exited(pid)]
        if dead:
            sys.exit(f"ray_wait: the Ray srun step(s) with pid {dead} exited before the cluster was complete; "
                     f"see the ray-*.log files of this job")

    def expired(self) -> bool:
        return time.monotonic() > self.deadline

    def wait_for_head(self) -> None:
        while not gcs_listening(self.args.address):
            self.check_watched()
            if self.expired():
                sys.exit(f"ray_wait: no Ray head answers at {self.args.address} after {self.args.timeout_s:.0f} s")
            time.sleep(self.args.poll_s)

    def wait_for_nodes(self) -> None:
        import ray  # after the head answers: connecting to a missing GCS blocks for a long time

        ray.init(address=self.args.address, logging_level="ERROR", log_to_driver=False)
        try:
            while True:
                hosts = sorted(n["NodeManagerHostname"] for n in ray.nodes() if n["Alive"])
                if len(hosts) >= self.args.nodes:
                    print(f"ray_wait: all {self.args.nodes} nodes joined: {' '.join(hosts)}", flush=True)
                    return
                self.check_watched()
                if self.expired():
                    sys.exit(f"ray_wait: only {len(hosts)} of {self.args.nodes} nodes joined the Ray cluster at "
                             f"{self.args.address} within {self.args.timeout_s:.0f} s; joined: {hosts or 'none'}; "
                             f"the job's nodes: {self.args.expected_hosts or '?'}; see the ray-worker-*.log files")
                time.sleep(self.args.poll_s)
        finally:
            ray.shutdown()


def main() -> None:
    waiter = Waiter(parse_args())
    waiter.wait_for_head()
    waiter.wait_for_nodes()


if __name__ == "__main__":
    main()
