"""One vocabulary (lightning_snip.tags): every ``snip/`` tag the package writes is a row of TAGS, and the callback's
docstring, docs/metrics.md and the README agree with it; a Trainer run logs nothing else."""

from __future__ import annotations

import ast
import glob
import re
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_snip.callback import SNIPCallback
from lightning_snip.tags import TAGS, markdown_table, tag_for

ROOT = Path(__file__).resolve().parent.parent


def _written_tags(source: str) -> set[str]:
    """The strings starting ``snip/`` a module writes: its string literals, and its f-strings with every
    placeholder replaced by the letter x (so ``f"snip/ld/{fqn}"`` reads ``snip/ld/x``)."""
    found, tree = set(), ast.parse(source)
    parts = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    for node in ast.walk(tree):
        if id(node) in parts:
            continue
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "x" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        else:
            continue
        if re.fullmatch(r"snip/[\w/<>.-]+", text):
            found.add(text)
    return found


def test_every_tag_the_package_writes_is_a_row_of_the_table():
    written = set()
    for path in (ROOT / "lightning_snip").rglob("*.py"):
        if path.name != "tags.py":
            written |= _written_tags(path.read_text())
    assert len(written) >= 20
    unknown = sorted(t for t in written if tag_for(t) is None)
    assert not unknown, f"snip/ tags written but not in lightning_snip.tags.TAGS: {unknown}"
    # and the check sees one that is not there
    assert tag_for("snip/made_up") is None and _written_tags('log({"snip/made_up": 1.0})') == {"snip/made_up"}
    assert tag_for("snip/ld/model.layers.0.mlp/mxfp4") is not None


def test_the_docstring_docs_and_readme_agree_with_the_table():
    doc = SNIPCallback.__doc__
    assert not [t.name for t in TAGS if f"``{t.name}``" not in doc]
    assert markdown_table() in (ROOT / "docs" / "metrics.md").read_text()
    for text in (ROOT / "README.md").read_text(), doc, (ROOT / "docs" / "method.md").read_text():
        named = set(re.findall(r"`(snip/[\w/<>.-]+)`", text))
        assert not [t for t in named if tag_for(t) is None and not any(x.name.startswith(t) for x in TAGS)], named


def test_a_trainer_run_logs_only_tags_of_the_table(tmp_path):
    from test_callback import _fit, _snip

    snip = SNIPCallback(_snip(warmup_steps=3, interval=4, first_order_steps=2, overhead_budget=None))
    _fit(tmp_path, snip, max_steps=10)
    events = EventAccumulator(glob.glob(str(tmp_path / "tb" / "*"))[0]).Reload()
    logged = [t for kind in ("scalars", "images", "tensors") for t in events.Tags()[kind] if t.startswith("snip/")]
    assert len(logged) > 20 and {"snip/overhead", "snip/fp4_fraction", "snip/canary_seconds"} <= set(logged)
    assert not [t for t in logged if tag_for(t.removesuffix("/text_summary")) is None]
