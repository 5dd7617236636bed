"""Pipeline timelines (frontend/plots/timeline.py): idle fractions, the text table, the PNG (no processes).

Every expected number is worked out by hand in the comments from the hand-made records.
"""

import ast
import inspect
from collections import namedtuple

import numpy as np
import pytest

from shardlib.frontend.plots import timeline
from shardlib.frontend.plots.timeline import idle_fraction, idle_fractions, plot_timeline, timeline_table

R = namedtuple("Record", "rank action start end")
MS = 1e-3

# p = 2, one microbatch, rank 1 runs zero-bubble I/W (ms):
#   rank 0: 0F0 [0,1]  0SEND_F0 [1,1.5]  0RECV_B0 [3.5,4]  0B0 [4,6]  0REDUCE_GRAD [6,7]
#   rank 1: 1RECV_F0 [1,1.5]  1F0 [1.5,2.5]  1I0 [2.5,3.5]  1SEND_B0 [3.5,4]  1W0 [5,7]
# span = 7 - 0 = 7 ms; busy (F/B/I/W only): rank 0 = 1 + 2 = 3, rank 1 = 1 + 1 + 2 = 4
# idle: rank 0 = 1 - 3/7 = 4/7, rank 1 = 1 - 4/7 = 3/7; mean = 1/2
TWO = [
    R(0, "0F0", 0.0, 1.0), R(0, "0SEND_F0", 1.0, 1.5), R(0, "0RECV_B0", 3.5, 4.0), R(0, "0B0", 4.0, 6.0),
    R(0, "0REDUCE_GRAD", 6.0, 7.0),
    R(1, "1RECV_F0", 1.0, 1.5), R(1, "1F0", 1.5, 2.5), R(1, "1I0", 2.5, 3.5), R(1, "1SEND_B0", 3.5, 4.0),
    R(1, "1W0", 5.0, 7.0),
]
TWO = [R(r.rank, r.action, r.start * MS, r.end * MS) for r in TWO]


def gpipe(p, m, f=1.0, b=2.0):
    """GPipe with equal per-stage costs (ms), free p2p: F(r, i) starts at (r + i) f; the backward of
    the last stage starts when its last F ends, B(r, i) at (m + p - 1) f + (p - 1 - r + i) b."""
    out = []
    for r in range(p):
        for i in range(m):
            out.append(R(r, f"{r}F{i}", (r + i) * f * MS, (r + i + 1) * f * MS))
            out.append(R(r, f"{r}B{i}", ((m + p - 1) * f + (p - 1 - r + i) * b) * MS,
                         ((m + p - 1) * f + (p - r + i) * b) * MS))
    return out


def test_idle_fractions_of_hand_made_records():
    fr = idle_fractions(TWO)
    assert sorted(fr) == [0, 1]
    assert fr[0] == pytest.approx(4 / 7)
    assert fr[1] == pytest.approx(3 / 7)
    assert idle_fraction(TWO) == pytest.approx(0.5)


def test_idle_fraction_of_gpipe_is_the_bubble_formula():
    # span = (m + p - 1)(f + b); each rank busy m (f + b) -> idle (p - 1) / (m + p - 1) on every rank
    for p, m in [(2, 1), (4, 8), (3, 5)]:
        fr = idle_fractions(gpipe(p, m))
        assert fr == pytest.approx({r: (p - 1) / (m + p - 1) for r in range(p)})


def test_span_is_over_all_ranks_and_comm_counts_as_idle():
    # rank 0 computes [0,1], rank 1 computes [3,4], rank 2 only receives [0,4]: span 4 for every rank
    recs = [R(0, "0F0", 0.0, 1.0), R(1, "1F0", 3.0, 4.0), R(2, "2RECV_F0", 0.0, 4.0)]
    assert idle_fractions(recs) == pytest.approx({0: 0.75, 1: 0.75, 2: 1.0})


def test_overlapping_compute_on_one_rank_counts_once():
    # F [0,2] and W [1,3] overlap: busy = |[0,3]| = 3 of span 4 -> idle 0.25 (a plain sum would say 0)
    recs = [R(0, "0F0", 0.0, 2.0), R(0, "0W0", 1.0, 3.0), R(0, "0REDUCE_GRAD", 3.0, 4.0)]
    assert idle_fractions(recs) == {0: pytest.approx(0.25)}


def test_actions_may_be_objects_that_print_like_torch_actions():
    class Act:
        def __init__(self, text):
            self.text = text

        def __str__(self):
            return self.text

    recs = [R(0, Act("0F0"), 0.0, 1.0), R(1, Act("1B0"), 1.0, 3.0)]
    # span 3: rank 0 busy 1 -> 2/3, rank 1 busy 2 -> 1/3
    assert idle_fractions(recs) == pytest.approx({0: 2 / 3, 1: 1 / 3})


