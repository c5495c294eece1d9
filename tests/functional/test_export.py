"""`run_grpo.py export RUN_DIR`: a GRPO run's checkpoint as a Hugging Face folder that transformers reloads with the
trainer's logprobs, that `run_eval.py policy.model_name=DIR` evaluates, whose tokenizer keeps its chat template;
and its user errors (one `error:` line, exit 2), its fall-back past a damaged checkpoint and its atomic write.

The run: 2 GRPO steps of the tiny Qwen2 on the say-"yes" task (CPU, in-process, a checkpoint after each step).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from child_env import one_thread_env
from script_main import script_main
from test_cli_errors import assert_one_message
from tolerances import SAME_MODEL_LOGPROBS

from nemo_rl_ext.config import load_config
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.grpo.loop import GRPO
from nemo_rl_ext.models.loading import load_tokenizer
from nemo_rl_ext.objectives.loss import CompletionTensors
from nemo_rl_ext.training import export as export_module
from nemo_rl_ext.training.checkpoint import checkpoint_dir, load_checkpoint, save_checkpoint
from nemo_rl_ext.training.export import ExportError, export_checkpoint
from nemo_rl_ext.training.lora import peft_reads_a_deprecated_alias
from nemo_rl_ext.training.sharded_checkpoint import save_trained_state

REPO = Path(__file__).resolve().parents[2]
TEMPERATURE = 0.7
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def export_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "examples" / "run_grpo.py"), "export", *map(str, args)],
                          cwd=REPO, env=one_thread_env(), capture_output=True, text=True, timeout=120)


def export_main(capsys: pytest.CaptureFixture[str], *args: str | Path) -> subprocess.CompletedProcess[str]:
    """`run_grpo.py export ARGS` through the script's `main` in this process (`script_main`): a user error's message
    is the property, and each `export_cli` process spends seconds on its imports first."""
    return script_main(capsys, "run_grpo.py", "export", *args)


def chat_items(tokenizer: Any) -> list[CompletionTensors]:
    """Chat prompts with a reply each: the loss mask on the reply (the tokens the trainer scores)."""
    items = []
    for question, reply in [("Say yes. apple", "yes"), ("Say yes. river", "no, maybe yes"), ("Hi", "hello there")]:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"]
        answer = tokenizer(reply + "<|im_end|>", add_special_tokens=False)["input_ids"]
        ids = torch.tensor(list(prompt) + list(answer), dtype=torch.int64)
        mask = torch.cat([torch.zeros(len(prompt)), torch.ones(len(answer))])
        items.append(CompletionTensors(token_ids=ids, loss_mask=mask, generation_logprobs=torch.zeros(len(ids))))
    return items


def _train(folder: Path, model_dir: Path, *overrides: str) -> dict[str, Any]:
    """A 2-step GRPO run in `folder/run` (checkpoints of steps 1 and 2) and what its trainer said at the end; the
    same final state also written as a sharded checkpoint (what FSDP2 ranks write; here one process writes one
    shard) in `folder/sharded`."""
    data = folder / "say_yes.jsonl"
    data.write_text("".join(json.dumps({"question": f"Say yes. {w}", "answer": "yes"}) + "\n"
                            for w in ("apple", "river", "blue", "seven")))
    cfg = {
        "policy": {"model_name": str(model_dir), "max_model_len": 256,
                   "generation": {"max_new_tokens": 8, "temperature": TEMPERATURE, "stop_strings": ["yes"]}},
        "rollouts": {"num_generations_per_prompt": 8, "max_seq_len": 128,
                     "env": {"name": "string_match", "kwargs": {"mode": "similarity"}}},
        "data": {"train_path": str(data)},
        "grpo": {"num_prompts_per_step": 2, "max_num_steps": 2, "seed": 42, "save_period": 1},
        "optimizer": {"lr": 3.0e-3, "micro_batch_size": 16, "max_grad_norm": 1.0},
        "loss": {"kl_coef": 0.0},
        "logger": {"progress": False, "tensorboard_enabled": False, "print_steps": False},
        "keep_last_checkpoints": None,
        "output_dir": str(folder / "run"),
    }
    config = folder / "grpo.yaml"
    config.write_text(yaml.safe_dump(cfg))
    with GRPO(load_config(config, list(overrides), GRPOConfig)) as grpo:
        grpo.run()
        items = chat_items(grpo.tokenizer)
        trained = grpo.trainer.logprobs(items)
        weights = {k: v.clone() for k, v in grpo.trainer.state_dict().items()}
        saved = load_checkpoint(checkpoint_dir(folder / "run" / "checkpoints", 2))
        save_checkpoint(folder / "sharded" / "checkpoints", 2, tokenizer=grpo.tokenizer, data_state=saved.data_state,
                        extra=saved.extra, write_state=lambda f: save_trained_state(f, grpo.trainer.model,
                                                                                    grpo.trainer.optimizer))
    return {"dir": folder / "run", "sharded": folder / "sharded", "model_dir": model_dir, "items": items,
            "trained": trained, "weights": weights}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The full fine-tune's 2-step run (`_train`)."""
    from nemo_rl_ext.models.tiny import build_tiny_model

    folder = tmp_path_factory.mktemp("export_run")
    return _train(folder, build_tiny_model(folder / "tiny", seed=0, initializer_range=0.05))


