"""Two-tier checkpoints: save to a local directory, replicate to S3 in the background, lose the node, resume from S3.

What it does (CPU, a few seconds; it starts its own S3 server, moto, on 127.0.0.1):

1. Trains a small MLP (AdamW, dropout, batches drawn from the global RNG) for ``2 * --steps`` steps without
   interruption, as the reference.
2. In a child process (the "node"), trains ``--steps`` steps from the same seed with a two-tier manager::

       manager = arrayckpt.CheckpointManager(local_dir, interval=arrayckpt.Interval(every_steps=K),
                                             asynchronous=True, retention=arrayckpt.Retention(keep_last=2),
                                             remote=arrayckpt.Remote("s3://bucket/run", storage_options=...,
                                                                     retention=arrayckpt.Retention(keep_last=3)))

   Every save commits to the local directory first (training blocks only to stage the tensors), then a
   background thread copies it to S3. After its last save the node waits until that upload has committed
   (``manager.wait_for_uploads()``), then is killed (``SIGKILL``: no ``close()``, nothing tidied up).
3. Wipes the local directory (the node is gone, and its disk with it), builds brand-new objects from another seed
   and a manager over an empty local directory and the same remote: ``manager.restore(state)`` finds the newest step
   on S3 and loads it; training goes on to ``2 * --steps``, saving (locally, then to S3) as before.
4. Checks that every loss after the resume, every parameter and the optimizer state equal the reference run's, bit
   for bit, and prints which tiers hold each step.

Run it with::

    python examples/two_tier_resume.py                  # temporary directory
    python examples/two_tier_resume.py --dir /tmp/two-tier --steps 20 --every 5

It prints a summary and exits with status 1 if anything differs (0 on success). Needs ``moto[server]`` (the test
extra) for the S3 server.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

import arrayckpt

SUCCESS_LINE = "OK: resumed from S3 after losing the local tier, bit for bit"
BUCKET = "two-tier-example"
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
          "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true", "NO_PROXY": "127.0.0.1,localhost",
          "no_proxy": "127.0.0.1,localhost"}


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 16, generator=g)
    return x, torch.sin(x @ torch.randn(16, 4, generator=g))


def train_step(model: nn.Module, optim: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    x, y = batch
    index = torch.randint(0, x.shape[0], (32,))  # from the global RNG: its state is part of the checkpoint
    loss = nn.functional.mse_loss(model(x[index]), y[index])
    optim.zero_grad(set_to_none=True)
    loss.backward()
    optim.step()
    return loss.item()


def state_of(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> dict:
    return {"model": model, "optim": optim, "step": step, "rng": torch.get_rng_state()}


def manager_for(local: Path, endpoint: str, every: int) -> arrayckpt.CheckpointManager:
    remote = arrayckpt.Remote(f"s3://{BUCKET}/run", storage_options={"endpoint_url": endpoint},
                              retention=arrayckpt.Retention(keep_last=3))
    return arrayckpt.CheckpointManager(local, interval=arrayckpt.Interval(every_steps=every), asynchronous=True,
                                       retention=arrayckpt.Retention(keep_last=2), remote=remote)


def node(local: Path, endpoint: str, steps: int, every: int, seed: int) -> None:
    """The first node: train ``steps`` steps with two-tier checkpoints, wait for the last upload, then die."""
    model, optim = build(seed)
    manager = manager_for(local, endpoint, every)
    batch = data()
    for step in range(1, steps + 1):
        train_step(model, optim, batch)
        manager.save(step, state_of(model, optim, step))  # returns once staged; the upload follows in the background
    manager.wait_for_uploads()  # the newest step is on S3 now
    print(f"node: trained {steps} steps; tiers {manager.tiers()}; killing myself", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close(), no clean-up: the node is simply gone


def run(workdir: Path, steps: int, every: int, seed: int, endpoint: str) -> int:
    batch = data()
    model, optim = build(seed)
    reference = [train_step(model, optim, batch) for _ in range(2 * steps)]
    reference_state = {"model": model.state_dict(), "optim": optim.state_dict()}

    local = workdir / "local"
    child = subprocess.run([sys.executable, __file__, "--node", "--dir", str(workdir), "--steps", str(steps),
                            "--every", str(every), "--seed", str(seed), "--endpoint", endpoint],
                           capture_output=True, text=True, timeout=300)
    print(child.stdout.strip())
    if child.returncode != -signal.SIGKILL:
        print(f"the node exited with {child.returncode}, not SIGKILL:\n{child.stderr}")
        return 1
    shutil.rmtree(local)  # the node's disk is gone with it

    model, optim = build(seed + 999)  # brand-new objects, other weights: everything must come from S3
    target = {"model": model, "optim": optim, "step": 0, "rng": torch.empty_like(torch.get_rng_state())}
    with manager_for(local, endpoint, every) as manager:
        tiers = manager.tiers()
        start = manager.restore(target)
        torch.set_rng_state(target["rng"])
        print(f"resume : step {start} restored from {tiers[start]} (tiers before: {tiers})")
        losses = []
        for step in range(start + 1, 2 * steps + 1):
            losses.append(train_step(model, optim, batch))
            manager.save(step, state_of(model, optim, step))
    print(f"after  : tiers {manager.tiers()}")

    problems = []
    if start != steps or tiers[start] != ("remote",):
        problems.append(f"expected step {steps} from the remote tier only, got {start} from {tiers.get(start)}")
    if losses != reference[start:]:
        problems.append("losses after the resume differ from the uninterrupted run's")
    for name, tensor in reference_state["model"].items():
        if not torch.equal(tensor, model.state_dict()[name]):
            problems.append(f"parameter {name} differs")
    for index, moments in reference_state["optim"]["state"].items():
        for key, value in moments.items():
            if not torch.equal(torch.as_tensor(value), torch.as_tensor(optim.state_dict()["state"][index][key])):
                problems.append(f"optimizer state {index}.{key} differs")
    print(f"losses : {len(losses)} after the resume, final {losses[-1]:.6f} (reference {reference[-1]:.6f})")
    for problem in problems:
        print(f"MISMATCH: {problem}")
    if problems:
        return 1
    print(SUCCESS_LINE)
    return 0


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """moto's S3 server in a subprocess on a free local port, with one bucket; yields its endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the moto S3 server did not start (pip install 'moto[server]')") from None
                time.sleep(0.1)
        import botocore.session

        client = botocore.session.get_session().create_client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=12, help="steps before the node dies, and after the resume")
    parser.add_argument("--every", type=int, default=4, help="save every this many steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--node", action="store_true", help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--endpoint", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps % args.every:
        parser.error("--steps must be a multiple of --every (the node's last step is saved)")
    os.environ.update(S3_ENV)  # dummy credentials for moto (TensorStore and botocore read them from here)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # the same in both processes: bit-exact results
    if args.node:
        node(args.dir / "local", args.endpoint, args.steps, args.every, args.seed)
        return 1  # not reached
    with contextlib.ExitStack() as stack:
        workdir = args.dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="arrayckpt-two-tier-")))
        workdir.mkdir(parents=True, exist_ok=True)
        endpoint = stack.enter_context(s3_server())
        return run(workdir, args.steps, args.every, args.seed, endpoint)


if __name__ == "__main__":
    sys.exit(main())
