"""The checks of on-policy distillation before any model loads: every agent has a teacher (under
`strict_agent_name_match`), each teacher exists, speaks the student's tokenizer (vocabulary, special and chat
template ids) and, over HTTP, answers `/health` and returns prompt logprobs. Each problem is one line naming
the teacher."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import httpx

from nemo_rl_ext.distillation.config import DistillationSettings
from nemo_rl_ext.distillation.http_teacher import parse_scores, root_url, scoring_body
from nemo_rl_ext.distillation.teacher import TeacherError
from nemo_rl_ext.distillation.teachers import is_url, teacher_specs, unmapped_problem

PROBE_CONVERSATION = [{"role": "system", "content": "You are a helpful assistant."},
                      {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]
"""A conversation rendered with the student's chat template: its ids are the template's ids a teacher must share."""
MAX_LISTED = 8
"""Most differing ids an error lists (then how many more)."""


def rendered_ids(tokenizer: Any) -> list[int]:
    """The ids of `PROBE_CONVERSATION` rendered with the tokenizer's chat template."""
    rendered = tokenizer.apply_chat_template(PROBE_CONVERSATION, tokenize=True, add_generation_prompt=False)
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def probe_ids(tokenizer: Any, samples: int = 64) -> list[int]:
    """Ids a teacher must spell as the student does: the chat template's rendering of `PROBE_CONVERSATION`,
    every special id, and `samples` ids spread over the whole vocabulary (its last id included)."""
    size = len(tokenizer)
    spread = sorted({size * i // samples for i in range(samples)} | {size - 1})
    return list(dict.fromkeys([*rendered_ids(tokenizer), *tokenizer.all_special_ids, *spread]))


def _listed(ids: list[int]) -> str:
    shown = ", ".join(map(str, ids[:MAX_LISTED]))
    return shown + (f" and {len(ids) - MAX_LISTED} more" if len(ids) > MAX_LISTED else "")


def tokenizer_problem(name: str, student: Any, teacher: Any) -> str | None:
    """Why teacher `name`'s tokenizer cannot score the student's ids (another vocabulary size, ids spelled
    otherwise, other special or chat-template ids; naming the ids), or None."""
    problems = []
    if len(student) != len(teacher):
        problems.append(f"vocabulary of {len(teacher)} ids, the student's has {len(student)}")
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    differ = sorted(i for tok, i in s_vocab.items() if t_vocab.get(tok) != i)
    if differ:
        problems.append(f"ids spelled otherwise: {_listed(differ)}")
    specials = {k: (getattr(student, k), getattr(teacher, k)) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    problems += [f"{k} {t} (the student's: {s})" for k, (s, t) in specials.items() if s != t]
    s_special, t_special = sorted(student.all_special_ids), sorted(teacher.all_special_ids)
    if s_special != t_special:
        problems.append(f"special ids {_listed(t_special)} (the student's: {_listed(s_special)})")
    s_ids, t_ids = rendered_ids(student), rendered_ids(teacher)
    if s_ids != t_ids:
        at = next((i for i, (a, b) in enumerate(zip(s_ids, t_ids, strict=False)) if a != b), min(len(s_ids), len(t_ids)))
        problems.append(f"its chat template renders ids {_listed(t_ids[at:])} from position {at} where the "
                        f"student's renders {_listed(s_ids[at:])}")
    if not problems:
        return None
    return f"on_policy_distillation: teacher {name!r} does not share the student's tokenizer: " + "; ".join(problems)


def http_teacher_problem(url: str, student: Any, timeout_s: float) -> str | None:
    """Why the teacher at `url` cannot serve (its `/health` does not answer, it returns no prompt logprobs, or
    it spells the student's probe ids otherwise: another tokenizer), or None."""
    root = root_url(url)
    try:
        health = httpx.get(root + "/health", timeout=timeout_s)
        if health.status_code != 200:
            return f"on_policy_distillation: teacher {url!r}: GET /health answered HTTP {health.status_code}"
    except httpx.HTTPError as exc:
        return f"on_policy_distillation: teacher {url!r}: GET /health did not answer ({type(exc).__name__}: {exc})"
    ids = probe_ids(student)
    try:
        answer = httpx.post(root + "/v1/completions", json=scoring_body([ids], 0, as_token_ids=False),
                            timeout=timeout_s)
        if answer.status_code != 200:
            return (f"on_policy_distillation: teacher {url!r} refused to score the student's token ids (HTTP "
                    f"{answer.status_code}: {answer.text[:300]}): another tokenizer, or no prompt logprobs")
        logprobs = (answer.json().get("choices") or [{}])[0].get("logprobs") or {}
        answered = httpx.post(root + "/v1/completions", json=scoring_body([ids], 1), timeout=timeout_s)
        parse_scores(answered.json(), [ids], 1)
    except (httpx.HTTPError, ValueError, TeacherError) as exc:
        return (f"on_policy_distillation: teacher {url!r} does not return prompt logprobs for token ids "
                f"(/v1/completions with echo, max_tokens 0, logprobs): {exc}")
    spelled = [student.decode([i], skip_special_tokens=False) for i in ids]
    differ = [i for i, want, got in zip(ids, spelled, logprobs.get("tokens") or [], strict=False) if want != got]
    if differ or len(logprobs.get("tokens") or []) != len(ids):
        return (f"on_policy_distillation: teacher {url!r} does not share the student's tokenizer: ids spelled "
                f"otherwise: {_listed(differ) or 'the answer has another length'}")
    return None


def distillation_problems(settings: DistillationSettings, agents: Iterable[str], student: Any = None) -> list[str]:
    """Every problem of `settings` for a run over `agents`, with the student's tokenizer `student` (None: the
    tokenizer and server checks are skipped): unmapped agents, missing or mismatched teachers."""
    if not settings.enabled:
        return []
    problems = [p for p in (unmapped_problem(settings, agents),) if p is not None]
    for spec in teacher_specs(settings):
        problems += [p for p in (_teacher_problem(spec, settings, student),) if p is not None]
    return problems


def _teacher_problem(spec: str, settings: DistillationSettings, student: Any) -> str | None:
    if is_url(spec):
        return None if student is None else http_teacher_problem(spec, student, settings.health_timeout_s)
    # local: models.policy may build a built-in model's folder; only for a local teacher
    from nemo_rl_ext.models.config import PolicyConfig
    from nemo_rl_ext.models.loading import load_tokenizer
    from nemo_rl_ext.models.policy import resolve_model_path

    folder_problem = PolicyConfig(model_name=spec).model_folder_problem()
    if folder_problem is not None:
        return f"on_policy_distillation: teacher {spec!r}: " + folder_problem.replace("policy.model_name=", "")
    if student is None:
        return None
    return tokenizer_problem(spec, student, load_tokenizer(resolve_model_path(PolicyConfig(model_name=spec))))
