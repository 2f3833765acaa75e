"""Long commands: Ctrl-C stops them at once, and a log shows where they are."""

import io
import os
import signal
import subprocess
import sys
import time

import pytest
import tiny

from flashnorm_mlx.cli import common


def _start(*args):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "flashnorm_mlx", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _interrupt(proc, after_s: float):
    """SIGINT `after_s` into the run (still working then): (rc, stderr lines,
    seconds from the signal to the exit)."""
    time.sleep(after_s)
    if proc.poll() is not None:  # e.g. on a GPU: nothing left to interrupt
        assert proc.returncode == 0, proc.communicate()
        pytest.skip("the run ended before the signal: this machine is too fast")
    proc.send_signal(signal.SIGINT)
    sent = time.perf_counter()
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    return proc.returncode, err.strip().splitlines(), time.perf_counter() - sent


def _one_interrupt_line(command, rc, lines, seconds):
    assert rc == 130, (rc, lines)
    assert seconds < 5, (seconds, lines)
    assert not any("Traceback" in l for l in lines), lines
    # Stage lines may come before it; one line says what was interrupted.
    stopped = [l for l in lines if "interrupted" in l]
    assert len(stopped) == 1 and lines[-1] == stopped[0], lines
    assert stopped[0].startswith(f"flashnorm-mlx {command}: interrupted"), lines
    assert all(l.startswith(f"flashnorm-mlx {command}: ") for l in lines), lines


def test_ctrl_c_stops_perplexity_at_once():
    # The embedded model: one batch of 4 windows is minutes of mx.eval here.
    proc = _start("perplexity")
    rc, lines, seconds = _interrupt(proc, 4)
    _one_interrupt_line("perplexity", rc, lines, seconds)


def test_ctrl_c_stops_a_requantizing_convert_and_leaves_nothing(tmp_path):
    out = tmp_path / "made" / "out"  # its parent is created, and must go too
    proc = _start("convert", "-o", str(out), "--requantize")
    rc, lines, seconds = _interrupt(proc, 4)
    _one_interrupt_line("convert", rc, lines, seconds)
    assert list(tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))


# --- a log of a long command: stages, and a line every ~10 s within one -------


def test_a_long_step_repeats_where_it_is(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(common.StageLog, "HEARTBEAT_S", 0.2)
    with common.StageLog("convert", enabled=True) as log:
        log.step("calibrating GPTQ: 0/16 windows")
        time.sleep(0.9)  # one long mx.eval: no step() comes
        log("calibrated GPTQ on 16 windows of 128 tokens")
    lines = err.getvalue().splitlines()
    still = [l for l in lines if "calibrating GPTQ: 0/16 windows: still" in l]
    assert len(still) >= 2, lines
    assert lines[-1].startswith("flashnorm-mlx convert: calibrated GPTQ"), lines


def test_a_fast_convert_prints_its_stages_not_a_line_per_layer(tmp_path):
    model = tiny.make_llama(tmp_path / "m", "gqa_untied")
    r = subprocess.run(
        [sys.executable, "-m", "flashnorm_mlx", "convert", str(model)]
        + ["-o", str(tmp_path / "out"), "-q", "--calib-seqs", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stderr.strip().splitlines()
    assert all(l.startswith("flashnorm-mlx convert: ") for l in lines), lines
    # Calibration is its own stage, not charged to the first layer group.
    assert "calibrated GPTQ on 2 windows" in lines[0], lines
    assert "folded and quantized 3 layer groups" in lines[1], lines
    assert "wrote 1 file(s)" in lines[2] and len(lines) == 3, lines


@pytest.mark.parametrize("stored", [False, True])
def test_the_convert_bar_says_copying_for_weights_kept_as_stored(
    stored, tmp_path, monkeypatch
):
    """Nothing is folded in a checkpoint kept as stored: the bar says so."""
    from flashnorm_mlx.loading import recipe
    from flashnorm_mlx.loading.source import read_source

    labels = []
    real = recipe.progress_bar

    def spy(enabled, label="{task.description}"):
        labels.append(label)
        return real(False, label)

    monkeypatch.setattr(recipe, "progress_bar", spy)
    source = read_source(str(tiny.make_llama(tmp_path, "gqa_untied")))
    if stored:
        source = tiny.quantized(source)
    recipe.fold_checkpoint(source, dict(source.weights), q_method="rtn")
    assert any(("copying" if stored else "folding") in l for l in labels), labels
    assert not any(("folding" if stored else "copying") in l for l in labels), labels
