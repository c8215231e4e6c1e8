"""The documentation site's generators: the HTTP API page from the server's routes, the README's
links rewritten for the site, and the concepts figures' data from real episodes.

``mkdocs build --strict`` itself runs in CI (``.ci/run``), after ``pip install -e ".[docs]"``.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hooks() -> ModuleType:
    return load(DOCS / "hooks" / "site.py", "docs_site_hooks")


def test_http_api_page_lists_every_route_and_every_request_field(hooks):
    from fastapi.routing import APIRoute

    from compaction_gym.servers import ServerArgs, create_app

    engine = SimpleNamespace(capacity=1, max_slots=1, tokenizer=None, model=SimpleNamespace(config=SimpleNamespace(vocab_size=1)))
    app = create_app(engine, ServerArgs())
    page = hooks.openapi_markdown(hooks.openapi_schema())
    routes = [(m, r.path) for r in app.routes if isinstance(r, APIRoute) and r.include_in_schema for m in r.methods]
    assert len(routes) >= 7 and ("POST", "/compact_session/step") in routes
    for method, path in routes:
        assert f"### `{method} {path}`" in page, (method, path)
    # every field of every request body model, by the pydantic models themselves
    for route in app.routes:
        if isinstance(route, APIRoute) and route.body_field is not None:
            model = route.body_field.field_info.annotation
            assert f"### {model.__name__}" in page
            for name, field in model.model_fields.items():
                assert f"| `{field.alias or name}` |" in page, (model.__name__, name)
    # the session API's documented fields: CompactionConfig's and SamplingParams' help texts
    from compaction_gym.engine.config import CompactionConfig

    help_text = CompactionConfig.__dataclass_fields__["max_kv_len"].metadata["help"]
    assert help_text.split(";")[0].replace("|", "\\|") in page


def test_the_site_renders_the_readme_with_site_links(hooks):
    readme = (ROOT / "README.md").read_text()
    out = hooks.include_files("<!-- include: README.md -->", ROOT, "index.md", DOCS)
    assert out.startswith(readme.splitlines()[0])
    targets = re.findall(r"\]\(([^)]+)\)", out)
    assert "engine.md" in targets and not any(t.startswith("docs/") for t in targets)
    # from a page in a subfolder, links climb out of it; files outside docs/ become code
    page = hooks.rewrite_links("[e](../engine.md) [m](../../compaction_gym/x.py)", DOCS / "tutorials", "tutorials/a.md", DOCS)
    assert page == "[e](../engine.md) `m`"


@pytest.mark.usefixtures("one_torch_thread")
def test_concepts_figure_data_from_a_real_episode():
    """The KV size rebuilt from the event records alone (what the figure draws) is the cache size the
    engine reported after every turn; the captured keys and values are the model's own cache."""
    import torch

    from compaction_gym import models
    from compaction_gym.backends import LocalBackend
    from compaction_gym.engine import CompactionConfig, Engine

    figures = load(DOCS / "figures" / "make_figures.py", "docs_make_figures")
    model, tokenizer = models.load("babyai-tiny")
    backend = LocalBackend(Engine(model, tokenizer, max_slots=1))
    traj = figures.play(backend, CompactionConfig(mode="attention_matching", max_kv_len=384, compact_window=128), "goto", 1)
    assert traj.events
    xs, ys = figures.kv_curve(traj)
    assert xs == sorted(xs) and ys[-1] == traj.num_tokens - sum(e.kv_len_before - e.kv_len_after for e in traj.events)
    for turn in traj.turns:
        x = turn.output_range[1] - 1  # rows fed by the end of the turn: its last sampled token waits for the next input
        # a KV-budget event at exactly x fires in the next call, before that input is fed
        fired = [e for e in traj.events if e.logical_len < x or (e.logical_len == x and e.trigger != "kv_budget")]
        assert turn.kv_len == x - sum(e.kv_len_before - e.kv_len_after for e in fired)
    ids = traj.token_ids[:200]
    q, k, v = figures.capture_qkv(model, ids)
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    assert q.shape[:3] == (model.config.num_hidden_layers, model.config.num_attention_heads, len(ids))
    for layer in range(model.config.num_hidden_layers):
        torch.testing.assert_close(k[layer], cache.layers[layer].keys[0])
        torch.testing.assert_close(v[layer], cache.layers[layer].values[0])


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
@pytest.mark.usefixtures("one_torch_thread")
def test_the_first_python_example_a_reader_copies_runs(page, capsys):
    """The README's 30-second example and the getting-started page's run as written: one episode of
    babyai-tiny whose printed peak KV respects the example's budget (plus one turn's input)."""
    text = (ROOT / page).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, page
    namespace: dict = {}
    exec(compile(blocks[-1], page, "exec"), namespace)  # noqa: S102
    traj = namespace["traj"]
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert printed == f"{traj.success} {len(traj.turns)} turns, {len(traj.events)} compaction events, peak KV {traj.peak_kv_len}"
    budget = namespace["agent"].compaction.max_kv_len
    assert all(t.peak_kv_len <= budget + t.input_range[1] - t.input_range[0] for t in traj.turns)
