"""docs/reference/configuration.md is generated from the config models (scripts/gen_config_reference.py): the
committed page equals a fresh rendering, every key has a description, and a changed description shows up in
the page (so a stale page cannot pass)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen_config_reference.py"


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_the_committed_reference_is_what_the_models_generate(generator):
    committed = generator.PAGE.read_text() if generator.PAGE.is_file() else ""
    fresh = generator.render()
    if committed != fresh:
        differing = sorted(set(fresh.splitlines()) ^ set(committed.splitlines()))[:5]
        pytest.fail(
            f"{generator.PAGE.relative_to(ROOT)} is stale: the config models changed since it was generated. "
            f"Run `{generator.REGENERATE}` and commit the page. First differing lines:\n" + "\n".join(differing)
        )


def test_every_key_has_a_description(generator):
    assert generator.missing_descriptions() == [], "give these fields a Field(description=...)"


def test_the_page_lists_every_key_with_its_default_and_description(generator, monkeypatch):
    from nemo_rl_ext.grpo.config import LossSettings
    from nemo_rl_ext.models.config import HfConfig

    text = generator.render()
    assert "| `policy.hf.max_prefill_tokens` | int (>= 1) | `16384` | Padded prompt tokens prefilled per step. |" in text
    assert "| `grpo.async.max_lag` | int (>= 0) | `1` |" in text  # the YAML alias, not the attribute `async_`
    assert '| `rollouts.mode` | str | `"native"` | A registered rollout mode: native: ' in text  # a registry name
    assert "| `eval.dataset_path` | str | required |" in text
    assert "`rollouts.num_generations_per_prompt` | int or dict[str, int] | `8` |" in text  # GRPO's own default
    assert "The same keys as the eval config's [`policy`](#eval-config-policy)." in text  # shown once
    monkeypatch.setattr(HfConfig.model_fields["max_prefill_tokens"], "description", "A changed description.")
    monkeypatch.setattr(LossSettings.model_fields["kl_coef"], "default", 0.5)
    changed = generator.render()
    assert "| `policy.hf.max_prefill_tokens` | int (>= 1) | `16384` | A changed description. |" in changed
    assert "| `loss.kl_coef` | float (>= 0.0) | `0.5` |" in changed
