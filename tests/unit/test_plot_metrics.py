"""scripts/plot_metrics.py: metrics.jsonl -> one PNG (loss and validation loss, lr, grad norm, tokens/s)."""

import importlib.util
import json
import struct

import pytest

from conftest import REPO


def _script():
    spec = importlib.util.spec_from_file_location("plot_metrics", REPO / "scripts" / "plot_metrics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def _records(steps, loss0):
    out = []
    for step in steps:
        out.append({"step": step, "loss": loss0 - 0.1 * step, "grad_norm": 1.0 / step, "lr": 1e-4 * step,
                    "tps": 1000.0 + step, "max_rss": 0.5})
        if step % 5 == 0:
            out.append({"step": step, "validation_loss": loss0 - 0.05 * step, "validation_perplexity": 1.0,
                        "validation_tokens": 64})
    return out


def test_metrics_jsonl_becomes_a_png(tmp_path):
    plot = _script()
    run = tmp_path / "run"
    run.mkdir()
    # Steps 1-10, then a resumed run that replays steps 9-12: the replayed records win; a torn last line.
    _write(run / "metrics.jsonl", _records(range(1, 11), 8.0) + _records(range(9, 13), 7.0), tail='{"step": 13, "lo')
    train, validation = plot.read_metrics(str(run / "metrics.jsonl"))
    assert sorted(train) == list(range(1, 13)) and train[9]["loss"] == pytest.approx(7.0 - 0.9)
    assert validation == {5: pytest.approx(7.75), 10: pytest.approx(6.5)}

    assert plot.main([str(run / "metrics.jsonl"), "--smooth", "0.6"]) == 0
    png = (run / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == (1200, 800)  # 12 x 8 inches at 100 dpi

    # Two runs side by side, into a named file.
    other = tmp_path / "other.jsonl"
    _write(other, _records(range(1, 6), 9.0))
    out = tmp_path / "plots" / "both.png"
    assert plot.main([str(run / "metrics.jsonl"), str(other), "--labels", "a", "b", "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_smoothing_is_tensorboards_debiased_average():
    plot = _script()
    assert plot.smooth([1.0, 2.0, 3.0], 0.0) == [1.0, 2.0, 3.0]
    smoothed = plot.smooth([2.0, 2.0, 4.0], 0.5)
    assert smoothed[:2] == [pytest.approx(2.0), pytest.approx(2.0)]  # debiased: no pull toward 0
    # Weights 1/8, 1/4, 1/2 for the three values, divided by their sum.
    assert smoothed[2] == pytest.approx((0.125 * 2 + 0.25 * 2 + 0.5 * 4) / 0.875)


def test_bad_arguments_are_one_line(tmp_path, capsys):
    plot = _script()
    with pytest.raises(SystemExit) as exit_:
        plot.main([str(tmp_path / "missing.jsonl")])
    assert exit_.value.code == 2 and "no such metrics file" in capsys.readouterr().err
