"""Ctrl-C and SIGTERM between a temporary's making and its maker's hold: acted on, nothing left behind.

The signals here are real ones, sent to this process; only their moment is
chosen (right after the file is made), which a test from outside hits by chance.
"""

import os
import signal

import pytest

from pdiffcopy import sync
from pdiffcopy.engine.interrupts import held_back, let_through
from pdiffcopy.local import writerlocks


class Terminated(KeyboardInterrupt):
    pass


@pytest.fixture
def raising_sigterm():
    def terminate(signum, frame):
        raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_a_signal_inside_held_back_acts_at_its_end(raising_sigterm):
    reached_the_end = False
    with pytest.raises(Terminated):
        with held_back():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler gets its chances to run here
                pass
            reached_the_end = True
    assert reached_the_end


def test_let_through_acts_at_once_and_on_one_held_back_before_it(raising_sigterm):
    steps = []
    with pytest.raises(Terminated):
        with held_back():
            with let_through():
                steps.append("let through")
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(1000):
                    pass
                steps.append("after the signal")
    assert steps == ["let through"]
    with pytest.raises(Terminated):
        with held_back():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):
                pass
            steps.append("held")
            with let_through():
                steps.append("never")
    assert steps == ["let through", "held"]


def test_the_handlers_are_given_back(raising_sigterm):
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    with held_back():
        with held_back():
            pass
    assert {signum: signal.getsignal(signum) for signum in before} == before


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_right_after_the_temporary_is_made_leaves_nothing_behind(tmp_path, monkeypatch,
                                                                             raising_sigterm, signum):
    source = tmp_path / "source.img"
    source.write_bytes(os.urandom(1 << 20))
    target = tmp_path / "out" / "new.img"
    target.parent.mkdir()
    made = []
    create_held = writerlocks.create_held

    def create_then_signal(name, mode, dir_fd=None):
        fd = create_held(name, mode, dir_fd=dir_fd)
        made.append(name)
        os.kill(os.getpid(), signum)
        return fd

    monkeypatch.setattr(writerlocks, "create_held", create_then_signal)
    with pytest.raises(KeyboardInterrupt):
        sync(str(source), str(target))
    assert made, "no temporary was made"
    assert list(target.parent.iterdir()) == []
