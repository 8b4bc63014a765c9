"""The reference in docs/ stays true: every schedule key documented, docs/schedule.md current, and
no page names a file the project lacks."""

from __future__ import annotations

import re
from pathlib import Path

from orchestrator import docs
from orchestrator.schedule import Schedule, Section

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_schedule_key_has_a_docstring():
    assert docs.undocumented() == []


def test_a_key_without_a_docstring_is_found():
    class Extra(Section):
        documented: int = 0
        """Has one."""
        bare: int = 0

    class WithExtra(Schedule):
        extra: Extra = Extra()

    assert docs.undocumented(WithExtra) == ["extra.bare"]


def test_schedule_reference_is_current():
    assert docs.DOC.read_text() == docs.render(), "docs/schedule.md is stale: run python -m orchestrator.docs"
    assert "`schedule.phases[i].layers`" in docs.render()


def test_pages_name_no_file_the_project_lacks():
    missing = []
    for page in PAGES:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            target = target.split("#")[0]
            if target and not target.startswith(("http://", "https://")) and not (page.parent / target).exists():
                missing.append(f"{page.name}: link {target}")
        for token in re.findall(r"`([^`\s]+)`", text):
            repo_path = re.match(r"(?:docs|examples|benchmarks|orchestrator|launch|shard_tools|tests)/[\w./-]*", token)
            if repo_path and not (ROOT / repo_path.group(0)).exists():
                missing.append(f"{page.name}: {token}")
            if re.fullmatch(r"[A-Za-z_]+\.md", token) and not (ROOT / token).exists() and not (ROOT / "docs" / token).exists():
                missing.append(f"{page.name}: {token}")
    assert missing == []


def test_coming_from_maps_the_peers_lisa_keys_to_keys_that_exist():
    """Seen: coming-from.md mapped LMFlow's LISA flags but not axolotl's. Every schedule key a row
    of its LISA tables names exists."""
    text = (ROOT / "docs" / "coming-from.md").read_text()
    for peer_key in ("lisa_n_layers", "lisa_step_interval", "lisa_layers_attribute", "--lisa_activated_layers",
                     "--lisa_interval_steps", "--lisa_layers_attribute"):
        assert f"`{peer_key}" in text, peer_key
    keys = {f"{section}.{key}" for section, model in Schedule.model_fields.items()
            for key in getattr(model.annotation, "model_fields", {})}
    for row in re.findall(r"^\| `(?:lisa_|--lisa_)[^|]*\| ([^|]*)\|", text, re.M):
        for named in re.findall(r"`([a-z_]+\.[a-z_]+)", row):
            assert named in keys, (named, row)


def test_the_readme_says_what_relayer_is_not():
    """Asked by users of the peers: LoRA and QLoRA stay with peft-based tools."""
    text = (ROOT / "README.md").read_text()
    head = text[:text.index("## Install")]
    assert "**What relayer is not.**" in head and "LoRA, QLoRA" in head and "peft" in head
