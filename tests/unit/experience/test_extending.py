"""docs/extending.md works as written: its environment and backend examples, registered as the doc shows,
are found by name by the front door (`build_policy` / `build_rollouts`) and give the rewards the doc states."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.environments import available_environments, registry
from nemo_rl_ext.models import backends
from nemo_rl_ext.models.config import PolicyConfig

DOC = Path(__file__).resolve().parents[3] / "docs" / "extending.md"


def section_blocks(title: str) -> list[str]:
    """The python code blocks of the doc's section `title` (up to the next `## ` heading)."""
    text = DOC.read_text().split(title, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


@pytest.fixture
def doc_namespace() -> Iterator[dict]:
    """The doc's environment and backend sections run in one namespace; their registrations removed after."""
    envs, backs = dict(registry._ENVIRONMENTS), dict(backends._BACKENDS)
    namespace: dict = {"__name__": "extending_doc"}
    blocks = section_blocks("## 1. An environment") + section_blocks("## 2. A backend")
    assert len(blocks) == 3, f"expected the environment, backend and run examples, found {len(blocks)} blocks"
    try:
        for block in blocks:
            exec(compile(block, str(DOC), "exec"), namespace)
        yield namespace
    finally:
        registry._ENVIRONMENTS.clear()
        registry._ENVIRONMENTS.update(envs)
        backends._BACKENDS.clear()
        backends._BACKENDS.update(backs)


def test_the_documented_environment_and_backend_run_through_the_front_door(doc_namespace, tiny_model_dir) -> None:
    assert "keyword" in available_environments() and "canned" in backends.available_backends()
    rewards = asyncio.run(doc_namespace["keyword_rewards"](str(tiny_model_dir)))
    assert rewards == [[1.0, 1.0], [0.0, 0.0]]  # as the doc says: "paris" is in the canned answer, "tokyo" not


def test_the_documented_environment_brings_its_prompt_and_row_adapter(doc_namespace, tiny_model_and_tokenizer) -> None:
    from nemo_rl_ext.experience.build import make_datums
    from nemo_rl_ext.experience.config import RolloutsConfig

    _, tokenizer = tiny_model_and_tokenizer
    rows = [{"topic": "France", "keyword": "paris"}]
    (datum,) = make_datums(RolloutsConfig(env={"name": "keyword"}), tokenizer, rows)
    assert [m.role for m in datum.message_log] == ["system", "user"]
    assert datum.message_log[0].content == "Answer in one short sentence."
    assert datum.message_log[1].content == "Write one sentence about France."
    assert datum.extra_env_info == {"keyword": "paris"} and datum.task_name == "keyword"
    (plain,) = make_datums(RolloutsConfig(env={"name": "keyword", "system_prompt": ""}), tokenizer, rows)
    assert [m.role for m in plain.message_log] == ["user"]
    with pytest.raises(ValueError, match=r"row 0: KeyError: 'keyword'"):  # the adapter's refusal names the row
        make_datums(RolloutsConfig(env={"name": "keyword"}), tokenizer, [{"topic": "x"}])


def test_the_registries_name_what_is_known(doc_namespace) -> None:
    with pytest.raises(ConfigError, match=r"backend: Value error, unknown backend 'nope'; known: canned, hf, vllm"):
        load_config(None, ["backend=nope"], PolicyConfig)
    PolicyConfig(backend="canned")  # a registered backend validates
    assert doc_namespace["KeywordEnvironment"] is registry.environment_entry("keyword").cls


def test_the_documented_backend_owns_its_settings_section(doc_namespace) -> None:
    assert backends.backend_entry("canned").settings is doc_namespace["CannedSettings"]
    assert PolicyConfig(backend="canned").canned.text == doc_namespace["CANNED_TEXT"]
    assert load_config(None, ["backend=canned", "canned.text=Hi"], PolicyConfig).canned.text == "Hi"
    with pytest.raises(ConfigError, match=r"canned.txt: Extra inputs are not permitted"):
        load_config(None, ["backend=canned", "canned.txt=Hi"], PolicyConfig)


def test_rows_of_a_registered_adapter_need_no_question_or_answer_keys(doc_namespace, tmp_path) -> None:
    """The eval and GRPO read a dataset with `load_rollout_rows`: the default adapter's keys are required (named
    by file and line before any model loads); rows for an environment with its own adapter are left to it."""
    from nemo_rl_ext.experience.build import load_rollout_rows
    from nemo_rl_ext.experience.config import RolloutsConfig
    from nemo_rl_ext.experience.input_checks import dataset_problems

    data = tmp_path / "topics.jsonl"
    data.write_text('{"topic": "France", "keyword": "paris"}\n{"topic": "Japan", "keyword": "tokyo"}\n')
    keyword = RolloutsConfig(env={"name": "keyword"})
    assert [r["topic"] for r in load_rollout_rows(keyword, data)] == ["France", "Japan"]
    assert dataset_problems("eval.dataset_path", data, keyword, counts=2, counts_key="n") == []
    with pytest.raises(ValueError, match=r"topics.jsonl: 2 bad row\(s\):[\s\S]*line 1: missing key\(s\) \['question', 'answer'\]"):
        load_rollout_rows(RolloutsConfig(env={"name": "math"}), data)
    (problem,) = dataset_problems("eval.dataset_path", data, RolloutsConfig(env={"name": "math"}), counts=2,
                                  counts_key="n")
    assert problem.startswith("eval.dataset_path: ") and "line 2: missing key(s) ['question', 'answer']" in problem
