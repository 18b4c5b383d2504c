"""corpus_chat's chat shapes for the training corpus: one exchange, multi-turn, pasted log (issue 24)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models" / "train"))

from corpus_chat import FIX_ASKS, FOLLOW_UPS, as_chat, shape_of  # noqa: E402

CODE = "\n".join(f"def f{i}(x):\n    total = x + {i}\n    return total * 2" for i in range(40)) + "\n"


def _turns(chat: str) -> list[tuple[str, str]]:
    return re.findall(r"<\|im_start\|>(user|assistant)\n(.*?)<\|im_end\|>\n", chat, flags=re.S)


def test_multi_turn_keeps_every_line_in_alternating_turns() -> None:
    turns = _turns(as_chat(CODE, "code-python", "k", "multi"))
    assert len(turns) >= 4 and [r for r, _ in turns[:4]] == ["user", "assistant", "user", "assistant"]
    assert any(t.startswith(FOLLOW_UPS) for r, t in turns[2:] if r == "user")
    body = "\n".join(t for _, t in turns)
    # each piece is stripped, so a piece's first line loses its indentation (the committed corpus was built so)
    assert all(line.strip() in body for line in CODE.splitlines() if line.strip())


def test_log_shape_pastes_a_failure_around_the_code_and_single_is_one_exchange() -> None:
    turns = _turns(as_chat(CODE, "code-python", "k", "log"))
    assert len(turns) == 2 and turns[0][1].startswith(FIX_ASKS) and "Traceback" in turns[0][1]
    single = _turns(as_chat(CODE, "code-python", "k", "single"))
    assert len(single) == 2 and (single[0][1] + single[1][1]).count("def f") == 40


def test_shape_of_is_deterministic_and_logs_only_for_code_and_config() -> None:
    keys = [f"file{i}.py" for i in range(400)]
    shapes = [shape_of(k, "code-python") for k in keys]
    assert shapes == [shape_of(k, "code-python") for k in keys]
    assert {"single", "multi", "log"} <= set(shapes)
    assert "log" not in {shape_of(k, "prose") for k in keys} and "log" not in {shape_of(k, "math") for k in keys}
