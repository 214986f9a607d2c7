"""Real hosts: two processes as two hosts in network namespaces on a veth link (skipped with the
reason where namespaces cannot be made). They find each other through the interface that routes
to the coordinator; a wrong one ends both in one line; a cut link ends both by themselves, and a
restart resumes exactly."""

import socket
import subprocess
import sys

import numpy as np
import pytest
from by_hand import at_step, two_processes
from conftest import ROOT, fast_config, losses

from lm.program.checkpoint import Checkpointer
from lm.training.loop import train
from netns import two_hosts
from sharding import hosts as lm_hosts
from sharding.stderr_guard import lost_processes


@pytest.mark.slow
def test_two_hosts_train_as_one_process_a_cut_link_ends_both_in_a_line_each_and_a_restart_resumes_exactly(tmp_path, small_corpus):
    work = tmp_path / "run"
    with two_hosts() as hosts:
        (tmp_path / "cut").mkdir()
        cut = at_step(work, 8, hosts.cut)
        ended = two_processes(small_corpus, work, tmp_path / "cut", hosts=hosts, during=cut)
        assert cut.done, ended[0].text[-2000:]
        for me, peer in ((0, "1"), (1, "0 (the coordinator)")):
            assert ended[me].code not in (0, None), ended[me].text[-2000:]
            assert ended[me].at - cut.done[0] < 10 + 30, f"process {me} ended {ended[me].at - cut.done[0]:.0f} s after the cut"
            assert ended[me].said()[-1].startswith(f"error: lost process {peer} of 2 (it stopped answering: killed, crashed, frozen, "
                                                   "its host down or the network to it cut)"), ended[me].said()[-3:]
            assert ended[me].log.endswith(b"\n" + ended[me].said()[-1].encode() + b"\n")
            assert "Traceback" not in ended[me].text
        cut_losses = losses(work)
        latest = Checkpointer(work / "checkpoints").latest_step()
        assert latest is not None and latest >= 5 and max(cut_losses) >= 8

        hosts.mend()
        (tmp_path / "restart").mkdir()
        restarted = two_processes(small_corpus, work, tmp_path / "restart", hosts=hosts)
        (tmp_path / "straight").mkdir()
        straight = two_processes(small_corpus, tmp_path / "uncut", tmp_path / "straight", hosts=hosts)
    assert [r.code for r in restarted + straight] == [0, 0, 0, 0], restarted[0].text[-3000:]
    assert f"resuming from step {latest}" in restarted[0].text
    final = losses(work)
    assert sorted(final) == list(range(1, 21))
    # bitwise: the interrupted and resumed run is the uninterrupted one, step for step
    uncut = losses(tmp_path / "uncut")
    assert [final[s] for s in range(1, 21)] == [uncut[s] for s in range(1, 21)]
    train(fast_config(small_corpus, train__steps=20, mesh__data=2, mesh__fsdp=4), tmp_path / "one")
    one = losses(tmp_path / "one")
    np.testing.assert_allclose([final[s] for s in range(1, 21)], [one[s] for s in range(1, 21)], rtol=1e-5)


@pytest.mark.slow
def test_hosts_on_the_wrong_interface_each_end_in_one_line_naming_the_addresses(tmp_path, small_corpus):
    """Both told to use loopback (as a host name resolving to 127.0.1.1 did before): each end
    within a bound in one line naming every process's address and what to set."""
    with two_hosts() as hosts:
        ended = two_processes(small_corpus, tmp_path / "run", tmp_path, hosts=hosts, extra=("--interface=lo",), timeout_s=200)
    for me, result in enumerate(ended):
        assert result.code == 2, result.text[-2000:]
        line = result.said()[-1]
        assert line.startswith(f"error: process {me} of 2 could not connect to the others' CPU collectives"), line
        assert "addresses tried: process 0 at 127.0.0.1 (--interface=lo); process 1 at 127.0.0.1 (--interface=lo)" in line
        assert "--interface=NAME (or GLOO_SOCKET_IFNAME=NAME; for NCCL on GPUs, NCCL_SOCKET_IFNAME)" in line
        assert "Traceback" not in result.text
    assert max(r.at for r in ended) - min(r.at for r in ended) < 30


