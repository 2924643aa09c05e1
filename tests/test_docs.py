"""The documentation against the code and the tree: docs/configuration.md documents exactly the app's
config schema with its defaults, the README stays one screen (90 lines) and links every document, and no
document or source file points outside the repository or at a file that does not exist."""

import dataclasses
import enum
import re
from pathlib import Path

from lightning_snip.train import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
MARKDOWN = [ROOT / "README.md", *DOCS, ROOT / "benchmarks" / "README.md", ROOT / "CHANGELOG.md"]
# A documented setting: | `group.name` | `default` | meaning |
_ROW = re.compile(r"^\| `(\w+)\.(\w+)` \| `([^`]*)` \| .+ \|$")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_UP = re.compile(r"(?:\.\./)+[\w.\-/]*")  # a relative path climbing out of its folder


def render_default(value) -> str:
    """A default as docs/configuration.md writes it, in Hydra's override syntax: null, true/false, an
    Enum by its value, numbers by repr, a list or tuple as [a, b] (strings in it double-quoted, so a
    glob reads as Hydra needs it), a mapping as {key: value}, any other string as it is."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return render_default(value.value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(f'"{v}"' if isinstance(v, str) and not isinstance(v, enum.Enum) else render_default(v)
                               for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {render_default(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def schema_defaults() -> dict[str, dict[str, str]]:
    """group -> setting -> rendered default, from the dataclasses of TrainConfig (default_factory too)."""
    out = {}
    for group in dataclasses.fields(TrainConfig):
        out[group.name] = {
            f.name: render_default(f.default if f.default is not dataclasses.MISSING else f.default_factory())
            for f in dataclasses.fields(group.default_factory)
        }
    return out


def documented_defaults() -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for line in (ROOT / "docs" / "configuration.md").read_text().splitlines():
        if match := _ROW.match(line.strip()):
            group, name, default = match.groups()
            assert name not in out.setdefault(group, {}), f"{group}.{name} documented twice"
            out[group][name] = default
    return out


def test_render_default_follows_its_rule():
    from lightning_snip.formats import Format

    assert render_default((Format.FP8, Format.MXFP4)) == "[fp8, mxfp4]"
    assert render_default(["*lm_head=bf16"]) == '["*lm_head=bf16"]'
    assert [render_default(v) for v in (None, False, (), {}, 0.75, 3, "snip_runs")] == [
        "null", "false", "[]", "{}", "0.75", "3", "snip_runs"]


def mismatches(schema: dict[str, dict[str, str]], documented: dict[str, dict[str, str]]) -> list[str]:
    """What the documented settings get wrong against the schema: a group, a setting or a default."""
    problems = [f"group {g}: documented but not in the schema" for g in sorted(set(documented) - set(schema))]
    for group, fields in schema.items():
        doc = documented.get(group, {})
        problems += [f"{group}.{n}: not documented" for n in sorted(set(fields) - set(doc))]
        problems += [f"{group}.{n}: documented but not in the schema" for n in sorted(set(doc) - set(fields))]
        problems += [f"{group}.{n}: documented default {doc[n]!r}, schema default {d!r}"
                     for n, d in fields.items() if n in doc and doc[n] != d]
    return problems


def test_configuration_doc_documents_exactly_the_schema_with_its_defaults():
    assert mismatches(schema_defaults(), documented_defaults()) == []


def test_the_checker_sees_a_field_added_removed_or_a_default_changed():
    schema = schema_defaults()
    added = {**schema, "snip": {**schema["snip"], "new_field": "1"}}
    removed = {**schema, "data": {k: v for k, v in schema["data"].items() if k != "path"}}
    changed = {**schema, "trainer": {**schema["trainer"], "max_steps": "201"}}
    assert mismatches(added, documented_defaults()) == ["snip.new_field: not documented"]
    assert mismatches(removed, documented_defaults()) == ["data.path: documented but not in the schema"]
    assert mismatches(changed, documented_defaults()) == [
        "trainer.max_steps: documented default '200', schema default '201'"]


def test_readme_is_one_screen_and_links_every_document():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 90  # one screen (issue 62); the rest is in docs/ and benchmarks/README.md
    linked = {(ROOT / target.split("#")[0]).resolve() for target in _LINK.findall(readme) if "://" not in target}
    for doc in [*DOCS, ROOT / "benchmarks" / "README.md", ROOT / "CHANGELOG.md"]:
        assert doc.resolve() in linked, f"README.md does not link {doc.relative_to(ROOT)}"


def test_every_relative_link_points_to_an_existing_file():
    for doc in MARKDOWN:
        for target in _LINK.findall(doc.read_text()):
            path = target.split("#")[0]
            if "://" in target or target.startswith("mailto:") or not path:
                continue
            assert (doc.parent / path).exists(), f"{doc.relative_to(ROOT)} links a missing file: {target}"


def _sources() -> list[Path]:
    return [*MARKDOWN, *(p for folder in ("lightning_snip", "benchmarks", "tests")
                         for p in sorted((ROOT / folder).rglob("*.py")))]


def test_nothing_references_a_path_outside_the_repository():
    outside = str(ROOT.parent) + "/"  # an absolute path next to the checkout (a shared folder, say)
    for source in _sources():
        text = source.read_text()
        name = source.relative_to(ROOT)
        assert outside not in text.replace(str(ROOT) + "/", ""), f"{name} names a path outside the repository"
        for path in _UP.findall(text):
            target = (source.parent / path).resolve()
            assert target.is_relative_to(ROOT) and target.exists(), f"{name} references {path}, not in the repository"
