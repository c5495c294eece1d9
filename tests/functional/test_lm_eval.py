"""lm-evaluation-harness against the policy server (docs/serving.md, "Benchmarks with lm-eval").

The policy server CLI runs in its own process over the session's tiny model; lm-eval (`lm_eval_runs.py`, one
subprocess with a deadline) evaluates small local tasks written here, once through the server
(`local-completions`: loglikelihood and generate_until; `local-chat-completions` with the chat template) and
once with lm-eval's own `hf` backend on the same model folder, and the two must agree:

- Loglikelihoods: both sides compute each continuation token's logprob with a full fp32 forward pass over the
  same weights, on the same machine (the server's prefill scores the echoed prompt; lm-eval's hf backend runs the
  model over context + continuation). The only differences are shapes: the engine batches and pads the
  prefills and shares a prompt's KV cache, lm-eval runs one row. That is `SAME_MODEL_LOGPROBS`' case, per token
  |d| <= rtol |v| + atol. lm-eval sums the n continuation tokens' logprobs, all <= 0, so the sums may differ by
  at most rtol |sum| + n atol (the float32 rounding of hf's own sum, n ulps of |sum|, is far inside).
- Greedy generations: the two sides run different kernels (the engine's batched KV-cache decode against
  `transformers` `generate`), so their logits differ by rounding and bit-identical tokens are not given by
  construction. They are by the margins: the test first checks, with plain forward passes, that at every
  greedy step the best logit beats the second by more than twice `GREEDY_LOGIT_SLACK` (the rounding either side
  may add); then both sides must pick the same token at every step, and their texts must be identical (and
  equal to that reference greedy text, cut at the first stop string).

The stop strings are taken from the model's own greedy texts, so `until` lists (lm-eval's `stop`) really cut
generations; one choice per question is the model's greedy next token, so `is_greedy` is exercised too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from backend_checks import GREEDY_LOGIT_SLACK
from policy_server_cli import policy_server_cli
from tolerances import SAME_MODEL_LOGPROBS

pytest.importorskip("lm_eval", reason="lm-eval is the lmeval extra (make setup installs it)")

REPO = Path(__file__).resolve().parents[2]
QUESTIONS = [(2, 3), (7, 5), (11, 4), (9, 9), (1, 30)]
MAX_GEN_TOKS = 10
MAX_MODEL_LEN = 1024
"""The server's context length, and lm-eval's `max_length` (docs/serving.md says to pass it)."""
DEADLINE_S = 300
"""lm-eval's four evaluations together (about 15 s on an idle 2-core machine)."""


def context(a: int, b: int) -> str:
    return f"Question: What is {a} + {b}?\nAnswer:"


def chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def greedy(model, ids: list[int], steps: int, eos: int) -> list[int]:
    """The greedy continuation of `ids` by plain forward passes (up to EOS); asserts that each step's best
    logit beats the second by more than the rounding either side may add, so any correct greedy decoder picks
    these tokens."""
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids + out])).logits[0, -1].float()
        top2 = logits.topk(2).values
        slack = GREEDY_LOGIT_SLACK * max(abs(float(top2[0])), 1.0)
        assert float(top2[0] - top2[1]) > 2 * slack, f"a near-tie at greedy step {len(out)}: {top2.tolist()}"
        out.append(int(logits.argmax()))
        if out[-1] == eos:
            break
    return out


def stop_from(tokenizer, generated: list[int]) -> str:
    """A stop string that occurs in a greedy text: the first plain word-like token from the 3rd on."""
    for token in generated[2:]:
        text = tokenizer.decode([token]).strip()
        if len(text) >= 2 and text.isascii() and text.isalnum():
            return text
    raise AssertionError(f"no word-like token in {tokenizer.decode(generated)!r}")


def cut(text: str, until: list[str]) -> str:
    """`text` up to the first occurrence of any stop string (what both sides return)."""
    return text[: min([text.find(s) for s in until if s in text] or [len(text)])]


def write_tasks(folder: Path, model, tokenizer) -> dict:
    """The task YAMLs and their data; returns the reference greedy texts per task and doc (each task's stop
    strings cut at least two of them)."""
    eos = tokenizer.eos_token_id
    plain = [greedy(model, tokenizer(context(a, b))["input_ids"], MAX_GEN_TOKS, eos) for a, b in QUESTIONS]
    chat = [greedy(model, chat_ids(tokenizer, context(a, b)), MAX_GEN_TOKS, eos) for a, b in QUESTIONS]
    rows = [
        {"question": context(a, b), "target": str(a + b),
         # the model's greedy next token first (is_greedy), then two others
         "choices": [tokenizer.decode(plain[i][:1]), f" {a + b}", f" {a * b} apples"]}
        for i, (a, b) in enumerate(QUESTIONS)
    ]
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(folder / "rows.jsonl")}},
            "test_split": "test", "doc_to_text": "{{question}}", "doc_to_target": "target"}
    mc = {"task": "lmeval_mc", **data, "output_type": "multiple_choice", "doc_to_choice": "{{choices}}",
          "doc_to_target": 0, "target_delimiter": "", "metric_list": [{"metric": "acc"}]}
    until = {"plain": [stop_from(tokenizer, plain[0]), stop_from(tokenizer, plain[1]), "\n\n"],
             "chat": [stop_from(tokenizer, chat[0]), stop_from(tokenizer, chat[1]), "\n\n"]}
    for name, stops in until.items():
        gen = {"task": f"lmeval_{name}_gen", **data, "output_type": "generate_until",
               "generation_kwargs": {"until": stops, "max_gen_toks": MAX_GEN_TOKS, "do_sample": False},
               "metric_list": [{"metric": "exact_match"}]}
        (folder / f"{name}_gen.yaml").write_text(json.dumps(gen))  # JSON is YAML
    (folder / "mc.yaml").write_text(json.dumps(mc))
    decode = lambda ids: tokenizer.decode([t for t in ids if t != eos], skip_special_tokens=True)  # noqa: E731
    reference = {}
    for task, stops, generated in (("lmeval_plain_gen", until["plain"], plain), ("lmeval_chat_gen", until["chat"], chat)):
        texts = [decode(g) for g in generated]
        reference[task] = [cut(t, stops) for t in texts]
        assert sum(c != t for c, t in zip(reference[task], texts, strict=True)) >= 2, (task, texts, stops)
    return reference


