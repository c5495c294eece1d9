"""The GRPO loop: prompts -> RolloutManager groups -> advantages -> policy update -> new weights to the engine.

    with GRPO(load_config(path, overrides, GRPOConfig)) as grpo:
        history = grpo.run()

One step: `num_prompts_per_step` rows from the seeded prompt stream go through `RolloutManager.run_rollouts`
(the only way rollouts are made; the rollout mode only changes how the manager is built); with dynamic
sampling, groups whose rewards are all equal are dropped and more rows are rolled out, up to
`max_gen_batches` batches. Group-relative advantages feed `PolicyTrainer.train_step` (micro-batched, global
normalization, grad clipping); then `update_weights(trainer.state_dict())` refits the generation backend,
which holds its own copy of the model. Validation runs every `val_period` steps through the eval metrics;
metrics go to `metrics.jsonl` (and TensorBoard); checkpoints every `save_period` steps make `resume` exact.
`build` checks the inputs and the checkpoint to resume and builds the policy's parts (tokenizer, trainer,
reference, engine) before the loop starts.

Sampling seeds: every rollout request is seeded (policy.generation.seed, else grpo.seed, then per prompt,
sample and turn by the rollout implementation), and the backend mixes in the step and rollout-batch number
(`SaltedGeneration`), so each step samples afresh and a resumed run replays the same draws.

Asynchronous GRPO (`grpo.async.enabled`, `_run_async` and `async_loop.AsyncLoop`): `AsyncCollector` keeps
groups in flight while the trainer trains and refits on a worker thread; each trained group is at most
`grpo.async.max_lag` policy versions behind (see `staleness` and `async_collector`). With `max_lag: 0` it is the synchronous loop.

Stopping (`run` runs inside `stopping.LoopStop`): the first SIGTERM / Ctrl-C cuts a wait for rollouts
or validation at once, but never a training step (it updates weights and optimizer state, on a thread in
the asynchronous loop); the run then checkpoints its last whole step (the data position of that step's
end, or, asynchronously, with the rows drawn and not trained listed as skipped) and raises
`KeyboardInterrupt`. So a stopped run is resumable whatever `save_period` is. `grpo.stop_timeout_s` bounds
the wait; a second signal stops at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from tqdm.auto import tqdm

from nemo_rl_ext.cluster import loads_model_folder
from nemo_rl_ext.config import ConfigError, dump_config
from nemo_rl_ext.data.records import DatumSpec, PromptGroupRecord
from nemo_rl_ext.environments.interfaces import EnvironmentInterface
from nemo_rl_ext.evals.metrics import aggregate_eval_metrics, prompt_samples_from_record
from nemo_rl_ext.experience.build import build_rollouts
from nemo_rl_ext.experience.prompt_length import PromptLengthWarning, count_prompts_too_long
from nemo_rl_ext.experience.rollout_manager import batch_metrics
from nemo_rl_ext.grpo.async_loop import AsyncLoop
from nemo_rl_ext.grpo.batch import (
    TrainingBatch,
    build_training_batch,
    has_signal,
    training_batch_metrics,
)
from nemo_rl_ext.grpo.build import (
    build_policy_parts,
    check_inputs,
    checkpoint_to_resume,
    seed_everything,
    teacher_scorer,
)
from nemo_rl_ext.grpo.config import RESTART, GRPOConfig, async_wedge_warning
from nemo_rl_ext.grpo.data_rows import run_sources, training_stream, validation_datums
from nemo_rl_ext.grpo.metrics_logger import MetricsLogger
from nemo_rl_ext.grpo.prompt_stream import PromptStream
from nemo_rl_ext.grpo.step_seeds import TRAIN_SALT, VAL_SALT
from nemo_rl_ext.grpo.stopping import LoopStop, Stopped
from nemo_rl_ext.grpo.trackers import sample_rows
from nemo_rl_ext.models.generation.interfaces import GenerationConfig, InFlightPolicy
from nemo_rl_ext.training.checkpoint import Checkpoint, discard_checkpoints, get_rng_state, save_checkpoint
from nemo_rl_ext.training.schedule import scheduled_lr
from nemo_rl_ext.training.state import restore_trainer_state, state_writer, weights_in_model_dir
from nemo_rl_ext.training.streamed_weights import refit_nbytes

logger = logging.getLogger(__name__)
T = TypeVar("T")

GYM_LOGS = "gym"
"""The folder in output_dir where the Gym servers a run launches write env.yaml and their logs (unless
`rollouts.gym.launch.work_dir` names another)."""


def rollout_generation_config(cfg: GRPOConfig) -> GenerationConfig:
    """The sampling parameters of every rollout: `policy.generation` seeded by its own seed, else `grpo.seed`."""
    seed = cfg.policy.generation.seed if cfg.policy.generation.seed is not None else cfg.grpo.seed
    return cfg.policy.generation.model_copy(update={"seed": seed})


def weight_by_loss_multiplier(batch: TrainingBatch, records: Sequence[PromptGroupRecord]) -> TrainingBatch:
    """Scale each completion's loss mask by its group's `loss_multiplier` (NeMo-RL's meaning: 0 leaves the
    group out of the loss and its token count, 1 trains on it as is)."""
    multipliers = [float(r.loss_multiplier) for r in records for _ in r.completions]
    if all(m == 1.0 for m in multipliers):
        return batch
    items = tuple(
        dataclasses.replace(item, loss_mask=item.loss_mask * m)
        for item, m in zip(batch.items, multipliers, strict=True)
    )
    return dataclasses.replace(batch, items=items)


class GRPO:
    """A GRPO run: builds the trainer, the generation backend, the data and the RolloutManager from a config.

    `task_to_env` replaces the configured environment (native mode); `train_datums` / `val_datums`
    replace the data files (e.g. Gym rows). With `cfg.resume`, everything comes back from a checkpoint.
    User errors (missing files, a resume with a changed config, no usable checkpoint) raise `ConfigError`
    before any model is loaded.
    """

    def __init__(
        self,
        cfg: GRPOConfig,
        *,
        task_to_env: Mapping[str, EnvironmentInterface] | None = None,
        train_datums: Sequence[DatumSpec] | None = None,
        val_datums: Sequence[DatumSpec] | None = None,
    ) -> None:
        self.cfg = cfg
        self.output_dir = Path(cfg.output_dir)
        self.checkpoint_root = self.output_dir / "checkpoints"
        check_inputs(cfg, train_datums, val_datums)
        checkpoint = checkpoint_to_resume(cfg, self.output_dir, self.checkpoint_root)
        seed_everything(cfg.grpo.seed)
        parts = build_policy_parts(cfg, checkpoint)
        self.tokenizer, self.trainer, self.generation = parts.tokenizer, parts.trainer, parts.generation
        self._build_data(task_to_env, train_datums, val_datums)

        self.step = 0
        self.schedule_steps = cfg.optimizer.scheduler.total_steps or cfg.grpo.max_num_steps
        """The horizon T of `optimizer.scheduler` (saved in checkpoints: a resumed run keeps its start's)."""
        self.logger = MetricsLogger(self.output_dir, tensorboard=cfg.logger.tensorboard_enabled)
        self._prompt_length_warning = PromptLengthWarning()  # once per run: prompts that leave no room
        if checkpoint is not None:
            self._restore(checkpoint)
        if cfg.resume == RESTART:  # every check passed: now the earlier run's checkpoints go
            discard_checkpoints(self.checkpoint_root)
        self.logger.truncate_after(self.step if checkpoint is not None else -1)  # a fresh run starts empty
        (self.output_dir / "config.yaml").write_text(dump_config(cfg))
        self.logger.start_trackers(cfg.logger, cfg.model_dump(mode="json"), resumed=checkpoint is not None)
        self._samples: list[list[Any]] = []
        """Sampled rollouts of the step in progress (the trackers' table), logged with its metrics."""
        self._runner = asyncio.Runner()
        self._stop: LoopStop | None = None
        """Stopping on a signal, while `run` runs."""
        self._saved_step = self.step if checkpoint is not None else None
        """The step of the newest checkpoint this run wrote or resumed from."""
        self._rng_after_step: dict[str, Any] | None = None
        """The RNG states when the last step ended (what a checkpoint of that step saves)."""

    @property
    def task_to_env(self) -> Mapping[str, EnvironmentInterface] | None:
        """The environments of native rollouts (the given ones, or the one the manager built and owns)."""
        return self.manager.task_to_env

    # ---- set-up helpers -------------------------------------------------------------------------

    def _build_data(self, task_to_env: Mapping[str, EnvironmentInterface] | None,
                    train_datums: Sequence[DatumSpec] | None, val_datums: Sequence[DatumSpec] | None) -> None:
        """The RolloutManager, the seeded training prompt stream and the validation prompts."""
        cfg = self.cfg
        keys = dict(question_key=cfg.data.question_key, answer_key=cfg.data.answer_key)
        validates = val_datums is None and (cfg.grpo.val_period > 0 or cfg.grpo.val_at_start)
        sources = run_sources(cfg, train=train_datums is None, validates=validates)
        single = cfg.data.train_path is not None
        datums, self.manager = build_rollouts(
            cfg.rollouts.with_gym_work_dir(self.output_dir / GYM_LOGS),  # Gym servers it launches log there
            self.tokenizer,
            self.generation,
            sources[0].rows if single else (),
            generation_config=rollout_generation_config(cfg),
            cluster=cfg.policy.cluster,
            task_to_env=task_to_env,
            more_envs=[e.env for e in cfg.data.datasets if e.env is not None],
            # None unless distilling; on the trainer ranks when trainer.workers > 1; the manager closes it
            teachers=teacher_scorer(cfg, self.trainer),
            **keys,
        )
        if train_datums is not None:
            self.train_data = PromptStream(list(train_datums), seed=cfg.grpo.seed, shuffle=cfg.data.shuffle)
        else:
            self.train_data = training_stream(cfg, self.tokenizer, sources, datums if single else None)
        if val_datums is None:
            val_datums = validation_datums(cfg, self.tokenizer, sources)
        self.val_datums = list(val_datums)[: cfg.validation.num_prompts]
        for stream in getattr(self.train_data, "streams", [self.train_data]):
            self.manager.preflight(stream.datums)

    def _restore(self, checkpoint: Checkpoint) -> None:
        """Continue from `checkpoint`: trainer state, engine weights, data position, step and RNG states."""
        restore_trainer_state(self.trainer, checkpoint)
        if loads_model_folder(self.cfg.policy) or not weights_in_model_dir(checkpoint):  # the engine has the initial model
            self._refit(in_flight="finish")
        try:
            self.train_data.load_state_dict(checkpoint.data_state)
        except ValueError as exc:
            raise ConfigError(f"cannot resume {checkpoint.path}: {exc}") from None
        self.step = checkpoint.step
        self.schedule_steps = int(checkpoint.extra.get("schedule_steps", self.schedule_steps))
        if self.cfg.optimizer.scheduler.type != "constant" and self.cfg.grpo.max_num_steps > self.schedule_steps:
            logger.warning("optimizer.scheduler: the run's schedule ends at step %d (its horizon when it started); "
                           "steps %d to %d (grpo.max_num_steps) train at min_lr", self.schedule_steps,
                           self.schedule_steps + 1, self.cfg.grpo.max_num_steps)
        checkpoint.restore_rng()
        logger.info("resumed from %s at step %d", checkpoint.path, self.step)

    # ---- one step -------------------------------------------------------------------------------

    async def _collect(self, step: int) -> tuple[list[PromptGroupRecord], dict[str, float]]:
        """Roll out this step's prompts (more batches with dynamic sampling); returns the trained groups."""
        settings = self.cfg.grpo
        n, dynamic = settings.num_prompts_per_step, settings.dynamic_sampling
        start = time.perf_counter()
        generated: list[PromptGroupRecord] = []
        kept: list[PromptGroupRecord] = []
        batches = 0
        while batches < (dynamic.max_gen_batches if dynamic.enabled else 1) and len(kept) < n:
            self.generation.salt = (TRAIN_SALT, step, batches)
            records, _ = await self.manager.run_rollouts(self.train_data.next(n), progress=False)
            batches += 1
            generated.extend(records)
            kept.extend(r for r in records if not dynamic.enabled or has_signal(r, settings))
        metrics = batch_metrics(generated, time.perf_counter() - start)
        self._samples = sample_rows(kept[:n], self.cfg.logger.num_sample_rollouts)
        too_long, longest = count_prompts_too_long(generated)
        self._prompt_length_warning(too_long, len(generated), longest)
        if dynamic.enabled:
            metrics["dynamic_sampling/gen_batches"] = float(batches)
            metrics["dynamic_sampling/kept_groups"] = float(min(len(kept), n))
            metrics["dynamic_sampling/zero_variance_fraction"] = 1.0 - len(kept) / len(generated)
        return kept[:n], metrics

    def train_step(self) -> dict[str, float]:
        """Run one GRPO step (rollouts, update, refit) and return its metrics; advances `self.step`."""
        step = self.step + 1
        start = time.perf_counter()
        position = self.train_data.consumed
        try:
            records, metrics = self._runner.run(self._unless_stopped(self._collect(step)))
        except Stopped:  # the step never happened: a resumed run draws its rows again
            self.train_data.consumed = position
            raise
        rollout_done = time.perf_counter()
        self._train_records(records, metrics)
        train_done = time.perf_counter()
        if metrics.get("train/optimizer_steps", 0.0) > 0:
            metrics.update(self._refit(in_flight="finish"))
        refit_done = time.perf_counter()
        self._cluster_metrics(metrics)
        metrics["timing/rollout_s"] = rollout_done - start
        metrics["timing/train_s"] = train_done - rollout_done
        metrics["timing/refit_s"] = refit_done - train_done
        self.step = step
        return metrics

    def _train_records(self, records: Sequence[PromptGroupRecord], metrics: dict[str, float]) -> None:
        """Advantages and one policy update on `records` (none: no optimizer step); adds to `metrics`, `train/lr`
        (the step's scheduled lr) always, so that the lr curve has every step."""
        lr = scheduled_lr(self.cfg.optimizer, self.step + 1, self.schedule_steps)
        if records:
            batch = build_training_batch(
                records,
                baseline=self.cfg.grpo.baseline,
                normalize_std=self.cfg.grpo.normalize_std,
                std_scope=self.cfg.grpo.std_scope,
                overlong_filtering=self.cfg.grpo.overlong_filtering,
                adv_estimator=self.cfg.grpo.adv_estimator,
                reward_weights=self.cfg.grpo.reward_weights,
                minus_baseline=self.cfg.grpo.minus_baseline,
                kl_in_reward=self.cfg.loss.use_kl_in_reward,
            )
            batch = weight_by_loss_multiplier(batch, records)
            metrics.update(training_batch_metrics(batch, records))
            self.trainer.set_lr(lr)
            train_metrics = self.trainer.train_step(batch.items, batch.advantages)
            metrics.update({f"train/{k}": v for k, v in train_metrics.items()})
        else:  # dynamic sampling found no group with reward variance: nothing to learn from
            metrics.update({"train/optimizer_steps": 0.0, "train/lr": lr})

    def _cluster_metrics(self, metrics: dict[str, float]) -> None:
        metrics.update(self.generation.metrics())  # a Ray pool: per-replica counters (cluster/...)
        metrics.update(self.trainer.refit_metrics())  # trainer ranks: bytes and seconds of the last gather

    def validate(self) -> dict[str, float]:
        """Roll out the validation prompts with the current weights; eval metrics under `val/`."""
        return self._runner.run(self._validate())

    async def _validate(self) -> dict[str, float]:
        if not self.val_datums:
            return {}
        start = time.perf_counter()
        salt, self.generation.salt = self.generation.salt, (VAL_SALT,)
        try:  # the training manager (and its servers), another count
            records, rollout = await self.manager.run_rollouts(
                self.val_datums, progress=False, counts=self.cfg.validation.num_generations_per_prompt
            )
        finally:
            self.generation.salt = salt
        metrics = aggregate_eval_metrics([prompt_samples_from_record(r) for r in records], self.cfg.validation.ks)
        metrics.update(rollout)
        out = {f"val/{k}": v for k, v in metrics.items()}
        out["timing/val_s"] = time.perf_counter() - start
        return out

    def save(self, extra: Mapping[str, Any] | None = None) -> Path:
        """Checkpoint the current step (`extra`: more JSON for the checkpoint's state)."""
        path = save_checkpoint(
            self.checkpoint_root,
            self.step,
            tokenizer=self.tokenizer,
            write_state=state_writer(self.trainer),  # FSDP2 ranks: each writes its shards
            data_state=self.train_data.state_dict(),
            extra={"config": self.cfg.model_dump(mode="json"), "schedule_steps": self.schedule_steps,
                   **(extra or {})},
            keep_last=self.cfg.keep_last_checkpoints,
            rng_state=self._rng_after_step,
        )
        self._saved_step = self.step
        return path

    # ---- stopping on a signal -------------------------------------------------------------------

    def _stopping(self) -> bool:
        return self._stop is not None and self._stop.requested

    async def _unless_stopped(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable`; inside `run`, cancel it and raise `Stopped` as soon as a stop is requested."""
        if self._stop is None:
            return await awaitable
        return await self._stop.unless_stopped(awaitable)

    def _validate_unless_stopped(self) -> dict[str, float]:
        try:
            return self._runner.run(self._unless_stopped(self._validate()))
        except Stopped:
            return {}

    # ---- the loop -------------------------------------------------------------------------------

    def run(self) -> list[dict[str, float]]:
        """Train until `grpo.max_num_steps`; returns the metrics of the steps run here (also in metrics.jsonl).

        A SIGTERM or Ctrl-C (main thread) ends it with a checkpoint of the last whole step and
        `KeyboardInterrupt` (see the module docstring)."""
        settings, log_cfg = self.cfg.grpo, self.cfg.logger
        history: list[dict[str, float]] = []
        bar = tqdm(total=settings.max_num_steps, initial=self.step, desc="grpo", unit="step",
                   disable=not log_cfg.progress)
        stop = LoopStop(self._runner.get_loop(), timeout_s=settings.stop_timeout_s, name="grpo",
                        what="the training step in progress and its checkpoint")
        with stop:
            self._stop = stop
            try:
                if settings.val_at_start and self.step == 0:
                    metrics = self._validate_unless_stopped()
                    if not stop.requested:
                        self.logger.log(0, metrics)
                        self._print(0, metrics)
                if settings.async_.enabled:
                    self._runner.run(self._run_async(history, bar))
                while self.step < settings.max_num_steps and not stop.requested:
                    start = time.perf_counter()
                    metrics = self.train_step()
                    if self._validates_now():
                        metrics.update(self._validate_unless_stopped())
                    self._end_step(metrics, start, history, bar)
            except Stopped:
                pass
            finally:
                bar.close()
                self._stop = None
            if stop.requested:
                if self.step > 0 and self._saved_step != self.step:
                    self.save()
                if self.step < settings.max_num_steps:
                    logger.info("stopped by a signal after step %d; resume=true continues from its checkpoint",
                                self.step)
                    raise KeyboardInterrupt
        return history

    def _validates_now(self) -> bool:
        period = self.cfg.grpo.val_period
        return bool(period) and (self.step % period == 0 or self.step == self.cfg.grpo.max_num_steps)

    def _end_step(self, metrics: dict[str, float], start: float, history: list[dict[str, float]], bar: Any,
                  checkpoint_extra: Mapping[str, Any] | None = None) -> None:
        """Log, print and (every save_period steps and at the last) checkpoint the step just done."""
        settings = self.cfg.grpo
        metrics["timing/step_s"] = time.perf_counter() - start
        self.logger.log(self.step, metrics)
        self.logger.log_samples(self.step, self._samples)
        self._samples = []
        history.append({"step": self.step, **metrics})
        self._print(self.step, metrics)
        self._rng_after_step = get_rng_state()
        periodic = settings.save_period and (self.step % settings.save_period == 0
                                             or self.step == settings.max_num_steps)
        if periodic or self._stopping():  # a stop request: this step is the one to resume from
            self.save(checkpoint_extra)
        bar.update(1)
        bar.set_postfix(reward=f"{metrics.get('rollout/reward/mean', float('nan')):.3f}")

    async def _run_async(self, history: list[dict[str, float]], bar: Any) -> None:
        """Asynchronous GRPO (`grpo.async`, see `async_collector` and `async_loop`): the collector keeps groups in
        flight while the trainer steps on the groups it hands over and the engine is refitted after every step;
        a stop request checkpoints the last whole step with the rows in flight or waiting as skipped."""
        warning = async_wedge_warning(self.cfg.grpo.async_)
        if warning:
            logger.warning(warning)
        await AsyncLoop(self, history, bar).run()


    def _refit(self, in_flight: InFlightPolicy) -> dict[str, float]:
        """Hand the trainer's weights to the engine; returns `refit/bytes` (of the tensors handed over) and
        `timing/refit/seconds` (building them, a LoRA policy's merge included, and loading them)."""
        start = time.perf_counter()
        # with LoRA only the merged target modules change: an engine that takes a partial update gets them alone
        partial = self.trainer.refit_partial and self.generation.accepts_partial_update
        weights = self.trainer.refit_weights() if partial else self.trainer.state_dict()
        self.generation.update_weights(weights, in_flight=in_flight, partial=partial)
        return {
            "refit/bytes": float(refit_nbytes(weights)),
            "timing/refit/seconds": time.perf_counter() - start,
        }

    def _print(self, step: int, m: Mapping[str, float]) -> None:
        if not self.cfg.logger.print_steps:
            return
        if step == 0:
            line = f"step 0 (before training) | val reward {m.get('val/mean_reward', float('nan')):.3f}"
        else:
            line = (
                f"step {step}/{self.cfg.grpo.max_num_steps} | reward {m['rollout/reward/mean']:.3f} "
                f"| loss {m.get('train/loss', 0.0):+.4f} | grad_norm {m.get('train/grad_norm', 0.0):.3f} "
                f"| gen_kl {m.get('train/gen_kl/mean', 0.0):.2e} "
                f"| rollout {m['timing/rollout_s']:.1f}s train {m['timing/train_s'] + m['timing/refit_s']:.1f}s"
            )
            if "distill/reverse_kl" in m:  # on-policy distillation: how far the student still is from its teacher
                line += f" | distill_kl {m['distill/reverse_kl']:.3f}"
            if "val/mean_reward" in m:
                line += f" | val reward {m['val/mean_reward']:.3f}"
        tqdm.write(line)

    def close(self) -> None:
        """Stop the rollout manager (the servers it started, the environment it built), the generation backend
        and the metrics writer."""
        try:
            self._runner.run(self.manager.shutdown())
        finally:
            try:
                self.generation.shutdown()
            finally:
                self.trainer.close()  # trainer ranks: killed, none left behind
                self._runner.close()
                self.logger.close()

    def __enter__(self) -> GRPO:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def run_grpo(cfg: GRPOConfig, **kwargs: Any) -> list[dict[str, float]]:
    """Build a GRPO run from `cfg`, train it to the end and clean up; returns the step metrics."""
    with GRPO(cfg, **kwargs) as grpo:
        return grpo.run()
