"""Several processes, preemption, crashes and bad steps: nothing is lost but the work since the
last checkpoint, and a checkpoint restores onto any mesh."""

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from by_hand import CLI_FAST, two_processes
from conftest import ROOT, command_env, fast_config, losses, metrics_rows, run_module
from netns import two_hosts

from lm.program.checkpoint import Checkpointer, CheckpointNotWritten
from lm.program.faults import Faults
from lm.program.steps import setup
from lm.training.loop import TrainingHalted, train

MESH = dict(mesh__data=2, mesh__fsdp=2, mesh__tensor=2)


def cli_args(corpus, workdir, *extra):
    return ["--config=configs/tiny.py", f"--config.data.path={corpus}", f"--workdir={workdir}", *CLI_FAST, *extra]


def restore(workdir, step, mesh: dict, devices=None, corpus=None):
    """The checkpointed state at `step` placed on `mesh`, fetched to the host."""
    trainer = setup(fast_config(corpus, **{f"mesh__{k}": v for k, v in {"data": 1, **mesh}.items()}), 256, devices)
    state, _ = Checkpointer(workdir / "checkpoints").restore(trainer.abstract_sharded_state(), step)
    return jax.device_get(state)


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.slow
def test_two_processes_match_one_and_their_checkpoint_restores_on_other_meshes(tmp_path, small_corpus):
    start = time.perf_counter()
    launched = run_module(
        "lm.launch", "--processes=2", "--devices_per_process=4", "--",
        sys.executable, "-m", "lm.train", *cli_args(small_corpus, tmp_path / "two", "--config.train.steps=5",
                                                   *[f"--config.{k.replace('__', '.')}={v}" for k, v in MESH.items()]),
    )
    wall = time.perf_counter() - start
    assert launched.returncode == 0, launched.stdout[-3000:]
    assert "[0] model:" in launched.stdout and "mesh {'data': 2, 'stage': 1, 'context': 1, 'expert': 1, 'fsdp': 2, 'tensor': 2}" in launched.stdout
    print(f"2 processes x 4 devices, 5 steps: {wall:.1f} s wall")

    train(fast_config(small_corpus, train__steps=5, **MESH), tmp_path / "one")
    two, one = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert sorted(two) == [1, 2, 3, 4, 5]
    np.testing.assert_allclose([two[s] for s in range(1, 6)], [one[s] for s in range(1, 6)], rtol=1e-5)

    # Written by 2 processes x {data 2, fsdp 2, tensor 2}; read by 1 process on three other meshes.
    on_one_device = restore(tmp_path / "two", 5, {}, jax.devices()[:1], small_corpus)
    assert_trees_equal(restore(tmp_path / "two", 5, {"fsdp": 8}, corpus=small_corpus), on_one_device)
    assert_trees_equal(restore(tmp_path / "two", 5, {"fsdp": 4}, jax.devices()[:4], small_corpus), on_one_device)
    # and it is the state the one-process run reached (same maths, other reduction order)
    reference = restore(tmp_path / "one", 5, {}, jax.devices()[:1], small_corpus)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), on_one_device, reference)


@pytest.mark.slow
def test_sigterm_checkpoints_the_current_step_exits_0_and_resumes(tmp_path, small_corpus):
    workdir = tmp_path / "run"
    env = command_env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lm.train", *cli_args(small_corpus, workdir, "--config.train.steps=10000")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    stopped = int(stdout.split("SIGTERM: stopped after step ")[1].split(";")[0])
    assert stopped >= 3 and [p.name for p in (workdir / "checkpoints").iterdir()] == [str(stopped)]
    assert max(losses(workdir)) == stopped

    resumed = run_module("lm.train", *cli_args(small_corpus, workdir, f"--config.train.steps={stopped + 2}"))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from step {stopped}" in resumed.stdout
    assert max(losses(workdir)) == stopped + 2