def run_lm_eval(tmp_path: Path, url: str, model_dir: Path) -> dict:
    """lm-eval's four evaluations (server and hf, completions and chat) in one subprocess with a deadline."""
    hf = f"pretrained={model_dir},dtype=float32"
    runs = {
        "server": {"model": "local-completions", "tasks": ["lmeval_mc", "lmeval_plain_gen"],
                   "model_args": f"model=tiny,base_url={url}/completions,tokenizer={model_dir},"
                                 f"tokenizer_backend=huggingface,num_concurrent=4,max_length={MAX_MODEL_LEN}"},
        "hf": {"model": "hf", "model_args": hf, "tasks": ["lmeval_mc", "lmeval_plain_gen"]},
        "server_chat": {"model": "local-chat-completions", "tasks": ["lmeval_chat_gen"], "apply_chat_template": True,
                        "model_args": f"model=tiny,base_url={url}/chat/completions,num_concurrent=4"},
        "hf_chat": {"model": "hf", "model_args": hf, "tasks": ["lmeval_chat_gen"], "apply_chat_template": True},
    }
    spec, out = tmp_path / "spec.json", tmp_path / "answers.json"
    spec.write_text(json.dumps({"include_path": str(tmp_path / "tasks"), "runs": runs}))
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets_cache"), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("lm_eval_runs.py")), str(spec), str(out)],
                          env=env, capture_output=True, text=True, timeout=DEADLINE_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_lm_eval_through_the_policy_server_equals_lm_evals_hf_backend(
    tmp_path, tiny_model_dir, tiny_model_and_tokenizer, one_torch_thread
):
    model, tokenizer = tiny_model_and_tokenizer
    (tmp_path / "tasks").mkdir()
    reference = write_tasks(tmp_path / "tasks", model, tokenizer)
    cmd = [sys.executable, "-m", "nemo_rl_ext.serving.policy_server", "--model", str(tiny_model_dir), "--port", "0",
           "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "tiny",
           "--log-level", "info"]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    with policy_server_cli(cmd, cwd=REPO, env=env, start_s=120, stop_s=60) as url:
        answers = run_lm_eval(tmp_path, url, tiny_model_dir)

    server, hf = answers["server"]["lmeval_mc"], answers["hf"]["lmeval_mc"]
    assert sorted(server) == sorted(hf) == [str(i) for i in range(len(QUESTIONS))]
    rows = [json.loads(line) for line in (tmp_path / "tasks" / "rows.jsonl").read_text().splitlines()]
    rtol, atol = SAME_MODEL_LOGPROBS["rtol"], SAME_MODEL_LOGPROBS["atol"]
    greedy_flags = []
    for doc, row in enumerate(rows):
        ctx_len = len(tokenizer(row["question"])["input_ids"])
        for choice, ours, theirs in zip(row["choices"], server[str(doc)], hf[str(doc)], strict=True):
            (ll, is_greedy), (hf_ll, hf_greedy) = ours[0], theirs[0]
            n = len(tokenizer(row["question"] + choice)["input_ids"]) - ctx_len  # continuation tokens
            tolerance = rtol * abs(float(hf_ll)) + max(n, 1) * atol
            assert abs(float(ll) - float(hf_ll)) <= tolerance, (doc, choice, ll, hf_ll, tolerance)
            assert is_greedy == hf_greedy, (doc, choice, is_greedy, hf_greedy)
            greedy_flags.append(is_greedy in (True, "True"))
    assert sum(greedy_flags) >= len(QUESTIONS), greedy_flags  # each question's first choice is the greedy token

    for side, task in (("", "lmeval_plain_gen"), ("_chat", "lmeval_chat_gen")):
        ours, theirs = answers[f"server{side}"][task], answers[f"hf{side}"][task]
        texts = [ours[str(i)][0][0] for i in range(len(QUESTIONS))]
        assert texts == [theirs[str(i)][0][0] for i in range(len(QUESTIONS))], task
        assert texts == reference[task], task  # the greedy texts, cut at the first stop string (2 or more are)