@pytest.fixture(scope="module")
def lora_run(run: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same 2 steps training LoRA adapters (r 8 on q_proj and v_proj) of the same tiny model."""
    return _train(tmp_path_factory.mktemp("export_lora"), run["model_dir"], "trainer.lora.r=8",
                  "trainer.lora.alpha=16", "trainer.lora.target_modules=[q_proj,v_proj]", "optimizer.lr=1.5e-2")


def reload_logprobs(folder: Path, items: list[CompletionTensors], temperature: float = TEMPERATURE
                    ) -> tuple[list[torch.Tensor], dict]:
    """transformers' own loading and forward pass: log_softmax(logits / T) of each next token, 0 off the mask."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model_logprobs(model, items, temperature), model.state_dict()


def model_logprobs(model: Any, items: list[CompletionTensors], temperature: float = TEMPERATURE) -> list[torch.Tensor]:
    """A model's own forward pass: log_softmax(logits / T) of each next token, 0 off the mask."""
    out = []
    with torch.no_grad():
        for item in items:
            logits = model(input_ids=item.token_ids[None]).logits[0, :-1].float()
            picked = torch.log_softmax(logits / temperature, dim=-1).gather(-1, item.token_ids[1:, None])[:, 0]
            out.append(torch.cat([torch.zeros(1), picked]) * item.loss_mask)
    return out


@pytest.mark.timeout(180)
def test_export_reloads_with_the_trainers_weights_and_logprobs(run: dict[str, Any], tmp_path: Path) -> None:
    proc = export_cli(run["dir"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = run["dir"] / "export" / "step_2"  # the default --out, of the newest checkpoint
    assert f"exported step 2 ({checkpoint_dir(run['dir'] / 'checkpoints', 2)}) to {out}" in proc.stdout
    names = sorted(p.name for p in out.iterdir())
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja"} <= set(names), names
    assert not list(out.parent.glob(".*tmp*"))  # nothing left from the atomic write

    got, state = reload_logprobs(out, run["items"])
    # a copy of the trainer's final weights: the same bits (tied embeddings appear under both names)
    assert set(state) == set(run["weights"]), set(state) ^ set(run["weights"])
    assert all(torch.equal(state[k], v) for k, v in run["weights"].items())
    # the trainer's logprobs (its own path: only the scored positions through the LM head) from the reloaded folder,
    # to float rounding: the two paths run other shapes
    for mine, theirs, item in zip(got, run["trained"], run["items"], strict=True):
        assert item.loss_mask.sum() > 0
        torch.testing.assert_close(mine, theirs, rtol=SAME_MODEL_LOGPROBS["rtol"], atol=SAME_MODEL_LOGPROBS["atol"])
    # and the step-2 weights are not the initial model's: training moved these logprobs far beyond that tolerance
    initial, _ = reload_logprobs(run["model_dir"], run["items"])
    assert max(float((a - b).abs().max()) for a, b in zip(initial, got, strict=True)) > 1e-3


@pytest.mark.timeout(60)
def test_export_keeps_the_tokenizer_and_its_chat_template(run: dict[str, Any], tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    result = export_checkpoint(run["dir"], step=1, out=tmp_path / "hf")
    assert result.step == 1 and result.out == tmp_path / "hf"
    exported, original = AutoTokenizer.from_pretrained(result.out), load_tokenizer(run["model_dir"])
    assert exported.chat_template and exported.chat_template == original.chat_template
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say yes."},
            {"role": "assistant", "content": "yes"}, {"role": "user", "content": "Again ünïcode 7+5"}]
    render = {"add_generation_prompt": True, "tokenize": True, "return_dict": True}
    assert (exported.apply_chat_template(chat, **render)["input_ids"]
            == original.apply_chat_template(chat, **render)["input_ids"])
    assert (exported.eos_token, exported.pad_token) == (original.eos_token, original.pad_token)


@pytest.mark.timeout(180)
def test_run_eval_evaluates_the_exported_folder(run: dict[str, Any], tmp_path: Path) -> None:
    out = export_checkpoint(run["dir"], out=tmp_path / "hf").out
    save = tmp_path / "eval"
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "run_eval.py"), "--config", "examples/configs/evals/eval.yaml",
         f"policy.model_name={out}", "eval.num_prompts=3", "eval.ks=[1,2]", "rollouts.num_generations_per_prompt=2",
         "policy.generation.max_new_tokens=4", f"eval.save_path={save}", "--no-progress"],
        cwd=REPO, env=one_thread_env(), capture_output=True, text=True, timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((save / "summary.json").read_text())
    lines = [json.loads(line) for line in (save / "completions.jsonl").read_text().splitlines()]
    assert len(lines) == 6, len(lines)  # 3 prompts x 2 samples, every one rolled out
    assert str(out) in (save / "config.yaml").read_text()
    assert summary, summary


@pytest.mark.timeout(240)
def test_export_user_errors_are_one_message(run: dict[str, Any], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    # through the CLI: one `error:` line, exit 2, no traceback (a real process once, then its main in-process)
    assert_one_message(export_cli(tmp_path / "nowhere"), f"{tmp_path / 'nowhere'} is not a folder")
    assert_one_message(export_main(capsys, run["dir"], "--step", "7"), "no checkpoint of step 7",
                       "complete checkpoints: [1, 2]")
    assert_one_message(export_main(capsys, run["dir"], "--step", "1", "--adapter-only", "--out", tmp_path / "a"),
                       "this run has no adapters")
    assert not (tmp_path / "a").exists()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    assert_one_message(export_main(capsys, run["dir"], "--out", busy), f"--out {busy} already exists", "--force")
    assert (busy / "keep.txt").read_text() == "mine"
    # the other cases in-process (the same ExportError the CLI prints)
    with pytest.raises(ExportError, match="holds no complete checkpoint"):
        export_checkpoint(tmp_path)
    for inside in (run["dir"], run["dir"] / "checkpoints" / "step_00000002" / "hf"):  # --force would delete them
        with pytest.raises(ExportError, match="would overwrite the run's checkpoints"):
            export_checkpoint(run["dir"], out=inside, force=True)
    assert (checkpoint_dir(run["dir"] / "checkpoints", 2) / "complete.json").is_file()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="is a file"):
        export_checkpoint(run["dir"], out=tmp_path / "file", force=True)
    export_checkpoint(run["dir"], step=1, out=busy, force=True)  # replaced as a whole
    assert not (busy / "keep.txt").exists() and (busy / "model.safetensors").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    export_checkpoint(run["dir"], out=empty)  # an empty folder is not in the way
    assert (empty / "config.json").is_file()


@pytest.mark.timeout(120)
def test_a_damaged_checkpoint_falls_back_unless_its_step_is_named(run: dict[str, Any], tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    damaged = tmp_path / "run"
    shutil.copytree(run["dir"] / "checkpoints", damaged / "checkpoints")
    weights = checkpoint_dir(damaged / "checkpoints", 2) / "policy" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF  # same size, other contents
    weights.write_bytes(bytes(data))

    proc = export_cli(damaged)  # a real process: the warning reaches its stderr
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exported step 1" in proc.stdout and "sha256 differs" in proc.stderr  # the warning names the file
    assert (damaged / "export" / "step_1" / "model.safetensors").is_file()
    assert_one_message(export_main(capsys, damaged, "--step", "2"), "the checkpoint of step 2 can't be exported",
                       str(weights), "sha256 differs")
    (checkpoint_dir(damaged / "checkpoints", 1) / "complete.json").unlink()
    assert_one_message(export_main(capsys, damaged, "--out", tmp_path / "x"), "no usable checkpoint", str(weights))


def test_an_interrupted_export_leaves_no_folder(run: dict[str, Any], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    copied: list[str] = []

    def copy_then_fail(src: Path, dst: Path) -> None:
        if copied:
            raise KeyboardInterrupt  # the second file: a Ctrl-C mid-export
        copied.append(str(dst))
        shutil.copyfile(src, dst)

    monkeypatch.setattr(export_module.shutil, "copyfile", copy_then_fail)
    with pytest.raises(KeyboardInterrupt):
        export_checkpoint(run["dir"], out=tmp_path / "hf")
    assert copied and not (tmp_path / "hf").exists()
    assert list(tmp_path.iterdir()) == []  # the temporary folder went too
    monkeypatch.undo()
    with pytest.raises(ExportError, match="this run has no adapters"):
        export_checkpoint(run["dir"], adapter_only=True, out=tmp_path / "hf")


@pytest.mark.timeout(120)
def test_a_sharded_checkpoint_exports_as_the_same_model(run: dict[str, Any], tmp_path: Path) -> None:
    """The run's final state written as shards exports as the Hugging Face folder one process wrote: the same files,
    the weights equal to the bit (consolidating copies them), the same config."""
    from safetensors.torch import load_file

    copied = export_checkpoint(run["dir"], out=tmp_path / "copied")
    consolidated = export_checkpoint(run["sharded"], out=tmp_path / "consolidated")
    assert consolidated.files == copied.files, set(consolidated.files) ^ set(copied.files)
    a, b = load_file(copied.out / "model.safetensors"), load_file(consolidated.out / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((copied.out / "config.json").read_text()) == json.loads((consolidated.out / "config.json").read_text())
    for name in copied.files:
        if name not in ("model.safetensors", "config.json"):  # the tokenizer and generation config: copies
            assert (copied.out / name).read_bytes() == (consolidated.out / name).read_bytes(), name


@pytest.mark.timeout(240)
def test_lora_exports_merged_or_as_its_adapters_with_the_trainers_logprobs(lora_run: dict[str, Any],
                                                                           tmp_path: Path) -> None:
    """Of either checkpoint format: the merged model (transformers alone reloads it) and the adapter folder (peft
    loads it on the base model) both give the trainer's logprobs; the merged weights are the refit's."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    items, trained = lora_run["items"], lora_run["trained"]
    initial = model_logprobs(AutoModelForCausalLM.from_pretrained(lora_run["model_dir"]).eval(), items)
    assert max(float((a - b).abs().max()) for a, b in zip(initial, trained, strict=True)) > 1e-3  # the adapters moved
    adapter_files = {}
    for source in ("dir", "sharded"):
        merged = export_checkpoint(lora_run[source], out=tmp_path / source / "merged")
        assert "model.safetensors" in merged.files and "chat_template.jinja" in merged.files
        assert not [f for f in merged.files if f.startswith("adapter")], merged.files
        got, state = reload_logprobs(merged.out, items)
        # W + (alpha / r) B A: peft's merge and the refit's merge, the same arithmetic on the same tensors
        for name, value in lora_run["weights"].items():
            torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7, msg=name)
        for mine, theirs in zip(got, trained, strict=True):  # merged weights against the adapters' separate matmul
            torch.testing.assert_close(mine, theirs, **SAME_MODEL_LOGPROBS)

        adapters = export_checkpoint(lora_run[source], out=tmp_path / source / "adapters", adapter_only=True)
        assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json", "chat_template.jinja"
                } <= set(adapters.files) and "model.safetensors" not in adapters.files, adapters.files
        config = json.loads((adapters.out / "adapter_config.json").read_text())
        assert Path(config["base_model_name_or_path"]) == lora_run["model_dir"]  # the run's policy.model_name
        base = AutoModelForCausalLM.from_pretrained(lora_run["model_dir"], dtype=torch.float32)
        with peft_reads_a_deprecated_alias():  # peft 0.21.2's own FutureWarning (see lora.py)
            peft_model = PeftModel.from_pretrained(base, adapters.out).eval()
        for mine, theirs in zip(model_logprobs(peft_model, items), trained, strict=True):
            torch.testing.assert_close(mine, theirs, **SAME_MODEL_LOGPROBS)
        adapter_files[source] = load_file(adapters.out / "adapter_model.safetensors")
    one, sharded = adapter_files["dir"], adapter_files["sharded"]
    assert one.keys() == sharded.keys() and all(torch.equal(one[k], sharded[k]) for k in one)  # the same adapters


@pytest.mark.timeout(300)
def test_run_eval_loads_a_lora_checkpoints_policy_folder_and_its_adapter_export_as_the_merged_model(
        lora_run: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`policy.model_name=<step>/policy` of the one-process LoRA run and its `--adapter-only` export (before: exit 2,
    "neither 'smollm2' nor 'tiny' nor a model folder with config.json") load as the base model with the adapters
    merged, the very weights of the merged export (peft's merge of the same float32 tensors): the eval's greedy
    completions are those of the merged export, token for token."""
    from safetensors.torch import load_file

    from nemo_rl_ext.models.config import PolicyConfig
    from nemo_rl_ext.models.policy import resolve_model_path

    monkeypatch.setenv("NEMO_RL_EXT_CACHE", str(tmp_path / "cache"))  # the merged folders land there
    policy = checkpoint_dir(lora_run["dir"] / "checkpoints", 2) / "policy"
    merged = export_checkpoint(lora_run["dir"], step=2, out=tmp_path / "merged").out
    adapters = export_checkpoint(lora_run["dir"], step=2, out=tmp_path / "adapters", adapter_only=True).out
    exported = load_file(merged / "model.safetensors")
    for folder in (policy, adapters):
        weights = load_file(resolve_model_path(PolicyConfig(model_name=str(folder))) / "model.safetensors")
        assert weights.keys() == exported.keys() and all(torch.equal(weights[k], exported[k]) for k in weights), folder

    completions = {}
    for name, folder in (("merged", merged), ("policy", policy), ("adapters", adapters)):
        save = tmp_path / f"eval_{name}"
        proc = script_main(capsys, "run_eval.py", "--config", REPO / "examples/configs/evals/eval.yaml",
                           f"policy.model_name={folder}", "eval.num_prompts=3", "eval.ks=[1]",
                           "rollouts.num_generations_per_prompt=1", "policy.generation.max_new_tokens=8",
                           "policy.generation.temperature=0.0", "eval.save_token_ids=true", f"eval.save_path={save}",
                           "--no-progress")
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        lines = [json.loads(line) for line in (save / "completions.jsonl").read_text().splitlines()]
        completions[name] = sorted((line["prompt_idx"], [m["token_ids"] for m in line["message_log"]]) for line in lines)
        assert len(lines) == 3, (name, len(lines))
    assert completions["policy"] == completions["merged"] and completions["adapters"] == completions["merged"]
