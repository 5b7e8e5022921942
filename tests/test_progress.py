"""Progress on a terminal: the bar is redrawn a few times a second, not once per item, and its last
drawing shows every item done."""
from __future__ import annotations

import io

from moebench.progress import Progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_bar_is_redrawn_at_most_every_tenth_of_a_second_and_ends_complete():
    out = _Tty()
    p = Progress("gsm8k", 5000, stream=out)
    for _ in range(5000):
        p.advance()
    p.close()
    draws = out.getvalue().split("\r")[1:]
    assert len(draws) < 100, len(draws)
    assert "5000/5000" in draws[-1] and draws[-1].endswith("\n")
