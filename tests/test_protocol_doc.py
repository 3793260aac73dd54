"""docs/protocol.md is generated from the protocol's field table and may never drift.

If this fails after a change to zmqsync/_protocol.py (or to the behaviour the generator
describes), run ``python tools/gen_protocol_doc.py`` and commit docs/protocol.md.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from zmqsync._protocol import FIELDS, MESSAGE_TYPES

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "protocol.md"


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    path = ROOT / "tools" / "gen_protocol_doc.py"
    spec = importlib.util.spec_from_file_location("gen_protocol_doc", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_doc_is_generated_from_the_code(gen: ModuleType) -> None:
    assert DOC.read_text(encoding="utf-8") == gen.render(), (
        "docs/protocol.md is stale: run python tools/gen_protocol_doc.py"
    )


def test_every_field_has_a_row(gen: ModuleType) -> None:
    text = gen.render()
    sections = dict(re.findall(r"^## (\S+)\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S))
    for cls, table in FIELDS.items():
        title = cls.TYPE.upper() if cls in MESSAGE_TYPES.values() else cls.__name__
        body = sections[title]
        for name in table:
            assert f"| `{name}` |" in body, f"{title}.{name} missing from docs/protocol.md"


def test_check_flag(gen: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "protocol.md"
    assert gen.main(["--check", "--output", str(out)]) == 1  # missing
    assert gen.main(["--output", str(out)]) == 0
    assert gen.main(["--check", "--output", str(out)]) == 0
    out.write_text(out.read_text(encoding="utf-8").replace("HELLO", "HI", 1), encoding="utf-8")
    assert gen.main(["--check", "--output", str(out)]) == 1
    assert "stale" in capsys.readouterr().err