def test_timeline_table_lists_busy_idle_and_order():
    shuffled = list(reversed(TWO))           # the table orders each rank's actions by start time
    text = timeline_table(shuffled)
    lines = text.splitlines()
    assert lines[0] == "timeline: 2 ranks, span 7.000 ms, mean idle 50.0%"
    # 4/7 = 57.14%, 3/7 = 42.86%
    assert lines[2] == "   0      3.000   57.1%  0F0 0SEND_F0 0RECV_B0 0B0 0REDUCE_GRAD"
    assert lines[3] == "   1      4.000   42.9%  1RECV_F0 1F0 1I0 1SEND_B0 1W0"


def _pixels(img, hex_color, tol=0.02):
    """How many pixels of the image have this colour."""
    rgb = np.array([int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(img[..., :3] - rgb).max(axis=-1) < tol).sum())


def _has_color(img, hex_color):
    return _pixels(img, hex_color) > 0


def test_plot_timeline_writes_a_png(tmp_path):
    from matplotlib.image import imread

    recs = gpipe(3, 4) + [R(r, f"{r}SEND_F0", 1.0 * MS, 1.1 * MS) for r in range(2)]
    path = tmp_path / "gpipe.png"
    got = plot_timeline(recs, path, title="gpipe p=3 m=4",
                        compare={"simulated": 2 / 6, "formula (p-1)/(m+p-1)": 2 / 6})
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    img = imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100 and img.shape[2] in (3, 4)
    # the F and B boxes were drawn in their kinds' colours, far more pixels than the legend's patches;
    # 12 B boxes of 2 ms and 12 F boxes of 1 ms, same height: about twice the B pixels (labels aside)
    f_px, b_px = _pixels(img, timeline._COLORS["F"]), _pixels(img, timeline._COLORS["B"])
    assert f_px > 5000 and 1.8 < b_px / f_px < 2.2
    # the W colour was not used: there is no W
    assert not _has_color(img, timeline._COLORS["W"])
    assert got == pytest.approx({r: 2 / 6 for r in range(3)})      # (p-1)/(m+p-1) with p=3, m=4


def test_plot_timeline_shades_the_second_local_chunk(tmp_path):
    from matplotlib.image import imread

    # interleaved, p = 2, v = 2: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
    recs = [R(0, "0F0", 0.0, 1.0), R(1, "1F0", 1.0, 2.0), R(0, "2F0", 2.0, 3.0), R(1, "3F0", 3.0, 4.0)]
    plot_timeline(recs, tmp_path / "v2.png")
    img = imread(tmp_path / "v2.png")
    # two 1 ms boxes in each shade (the legend shows both shades too): about as many pixels of each
    plain, light = _pixels(img, timeline._COLORS["F"]), _pixels(img, timeline._COLORS_ALT["F"])
    assert plain > 5000 and 0.8 < light / plain < 1.25


@pytest.mark.parametrize("action", ["0X3", "F3", "0F", "0UNSHARD3", "0SEND_X1", "", "0f3"])
def test_unknown_action_raises(action):
    recs = [R(0, "0F0", 0.0, 1.0), R(0, action, 1.0, 2.0)]
    for fn in (idle_fractions, timeline_table):
        with pytest.raises(ValueError, match=rf"records\[1\].*action '{action}'"):
            fn(recs)


def test_every_bad_record_is_named_at_once(tmp_path):
    recs = [R(0, "0Q0", 0.0, 1.0), R(-1, "0F0", 0.0, 1.0), R(0, "0B0", 2.0, 1.0), (0, "0F0")]
    with pytest.raises(ValueError) as e:
        plot_timeline(recs, tmp_path / "bad.png")
    msg = str(e.value)
    assert "4 problems" in msg
    assert "records[0]" in msg and "'0Q0'" in msg
    assert "records[1]" in msg and "rank -1" in msg
    assert "records[2]" in msg and "end 1.0 < start 2.0" in msg
    assert "records[3] has no rank, action, start, end" in msg
    assert not (tmp_path / "bad.png").exists()


def test_empty_records_raise(tmp_path):
    for call in (lambda: idle_fractions([]), lambda: idle_fraction([]), lambda: timeline_table(iter(())),
                 lambda: plot_timeline([], tmp_path / "empty.png")):
        with pytest.raises(ValueError, match="no records"):
            call()
    assert not (tmp_path / "empty.png").exists()


def test_zero_length_step_and_bad_compare_raise(tmp_path):
    with pytest.raises(ValueError, match="no duration"):
        idle_fractions([R(0, "0F0", 1.0, 1.0)])
    with pytest.raises(ValueError, match=r"compare\['formula'\].*27"):
        plot_timeline(TWO, tmp_path / "x.png", compare={"formula": 27})    # a percentage, not a fraction
    with pytest.raises(TypeError, match="compare is not a dict"):
        plot_timeline(TWO, tmp_path / "x.png", compare=[0.27])
    with pytest.raises(TypeError, match="records is not iterable"):
        idle_fractions(3)


def test_matplotlib_is_imported_lazily():
    # importing shardlib must not need matplotlib: no module-level import of it in frontend/plots/timeline.py
    tree = ast.parse(inspect.getsource(timeline))
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert names and not any(n.startswith("matplotlib") for n in names)
