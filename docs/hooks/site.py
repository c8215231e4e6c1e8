"""MkDocs hooks for the documentation site (mkdocs.yml ``hooks:``).

* ``<!-- include: PATH -->`` inserts a repository file (the home page is the README); its links into
  ``docs/`` are rewritten to site pages, and links to files outside ``docs/`` become code spans
  (the site holds only the documentation).
* ``docs/http-api.md`` gets the HTTP API rendered from the FastAPI app's OpenAPI schema at build
  time, so the page cannot go stale; the schema itself is written to ``site/openapi.json``.

``openapi_schema()`` and ``openapi_markdown()`` are importable (``tests/docs/test_docs_site.py``).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

OPENAPI_MARKER = "<!-- openapi:generated -->"
_INCLUDE = re.compile(r"<!--\s*include:\s*(\S+)\s*-->")
_LINK = re.compile(r"(?<!!)\[([^\]]*)\]\(([^)\s]+)\)")


def openapi_schema() -> dict[str, Any]:
    """The OpenAPI schema of ``compaction-gym serve``'s app.

    The routes and their pydantic models do not depend on the engine, so the app is built around
    a stand-in that has only the attributes the app reads at construction (no model is loaded and
    the app's worker is never started).
    """
    from compaction_gym.servers import ServerArgs, create_app

    engine = SimpleNamespace(capacity=1, max_slots=1, tokenizer=None, model=SimpleNamespace(config=SimpleNamespace(vocab_size=1)))
    return create_app(engine, ServerArgs()).openapi()


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _type(prop: dict[str, Any]) -> str:
    """A short type label for a JSON-schema property (schema links for ``$ref``)."""
    if "$ref" in prop:
        name = _ref_name(prop["$ref"])
        return f"[`{name}`](#{name.lower()})"
    if "anyOf" in prop:
        return " or ".join(_type(p) for p in prop["anyOf"])
    if "enum" in prop:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in prop["enum"])
    if "const" in prop:
        return f"`{json.dumps(prop['const'])}`"
    kind = prop.get("type", "any")
    if kind == "array":
        return f"array of {_type(prop.get('items', {}))}"
    if kind == "object" and "additionalProperties" in prop and isinstance(prop["additionalProperties"], dict):
        return f"object of {_type(prop['additionalProperties'])}"
    return f"`{kind}`"


def _limits(prop: dict[str, Any]) -> str:
    keys = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum", "minLength", "maxLength", "maxItems", "pattern")
    found = {}
    for p in [prop, *prop.get("anyOf", [])]:
        for k in keys:
            if k in p:
                found[k] = p[k]
    parts = []
    for k, v in found.items():
        if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
            v = int(v)
        parts.append(f"{k} {v}" if k != "pattern" else f"pattern `{v}`")
    return ", ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _schema_section(name: str, schema: dict[str, Any]) -> list[str]:
    lines = [f"### {name}", ""]
    if schema.get("description"):
        lines += [schema["description"].strip(), ""]
    props = schema.get("properties", {})
    if not props:
        lines += [f"Type: {_type(schema)}", ""]
        return lines
    required = set(schema.get("required", []))
    lines += ["| field | type | required | default | description |", "|---|---|---|---|---|"]
    for field, prop in props.items():
        default = f"`{json.dumps(prop['default'])}`" if "default" in prop else ""
        desc = prop.get("description", "")
        limits = _limits(prop)
        if limits:
            desc = f"{desc} ({limits})" if desc else limits
        lines.append(
            f"| `{field}` | {_type(prop)} | {'yes' if field in required else ''} | {_cell(default)} | {_cell(desc)} |"
        )
    if schema.get("additionalProperties") is False:
        lines += ["", "Unknown fields are refused (422)."]
    lines.append("")
    return lines


def _body_type(content: dict[str, Any]) -> str:
    return "; ".join(f"{mime}: {_type(c.get('schema', {}))}" for mime, c in content.items())


def openapi_markdown(schema: dict[str, Any]) -> str:
    """Markdown for every endpoint (method, path, summary, parameters, bodies) and every schema."""
    info = schema.get("info", {})
    lines = [
        f"Generated from the OpenAPI {schema.get('openapi', '')} schema of `{info.get('title', '')}` "
        f"{info.get('version', '')} when the site was built (download: [openapi.json](openapi.json)).",
        "",
        "## Endpoints",
        "",
    ]
    for path, item in schema.get("paths", {}).items():
        for method, op in item.items():
            lines += [f"### `{method.upper()} {path}`", ""]
            summary = op.get("description") or op.get("summary") or ""
            if summary:
                lines += [summary.strip().replace("``", "`"), ""]
            params = op.get("parameters", [])
            if params:
                lines += ["| parameter | in | type | required |", "|---|---|---|---|"]
                lines += [
                    f"| `{p['name']}` | {p['in']} | {_type(p.get('schema', {}))} | {'yes' if p.get('required') else ''} |"
                    for p in params
                ]
                lines.append("")
            body = op.get("requestBody")
            if body:
                lines += [f"**Request body**: {_body_type(body.get('content', {}))}", ""]
            for status, resp in op.get("responses", {}).items():
                content = resp.get("content")
                kind = f": {_body_type(content)}" if content else ""
                lines.append(f"* **{status}** {resp.get('description', '')}{kind}")
            lines.append("")
    lines += ["## Schemas", ""]
    for name, sch in sorted(schema.get("components", {}).get("schemas", {}).items()):
        lines += _schema_section(name, sch)
    return "\n".join(lines)


def rewrite_links(markdown: str, base: Path, page_src: str, docs_dir: Path) -> str:
    """Rewrite relative links written from ``base`` for the page ``page_src``: links into ``docs/``
    become site links, links to files outside ``docs/`` become code spans."""
    docs_dir = docs_dir.resolve()
    page_dir = (docs_dir / page_src).parent

    def fix(m: re.Match[str]) -> str:
        text, target = m.group(1), m.group(2)
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            return m.group(0)
        path, _, anchor = target.partition("#")
        resolved = (base / path).resolve()
        if not resolved.is_relative_to(docs_dir):
            return text if text.startswith("`") else f"`{text}`"
        rel = os.path.relpath(resolved, page_dir)
        return f"[{text}]({Path(rel).as_posix()}{'#' + anchor if anchor else ''})"

    return _LINK.sub(fix, markdown)


def include_files(markdown: str, repo: Path, page_src: str, docs_dir: Path) -> str:
    """Replace each ``<!-- include: PATH -->`` (PATH from the repository root) by that file, its
    relative links rewritten for this page."""

    def sub(m: re.Match[str]) -> str:
        path = repo / m.group(1).strip()
        return rewrite_links(path.read_text(encoding="utf-8"), path.parent, page_src, docs_dir)

    return _INCLUDE.sub(sub, markdown)


def on_config(config: Any) -> Any:
    """Import the checkout's package (also when it is not installed)."""
    repo = str(Path(config["docs_dir"]).resolve().parent)
    if repo not in sys.path:
        sys.path.insert(0, repo)
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs_dir = Path(config["docs_dir"]).resolve()
    src = page.file.src_uri
    markdown = rewrite_links(markdown, (docs_dir / src).parent, src, docs_dir)
    markdown = include_files(markdown, docs_dir.parent, src, docs_dir)
    if OPENAPI_MARKER in markdown:
        markdown = markdown.replace(OPENAPI_MARKER, openapi_markdown(openapi_schema()))
    return markdown


def on_files(files: Any, config: Any) -> Any:
    """Add the schema itself to the site as ``openapi.json``."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, "openapi.json", content=json.dumps(openapi_schema(), indent=1) + "\n"))
    return files
