"""The GPU machine's one command (``bench/gpu/run.sh``), rehearsed on CPU as close to that machine
as a CPU gets: pydantic and torch_remat import only from the wheels that ``fetch_wheels.sh``
downloads and run.sh installs (that image lacks them), and of ``$OUT`` only what the device
returns is kept (at most 8 files). Every result must still come back, whether or not the suite
passed, failed or was stopped."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "bench" / "gpu" / "run.sh"
FETCH = ROOT / "bench" / "gpu" / "fetch_wheels.sh"
CARRIED = ("pydantic", "pydantic_core", "annotated_types", "typing_inspection", "torch_remat")
TINY = ["--scale", "tiny", "--device", "cpu"]

# Put first on PYTHONPATH: the image's view, where the carried packages import only from the
# folder the wheels were installed into. Every Python process the suite starts inherits it.
SITECUSTOMIZE = f"""
import os
import sys
from importlib.machinery import PathFinder

_CARRIED = {set(CARRIED)!r}
_SITE = [os.environ["ACTPLAN_REHEARSAL_SITE"]]


class _CarriedOnly(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return super().find_spec(name, _SITE if path is None and name in _CARRIED else path, target)


sys.meta_path[:] = [_CarriedOnly if f is PathFinder else f for f in sys.meta_path]
"""

pytestmark = [
    pytest.mark.xdist_group("device-command"),  # one worker fetches the wheels once
    pytest.mark.slow,
    pytest.mark.skipif(
        sys.platform != "linux" or platform.machine() != "x86_64" or shutil.which("bash") is None,
        reason="the carried wheels are manylinux x86-64, as on the GPU machine",
    ),
]


def device_return(out: Path, returned: Path) -> list[str]:
    """Copy to ``returned`` what the device machine brings back of ``out``; name what it leaves."""
    kept, left_out, total = 0, [], 0
    for path in sorted(p for p in out.rglob("*") if not p.is_dir()):
        rel = path.relative_to(out)
        size = path.stat().st_size if path.is_file() and not path.is_symlink() else 0
        why = (
            "not a plain file" if path.is_symlink() or not path.is_file()
            else "odd name" if not all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in rel.parts)
            else "too deep" if len(rel.parts) > 3
            else "over 16 MiB" if size > 16 << 20
            else "over 64 MiB together" if total + size > 64 << 20
            else "more than 8 files" if kept == 8
            else None
        )  # fmt: skip
        if why:
            left_out.append(f"{rel} ({why})")
            continue
        kept, total = kept + 1, total + size
        (returned / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, returned / rel)
    return left_out


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """The wheels for this Python, and the environment that hides the carried packages elsewhere."""
    base = tmp_path_factory.mktemp("device")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    env = {**os.environ, "ACTPLAN_PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(FETCH), "--python-version", version, "--dest", str(base / "wheels")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    wheels = sorted(p.name for p in (base / "wheels").glob("*.whl"))
    assert len(wheels) == len(CARRIED), wheels
    (base / "hide").mkdir()
    (base / "hide" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env.update(
        ACTPLAN_WHEELS=str(base / "wheels"),
        ACTPLAN_SITE=str(base / "site"),
        ACTPLAN_REHEARSAL_SITE=str(base / "site"),
        PYTHONPATH=str(base / "hide"),
    )
    return base, env


def run_device_command(
    env: dict[str, str], out: Path, *suite_args: str, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(RUN), str(out), *suite_args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def returned_results(out: Path, returned: Path) -> Path:
    """What the device brings back, with the archive unpacked beside it into ``returned/results``."""
    returned.mkdir()
    assert device_return(out, returned) == []
    names = {p.name for p in returned.iterdir()}
    assert {"gpu_results.tar.gz", "gpu_suite.md", "gpu_run.log"} <= names
    assert names <= {"gpu_results.tar.gz", "gpu_suite.md", "gpu_suite.json", "gpu_run.log"}
    with tarfile.open(returned / "gpu_results.tar.gz") as archive:
        archive.extractall(returned / "results", filter="data")
    return returned / "results"


def test_without_the_wheels_the_carried_packages_do_not_import(rehearsal, tmp_path):
    _, env = rehearsal
    probe = "import importlib.util as u, sys; sys.exit(any(u.find_spec(n) for n in sys.argv[1:]))"
    bare = {**env, "ACTPLAN_REHEARSAL_SITE": str(tmp_path)}
    assert subprocess.run([sys.executable, "-c", probe, *CARRIED], env=bare).returncode == 0
    done = subprocess.run([sys.executable, "-c", "import pydantic"], env=bare, capture_output=True, text=True)
    assert "No module named 'pydantic'" in done.stderr


def test_the_device_command_brings_every_result_back_in_at_most_8_files(rehearsal, tmp_path):
    base, env = rehearsal
    stages = ["offload"]  # of the stages that run on CPU, one of the quicker (about 25 s)
    done = run_device_command(env, tmp_path / "out", *TINY, "--stages", ",".join(stages))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    # Each carried package was imported from the wheels' folder, the one place it can come from.
    where = "import sys, importlib; print([importlib.import_module(n).__file__ for n in sys.argv[1:]])"
    paths = subprocess.run(
        [sys.executable, "-c", where, *CARRIED],
        env={**env, "PYTHONPATH": f"{base / 'site'}{os.pathsep}{env['PYTHONPATH']}"},
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert paths.count(str(base / "site")) == len(CARRIED), paths

    results = returned_results(tmp_path / "out", tmp_path / "returned")
    suite = json.loads((results / "gpu_suite.json").read_text())
    assert suite["device"]["torch_remat"] is True
    assert [s["stage"] for s in suite["stages"]] == stages
    assert all(s["status"] in ("ok", "ok, parts skipped", "skipped") for s in suite["stages"]), suite
    for stage in stages:
        report = json.loads((results / f"gpu_{stage}.json").read_text())
        assert report["complete"], stage
        assert (results / f"gpu_{stage}.md").exists() and (results / f"gpu_{stage}.log").exists()
    summary = (tmp_path / "returned" / "gpu_suite.md").read_text()
    assert summary == (results / "gpu_suite.md").read_text()
    assert "**offload**: ok" in summary and len(summary.splitlines()) < 60
    log = (results / "gpu_run.log").read_text()
    assert f"from {base / 'site' / 'pydantic'}" in log and "stage offload: ok" in log
    assert "pydantic==" in (results / "gpu_pip_list.txt").read_text()


def test_a_failed_suite_still_leaves_its_archive_and_summary(rehearsal, tmp_path):
    _, env = rehearsal
    done = run_device_command(env, tmp_path / "out", *TINY, "--stages", "offload", "--caps", "offload=1")
    assert done.returncode == 1
    results = returned_results(tmp_path / "out", tmp_path / "returned")
    summary = (tmp_path / "returned" / "gpu_suite.md").read_text()
    assert "**offload**: timed out" in summary and summary == (results / "gpu_suite.md").read_text()
    assert json.loads((results / "gpu_suite.json").read_text())["stages"][0]["status"] == "timed out"
    assert (results / "gpu_offload.log").exists() and (results / "gpu_run.log").exists()


def test_a_suite_that_writes_no_summary_still_leaves_one(rehearsal, tmp_path):
    _, env = rehearsal
    done = run_device_command(env, tmp_path / "out", *TINY, "--stages", "offload,warp")
    assert done.returncode == 1  # the suite refuses the stage before it runs any
    results = returned_results(tmp_path / "out", tmp_path / "returned")
    summary = (tmp_path / "returned" / "gpu_suite.md").read_text()
    assert "the suite wrote no summary (exit 1)" in summary and "unknown warp" in summary
    assert summary == (results / "gpu_suite.md").read_text()


STUB = """#!/usr/bin/env bash
# python, except that the suite writes one result, then hangs
if [ "$1 $2" = "-m bench.gpu.suite" ]; then
    echo '{"complete": false}' >"$4/gpu_offload.json"
    echo '# stub summary' >"$4/gpu_suite.md"
    echo "stub suite started"
    exec sleep 60
fi
exec PYTHON "$@"
"""


@pytest.mark.parametrize("how", ["deadline", "signal"])
def test_a_stopped_suite_still_leaves_what_it_wrote(rehearsal, tmp_path, how):
    _, env = rehearsal
    stub = tmp_path / "python"
    stub.write_text(STUB.replace("PYTHON", sys.executable))
    stub.chmod(0o755)
    env = {**env, "ACTPLAN_PYTHON": str(stub), "ACTPLAN_DEADLINE": "3" if how == "deadline" else "0"}
    log = tmp_path / "out" / "gpu_run.log"
    process = subprocess.Popen(
        ["bash", str(RUN), str(tmp_path / "out")],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        if how == "signal":  # as timeout(1) or Ctrl-C would: the whole process group
            deadline = time.monotonic() + 60
            while not (log.exists() and "stub suite started" in log.read_text()):
                assert time.monotonic() < deadline and process.poll() is None
                time.sleep(0.1)
            os.killpg(process.pid, signal.SIGTERM)
        code = process.wait(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert code == (124 if how == "deadline" else 143)
    results = returned_results(tmp_path / "out", tmp_path / "returned")
    assert (results / "gpu_offload.json").exists()
    summary = (tmp_path / "returned" / "gpu_suite.md").read_text()
    assert summary.startswith("# stub summary") and f"the suite ended with exit {code}" in summary
