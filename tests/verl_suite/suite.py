"""verl 0.9.1's own tests, fetched at test time and run against daskwg.

verl's ``tests/single_controller/*.py`` and ``tests/test_protocol_on_cpu.py`` come from
verl's source distribution on PyPI, downloaded with ``pip download`` into a cache
directory (``$DASKWG_VERL_CACHE``, default ``~/.cache/daskwg/verl-0.9.1``) the first time
and never copied into this repository. Two suites run them:

- ``single_controller``: the real verl package (installed with ``pip install --no-deps
  verl==0.9.1``) provides ``Worker``, ``register``, ``Dispatch`` and ``DataProto``; only
  ``ray`` and ``verl.single_controller.ray`` are stand-ins (``standins.py``) pointed at
  daskwg (``daskwg.verl``, ``daskwg.get``, a local Dask cluster).
- ``protocol``: ``verl.protocol`` and ``verl.DataProto`` are daskwg's (``daskwg.protocol``),
  the rest of verl (``verl.utils``) is real: verl's protocol tests, run on daskwg's
  ``DataProto``.

Run ``python tests/verl_suite/suite.py [single_controller|protocol] [pytest args]``
(``tox -e verl``); ``tests/test_verl_suite.py`` runs both from the main test command.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERL_VERSION = "0.9.1"
HERE = Path(__file__).resolve().parent

#: verl's single-controller test files run here (every test in them is expected to pass).
SINGLE_CONTROLLER = [
    "test_auto_padding_on_cpu.py",
    "test_colocated_workers.py",
    "test_colocated_workers_fused.py",
    "test_decorator_on_cpu.py",
    "test_driverfunc_to_worker.py",
    "test_fused_workers_on_cpu.py",
    "test_get_set_dispatch_collect_cpu.py",
    "test_nested_worker.py",
    "test_ray_local_envs_on_cpu.py",
    "test_ray_utils_on_cpu.py",
    "test_worker_group_basics.py",
]

#: verl's single-controller test files left out, and why.
LEFT_OUT = {
    "test_data_transfer.py": "needs GPUs: one rank per CUDA device (torch.cuda.device_count()) and a "
    "2 x 4096 x 32768 int64 batch; it times ray.cloudpickle and ray.put (Ray internals)",
    "test_device_mesh_register.py": "needs 4 or more GPUs: 2-D and 3-D device meshes over "
    "torch.cuda.device_count() ranks, nccl",
    "test_high_level_scheduling_api.py": "needs GPUs (pool sizes from torch.cuda.device_count()) and tests Ray "
    "internals (ray.util.remove_placement_group, ray.get_runtime_context().get_node_id())",
    "test_ray_collectives.py": "needs GPUs and tests Ray internals (ray.util.collective send/recv over nccl)",
    "test_rvdz.py": "needs GPUs and tests Ray internals (actor .options(num_gpus=1), verl's Ray NCCL rendezvous)",
    "test_split_resource_pool.py": "needs GPUs: sizes and expected values come from torch.cuda.device_count() "
    "(without GPUs its batches are empty and its expected lists are not), cuda tensors, nccl",
    "test_worker_group_torch.py": "needs GPUs: RayResourcePool(use_gpu=True) ranks all_gather_into_tensor "
    "on the ranks' devices (nccl)",
}

#: verl's protocol test file, run on daskwg's DataProto.
PROTOCOL = "test_protocol_on_cpu.py"


def cache_dir() -> Path:
    """Where the sdist is unpacked (``$DASKWG_VERL_CACHE`` or ``~/.cache/daskwg/verl-<version>``)."""
    default = Path.home() / ".cache" / "daskwg" / f"verl-{VERL_VERSION}"
    return Path(os.environ.get("DASKWG_VERL_CACHE", default))


def fetch() -> Path:
    """verl's source tree (its ``tests/`` only are used), downloaded and unpacked once.

    Returns:
        the unpacked ``verl-<version>`` directory.

    Raises:
        RuntimeError: ``pip download`` failed (its output is in the message).
    """
    root = cache_dir()
    tree = root / f"verl-{VERL_VERSION}"
    if (tree / "tests" / "single_controller").is_dir():
        return tree
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"verl=={VERL_VERSION}",
                "-d",
                tmp,
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            raise RuntimeError(
                f"pip download of verl=={VERL_VERSION}'s sdist failed:\n{proc.stdout}\n{proc.stderr}"
            )
        (archive,) = Path(tmp).glob("verl-*.tar.gz")
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(f"verl-{VERL_VERSION}/tests/")]
            tar.extractall(tmp, members=members, filter="data")
        os.replace(Path(tmp) / f"verl-{VERL_VERSION}", tree)
    return tree


def pytest_command(suite: str, extra: list[str]) -> tuple[list[str], Path]:
    """The command line that runs ``suite`` and the directory to run it in."""
    tree = fetch()
    if suite == "single_controller":
        files = [f"tests/single_controller/{name}" for name in SINGLE_CONTROLLER]
    elif suite == "protocol":
        files = [f"tests/{PROTOCOL}"]
    else:
        raise ValueError(f"unknown suite {suite!r}: single_controller or protocol")
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "verl_suite_plugin",
        "-p",
        "no:cacheprovider",
        f"--rootdir={tree}",
        "-c",
        os.devnull,
        "-o",
        "timeout=180",
        *files,
        *extra,
    ]
    return command, tree


def run(suite: str, extra: list[str], **popen: object) -> subprocess.CompletedProcess:
    """Run one suite in a child process (``popen``: ``subprocess.run`` options)."""
    command, tree = pytest_command(suite, extra)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["DASKWG_VERL_SUITE"] = suite
    return subprocess.run(command, cwd=tree, env=env, **popen)


def main(argv: list[str]) -> int:
    suites = ["single_controller", "protocol"]
    if argv and argv[0] in suites:
        suites, argv = [argv[0]], argv[1:]
    status = 0
    for suite in suites:
        status = run(suite, argv).returncode or status
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