@pytest.mark.slow
def test_sigkill_during_a_save_and_a_truncated_checkpoint_lose_only_the_work_since_the_previous(tmp_path, small_corpus):
    every = ["--config.checkpoint.every_steps=10"]
    straight = run_module("lm.train", *cli_args(small_corpus, tmp_path / "straight", "--config.train.steps=30", *every))
    assert straight.returncode == 0, straight.stderr
    expected = losses(tmp_path / "straight")

    work = tmp_path / "crashed"
    killed = run_module("lm.train", *cli_args(small_corpus, work, "--config.train.steps=30", *every, "--debug_kill_during_save_at_step=20"))
    assert killed.returncode == -9, killed.stderr
    assert Checkpointer(work / "checkpoints").latest_step() == 10  # the half-written 20 is not taken

    resumed = run_module("lm.train", *cli_args(small_corpus, work, "--config.train.steps=30", *every))
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from step 10" in resumed.stdout
    np.testing.assert_array_equal([losses(work)[s] for s in range(11, 31)], [expected[s] for s in range(11, 31)])

    def resumes_from_20_saying(why: str) -> None:
        """The damaged step 30 is reported in one line, kept aside, and step 20 used: same losses."""
        again = run_module("lm.train", *cli_args(small_corpus, work, "--config.train.steps=30", *every))
        assert again.returncode == 0, again.stderr
        warnings = [line for line in again.stdout.splitlines() if line.startswith("warning: checkpoint")]
        assert len(warnings) == 1 and why in warnings[0], again.stdout
        assert "resuming from step 20" in again.stdout and (work / "checkpoints" / "30.unreadable").is_dir()
        np.testing.assert_array_equal([losses(work)[s] for s in range(21, 31)], [expected[s] for s in range(21, 31)])

    # Damage the newest checkpoint: the run says so in one line, keeps it aside and uses step 20.
    biggest = max((p for p in (work / "checkpoints" / "30").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    os.truncate(biggest, biggest.stat().st_size // 2)
    resumes_from_20_saying("30 cannot be read")

    # A checkpoint without the data iterator's position is damaged too: resuming there would
    # replay the data from its start (it silently did), so step 20 is used and the losses match.
    shutil.rmtree(work / "checkpoints" / "30" / "data")
    shutil.rmtree(work / "checkpoints" / "30.unreadable")
    third = run_module("lm.train", *cli_args(small_corpus, work, "--config.train.steps=30", *every))
    assert third.returncode == 0, third.stderr
    assert "30 has no data iterator position" in third.stdout and "resuming from step 20" in third.stdout
    np.testing.assert_array_equal([losses(work)[s] for s in range(21, 31)], [expected[s] for s in range(21, 31)])

    # Flipped bits: one byte of the newest checkpoint's largest array file changed. The file still
    # decodes (negative control: without the saved checksums it restores, to other values), but its
    # checksums do not match: set aside in one line, step 20 used, the same losses.
    shutil.rmtree(work / "checkpoints" / "30.unreadable")
    arrays = [p for p in (work / "checkpoints" / "30" / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    biggest = max(arrays, key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 0x10
    biggest.write_bytes(bytes(data))
    unchecked = tmp_path / "unchecked"
    shutil.copytree(work / "checkpoints" / "30", unchecked / "30")
    shutil.rmtree(unchecked / "30" / "checksums")
    abstract = setup(fast_config(small_corpus), 256, jax.devices()[:1]).abstract_sharded_state()
    flipped, _ = Checkpointer(unchecked).restore(abstract, 30)
    with pytest.raises(AssertionError):
        assert_trees_equal(jax.device_get(flipped), restore(tmp_path / "straight", 30, {}, jax.devices()[:1], small_corpus))
    resumes_from_20_saying("read back with other bits than were saved")


def test_a_full_disk_stops_the_run_in_one_line_and_the_previous_checkpoint_resumes(tmp_path, small_corpus, monkeypatch, capfd):
    """On a 3 MB filesystem (a tmpfs the test mounts) a checkpoint of 1.3 MB fits twice: the
    third save is refused before it starts; with the free-space check fooled, it fails inside
    orbax's asynchronous writer (ENOSPC). Either way the run stops with one error (exit code 5)
    naming the newest checkpoint, leaves no step directory a resume could take as complete, and
    once space is freed the same command resumes with the losses of a run that never failed."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root): the ENOSPC paths are not exercised")
    try:
        config = fast_config(small_corpus, train__steps=30, checkpoint__every_steps=5, checkpoint__keep=10)
        devices = jax.devices()[:1]
        train(config, tmp_path / "straight", devices)
        expected = losses(tmp_path / "straight")
        capfd.readouterr()
        for name, fooled in (("refused", False), ("failed", True)):
            if fooled:  # the check sees a huge disk: the write itself meets ENOSPC
                real = shutil.disk_usage
                monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 40))
            with pytest.raises(CheckpointNotWritten) as stopped:
                train(config, disk / name, devices)
            assert stopped.value.exit_code == 5
            message = str(stopped.value)
            assert ("no space for the checkpoint of step 15" if not fooled else "the checkpoint of step 15 could not be written") in message
            assert "the newest complete checkpoint is step 10" in message and "\n" not in message
            assert sorted(p.name for p in (disk / name / "checkpoints").iterdir()) == ["10", "5"]  # no temporary left
            assert "Traceback" not in capfd.readouterr().err
            monkeypatch.undo()
            subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)  # the user makes room
            train(config, disk / name, devices)
            assert Checkpointer(disk / name / "checkpoints").latest_step() == 30
            np.testing.assert_array_equal([losses(disk / name)[s] for s in range(11, 31)], [expected[s] for s in range(11, 31)])
            shutil.rmtree(disk / name)
            subprocess.run(["mount", "-o", "remount,size=3m", str(disk)], check=True)
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_nonfinite_steps_are_skipped_or_stop_the_run_with_the_last_good_state(tmp_path, small_corpus):
    one = jax.devices()[:1]
    skip = train(fast_config(small_corpus, train__steps=6), tmp_path / "skip", one, faults=Faults(nonfinite_steps=(3,)))
    rows = {r["step"]: r for r in metrics_rows(tmp_path / "skip") if "loss" in r}
    assert [rows[s]["skipped_steps"] for s in range(1, 7)] == [0, 0, 1, 1, 1, 1] and np.isfinite(skip["loss"])
    state = restore(tmp_path / "skip", 6, {}, one, small_corpus)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state.params))

    with pytest.raises(TrainingHalted, match=r"step 4: non-finite loss or gradients \(train.on_nonfinite=stop\).*checkpointed at step 4"):
        train(fast_config(small_corpus, train__steps=6, optim__decay_steps=6, train__on_nonfinite="stop"), tmp_path / "stop", one, faults=Faults(nonfinite_steps=(4,)))
    halted = restore(tmp_path / "stop", 4, {}, one, small_corpus)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(halted.params))
    # nothing of step 4 was applied: the parameters are those after step 3 of a run that ends
    # before its poisoned step (the same program, so equal to the bit)
    train(fast_config(small_corpus, train__steps=3, optim__decay_steps=6, train__on_nonfinite="stop"), tmp_path / "clean", one,
          faults=Faults(nonfinite_steps=(4,)))
    assert_trees_equal(halted.params, restore(tmp_path / "clean", 3, {}, one, small_corpus).params)


def test_too_many_nonfinite_steps_in_a_row_end_the_run(tmp_path, small_corpus):
    c = fast_config(small_corpus, train__steps=8, train__max_consecutive_nonfinite=2)
    with pytest.raises(TrainingHalted, match=r"2 steps in a row had non-finite loss or gradients"):
        train(c, tmp_path, jax.devices()[:1], faults=Faults(nonfinite_steps=(2, 3)))


@pytest.mark.slow
def test_a_lost_peer_ends_every_survivor_in_one_line_and_all_restarted_resume(tmp_path, small_corpus):
    """Two processes started by hand, as two hosts in network namespaces where they can be made
    (else on loopback); one is SIGKILLed (a worker after a step, then the coordinator in the middle
    of a save): the survivor exits non-zero within the peer timeout with one line naming the lost
    process, on a line of its own after the progress bar's (JAX's own abort, its C++ stack trace
    and the Python traceback are replaced), the last complete checkpoint is intact, and a restart
    of both resumes from it with the losses of an uninterrupted run."""
    work = tmp_path / "run"
    runs = []
    with two_hosts(or_loopback=True) as hosts:
        for n, (victim, fault, lost) in enumerate([(1, "--debug_kill_at_step=8", "1"), (0, "--debug_kill_during_save_at_step=10", "0 (the coordinator)")]):
            (tmp_path / str(n)).mkdir()
            results = two_processes(small_corpus, work, tmp_path / str(n), hosts=hosts, victim=victim, fault=fault)
            survivor = results[1 - victim]
            assert results[victim].code == -signal.SIGKILL, results[victim].text[-2000:]
            assert survivor.code not in (0, None) and survivor.at - results[victim].at < 60, survivor.text[-3000:]
            line = (f"error: lost process {lost} of 2 (it stopped answering: killed, crashed, frozen, its host down or the network to it cut); "
                    f"process {1 - victim} stopped too. Start all 2 processes again: they resume from the last complete checkpoint")
            assert survivor.said()[-1] == line, survivor.said()[-5:]
            if victim == 1:  # the survivor drew the progress bar: the line is its own, in bytes
                assert "step/s" in survivor.text and survivor.log.endswith(b"\n" + line.encode() + b"\n"), survivor.log[-600:]
            assert not any(w in survivor.text for w in ("Traceback", "stack trace", "client.h", "Fatal Python")), survivor.text[-3000:]
            assert Checkpointer(work / "checkpoints").latest_step() == 5  # the save of step 10 never completed
            runs.append(losses(work))
        assert (work / "checkpoints" / "10.orbax-checkpoint-tmp").exists() or not (work / "checkpoints" / "10").exists()

        (tmp_path / "restart").mkdir()
        restarted = two_processes(small_corpus, work, tmp_path / "restart", hosts=hosts)
    assert [r.code for r in restarted] == [0, 0], restarted[0].text[-3000:]
    assert "resuming from step 5" in restarted[0].text
    final = losses(work)
    assert sorted(final) == list(range(1, 21))
    # bitwise: steps 6-8 as each of the three runs computed them from the same checkpoint
    assert [runs[0][s] for s in (6, 7, 8)] == [runs[1][s] for s in (6, 7, 8)] == [final[s] for s in (6, 7, 8)]
    train(fast_config(small_corpus, train__steps=20, mesh__data=2, mesh__fsdp=4), tmp_path / "straight")
    straight = losses(tmp_path / "straight")
    np.testing.assert_allclose([final[s] for s in range(1, 21)], [straight[s] for s in range(1, 21)], rtol=1e-5)


def test_launcher_prefixes_output_and_stops_everyone_when_one_process_fails(tmp_path):
    said = tmp_path / "process 0 said hello"
    worker = (
        "import pathlib, sys, time; i = int(sys.argv[-1].split('=')[1]); print('hello from', i, flush=True); "
        f"seen = pathlib.Path({str(said)!r}); "
        "seen.touch() if i == 0 else [time.sleep(0.05) for _ in range(200) if not seen.exists()]; "
        "sys.exit(3) if i == 1 else time.sleep(120)"
    )
    # Process 1 fails once process 0 has printed (on a loaded machine it could otherwise be stopped
    # before it started); the survivor sleeps 120 s: the launcher must stop it well before (else
    # the timeout fails the test).
    out = run_module("lm.launch", "--processes=2", "--devices_per_process=1", "--", sys.executable, "-c", worker, timeout=30)
    assert out.returncode == 3
    assert "[0] hello from 0" in out.stdout and "[1] hello from 1" in out.stdout


@pytest.mark.slow
def test_one_writer_per_run_directory_and_a_dead_holders_lock_is_taken_over(tmp_path, capsys, monkeypatch):
    """A second lm.train on a directory in use is refused in one line naming the holder, and the
    first trains on undisturbed; the lock of a holder that was SIGKILLed (its pid gone from this
    host) is taken over, said in one line, and released when the run ends."""
    import socket

    from conftest import ROOT, run_cli

    from lm import paths
    from lm import train as lm_train

    workdir = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "lm.train", "--config=configs/tiny.py", f"--workdir={workdir}",
                              "--config.train.steps=400", "--config.train.log_every=1"], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lock = workdir / paths.LOCK_FILE
    try:
        deadline = time.time() + 120
        while not (workdir / "metrics.jsonl").exists() and time.time() < deadline:
            time.sleep(0.5)
        assert lock.exists() and json.loads(lock.read_text())["pid"] == first.pid
        second = run_cli(capsys, lm_train.main, "--config=configs/tiny.py", f"--workdir={workdir}", "--config.train.steps=5")
        assert second.returncode == 2 and f"is in use by lm.train (pid {first.pid} on " in second.stderr
        assert len(second.stderr.strip().splitlines()) == 1 and "Traceback" not in second.stderr
        assert first.poll() is None  # undisturbed: still training
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert json.loads(lock.read_text())["pid"] == first.pid  # a SIGKILLed holder leaves its lock behind
    third = run_cli(capsys, lm_train.main, "--config=configs/tiny.py", f"--workdir={workdir}", "--config.train.steps=2")
    assert third.returncode == 0, third.stderr
    assert f"taking over the lock of lm.train (pid {first.pid} on " in third.stdout
    assert not lock.exists()  # released at the end
    # Negative control: a live holder (this very process) is not taken over: by the kernel's lock,
    with paths.held(workdir, "--workdir", "a test"):
        refused = run_cli(capsys, lm_train.main, "--config=configs/tiny.py", f"--workdir={workdir}", "--config.train.steps=2")
    assert refused.returncode == 2 and "is in use by a test" in refused.stderr
    # and, on a file system without kernel locks, by the record's pid (a zombie's would be gone).
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(paths.fcntl, "flock", no_locks)
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "command": "a test", "since": "now"}))
    refused = run_cli(capsys, lm_train.main, "--config=configs/tiny.py", f"--workdir={workdir}", "--config.train.steps=2")
    assert refused.returncode == 2 and "is in use by a test" in refused.stderr
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": first.pid, "command": "a test", "since": "now"}))
    with paths.held(workdir, "--workdir", "a second test"):
        assert json.loads(lock.read_text())["command"] == "a second test"


def test_a_loss_spike_rolls_back_once_and_trains_on_as_if_its_batches_never_were(tmp_path, small_corpus):
    """Batches 22-24 hold random tokens (a damaged shard): their losses jump, the third in a row
    rolls the run back to step 20, those batches are recorded and skipped, and every later loss
    equals a run that resumed at step 20 with them listed as skipped from the start. Without
    `train.spike_rollback` the same run trains straight through them."""
    devices = jax.devices()[:1]
    kw = dict(train__steps=40, optim__decay_steps=40, checkpoint__every_steps=10, train__spike_rollback=True, train__spike_factor=1.2,
              train__spike_window=10, train__spike_steps=3)
    garbled = Faults(garbled_batches=(22, 23, 24))
    train(fast_config(small_corpus, **kw), tmp_path / "spiked", devices, faults=garbled)
    rows = metrics_rows(tmp_path / "spiked")
    assert [(r["step"], r["spike_rollbacks"]) for r in rows if "spike_rollbacks" in r] == [(24, 1)]
    first_pass = {r["step"]: r["loss"] for r in rows[: rows.index({"step": 24, "spike_rollbacks": 1})] if "loss" in r}
    recent = np.mean([first_pass[s] for s in range(12, 22)])
    assert all(first_pass[s] > 1.2 * recent for s in (22, 23, 24)) and first_pass[21] < 1.2 * recent
    record = json.loads((tmp_path / "spiked" / "skipped_batches.json").read_text())
    assert [(r["steps"], r["batches"], r["rolled_back_to"]) for r in record] == [([22, 23, 24], [22, 23, 24], 20)]

    reference = tmp_path / "reference"
    train(fast_config(small_corpus, **{**kw, "train__steps": 20}), reference, devices)
    (reference / "skipped_batches.json").write_text(json.dumps([{"batches": [22, 23, 24]}]))
    train(fast_config(small_corpus, **kw), reference, devices)
    spiked, expected = losses(tmp_path / "spiked"), losses(reference)
    assert [spiked[s] for s in range(1, 41)] == [expected[s] for s in range(1, 41)]

    train(fast_config(small_corpus, **{**kw, "train__spike_rollback": False, "train__steps": 26}), tmp_path / "off", devices, faults=garbled)
    assert not (tmp_path / "off" / "skipped_batches.json").exists()
    assert losses(tmp_path / "off")[24] == first_pass[24]  # trained on the garbled batches


@pytest.mark.slow
def test_a_step_that_never_completes_ends_every_process_with_its_stacks_written(tmp_path, small_corpus):
    """Process 1's data read blocks at step 7 (alive, heartbeating: the lost-peer check sees
    nothing): within train.step_timeout_s plus a bound both processes write their Python stacks
    to WORKDIR/hang-<process>.txt and end in one line naming the step and the file; a restart
    resumes from the last complete checkpoint."""
    work = tmp_path / "run"
    ended = two_processes(small_corpus, work, tmp_path, victim=1, fault="--debug_stall_at_step=7",
                          extra=("--config.train.step_timeout_s=8",), timeout_s=200)
    for me, result in enumerate(ended):
        assert result.code == 4, result.text[-3000:]
        hang = work / f"hang-{me}.txt"
        line = result.said()[-1]
        assert line.startswith(f"error: process {me} of 2: ") and "did not complete within 8 s (train.step_timeout_s" in line, line
        assert f"this process's Python stacks are in {hang}" in line and "Traceback" not in result.text
        stacks = hang.read_text()
        assert "thread MainThread:" in stacks and "meshlm-watchdog" in stacks
    assert "in _stall" in (work / "hang-1.txt").read_text()  # where it hung
    assert "the loop was reading the batch of step 7" in (work / "hang-1.txt").read_text()
    assert abs(ended[0].at - ended[1].at) < 20
    assert ended[0].log.endswith(b"\n" + ended[0].said()[-1].encode() + b"\n")  # off the progress bar's line
    assert Checkpointer(work / "checkpoints").latest_step() == 5
    (tmp_path / "restart").mkdir()
    restarted = two_processes(small_corpus, work, tmp_path / "restart", steps=8)
    assert [r.code for r in restarted] == [0, 0] and "resuming from step 5" in restarted[0].text, restarted[0].text[-2000:]


def test_the_watchdog_times_steps_from_the_first_completed_one_not_compilation_or_restores(tmp_path, small_corpus):
    """A first step 3 s slow (as compilation, a restore or a cold data read make it) under a 1-s
    step timeout trips nothing, nor does the slow first step after resuming from a checkpoint, nor
    evaluation and checkpoint writes; the limit derived by default is at least the floor."""
    from lm.training import watchdog

    config = fast_config(small_corpus, train__steps=6, train__step_timeout_s=1.0, checkpoint__every_steps=3, train__eval_every=3)
    train(config, tmp_path, jax.devices()[:1], faults=Faults(stall_at_step=1, stall_s=3.0))
    resumed = fast_config(small_corpus, train__steps=9, train__step_timeout_s=1.0, checkpoint__every_steps=3, train__eval_every=3)
    train(resumed, tmp_path, jax.devices()[:1], faults=Faults(stall_at_step=7, stall_s=3.0))
    assert sorted(losses(tmp_path)) == list(range(1, 10)) and not list(tmp_path.glob("hang-*.txt"))

    auto = watchdog.StepWatchdog(None, tmp_path)
    try:
        assert auto.limit_s() == watchdog.FLOOR_S
        for step in range(1, 6):
            auto.completed(step)
        assert auto.limit_s() == watchdog.FLOOR_S  # 10 x a step of microseconds is below the floor
        auto._intervals.extend([60.0] * 10)
        assert auto.limit_s() == 600.0
    finally:
        auto.close()


@pytest.mark.slow
def test_a_run_killed_with_its_launcher_restarts_at_once(tmp_path, small_corpus):
    """lm.launch and its trainers SIGKILLed together (a scheduler's kill): the trainer that held
    the run's lock is left a zombie under a parent that does not reap it (this test, made the
    subreaper of its orphans, as a container's PID 1 that never reaps). A restart at once runs
    and resumes. Negative control: that zombie still answers `kill -0`, which is all the lock's
    pid check used to ask."""
    import ctypes

    from lm import paths

    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_CHILD_SUBREAPER = 36
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    work = tmp_path / "run"
    launch = [sys.executable, "-m", "lm.launch", "--processes=2", "--devices_per_process=4", "--", sys.executable, "-m", "lm.train",
              *cli_args(small_corpus, work, "--config.train.steps=12", "--config.mesh.data=2", "--config.mesh.fsdp=4", "--config.checkpoint.every_steps=5")]
    env = command_env()
    zombies = []
    try:
        with open(tmp_path / "first.log", "wb") as log:
            first = subprocess.Popen(launch, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.monotonic() + 300
            while not (work / "checkpoints" / "5").is_dir() and time.monotonic() < deadline and first.poll() is None:
                time.sleep(0.2)
            holder = json.loads((work / paths.LOCK_FILE).read_text())["pid"]
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and paths._alive(holder):
            time.sleep(0.1)
        state = open(f"/proc/{holder}/stat").read().rpartition(")")[2].split()[0]
        assert state == "Z" and os.kill(holder, 0) is None  # a zombie, "alive" to kill -0
        zombies = [holder]
        restart = subprocess.run(launch, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert restart.returncode == 0, restart.stdout[-3000:]
        assert "which is gone" in restart.stdout and "resuming from step 5" in restart.stdout, restart.stdout[-3000:]
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        for pid in [p for p in _orphans_of_this_process()] + zombies:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
    assert sorted(losses(work)) == list(range(1, 13))


def _orphans_of_this_process() -> list[int]:
    """Zombie children of this process (orphans it adopted as their subreaper)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            fields = stat.read_text().rpartition(")")[2].split()
            if fields[0] == "Z" and int(fields[1]) == os.getpid():
                found.append(int(stat.parent.name))
    return found


def test_a_final_line_starts_a_line_of_its_own_after_a_progress_bar_in_a_file():
    """The bar written to a file is lines, so a line written after it by anyone starts a line.
    Negative control: tqdm's own redraws to a file leave the next line glued on (the issue's log:
    `... tok_s=1,675]error: lost process 1 of 2 ...`)."""
    import io

    from tqdm import tqdm

    from lm import progress

    for make, glued in ((lambda out: progress.bar(stream=out, total=100, unit="step"), False),
                        (lambda out: tqdm(file=out, total=100, unit="step", mininterval=0), True)):
        out = io.StringIO()
        bar = make(out)
        for _ in range(99):
            bar.update(1)
        bar.refresh()
        out.write("error: lost process 1 of 2\n")  # the process dies with its bar open
        assert ("\n" + "error: lost" not in out.getvalue()) == glued and ("\r" in out.getvalue()) == glued, repr(out.getvalue()[-200:])


def test_a_final_line_after_a_bar_left_open_on_a_terminal_starts_a_line_of_its_own(monkeypatch):
    """An error raised with the bar still drawn on a terminal (a watchdog, a lost collective):
    the bar's line is ended first. Control: with no bar open nothing extra is written."""
    import io

    from lm import progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen, errors = Terminal(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", errors)
    bar = progress.bar(stream=screen, total=10, unit="step")
    bar.update(3)
    progress.final_line("error: one")
    assert screen.getvalue().endswith("\n") and "\r" in screen.getvalue() and errors.getvalue() == "error: one\n"
    bar.close()
    before = screen.getvalue()
    progress.final_line("error: two")
    assert screen.getvalue() == before and errors.getvalue().endswith("error: two\n")


def test_the_watchdog_holds_off_while_a_debugger_traces_the_loop():
    """A breakpoint in the loop is not a hang: with a trace function on the main thread (as pdb
    sets) the watchdog does not fire; without one (control) it would."""
    import threading

    from lm.training import watchdog

    seen = []

    def look():
        time.sleep(0.3)
        seen.append(watchdog._debugged())

    def tracer(frame, event, arg):
        return tracer

    def stepping():  # a frame entered under the trace function, as the loop's under pdb
        deadline = time.monotonic() + 0.6
        while time.monotonic() < deadline:
            pass

    looking = threading.Thread(target=look)
    looking.start()
    sys.settrace(tracer)
    try:
        stepping()
    finally:
        sys.settrace(None)
    looking.join()
    assert seen == [True] and not watchdog._debugged()