def test_the_advertised_address_is_the_route_to_the_coordinator_or_the_named_interface(monkeypatch):
    assert lm_hosts.advertised("127.0.0.1:1234", None) == ("127.0.0.1", "the route to the coordinator 127.0.0.1:1234")
    assert lm_hosts.advertised("10.1.2.3:9", "lo") == ("127.0.0.1", "--interface=lo")
    assert lm_hosts.advertised("10.1.2.3:9", "192.0.2.7") == ("192.0.2.7", "--interface=192.0.2.7")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert lm_hosts.advertised("10.1.2.3:9", None) == ("127.0.0.1", "GLOO_SOCKET_IFNAME=lo")
    with pytest.raises(ValueError, match=r"interface 'nosuch0': this host has no such network interface \(it has lo"):
        lm_hosts.advertised("10.1.2.3:9", "nosuch0")
    # Negative control: what JAX's gloo advertised before, the host name's address, is not the route's.
    with two_hosts() as hosts:
        script = f"from sharding import hosts; print(hosts.route_to('{hosts[0].address}:1'))"
        routed = subprocess.run([*hosts[1].run, sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT)
        assert routed.stdout.strip() == hosts[1].address != socket.gethostbyname(socket.gethostname())


HEARTBEAT_TIMED_OUT = (
    "F1128 06:33:58.927658    7038 client.h:80] Terminating process because the JAX distributed service detected fatal errors. "
    "absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded\n\nRPC: /xla.coordination.CoordinationService/Heartbeat\n"
)


def test_a_process_whose_heartbeats_no_longer_reach_the_coordinator_has_lost_it():
    """Seen on the far side of a cut link (above): JAX's status names no task, only the RPC."""
    assert lost_processes(HEARTBEAT_TIMED_OUT, 1) == [0]
    assert lost_processes(HEARTBEAT_TIMED_OUT.replace("Heartbeat", "PollForError"), 1) is None  # control


def test_the_guard_names_an_unreachable_coordinator_and_adds_nothing_after_a_processs_own_last_line():
    """JAX aborts a process whose coordinator never answers (`RegisterTask`, seen with a closed
    port) and every survivor after a process ended by its own line (a watchdog's): the guard says
    the first in one line, and adds nothing to the second (control: without the process's own
    line it names the lost process)."""
    guard = str(ROOT / "sharding" / "stderr_guard.py")
    never = ("F1128 06:43:03.728028   14768 client.h:80] Terminating process because the JAX distributed service detected fatal errors. "
             "absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded\n\nRPC: /xla.coordination.CoordinationService/RegisterTask\n*** Check failure stack trace: ***\n")
    out = subprocess.run([sys.executable, guard, "1", "2", "10.0.0.1:1234", "300"], input=never.encode(), capture_output=True).stdout.decode()
    assert out == ("error: process 1 of 2: the coordinator at 10.0.0.1:1234 did not answer within 300 s; start process 0 there "
                   "(its host and port as this host reaches them, in --coordinator) and the others within that time\n")
    lost = HEARTBEAT_TIMED_OUT + "*** Check failure stack trace: ***\n    @     0x7f6fed040634  absl::LogMessage::SendToLog()\n"
    own = "error: process 1 of 2: step 7 did not complete within 8 s\n"
    out = subprocess.run([sys.executable, guard, "1", "2", "10.0.0.1:1234", "300"], input=(own + lost).encode(), capture_output=True).stdout.decode()
    assert out == own
    out = subprocess.run([sys.executable, guard, "1", "2", "10.0.0.1:1234", "300"], input=lost.encode(), capture_output=True).stdout.decode()
    assert out.startswith("error: lost process 0 (the coordinator) of 2")
