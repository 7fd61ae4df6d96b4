"""Outputs are never lost: written whole or not at all, in folders checked before any
work, never replacing a file, run folder or checkpoint the user did not give up."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from autoplace.errors import AutoplaceError
from autoplace.files import check_output_file, write_atomic, write_json_atomic
from autoplace.plan import Plan
from tests.reliability._run import clean_error, cli


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "rows.json"
    path.write_text("old content")

    def broken(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken)
    with pytest.raises(AutoplaceError, match="No space left"):
        write_atomic(path, "new content")
    assert path.read_text() == "old content"
    assert [p.name for p in tmp_path.iterdir()] == ["rows.json"], "no temp file left behind"
    with pytest.raises(TypeError):  # not JSON: the file is not even opened
        write_json_atomic(path, {"x": object()})
    assert path.read_text() == "old content"


def test_modes_are_kept_and_new_files_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        fresh = tmp_path / "fresh.json"
        write_atomic(fresh, "{}")
        assert _mode(fresh) == 0o644, "a new file gets the umask's mode, not mkstemp's 0600"
        shared = tmp_path / "shared.json"
        shared.write_text("{}")
        shared.chmod(0o664)
        write_atomic(shared, "[]")
        assert _mode(shared) == 0o664 and shared.read_text() == "[]"
    finally:
        os.umask(old)


def test_plan_files_keep_their_mode(tmp_path):
    from autoplace.graph import random_dag

    path = tmp_path / "plan.json"
    path.write_text("{}")
    path.chmod(0o664)
    Plan.single(random_dag(5, seed=0)).save(path)
    assert _mode(path) == 0o664
    assert json.loads(path.read_text())["format"] == "autoplace.plan/1"


def test_output_paths_are_checked_before_any_work(tmp_path):
    missing = tmp_path / "no" / "such"
    t0 = time.perf_counter()
    clean_error(cli("plan", "--model", "gpt-tiny", "--cluster", "cpu-x2", "-o",
                    str(missing / "plan.json")), "-o/--out", "does not exist")
    p = cli("compare", "--model", "gpt-tiny", "--cluster", "cpu-x2", "--json",
            str(missing / "rows.json"))
    clean_error(p, "--json", "does not exist")
    assert "[compare]" not in p.stderr, "no planner ran"
    clean_error(cli("capture", "--model", "gpt-tiny", "-o", str(tmp_path)), "is a folder")
    assert time.perf_counter() - t0 < 60


def test_picture_formats_are_checked_before_drawing(single_plan_file, tmp_path):
    plan = single_plan_file  # planned as a user does (tests/conftest.py)
    clean_error(cli("show", str(plan), "--gantt", str(tmp_path / "g.txt")),
                "unknown picture format", ".txt", ".png")
    assert not (tmp_path / "g.txt").exists()
    clean_error(cli("compare", "--model", "gpt-tiny", "--cluster", "cpu-x2", "--plot",
                    str(tmp_path / "bars")), "unknown picture format")
    with pytest.raises(AutoplaceError, match="unknown picture format"):
        check_output_file(tmp_path / "x.bmp", "--curve", suffixes=("png",))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_folder_that_cannot_be_written_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        clean_error(cli("capture", "--model", "gpt-tiny", "-o", str(locked / "g.json")),
                    "not writable")
    finally:
        locked.chmod(0o755)


def test_default_outputs_never_replace_a_users_file(tmp_path):
    """profile's cluster.json and profile.json, plan's plan.json: kept unless --force."""
    for name in ("cluster.json", "profile.json", "plan.json"):
        (tmp_path / name).write_text(f"my own {name}")
    clean_error(cli("profile", "--model", "gpt-tiny", "--cluster", "cpu-x2", "--repeats", "1",
                    cwd=tmp_path), "profile.json", "exists", "--force")
    clean_error(cli("profile", "--model", "gpt-tiny", "--cluster", "cpu-x2", "--repeats", "1",
                    "-o", "mine.json", cwd=tmp_path), "cluster.json", "--force")
    clean_error(cli("plan", "--model", "gpt-tiny", "--cluster", "cpu-x2", "--planner", "single",
                    cwd=tmp_path), "plan.json", "--force")
    for name in ("cluster.json", "profile.json", "plan.json"):
        assert (tmp_path / name).read_text() == f"my own {name}"
    assert cli("plan", "--model", "gpt-tiny", "--cluster", "cpu-x2", "--planner", "single",
               "--force", cwd=tmp_path).returncode == 0
    assert json.loads((tmp_path / "plan.json").read_text())["format"] == "autoplace.plan/1"
    # named on the command line: the user chose to replace it
    assert cli("plan", "--model", "gpt-tiny", "--cluster", "cpu-x2", "--planner", "single",
               "-o", "plan.json", cwd=tmp_path).returncode == 0


def test_train_never_restarts_over_an_earlier_run(tmp_path):
    out = tmp_path / "run"
    args = ("train", "--model", "gpt-tiny", "--cluster", "cpu-x2", "--budget", "1up",
            "--max-groups", "4", "--out", str(out))
    assert cli(*args).returncode == 0
    ckpt = (out / "checkpoint.pt").read_bytes()
    clean_error(cli(*args), "holds an earlier run", "--resume", "--force")
    assert (out / "checkpoint.pt").read_bytes() == ckpt
    clean_error(cli("train", "--model", "gpt-tiny", "--cluster", "cpu-x2", "--resume",
                    "--out", str(tmp_path / "empty")), "no checkpoint.pt")
    p = cli(*args[:6], "2up", *args[7:], "--resume")
    assert p.returncode == 0, p.stderr
    assert cli(*args, "--force").returncode == 0


def test_the_library_train_never_restarts_over_an_earlier_run(tmp_path):
    from autoplace.errors import AutoplaceError
    from autoplace.policies import train

    out = tmp_path / "run"
    kw = {"policy": "seq2seq", "budget": "1", "out_dir": out, "max_groups": 4,
          "progress": False}
    train("gpt-tiny", "cpu-x2", **kw)
    ckpt = (out / "checkpoint.pt").read_bytes()
    with pytest.raises(AutoplaceError, match="holds an earlier run"):
        train("gpt-tiny", "cpu-x2", **kw)
    assert (out / "checkpoint.pt").read_bytes() == ckpt
    train("gpt-tiny", "cpu-x2", **kw, force=True)  # starts over, on purpose
    assert not (out / "tb").exists() or len(list((out / "tb").rglob("events*"))) == 1


@pytest.fixture
def single_plan(single_plan_file) -> Path:
    return single_plan_file  # tests/conftest.py: planned once per process, as a user does


def test_run_resumes_or_refuses_a_checkpoint_never_deletes_it(single_plan, tmp_path):
    ckpt = tmp_path / "ckpt"
    p = cli("run", str(single_plan), "--cluster", "cpu-x2", "--steps", "3", "--warmup", "1",
            "--no-reference", "--checkpoint-dir", str(ckpt))
    assert p.returncode == 0, p.stderr
    saved = (ckpt / "checkpoint.pt").read_bytes()
    clean_error(cli("run", str(single_plan), "--cluster", "cpu-x2", "--steps", "6",
                    "--no-reference", "--checkpoint-dir", str(ckpt)),
                "holds a checkpoint at step 3", "--resume")
    assert (ckpt / "checkpoint.pt").read_bytes() == saved
    p = cli("run", str(single_plan), "--cluster", "cpu-x2", "--steps", "6", "--warmup", "1",
            "--no-reference", "--checkpoint-dir", str(ckpt), "--resume")
    assert p.returncode == 0, p.stderr
    assert "resuming from step 3" in p.stdout
    clean_error(cli("run", str(single_plan), "--cluster", "cpu-x2", "--steps", "6",
                    "--checkpoint-dir", str(ckpt), "--resume"), "at step 6",
                "nothing is left to run")


def test_a_checkpoint_folder_in_use_is_refused(single_plan, tmp_path):
    import subprocess
    import sys

    from autoplace.executor.lifetime import LOCK_NAME, folder_lock

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (ckpt / LOCK_NAME).write_text(json.dumps({"pid": holder.pid, "started": "now"}))
        clean_error(cli("run", str(single_plan), "--cluster", "cpu-x2", "--steps", "3",
                        "--checkpoint-dir", str(ckpt), "--resume"),
                    "in use by another run", f"process {holder.pid}")
    finally:
        holder.kill()
        holder.wait()
    with folder_lock(ckpt):  # the holder is gone: its lock is taken over
        assert json.loads((ckpt / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert not (ckpt / LOCK_NAME).exists()
