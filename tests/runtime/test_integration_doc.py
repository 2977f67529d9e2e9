"""docs/integration.md's worked example runs as written: the doc cannot drift from the API."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "integration.md"


def test_worked_example_in_integration_doc_runs_and_hands_off_bit_exact():
    text = DOC.read_text()
    section = text[text.index("## Worked example") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    exec(compile(code.group(1), str(DOC), "exec"), {"__name__": "integration_example"})
